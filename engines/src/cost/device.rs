//! Device descriptions as data: the table shipped in `engines/devices.yaml` (compiled
//! in) and user files of the same shape. Every peak figure is a datasheet number with
//! its source; unknown figures are `null` and stay `None` here.

use super::{CostError, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The file shipped with the crate.
pub const BUILTIN_FILE: &str = "engines/devices.yaml";
const BUILTIN: &str = include_str!("../../devices.yaml");

const GIB: f64 = (1u64 << 30) as f64;

/// CPU or GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// A link (host link or GPU interconnect) as the file states it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub kind: String,
    pub gb_s_per_direction: f64,
}

/// One device entry as written in the file (units in the names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub description: String,
    pub kind: DeviceKind,
    pub memory_gib: Option<f64>,
    #[serde(default)]
    pub measured_memory_bytes: Option<u64>,
    pub memory_bandwidth_gb_s: Option<f64>,
    pub bf16_dense_tflops: Option<f64>,
    pub host_link: Option<LinkSpec>,
    pub interconnect: Option<LinkSpec>,
    pub sources: Vec<String>,
    #[serde(default)]
    pub notes: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceFile {
    devices: BTreeMap<String, DeviceSpec>,
}

/// A link in SI units.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Link {
    pub kind: String,
    /// Bytes per second, one direction.
    pub bytes_per_s: f64,
}

/// A device in SI units (bytes, bytes/s, FLOP/s).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Device {
    pub name: String,
    pub description: String,
    pub kind: DeviceKind,
    /// Datasheet capacity in bytes.
    pub memory_bytes: Option<u64>,
    /// Capacity the driver reported on a card we ran, when known.
    pub measured_memory_bytes: Option<u64>,
    pub memory_bandwidth: Option<f64>,
    pub bf16_flops: Option<f64>,
    pub host_link: Option<Link>,
    pub interconnect: Option<Link>,
    pub sources: Vec<String>,
    pub notes: Option<String>,
}

/// A card's rates measured on it (scripts/gpu-ceilings.py): what a fit compares its
/// rates with and keeps for terms its runs never exercise, in place of the datasheet's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ceilings {
    /// Bytes per second of a device-to-device copy, read and written counted.
    pub memory_bandwidth: Option<f64>,
    /// bf16 FLOP/s of a large matrix product.
    pub bf16_flops: Option<f64>,
    /// Bytes per second from pinned host memory to the device.
    pub host_link: Option<f64>,
}

impl Device {
    /// This device with `c`'s measured rates in place of the datasheet's, named in
    /// `sources` as `from`.
    pub fn with_ceilings(&self, c: &Ceilings, from: &str) -> Device {
        let mut d = self.clone();
        d.memory_bandwidth = c.memory_bandwidth.or(d.memory_bandwidth);
        d.bf16_flops = c.bf16_flops.or(d.bf16_flops);
        if let Some(rate) = c.host_link {
            d.host_link = Some(Link {
                kind: d
                    .host_link
                    .as_ref()
                    .map_or("measured".into(), |l| format!("{} (measured)", l.kind)),
                bytes_per_s: rate,
            });
        }
        d.sources.push(format!("measured ceilings: {from}"));
        d
    }

    fn unknown(&self, field: &str) -> CostError {
        CostError::UnknownFigure {
            device: self.name.clone(),
            field: field.to_string(),
        }
    }

    /// Memory capacity: the measured total when there is one, else the datasheet's.
    pub fn capacity(&self) -> Result<u64> {
        self.measured_memory_bytes
            .or(self.memory_bytes)
            .ok_or_else(|| self.unknown("memory_gib"))
    }

    pub fn bandwidth(&self) -> Result<f64> {
        self.memory_bandwidth
            .ok_or_else(|| self.unknown("memory_bandwidth_gb_s"))
    }

    pub fn flops(&self) -> Result<f64> {
        self.bf16_flops
            .ok_or_else(|| self.unknown("bf16_dense_tflops"))
    }

    pub fn host_link_bandwidth(&self) -> Result<f64> {
        self.host_link
            .as_ref()
            .map(|l| l.bytes_per_s)
            .ok_or_else(|| self.unknown("host_link"))
    }

    pub fn interconnect_bandwidth(&self) -> Result<f64> {
        self.interconnect
            .as_ref()
            .map(|l| l.bytes_per_s)
            .ok_or_else(|| self.unknown("interconnect"))
    }
}

/// All devices of one or more files, by name.
#[derive(Debug, Clone, Default)]
pub struct DeviceTable {
    devices: BTreeMap<String, Device>,
}

fn invalid(file: &str, key: String, message: impl Into<String>) -> CostError {
    CostError::DeviceFile {
        file: file.to_string(),
        key,
        message: message.into(),
    }
}

fn positive(file: &str, key: String, v: Option<f64>) -> Result<Option<f64>> {
    match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(invalid(
            file,
            key,
            format!("{x}: expected a positive number or null"),
        )),
        _ => Ok(v),
    }
}

fn link(file: &str, key: String, l: Option<LinkSpec>) -> Result<Option<Link>> {
    let Some(l) = l else { return Ok(None) };
    let bw = positive(
        file,
        format!("{key}.gb_s_per_direction"),
        Some(l.gb_s_per_direction),
    )?;
    Ok(bw.map(|b| Link {
        kind: l.kind,
        bytes_per_s: b * 1e9,
    }))
}

impl DeviceTable {
    /// The table shipped in `engines/devices.yaml`.
    pub fn builtin() -> Result<Self> {
        Self::from_yaml(BUILTIN, BUILTIN_FILE)
    }

