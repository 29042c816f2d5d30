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
        crate::schema::MEM_WEIGHTS_BYTES,
        crate::schema::MEM_KV_DEVICE_BYTES,
        crate::schema::MEM_ACTIVATIONS_PEAK_BYTES,
    ];
    let dev_max =
        max_of(&runs, &dev_cols).max(max_of(&runs, &[crate::schema::MEM_DEVICE_PEAK_BYTES]));
    let host_max = max_of(&runs, &[crate::schema::MEM_KV_HOST_BYTES])
        .max(max_of(&runs, &[crate::schema::MEM_HOST_PEAK_BYTES]));
    let (dd, du) = byte_unit(dev_max);
    let (hd, hu) = byte_unit(host_max);
    let d = |c: &'static str| move |r: &Run| r.get(c).map(|v| v / dd);
    let h = |c: &'static str| move |r: &Run| r.get(c).map(|v| v / hd);
    let (w, k, a, p) = (
        d(crate::schema::MEM_WEIGHTS_BYTES),
        d(crate::schema::MEM_KV_DEVICE_BYTES),
        d(crate::schema::MEM_ACTIVATIONS_PEAK_BYTES),
        d(crate::schema::MEM_DEVICE_PEAK_BYTES),
    );
    let (hk, rss) = (
        h(crate::schema::MEM_KV_HOST_BYTES),
        h(crate::schema::MEM_HOST_PEAK_BYTES),
    );
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
            crate::schema::MEM_WEIGHTS_BYTES,
            crate::schema::MEM_KV_DEVICE_BYTES,
            crate::schema::MEM_ACTIVATIONS_PEAK_BYTES,
            crate::schema::MEM_KV_HOST_BYTES,
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
