//! Exact bytes by memory component, checked against the device's capacity.
//!
//! Every byte the engine reserves goes through [`MemoryLedger::reserve`], so a CPU run
//! with `--device-memory` fails with the same typed out-of-memory error as a GPU.

use crate::error::{Component, Error, Result};
use crate::kv::KvCodec;
use crate::policy::spec::Reservation;
use serde::Serialize;

/// Snapshot of the ledger (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    pub weights: u64,
    /// Most KV bytes held on the device at once: the whole pool where it is allocated
    /// up front (`full`, or any engine with `reservation=fraction`), what the pool grew
    /// to where it grows on demand (`h2o`, `streaming`, `infinigen` by default).
    pub kv_device: u64,
    /// Most KV bytes held in host memory at once.
    pub kv_host: u64,
    /// Largest activation footprint of any step so far (incl. materialized attention).
    pub activations_peak: u64,
    pub transfer_buffers: u64,
    /// How the device KV was reserved (`fraction`: the pool up front, `budget`: grown
    /// on demand), so that `kv_device` reads as what the engine held; set by the
    /// engine, `None` from a bare ledger.
    pub reservation: Option<Reservation>,
    /// How the paged stores kept their K/V rows (`f32`, `bf16`, `int4`, …); set by the
    /// engine for strategies whose rows the codecs write, `None` for those that keep
    /// their own (InfiniGen's tiers, KIVI's codes) and from a bare ledger.
    pub kv_codec: Option<KvCodec>,
}

impl MemoryReport {
    pub fn device_total(&self) -> u64 {
        self.weights + self.kv_device + self.activations_peak + self.transfer_buffers
    }
}

#[derive(Debug, Clone)]
pub struct MemoryLedger {
    device: String,
    device_capacity: Option<u64>,
    host_capacity: Option<u64>,
    weights: u64,
    kv_device: u64,
    kv_host: u64,
    transfer_buffers: u64,
    activations_now: u64,
    activations_peak: u64,
    kv_device_peak: u64,
    kv_host_peak: u64,
}

impl MemoryLedger {
    pub fn new(device: impl Into<String>, device_capacity: Option<u64>) -> Self {
        Self {
            device: device.into(),
            device_capacity,
            host_capacity: None,
            weights: 0,
            kv_device: 0,
            kv_host: 0,
            transfer_buffers: 0,
            activations_now: 0,
            activations_peak: 0,
            kv_device_peak: 0,
            kv_host_peak: 0,
        }
    }

    pub fn with_host_capacity(mut self, cap: Option<u64>) -> Self {
        self.host_capacity = cap;
        self
    }

    pub fn device_capacity(&self) -> Option<u64> {
        self.device_capacity
    }

    /// Device KV bytes held now.
    pub fn kv_device(&self) -> u64 {
        self.kv_device
    }

    pub fn device_used(&self) -> u64 {
        self.weights + self.kv_device + self.transfer_buffers + self.activations_now
    }

    /// Bytes still free on the device (`u64::MAX` without a capacity).
    pub fn device_free(&self) -> u64 {
        match self.device_capacity {
            Some(c) => c.saturating_sub(self.device_used()),
            None => u64::MAX,
        }
    }

    fn slot(&mut self, c: Component) -> &mut u64 {
        match c {
            Component::Weights => &mut self.weights,
            Component::KvDevice => &mut self.kv_device,
            Component::KvHost => &mut self.kv_host,
            Component::Activations => &mut self.activations_now,
            Component::TransferBuffers => &mut self.transfer_buffers,
        }
    }

    /// Reserve `bytes` for a component, or fail with [`Error::OutOfMemory`].
    pub fn reserve(&mut self, c: Component, bytes: u64) -> Result<()> {
        let (cap, used, dev) = if c == Component::KvHost {
            (self.host_capacity, self.kv_host, "host".to_string())
        } else {
            (
                self.device_capacity,
                self.device_used(),
                self.device.clone(),
            )
        };
        if let Some(cap) = cap {
            let available = cap.saturating_sub(used);
            if bytes > available {
                return Err(Error::OutOfMemory {
                    device: dev,
                    component: c,
                    requested: bytes,
                    available,
                    capacity: cap,
                });
            }
        }
        let now = *self.slot(c) + bytes;
        self.set(c, now);
        Ok(())
    }

    /// Set a component to what a policy holds now (policies that allocate as they go
    /// check their own capacity); KV components keep their peak for the report.
    pub fn set(&mut self, c: Component, bytes: u64) {
        *self.slot(c) = bytes;
        match c {
            Component::KvDevice => self.kv_device_peak = self.kv_device_peak.max(bytes),
            Component::KvHost => self.kv_host_peak = self.kv_host_peak.max(bytes),
            Component::Activations => {
                self.activations_peak = self.activations_peak.max(self.activations_now)
            }
            _ => {}
        }
    }

    pub fn release(&mut self, c: Component, bytes: u64) {
        let s = self.slot(c);
        *s = s.saturating_sub(bytes);
    }

    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            weights: self.weights,
            kv_device: self.kv_device_peak.max(self.kv_device),
            kv_host: self.kv_host_peak.max(self.kv_host),
            activations_peak: self.activations_peak,
            transfer_buffers: self.transfer_buffers,
            reservation: None,
            kv_codec: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_past_capacity_is_a_typed_error() {
        let mut l = MemoryLedger::new("cpu", Some(1000));
        l.reserve(Component::Weights, 600).unwrap();
        let e = l.reserve(Component::KvDevice, 500).unwrap_err();
        match e {
            Error::OutOfMemory {
                requested,
                available,
                capacity,
                component,
                ..
            } => {
                assert_eq!((requested, available, capacity), (500, 400, 1000));
                assert_eq!(component, Component::KvDevice);
            }
            other => panic!("{other}"),
        }
        // Nothing was charged by the failed reservation.
        l.reserve(Component::KvDevice, 400).unwrap();
        assert_eq!(l.device_free(), 0);
    }

    #[test]
    fn activation_peak_survives_release_and_host_has_its_own_capacity() {
        let mut l = MemoryLedger::new("cpu", Some(100)).with_host_capacity(Some(10));
        l.reserve(Component::Activations, 70).unwrap();
        l.release(Component::Activations, 70);
        l.reserve(Component::Activations, 20).unwrap();
        assert_eq!(l.report().activations_peak, 70);
        assert!(l.reserve(Component::KvHost, 11).unwrap_err().is_oom());
        l.reserve(Component::KvHost, 10).unwrap();
        assert_eq!(l.device_used(), 20);
    }
}
