//! preset:tiny through the paged cache against recomputation without a cache, and the
//! scheduler's guarantees (invariants, preemption, rejection, OOM as a value).

mod common;
use common::{max_abs_diff, random_tokens, tiny};
use kvbench_engines::engine::{Engine, EngineConfig, Request, StepOutcome};
use kvbench_engines::error::{Component, Error};
use kvbench_engines::kv::KvCodec;
use kvbench_engines::policy::full::{FullOptions, FullPolicy};
use kvbench_engines::policy::{KvPolicy, StepBatch};
use kvbench_engines::scheduler::PrefillMode;
use kvbench_engines::trace::EventKind;

/// Ragged sequences that join at different steps (prefill in chunks while others
/// decode), random block tables: every returned logit row equals the no-cache forward.
#[test]
fn paged_incremental_decode_equals_recompute() {
    let model = tiny();
    let mut policy = FullPolicy::new(
        &model.cfg,
        FullOptions {
            block_size: 4,
            kv_codec: KvCodec::F32,
            shuffle_seed: Some(11),
            ..Default::default()
        },
        256,
    );
    let mut seed = 5;
    // (full token list, prompt length, step at which it starts, prefill chunk)
    let seqs: Vec<(Vec<u32>, usize, usize, usize)> = vec![
        (random_tokens(30, &mut seed), 13, 0, 13),
        (random_tokens(25, &mut seed), 1, 0, 1),
        (random_tokens(40, &mut seed), 22, 2, 6),
        (random_tokens(20, &mut seed), 9, 5, 4),
    ];
    let dense: Vec<Vec<Vec<f32>>> = seqs
        .iter()
        .map(|(t, ..)| model.forward_dense(t).unwrap().to_vec2::<f32>().unwrap())
        .collect();
    let mut computed = vec![0usize; seqs.len()];
    let mut worst = 0f32;
    let mut checked = 0;
    for step in 0..60 {
        let mut batch = StepBatch::default();
        let (mut tokens, mut positions, mut rows, mut who) = (vec![], vec![], vec![], vec![]);
        for (i, (t, prompt, start, chunk)) in seqs.iter().enumerate() {
            if step < *start || computed[i] >= t.len() {
                continue;
            }
            let c = computed[i];
            let n = if c < *prompt {
                (*prompt - c).min(*chunk)
            } else {
                1
            };
            assert!(policy.reserve(i as u64, c + n).unwrap());
            tokens.extend_from_slice(&t[c..c + n]);
            positions.extend(c as u32..(c + n) as u32);
            batch.push(i as u64, c, n);
            rows.push((tokens.len() - 1) as u32);
            who.push((i, c + n - 1));
        }
        if tokens.is_empty() {
            break;
        }
        let logits = model
            .forward(&tokens, &positions, &batch, &rows, &mut policy)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (row, &(i, pos)) in logits.iter().zip(&who) {
            worst = worst.max(max_abs_diff(row, &dense[i][pos]));
            checked += 1;
        }
        for s in &batch.seqs {
            computed[s.id as usize] += s.q_len;
        }
        policy.check_invariants().unwrap();
    }
    assert!(computed.iter().zip(&seqs).all(|(c, s)| *c == s.0.len()));
    assert!(checked > 70, "{checked}");
    assert!(worst < 1e-4, "max |Δlogit| = {worst}");
    // Blocks were really scattered: some table is not a run of consecutive ids.
    let t = policy.table(2).unwrap();
    assert!(t.windows(2).any(|w| w[1] != w[0] + 1), "{t:?}");
    for i in 0..seqs.len() {
        policy.release(i as u64);
    }
    assert_eq!(policy.num_free_blocks(), 256);
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(tiny(), cfg).unwrap()
}

fn base_cfg() -> EngineConfig {
    EngineConfig {
        num_blocks: Some(512),
        max_model_len: Some(256),
        shuffle_blocks_seed: Some(3),
        check_invariants: true,
        ..Default::default()
    }
}

