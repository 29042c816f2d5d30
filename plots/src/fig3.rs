//! Fig. 3: device and host memory by component vs batch size, stacked bars per
//! engine (the study's claim C5: `full` pre-allocates its pool whatever the batch,
//! H2O holds less, InfiniGen moves the KV cache to host memory). Device: weights, KV
//! cache and the activation peak from the memory ledger, with the device peak NVML
//! observed marked; host: the KV cache in host memory, with the process's RSS peak
//! marked.

use crate::bars::{Bars, Getter};
use crate::data::Run;
use crate::select::{missing_note, pin, Dim};
use crate::style::{byte_unit, fmt_count, LegendItem, TwoPanels};
use crate::{Prepared, Tables};

pub type Fig3 = TwoPanels<Bars, Bars>;

fn max_of(runs: &[&Run], cols: &[&str]) -> f64 {
    runs.iter()
        .map(|r| cols.iter().filter_map(|c| r.get(c)).sum::<f64>())
        .fold(0.0, f64::max)
}

pub fn prepare(t: &Tables) -> Prepared<Fig3> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let all: Vec<&Run> = t.runs.iter().collect();
    let mut notes = Vec::new();
    let runs = pin(&all, &[Dim::Batch], &mut notes);
    let dev_cols = [
        "mem_weights_bytes",
        "mem_kv_device_bytes",
        "mem_activations_peak_bytes",
    ];
    let dev_max = max_of(&runs, &dev_cols).max(max_of(&runs, &["mem_device_peak_bytes"]));
    let host_max =
        max_of(&runs, &["mem_kv_host_bytes"]).max(max_of(&runs, &["mem_host_peak_bytes"]));
    let (dd, du) = byte_unit(dev_max);
    let (hd, hu) = byte_unit(host_max);
    let d = |c: &'static str| move |r: &Run| r.get(c).map(|v| v / dd);
    let h = |c: &'static str| move |r: &Run| r.get(c).map(|v| v / hd);
    let (w, k, a, p) = (
        d("mem_weights_bytes"),
        d("mem_kv_device_bytes"),
        d("mem_activations_peak_bytes"),
        d("mem_device_peak_bytes"),
    );
    let (hk, rss) = (h("mem_kv_host_bytes"), h("mem_host_peak_bytes"));
    let batch = |r: &Run| r.batch;
    let device = Bars::build(
        "Device memory",
        "batch size",
        &format!("device memory ({du})"),
        &runs,
        &batch,
        fmt_count,
        &[
            ("weights", &w as Getter),
            ("KV (device)", &k as Getter),
            ("activations (peak)", &a as Getter),
        ],
        Some(("device peak observed (NVML)", &p as Getter)),
    );
    let host = Bars::build(
        "Host memory",
        "batch size",
        &format!("host memory ({hu})"),
        &runs,
        &batch,
        fmt_count,
        &[("KV (host)", &hk as Getter)],
        Some(("process RSS peak", &rss as Getter)),
    );
    if device.is_empty() {
        return Err("no cell has a batch size".into());
    }
    notes.extend(device.notes());
    notes.extend(
        host.notes()
            .into_iter()
            .filter(|n| !n.contains("did not finish")),
    );
    if device.mark_label.is_none() {
        notes.push(
            "Device peak not observed (no NVML: CPU run); the ledger's components are shown."
                .into(),
        );
    }
    notes.extend(missing_note(
        t,
        &[
            "mem_weights_bytes",
            "mem_kv_device_bytes",
            "mem_activations_peak_bytes",
            "mem_kv_host_bytes",
        ],
    ));
    let mut legend: Vec<LegendItem> = device.legend_items(false);
    legend.extend(
        host.legend_items(true)
            .into_iter()
            .filter(|i| !matches!(i, LegendItem::Hatch(_)) || !device.has_fails()),
    );
    Ok(TwoPanels::new(device, host, 60, legend, notes))
}
