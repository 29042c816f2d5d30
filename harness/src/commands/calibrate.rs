//! `kvbench calibrate results/EXP... --device NAME`: the cost model's efficiency
//! constants fitted to the steps of measured experiments, written as a calibration
//! file; `--validate results/OTHER...` then predicts experiments the fit did not see
//! and reports the error per metric against their measurements.

use crate::prediction::{
    calibrate, metric_errors, outcome_compared, outcome_mismatches, validate, CellCheck, Measured,
    MetricError, Target, NOT_MODELLED, VALIDATED,
};
use crate::run::write_atomic;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_engines::cost::calibrate::PhaseFit;
use kvbench_engines::cost::fit::Term;
use kvbench_engines::cost::{Calibration, Ceilings, Device, DeviceTable, Efficiency};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Which device, from the shipped table or a file of the same shape.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// Device name in the device table (engines/devices.yaml: cpu, a100-80g,
    /// h100-sxm, h100-pcie, h200, gh200, b200, or one of `--devices`).
    #[arg(long)]
    pub device: String,
    /// A YAML file of more devices, in the shape of engines/devices.yaml; its entries
    /// replace shipped ones of the same name.
    #[arg(long)]
    pub devices: Option<PathBuf>,
}

/// The constants a prediction for `device` uses: the calibration file given (of that
/// device), else the datasheet roofline.
pub fn efficiency_for(calibration: Option<&Path>, device: &Device) -> Result<Efficiency> {
    match calibration {
        Some(p) => {
            let c = Calibration::load(p)?;
            if c.device != device.name {
                bail!(
                    "{}: a calibration of `{}`, not of `{}`",
                    p.display(),
                    c.device,
                    device.name
                );
            }
            Ok(c.efficiency())
        }
        None => Efficiency::peak(device).with_context(|| {
            format!(
                "{} has no datasheet peaks to predict with: give --calibration (a file of \
                 `kvbench calibrate`; results/baselines/cpu/calibration-cpu.yaml is the \
                 development machine's)",
                device.name
            )
        }),
    }
}

pub fn load_device(a: &DeviceArgs) -> Result<Device> {
    let mut table = DeviceTable::builtin()?;
    if let Some(f) = &a.devices {
        table = table.merged(DeviceTable::load(f)?);
    }
    Ok(table.get(&a.device)?.clone())
}

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Results directories of measured performance experiments on this device
    /// (results/EXP, holding experiment.yaml, runs, requests and steps tables).
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Where the calibration goes (default: calibration-<device>.yaml in the first
    /// results directory).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Measured experiments to predict with the fitted constants and compare (held
    /// out: not fitted).
    #[arg(long, num_args = 1..)]
    pub validate: Vec<PathBuf>,
    /// Write the validation as Markdown to this file too.
    #[arg(long, requires = "validate")]
    pub table: Option<PathBuf>,
    /// Fit only the cells of these engines (e.g. leave out cells whose per-step times
    /// are not their own: results recorded before the engine synchronized the GPU after
    /// each forward). Validation predicts every cell.
    #[arg(long, value_delimiter = ',')]
    pub engines: Vec<String>,
    /// Write every fitted step as CSV (phase, measured seconds, the model's time, and
    /// the cost's features), to look at the fit.
    #[arg(long)]
    pub observations: Option<PathBuf>,
    /// Directory of fetched weights (a GGUF model's config is read from it).
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// The card's rates measured on it, as scripts/gpu-ceilings.py writes them
    /// (results/baselines/<card>/ceilings.json): its copy bandwidth, bf16 matmul rate
    /// and pinned host-to-device rate replace the datasheet's as the peaks the fitted
    /// rates are compared with and as the rates of terms the runs never exercise.
    #[arg(long)]
    pub ceilings: Option<PathBuf>,
    /// A calibration of the same device whose fitted values the terms these runs never
    /// exercise take, instead of the device's rates: e.g. the host link fitted on
    /// another experiment's offloading cells (InfiniGen), for a fit on runs that do not
    /// offload. The file lists the terms it took.
    #[arg(long)]
    pub rates_from: Option<PathBuf>,
}

