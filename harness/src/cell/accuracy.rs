//! Accuracy cells: lm-eval's multiple-choice log-likelihood tasks scored through an
//! engine, so that a KV policy acts on what the model sees.
//!
//! Each choice of an item is one request: its context and continuation are tokenized as
//! lm-eval's `_encode_pair` does (trailing whitespace of the context moves to the
//! continuation; the continuation's tokens are those of the whole string after the
//! context's), and log P(continuation | context) is the sum over the continuation's
//! tokens of the log-softmax at that token. Two scoring modes:
//!
//! - `decode`: the context is the prompt, prefilled with the policy active; the
//!   continuation is teacher-forced through decode steps. The logits after the prefill
//!   give the first continuation token, those after feeding token i − 1 token i.
//! - `one_pass`: context and continuation are one prompt and the logits of the
//!   continuation's positions are read from the prefill (what lm-eval computes).
//!
//! `acc` takes the choice with the largest sum, `acc_norm` the largest sum per
//! character of the choice; the standard error is lm-eval's (sample deviation / √n).

use super::shared::{load_setup, policy_engine, Progress};
use crate::experiment::{Cell, Plan, ScoringMode};
use crate::setup::Setup;
use anyhow::{bail, Context, Result};
use kvbench_datasets::tasks::{mean_stderr, Item, Task};
use kvbench_engines::engine::{Engine, Request, StepOutcome};
use kvbench_engines::policy::SeqId;
use kvbench_engines::tokenizer::TextTokenizer;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Context and continuation token ids of one request, as lm-eval's `_encode_pair`.
pub fn encode_pair(
    tok: &TextTokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let trimmed = context.trim_end();
    let (context, continuation) = (
        trimmed,
        format!("{}{continuation}", &context[trimmed.len()..]),
    );
    let whole = tok.encode(&format!("{context}{continuation}"))?;
    let ctx = tok.encode(context)?;
    if ctx.is_empty() {
        bail!("empty context: nothing to condition the continuation {continuation:?} on");
    }
    let cont = whole.get(ctx.len()..).unwrap_or_default().to_vec();
    if cont.is_empty() {
        bail!("the continuation {continuation:?} has no tokens of its own after {context:?}");
    }
    Ok((ctx, cont))
}

/// log softmax(row)[target], in f64.
pub fn log_prob(row: &[f32], target: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[target as usize] as f64 - max - sum.ln()
}

/// One request to score: context and continuation tokens.
#[derive(Debug, Clone)]
pub struct Pair {
    pub ctx: Vec<u32>,
    pub cont: Vec<u32>,
}

/// Left-truncate the context so that the request fits `max_len` tokens (lm-eval keeps
/// the last tokens of the input). Returns whether anything was cut.
pub fn fit(p: &mut Pair, max_len: usize, mode: ScoringMode) -> Result<bool> {
    // One-pass generates one token after the prompt.
    let extra = usize::from(mode == ScoringMode::OnePass);
    let room = max_len.saturating_sub(p.cont.len() + extra);
    if room == 0 {
        bail!(
            "a continuation of {} tokens does not fit the context of {max_len}",
            p.cont.len()
        );
    }
    if p.ctx.len() <= room {
        return Ok(false);
    }
    p.ctx.drain(..p.ctx.len() - room);
    Ok(true)
}

