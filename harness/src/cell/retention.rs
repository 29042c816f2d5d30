//! The retention test (the study's Fig. 8): prompts built by
//! `kvbench_datasets::retention` in the model's chat template, answered greedily by one
//! engine, scored by whether the answer is in the response. One row per prompt, in the
//! shape `accuracy.parquet` takes (task `retention`, with bucket and turn).

use super::shared::{load_setup, policy_engine, Progress};
use crate::experiment::{Cell, Plan};
use crate::setup::Setup;
use anyhow::{bail, ensure, Context, Result};
use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::retention::{
    build_chat, build_passkey, is_correct, load_conversations, Bucket, BuildSpec, Form, Message,
    RetentionPrompt,
};
use kvbench_datasets::FETCH_HINT;
use kvbench_engines::engine::{Engine, Request};
use kvbench_engines::tokenizer::{ChatTemplate, TextTokenizer};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The chat conversations, under the datasets directory.
pub const CHAT_FILE: &str = "chat/hh-rlhf_harmless-base_test_messages.jsonl";
/// The passkey form's filler, under the datasets directory.
pub const PASSKEY_PROSE: &str = "prose/pride_and_prejudice_pg42671.txt";
/// Characters of the response kept in a row.
const RESPONSE_CHARS: usize = 200;

/// What to build and how to answer.
#[derive(Debug, Clone)]
pub struct RetentionOptions {
    pub form: Form,
    pub buckets: Vec<Bucket>,
    /// Question turns (chat: ≥ 2, the study's 2, 4, …, 12; passkey: `[1]`).
    pub turns: Vec<usize>,
    /// Distinct facts cycled over the conversations (chat).
    pub facts: usize,
    /// Conversations (chat) or keys (passkey) per bucket.
    pub items: usize,
    pub seed: u64,
    /// Most tokens generated per answer (generation stops at the end of the turn).
    pub max_new_tokens: usize,
    /// The datasets directory (`chat/`, `prose/`).
    pub data_dir: PathBuf,
}

/// A prompt with its token ids (the rendered chat template, generation prompt last).
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: RetentionPrompt,
    pub ids: Vec<u32>,
}

/// One answered retention prompt.
#[derive(Debug, Clone, Serialize)]
pub struct RetentionRow {
    /// Always `retention`.
    pub task: String,
    /// `chat` or `passkey`.
    pub form: String,
    pub engine: String,
    pub budget: f64,
    /// Such as `1K-2K`.
    pub bucket: String,
    pub turn: usize,
    pub fact_id: usize,
    pub conversation_id: String,
    /// Prompt tokens when the question is answered.
    pub context_tokens: usize,
    pub correct: bool,
    /// The greedy response, cut at 200 characters.
    pub response: String,
}

fn template(tok: &TextTokenizer) -> Result<&ChatTemplate> {
    tok.chat_template.as_ref().context(
        "the model's tokenizer has no chat template kvbench can render (ChatML); the retention test needs one",
    )
}

fn render(t: &ChatTemplate, msgs: &[Message]) -> String {
    let pairs: Vec<(&str, &str)> = msgs
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    t.render(&pairs, true)
}

/// Every prompt of `opts`, rendered and tokenized; each bucket must fit the model's
/// context with room for the answer.
pub fn build_prompts(
    opts: &RetentionOptions,
    tok: &TextTokenizer,
    max_model_len: usize,
) -> Result<Vec<Prepared>> {
    let t = template(tok)?;
    for b in &opts.buckets {
        ensure!(
            b.hi - 1 + opts.max_new_tokens <= max_model_len,
            "bucket {}: prompts up to {} tokens plus {} generated exceed the model's context of {max_model_len}",
            b.label(),
            b.hi - 1,
            opts.max_new_tokens
        );
    }
    let spec = BuildSpec {
        buckets: opts.buckets.clone(),
        turns: opts.turns.clone(),
        items: opts.items,
        facts: opts.facts,
        seed: opts.seed,
    };
    let measure = |msgs: &[Message]| -> std::result::Result<usize, String> {
        tok.encode(&render(t, msgs))
            .map(|ids| ids.len())
            .map_err(|e| e.to_string())
    };
    let prompts = match opts.form {
        Form::Chat => {
            let path = opts.data_dir.join(CHAT_FILE);
            let convs = load_conversations(&path)?;
            build_chat(&convs, &spec, &measure)?
        }
        Form::Passkey => {
            let path = opts.data_dir.join(PASSKEY_PROSE);
            let prose = Corpus::from_file(&path)?;
            build_passkey(&prose.text, &spec, &measure)?
        }
    };
    prompts
        .into_iter()
        .map(|p| {
            let ids = tok.encode(&render(t, &p.messages))?;
            Ok(Prepared { prompt: p, ids })
        })
        .collect()
}