fn greedy_dense(prompt: &[u32], n: usize) -> Vec<u32> {
    let model = tiny();
    let mut t = prompt.to_vec();
    for _ in 0..n {
        let l = model.forward_dense(&t).unwrap();
        let last = l.get(t.len() - 1).unwrap().unsqueeze(0).unwrap();
        t.push(kvbench_engines::engine::argmax_rows(&last).unwrap()[0]);
    }
    t[prompt.len()..].to_vec()
}

fn run_all(e: &mut Engine, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    for p in prompts {
        e.add_request(Request::greedy(p.clone(), n)).unwrap();
    }
    e.run().unwrap();
    let mut out: Vec<_> = e.finished().to_vec();
    out.sort_by_key(|r| r.id);
    assert_eq!(out.len(), prompts.len(), "every request finishes");
    out.into_iter().map(|r| r.output).collect()
}

fn prompts() -> Vec<Vec<u32>> {
    let mut seed = 9;
    [17, 3, 40, 8, 25]
        .iter()
        .map(|&n| random_tokens(n, &mut seed))
        .collect()
}

#[test]
fn batched_engine_generates_the_dense_greedy_tokens() {
    let ps = prompts();
    let got = run_all(&mut engine(base_cfg()), &ps, 12);
    for (p, g) in ps.iter().zip(&got) {
        assert_eq!(g, &greedy_dense(p, 12));
    }
}

#[test]
fn chunked_and_sequential_prefill_give_the_same_tokens() {
    let ps = prompts();
    let reference = run_all(&mut engine(base_cfg()), &ps, 8);
    let mut chunked = base_cfg();
    chunked.scheduler.max_batched_tokens = 7;
    let mut e = engine(chunked);
    assert_eq!(run_all(&mut e, &ps, 8), reference);
    assert!(e
        .traces()
        .iter()
        .any(|t| t.kind == kvbench_engines::trace::StepKind::Mixed));
    let mut seq = base_cfg();
    seq.scheduler.prefill = PrefillMode::Sequential;
    let mut e = engine(seq);
    assert_eq!(run_all(&mut e, &ps, 8), reference);
    // One prompt per prefill step, all prefills before the first decode.
    let prefills: Vec<_> = e
        .traces()
        .iter()
        .filter(|t| t.num_prefill_tokens > 0)
        .collect();
    assert_eq!(prefills.len(), ps.len());
    assert!(prefills.iter().all(|t| t.num_seqs == 1));
    // The host's launch time is a GPU measurement: on the CPU it is missing, not zero.
    assert!(e.traces().iter().all(|t| t.launch_s.is_none()));
}

#[test]
fn preempted_requests_generate_the_same_tokens() {
    let ps = prompts();
    let reference: Vec<_> = ps
        .iter()
        .map(|p| run_all(&mut engine(base_cfg()), std::slice::from_ref(p), 30).remove(0))
        .collect();
    let mut small = base_cfg();
    // 15 blocks of 4 = 60 token slots for 5 requests needing up to 70 each.
    small.block_size = 4;
    small.num_blocks = Some(18);
    small.max_model_len = Some(72);
    let mut e = engine(small);
    let got = run_all(&mut e, &ps, 30);
    let preemptions = e
        .events()
        .iter()
        .filter(|ev| ev.kind == EventKind::Preempted)
        .count();
    assert!(preemptions > 0, "the pool was meant to run out");
    assert!(e.finished().iter().any(|r| r.num_preemptions > 0));
    assert_eq!(got, reference);
    assert_eq!(e.policy().memory().device_used, 0, "all blocks return");
}