/// Rates of a ceilings file (scripts/gpu-ceilings.py's JSON); each may be absent.
pub fn load_ceilings(path: &Path) -> Result<Ceilings> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected the JSON of scripts/gpu-ceilings.py",
            path.display()
        )
    })?;
    let rate = |key: &str| -> Result<Option<f64>> {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(x) => match x.as_f64() {
                Some(r) if r.is_finite() && r > 0.0 => Ok(Some(r)),
                _ => bail!(
                    "{}: `{key}` is {x}, expected a positive rate",
                    path.display()
                ),
            },
        }
    };
    let c = Ceilings {
        memory_bandwidth: rate("copy_bandwidth_bytes_per_s")?,
        bf16_flops: rate("matmul_bf16_flops_per_s")?,
        host_link: rate("h2d_pinned_bytes_per_s")?,
    };
    if c == Ceilings::default() {
        bail!(
            "{}: none of copy_bandwidth_bytes_per_s, matmul_bf16_flops_per_s, \
             h2d_pinned_bytes_per_s (scripts/gpu-ceilings.py writes them)",
            path.display()
        );
    }
    Ok(c)
}

fn rate(x: Option<f64>, unit: &str, scale: f64) -> String {
    x.map_or("hidden".into(), |r| format!("{:.3} {unit}", r / scale))
}

fn pct(x: Option<f64>) -> String {
    x.map_or("–".into(), |f| format!("{:.0} %", f * 100.0))
}

/// One phase of a calibration in words.
pub fn describe_phase(name: &str, p: &PhaseFit) -> String {
    let e = &p.fit.efficiency;
    format!(
        "{name}: {} steps, {} terms; overhead {:.3} ms/step + {:.3} ms/sequence; \
         bandwidth {} ({} of peak), matmul {} ({} of peak), attention {}{}, host link {}; \
         R² {:.4}, median |error| {:.1} %, largest {:.1} %{}",
        p.fit.observations,
        p.fit.active_terms,
        e.step_overhead_s * 1e3,
        e.per_sequence_s * 1e3,
        rate(e.bandwidth, "GB/s", 1e9),
        pct(p.bandwidth_of_peak),
        rate(e.flops, "TFLOP/s", 1e12),
        pct(p.flops_of_peak),
        rate(e.attention_flops, "TFLOP/s", 1e12),
        // Only where the statistics passes run at a rate of their own.
        e.statistics_flops.map_or(String::new(), |r| format!(
            ", statistics passes {}",
            rate(Some(r), "TFLOP/s", 1e12)
        )),
        rate(e.link, "GB/s", 1e9),
        p.fit.r_squared,
        p.median_relative_error * 100.0,
        p.fit.max_relative_error * 100.0,
        unobserved(p)
    )
}

/// The terms the fitted runs never exercised: those kept at the device's rate, and
/// those that took another calibration's fitted value (`--rates-from`).
fn unobserved(p: &PhaseFit) -> String {
    // The statistics passes never seen run at the attention rate, not the device's.
    let kept: Vec<_> = p
        .unobserved
        .iter()
        .filter(|t| !p.taken.contains(t) && **t != Term::StatisticsFlops)
        .collect();
    let mut s = String::new();
    // As the calibration file names them.
    let names = |ts: &mut dyn Iterator<Item = &Term>| -> String {
        ts.map(|t| {
            serde_json::to_value(t)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
        })
        .map(Option::unwrap_or_default)
        .collect::<Vec<_>>()
        .join(", ")
    };
    if !kept.is_empty() {
        let _ = write!(
            s,
            "; not in the fitted runs, kept at the device's rate: {}",
            names(&mut kept.iter().copied())
        );
    }
    if !p.taken.is_empty() {
        let _ = write!(
            s,
            "; not in the fitted runs, taken from --rates-from: {}",
            names(&mut p.taken.iter())
        );
    }
    s
}