/// Answer every prompt greedily with `engine` (its policy is the strategy and budget
/// of the rows), `batch` requests at a time, generation stopping at the template's end
/// of turn or the model's end of sequence. `on_tokens` gets each step's token count
/// (progress).
pub fn run_retention(
    engine: &mut Engine,
    tok: &TextTokenizer,
    prompts: &[Prepared],
    max_new_tokens: usize,
    batch: usize,
    on_tokens: &mut dyn FnMut(usize),
) -> Result<Vec<RetentionRow>> {
    ensure!(
        batch >= 1 && max_new_tokens >= 1,
        "batch and max_new_tokens must be ≥ 1"
    );
    let t = template(tok)?;
    let mut stop = tok.end_of_turn_ids();
    stop.extend(&engine.model().cfg.eos_token_ids);
    let engine_name = engine.config().policy.name().to_string();
    let budget = engine.config().policy.budget();
    let mut rows = Vec::with_capacity(prompts.len());
    for chunk in prompts.chunks(batch) {
        let mut ids = HashMap::new();
        for (i, p) in chunk.iter().enumerate() {
            let id = engine
                .add_request(Request {
                    stop_tokens: stop.clone(),
                    ..Request::greedy(p.ids.clone(), max_new_tokens)
                })
                .with_context(|| {
                    format!(
                        "retention prompt of {} tokens (bucket {}, turn {})",
                        p.ids.len(),
                        p.prompt.bucket.label(),
                        p.prompt.turn
                    )
                })?;
            ids.insert(id, i);
        }
        engine.run_with(|step| on_tokens(step.num_tokens))?;
        let mut answers: Vec<Option<String>> = vec![None; chunk.len()];
        for out in engine.take_finished() {
            if let Some(&i) = ids.get(&out.id) {
                answers[i] = Some(tok.decode(&out.output)?);
            }
        }
        for (p, answer) in chunk.iter().zip(answers) {
            let Some(text) = answer else {
                bail!("a retention request did not finish");
            };
            // Tokenizers without the end-of-turn token (byte-level) spell it out.
            let text = text.split(t.end_of_turn()).next().unwrap_or("").trim();
            let q = &p.prompt;
            rows.push(RetentionRow {
                task: "retention".into(),
                form: q.form.name().into(),
                engine: engine_name.clone(),
                budget,
                bucket: q.bucket.label(),
                turn: q.turn,
                fact_id: q.fact.id,
                conversation_id: q.conversation_id.clone(),
                context_tokens: p.ids.len(),
                correct: is_correct(text, &q.fact.answer),
                response: text.chars().take(RESPONSE_CHARS).collect(),
            });
        }
    }
    Ok(rows)
}

/// The form's data file is there (before the first cell: one clear error, not one per
/// cell).
pub fn check_data(form: &str, data_dir: &Path) -> Result<()> {
    let file = match Form::parse(form)? {
        Form::Chat => CHAT_FILE,
        Form::Passkey => PASSKEY_PROSE,
    };
    let p = data_dir.join(file);
    ensure!(
        p.is_file(),
        "retention ({form}): {} not found in the evaluation data directory {}: {FETCH_HINT}",
        p.display(),
        data_dir.display()
    );
    Ok(())
}