    /// Parse a device file; `file` names it in errors.
    pub fn from_yaml(text: &str, file: &str) -> Result<Self> {
        let de = serde_yaml::Deserializer::from_str(text);
        let parsed: DeviceFile = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            invalid(file, key, e.into_inner().to_string())
        })?;
        let mut devices = BTreeMap::new();
        for (name, s) in parsed.devices {
            let k = |f: &str| format!("devices.{name}.{f}");
            let mem = positive(file, k("memory_gib"), s.memory_gib)?;
            if s.measured_memory_bytes == Some(0) {
                return Err(invalid(file, k("measured_memory_bytes"), "must be > 0"));
            }
            let bw = positive(file, k("memory_bandwidth_gb_s"), s.memory_bandwidth_gb_s)?;
            let fl = positive(file, k("bf16_dense_tflops"), s.bf16_dense_tflops)?;
            if s.sources.is_empty() {
                return Err(invalid(
                    file,
                    k("sources"),
                    "at least one source (datasheet URL or how it was measured) is required",
                ));
            }
            let dev = Device {
                name: name.clone(),
                description: s.description,
                kind: s.kind,
                memory_bytes: mem.map(|g| (g * GIB).round() as u64),
                measured_memory_bytes: s.measured_memory_bytes,
                memory_bandwidth: bw.map(|b| b * 1e9),
                bf16_flops: fl.map(|f| f * 1e12),
                host_link: link(file, k("host_link"), s.host_link)?,
                interconnect: link(file, k("interconnect"), s.interconnect)?,
                sources: s.sources,
                notes: s.notes,
            };
            devices.insert(name, dev);
        }
        Ok(Self { devices })
    }

    /// Read a user's device file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// The built-in table with `other`'s entries added (same names replaced).
    pub fn merged(mut self, other: DeviceTable) -> Self {
        self.devices.extend(other.devices);
        self
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.devices.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Result<&Device> {
        self.devices
            .get(name)
            .ok_or_else(|| CostError::UnknownDevice {
                name: name.to_string(),
                known: self.names().collect::<Vec<_>>().join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_table_has_the_required_devices_with_sources() {
        let t = DeviceTable::builtin().unwrap();
        for n in [
            "cpu",
            "a100-80g",
            "h100-sxm",
            "h100-pcie",
            "h200",
            "gh200",
            "b200",
        ] {
            let d = t.get(n).unwrap();
            assert!(!d.sources.is_empty(), "{n}");
            if d.kind == DeviceKind::Gpu {
                assert!(d.sources.iter().any(|s| s.starts_with("https://")), "{n}");
                d.bandwidth().unwrap();
                d.flops().unwrap();
                d.host_link_bandwidth().unwrap();
            }
        }
        let h = t.get("h100-sxm").unwrap();
        assert_eq!(h.memory_bandwidth, Some(3.35e12));
        assert_eq!(h.bf16_flops, Some(989.5e12));
        assert_eq!(h.memory_bytes, Some(80 << 30));
        assert_eq!(h.capacity().unwrap(), 85_017_493_504);
        // NVLink-C2C is 7x PCIe 5 per direction (paper-notes: "≈7× PCIe 5").
        let c2c = t.get("gh200").unwrap().host_link_bandwidth().unwrap();
        let ratio = c2c / h.host_link_bandwidth().unwrap();
        assert!((ratio - 7.03).abs() < 0.01, "{ratio}");
        // The CPU's unknowns are errors naming the device and the field.
        let e = t.get("cpu").unwrap().flops().unwrap_err().to_string();
        assert!(e.contains("cpu") && e.contains("bf16_dense_tflops"), "{e}");
        let e = t.get("h300").unwrap_err().to_string();
        assert!(e.contains("h300") && e.contains("h100-sxm"), "{e}");
    }

    #[test]
    fn malformed_files_name_the_file_and_key() {
        let ok = "devices:\n  x:\n    description: d\n    kind: gpu\n    memory_gib: 1\n    memory_bandwidth_gb_s: 1\n    bf16_dense_tflops: 1\n    host_link: null\n    interconnect: null\n    sources: [s]\n";
        DeviceTable::from_yaml(ok, "mine.yaml").unwrap();
        let cases = [
            (
                ok.replace("memory_bandwidth_gb_s: 1", "memory_bandwidth_gb_s: fast"),
                "devices.x.memory_bandwidth_gb_s",
            ),
            (
                ok.replace("bf16_dense_tflops: 1", "bf16_dense_tflops: -3"),
                "devices.x.bf16_dense_tflops",
            ),
            (
                ok.replace(
                    "host_link: null",
                    "host_link: {kind: p, gb_s_per_direction: 0}",
                ),
                "devices.x.host_link.gb_s_per_direction",
            ),
            (ok.replace("kind: gpu", "kind: tpu"), "devices.x.kind"),
            (ok.replace("memory_gib", "memory_gb"), "devices.x"),
            (
                ok.replace("sources: [s]", "sources: []"),
                "devices.x.sources",
            ),
        ];
        for (text, key) in cases {
            let e = DeviceTable::from_yaml(&text, "mine.yaml").unwrap_err();
            let msg = e.to_string();
            assert!(msg.starts_with("mine.yaml: "), "{msg}");
            assert!(msg.contains(key), "{key} not in {msg}");
        }
        // A user file adds to (and overrides) the built-in table.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.yaml");
        std::fs::write(&path, ok.replace("  x:", "  h100-sxm:")).unwrap();
        let t = DeviceTable::builtin()
            .unwrap()
            .merged(DeviceTable::load(&path).unwrap());
        assert_eq!(t.get("h100-sxm").unwrap().memory_bandwidth, Some(1e9));
        assert!(t.get("b200").is_ok());
        let e = DeviceTable::load(Path::new("/nonexistent/devices.yaml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/devices.yaml"));
    }
}