/// The validation of one experiment as Markdown: the error per metric, then the cells.
pub fn validation_markdown(
    experiment: &str,
    calibration: &Calibration,
    errors: &[MetricError],
    checks: &[CellCheck],
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### {experiment} predicted with the calibration of {} on {}\n",
        calibration.device,
        calibration.sources.join(", ")
    );
    let _ = writeln!(
        s,
        "| metric | cells | attention | median abs. error | largest |"
    );
    let _ = writeln!(s, "|---|---:|---|---:|---:|");
    let row = |s: &mut String, e: &MetricError, which: &str| {
        let _ = writeln!(
            s,
            "| {} | {} | {which} | {:.1} % | {:.1} % |",
            e.metric,
            e.cells,
            e.median_abs_rel * 100.0,
            e.max_abs_rel * 100.0
        );
    };
    for e in errors {
        row(&mut s, e, "all");
    }
    // Per attention implementation, when the experiment has several.
    let mut kinds: Vec<&str> = checks.iter().map(|c| c.attention.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    if kinds.len() > 1 {
        for k in kinds {
            let some: Vec<CellCheck> = checks
                .iter()
                .filter(|c| c.attention == k)
                .cloned()
                .collect();
            for e in metric_errors(&some).unwrap_or_default() {
                row(&mut s, &e, k);
            }
        }
    }
    let wrong = outcome_mismatches(checks);
    let compared = outcome_compared(checks).len();
    let _ = write!(
        s,
        "\nOutcomes (ok / oom): {} of {} cells predicted right",
        compared - wrong.len(),
        compared
    );
    let not_modelled = checks
        .iter()
        .filter(|c| c.predicted_outcome == NOT_MODELLED)
        .count();
    if not_modelled > 0 {
        let _ = write!(s, "; {not_modelled} not modelled, so not predicted");
    }
    let failed = checks
        .iter()
        .filter(|c| !["ok", "oom"].contains(&c.measured_outcome.as_str()))
        .count();
    if failed > 0 {
        let _ = write!(
            s,
            "; {failed} ended in an error when measured, not compared"
        );
    }
    let _ = writeln!(s, ".\n");
    let _ = write!(s, "| cell | outcome (measured / predicted) |");
    for m in VALIDATED {
        let _ = write!(s, " {m} (measured / predicted) |");
    }
    let _ = write!(s, "\n|---|---|");
    for _ in VALIDATED {
        let _ = write!(s, "---:|");
    }
    let _ = writeln!(s);
    let num = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.4}"));
    for c in checks {
        let _ = write!(
            s,
            "| {} | {} / {} |",
            c.key, c.measured_outcome, c.predicted_outcome
        );
        for (m, p) in &c.values {
            let _ = write!(s, " {} / {} |", num(*m), num(*p));
        }
        let _ = writeln!(s);
    }
    s
}

