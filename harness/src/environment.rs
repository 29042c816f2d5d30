//! Where a cell ran: recorded with every result, since a sweep may be split over
//! machines (`--shard`).

use serde::Serialize;

/// What this binary was built from: a hash of the workspace's sources, manifests and
/// features (harness/build.rs), the same on any machine that builds the same code.
pub const BUILD_ID: &str = env!("KVBENCH_BUILD_ID");

#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub device: String,
    /// Name of the GPU and the NVIDIA driver version (NVML), when present.
    pub gpu_name: Option<String>,
    pub driver_version: Option<String>,
    pub cpu_model: Option<String>,
    pub cpu_cores: usize,
    /// CPU worker threads the cell ran with (`--threads`; part of its identity).
    pub threads: usize,
    pub host_memory_bytes: u64,
    pub hostname: Option<String>,
    /// `git rev-parse HEAD` of the working directory, when it is a git checkout.
    pub git_revision: Option<String>,
    /// The code the kvbench binary was built from ([`BUILD_ID`]): a sweep resumed by
    /// another build runs again the cells this one did not record.
    pub build: Option<String>,
    pub kvbench_version: &'static str,
    pub timestamp_unix_s: u64,
    /// The engines' kernel switches set for this cell (`KVBENCH_FLASH_PREFILL=fa2`,
    /// ...; part of its identity), absent when none is.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub switches: std::collections::BTreeMap<String, String>,
    /// Predicted cells: the efficiency constants the cost model used (a calibration,
    /// or the datasheet roofline); the rest describes the machine that predicted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<String>,
}

/// The processor a cell on `device` (`cpu`, `cuda`, `cuda:N`) runs on here, as its
/// results record it: the GPU's name (NVML) on CUDA, the CPU's model otherwise; `None`
/// when it cannot be read. A cell recorded on another processor is not this machine's
/// result.
pub fn processor(device: &str) -> Option<String> {
    let cuda = device.strip_prefix("cuda").map(|i| {
        i.strip_prefix(':')
            .map_or(Some(0), |i| i.parse::<u32>().ok())
    });
    match cuda {
        Some(index) => {
            let n = nvml_wrapper::Nvml::init().ok()?;
            n.device_by_index(index?).ok()?.name().ok()
        }
        None => cpu_model(),
    }
}

/// The processor a recorded cell ran on (`env.gpu_name` for a CUDA cell, else
/// `env.cpu_model`), as [`processor`] reads it here; `None` when not recorded.
pub fn recorded_processor(cell: &serde_json::Value) -> Option<&str> {
    let env = &cell["env"];
    if env["device"]
        .as_str()
        .is_some_and(|d| d.starts_with("cuda"))
    {
        env["gpu_name"].as_str()
    } else {
        env["cpu_model"].as_str()
    }
}

fn cpu_model() -> Option<String> {
    use sysinfo::{CpuRefreshKind, RefreshKind, System};
    let sys =
        System::new_with_specifics(RefreshKind::nothing().with_cpu(CpuRefreshKind::nothing()));
    sys.cpus()
        .first()
        .map(|c| c.brand().trim().to_string())
        .filter(|s| !s.is_empty())
}

impl Environment {
    pub fn collect(device: &str, gpu: Option<u32>) -> Self {
        let (gpu_name, driver_version) = match gpu.and_then(|i| {
            let n = nvml_wrapper::Nvml::init().ok()?;
            let name = n.device_by_index(i).ok()?.name().ok();
            Some((name, n.sys_driver_version().ok()))
        }) {
            Some((a, b)) => (a, b),
            None => (None, None),
        };
        let git_revision = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string());
        Self {
            device: device.to_string(),
            gpu_name,
            driver_version,
            cpu_model: cpu_model(),
            cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            threads: candle_core::utils::get_num_threads(),
            host_memory_bytes: crate::setup::host_memory_bytes(),
            hostname: sysinfo::System::host_name(),
            git_revision,
            build: Some(BUILD_ID.to_string()),
            kvbench_version: env!("CARGO_PKG_VERSION"),
            timestamp_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            switches: kvbench_engines::kernel_switches(),
            prediction: None,
        }
    }

    /// A cell the cost model predicted for `device` with the constants of `source`.
    pub fn predicted(device: &str, source: &str) -> Self {
        Self {
            prediction: Some(source.to_string()),
            ..Self::collect(&format!("predicted:{device}"), None)
        }
    }
}