/// Sum of log P(continuation | context) of each request, through `eng`. At most
/// `in_flight` requests are in the engine at once (their logits are kept until they
/// finish); `on_tokens` gets each step's token count.
pub fn score(
    eng: &mut Engine,
    reqs: &[Pair],
    mode: ScoringMode,
    in_flight: usize,
    mut on_tokens: impl FnMut(usize),
) -> Result<Vec<f64>> {
    let mut out: Vec<Option<f64>> = vec![None; reqs.len()];
    let mut ids: HashMap<SeqId, usize> = HashMap::new();
    let mut next = 0;
    let mut done = 0;
    while done < reqs.len() {
        while next < reqs.len() && ids.len() < in_flight.max(1) {
            let p = &reqs[next];
            let id = match mode {
                ScoringMode::Decode => eng.add_request(Request {
                    forced_output: p.cont.clone(),
                    record_logits: true,
                    ..Request::greedy(p.ctx.clone(), p.cont.len())
                })?,
                ScoringMode::OnePass => eng.add_request_with_prompt_logits(
                    Request::greedy([p.ctx.as_slice(), &p.cont].concat(), 1),
                    p.ctx.len() - 1,
                )?,
            };
            ids.insert(id, next);
            next += 1;
        }
        match eng.step()? {
            StepOutcome::Ran(t) => on_tokens(t.num_tokens),
            StepOutcome::Idle { .. } => bail!("the scoring engine waited for an arrival"),
            StepOutcome::Done => {}
        }
        for o in eng.take_finished() {
            let i = ids
                .remove(&o.id)
                .with_context(|| format!("the engine finished an unknown request {}", o.id))?;
            let cont = &reqs[i].cont;
            if o.logits.len() < cont.len() {
                bail!(
                    "request {i}: {} logit rows for {} continuation tokens",
                    o.logits.len(),
                    cont.len()
                );
            }
            out[i] = Some(
                cont.iter()
                    .zip(&o.logits)
                    .map(|(&t, row)| log_prob(row, t))
                    .sum(),
            );
            done += 1;
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, x)| x.with_context(|| format!("request {i} was never scored")))
        .collect()
}

/// The items of a cell's task (the first `limit`).
pub fn load_items(data_dir: &Path, task: Task, limit: Option<usize>) -> Result<Vec<Item>> {
    task.load(data_dir, limit).with_context(|| {
        format!(
            "loading {task} from the evaluation data in {}",
            data_dir.display()
        )
    })
}

/// Per-item rows and the task row of `accuracy.parquet`, and the cell's summary.
pub fn rows(
    cell: &Cell,
    task: Task,
    mode: ScoringMode,
    items: &[Item],
    pairs: &[Pair],
    loglik: &[f64],
) -> Result<(Vec<Value>, Value)> {
    let base = |m: &mut Map<String, Value>| {
        m.insert("task".into(), task.name().into());
        m.insert("engine".into(), cell.engine.clone().into());
        m.insert("budget".into(), cell.budget.into());
        m.insert("mode".into(), mode.name().into());
        m.insert("repeat".into(), cell.repeat.into());
    };
    let mut out = Vec::new();
    let (mut acc, mut acc_norm) = (Vec::new(), Vec::new());
    let mut k = 0;
    for item in items {
        let n = item.choices.len();
        let ll = &loglik[k..k + n];
        let ps = &pairs[k..k + n];
        k += n;
        let s = item.score(ll)?;
        acc.push(f64::from(u8::from(s.correct)));
        if let Some(c) = s.correct_norm {
            acc_norm.push(f64::from(u8::from(c)));
        }
        let mut m = Map::new();
        m.insert("level".into(), "item".into());
        base(&mut m);
        m.insert("item".into(), item.index.into());
        m.insert("gold".into(), item.gold.into());
        m.insert("pred".into(), s.pred.into());
        m.insert("correct".into(), s.correct.into());
        m.insert("pred_norm".into(), json!(s.pred_norm));
        m.insert("correct_norm".into(), json!(s.correct_norm));
        m.insert("loglik".into(), json!(ll));
        m.insert(
            "context_tokens".into(),
            json!(ps.iter().map(|p| p.ctx.len()).collect::<Vec<_>>()),
        );
        m.insert(
            "continuation_tokens".into(),
            json!(ps.iter().map(|p| p.cont.len()).collect::<Vec<_>>()),
        );
        out.push(Value::Object(m));
    }
    let (a, a_se) = mean_stderr(&acc);
    let (an, an_se) = if task.has_acc_norm() {
        mean_stderr(&acc_norm)
    } else {
        (None, None)
    };
    // Scores only: `kvbench compare` checks every `accuracy*` column of runs.parquet
    // exactly (the task and mode are the cell's).
    let summary = json!({
        "items": items.len(),
        "acc": a,
        "acc_stderr": a_se,
        "acc_norm": an,
        "acc_norm_stderr": an_se,
    });
    let mut m = Map::new();
    m.insert("level".into(), "task".into());
    base(&mut m);
    m.insert("items".into(), items.len().into());
    m.insert("accuracy".into(), json!(a));
    m.insert("acc_stderr".into(), json!(a_se));
    m.insert("acc_norm".into(), json!(an));
    m.insert("acc_norm_stderr".into(), json!(an_se));
    out.push(Value::Object(m));
    Ok((out, summary))
}

