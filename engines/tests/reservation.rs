//! How each engine reserves its device KV (`reservation`): `full` holds the fraction of
//! the capacity from start-up (vLLM); `h2o`, `streaming` and `infinigen` hold what their
//! admitted sequences need at their budget, grown on demand (FlexGen, InfiniGen). The
//! ledger records what each one holds, to the byte.

mod common;

use common::{random_tokens, spec, tiny};
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::error::{Component, Error};
use kvbench_engines::kv::{KvCodec, PagedKv};
use kvbench_engines::policy::budget::infinigen_selection_cap;
use kvbench_engines::policy::full::{FullOptions, FullPolicy};
use kvbench_engines::policy::spec::{split_engine_options, PolicySpec, Reservation};
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};

const CAP: u64 = 64 << 20;
const BS: usize = 16;
const BATCH: usize = 4;
const MAX_TOKENS: usize = 2048;

/// A 64 MiB device at 90 %, every prefill of the batch in one step.
fn cfg(policy: PolicySpec, reservation: Option<Reservation>) -> EngineConfig {
    EngineConfig {
        device_memory: Some(CAP),
        memory_fraction: 0.9,
        num_blocks: None,
        reservation,
        block_size: BS,
        max_model_len: Some(256),
        check_invariants: true,
        policy,
        scheduler: SchedulerConfig {
            max_num_seqs: BATCH,
            max_batched_tokens: MAX_TOKENS,
            prefill: PrefillMode::Chunked,
        },
        ..Default::default()
    }
}

/// Device KV the engine held (the ledger's) after `BATCH` requests of `prompt` tokens
/// and `output` new tokens.
fn held(cfg: EngineConfig, prompt: usize, output: usize) -> u64 {
    let mut e = Engine::new(tiny(), cfg).unwrap();
    let mut seed = 7;
    for _ in 0..BATCH {
        e.add_request(Request::greedy(random_tokens(prompt, &mut seed), output))
            .unwrap();
    }
    e.run().unwrap();
    assert_eq!(e.finished().len(), BATCH);
    e.memory().kv_device
}

/// Bytes of one block of all layers (f32 K and V: the tiny model's and the slot stores').
fn block(layers: usize) -> u64 {
    let c = &tiny().cfg;
    PagedKv::block_bytes(layers, BS, c.num_kv_heads, c.head_dim, KvCodec::F32)
}

/// What the fraction leaves for the KV: capacity × 0.9 − weights − the activation
/// profile, in whole blocks.
fn fraction_pool() -> u64 {
    let m = tiny();
    let profile = m.activation_bytes(MAX_TOKENS, BATCH);
    let usable = (CAP as f64 * 0.9) as u64 - m.weights_bytes() - profile;
    let b = block(m.cfg.num_layers);
    usable / b * b
}

#[test]
fn full_holds_the_fraction_and_the_evicting_policies_what_their_batch_needs() {
    let model = tiny();
    let layers = model.cfg.num_layers;
    let (prompt, output) = (100, 8);
    let full = held(cfg(PolicySpec::full(), None), prompt, output);
    assert_eq!(full, fraction_pool(), "full: the fraction, up front");

    // H2O and StreamingLLM hold every prompt token during the prefill (all four in
    // the first step), then C + 1 slots of fewer blocks: the pool grew to the prefill.
    let prefill_blocks = (BATCH * prompt.div_ceil(BS)) as u64;
    for name in ["h2o", "streaming"] {
        let kv = held(cfg(spec(&model, name, 0.3, &[]), None), prompt, output);
        assert_eq!(kv, prefill_blocks * block(layers), "{name}");
        assert!(kv * 10 < full, "{name}: {kv} vs full {full}");
    }

    // InfiniGen: its dense layer keeps all prompt + output tokens (the last one is
    // never computed), the offloaded layer's partial keys, partial weights and the two
    // staging buffers of its selection per sequence.
    let s = spec(&model, "infinigen", 0.3, &[("dense_layers", "1")]);
    let PolicySpec::Infinigen(p) = &s else {
        unreachable!()
    };
    let (hkv, dh) = (model.cfg.num_kv_heads, model.cfg.head_dim);
    let r = (p.partial_ratio * dh as f64).floor() as usize;
    let n_max = prompt + output;
    let cap = infinigen_selection_cap(0.3, prompt, output, prompt, p.relative_to_current);
    let off = layers - 1;
    let fixed =
        (off * hkv * n_max * r * 4 + off * hkv * dh * r * 4 + 2 * 2 * hkv * cap * dh * 4) as u64;
    let dense = (BATCH * (prompt + output - 1).div_ceil(BS)) as u64 * block(1);
    let kv = held(cfg(s, None), prompt, output);
    assert_eq!(kv, dense + BATCH as u64 * fixed, "infinigen");
    assert!(kv * 10 < full);
}

#[test]
fn a_pool_grown_on_demand_grows_for_a_longer_admission_and_keeps_what_it_grew_to() {
    let model = tiny();
    let b = block(model.cfg.num_layers);
    let mut e = Engine::new(tiny(), cfg(spec(&model, "h2o", 0.3, &[]), None)).unwrap();
    let mut seed = 3;
    e.add_request(Request::greedy(random_tokens(40, &mut seed), 4))
        .unwrap();
    e.run().unwrap();
    assert_eq!(e.memory().kv_device, 3 * b, "40 prompt tokens: 3 blocks");
    e.add_request(Request::greedy(random_tokens(200, &mut seed), 4))
        .unwrap();
    e.run().unwrap();
    assert_eq!(e.memory().kv_device, 13 * b, "then 200: grown to 13 blocks");
    let mem = e.policy().memory();
    assert_eq!(mem.device_reserved, 13 * b, "kept once grown");
    assert_eq!(mem.device_used, 0, "nothing is held for a finished request");
}

