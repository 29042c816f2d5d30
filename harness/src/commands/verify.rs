//! `kvbench verify`: every strategy × attention implementation at budget 1.0 must
//! reproduce `full` + `eager` (the universal regression test of algorithms.md §1), and
//! at a small budget each strategy must hold and attend what its budget allows (the
//! audit).

use crate::setup::{host_memory_bytes, load_model, seeded_ids, skewing, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::decode_graphs::GraphStats;
use kvbench_engines::device::DeviceKind;
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::policy::audit::{allowed_device_bytes, nominal_device_bytes};
use kvbench_engines::policy::registry::{registry, Strategy, Variant};
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::policy::SeqInfo;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use serde::Serialize;

#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", env = "KVBENCH_DEVICE")]
    pub device: String,

    /// Tokens of the first prompt (a second one has two thirds of it).
    #[arg(long, default_value_t = 96)]
    pub prompt_tokens: usize,

    /// Generated tokens compared per request.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,

    /// Largest |Δlogit| accepted at budget 1.0 (positive). Default: 1e-3 for f32
    /// weights, 5e-2 for 16-bit weights, 1e-2 for quantized ones.
    #[arg(long, allow_hyphen_values = true)]
    pub tolerance: Option<f32>,

    /// Budget of the audit pass, in (0, 1).
    #[arg(long, default_value_t = 0.3, allow_hyphen_values = true)]
    pub audit_budget: f64,

    /// Text calibrating InfiniGen's skewing (default: seeded random tokens).
    #[arg(long, env = "KVBENCH_CALIBRATION")]
    pub calibration: Option<std::path::PathBuf>,

    /// Only the CUDA kernels against their references (seconds): no strategy rows. For
    /// checking a kernel chosen by a switch (e.g. KVBENCH_PAGED_DECODE=pipe) before
    /// timing it.
    #[arg(long)]
    pub kernels_only: bool,

    /// Print exactly one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    engine: &'static str,
    attention: String,
    budget: f64,
    params: serde_json::Value,
    /// Largest |Δlogit| against full + eager (budget 1.0 rows only).
    max_abs_logit_diff: Option<f32>,
    /// Device KV bytes held for the first request just before it finished (null when
    /// nothing finished: an error row, or the dense reference, which has no cache).
    kv_device_bytes: Option<u64>,
    /// What the budget allows for it (audit rows only).
    kv_device_allowed_bytes: Option<u64>,
    pass: bool,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    weights_dtype: String,
    device: String,
    tolerance: f32,
    /// 16-bit weights: largest |Δlogit| between the plain forward in the weights'
    /// dtype and in f32 (the model's own rounding noise).
    noise_floor: Option<f32>,
    prompt_tokens: Vec<usize>,
    steps: usize,
    /// CUDA kernels against the host reference (CUDA devices only).
    kernels: Vec<KernelCheck>,
    results: Vec<Row>,
    pass: bool,
}

struct Outcome {
    logits: Vec<Vec<Vec<f32>>>,
    outputs: Vec<Vec<u32>>,
    kv_device_bytes: Option<u64>,
    graphs: GraphStats,
}

