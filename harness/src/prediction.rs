//! The cost model (`kvbench_engines::cost`) on experiments: predicted cells recorded
//! like measured ones (`kvbench predict`), calibrations fitted to the steps of
//! measured cells (`kvbench calibrate`), and predictions checked against measured
//! cells they were not fitted on (`kvbench calibrate --validate`).
//!
//! A cell is predicted by driving the cost model's simulation of the engine
//! ([`SimEngine`]: the engine's scheduler, each step costed and timed) with the
//! cell's own workload through the driver the measured cells use, then computing
//! the metrics with the same code; memory and the OOM outcome come from the memory
//! model.

use crate::cell::performance::{drive, workload_shape, CellResult, Outcome, Stepper};
use crate::compare::{floats, ints, strings};
use crate::environment::Environment;
use crate::experiment::{Cell, Kind, Plan};
use crate::metrics::compute;
use anyhow::{bail, Context, Result};
use kvbench_engines::config::ModelConfig;
use kvbench_engines::cost::memory::block_bytes;
use kvbench_engines::cost::{
    self, Calibration, Device, DeviceKind, Efficiency, Observation, Precision, Scenario, SimEngine,
    SimRequest, StepCost, TensorParallel,
};
use kvbench_engines::device::parse_bytes;
use kvbench_engines::engine::StepOutcome;
use kvbench_engines::policy::spec::{split_engine_options, PolicySpec};
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use kvbench_engines::source::{LoadOptions, ModelSource};
use kvbench_plots::schema;
use kvbench_plots::schema::read_table as read_parquet;
use std::collections::HashMap;
use std::path::Path;

/// Where a prediction is for: a device (its table entry), its efficiency constants
/// and the GPUs in tensor parallelism.
pub struct Target {
    pub device: Device,
    pub efficiency: Efficiency,
    pub tensor_parallel: usize,
}

/// The model's shapes, from its config only (no weights are read).
pub fn model_config(plan: &Plan, models_dir: &Path) -> Result<ModelConfig> {
    let src = ModelSource::parse(&plan.exp.model)
        .with_context(|| format!("model `{}`", plan.exp.model))?;
    let opts = LoadOptions {
        models_dir: models_dir.to_path_buf(),
        ..Default::default()
    };
    src.config(&opts)
        .with_context(|| format!("reading the config of model `{}`", plan.exp.model))
}

/// Bytes per element of the experiment's weights on `kind`: `auto` is f32 on a CPU
/// (what the engine picks there when the weights fit) and bf16 on a GPU.
pub fn precision(plan: &Plan, kind: DeviceKind) -> Result<Precision> {
    Ok(match (plan.exp.dtype.as_str(), kind) {
        ("f32", _) | ("auto", DeviceKind::Cpu) => Precision::F32,
        ("bf16" | "f16", _) | ("auto", DeviceKind::Gpu) => Precision::BF16,
        (d, _) => bail!(
            "dtype `{d}`: the cost model knows f32, f16 and bf16 weights (quantized weights \
             are not modelled)"
        ),
    })
}

/// A cell's strategy and how it runs, as the cost model takes them.
fn cell_setup(
    plan: &Plan,
    cell: &Cell,
    cfg: &ModelConfig,
    precision: Precision,
    kind: DeviceKind,
) -> Result<cost::Setup> {
    let pairs: Vec<(String, String)> = cell
        .params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let policy = PolicySpec::parse(&cell.engine, cell.budget, &pairs)
        .with_context(|| format!("cell {}: engine `{}`", cell.index, cell.engine))?;
    let (opts, _) = split_engine_options(&pairs)?;
    let mut s = cost::Setup::new(cfg.clone(), policy, precision);
    s.backend = kind;
    s.kv_codec = opts.kv_codec;
    s.block_size = plan.exp.scheduler.block_size;
    s.attention = cell.attention.parse().map_err(anyhow::Error::msg)?;
    s.chunk_size = cell.chunk_size.unwrap_or(512);
    Ok(s)
}