/// Conversations (chat) or keys (passkey) per bucket without a `limit`: the study's.
pub const DEFAULT_ITEMS: usize = 50;
/// Most tokens generated per answer.
pub const MAX_NEW_TOKENS: usize = 24;
/// Text InfiniGen's skewing is calibrated on (as the accuracy cells).
const CALIBRATION: &str = "prose/wikitext-2-raw_wiki.test.raw";

/// The options of one retention cell: its bucket, the experiment's `retention:` section.
pub fn cell_options(plan: &Plan, cell: &Cell, data_dir: &Path) -> Result<RetentionOptions> {
    let r = plan
        .exp
        .retention
        .as_ref()
        .context("a retention cell needs the experiment's `retention:` section")?;
    let bucket = cell
        .bucket
        .as_deref()
        .with_context(|| format!("cell {} is not a retention cell", cell.index))?;
    Ok(RetentionOptions {
        form: Form::parse(&r.form)?,
        buckets: vec![Bucket::parse(bucket)?],
        turns: r.turns.clone(),
        facts: r.facts.unwrap_or(1),
        items: cell.limit.unwrap_or(DEFAULT_ITEMS),
        seed: plan.exp.seed,
        max_new_tokens: MAX_NEW_TOKENS,
        data_dir: data_dir.to_path_buf(),
    })
}

fn answer_cell(
    plan: &Plan,
    cell: &Cell,
    setup: &Setup,
    models_dir: &Path,
    data_dir: &Path,
) -> Result<(Engine, Vec<RetentionRow>, Value)> {
    let o = cell_options(plan, cell, data_dir)?;
    let tok = &setup.loaded.tokenizer;
    let prompts = build_prompts(&o, tok, plan.context)?;
    let total: usize = prompts.iter().map(|p| p.ids.len() + o.max_new_tokens).sum();
    let mut progress = Progress::new(total as u64);
    let calibration = data_dir.join(CALIBRATION);
    let mut engine = policy_engine(
        plan,
        cell,
        setup,
        models_dir,
        calibration.is_file().then_some(calibration.as_path()),
    )?;
    engine.reset_clock();
    let t0 = Instant::now();
    let rows = run_retention(
        &mut engine,
        tok,
        &prompts,
        o.max_new_tokens,
        cell.batch,
        &mut |n| progress.step(n),
    )?;
    progress.finish();
    let correct = rows.iter().filter(|r| r.correct).count();
    let summary = json!({
        "task": "retention",
        "form": o.form.name(),
        "bucket": cell.bucket,
        "prompts": rows.len(),
        "correct": correct,
        "accuracy": (!rows.is_empty()).then(|| correct as f64 / rows.len() as f64),
        "prompt_tokens": prompts.iter().map(|p| p.ids.len()).sum::<usize>(),
        "answer_s": t0.elapsed().as_secs_f64(),
    });
    Ok((engine, rows, summary))
}