/// Text InfiniGen's skewing is calibrated on for accuracy runs: real prose from the
/// datasets directory (random tokens say little about trained weights' queries).
fn calibration_text(data_dir: &Path) -> Option<PathBuf> {
    let p = data_dir.join("prose/wikitext-2-raw_wiki.test.raw");
    p.is_file().then_some(p)
}

/// Score the cell's task and mode with its engine and budget.
fn score_cell(
    plan: &Plan,
    cell: &Cell,
    setup: &Setup,
    models_dir: &Path,
    data_dir: &Path,
    progress: &mut Option<Progress>,
) -> Result<(Engine, Vec<Value>, Value, Value)> {
    let (Some(task), Some(mode)) = (&cell.task, cell.mode) else {
        bail!("cell {} is not an accuracy cell", cell.index);
    };
    let task: Task = task.parse().map_err(anyhow::Error::msg)?;
    let items = load_items(data_dir, task, cell.limit)?;
    let tok = &setup.loaded.tokenizer;
    let mut pairs = Vec::new();
    let mut truncated = 0;
    for item in &items {
        for c in &item.choices {
            let (ctx, cont) = encode_pair(tok, &c.context, &c.continuation)
                .with_context(|| format!("{task} item {}", item.index))?;
            let mut p = Pair { ctx, cont };
            truncated += usize::from(fit(&mut p, plan.context, mode)?);
            pairs.push(p);
        }
    }
    let total: usize = pairs.iter().map(|p| p.ctx.len() + p.cont.len()).sum();
    let p = progress.insert(Progress::new(total as u64));
    let mut eng = policy_engine(
        plan,
        cell,
        setup,
        models_dir,
        calibration_text(data_dir).as_deref(),
    )?;
    eng.reset_clock();
    let t0 = Instant::now();
    // Twice the batch in the engine: the next requests are queued while the last
    // ones of a batch decode.
    let loglik = score(&mut eng, &pairs, mode, 2 * cell.batch, |n| p.step(n))?;
    let scoring_s = t0.elapsed().as_secs_f64();
    p.finish();
    let (rows, summary) = rows(cell, task, mode, &items, &pairs, &loglik)?;
    let scoring = json!({
        "requests": pairs.len(),
        "tokens": total,
        "truncated_requests": truncated,
        "seconds": scoring_s,
        "tokens_per_s": (scoring_s > 0.0).then(|| total as f64 / scoring_s),
    });
    Ok((eng, rows, summary, scoring))
}