#[test]
fn impossible_requests_are_rejected_not_looped() {
    let mut cfg = base_cfg();
    cfg.num_blocks = Some(20);
    cfg.block_size = 4;
    cfg.max_model_len = Some(64);
    let mut e = engine(cfg);
    let too_long = e.add_request(Request::greedy(vec![1; 60], 10));
    match too_long {
        Err(Error::RequestRejected { reason, .. }) => {
            assert!(reason.contains("max_model_len"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let bad_token = e.add_request(Request::greedy(vec![49_152], 1));
    assert!(matches!(bad_token, Err(Error::RequestRejected { .. })));
    let empty = e.add_request(Request::greedy(vec![], 1));
    assert!(matches!(empty, Err(Error::RequestRejected { .. })));
    let bad_forced = e.add_request(Request {
        forced_output: vec![3, 49_152],
        ..Request::greedy(vec![1, 2], 2)
    });
    match bad_forced {
        Err(Error::RequestRejected { reason, .. }) => {
            assert!(reason.contains("forced output token id 49152"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    for arrival_s in [f64::NAN, -1.0, f64::INFINITY] {
        let bad_arrival = e.add_request(Request {
            arrival_s,
            ..Request::greedy(vec![1, 2], 2)
        });
        assert!(
            matches!(bad_arrival, Err(Error::RequestRejected { .. })),
            "arrival {arrival_s}"
        );
    }
    assert!(!e.has_unfinished());
    assert_eq!(
        e.events()
            .iter()
            .filter(|ev| ev.kind == EventKind::Rejected)
            .count(),
        7
    );
}

#[test]
fn out_of_memory_is_an_error_value() {
    // Weights alone exceed the capacity.
    let mut cfg = base_cfg();
    cfg.num_blocks = None;
    cfg.device_memory = Some(1 << 20);
    match Engine::new(tiny(), cfg) {
        Err(Error::OutOfMemory {
            component: Component::Weights,
            ..
        }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("expected OOM"),
    }
    // Room for the weights but not for one max_model_len sequence.
    let model = tiny();
    let mut cfg = base_cfg();
    cfg.num_blocks = None;
    cfg.device_memory = Some(model.weights_bytes() + model.activation_bytes(8192, 256) + 1000);
    cfg.memory_fraction = 1.0;
    match Engine::new(model, cfg) {
        Err(Error::OutOfMemory {
            component: Component::KvDevice,
            ..
        }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("expected OOM"),
    }
}

#[test]
fn pool_is_sized_from_the_capacity_fraction() {
    let model = tiny();
    let w = model.weights_bytes();
    let act = model.activation_bytes(8192, 256);
    let mut cfg = base_cfg();
    cfg.num_blocks = None;
    cfg.device_memory = Some(256 << 20);
    cfg.memory_fraction = 0.5;
    let e = Engine::new(model, cfg).unwrap();
    let pool = e.memory().kv_device;
    let block = e.policy().memory().device_reserved / (pool / block_bytes_tiny()).max(1);
    assert_eq!(block, block_bytes_tiny());
    let usable = (256u64 << 20) / 2 - w - act;
    assert!(
        pool <= usable && usable - pool < block_bytes_tiny(),
        "{pool} vs {usable}"
    );
}

#[test]
fn pool_stays_within_the_memory_the_device_has_free() {
    let model = tiny();
    let w = model.weights_bytes();
    let act = model.activation_bytes(8192, 256);
    let pool_with = |available: Option<u64>| {
        let mut cfg = base_cfg();
        cfg.num_blocks = None;
        cfg.device_memory = Some(256 << 20);
        cfg.memory_fraction = 0.5;
        cfg.device_available = available;
        Engine::new(tiny(), cfg).unwrap().memory().kv_device
    };
    let full_fraction = pool_with(None);
    // More free than the fraction: no change; less: the pool plans within it.
    assert_eq!(pool_with(Some(200 << 20)), full_fraction);
    let tight = (100u64 << 20) - w - act;
    let pool = pool_with(Some(100 << 20));
    assert!(
        pool <= tight && tight - pool < block_bytes_tiny() && pool < full_fraction,
        "{pool} vs {tight} (fraction alone: {full_fraction})"
    );
}

fn block_bytes_tiny() -> u64 {
    // 2 layers × 16 tokens × 2 KV heads × 16 dims × 4 bytes × (K, V)
    2 * 16 * 2 * 16 * 4 * 2
}

#[test]
fn later_arrivals_wait_and_stop_tokens_end_early() {
    let mut e = engine(base_cfg());
    let p = prompts();
    let first = greedy_dense(&p[0], 6);
    // Stop at the first token that was not generated before it.
    let k = (1..6)
        .find(|&i| !first[..i].contains(&first[i]))
        .expect("varied output");
    e.add_request(Request {
        arrival_s: 0.3,
        ..Request::greedy(p[1].clone(), 3)
    })
    .unwrap();
    e.add_request(Request {
        stop_tokens: vec![first[k]],
        ..Request::greedy(p[0].clone(), 6)
    })
    .unwrap();
    assert!(matches!(e.step().unwrap(), StepOutcome::Ran(_)));
    e.run().unwrap();
    let late = e.finished().iter().find(|r| r.id == 0).unwrap();
    assert!(late.admitted_s >= 0.3 && late.token_times_s[0] >= 0.3);
    // Its first token comes after its arrival (prefill takes time) and before it ends.
    let ttft = late.ttft_s().unwrap();
    let e2e = late.finished_s - late.arrival_s;
    assert!(ttft > 0.0 && ttft <= e2e, "TTFT {ttft} s, E2E {e2e} s");
    let early = e.finished().iter().find(|r| r.id == 1).unwrap();
    assert_eq!(
        early.output,
        first[..=k].to_vec(),
        "stops at the stop token"
    );
    assert_eq!(
        early.finish_reason,
        kvbench_engines::trace::FinishReason::Stop
    );
}

#[test]
fn tiny_greedy_output_is_not_degenerate() {
    // Token-equality tests only mean something if outputs vary.
    let out = greedy_dense(&prompts()[0], 16);
    let mut distinct = out.clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() >= 4, "{out:?}");
}

#[test]
fn a_step_past_the_capacity_fails_with_oom_and_nothing_is_lost() {
    // The pool leaves room for the profiled step (8 tokens, 8 logit rows); sequential
    // prefill runs a whole 700-token prompt in one step, whose activations do not fit.
    let model = tiny();
    let cap = model.weights_bytes() + 64 * block_bytes_tiny() + model.activation_bytes(8, 8);
    let mut cfg = EngineConfig {
        num_blocks: Some(64),
        device_memory: Some(cap),
        max_model_len: Some(1024),
        ..Default::default()
    };
    cfg.scheduler.max_batched_tokens = 8;
    cfg.scheduler.prefill = PrefillMode::Sequential;
    let mut e = Engine::new(model, cfg).unwrap();
    let mut seed = 1;
    e.add_request(Request::greedy(random_tokens(4, &mut seed), 2))
        .unwrap();
    e.run().unwrap();
    assert_eq!(e.finished().len(), 1, "a small step fits");
    e.add_request(Request::greedy(random_tokens(700, &mut seed), 2))
        .unwrap();
    match e.run() {
        Err(Error::OutOfMemory {
            component: Component::Activations,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(e.finished().len(), 1, "the finished request is still there");
}

/// A policy sees the layer input and can re-rotate raw keys to any positions.
struct Inspect {
    inner: FullPolicy,
    layers_seen: usize,
}

impl KvPolicy for Inspect {
    fn name(&self) -> &'static str {
        "inspect"
    }
    fn reserve(&mut self, seq: u64, total: usize) -> kvbench_engines::Result<bool> {
        self.inner.reserve(seq, total)
    }
    fn fits(&self, total: usize) -> bool {
        self.inner.fits(total)
    }
    fn release(&mut self, seq: u64) {
        self.inner.release(seq)
    }
    fn attend(
        &mut self,
        batch: &StepBatch,
        input: &kvbench_engines::policy::LayerInput<'_>,
    ) -> kvbench_engines::Result<candle_core::Tensor> {
        let again = input.rope.rotate(input.k_raw, input.positions)?;
        let d = (&again - input.k)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "rotating raw keys reproduces the model's keys");
        let q0 = input
            .rope
            .rotate(input.q_raw, &vec![0; input.positions.len()])?;
        let d = (&q0 - input.q_raw)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-6, "position 0 is the identity");
        assert_eq!(input.x.dims(), &[batch.num_tokens, 64]);
        self.layers_seen += 1;
        self.inner.attend(batch, input)
    }
    fn memory(&self) -> kvbench_engines::policy::PolicyMemory {
        self.inner.memory()
    }
    fn seq_device_bytes(&self, seq: u64) -> u64 {
        self.inner.seq_device_bytes(seq)
    }
    fn take_stats(&mut self) -> kvbench_engines::policy::PolicyStats {
        self.inner.take_stats()
    }
    fn take_attended(&mut self) -> Vec<kvbench_engines::policy::AttendRecord> {
        self.inner.take_attended()
    }
}

#[test]
fn policies_see_layer_inputs_and_can_re_rotate_keys() {
    let model = tiny();
    let mut p = Inspect {
        inner: FullPolicy::new(&model.cfg, FullOptions::default(), 16),
        layers_seen: 0,
    };
    let mut batch = StepBatch::default();
    assert!(p.reserve(0, 6).unwrap());
    batch.push(0, 0, 6);
    let toks = [5u32, 6, 7, 8, 9, 10];
    let pos: Vec<u32> = (0..6).collect();
    model.forward(&toks, &pos, &batch, &[5], &mut p).unwrap();
    assert_eq!(p.layers_seen, 2);
}

#[test]
fn bf16_weights_and_kv_stay_close_to_the_bf16_dense_forward() {
    use candle_core::Device;
    use kvbench_engines::config::preset;
    use kvbench_engines::model::load::load_preset;
    use kvbench_engines::model::WeightDtype;
    let model = load_preset(preset("tiny").unwrap(), WeightDtype::Bf16, 7, &Device::Cpu).unwrap();
    let opts = FullOptions {
        block_size: 4,
        kv_codec: KvCodec::Bf16,
        shuffle_seed: Some(2),
        ..Default::default()
    };
    let mut policy = FullPolicy::new(&model.cfg, opts, 32);
    let mut seed = 3;
    let toks = random_tokens(20, &mut seed);
    let dense = model
        .forward_dense(&toks)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let scale = dense.iter().flatten().fold(0f32, |a, &b| a.max(b.abs()));
    // Prefill 12 tokens, then decode the rest one by one.
    let mut worst = 0f32;
    for (start, n) in [(0usize, 12usize)]
        .into_iter()
        .chain((12..20).map(|i| (i, 1)))
    {
        assert!(policy.reserve(0, start + n).unwrap());
        let mut batch = StepBatch::default();
        batch.push(0, start, n);
        let pos: Vec<u32> = (start as u32..(start + n) as u32).collect();
        let l = model
            .forward(
                &toks[start..start + n],
                &pos,
                &batch,
                &[n as u32 - 1],
                &mut policy,
            )
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        worst = worst.max(max_abs_diff(&l[0], &dense[start + n - 1]));
    }
    println!("bf16: max |Δlogit| {worst}, max |logit| {scale}");
    // bf16 keeps 8 bits of mantissa: relative error of a few 1e-3 per value.
    assert!(
        worst < 0.05 * scale,
        "max |Δlogit| {worst} vs max |logit| {scale}"
    );
    assert_eq!(policy.seq_device_bytes(0), 20 * 2 * 2 * 16 * 2 * 2);
}
