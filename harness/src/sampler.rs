//! A background thread sampling memory at a fixed interval: this process's resident
//! memory and the host's used memory through sysinfo, and the GPU's memory and
//! utilization through NVML (nvml-wrapper, which loads the driver's library at run
//! time: without a driver the GPU columns are null and nothing fails).

use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the sampler started.
    pub t_s: f64,
    pub process_rss_bytes: Option<u64>,
    pub host_used_bytes: Option<u64>,
    pub gpu_used_bytes: Option<u64>,
    pub gpu_total_bytes: Option<u64>,
    pub gpu_util_percent: Option<u32>,
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<Sample>>>,
}

/// The GPU of `index` through NVML, if a driver is present.
fn nvml_device(index: u32) -> Option<(nvml_wrapper::Nvml, u32)> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    nvml.device_by_index(index).ok()?;
    Some((nvml, index))
}

impl Sampler {
    /// Start sampling every `interval`; `gpu`: the CUDA device index, if any.
    pub fn start(interval: Duration, gpu: Option<u32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            use sysinfo::{MemoryRefreshKind, Pid, ProcessRefreshKind, ProcessesToUpdate, System};
            let nvml = gpu.and_then(nvml_device);
            let mut sys = System::new();
            let pid = Pid::from_u32(std::process::id());
            let t0 = Instant::now();
            let mut out = Vec::new();
            loop {
                sys.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram());
                sys.refresh_processes_specifics(
                    ProcessesToUpdate::Some(&[pid]),
                    false,
                    ProcessRefreshKind::nothing().with_memory(),
                );
                let (mut used, mut total, mut util) = (None, None, None);
                if let Some((n, i)) = &nvml {
                    if let Ok(d) = n.device_by_index(*i) {
                        if let Ok(m) = d.memory_info() {
                            used = Some(m.used);
                            total = Some(m.total);
                        }
                        util = d.utilization_rates().ok().map(|u| u.gpu);
                    }
                }
                out.push(Sample {
                    t_s: t0.elapsed().as_secs_f64(),
                    process_rss_bytes: sys.process(pid).map(|p| p.memory()),
                    host_used_bytes: Some(sys.used_memory()),
                    gpu_used_bytes: used,
                    gpu_total_bytes: total,
                    gpu_util_percent: util,
                });
                if flag.load(Ordering::Relaxed) {
                    return out;
                }
                std::thread::sleep(interval);
            }
        });
        Self {
            stop,
            handle: Some(handle),
        }
    }

    /// Stop (after one last sample) and return the samples.
    pub fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_this_process_and_leaves_gpu_columns_null_without_a_driver() {
        let s = Sampler::start(Duration::from_millis(5), Some(0));
        let big = vec![1u8; 64 << 20];
        std::thread::sleep(Duration::from_millis(40));
        let samples = s.finish();
        assert!(samples.len() >= 2, "{}", samples.len());
        assert!(samples.windows(2).all(|w| w[0].t_s <= w[1].t_s));
        let rss = samples
            .iter()
            .filter_map(|s| s.process_rss_bytes)
            .max()
            .unwrap();
        assert!(rss >= 64 << 20, "rss {rss}");
        assert!(big.iter().all(|&b| b == 1));
        if nvml_wrapper::Nvml::init().is_err() {
            assert!(samples.iter().all(|s| s.gpu_used_bytes.is_none()));
        }
    }
}