pub fn run(mut a: VerifyArgs) -> Result<()> {
    // Quantized matmuls amplify fp noise by orders of magnitude (docs/correctness-and-
    // performance.md), so the comparison runs on dequantized weights unless a dtype is
    // asked for.
    if a.model.dtype == crate::setup::DtypeArg::Auto && a.device == "cpu" {
        a.model.dtype = crate::setup::DtypeArg::F32;
    }
    if a.kernels_only && a.device.parse::<DeviceKind>()? == DeviceKind::Cpu {
        bail!("--kernels-only checks the CUDA kernels: it needs --device cuda");
    }
    if a.prompt_tokens < 8 {
        bail!("--prompt-tokens {}: expected at least 8", a.prompt_tokens);
    }
    if a.steps == 0 {
        bail!("--steps 0: expected at least 1");
    }
    if let Some(t) = a.tolerance {
        if !(t.is_finite() && t > 0.0) {
            bail!("--tolerance {t}: expected a positive |Δlogit| such as 1e-3");
        }
    }
    if !(a.audit_budget > 0.0 && a.audit_budget < 1.0) {
        bail!(
            "--audit-budget {}: expected a fraction in (0, 1)",
            a.audit_budget
        );
    }
    let setup = load_model(&a.model, &a.device)?;
    let model = &setup.loaded.model;
    let cfg = &model.cfg;
    let total = a.prompt_tokens + a.steps;
    if total > cfg.max_position_embeddings {
        bail!(
            "--prompt-tokens {} + --steps {} exceed the model's context of {}",
            a.prompt_tokens,
            a.steps,
            cfg.max_position_embeddings
        );
    }
    if a.kernels_only {
        // Before anything else is made (InfiniGen's calibration among it).
        let kernels = kernel_checks(model.device())?;
        // No checks at all (a build without them) is a failure, not a pass.
        let pass = !kernels.is_empty() && kernels.iter().all(|k| k.pass);
        let report = Report {
            model: setup.spec.clone(),
            weights_dtype: model.weight_dtype.to_string(),
            device: setup.device.to_string(),
            tolerance: 0.0,
            noise_floor: None,
            prompt_tokens: Vec::new(),
            steps: 0,
            kernels,
            results: Vec::new(),
            pass,
        };
        return finish(&report, a.json);
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut tokens = |n: usize| seeded_ids(n, cfg.vocab_size, &mut state);
    let prompts = [tokens(a.prompt_tokens), tokens(a.prompt_tokens * 2 / 3)];
    let on_cuda = setup.device != DeviceKind::Cpu;
    let skew = skewing(&setup, a.calibration.as_deref(), &a.model.models_dir)?;
    let make = |name: &str, budget: f64, extra: &[(&str, &str)]| -> Result<PolicySpec> {
        let params: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut s = PolicySpec::parse(name, budget, &params)?;
        if s.needs_skewing() {
            s.set_skewing(skew.clone());
        }
        Ok(s)
    };
    let host = host_memory_bytes();
    let engine_cfg = |policy: PolicySpec, attention: AttentionImpl| EngineConfig {
        device_name: setup.device.to_string(),
        device_memory: Some(host),
        memory_fraction: 0.9,
        // Enough blocks for both requests; small steps so prompts span several
        // chunks and mix with decodes.
        num_blocks: Some(4 * total.div_ceil(16) + 8),
        max_model_len: Some(total),
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            max_batched_tokens: (a.prompt_tokens / 2).max(8),
            prefill: PrefillMode::Chunked,
        },
        policy,
        attention,
        chunk_size: 16,
        host_memory: Some(host),
        check_invariants: true,
        ..Default::default()
    };
    let run_cfg = |cfg: EngineConfig, forced: Option<&[Vec<u32>]>| -> Result<Outcome> {
        let mut e = Engine::new(model.clone(), cfg)?;
        for (i, p) in prompts.iter().enumerate() {
            e.add_request(Request {
                forced_output: forced.map_or(Vec::new(), |f| f[i].clone()),
                record_logits: true,
                ..Request::greedy(p.clone(), a.steps)
            })?;
        }
        e.run()?;
        let mut out = e.finished().to_vec();
        out.sort_by_key(|r| r.id);
        Ok(Outcome {
            graphs: e.graph_stats(),
            kv_device_bytes: out.first().map(|r| r.kv_device_bytes),
            outputs: out.iter().map(|r| r.output.clone()).collect(),
            logits: out.into_iter().map(|r| r.logits).collect(),
        })
    };
    let run_one = |policy: PolicySpec, attention: AttentionImpl, forced: Option<&[Vec<u32>]>| {
        run_cfg(engine_cfg(policy, attention), forced)
    };

    let kernels = kernel_checks(model.device())?;
    let reference = run_one(PolicySpec::full(), AttentionImpl::Eager, None)
        .context("reference run (full + eager)")?;
    let forced = reference.outputs.clone();
    // 16-bit weights: how far the plain 16-bit forward lands from the same weights in
    // f32 (the rounding noise of the model itself). Two 16-bit computations of the same
    // function may differ by about twice that.
    let dense = dense_logits(model, &prompts, &reference.outputs)?;
    // The floor is measured on the separate products: fused products (CUDA) are
    // checked against them below, and must not widen the tolerance they are held to.
    let separate = model
        .projections_fused()
        .then(|| {
            dense_logits(
                &model.with_separate_projections(),
                &prompts,
                &reference.outputs,
            )
        })
        .transpose()?;
    let noise_floor = match model.weight_dtype {
        WeightDtype::F16 | WeightDtype::Bf16 => {
            let truth = dense_logits(&model.to_f32()?, &prompts, &reference.outputs)?;
            Some(max_abs_diff(separate.as_ref().unwrap_or(&dense), &truth))
        }
        _ => None,
    };
    if let Some(f) = noise_floor.filter(|f| !f.is_finite()) {
        // A NaN or infinite logit in the model itself would widen the tolerance to ∞.
        anyhow::bail!("the dense forward of the model has non-finite logits (noise floor {f}): nothing can be verified against it");
    }
    let tolerance = a.tolerance.unwrap_or(match model.weight_dtype {
        WeightDtype::F32 => 1e-3,
        WeightDtype::Quantized => 1e-2,
        WeightDtype::F16 | WeightDtype::Bf16 => (2.0 * noise_floor.unwrap_or(0.0)).max(5e-2),
    });
    let mut rows = Vec::new();
    let d = max_abs_diff(&dense, &reference.logits);
    let complete = dense.iter().map(Vec::len).sum::<usize>()
        == reference.logits.iter().map(Vec::len).sum::<usize>();
    rows.push(Row::forward(
        "dense-reference",
        d,
        complete && passes(d, tolerance),
    ));
    if let Some(sep) = &separate {
        // Q/K/V and gate/up as one product each, against the same weights' separate
        // products: over the prompts, and for one token alone (a batch-1 decode step's
        // rows, which take Q, K and V in a single product).
        let one = [vec![prompts[0][0]]];
        let none = [Vec::new()];
        let d = max_abs_diff(&dense, sep).max(max_abs_diff(
            &dense_logits(model, &one, &none)?,
            &dense_logits(&model.with_separate_projections(), &one, &none)?,
        ));
        rows.push(Row::forward("fused-projections", d, passes(d, tolerance)));
    }
    // Where the model runs a few rows' products in kvbench's matrix-vector kernel
    // (CUDA, bf16, `KVBENCH_GEMV=kvbench`), against cuBLAS's on the same weights: one
    // token alone (Q/K/V as one product) and three rows (inputs interleaved in the
    // stacked pairs' outputs), every logit of each.
    if model.products_in_gemv() {
        let (in_gemv, in_cublas) = (model, &model.clone().with_products_in_gemv(false));
        let few = [
            vec![prompts[0][0]],
            prompts[0].iter().copied().cycle().take(3).collect(),
        ];
        let none = [Vec::new(), Vec::new()];
        let d = max_abs_diff(
            &dense_logits(in_gemv, &few, &none)?,
            &dense_logits(in_cublas, &few, &none)?,
        );
        rows.push(Row::forward("gemv", d, passes(d, tolerance)));
    }
    // Every strategy at budget 1.0 with each attention implementation (the same list
    // on CPU and CUDA: each has device kernels).
    let impls = [
        AttentionImpl::Eager,
        AttentionImpl::Chunked,
        AttentionImpl::Flash,
    ];
    // Each registered strategy's parameter sets (the same on CPU and CUDA but for
    // paths only the CUDA policy has).
    let variants = |pick: fn(&Strategy) -> &'static [Variant]| -> Vec<(&'static str, &'static [(&'static str, &'static str)])> {
        registry()
            .iter()
            .filter(|s| s.cuda || !on_cuda)
            .flat_map(|s| pick(s).iter().map(move |v| (s.name, v)))
            .filter(|(_, v)| v.runs_on(on_cuda))
            .map(|(name, v)| (name, v.params))
            .collect()
    };
    for s in registry().iter().filter(|s| on_cuda && !s.cuda) {
        eprintln!(
            "{}: no CUDA implementation (refused on CUDA with a named error), verified on the CPU only",
            s.name
        );
    }
    let strategies = variants(|s| s.verify);
    let mut combos: Vec<(PolicySpec, AttentionImpl)> = Vec::new();
    for imp in impls {
        for (name, extra) in &strategies {
            combos.push((make(name, 1.0, extra)?, imp));
        }
    }
    for (spec, imp) in combos {
        let (engine, params) = (spec.name(), spec.params_json());
        let row = match run_one(spec, imp, Some(&forced)) {
            Ok(o) => {
                let d = max_abs_diff(&reference.logits, &o.logits);
                let complete = o.logits.iter().map(Vec::len).sum::<usize>()
                    == reference.logits.iter().map(Vec::len).sum::<usize>();
                Row {
                    engine,
                    attention: imp.to_string(),
                    budget: 1.0,
                    params,
                    max_abs_logit_diff: Some(d),
                    kv_device_bytes: o.kv_device_bytes,
                    kv_device_allowed_bytes: None,
                    pass: complete && passes(d, tolerance),
                    error: None,
                }
            }
            Err(e) => Row::failed(engine, imp, 1.0, params, None, &e),
        };
        rows.push(row);
    }

    // CUDA graphs of decode steps (on unless KVBENCH_CUDA_GRAPH=off; captured per row
    // count, context bucket and kind of step): the rows above ran as the switch says, so
    // `full` and `h2o` at budget 1.0 run here the other way too, against the reference;
    // H2O and StreamingLLM (rolling positions: the query rotated on the device) at the
    // audit's budget, where they evict every step, with graphs against themselves
    // without them. A run with graphs in which no step was replayed fails: it would have
    // checked nothing.
    if on_cuda {
        let chosen = kvbench_engines::decode_graphs::chosen();
        eprintln!(
            "graph rows: full and h2o at 1.0 {} graphs against full + eager; h2o and \
             streaming at {} with graphs against themselves without",
            if chosen { "without" } else { "with" },
            a.audit_budget
        );
        for (name, budget) in [
            ("full", 1.0),
            ("h2o", 1.0),
            ("h2o", a.audit_budget),
            ("streaming", a.audit_budget),
        ] {
            let spec = make(name, budget, &[])?;
            let with_graphs = |on: bool| EngineConfig {
                cuda_graphs: Some(on),
                ..engine_cfg(spec.clone(), AttentionImpl::Flash)
            };
            let (graphs, against) = if budget == 1.0 {
                (!chosen, Ok(reference.logits.clone()))
            } else {
                (
                    true,
                    run_cfg(with_graphs(false), Some(&forced)).map(|o| o.logits),
                )
            };
            let ran =
                against.and_then(|want| Ok((want, run_cfg(with_graphs(graphs), Some(&forced))?)));
            // Short keys: the table shows 28 characters of them.
            let params = |o: Option<&Outcome>| match (graphs, o) {
                (false, _) => serde_json::json!({ "graphs": "off" }),
                (true, Some(o)) => serde_json::json!({
                    "graphs": o.graphs.captured,
                    "replays": o.graphs.replayed,
                }),
                (true, None) => serde_json::json!({ "graphs": "on" }),
            };
            let row = match ran {
                Ok((want, o)) => {
                    let d = max_abs_diff(&want, &o.logits);
                    let complete = o.logits.iter().map(Vec::len).sum::<usize>()
                        == want.iter().map(Vec::len).sum::<usize>();
                    let unreplayed = graphs && o.graphs.replayed == 0;
                    Row {
                        engine: spec.name(),
                        attention: AttentionImpl::Flash.to_string(),
                        budget,
                        params: params(Some(&o)),
                        max_abs_logit_diff: Some(d),
                        kv_device_bytes: o.kv_device_bytes,
                        kv_device_allowed_bytes: None,
                        pass: complete && !unreplayed && passes(d, tolerance),
                        error: unreplayed
                            .then(|| "no decode step ran from a CUDA graph".to_string()),
                    }
                }
                Err(e) => Row::failed(
                    spec.name(),
                    AttentionImpl::Flash,
                    budget,
                    params(None),
                    None,
                    &e,
                ),
            };
            rows.push(row);
        }
    }

    // The audit at a small budget: the engine fails the run on any step that attends
    // more keys than the budget allows; the bytes held are checked here as well.
    let b = a.audit_budget;
    let info = SeqInfo {
        prompt_len: prompts[0].len(),
        max_new_tokens: a.steps,
        prefill_len: prompts[0].len(),
    };
    let token_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4) as u64;
    let compute = kvbench_engines::kv::KvCodec::from_candle(model.dtype());
    let audited = variants(|s| s.audit);
    for &(name, extra) in &audited {
        // A strategy that takes no budget (KIVI: its bits set the size) is audited at
        // 1, by the bytes it holds.
        let budgeted = kvbench_engines::policy::registry::lookup(name).is_none_or(|s| s.budgeted);
        let b = if budgeted { b } else { 1.0 };
        let spec = make(name, b, extra)?;
        // Statistics from materialized probabilities need a cuBLAS attention on CUDA.
        let imp = if extra.contains(&("stats", "eager")) {
            AttentionImpl::Eager
        } else {
            AttentionImpl::Flash
        };
        let params = spec.params_json();
        let n = prompts[0].len() + a.steps - 1;
        let allowed = allowed_device_bytes(
            nominal_device_bytes(&spec, cfg, &info, n, compute, None),
            16,
            token_bytes,
        );
        let row = match run_one(spec.clone(), imp, Some(&forced)) {
            Ok(o) => Row {
                engine: spec.name(),
                attention: imp.to_string(),
                budget: b,
                params,
                max_abs_logit_diff: None,
                kv_device_bytes: o.kv_device_bytes,
                kv_device_allowed_bytes: Some(allowed),
                // Nothing measured is a failure, not a pass within the budget.
                pass: o.kv_device_bytes.is_some_and(|k| k > 0 && k <= allowed),
                error: None,
            },
            Err(e) => Row::failed(spec.name(), imp, b, params, Some(allowed), &e),
        };
        rows.push(row);
    }

    let pass = rows.iter().all(|r| r.pass) && kernels.iter().all(|k| k.pass);
    let report = Report {
        kernels,
        model: setup.spec.clone(),
        weights_dtype: model.weight_dtype.to_string(),
        device: setup.device.to_string(),
        tolerance,
        noise_floor,
        prompt_tokens: prompts.iter().map(Vec::len).collect(),
        steps: a.steps,
        results: rows,
        pass,
    };
    finish(&report, a.json)
}