#[test]
fn the_other_reservation_is_an_option_for_every_engine() {
    let model = tiny();
    let b = block(model.cfg.num_layers);
    let (prompt, output) = (100, 8);
    // `fraction` restores the pool allocated up front for the evicting policies.
    for name in ["h2o", "streaming"] {
        let kv = held(
            cfg(spec(&model, name, 0.3, &[]), Some(Reservation::Fraction)),
            prompt,
            output,
        );
        assert_eq!(kv, fraction_pool(), "{name}");
    }
    // `budget` makes `full` grow to what its batch holds: every token, in blocks.
    let kv = held(
        cfg(PolicySpec::full(), Some(Reservation::Budget)),
        prompt,
        output,
    );
    assert_eq!(kv, (BATCH * (prompt + output - 1).div_ceil(BS)) as u64 * b);
}

#[test]
fn a_budget_of_one_holds_what_full_holds_when_both_grow_on_demand() {
    let model = tiny();
    let full = held(cfg(PolicySpec::full(), Some(Reservation::Budget)), 100, 8);
    for name in ["h2o", "streaming"] {
        assert_eq!(
            held(cfg(spec(&model, name, 1.0, &[]), None), 100, 8),
            full,
            "{name}"
        );
    }
}

#[test]
fn a_pool_held_past_the_capacity_is_a_typed_oom() {
    // A policy built elsewhere with a pool larger than the device: the first step
    // charges it and fails with the typed error naming the device KV.
    let model = tiny();
    let opts = FullOptions {
        block_size: BS,
        ..Default::default()
    };
    let policy = FullPolicy::new(&model.cfg, opts, 4096);
    let cap = model.weights_bytes() + 100 * block(model.cfg.num_layers);
    let c = EngineConfig {
        device_memory: Some(cap),
        num_blocks: Some(4096),
        max_model_len: Some(256),
        ..Default::default()
    };
    let mut e = Engine::with_policy(model, c, Box::new(policy)).unwrap();
    e.add_request(Request::greedy(vec![1, 2, 3], 2)).unwrap();
    match e.run() {
        Err(Error::OutOfMemory {
            component: Component::KvDevice,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_option_is_split_off_the_strategy_parameters_and_checked() {
    let p = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
    let (o, rest) = split_engine_options(&p("reservation", "fraction")).unwrap();
    assert_eq!(
        (o.reservation, rest.len()),
        (Some(Reservation::Fraction), 0)
    );
    let (o, rest) = split_engine_options(&p("kv_codec", "int4")).unwrap();
    assert_eq!(
        (o.kv_codec, o.reservation, rest.len()),
        (Some(KvCodec::Int { bits: 4, group: 32 }), None, 0)
    );
    let (o, rest) = split_engine_options(&p("sinks", "2")).unwrap();
    assert_eq!((o, rest), (Default::default(), p("sinks", "2")));
    let e = split_engine_options(&p("kv_codec", "int3"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("kv_codec=int3") && e.contains("int4"), "{e}");
    let e = split_engine_options(&p("reservation", "half"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("reservation=half") && e.contains("fraction") && e.contains("budget"),
        "{e}"
    );
    assert_eq!(
        Reservation::default_for(&PolicySpec::full()),
        Reservation::Fraction
    );
    let h2o = PolicySpec::parse("h2o", 0.3, &[]).unwrap();
    assert_eq!(Reservation::default_for(&h2o), Reservation::Budget);
}

#[test]
fn a_prepared_budget_pool_holds_the_batch_peak_before_the_timed_steps() {
    use kvbench_engines::policy::SeqInfo;
    let model = tiny();
    let b = block(model.cfg.num_layers);
    let (prompt, output) = (100, 8);
    for name in ["h2o", "streaming"] {
        // One prompt prefilled at a time (the study's H2O): the peak is every sequence
        // at its capacity plus one prompt whole.
        let mut c = cfg(spec(&model, name, 0.3, &[]), None);
        c.scheduler.prefill = PrefillMode::Sequential;
        let run = |prepare: bool| {
            let mut e = Engine::new(tiny(), c.clone()).unwrap();
            let info = SeqInfo {
                prompt_len: prompt,
                max_new_tokens: output,
                prefill_len: prompt,
            };
            if prepare {
                e.prepare(&[info; BATCH]).unwrap();
            }
            let before = e.memory().kv_device;
            let mut seed = 7;
            for _ in 0..BATCH {
                e.add_request(Request::greedy(random_tokens(prompt, &mut seed), output))
                    .unwrap();
            }
            e.run().unwrap();
            (before, e.memory().kv_device)
        };
        let (none, grown) = run(false);
        assert_eq!(none, 0, "{name}: nothing held before the first step");
        let (before, after) = run(true);
        // Prepared: the steps grow nothing, and the pool is the peak the unprepared
        // engine grew to inside its steps.
        assert_eq!(before, after, "{name}");
        assert_eq!(
            before,
            grown,
            "{name}: {} vs {} blocks",
            before / b,
            grown / b
        );
    }
}
