//! A performance cell: its workload (prompts of exact token length, arrival times), one
//! engine, the measured requests after the warm-up ones, and the metrics.

use super::shared::{is_oom, load_setup, policy_engine, Progress};
use crate::experiment::{Cell, Plan};
use crate::metrics::{compute, CellMetrics};
use crate::setup::{seeded_ids, Setup};
use anyhow::{bail, Context, Result};
use kvbench_datasets::arrivals::{Arrivals, ConcurrencyGate};
use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::prompts::slice_prompts;
use kvbench_datasets::Tokenize;
use kvbench_engines::engine::{Engine, Request, StepOutcome};
use kvbench_engines::ledger::MemoryReport;
use kvbench_engines::policy::SeqInfo;
use kvbench_engines::tokenizer::TextTokenizer;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Ok,
    Oom,
    Error,
}

#[derive(Debug, Serialize)]
pub struct CellResult {
    /// The cell's identity ([`crate::experiment::matrix::identity`]).
    pub id: String,
    pub key: String,
    pub cell: Cell,
    pub outcome: Outcome,
    pub error: Option<String>,
    pub metrics: Option<CellMetrics>,
    pub memory: Option<MemoryReport>,
    /// Bytes moved over the measured requests.
    pub h2d_bytes: Option<u64>,
    pub d2h_bytes: Option<u64>,
    /// Keys attended by decode rows over what full attention would read.
    pub attended_fraction: Option<f64>,
    /// Seconds the cell took, set-up included.
    pub wall_s: f64,
    /// Of those, seconds before the engine was built (the model loaded onto its device,
    /// the workload drawn) and from then to the measured requests' start (the engine's
    /// construction and allocation, the warm-up requests): where a cell's time outside
    /// the measurement goes. Null where not measured (a prediction; a run that failed
    /// before that point).
    pub load_s: Option<f64>,
    pub warmup_s: Option<f64>,
    /// Where it ran.
    pub env: crate::environment::Environment,
    /// Most resident memory of this process and most GPU memory in use (NVML) while
    /// the engine ran; null when not measured.
    pub process_rss_peak_bytes: Option<u64>,
    pub gpu_used_peak_bytes: Option<u64>,
    /// The memory time series (every 100 ms).
    pub samples: Vec<crate::sampler::Sample>,
    /// Per measured request and per engine step, for the requests and steps tables.
    pub requests: Vec<kvbench_engines::trace::RequestOutput>,
    pub steps: Vec<kvbench_engines::trace::StepTrace>,
    /// Predicted by the cost model (`kvbench predict`), not measured.
    pub predicted: bool,
}

struct Tok<'a>(&'a TextTokenizer);

impl Tokenize for Tok<'_> {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.0.encode(text).map_err(|e| e.to_string())
    }
}

/// Token stream of a corpus: one UTF-8 file, or every `.txt` file of a directory in
/// name order.
fn corpus_tokens(src: &Path, tok: &TextTokenizer) -> Result<Vec<u32>> {
    let files = crate::experiment::matrix::corpus_files(src)
        .map_err(|e| anyhow::anyhow!("workload source {e}"))?;
    let mut tokens = Vec::new();
    for f in files {
        let c = Corpus::from_file(&f)?;
        tokens.extend(c.tokenize(&Tok(tok))?);
    }
    Ok(tokens)
}

/// The lengths and arrival times of a cell's requests, warm-up ones first: all the
/// cost model needs of a workload.
pub(crate) struct Shape {
    pub prompt_lens: Vec<usize>,
    pub output_len: usize,
    /// Warm-up requests arrive at 0; the measured ones follow their process.
    pub arrivals: Vec<f64>,
    pub warmup: usize,
}