/// Runs on a CPU fit a CPU's constants, runs on a GPU a GPU's: the experiment's
/// `device.name` against the device file's kind.
fn same_kind(m: &Measured, device: &Device) -> Result<()> {
    let ran: kvbench_engines::device::DeviceKind = m
        .plan
        .exp
        .device
        .name
        .parse()
        .map_err(|e| anyhow::anyhow!("{}: {e}", m.dir.display()))?;
    let on_cpu = matches!(ran, kvbench_engines::device::DeviceKind::Cpu);
    if on_cpu != (device.kind == kvbench_engines::cost::device::DeviceKind::Cpu) {
        bail!(
            "{} ran on `{}`, and --device {} is a {}: a device's constants are fitted to \
             runs on that kind of device",
            m.dir.display(),
            m.plan.exp.device.name,
            device.name,
            if on_cpu { "GPU" } else { "CPU" }
        );
    }
    Ok(())
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    let mut device = load_device(&a.device)?;
    if let Some(p) = &a.ceilings {
        // scripts/gpu-ceilings.py measures a card: a CPU's constants are not its.
        if device.kind == kvbench_engines::cost::DeviceKind::Cpu {
            bail!(
                "--ceilings {}: a card's measured rates (scripts/gpu-ceilings.py), and --device {} is a CPU",
                p.display(),
                device.name
            );
        }
        device = device.with_ceilings(&load_ceilings(p)?, &p.display().to_string());
    }
    let measured: Vec<Measured> = a
        .results
        .iter()
        .map(|d| Measured::load(d, &a.models_dir))
        .collect::<Result<_>>()?;
    // Everything the fit needs is checked before it runs, and nothing is written on a
    // failure found after it.
    let validated: Vec<Measured> = a
        .validate
        .iter()
        .map(|d| Measured::load(d, &a.models_dir))
        .collect::<Result<_>>()?;
    for m in measured.iter().chain(&validated) {
        same_kind(m, &device)?;
    }
    for (flag, path) in [
        ("-o", a.output.as_ref()),
        ("--observations", a.observations.as_ref()),
        ("--table", a.table.as_ref()),
    ] {
        if let Some(parent) = path
            .and_then(|p| p.parent())
            .filter(|p| !p.as_os_str().is_empty())
        {
            if !parent.is_dir() {
                bail!(
                    "{flag} {}: no directory {}",
                    path.map_or(String::new(), |p| p.display().to_string()),
                    parent.display()
                );
            }
        }
    }
    let other = match &a.rates_from {
        Some(p) => Some((Calibration::load(p)?, p.display().to_string())),
        None => None,
    };
    let (mut cal, obs) = calibrate(
        &measured,
        &device,
        &a.engines,
        other.as_ref().map(|(c, n)| (c, n.as_str())),
    )?;
    cal.ceilings = a.ceilings.as_ref().map(|p| p.display().to_string());
    for (key, why) in &obs.left_out {
        eprintln!("left out of the fit: {key}: {NOT_MODELLED}: {why}");
    }
    eprintln!(
        "{} steps of {} paired with the model's schedule ({} after a divergence left out)",
        obs.aligned,
        cal.sources.join(", "),
        obs.dropped
    );
    println!("{}", describe_phase("prefill", &cal.prefill));
    println!("{}", describe_phase("decode", &cal.decode));
    let out = match &a.output {
        Some(p) => p.clone(),
        None => a.results[0].join(format!("calibration-{}.yaml", device.name)),
    };
    write_atomic(&out, cal.to_yaml()?.as_bytes())?;
    println!("calibration → {}", out.display());
    if let Some(path) = &a.observations {
        let eff = cal.efficiency();
        let mut csv = String::from(
            "phase,seconds,model_seconds,forwards,sequences,tokens,device_bytes,flops,transfer_bytes\n",
        );
        for (phase, obs, e) in [
            ("prefill", &obs.prefill, &eff.prefill),
            ("decode", &obs.decode, &eff.decode),
        ] {
            for o in obs {
                let c = &o.cost;
                let _ = writeln!(
                    csv,
                    "{phase},{},{},{},{},{},{},{},{}",
                    o.seconds,
                    e.time(c),
                    c.forwards,
                    c.sequences,
                    c.tokens,
                    c.device_bytes(),
                    c.flops(),
                    c.transfer_bytes()
                );
            }
        }
        write_atomic(path, csv.as_bytes())?;
        println!("observations → {}", path.display());
    }
    if a.validate.is_empty() {
        return Ok(());
    }
    let target = Target {
        device: device.clone(),
        efficiency: cal.efficiency(),
        tensor_parallel: 1,
    };
    let mut md = String::new();
    for m in &validated {
        let checks = validate(m, &target)?;
        if checks.is_empty() {
            bail!("{}: no recorded cell to validate against", m.dir.display());
        }
        let errors = metric_errors(&checks)?;
        let table = validation_markdown(&m.name(), &cal, &errors, &checks);
        println!("\n{table}");
        md.push_str(&table);
        md.push('\n');
    }
    if let Some(t) = &a.table {
        write_atomic(t, md.as_bytes())?;
        println!("validation → {}", t.display());
    }
    Ok(())
}