/// Print the report (a table, or one JSON object) and fail when anything failed.
fn finish(report: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_table(report);
    }
    if !report.pass {
        bail!(
            "verify failed: {} of {} combinations, {} of {} kernel checks",
            report.results.iter().filter(|r| !r.pass).count(),
            report.results.len(),
            report.kernels.iter().filter(|k| !k.pass).count(),
            report.kernels.len()
        );
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "kvbench verify: {} ({} weights) on {}; prompts {:?} tokens, {} steps; tolerance {:e}",
        r.model, r.weights_dtype, r.device, r.prompt_tokens, r.steps, r.tolerance
    );
    if let Some(f) = r.noise_floor {
        println!(
            "noise floor: plain {} forward vs f32 forward of the same weights, max|Δlogit| {f:.2e}; tolerance max(5e-2, 2 × floor)",
            r.weights_dtype
        );
    }
    println!(
        "{:<10} {:<8} {:>6}  {:<28} {:>12}  {:>22}  result",
        "engine", "attn", "budget", "params", "max|Δlogit|", "KV device bytes"
    );
    for x in &r.results {
        let params = x.params.to_string();
        let params = if params == "{}" {
            String::new()
        } else {
            params
        };
        let d = x
            .max_abs_logit_diff
            .map_or("-".into(), |d| format!("{d:.2e}"));
        let held = x.kv_device_bytes.map_or("-".into(), |k| k.to_string());
        let bytes = match x.kv_device_allowed_bytes {
            Some(a) => format!("{held} ≤ {a}"),
            None => held,
        };
        let res = match (&x.error, x.pass) {
            (Some(e), _) => format!("FAIL: {e}"),
            (None, true) => "ok".into(),
            (None, false) => "FAIL".into(),
        };
        let params: String = params.chars().take(28).collect();
        println!(
            "{:<10} {:<8} {:>6}  {:<28} {:>12}  {:>22}  {res}",
            x.engine, x.attention, x.budget, params, d, bytes
        );
    }
    print_kernels(&r.kernels);
    println!("{}", if r.pass { "all passed" } else { "FAILED" });
}