/// The shape of the cell's workload: `warmup` + the measured requests' prompt lengths
/// and scheduled arrival times, the same for every engine and repeat of a matrix point
/// (seeded by the experiment's seed).
pub(crate) fn workload_shape(plan: &Plan, cell: &Cell) -> Result<Shape> {
    let e = &plan.exp;
    let w = e
        .workload
        .as_ref()
        .context("a performance cell needs the experiment's `workload`")?;
    let (Some(prompt_len), Some(output_len)) = (&cell.prompt_len, cell.output_len) else {
        bail!(
            "cell {}: a performance cell needs a prompt and an output length",
            cell.index
        );
    };
    let measured = w.requests(cell.batch);
    let prompt_lens = prompt_len.dist().sample(e.warmup + measured, e.seed)?;
    let process = if cell.request_rate.is_finite() {
        Arrivals::Poisson {
            rate: cell.request_rate,
            burstiness: cell.burstiness,
        }
    } else {
        Arrivals::AllAtZero
    };
    let times = process.times(measured, e.seed)?;
    let mut arrivals = vec![0.0; e.warmup];
    arrivals.extend(times);
    Ok(Shape {
        prompt_lens,
        output_len,
        arrivals,
        warmup: e.warmup,
    })
}

/// The cell's requests ([`workload_shape`] with their prompts' tokens). Under a
/// concurrency cap a measured request's arrival is when it is sent ([`drive`]).
fn workload(plan: &Plan, cell: &Cell, setup: &Setup) -> Result<Vec<Request>> {
    let e = &plan.exp;
    let shape = workload_shape(plan, cell)?;
    let lengths = &shape.prompt_lens;
    let vocab = setup.loaded.model.cfg.vocab_size;
    let source = e.workload.as_ref().and_then(|w| w.source.as_ref());
    let prompts = match source {
        Some(src) => {
            let tokens = corpus_tokens(src, &setup.loaded.tokenizer)?;
            slice_prompts(&tokens, lengths, e.seed)?
        }
        None => {
            let mut s = e.seed ^ 0x9e37_79b9_7f4a_7c15;
            lengths
                .iter()
                .map(|&l| seeded_ids(l, vocab, &mut s))
                .collect()
        }
    };
    let warmup_tokens = e.warmup_tokens.unwrap_or(shape.output_len);
    Ok(prompts
        .into_iter()
        .zip(&shape.arrivals)
        .enumerate()
        .map(|(i, (p, &arrival_s))| {
            let tokens = if i < shape.warmup {
                warmup_tokens
            } else {
                shape.output_len
            };
            Request {
                arrival_s,
                ..Request::greedy(p, tokens)
            }
        })
        .collect())
}

fn engine(plan: &Plan, cell: &Cell, setup: &Setup, models_dir: &Path) -> Result<Engine> {
    policy_engine(plan, cell, setup, models_dir, None)
}

/// What [`drive`] steps: the engine, or the cost model's simulation of it
/// (`crate::prediction`), so that a predicted cell is driven exactly as a measured one.
pub(crate) trait Stepper {
    /// Seconds on the engine clock.
    fn now(&self) -> f64;
    /// Finish time of the `i`-th request to finish, once it has.
    fn finish_time(&self, i: usize) -> Option<f64>;
    /// Send request `i` of the workload, arriving at `arrival_s`.
    fn submit(&mut self, i: usize, arrival_s: f64) -> Result<()>;
    fn step(&mut self) -> Result<StepOutcome>;
    /// Let time pass until `t` (the engine sleeps; a simulation moves its clock).
    fn wait_until(&mut self, t: f64);
}

struct Live<'a> {
    eng: &'a mut Engine,
    reqs: &'a [Request],
}

impl Stepper for Live<'_> {
    fn now(&self) -> f64 {
        self.eng.now()
    }

    fn finish_time(&self, i: usize) -> Option<f64> {
        self.eng.finished().get(i).map(|o| o.finished_s)
    }

    fn submit(&mut self, i: usize, arrival_s: f64) -> Result<()> {
        self.eng.add_request(Request {
            arrival_s,
            ..self.reqs[i].clone()
        })?;
        Ok(())
    }

    fn step(&mut self) -> Result<StepOutcome> {
        Ok(self.eng.step()?)
    }

    fn wait_until(&mut self, t: f64) {
        let wait = t - self.eng.now();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
    }
}

