//! The device a model runs on. CPU always; CUDA behind the `cuda` feature.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(i)) => Ok(DeviceKind::Cuda(i)),
                _ => Err(Error::Config(format!(
                    "unknown device `{s}`: expected `cpu`, `cuda` or `cuda:N`"
                ))),
            },
        }
    }
}

impl DeviceKind {
    pub fn candle(&self) -> Result<candle_core::Device> {
        match self {
            DeviceKind::Cpu => Ok(candle_core::Device::Cpu),
            DeviceKind::Cuda(i) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(Error::DeviceUnavailable(self.to_string()));
                }
                // cudarc loads libcuda at first use and panics when it cannot.
                let i = *i;
                // Silence the default hook's message for that expected panic.
                let hook = std::panic::take_hook();
                std::panic::set_hook(Box::new(|_| {}));
                let made = std::panic::catch_unwind(|| candle_core::Device::new_cuda(i));
                std::panic::set_hook(hook);
                match made {
                    Ok(d) => {
                        let d = d?;
                        #[cfg(feature = "cuda")]
                        if let candle_core::Device::Cuda(c) = &d {
                            // Work on kvbench's second stream (InfiniGen's gathers) is
                            // ordered with explicit events; cudarc's per-buffer event
                            // tracking would add a wait and a record to every kernel
                            // argument of every launch once that stream exists.
                            // SAFETY: called before any kvbench buffer is allocated.
                            unsafe { c.disable_event_tracking() };
                        }
                        Ok(d)
                    }
                    Err(_) => Err(Error::Config(format!(
                        "cuda:{i}: the CUDA driver library (libcuda.so.1) could not be \
                         loaded; is there an NVIDIA driver on this machine?"
                    ))),
                }
            }
        }
    }
}

/// Total and free memory of a device in bytes as its driver reports them; `None` on
/// CPU.
pub fn device_memory(d: &candle_core::Device) -> Result<Option<(u64, u64)>> {
    match d {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(c) => Ok(Some(crate::cuda::memory_info(c)?)),
        _ => Ok(None),
    }
}

/// Parse a byte size such as `8GiB`, `512MB`, `1.5GiB` or `1024`.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!("`{s}` is not a size: expected a number with a unit, e.g. 8GiB (bytes without one)")
    })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "kib" | "k" => 1 << 10,
        "mb" => 1_000_000,
        "mib" | "m" => 1 << 20,
        "gb" => 1_000_000_000,
        "gib" | "g" => 1 << 30,
        "tb" => 1_000_000_000_000,
        "tib" | "t" => 1 << 40,
        u => {
            return Err(format!(
                "`{s}`: unknown unit `{u}` (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    if !n.is_finite() || n < 0.0 {
        return Err(format!("`{s}` must be a non-negative size"));
    }
    let bytes = (n * mult as f64).round();
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is more bytes than a 64-bit size holds"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("eight").unwrap_err().contains("eight"));
        assert!(parse_bytes("8 parsecs").unwrap_err().contains("parsecs"));
    }

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse::<DeviceKind>().unwrap(), DeviceKind::Cpu);
        assert_eq!("cuda:1".parse::<DeviceKind>().unwrap(), DeviceKind::Cuda(1));
        assert!("tpu".parse::<DeviceKind>().is_err());
    }
}