#[cfg(feature = "cuda")]
fn print_kernels(k: &[KernelCheck]) {
    for c in k {
        println!(
            "kernel {:<20} rel.err {:.2e} ≤ {:.0e}  {}  {}",
            c.kernel,
            c.rel_err,
            c.tolerance,
            if c.pass { "ok" } else { "FAIL" },
            c.case
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn print_kernels(_k: &[KernelCheck]) {}

/// Logits of every generated step from the model's plain causal attention without a
/// cache (`forward_dense`), teacher-forced on `outputs`.
fn dense_logits(
    model: &kvbench_engines::model::Llama,
    prompts: &[Vec<u32>],
    outputs: &[Vec<u32>],
) -> Result<Vec<Vec<Vec<f32>>>> {
    let mut all = Vec::new();
    for (p, out) in prompts.iter().zip(outputs) {
        let mut seq = p.clone();
        seq.extend(&out[..out.len().saturating_sub(1)]);
        let dense = model
            .forward_dense(&seq)?
            .to_dtype(candle_core::DType::F32)?
            .to_vec2::<f32>()?;
        all.push(dense.into_iter().skip(p.len() - 1).collect());
    }
    Ok(all)
}

/// Whether a difference passes: finite and within a finite tolerance (a NaN logit
/// makes the difference +∞, which no tolerance admits).
impl Row {
    /// A combination whose run ended in an error: nothing measured, a failure.
    fn failed(
        engine: &'static str,
        attention: AttentionImpl,
        budget: f64,
        params: serde_json::Value,
        kv_device_allowed_bytes: Option<u64>,
        e: &anyhow::Error,
    ) -> Self {
        Row {
            engine,
            attention: attention.to_string(),
            budget,
            params,
            max_abs_logit_diff: None,
            kv_device_bytes: None,
            kv_device_allowed_bytes,
            pass: false,
            error: Some(format!("{e:#}")),
        }
    }

    /// A comparison of two cache-free forwards (no strategy, no KV bytes).
    fn forward(engine: &'static str, d: f32, pass: bool) -> Self {
        Row {
            engine,
            attention: "none".into(),
            budget: 1.0,
            params: serde_json::json!({}),
            max_abs_logit_diff: Some(d),
            kv_device_bytes: None,
            kv_device_allowed_bytes: None,
            pass,
            error: None,
        }
    }
}

fn passes(d: f32, tolerance: f32) -> bool {
    d.is_finite() && tolerance.is_finite() && d <= tolerance
}

/// Largest |a − b| over matching logits (infinite when the shapes differ or any value
/// is not finite).
fn max_abs_diff(a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]) -> f32 {
    let same = a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(r, s)| r.len() == s.len()));
    if !same {
        return f32::INFINITY;
    }
    kvbench_engines::compare::max_abs_diff(
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .flat_map(|(x, y)| x.iter().copied().zip(y.iter().copied())),
    )
}