/// Hand the requests (scheduled at `arrivals`) to the engine and step it until all
/// have finished, reporting each step's tokens to `on_step`. With a cap, at most
/// `cap` requests are in flight: a request due while the cap is full is sent when one
/// finishes, and its arrival is the finish time that freed its slot (the engine's own
/// finish time, so that TTFT and E2E run from the moment vLLM's client would send it).
/// Without a cap every request goes to the engine at once with its scheduled arrival,
/// and the engine waits for it.
pub(crate) fn drive(
    eng: &mut dyn Stepper,
    arrivals: Vec<f64>,
    cap: Option<usize>,
    on_step: &mut dyn FnMut(usize),
) -> Result<()> {
    let total = arrivals.len();
    let mut gate = ConcurrencyGate::new(arrivals, cap)?;
    // Requests finished before this workload (a warm-up's) hold no slot.
    let mut seen = 0;
    while eng.finish_time(seen).is_some() {
        seen += 1;
    }
    loop {
        while let Some(t) = eng.finish_time(seen) {
            gate.release(t);
            seen += 1;
        }
        for (i, arrival_s) in gate.ready(eng.now()) {
            eng.submit(i, arrival_s)?;
        }
        match eng.step()? {
            StepOutcome::Ran(t) => on_step(t.num_tokens),
            StepOutcome::Idle { until_s } => {
                eng.wait_until(until_s.min(gate.next_send().unwrap_or(f64::INFINITY)))
            }
            StepOutcome::Done => match gate.next_send() {
                Some(t) => eng.wait_until(t),
                None if gate.all_sent() => return Ok(()),
                None => bail!(
                    "max concurrency: {} request(s) in flight but none in the engine, {} of {} sent",
                    gate.in_flight(),
                    gate.sent(),
                    total
                ),
            },
        }
    }
}

fn drive_live(
    eng: &mut Engine,
    reqs: &[Request],
    cap: Option<usize>,
    progress: &mut Progress,
) -> Result<()> {
    let arrivals = reqs.iter().map(|r| r.arrival_s).collect();
    drive(&mut Live { eng, reqs }, arrivals, cap, &mut |n| {
        progress.step(n)
    })
}