/// Run one accuracy cell; errors of the run itself become the `oom` or `error` outcome.
pub fn run_cell(plan: &Plan, cell: &Cell, models_dir: &Path, data_dir: &Path) -> Result<Value> {
    let t0 = Instant::now();
    let setup = load_setup(plan, models_dir)?;
    let gpu = setup.gpu_index();
    let sampler = crate::sampler::Sampler::start(std::time::Duration::from_millis(100), gpu);
    let mut progress = None;
    let outcome = score_cell(plan, cell, &setup, models_dir, data_dir, &mut progress);
    let samples = sampler.finish();
    let mut v = super::shared::scored_cell_record(cell, &setup, gpu, &samples);
    v["scoring"] = Value::Null;
    match outcome {
        Ok((eng, rows, summary, scoring)) => {
            v["memory"] = serde_json::to_value(eng.memory())?;
            v["accuracy"] = summary;
            v["scoring"] = scoring;
            v["accuracy_rows"] = Value::Array(rows);
        }
        Err(err) => super::shared::record_failure(&mut v, &err),
    }
    v["wall_s"] = t0.elapsed().as_secs_f64().into();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbench_engines::config::preset;
    use kvbench_engines::engine::EngineConfig;
    use kvbench_engines::model::load::load_preset;
    use kvbench_engines::model::{Llama, WeightDtype};
    use kvbench_engines::policy::registry::registry;
    use kvbench_engines::policy::spec::PolicySpec;

    fn tiny() -> Llama {
        let cfg = preset("tiny").expect("the tiny preset exists");
        load_preset(cfg, WeightDtype::F32, 7, &candle_core::Device::Cpu).expect("tiny loads")
    }

    #[test]
    fn encode_pair_moves_trailing_spaces_and_slices_the_whole_string() {
        let tok = TextTokenizer::byte_level().unwrap();
        let (c, k) = encode_pair(&tok, "ab  ", "cd").unwrap();
        assert_eq!(c, vec![97, 98]);
        assert_eq!(k, vec![32, 32, 99, 100]);
        assert!(encode_pair(&tok, "  ", "x").is_err());
    }

    #[test]
    fn log_prob_is_a_log_softmax() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        assert!((log_prob(&row, 1) - (2.0 - z.ln())).abs() < 1e-12);
        let p: f64 = (0..3).map(|t| log_prob(&row, t).exp()).sum();
        assert!((p - 1.0).abs() < 1e-12);
    }

    #[test]
    fn fit_keeps_the_last_context_tokens() {
        let mut p = Pair {
            ctx: (0..10).collect(),
            cont: vec![1, 2, 3],
        };
        assert!(!fit(&mut p.clone(), 13, ScoringMode::Decode).unwrap());
        assert!(fit(&mut p, 12, ScoringMode::OnePass).unwrap());
        assert_eq!(p.ctx, (2..10).collect::<Vec<u32>>());
        assert!(fit(&mut p, 3, ScoringMode::Decode).is_err());
    }

    /// Requests of random tokens shaped like a task's: a shared context per item.
    fn pairs() -> Vec<Pair> {
        let mut s = 11u64;
        let mut next = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 33) % 250) as u32 + 1
                })
                .collect()
        };
        let mut out = Vec::new();
        for (ctx, conts) in [(40, [3, 9]), (70, [1, 12]), (25, [6, 6]), (90, [15, 2])] {
            let c = next(ctx);
            for n in conts {
                out.push(Pair {
                    ctx: c.clone(),
                    cont: next(n),
                });
            }
        }
        out
    }

    fn engine(model: &Llama, policy: PolicySpec) -> Engine {
        let cfg = EngineConfig {
            num_blocks: Some(256),
            max_model_len: Some(256),
            policy,
            ..Default::default()
        };
        Engine::new(model.clone(), cfg).unwrap()
    }

    /// Independent reference: the dense forward of context + continuation.
    fn dense(model: &Llama, p: &Pair) -> f64 {
        let all = [p.ctx.as_slice(), &p.cont].concat();
        let rows = model.forward_dense(&all).unwrap().to_vec2::<f32>().unwrap();
        p.cont
            .iter()
            .enumerate()
            .map(|(i, &t)| log_prob(&rows[p.ctx.len() - 1 + i], t))
            .sum()
    }

    /// The evaluation data's committed fixtures (the first 40 items of each task).
    fn data_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/fixtures")
    }

    /// SmolLM2-135M-Instruct (f32) on the first items of three tasks: the engine's
    /// decode-path and one-pass sums against log-probabilities from a plain dense
    /// forward of context + continuation (no engine, no cache), with the tokens split
    /// as lm-eval does and the log-softmax taken here in f32.
    #[test]
    fn smollm2_scores_match_a_dense_forward() {
        use kvbench_engines::source::{LoadOptions, ModelSource};
        let models = std::env::var_os("KVBENCH_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
        let opts = LoadOptions {
            dtype: Some(WeightDtype::F32),
            models_dir: models.clone(),
            ..Default::default()
        };
        let loaded = ModelSource::parse("smollm2-135m-instruct")
            .unwrap()
            .load(&candle_core::Device::Cpu, &opts)
            .unwrap_or_else(|e| {
                panic!(
                    "SmolLM2 under {}: {e} (run `just fetch-model smollm2`)",
                    models.display()
                )
            });
        let (model, tok) = (&loaded.model, &loaded.tokenizer);
        let mut items = Vec::new();
        for task in [Task::Piqa, Task::Copa, Task::Hellaswag] {
            items.extend(load_items(&data_dir(), task, Some(2)).unwrap());
        }
        let mut reqs = Vec::new();
        let mut want = Vec::new();
        for item in &items {
            for c in &item.choices {
                // lm-eval's split: the whole string's tokens after the context's.
                let whole = tok
                    .encode(&format!("{}{}", c.context, c.continuation))
                    .unwrap();
                let ctx = tok.encode(&c.context).unwrap();
                let rows = model
                    .forward_dense(&whole)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let mut ll = 0f64;
                for p in ctx.len()..whole.len() {
                    let row = &rows[p - 1];
                    let m = row.iter().copied().fold(f32::MIN, f32::max);
                    let z: f32 = row.iter().map(|x| (x - m).exp()).sum();
                    ll += (row[whole[p] as usize] - m - z.ln()) as f64;
                }
                want.push(ll);
                let (a, b) = encode_pair(tok, &c.context, &c.continuation).unwrap();
                assert_eq!((a.as_slice(), b.as_slice()), whole.split_at(ctx.len()));
                reqs.push(Pair { ctx: a, cont: b });
            }
        }
        for mode in [ScoringMode::Decode, ScoringMode::OnePass] {
            let cfg = EngineConfig {
                num_blocks: Some(512),
                max_model_len: Some(1024),
                ..Default::default()
            };
            let mut eng = Engine::new(model.clone(), cfg).unwrap();
            let got = score(&mut eng, &reqs, mode, 4, |_| {}).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() < 2e-3 * w.abs().max(1.0),
                    "{mode:?} request {i}: engine {g} vs dense {w}"
                );
            }
            // Log-likelihoods of real text are finite and negative.
            assert!(got.iter().all(|x| x.is_finite() && *x < 0.0));
        }
    }

    #[test]
    fn both_modes_match_a_dense_forward_and_every_policy_at_budget_one_matches_full() {
        let model = tiny();
        let reqs = pairs();
        let want: Vec<f64> = reqs.iter().map(|p| dense(&model, p)).collect();
        for mode in [ScoringMode::Decode, ScoringMode::OnePass] {
            let full = score(
                &mut engine(&model, PolicySpec::full()),
                &reqs,
                mode,
                3,
                |_| {},
            )
            .unwrap();
            for (i, (a, b)) in full.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-4,
                    "{mode:?} request {i}: full {a} vs dense {b}"
                );
            }
            // Every compressing strategy at budget 1.0, with its first verify set.
            let calib: Vec<u32> = (0..128u32).map(|i| (i * 7) % 250 + 1).collect();
            let skew = std::sync::Arc::new(
                kvbench_engines::policy::infinigen::skew::calibrate(&model, &calib).unwrap(),
            );
            for s in registry().iter().filter(|s| s.budgeted) {
                let name = s.name;
                let params: Vec<(String, String)> = s.verify[0]
                    .params
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                let mut spec = PolicySpec::parse(name, 1.0, &params).unwrap();
                if spec.needs_skewing() {
                    spec.set_skewing(skew.clone());
                }
                let got = score(&mut engine(&model, spec), &reqs, mode, 3, |_| {}).unwrap();
                for (i, (a, b)) in got.iter().zip(&full).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-4,
                        "{name} {mode:?} request {i}: {a} vs full {b}"
                    );
                }
            }
        }
    }
}