#[cfg(feature = "cuda")]
fn kernel_checks(d: &candle_core::Device) -> Result<Vec<KernelCheck>> {
    if !d.is_cuda() {
        return Ok(Vec::new());
    }
    Ok(kvbench_engines::cuda::check::run(d, 0x006b_7662_656e_6368)?)
}

#[cfg(not(feature = "cuda"))]
fn kernel_checks(_d: &candle_core::Device) -> Result<Vec<KernelCheck>> {
    Ok(Vec::new())
}

#[cfg(feature = "cuda")]
use kvbench_engines::cuda::check::KernelCheck;

/// Kernel checks exist only in CUDA builds.
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Serialize)]
struct KernelCheck {
    pass: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_or_infinite_logits_fail_verification() {
        let reference = vec![vec![vec![0.5f32, -1.0, 2.0]; 3]; 2];
        let close: Vec<Vec<Vec<f32>>> = reference
            .iter()
            .map(|r| {
                r.iter()
                    .map(|l| l.iter().map(|x| x + 1e-4).collect())
                    .collect()
            })
            .collect();
        let d = max_abs_diff(&reference, &close);
        assert!(passes(d, 1e-3), "{d}");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut broken = close.clone();
            broken[1][2][1] = bad;
            let d = max_abs_diff(&reference, &broken);
            assert!(!passes(d, 1e-3), "{bad}: {d}");
            assert!(!passes(d, f32::MAX), "{bad}: {d}");
            // On the reference's side too.
            assert!(!passes(max_abs_diff(&broken, &close), 1e3));
        }
        // Every logit NaN: the old fold reported 0 and passed.
        let all_nan: Vec<Vec<Vec<f32>>> = reference
            .iter()
            .map(|r| r.iter().map(|l| vec![f32::NAN; l.len()]).collect())
            .collect();
        assert!(!passes(max_abs_diff(&reference, &all_nan), 1.0));
        // A shape mismatch fails too, and a non-finite tolerance admits nothing.
        assert!(!passes(max_abs_diff(&reference, &reference[..1]), 1.0));
        assert!(!passes(0.0, f32::INFINITY));
    }
}