/// Run one cell; errors of the run itself become the `oom` or `error` outcome.
pub fn run_cell(plan: &Plan, cell: &Cell, models_dir: &Path) -> Result<CellResult> {
    let t0 = Instant::now();
    let e = &plan.exp;
    let setup = load_setup(plan, models_dir)?;
    let requests = workload(plan, cell, &setup)?;
    let mut progress = Progress::new(
        requests
            .iter()
            .map(|r| (r.prompt.len() + r.max_new_tokens - 1) as u64)
            .sum(),
    );
    let gpu = setup.gpu_index();
    let mut result = CellResult {
        env: crate::environment::Environment::collect(&setup.device.to_string(), gpu),
        id: cell.id.clone(),
        key: cell.key(),
        cell: cell.clone(),
        outcome: Outcome::Ok,
        error: None,
        metrics: None,
        memory: None,
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
        predicted: false,
    };
    result.load_s = Some(t0.elapsed().as_secs_f64());
    let sampler = crate::sampler::Sampler::start(std::time::Duration::from_millis(100), gpu);
    let mut warmup_s = None;
    let mut run = || -> Result<(Engine, usize, usize)> {
        let built = Instant::now();
        let mut eng = engine(plan, cell, &setup, models_dir)?;
        // At most `batch` requests are held at once: room for the longest ones is
        // allocated before anything is timed.
        let mut held: Vec<SeqInfo> = requests
            .iter()
            .map(|r| SeqInfo {
                prompt_len: r.prompt.len(),
                max_new_tokens: r.max_new_tokens,
                prefill_len: r.prompt.len(),
            })
            .collect();
        held.sort_unstable_by_key(|i| std::cmp::Reverse(i.prompt_len + i.max_new_tokens));
        eng.prepare(&held[..cell.batch.min(held.len())])?;
        let (warm, measured) = requests.split_at(e.warmup);
        // Warm-up requests all go at once, whatever the cap.
        drive_live(&mut eng, warm, None, &mut progress)?;
        let (skip_out, skip_steps) = (eng.finished().len(), eng.traces().len());
        warmup_s = Some(built.elapsed().as_secs_f64());
        eng.reset_clock();
        drive_live(&mut eng, measured, cell.max_concurrency, &mut progress)?;
        Ok((eng, skip_out, skip_steps))
    };
    let outcome = run();
    result.warmup_s = warmup_s;
    progress.finish();
    let samples = sampler.finish();
    result.process_rss_peak_bytes = samples.iter().filter_map(|x| x.process_rss_bytes).max();
    result.gpu_used_peak_bytes = samples.iter().filter_map(|x| x.gpu_used_bytes).max();
    result.samples = samples;
    match outcome {
        Ok((eng, skip_out, skip_steps)) => {
            // Whether decode steps ran from CUDA graphs, for the log of a CUDA run with
            // graphs on (a strategy without decode graphs runs every step as it is).
            let g = eng.graph_stats();
            if eng.model().device().is_cuda() && kvbench_engines::decode_graphs::chosen() {
                eprintln!(
                    "decode graphs: {} captured, {} steps replayed{}",
                    g.captured,
                    g.replayed,
                    if g.replayed == 0 {
                        " (none: this strategy, device or step kind runs without graphs)"
                    } else {
                        ""
                    }
                );
            }
            let outs = &eng.finished()[skip_out..];
            let steps = &eng.traces()[skip_steps..];
            // The clock was reset at the benchmark's start: 0 on it.
            let slo = cell.slo.map(|s| s.seconds()).unwrap_or_default();
            result.metrics = Some(compute(outs, steps, slo, 0.0));
            result.memory = Some(eng.memory());
            result.h2d_bytes = Some(steps.iter().map(|t| t.h2d_bytes).sum());
            result.d2h_bytes = Some(steps.iter().map(|t| t.d2h_bytes).sum());
            let att: u64 = steps.iter().filter_map(|t| t.attended_tokens).sum();
            let ctx: u64 = steps.iter().filter_map(|t| t.context_tokens).sum();
            result.attended_fraction = (ctx > 0).then(|| att as f64 / ctx as f64);
            result.requests = outs.to_vec();
            result.steps = steps.to_vec();
        }
        Err(err) => {
            result.outcome = if is_oom(&err) {
                Outcome::Oom
            } else {
                Outcome::Error
            };
            result.error = Some(format!("{err:#}"));
        }
    }
    result.wall_s = t0.elapsed().as_secs_f64();
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(extra: &str) -> Plan {
        let text = format!(
            "name: t\nmodel: preset:tiny\nengines:\n  - name: full\nmatrix:\n  batch: [2]\n  \
             prompt_len: [16]\n  output_len: [8]\nworkload:\n  num_requests: 2\n{extra}"
        );
        Plan::parse(&text, Path::new("exp.yaml"), Path::new("models")).unwrap()
    }

    fn lengths(plan: &Plan) -> Vec<usize> {
        let setup = load_setup(plan, Path::new("models")).unwrap();
        workload(plan, &plan.cells[0], &setup)
            .unwrap()
            .iter()
            .map(|r| r.max_new_tokens)
            .collect()
    }

    #[test]
    fn warmup_requests_generate_warmup_tokens_and_the_measured_ones_the_output_length() {
        assert_eq!(lengths(&plan("warmup: 2\n")), [8, 8, 8, 8]);
        assert_eq!(
            lengths(&plan("warmup: 2\nwarmup_tokens: 3\n")),
            [3, 3, 8, 8]
        );
    }
}