fn scheduler(plan: &Plan, cell: &Cell) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: cell.batch,
        max_batched_tokens: plan.exp.scheduler.max_batched_tokens,
        prefill: if plan.exp.scheduler.prefill == "sequential" {
            PrefillMode::Sequential
        } else {
            PrefillMode::Chunked
        },
    }
}

/// The device the cell runs on: the target, with the experiment's own `device.memory`
/// when the experiment is written for that kind of device (a CPU experiment's
/// capacity on the CPU), since that capacity is part of what the cell measures.
fn cell_device(plan: &Plan, target: &Device) -> Result<Device> {
    let mut d = target.clone();
    let exp_kind = if plan.exp.device.name == "cpu" {
        DeviceKind::Cpu
    } else {
        DeviceKind::Gpu
    };
    if exp_kind == d.kind {
        if let Some(m) = &plan.exp.device.memory {
            d.measured_memory_bytes = Some(parse_bytes(m).map_err(anyhow::Error::msg)?);
        }
    }
    Ok(d)
}

/// The simulation the driver steps.
struct Sim<'a> {
    eng: SimEngine<'a>,
    reqs: Vec<SimRequest>,
}

impl Stepper for Sim<'_> {
    fn now(&self) -> f64 {
        self.eng.now()
    }

    fn finish_time(&self, i: usize) -> Option<f64> {
        self.eng.finished().get(i).map(|o| o.finished_s)
    }

    fn submit(&mut self, i: usize, arrival_s: f64) -> Result<()> {
        self.eng.add_request(SimRequest {
            arrival_s,
            ..self.reqs[i]
        })?;
        Ok(())
    }

    fn step(&mut self) -> Result<StepOutcome> {
        Ok(self.eng.step()?)
    }

    fn wait_until(&mut self, t: f64) {
        self.eng.wait_until(t);
    }
}

