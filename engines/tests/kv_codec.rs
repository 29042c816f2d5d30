//! The `kv_codec` engine option: how the paged stores keep their rows, composed with
//! every strategy whose rows they write.

mod common;

use common::{max_abs_diff, random_tokens, spec, tiny};
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::kv::KvCodec;
use kvbench_engines::policy::registry::registry;
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};

fn cfg(policy: PolicySpec, kv_codec: Option<KvCodec>, step_tokens: usize) -> EngineConfig {
    EngineConfig {
        num_blocks: Some(512),
        max_model_len: Some(256),
        check_invariants: true,
        policy,
        kv_codec,
        attention: AttentionImpl::Flash,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_batched_tokens: step_tokens,
            prefill: PrefillMode::Chunked,
        },
        ..Default::default()
    }
}

struct Run {
    logits: Vec<Vec<Vec<f32>>>,
    kv_device: u64,
    codec: Option<KvCodec>,
}

/// Teacher-forced logits of two requests (the second's prompt split across steps and
/// batched with the first one's decodes when `step_tokens` is small).
fn run(cfg: EngineConfig) -> Run {
    let mut seed = 21;
    let prompts = [random_tokens(40, &mut seed), random_tokens(23, &mut seed)];
    let forced = [random_tokens(12, &mut seed), random_tokens(9, &mut seed)];
    let mut e = Engine::new(tiny(), cfg).unwrap();
    for (p, f) in prompts.iter().zip(&forced) {
        e.add_request(Request {
            forced_output: f.clone(),
            record_logits: true,
            ..Request::greedy(p.clone(), f.len())
        })
        .unwrap();
    }
    e.run().unwrap();
    let mut out: Vec<_> = e.finished().to_vec();
    out.sort_by_key(|r| r.id);
    Run {
        logits: out.into_iter().map(|r| r.logits).collect(),
        kv_device: e.memory().kv_device,
        codec: e.memory().kv_codec,
    }
}

fn worst(a: &Run, b: &Run) -> f32 {
    let mut d = 0f32;
    for (x, y) in a.logits.iter().zip(&b.logits) {
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(y) {
            d = d.max(max_abs_diff(p, q));
        }
    }
    d
}

const CODECS: [KvCodec; 3] = [
    KvCodec::Bf16,
    KvCodec::Int { bits: 8, group: 32 },
    KvCodec::Int { bits: 4, group: 16 },
];

/// Budget 1 keeps every row, so a strategy reads exactly the rows `full` reads when
/// both store them alike: the logits agree to f32 rounding for every codec, with
/// prompts whole and split across steps.
#[test]
fn every_codec_strategy_at_budget_one_reproduces_full_with_the_same_codec() {
    let model = tiny();
    let mut checked = 0;
    for codec in CODECS {
        for step_tokens in [2048, 16] {
            let reference = run(cfg(PolicySpec::full(), Some(codec), step_tokens));
            assert_eq!(reference.codec, Some(codec));
            for st in registry().iter().filter(|s| s.kv_codec) {
                for v in st.verify.iter().filter(|v| v.runs_on(false)) {
                    // StreamingLLM's rolling positions store keys before RoPE (the
                    // original's form): its rows are coded before the rotation that
                    // `full`'s are coded after, so the two differ by the codec's
                    // error; its f32 rows match (tests/policies.rs).
                    if st.name == "streaming" && !v.params.contains(&("rolling_positions", "false"))
                    {
                        continue;
                    }
                    let s = spec(&model, st.name, 1.0, v.params);
                    let got = run(cfg(s.clone(), Some(codec), step_tokens));
                    assert_eq!(got.codec, Some(codec), "{}", st.name);
                    let d = worst(&reference, &got);
                    assert!(
                        d < 1e-4,
                        "{} {} {codec} {step_tokens}: Δ {d}",
                        st.name,
                        s.params_json()
                    );
                    checked += 1;
                }
            }
        }
    }
    // full, h2o, streaming (positions stored), snapkv ×2, quest ×2, hybrid ×2.
    assert_eq!(checked, CODECS.len() * 2 * 9);
}

/// A coded cache changes what attention reads (the logits move, by more for fewer
/// bits) and holds the bytes its rows take: the pool of 512 blocks is exactly
/// 512 × the codec's block bytes.
#[test]
fn codecs_change_the_logits_and_hold_their_bytes() {
    let model = tiny();
    let c = &model.cfg;
    let f32_run = run(cfg(PolicySpec::full(), None, 2048));
    assert_eq!(f32_run.codec, Some(KvCodec::F32));
    let mut last = 0f32;
    for codec in [
        KvCodec::Int { bits: 8, group: 32 },
        KvCodec::Int { bits: 4, group: 32 },
        KvCodec::Int { bits: 2, group: 32 },
    ] {
        let r = run(cfg(PolicySpec::full(), Some(codec), 2048));
        let d = worst(&f32_run, &r);
        assert!(d > last && d.is_finite(), "{codec}: Δ {d} after {last}");
        last = d;
        let block = 16 * codec.token_bytes(c);
        assert_eq!(r.kv_device, 512 * block, "{codec}");
        assert!(block < 16 * KvCodec::F32.token_bytes(c));
    }
    // Eight bits stay close: the rows are within half a scale of their group.
    let r8 = run(cfg(
        PolicySpec::full(),
        Some(KvCodec::Int { bits: 8, group: 32 }),
        2048,
    ));
    assert!(worst(&f32_run, &r8) < 0.05, "{}", worst(&f32_run, &r8));
}

/// Compressing strategies with coded rows pass the engine's budget audit, whose bytes
/// follow the codec: a policy holding f32 rows under `int4` would fail it.
#[test]
fn coded_compression_passes_the_audit_by_its_own_bytes() {
    let model = tiny();
    let int4 = KvCodec::Int { bits: 4, group: 32 };
    for (name, params) in [
        ("h2o", vec![]),
        ("streaming", vec![]),
        ("snapkv", vec![("window", "4")]),
        ("quest", vec![("dense_layers", "0"), ("page", "4")]),
        ("hybrid", vec![("threshold", "30")]),
    ] {
        let s = spec(&model, name, 0.3, &params);
        let coded = run(cfg(s.clone(), Some(int4), 2048));
        assert_eq!(coded.codec, Some(int4));
        let plain = run(cfg(s, None, 2048));
        assert!(worst(&plain, &coded) > 0.0, "{name}");
        assert!(
            coded.kv_device < plain.kv_device,
            "{name}: {} ≥ {}",
            coded.kv_device,
            plain.kv_device
        );
    }
}

/// Strategies that keep their K/V in storage of their own refuse the option, naming
/// it, when parsed and when built (hybrid's long side).
#[test]
fn storage_of_its_own_refuses_the_option() {
    let kv = |v: &str| vec![("kv_codec".to_string(), v.to_string())];
    for name in ["kivi", "infinigen"] {
        let e = PolicySpec::parse(name, 1.0, &kv("int4"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("kv_codec=int4") && e.contains(name), "{e}");
    }
    let e = PolicySpec::parse("full", 1.0, &kv("int5"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("kv_codec=int5") && e.contains("int4"), "{e}");
    let model = tiny();
    let hybrid = spec(
        &model,
        "hybrid",
        0.3,
        &[("threshold", "8"), ("long", "infinigen")],
    );
    let e = Engine::new(
        model,
        cfg(hybrid, Some(KvCodec::Int { bits: 4, group: 32 }), 2048),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("kv_codec=int4") && e.contains("infinigen"),
        "{e}"
    );
}
