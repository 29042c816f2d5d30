//! `kvbench predict EXP.yaml --device NAME`: every cell of a performance experiment
//! predicted by the cost model, recorded as `kvbench run` records measured cells
//! (runs.parquet with `predicted = true`) in results/<name>-predicted-<device>/, so
//! `kvbench plot`, `report` and `compare` read predictions unchanged.

use super::calibrate::{efficiency_for, load_device, DeviceArgs};
use crate::cell::performance::Outcome;
use crate::experiment::{Kind, Plan};
use crate::prediction::{model_config, predict_cell, Target};
use crate::recorder::write_tables;
use crate::run::write_atomic;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct PredictArgs {
    /// Experiment file (YAML), or a name under experiments/ (`paper/batch-scaling`).
    pub experiment: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Efficiency constants fitted by `kvbench calibrate` (a calibration YAML for the
    /// same device). Without one the prediction is the datasheet roofline: a lower
    /// bound on every time, not an estimate.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Host memory an offloading strategy may use (`512GiB`); default: the size of the
    /// device's KV pool, the engine's default without a host capacity.
    #[arg(long)]
    pub host_memory: Option<String>,
    /// GPUs in tensor parallelism (weights and KV heads split, two all-reduces per
    /// layer).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Directory of fetched weights (a GGUF model's config is read from it).
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Where results go: `<results>/<experiment name>-predicted-<device>/`.
    #[arg(long, env = "KVBENCH_RESULTS", default_value = "results")]
    pub results: PathBuf,
}

pub fn run(a: PredictArgs) -> Result<()> {
    let mut plan = Plan::load(&a.experiment, &a.models_dir)?;
    if let Some(h) = &a.host_memory {
        crate::setup::parse_size(h).map_err(|e| anyhow::anyhow!("--host-memory: {e}"))?;
        plan.exp.device.host_memory = Some(h.clone());
    }
    if plan.exp.kind != Kind::Performance {
        bail!(
            "{}: a `kind: {}` experiment; `kvbench predict` predicts performance cells",
            a.experiment.display(),
            plan.exp.kind.name()
        );
    }
    let device = load_device(&a.device)?;
    let efficiency = efficiency_for(a.calibration.as_deref(), &device)?;
    if a.calibration.is_none() {
        eprintln!(
            "no --calibration: predicting with {}'s datasheet peaks (the roofline, a lower \
             bound on every time)",
            device.name
        );
    }
    let cfg = model_config(&plan, &a.models_dir)?;
    let target = Target {
        device,
        efficiency,
        tensor_parallel: a.tensor_parallel,
    };
    let name = format!("{}-predicted-{}", plan.exp.name, target.device.name);
    let exp_dir = a.results.join(&name);
    let cells_dir = exp_dir.join("cells");
    std::fs::create_dir_all(&cells_dir)
        .with_context(|| format!("creating {}", cells_dir.display()))?;
    let file = Plan::resolve(&a.experiment);
    let spec = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    write_atomic(&exp_dir.join("experiment.yaml"), &spec)?;
    let (mut ok, mut oom, mut not_modelled) = (0, 0, Vec::new());
    for cell in &plan.cells {
        let r = predict_cell(&plan, cell, &cfg, &target)
            .with_context(|| format!("predicting cell {} ({})", cell.index, cell.key()))?;
        match r.outcome {
            Outcome::Oom => oom += 1,
            Outcome::Ok => ok += 1,
            Outcome::Error => not_modelled.push(format!(
                "cell {} ({}): {}",
                cell.index,
                cell.key(),
                r.error.as_deref().unwrap_or("no prediction")
            )),
        }
        crate::cell_file::write(&cells_dir, &cell.id, &serde_json::to_string(&r)?)?;
    }
    write_tables(&exp_dir, &plan.cells)?;
    for line in &not_modelled {
        eprintln!("{line}");
    }
    println!(
        "{} cells predicted for {} ({} ok, {} out of memory{}) with {} → {}",
        plan.cells.len() - not_modelled.len(),
        target.device.name,
        ok,
        oom,
        if not_modelled.is_empty() {
            String::new()
        } else {
            format!(
                "; {} not modelled, recorded as errors (above)",
                not_modelled.len()
            )
        },
        target.efficiency.source,
        exp_dir.join("runs.parquet").display()
    );
    Ok(())
}