/// Run one retention cell (one engine, budget and bucket); errors of the run itself
/// become the `oom` or `error` outcome. Its rows go to `accuracy.parquet`.
pub fn run_cell(plan: &Plan, cell: &Cell, models_dir: &Path, data_dir: &Path) -> Result<Value> {
    let t0 = Instant::now();
    let setup = load_setup(plan, models_dir)?;
    let gpu = setup.gpu_index();
    let sampler = crate::sampler::Sampler::start(std::time::Duration::from_millis(100), gpu);
    let outcome = answer_cell(plan, cell, &setup, models_dir, data_dir);
    let samples = sampler.finish();
    let mut v = super::shared::scored_cell_record(cell, &setup, gpu, &samples);
    match outcome {
        Ok((engine, rows, summary)) => {
            v["memory"] = serde_json::to_value(engine.memory())?;
            v["accuracy"] = summary;
            v["accuracy_rows"] = serde_json::to_value(&rows)?;
        }
        Err(err) => super::shared::record_failure(&mut v, &err),
    }
    v["wall_s"] = t0.elapsed().as_secs_f64().into();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use kvbench_datasets::retention::{Role, ACKNOWLEDGMENT, PASSKEY_INTRO, STUDY_TURNS};
    use kvbench_engines::config::preset;
    use kvbench_engines::engine::EngineConfig;
    use kvbench_engines::model::load::{load_gguf, load_preset, GgufFile};
    use kvbench_engines::model::WeightDtype;
    use kvbench_engines::policy::registry::registry;
    use kvbench_engines::policy::spec::PolicySpec;
    use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};

    fn repo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    /// The evaluation data's committed fixtures (100 conversations, a slice of the book).
    fn data_dir() -> PathBuf {
        repo().join("datasets/fixtures")
    }

    /// The SmolLM2 GGUF; tests that need it fail when it is missing.
    fn smollm2() -> GgufFile {
        let dir = std::env::var_os("KVBENCH_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo().join("models"));
        let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            p.is_file(),
            "{} is missing: run `just fetch-model smollm2` first",
            p.display()
        );
        GgufFile::open(&p).unwrap()
    }

    fn opts(form: Form, buckets: &[&str], turns: &[usize], items: usize) -> RetentionOptions {
        RetentionOptions {
            form,
            buckets: buckets.iter().map(|b| Bucket::parse(b).unwrap()).collect(),
            turns: turns.to_vec(),
            facts: 20,
            items,
            seed: 11,
            max_new_tokens: 24,
            data_dir: data_dir(),
        }
    }

    fn engine_cfg(policy: PolicySpec, max_model_len: usize) -> EngineConfig {
        EngineConfig {
            device_memory: Some(4 << 30),
            num_blocks: Some(4 * max_model_len.div_ceil(16)),
            max_model_len: Some(max_model_len),
            scheduler: SchedulerConfig {
                max_num_seqs: 4,
                max_batched_tokens: 512,
                prefill: PrefillMode::Chunked,
            },
            policy,
            ..Default::default()
        }
    }

    fn check_layout(p: &Prepared, tok: &TextTokenizer) {
        let q = &p.prompt;
        assert_eq!(p.ids.len(), q.context_tokens, "measured as fed");
        assert!(
            q.bucket.contains(p.ids.len()),
            "{} tokens in {}",
            p.ids.len(),
            q.bucket.label()
        );
        // The rendered prompt ends with the question and the generation prompt, and
        // starts (after SmolLM2's default system message) with the fact.
        let text = tok.decode(&p.ids).unwrap();
        let first_user = text.find("user\n").unwrap() + "user\n".len();
        let head = &text[first_user..];
        match q.form {
            Form::Chat => {
                assert!(head.starts_with(&q.fact.statement), "{head:.120}");
                assert!(text.contains(&format!("assistant\n{ACKNOWLEDGMENT}")));
                assert_eq!(text.matches("user\n").count(), q.turn);
            }
            Form::Passkey => {
                assert!(head.starts_with(PASSKEY_INTRO), "{head:.120}");
                assert!(head[..PASSKEY_INTRO.len() + 40].contains(&q.fact.answer));
            }
        }
        assert!(
            text.ends_with(&format!("{}\nassistant\n", q.fact.question)),
            "{:?}",
            &text[text.len().saturating_sub(80)..]
        );
    }

    #[test]
    fn prompts_land_in_their_buckets_with_the_real_tokenizer() {
        let tok = TextTokenizer::from_gguf(&smollm2().content).unwrap();
        let chat = build_prompts(
            &opts(Form::Chat, &["1K-2K", "2K-4K"], &STUDY_TURNS, 2),
            &tok,
            8192,
        )
        .unwrap();
        assert_eq!(chat.len(), 2 * 2 * STUDY_TURNS.len());
        for p in &chat {
            check_layout(p, &tok);
            assert_eq!(p.prompt.messages.len(), 2 * p.prompt.turn - 1);
            assert_eq!(p.prompt.messages[0].role, Role::User);
        }
        let passkey = build_prompts(&opts(Form::Passkey, &["1K-2K"], &[1], 3), &tok, 8192).unwrap();
        assert_eq!(passkey.len(), 3);
        for p in &passkey {
            check_layout(p, &tok);
        }
        // A bucket past the model's context is refused, naming it.
        let e = build_prompts(&opts(Form::Passkey, &["4K-8K"], &[1], 1), &tok, 8192)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4K-8K") && e.contains("8192"), "{e}");
    }

    #[test]
    fn every_strategy_at_budget_one_answers_as_full() {
        // Random weights: the answers are noise, but the same noise for every
        // strategy that keeps everything.
        let model =
            load_preset(preset("tiny").unwrap(), WeightDtype::F32, 3, &Device::Cpu).unwrap();
        // SmolLM2's tokenizer (the tiny preset has its vocabulary), so that the random
        // ids decode to text.
        let tok = TextTokenizer::from_gguf(&smollm2().content).unwrap();
        let o = opts(Form::Chat, &["256-512"], &[2, 4], 2);
        let prompts = build_prompts(&o, &tok, 1024).unwrap();
        assert_eq!(prompts.len(), 4);
        let run = |spec: PolicySpec| {
            let mut e = Engine::new(model.clone(), engine_cfg(spec, 1024)).unwrap();
            run_retention(&mut e, &tok, &prompts, 12, 3, &mut |_| {}).unwrap()
        };
        let full = run(PolicySpec::full());
        assert_eq!(full.len(), 4);
        assert!(full.iter().any(|r| !r.response.is_empty()));
        let calib: Vec<u32> = prompts[0].ids.clone();
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
            let rows = run(spec);
            assert_eq!(rows.len(), full.len());
            for (a, b) in full.iter().zip(&rows) {
                assert_eq!(b.engine, name);
                assert_eq!(b.budget, 1.0);
                assert_eq!(
                    (
                        &a.bucket,
                        a.turn,
                        a.fact_id,
                        &a.conversation_id,
                        a.context_tokens
                    ),
                    (
                        &b.bucket,
                        b.turn,
                        b.fact_id,
                        &b.conversation_id,
                        b.context_tokens
                    )
                );
                assert_eq!(a.response, b.response, "{name} differs from full");
                assert_eq!(a.correct, b.correct);
            }
        }
        // The comparison can fail: a strategy that drops most of the context answers
        // differently.
        let low = run(PolicySpec::parse("streaming", 0.1, &[]).unwrap());
        assert!(
            full.iter().zip(&low).any(|(a, b)| a.response != b.response),
            "streaming at 0.1 answered exactly as full"
        );
    }

    #[test]
    fn smollm2_with_the_full_cache_recalls_short_passkeys() {
        let file = smollm2();
        let tok = TextTokenizer::from_gguf(&file.content).unwrap();
        // f32: the quantized matmuls are slow on CPU and noisier (cpu-notes).
        let model = load_gguf(&file, WeightDtype::F32, &Device::Cpu).unwrap();
        let o = opts(Form::Passkey, &["256-768"], &[1], 2);
        let prompts = build_prompts(&o, &tok, 8192).unwrap();
        let mut e = Engine::new(model, engine_cfg(PolicySpec::full(), 1024)).unwrap();
        let mut tokens = 0;
        let rows = run_retention(&mut e, &tok, &prompts, 24, 2, &mut |n| tokens += n).unwrap();
        let prompt_tokens: usize = prompts.iter().map(|p| p.ids.len()).sum();
        assert!(tokens > prompt_tokens, "{tokens} tokens stepped");
        assert_eq!(rows.len(), 2);
        let keys: Vec<&str> = prompts
            .iter()
            .map(|p| p.prompt.fact.answer.as_str())
            .collect();
        for (r, key) in rows.iter().zip(keys) {
            assert!(r.correct, "key {key}, answered {:?}", r.response);
            assert!(r.response.contains(key));
            assert_eq!(
                (r.task.as_str(), r.form.as_str(), r.engine.as_str()),
                ("retention", "passkey", "full")
            );
            assert!(r.context_tokens >= 256 && r.context_tokens < 768);
        }
    }
}