/// Predict one performance cell on `target`: the same record a measured cell has
/// (metrics, memory by component, outcome), marked `predicted`. Measurements the
/// model does not make (the walltime breakdown, per-step KV in use, resident memory,
/// the requests and steps tables) are null.
pub fn predict_cell(
    plan: &Plan,
    cell: &Cell,
    cfg: &ModelConfig,
    target: &Target,
) -> Result<CellResult> {
    let device = cell_device(plan, &target.device)?;
    let precision = precision(plan, device.kind)?;
    let setup = cell_setup(plan, cell, cfg, precision, device.kind)?;
    let shape = workload_shape(plan, cell)?;
    let sched = scheduler(plan, cell);
    let tp = TensorParallel::new(target.tensor_parallel)?;
    // The memory model holds `batch` sequences alike: the longest prompt of the
    // workload, as the engine makes room for the longest before it starts.
    let longest = shape.prompt_lens.iter().copied().max().unwrap_or(1);
    let mut sc = Scenario::new(setup.clone(), cell.batch, longest, shape.output_len);
    sc.tensor_parallel = target.tensor_parallel;
    sc.memory_fraction = plan.exp.device.memory_fraction;
    sc.max_model_len = Some(plan.context);
    sc.max_num_seqs = sched.max_num_seqs;
    sc.max_batched_tokens = sched.max_batched_tokens;
    sc.sequential_prefill = sched.prefill == PrefillMode::Sequential;
    sc.host_memory = match &plan.exp.device.host_memory {
        Some(m) => Some(parse_bytes(m).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let mem = cost::memory(&device, &sc)?;
    let not_modelled = setup.not_modelled();
    let mut result = CellResult {
        env: Environment::predicted(&device.name, &target.efficiency.source),
        id: cell.id.clone(),
        key: cell.key(),
        cell: cell.clone(),
        outcome: Outcome::Ok,
        error: None,
        metrics: None,
        memory: Some(mem.report),
        h2d_bytes: None,
        d2h_bytes: None,
        attended_fraction: None,
        wall_s: 0.0,
        load_s: None,
        warmup_s: None,
        process_rss_peak_bytes: None,
        gpu_used_peak_bytes: None,
        samples: Vec::new(),
        requests: Vec::new(),
        steps: Vec::new(),
        predicted: true,
    };
    if let Some(why) = not_modelled {
        result.outcome = Outcome::Error;
        result.error = Some(format!("{NOT_MODELLED}: {why}"));
        return Ok(result);
    }
    if let Some(o) = mem.oom {
        result.outcome = Outcome::Oom;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let place = match o.component {
            kvbench_engines::error::Component::KvHost => {
                format!("host memory beside {}", device.name)
            }
            _ => device.name.clone(),
        };
        result.error = Some(format!(
            "predicted out of memory in {place}: {} needs {} bytes ({:.1} GiB), {} of {} bytes free ({:.1} of {:.1} GiB)",
            o.component,
            o.requested,
            gib(o.requested),
            o.available,
            o.capacity,
            gib(o.available),
            gib(o.capacity)
        ));
        return Ok(result);
    }
    let shard = cost::Setup {
        model: tp.shard(cfg)?,
        ..setup
    };
    let mut sched = sched;
    let kv_blocks = match shard.policy {
        PolicySpec::Full(_) => Some((mem.kv_pool / block_bytes(&shard)?) as usize),
        _ => {
            // The engine's on-demand pool preempts past its plan; the model admits no
            // more sequences than the plan holds at their peak.
            sched.max_num_seqs = sched.max_num_seqs.min(mem.concurrency.max(1));
            None
        }
    };
    let eff = &target.efficiency;
    let eng = SimEngine::new(
        shard,
        cfg.clone(),
        tp,
        sched,
        kv_blocks,
        plan.context,
        |_, phase, c: &StepCost| eff.time(phase, c),
    )?;
    // Warm-up requests leave the engine empty before the measured ones start, so the
    // measured ones are simulated alone.
    let reqs: Vec<SimRequest> = shape.prompt_lens[shape.warmup..]
        .iter()
        .map(|&l| SimRequest {
            prompt_len: l,
            max_new_tokens: shape.output_len,
            arrival_s: 0.0,
        })
        .collect();
    let mut sim = Sim { eng, reqs };
    let arrivals = shape.arrivals[shape.warmup..].to_vec();
    drive(&mut sim, arrivals, cell.max_concurrency, &mut |_| {})?;
    let outs = sim.eng.finished();
    let steps = sim.eng.traces();
    let slo = cell.slo.map(|s| s.seconds()).unwrap_or_default();
    let mut metrics = compute(outs, steps, slo, 0.0);
    // The model's step time is one number, not the engine's breakdown.
    metrics.breakdown = None;
    result.metrics = Some(metrics);
    result.h2d_bytes = Some(steps.iter().map(|t| t.h2d_bytes).sum());
    result.d2h_bytes = Some(steps.iter().map(|t| t.d2h_bytes).sum());
    let att: u64 = steps.iter().filter_map(|t| t.attended_tokens).sum();
    let ctx: u64 = steps.iter().filter_map(|t| t.context_tokens).sum();
    result.attended_fraction = (ctx > 0).then(|| att as f64 / ctx as f64);
    Ok(result)
}

/// The steps of one measured cell paired with their costs.
#[derive(Debug, Default)]
pub struct CellObservations {
    pub prefill: Vec<Observation>,
    pub decode: Vec<Observation>,
    /// Measured steps the simulation reproduced (same prefill and decode rows).
    pub aligned: usize,
    /// Measured steps past the first one the simulation scheduled differently.
    pub dropped: usize,
    /// Cells left out of the fit because the model does not describe them: (key, why).
    pub left_out: Vec<(String, &'static str)>,
    /// The builds that measured the fitted cells (`not recorded` for cells from before
    /// builds were).
    pub builds: std::collections::BTreeSet<String>,
}

/// Steps of a measured cell, in order: (prefill rows, decode rows, seconds).
type MeasuredSteps = Vec<(usize, usize, f64)>;

/// Observations of one measured cell: its measured requests replayed through the
/// simulation with each step lasting what the measured step lasted, so arrivals and
/// admissions fall on the same steps; each step's cost is then paired with its
/// measured time (the scheduling, forward, cache operations and sampling, the time
/// the decode throughput counts). Steps are paired until the first one whose rows
/// differ (a preemption the model's pool placed elsewhere).
pub fn cell_observations(
    plan: &Plan,
    cell: &Cell,
    cfg: &ModelConfig,
    device: &Device,
    requests: &[SimRequest],
    steps: &MeasuredSteps,
) -> Result<CellObservations> {
    let device = cell_device(plan, device)?;
    let precision = precision(plan, device.kind)?;
    let setup = cell_setup(plan, cell, cfg, precision, device.kind)?;
    let sched = scheduler(plan, cell);
    let kv_blocks = match setup.policy {
        PolicySpec::Full(_) => {
            let longest = requests.iter().map(|r| r.prompt_len).max().unwrap_or(1);
            let out = requests.iter().map(|r| r.max_new_tokens).max().unwrap_or(1);
            let mut sc = Scenario::new(setup.clone(), cell.batch, longest, out);
            sc.memory_fraction = plan.exp.device.memory_fraction;
            sc.max_model_len = Some(plan.context);
            sc.max_num_seqs = sched.max_num_seqs;
            sc.max_batched_tokens = sched.max_batched_tokens;
            let mem = cost::memory(&device, &sc)?;
            Some((mem.kv_pool / block_bytes(&setup)?).max(1) as usize)
        }
        _ => None,
    };
    let mut eng = SimEngine::new(
        setup,
        cfg.clone(),
        TensorParallel::new(1)?,
        sched,
        kv_blocks,
        plan.context,
        |i, _, _: &StepCost| steps.get(i).map_or(0.0, |s| s.2),
    )?;
    for r in requests {
        eng.add_request(*r)?;
    }
    // A simulation that runs longer than the measurement has diverged: stop it.
    let mut n = 0;
    loop {
        match eng.step()? {
            StepOutcome::Ran(_) => {
                n += 1;
                if n > steps.len() {
                    break;
                }
            }
            StepOutcome::Idle { until_s } => eng.wait_until(until_s),
            StepOutcome::Done => break,
        }
    }
    let mut out = CellObservations::default();
    for (i, (t, c)) in eng.traces().iter().zip(eng.costs()).enumerate() {
        let Some(&(p, d, seconds)) = steps.get(i) else {
            break;
        };
        if t.num_prefill_tokens != p || t.num_decode_tokens != d {
            break;
        }
        out.aligned += 1;
        let o = Observation { cost: *c, seconds };
        if p > 0 {
            out.prefill.push(o);
        } else {
            out.decode.push(o);
        }
    }
    out.dropped = steps.len() - out.aligned;
    Ok(out)
}

fn column<T>(v: Option<Vec<Option<T>>>, table: &Path, name: &str) -> Result<Vec<Option<T>>> {
    v.with_context(|| format!("{}: no column `{name}`", table.display()))
}

/// The measured requests and steps of each cell of a results directory, by cell key.
#[allow(clippy::type_complexity)]
fn measured(dir: &Path) -> Result<HashMap<String, (Vec<SimRequest>, MeasuredSteps)>> {
    let req_path = dir.join(schema::file_name(schema::REQUESTS));
    let df = read_parquet(&req_path)?;
    let idx = column(strings(&df, schema::CELL_KEY)?, &req_path, schema::CELL_KEY)?;
    let id = column(ints(&df, "id")?, &req_path, "id")?;
    let prompt = column(ints(&df, "prompt_len")?, &req_path, "prompt_len")?;
    let out_len = column(ints(&df, "output_len")?, &req_path, "output_len")?;
    let arrival = column(floats(&df, "arrival_s")?, &req_path, "arrival_s")?;
    let mut reqs: HashMap<String, Vec<(i64, SimRequest)>> = HashMap::new();
    for i in 0..df.height() {
        let (Some(c), Some(id), Some(p), Some(o), Some(a)) =
            (idx[i].clone(), id[i], prompt[i], out_len[i], arrival[i])
        else {
            bail!("{}: row {i} has a null length or time", req_path.display());
        };
        reqs.entry(c).or_default().push((
            id,
            SimRequest {
                prompt_len: p as usize,
                max_new_tokens: o as usize,
                arrival_s: a,
            },
        ));
    }
    let step_path = dir.join(schema::file_name(schema::STEPS));
    let df = read_parquet(&step_path)?;
    let sidx = column(
        strings(&df, schema::CELL_KEY)?,
        &step_path,
        schema::CELL_KEY,
    )?;
    let step = column(ints(&df, "step")?, &step_path, "step")?;
    let pre = column(
        ints(&df, "num_prefill_tokens")?,
        &step_path,
        "num_prefill_tokens",
    )?;
    let dec = column(
        ints(&df, "num_decode_tokens")?,
        &step_path,
        "num_decode_tokens",
    )?;
    let parts: Vec<Vec<Option<f64>>> = ["schedule_s", "compute_s", "cache_ops_s", "sample_s"]
        .iter()
        .map(|n| column(floats(&df, n)?, &step_path, n))
        .collect::<Result<_>>()?;
    let mut steps: HashMap<String, Vec<(i64, (usize, usize, f64))>> = HashMap::new();
    for i in 0..df.height() {
        let (Some(c), Some(s), Some(p), Some(d)) = (sidx[i].clone(), step[i], pre[i], dec[i])
        else {
            bail!("{}: row {i} has a null count", step_path.display());
        };
        let secs: Option<f64> = parts.iter().map(|col| col[i]).sum();
        let secs =
            secs.with_context(|| format!("{}: row {i} has a null time", step_path.display()))?;
        steps
            .entry(c)
            .or_default()
            .push((s, (p as usize, d as usize, secs)));
    }
    let mut out = HashMap::new();
    for (c, mut r) in reqs {
        r.sort_by_key(|x| x.0);
        let mut s = steps.remove(&c).unwrap_or_default();
        s.sort_by_key(|x| x.0);
        out.insert(
            c,
            (
                r.into_iter().map(|x| x.1).collect(),
                s.into_iter().map(|x| x.1).collect(),
            ),
        );
    }
    Ok(out)
}

/// A measured experiment: its plan (from the `experiment.yaml` kept beside its
/// tables), its model's shapes and its runs.
pub struct Measured {
    pub dir: std::path::PathBuf,
    pub plan: Plan,
    pub cfg: ModelConfig,
}

impl Measured {
    pub fn load(dir: &Path, models_dir: &Path) -> Result<Self> {
        let yaml = dir.join("experiment.yaml");
        if !yaml.is_file() {
            bail!(
                "{}: no experiment.yaml; expected a results directory written by `kvbench run`",
                dir.display()
            );
        }
        let plan = Plan::load(&yaml, models_dir)?;
        if plan.exp.kind != Kind::Performance {
            bail!(
                "{}: a `kind: {}` experiment; the cost model needs performance cells",
                dir.display(),
                plan.exp.kind.name()
            );
        }
        let cfg = model_config(&plan, models_dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            plan,
            cfg,
        })
    }

    pub fn name(&self) -> String {
        self.plan.exp.name.clone()
    }

    /// Every recorded cell of this plan with its outcome and row.
    pub fn runs(&self) -> Result<Vec<RunRow>> {
        let path = self.dir.join(schema::RUNS_FILE);
        let df = read_parquet(&path)?;
        // By key, not identity: an identity counts the CPU threads of the machine that
        // ran the cell, and results come from other machines.
        let keys = column(strings(&df, schema::CELL_KEY)?, &path, schema::CELL_KEY)?;
        let outcomes = column(strings(&df, "outcome")?, &path, "outcome")?;
        // Tables written before builds were recorded have no such column.
        let builds = strings(&df, schema::ENV_BUILD)?.unwrap_or_else(|| vec![None; outcomes.len()]);
        let by_key: HashMap<String, &Cell> = self.plan.cells.iter().map(|c| (c.key(), c)).collect();
        let mut out = Vec::new();
        for (row, ((key, outcome), build)) in keys.iter().zip(&outcomes).zip(builds).enumerate() {
            let Some(cell) = key.as_deref().and_then(|k| by_key.get(k)) else {
                continue;
            };
            out.push(RunRow {
                cell: (*cell).clone(),
                row,
                outcome: outcome.clone().unwrap_or_default(),
                build,
            });
        }
        Ok(out)
    }

    /// Observations of every `ok` cell on `device` (the device table's entry for the
    /// machine that measured them).
    /// Only the cells of `engines` when it is not empty.
    pub fn observations(
        &self,
        device: &Device,
        engines: &[String],
    ) -> Result<(CellObservations, usize)> {
        let data = measured(&self.dir)?;
        let mut all = CellObservations::default();
        let mut cells = 0;
        for run in self.runs()?.into_iter().filter(|r| r.outcome == "ok") {
            let cell = run.cell;
            if !engines.is_empty() && !engines.contains(&cell.engine) {
                continue;
            }
            let setup = cell_setup(
                &self.plan,
                &cell,
                &self.cfg,
                precision(&self.plan, device.kind)?,
                device.kind,
            )?;
            if let Some(why) = setup.not_modelled() {
                all.left_out.push((cell.key(), why));
                continue;
            }
            let Some((reqs, steps)) = data.get(&cell.key()) else {
                continue;
            };
            if reqs.is_empty() || steps.is_empty() {
                continue;
            }
            let o = cell_observations(&self.plan, &cell, &self.cfg, device, reqs, steps)
                .with_context(|| format!("{}: cell {}", self.dir.display(), cell.key()))?;
            cells += 1;
            all.builds
                .insert(run.build.unwrap_or_else(|| "not recorded".into()));
            all.prefill.extend(o.prefill);
            all.decode.extend(o.decode);
            all.aligned += o.aligned;
            all.dropped += o.dropped;
        }
        Ok((all, cells))
    }
}

/// One row of runs.parquet that belongs to the plan.
pub struct RunRow {
    pub cell: Cell,
    pub row: usize,
    pub outcome: String,
    /// The build that measured it (`None` in tables without the column, or for a cell
    /// recorded before builds were).
    pub build: Option<String>,
}

/// Fit a calibration of `device` to the steps of measured experiments (of the cells
/// of `engines` only, when it is not empty).
/// `rates_from`: another calibration of the device (and its name) whose fitted values
/// the terms these runs never exercise take ([`Calibration::fit_with`]).
pub fn calibrate(
    measured: &[Measured],
    device: &Device,
    engines: &[String],
    rates_from: Option<(&Calibration, &str)>,
) -> Result<(Calibration, CellObservations)> {
    let mut all = CellObservations::default();
    let mut sources = Vec::new();
    for m in measured {
        let (o, cells) = m.observations(device, engines)?;
        if cells == 0 {
            bail!(
                "{}: no cell with outcome ok and recorded steps to fit{}{}",
                m.dir.display(),
                if engines.is_empty() {
                    String::new()
                } else {
                    format!(" among the engines {}", engines.join(", "))
                },
                match o.left_out.first() {
                    Some((_, why)) => format!(" ({} left out: {why})", o.left_out.len()),
                    None => String::new(),
                }
            );
        }
        sources.push(m.name());
        all.prefill.extend(o.prefill);
        all.decode.extend(o.decode);
        all.aligned += o.aligned;
        all.dropped += o.dropped;
        all.left_out.extend(o.left_out);
        all.builds.extend(o.builds);
    }
    let mut c = Calibration::fit_with(device, sources, &all.prefill, &all.decode, rates_from)?;
    c.builds = all.builds.iter().cloned().collect();
    Ok((c, all))
}

/// A validation's predicted outcome, and the start of a prediction's error, for a cell
/// the model does not describe ([`cost::Setup::not_modelled`]).
pub const NOT_MODELLED: &str = "not modelled";

/// The metrics a validation compares, as runs.parquet names them.
pub const VALIDATED: [&str; 4] = [
    schema::TTFT_MEAN_S,
    schema::TPOT_MEAN_S,
    schema::DECODE_TOK_S,
    schema::E2E_MEAN_S,
];

/// Measured against predicted, cell by cell.
#[derive(Debug, Clone)]
pub struct CellCheck {
    pub key: String,
    /// The cell's prefill attention (a calibration fitted on one implementation says
    /// little of another's score matrices).
    pub attention: String,
    pub measured_outcome: String,
    pub predicted_outcome: String,
    /// Per metric of [`VALIDATED`]: (measured, predicted) where both exist.
    pub values: Vec<(Option<f64>, Option<f64>)>,
}

/// Summary of one metric over the cells where both sides have it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricError {
    pub metric: &'static str,
    pub cells: usize,
    pub median_abs_rel: f64,
    pub max_abs_rel: f64,
}

/// Predict every recorded cell of `m` with `target` and set each beside its measurement.
pub fn validate(m: &Measured, target: &Target) -> Result<Vec<CellCheck>> {
    let path = m.dir.join(schema::RUNS_FILE);
    let df = read_parquet(&path)?;
    let cols: Vec<Vec<Option<f64>>> = VALIDATED
        .iter()
        .map(|n| column(floats(&df, n)?, &path, n))
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    for r in m.runs()? {
        let p = predict_cell(&m.plan, &r.cell, &m.cfg, target)?;
        let pm = serde_json::to_value(&p.metrics)?;
        let predicted = |name: &str| -> Option<f64> {
            match name {
                schema::TTFT_MEAN_S => pm["ttft_s"]["mean"].as_f64(),
                schema::TPOT_MEAN_S => pm["tpot_s"]["mean"].as_f64(),
                schema::DECODE_TOK_S => pm["decode_throughput"].as_f64(),
                schema::E2E_MEAN_S => pm["e2e_s"]["mean"].as_f64(),
                _ => None,
            }
        };
        out.push(CellCheck {
            key: r.cell.key(),
            attention: r.cell.attention.clone(),
            measured_outcome: r.outcome.clone(),
            predicted_outcome: if p
                .error
                .as_deref()
                .is_some_and(|e| e.starts_with(NOT_MODELLED))
            {
                NOT_MODELLED.to_string()
            } else {
                serde_json::to_value(p.outcome)?
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            },
            values: VALIDATED
                .iter()
                .enumerate()
                .map(|(j, n)| (cols[j][r.row], predicted(n)))
                .collect(),
        });
    }
    Ok(out)
}

/// Median and largest |predicted − measured| / measured per metric; NaN never passes
/// as an error (a cell with a NaN on either side is an error of the validation).
pub fn metric_errors(checks: &[CellCheck]) -> Result<Vec<MetricError>> {
    let mut out = Vec::new();
    for (j, &metric) in VALIDATED.iter().enumerate() {
        let mut errs = Vec::new();
        for c in checks {
            if let (Some(m), Some(p)) = c.values[j] {
                if !(m.is_finite() && p.is_finite()) || m <= 0.0 {
                    bail!("{}: {metric} measured {m}, predicted {p}", c.key);
                }
                errs.push(((p - m) / m).abs());
            }
        }
        errs.sort_by(f64::total_cmp);
        let n = errs.len();
        let median = match n {
            0 => continue,
            n if n % 2 == 1 => errs[n / 2],
            n => (errs[n / 2 - 1] + errs[n / 2]) / 2.0,
        };
        out.push(MetricError {
            metric,
            cells: n,
            median_abs_rel: median,
            max_abs_rel: errs[n - 1],
        });
    }
    Ok(out)
}

/// Cells whose predicted outcome (ok / oom) differs from the measured one.
pub fn outcome_mismatches(checks: &[CellCheck]) -> Vec<&CellCheck> {
    outcome_compared(checks)
        .into_iter()
        .filter(|c| c.measured_outcome != c.predicted_outcome)
        .collect()
}

/// The cells whose outcome a validation compares: measured ok or out of memory (a
/// measured error says nothing of the model) and described by the model.
pub fn outcome_compared(checks: &[CellCheck]) -> Vec<&CellCheck> {
    checks
        .iter()
        .filter(|c| {
            ["ok", "oom"].contains(&c.measured_outcome.as_str())
                && c.predicted_outcome != NOT_MODELLED
        })
        .collect()
}
