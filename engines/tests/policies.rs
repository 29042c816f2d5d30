//! The strategies against full attention and against what algorithms.md says they keep.

mod common;

use common::{max_abs_diff, random_tokens, spec, tiny};
use kvbench_engines::attention::prefill::{
    prefill_attention, AttentionImpl, ColumnStats, PrefillShape,
};
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::error::Error;
use kvbench_engines::model::Llama;
use kvbench_engines::policy::budget::{h2o_counts, H2oRatio};
use kvbench_engines::policy::full::{FullOptions, FullPolicy};
use kvbench_engines::policy::registry::registry;
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};

fn cfg(policy: PolicySpec, attention: AttentionImpl, prefill: PrefillMode) -> EngineConfig {
    EngineConfig {
        num_blocks: Some(512),
        max_model_len: Some(256),
        check_invariants: true,
        policy,
        attention,
        chunk_size: 7,
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_batched_tokens: 2048,
            prefill,
        },
        ..Default::default()
    }
}

/// Logits of every generated position of each request, teacher-forced on `forced`.
fn run_forced(
    cfg: EngineConfig,
    prompts: &[Vec<u32>],
    forced: &[Vec<u32>],
) -> Result<Vec<Vec<Vec<f32>>>, Error> {
    let mut e = Engine::new(tiny(), cfg)?;
    for (p, f) in prompts.iter().zip(forced) {
        e.add_request(Request {
            forced_output: f.clone(),
            record_logits: true,
            ..Request::greedy(p.clone(), f.len())
        })?;
    }
    e.run()?;
    let mut out: Vec<_> = e.finished().to_vec();
    out.sort_by_key(|r| r.id);
    Ok(out.into_iter().map(|r| r.logits).collect())
}

fn workload() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let mut seed = 21;
    let prompts = vec![random_tokens(40, &mut seed), random_tokens(23, &mut seed)];
    let forced = vec![random_tokens(12, &mut seed), random_tokens(9, &mut seed)];
    (prompts, forced)
}

#[test]
fn every_policy_and_attention_at_budget_one_reproduces_full_eager() {
    let model = tiny();
    let (prompts, forced) = workload();
    let reference = run_forced(
        cfg(
            PolicySpec::full(),
            AttentionImpl::Eager,
            PrefillMode::Chunked,
        ),
        &prompts,
        &forced,
    )
    .unwrap();
    // Every registered strategy with each parameter set `kvbench verify` runs.
    let specs: Vec<PolicySpec> = registry()
        .iter()
        .flat_map(|st| st.verify.iter().map(move |v| (st.name, v)))
        .filter(|(_, v)| v.runs_on(false))
        .map(|(name, v)| spec(&model, name, 1.0, v.params))
        .collect();
    assert!(specs.len() >= registry().len());
    for s in &specs {
        for imp in [
            AttentionImpl::Eager,
            AttentionImpl::Chunked,
            AttentionImpl::Flash,
        ] {
            // Chunked with a 16-token step budget: prompts split across steps and
            // batched with the other request's decodes.
            for (prefill, step_tokens) in [
                (PrefillMode::Chunked, 2048),
                (PrefillMode::Chunked, 16),
                (PrefillMode::Sequential, 2048),
            ] {
                let mut c = cfg(s.clone(), imp, prefill);
                c.scheduler.max_batched_tokens = step_tokens;
                let got = run_forced(c, &prompts, &forced).unwrap();
                for (a, b) in reference.iter().zip(&got) {
                    assert_eq!(a.len(), b.len());
                    for (x, y) in a.iter().zip(b) {
                        let d = max_abs_diff(x, y);
                        assert!(
                            d < 1e-4,
                            "{} {} {imp} {prefill:?} {step_tokens}: Δ {d}",
                            s.name(),
                            s.params_json()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn small_budgets_change_the_logits_and_pass_the_audit() {
    let model = tiny();
    let (prompts, forced) = workload();
    let reference = run_forced(
        cfg(
            PolicySpec::full(),
            AttentionImpl::Flash,
            PrefillMode::Sequential,
        ),
        &prompts,
        &forced,
    )
    .unwrap();
    for s in [
        spec(&model, "h2o", 0.3, &[]),
        spec(&model, "h2o", 0.3, &[("ratio", "flexgen_hh")]),
        spec(&model, "h2o", 0.02, &[]),
        spec(&model, "h2o", 0.3, &[("decode_update", "false")]),
        spec(&model, "streaming", 0.3, &[]),
        spec(&model, "streaming", 0.02, &[("sinks", "1")]),
        spec(&model, "infinigen", 0.3, &[("dense_layers", "1")]),
        spec(
            &model,
            "infinigen",
            0.1,
            &[("dense_layers", "1"), ("alpha", "1")],
        ),
        spec(&model, "snapkv", 0.3, &[("window", "4")]),
        spec(&model, "snapkv", 0.1, &[("pooling", "max")]),
        spec(
            &model,
            "quest",
            0.3,
            &[("dense_layers", "0"), ("page", "4")],
        ),
    ] {
        for imp in [AttentionImpl::Eager, AttentionImpl::Flash] {
            let got = run_forced(
                cfg(s.clone(), imp, PrefillMode::Sequential),
                &prompts,
                &forced,
            )
            .unwrap_or_else(|e| panic!("{} {:?}: {e}", s.name(), s.params_json()));
            let d = max_abs_diff(&reference[0][11], &got[0][11]);
            assert!(
                d > 1e-4,
                "{} at budget {} changed nothing",
                s.name(),
                s.budget()
            );
        }
    }
}

#[test]
fn the_audit_fails_a_policy_that_keeps_everything() {
    let model = tiny();
    let (prompts, forced) = workload();
    let c = cfg(
        spec(&model, "h2o", 0.3, &[]),
        AttentionImpl::Flash,
        PrefillMode::Sequential,
    );
    let full = FullPolicy::new(&model.cfg, FullOptions::default(), 512);
    let mut e = Engine::with_policy(tiny(), c, Box::new(full)).unwrap();
    e.add_request(Request::greedy(prompts[0].clone(), forced[0].len()))
        .unwrap();
    match e.run() {
        Err(Error::Budget(m)) => assert!(m.contains("attended"), "{m}"),
        other => panic!("expected a budget failure, got {other:?}"),
    }
}

/// Drive a policy step by step (sequential prefill, then decode) and return it.
fn drive(model: &Llama, s: &PolicySpec, seqs: &[(u64, Vec<u32>)], decode_steps: usize) -> Engine {
    drive_with(model, s, seqs, decode_steps, None)
}

/// As [`drive`]; with `chunk`, prompts are prefilled `chunk` tokens per step.
fn drive_with(
    model: &Llama,
    s: &PolicySpec,
    seqs: &[(u64, Vec<u32>)],
    decode_steps: usize,
    chunk: Option<usize>,
) -> Engine {
    let mut c = cfg(s.clone(), AttentionImpl::Flash, PrefillMode::Sequential);
    if let Some(n) = chunk {
        c.scheduler.prefill = PrefillMode::Chunked;
        c.scheduler.max_batched_tokens = n;
    }
    let mut e = Engine::new(model.clone(), c).unwrap();
    for (_, p) in seqs {
        e.add_request(Request::greedy(p.clone(), 64)).unwrap();
    }
    // Step until every prompt is prefilled, then the decode steps.
    let prompt_tokens: usize = seqs.iter().map(|(_, p)| p.len()).sum();
    while e
        .traces()
        .iter()
        .map(|t| t.num_prefill_tokens)
        .sum::<usize>()
        < prompt_tokens
    {
        e.step().unwrap();
    }
    for _ in 0..decode_steps {
        e.step().unwrap();
    }
    e
}

/// Column sums of the prompt's softmax per (layer, KV head), from the model's own
/// layer inputs and a naive softmax (independent of the policies).
fn naive_column_sums(model: &Llama, prompt: &[u32]) -> Vec<Vec<Vec<f32>>> {
    let c = &model.cfg;
    let (h, hkv, dh) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let n = prompt.len();
    let mut out = Vec::new();
    model
        .forward_observe(prompt, &mut |i| {
            let q = i.q.flatten_all()?.to_vec1::<f32>()?;
            let k = i.k.flatten_all()?.to_vec1::<f32>()?;
            let mut col = vec![vec![0f32; n]; hkv];
            for hq in 0..h {
                let g = hq / (h / hkv);
                for row in 0..n {
                    let s: Vec<f64> = (0..=row)
                        .map(|j| {
                            (0..dh)
                                .map(|d| {
                                    q[(row * h + hq) * dh + d] as f64
                                        * k[(j * hkv + g) * dh + d] as f64
                                })
                                .sum::<f64>()
                                / (dh as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for (j, x) in s.iter().enumerate() {
                        col[g][j] += ((x - m).exp() / z) as f32;
                    }
                }
            }
            out.push(col);
            Ok(())
        })
        .unwrap();
    out
}

#[test]
fn h2o_keeps_the_window_and_the_heavy_hitters_of_the_exact_statistics() {
    let model = tiny();
    let mut seed = 4;
    let prompt = random_tokens(60, &mut seed);
    let budget = 0.3;
    let c = h2o_counts(budget, prompt.len(), 0.5, H2oRatio::Total).unwrap();
    let cols = naive_column_sums(&model, &prompt);
    // Exact statistics are exact whatever the scheduler's prefill chunks.
    for (stats, chunk) in [
        ("exact", None),
        ("eager", None),
        ("exact", Some(13)),
        ("exact", Some(1)),
    ] {
        let s = spec(&model, "h2o", budget, &[("stats", stats)]);
        let e = drive_with(&model, &s, &[(0, prompt.clone())], 0, chunk);
        for (layer, col) in cols.iter().enumerate() {
            for (g, col) in col.iter().enumerate() {
                let mut kept = e.policy().kept_positions(0, layer, g).unwrap();
                kept.sort_unstable();
                let n = prompt.len();
                let mut old: Vec<usize> = (0..n - c.recent).collect();
                old.sort_by(|&a, &b| col[b].partial_cmp(&col[a]).unwrap().then(a.cmp(&b)));
                let mut want: Vec<u32> = old[..c.heavy].iter().map(|&x| x as u32).collect();
                want.extend((n - c.recent) as u32..n as u32);
                want.sort_unstable();
                assert_eq!(
                    kept, want,
                    "stats {stats}, chunk {chunk:?}, layer {layer}, head {g}"
                );
            }
        }
    }
}

/// Per (layer, KV head), each key's softmax probability summed over the last `w`
/// prompt rows and the group's heads, from the model's own layer inputs (naive, f64).
fn naive_window_votes(model: &Llama, prompt: &[u32], w: usize) -> Vec<Vec<Vec<f64>>> {
    let c = &model.cfg;
    let (h, hkv, dh) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let n = prompt.len();
    let mut out = Vec::new();
    model
        .forward_observe(prompt, &mut |i| {
            let q = i.q.flatten_all()?.to_vec1::<f32>()?;
            let k = i.k.flatten_all()?.to_vec1::<f32>()?;
            let mut vote = vec![vec![0f64; n]; hkv];
            for hq in 0..h {
                let g = hq / (h / hkv);
                for row in n - w..n {
                    let s: Vec<f64> = (0..=row)
                        .map(|j| {
                            (0..dh)
                                .map(|d| {
                                    q[(row * h + hq) * dh + d] as f64
                                        * k[(j * hkv + g) * dh + d] as f64
                                })
                                .sum::<f64>()
                                / (dh as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for (j, x) in s.iter().enumerate() {
                        vote[g][j] += (x - m).exp() / z;
                    }
                }
            }
            out.push(vote);
            Ok(())
        })
        .unwrap();
    out
}

#[test]
fn snapkv_keeps_the_window_and_the_pooled_top_of_the_window_votes() {
    let model = tiny();
    let mut seed = 21;
    let prompt = random_tokens(60, &mut seed);
    let n = prompt.len();
    let (w, kernel) = (8, 3);
    let votes = naive_window_votes(&model, &prompt, w);
    let capacity = (0.5 * n as f64).floor() as usize;
    for pooling in ["avg", "max"] {
        let params = [("window", "8"), ("kernel", "3"), ("pooling", pooling)];
        let s = spec(&model, "snapkv", 0.5, &params);
        // The window's rows split across prefill steps, or all in one.
        for chunk in [None, Some(13), Some(1)] {
            let decode = 5;
            let e = drive_with(&model, &s, &[(0, prompt.clone())], decode, chunk);
            for (layer, vote) in votes.iter().enumerate() {
                for (g, vote) in vote.iter().enumerate() {
                    // Pooling over the keys before the window (zero padding counted by
                    // the average, ignored by the max), then the top C − w, older first.
                    let prefix = n - w;
                    let pooled: Vec<f64> = (0..prefix)
                        .map(|j| {
                            let lo = j.saturating_sub(kernel / 2);
                            let hi = (j + kernel / 2 + 1).min(prefix);
                            let xs = &vote[lo..hi];
                            if pooling == "avg" {
                                xs.iter().sum::<f64>() / kernel as f64
                            } else {
                                xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
                            }
                        })
                        .collect();
                    let mut old: Vec<usize> = (0..prefix).collect();
                    old.sort_by(|&a, &b| {
                        pooled[b].partial_cmp(&pooled[a]).unwrap().then(a.cmp(&b))
                    });
                    let mut want: Vec<u32> =
                        old[..capacity - w].iter().map(|&x| x as u32).collect();
                    want.extend(prefix as u32..n as u32);
                    // Decode tokens are appended, never evicted.
                    want.extend(n as u32..(n + decode) as u32);
                    want.sort_unstable();
                    let mut kept = e.policy().kept_positions(0, layer, g).unwrap();
                    kept.sort_unstable();
                    assert_eq!(
                        kept, want,
                        "{pooling}, chunk {chunk:?}, layer {layer}, head {g}"
                    );
                }
            }
            e.policy().check_invariants().unwrap();
        }
    }
}

#[test]
fn h2o_kept_sets_are_the_same_alone_and_in_a_batch() {
    let model = tiny();
    let mut seed = 8;
    let a = random_tokens(50, &mut seed);
    let b = random_tokens(31, &mut seed);
    let s = spec(&model, "h2o", 0.3, &[]);
    let alone = drive(&model, &s, &[(0, a.clone())], 6);
    let batched = drive(&model, &s, &[(0, a), (1, b)], 6);
    for layer in 0..2 {
        for g in 0..2 {
            let x = alone.policy().kept_positions(0, layer, g).unwrap();
            let y = batched.policy().kept_positions(0, layer, g).unwrap();
            assert_eq!(x, y, "layer {layer} head {g}");
            // C tokens kept after each step, including the whole recent window.
            assert_eq!(x.len(), 15);
            for p in (56 - 7)..56 {
                assert!(x.contains(&p), "recent position {p} missing");
            }
        }
    }
}

#[test]
fn a_token_that_takes_all_attention_mass_is_never_evicted() {
    // Hand-built: key 3 has a huge dot product with every query.
    let (h, hkv, dh, n) = (4, 2, 8, 24);
    let mut q = vec![0f32; n * h * dh];
    let mut k = vec![0f32; n * hkv * dh];
    let v = vec![1f32; n * hkv * dh];
    for row in 0..n {
        for hq in 0..h {
            q[(row * h + hq) * dh] = 10.0;
        }
    }
    for g in 0..hkv {
        k[(3 * hkv + g) * dh] = 10.0;
    }
    let shape = PrefillShape {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: dh,
    };
    let r = prefill_attention(
        &q,
        &k,
        &v,
        n,
        n,
        shape,
        AttentionImpl::Flash,
        8,
        Some(ColumnStats::Exact),
        None,
    )
    .unwrap();
    let col = r.col.unwrap();
    use kvbench_engines::policy::evicting::h2o::{H2o, H2oParams};
    use kvbench_engines::policy::evicting::{Counts, Eviction};
    let rule = H2o(H2oParams::default());
    let keep = rule.prefill_keep(
        Counts {
            capacity: 4,
            recent: 2,
        },
        n,
        &col[..n],
    );
    assert!(keep.contains(&3), "{keep:?}");
}

#[test]
fn streaming_keeps_sinks_and_the_last_window_in_both_position_modes() {
    let model = tiny();
    let mut seed = 12;
    let prompt = random_tokens(80, &mut seed);
    for rolling in ["true", "false"] {
        let s = spec(
            &model,
            "streaming",
            0.2,
            &[("sinks", "4"), ("rolling_positions", rolling)],
        );
        // S + W = 16: sinks 0..4 and the last 12 positions.
        let e = drive(&model, &s, &[(0, prompt.clone())], 5);
        let n = 85u32;
        for layer in 0..2 {
            let mut kept = e.policy().kept_positions(0, layer, 1).unwrap();
            kept.sort_unstable();
            let want: Vec<u32> = (0..4).chain(n - 12..n).collect();
            assert_eq!(kept, want, "rolling {rolling}");
        }
    }
}

#[test]
fn infinigen_with_full_partial_keys_and_the_true_query_selects_the_exact_top_k() {
    // With ρ = 1 the partial keys are the whole skewed keys, so the estimated logits are
    // the true ones; with the layer's own query (oracle) the selection is the true top-k.
    let model = tiny();
    let mut seed = 30;
    let prompt = random_tokens(70, &mut seed);
    let s = spec(
        &model,
        "infinigen",
        0.2,
        &[
            ("dense_layers", "1"),
            ("partial_ratio", "1"),
            ("speculate", "oracle"),
            ("alpha", "inf"),
        ],
    );
    let e = drive(&model, &s, &[(0, prompt.clone())], 1);
    // The decode token's query in layer 1, from the model itself.
    let out = e.finished();
    assert!(out.is_empty());
    let mut toks = prompt.clone();
    // The token the engine generated at the end of the prefill (greedy).
    let logits = model.forward_dense(&prompt).unwrap();
    let last = logits.get(prompt.len() - 1).unwrap().unsqueeze(0).unwrap();
    toks.push(kvbench_engines::engine::argmax_rows(&last).unwrap()[0]);
    let c = &model.cfg;
    let (h, hkv, dh) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let mut layer1 = None;
    model
        .forward_observe(&toks, &mut |i| {
            if i.layer == 1 {
                layer1 = Some((
                    i.q.flatten_all()?.to_vec1::<f32>()?,
                    i.k.flatten_all()?.to_vec1::<f32>()?,
                ));
            }
            Ok(())
        })
        .unwrap();
    let (q, k) = layer1.unwrap();
    let n = prompt.len();
    let k_max = (0.2f64 * (70 + 64) as f64).ceil() as usize;
    for g in 0..hkv {
        let est: Vec<f32> = (0..n)
            .map(|j| {
                (g * (h / hkv)..(g + 1) * (h / hkv))
                    .map(|hq| {
                        (0..dh)
                            .map(|d| q[(n * h + hq) * dh + d] * k[(j * hkv + g) * dh + d])
                            .sum::<f32>()
                    })
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        let mut idx: Vec<usize> = (0..n).collect();
        idx.sort_by(|&a, &b| est[b].partial_cmp(&est[a]).unwrap().then(a.cmp(&b)));
        let mut want: Vec<u32> = idx[..k_max].iter().map(|&x| x as u32).collect();
        want.sort_unstable();
        let got = e.policy().kept_positions(0, 1, g).unwrap();
        assert_eq!(got.len(), want.len(), "head {g}");
        // Identical sets, except that a token whose true score is within fp noise
        // (the skewing is orthogonal to ~1e-6 here) of the k-th may swap with it.
        let kth = est[idx[k_max - 1]];
        for p in got.iter().filter(|p| !want.contains(p)) {
            let d = (est[*p as usize] - kth).abs();
            assert!(
                d < 1e-4 * kth.abs().max(1.0),
                "head {g}: {p} selected, {d} below the k-th"
            );
        }
    }
}

#[test]
fn an_eager_prefill_past_the_device_capacity_is_a_typed_oom_and_flash_fits() {
    let model = tiny();
    let mut seed = 40;
    let prompt = random_tokens(200, &mut seed);
    let mk = |imp, capacity| EngineConfig {
        device_memory: Some(capacity),
        memory_fraction: 1.0,
        max_model_len: Some(256),
        policy: PolicySpec::parse("h2o", 0.5, &[("stats".into(), "exact".into())]).unwrap(),
        attention: imp,
        // One sequence: the start-up profile leaves little headroom past the prompt.
        scheduler: SchedulerConfig {
            max_num_seqs: 1,
            max_batched_tokens: 256,
            prefill: PrefillMode::Sequential,
        },
        ..Default::default()
    };
    let run = |imp, capacity| -> Result<u64, Error> {
        let mut e = Engine::new(tiny(), mk(imp, capacity))?;
        e.add_request(Request::greedy(prompt.clone(), 4))?;
        e.run()?;
        Ok(e.memory().device_total())
    };
    // What a flash prefill needs, then a capacity 200 kB above it: the eager score
    // matrix (4 heads × 200 × 200 f32 = 640 kB) cannot fit.
    let need = run(AttentionImpl::Flash, model.weights_bytes() * 10).unwrap();
    let capacity = need + 200_000;
    run(AttentionImpl::Flash, capacity).unwrap();
    let err = run(AttentionImpl::Eager, capacity).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(err.to_string().contains("activations"), "{err}");
}

#[test]
fn parameters_are_checked_with_errors_that_name_them() {
    let e = PolicySpec::parse("h2o", 0.3, &[("heavy".into(), "1".into())]).unwrap_err();
    assert!(e.to_string().contains("heavy_fraction"), "{e}");
    let e = PolicySpec::parse("lru", 0.3, &[]).unwrap_err();
    assert!(e.to_string().contains("full, h2o"), "{e}");
    let e = PolicySpec::parse("full", 0.3, &[]).unwrap_err();
    assert!(e.to_string().contains("budgets apply"), "{e}");
    let e = PolicySpec::parse("h2o", -1.0, &[]).unwrap_err();
    assert!(e.to_string().contains("fraction"), "{e}");
    let e = PolicySpec::parse("infinigen", 0.3, &[("alpha".into(), "x".into())]).unwrap_err();
    assert!(e.to_string().contains("alpha=x"), "{e}");
    let e = PolicySpec::parse("infinigen", 0.3, &[("transfer".into(), "dma".into())]).unwrap_err();
    assert!(e.to_string().contains("`zero_copy` or `memcpy`"), "{e}");
    let s = PolicySpec::parse("infinigen", 0.3, &[("transfer".into(), "memcpy".into())]).unwrap();
    assert_eq!(s.params_json()["transfer"], "memcpy");
    // The transfer mode is CUDA's: the CPU policy refuses one it would not run.
    let s = PolicySpec::parse(
        "infinigen",
        0.3,
        &[
            ("transfer".into(), "memcpy".into()),
            ("dense_layers".into(), "1".into()),
        ],
    )
    .unwrap();
    let e = Engine::new(tiny(), cfg(s, AttentionImpl::Flash, PrefillMode::Chunked))
        .err()
        .expect("refused on the CPU");
    assert!(e.to_string().contains("transfer=memcpy"), "{e}");
    // `full` takes only the engine's options, and says which.
    let e = PolicySpec::parse("full", 1.0, &[("bogus".into(), "1".into())]).unwrap_err();
    assert!(
        e.to_string().contains("bogus") && e.to_string().contains("reservation, kv_codec"),
        "{e}"
    );
    PolicySpec::parse("full", 1.0, &[("kv_codec".into(), "int4".into())]).unwrap();
    // KIVI's codes grow with each sequence: a pool up front is refused.
    let mut c = cfg(
        PolicySpec::parse("kivi", 1.0, &[]).unwrap(),
        AttentionImpl::Flash,
        PrefillMode::Chunked,
    );
    c.reservation = Some(kvbench_engines::policy::spec::Reservation::Fraction);
    let e = Engine::new(tiny(), c).err().expect("refused");
    assert!(
        e.to_string().contains("kivi") && e.to_string().contains("reservation=budget"),
        "{e}"
    );
    let e = PolicySpec::parse("snapkv", 0.3, &[("kernel".into(), "4".into())]).unwrap_err();
    assert!(
        e.to_string().contains("kernel=4") && e.to_string().contains("odd"),
        "{e}"
    );
    let e = PolicySpec::parse("snapkv", 0.3, &[("pooling".into(), "min".into())]).unwrap_err();
    assert!(e.to_string().contains("`avg` or `max`"), "{e}");
    let e = PolicySpec::parse("snapkv", 0.3, &[("window".into(), "0".into())]).unwrap_err();
    assert!(e.to_string().contains("window=0"), "{e}");
    let e = PolicySpec::parse("kivi", 1.0, &[("bits".into(), "3".into())]).unwrap_err();
    assert!(e.to_string().contains("2 or 4"), "{e}");
    let e = PolicySpec::parse("kivi", 1.0, &[("residual".into(), "20".into())]).unwrap_err();
    assert!(e.to_string().contains("multiple of group"), "{e}");
    let e = PolicySpec::parse("kivi", 0.5, &[]).unwrap_err();
    assert!(e.to_string().contains("budget 1"), "{e}");
    let e = PolicySpec::parse("quest", 0.3, &[("page".into(), "0".into())]).unwrap_err();
    assert!(e.to_string().contains("page=0"), "{e}");
    let e = PolicySpec::parse("snapkv", 0.3, &[("w".into(), "8".into())]).unwrap_err();
    assert!(e.to_string().contains("window, kernel, pooling"), "{e}");
}

#[test]
fn prompts_shorter_than_the_budget_evict_only_once_the_context_passes_it() {
    let model = tiny();
    let mut seed = 50;
    let prompt = random_tokens(20, &mut seed);
    // FlexGen's ratio at 0.8 keeps 2·⌊0.8·20⌋ = 32 tokens: more than the prompt.
    let s = spec(&model, "h2o", 0.8, &[("ratio", "flexgen_hh")]);
    let e = drive(&model, &s, &[(0, prompt.clone())], 1);
    assert_eq!(e.policy().kept_positions(0, 1, 0).unwrap().len(), 21);
    let e = drive(&model, &s, &[(0, prompt.clone())], 15);
    let kept = e.policy().kept_positions(0, 1, 0).unwrap();
    assert_eq!(kept.len(), 32, "35 tokens of context, capacity 32");
    // StreamingLLM with S + W = S + 1 = 5 and a 3-token prompt.
    let s = spec(&model, "streaming", 0.01, &[]);
    let short = random_tokens(3, &mut seed);
    let e = drive(&model, &s, &[(0, short.clone())], 1);
    assert_eq!(e.policy().kept_positions(0, 0, 0).unwrap().len(), 4);
    let e = drive(&model, &s, &[(0, short)], 6);
    let mut kept = e.policy().kept_positions(0, 0, 0).unwrap();
    kept.sort_unstable();
    assert_eq!(kept, vec![0, 1, 2, 3, 8], "four sinks and a window of one");
}

#[test]
fn hybrid_runs_short_prompts_on_full_and_long_ones_on_its_long_side_in_one_batch() {
    let model = tiny();
    let (prompts, forced) = workload();
    // Prompts of 40 and 23 tokens: the first is long (≥ 30), the second short.
    let hybrid = |long: &str| {
        spec(
            &model,
            "hybrid",
            0.3,
            &[
                ("threshold", "30"),
                ("short_share", "0.3"),
                ("long", long),
                ("long.window", "4"),
            ][..if long == "snapkv" { 4 } else { 3 }],
        )
    };
    for (long, alone) in [
        ("h2o", spec(&model, "h2o", 0.3, &[])),
        ("snapkv", spec(&model, "snapkv", 0.3, &[("window", "4")])),
    ] {
        for prefill in [PrefillMode::Sequential, PrefillMode::Chunked] {
            // A roomy budget, and one whose shares just hold each request: 30 % of 7
            // blocks of 16 tokens is 2 for the 23 + 9 tokens of the short one, the rest
            // 4 for the 40 + 12 of the long one.
            for blocks in [512, 7] {
                let mut c = cfg(hybrid(long), AttentionImpl::Flash, prefill);
                c.num_blocks = Some(blocks);
                let got = run_forced(c, &prompts, &forced)
                    .unwrap_or_else(|e| panic!("{long} {prefill:?} {blocks}: {e}"));
                let full = run_forced(
                    cfg(PolicySpec::full(), AttentionImpl::Flash, prefill),
                    &prompts,
                    &forced,
                )
                .unwrap();
                let compressed = run_forced(
                    cfg(alone.clone(), AttentionImpl::Flash, prefill),
                    &prompts,
                    &forced,
                )
                .unwrap();
                for (i, want) in [(0, &compressed[0]), (1, &full[1])] {
                    assert_eq!(got[i].len(), want.len());
                    for (x, y) in got[i].iter().zip(want) {
                        let d = max_abs_diff(x, y);
                        assert!(
                            d < 1e-4,
                            "{long} {prefill:?} {blocks} blocks, request {i}: Δ {d}"
                        );
                    }
                }
                // The long side compressed: its logits differ from full's.
                assert!(max_abs_diff(&got[0][11], &full[0][11]) > 1e-4, "{long}");
            }
        }
    }
    // The split binds: at half of 7 blocks the long side has 3, short of the 4 its
    // 52 tokens take.
    let mut c = cfg(
        spec(&model, "hybrid", 0.3, &[("threshold", "30")]),
        AttentionImpl::Flash,
        PrefillMode::Chunked,
    );
    c.num_blocks = Some(7);
    let e = run_forced(c, &prompts, &forced).unwrap_err();
    assert!(e.to_string().contains("request 0 rejected"), "{e}");
}

#[test]
fn hybrid_parameters_and_reservation_are_checked() {
    let p = |kv: &[(&str, &str)]| {
        let kv: Vec<(String, String)> = kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        PolicySpec::parse("hybrid", 0.3, &kv)
    };
    let e = p(&[("long", "full")]).unwrap_err();
    assert!(e.to_string().contains("long=full"), "{e}");
    let e = p(&[("long", "hybrid")]).unwrap_err();
    assert!(e.to_string().contains("long=hybrid"), "{e}");
    let e = p(&[("long.heavy", "1")]).unwrap_err();
    assert!(e.to_string().contains("heavy_fraction"), "{e}");
    let e = p(&[("threshold", "0")]).unwrap_err();
    assert!(e.to_string().contains("threshold=0"), "{e}");
    // The long side's parameters apply whichever order `long` comes in.
    let s = p(&[("long.sinks", "2"), ("long", "streaming")]).unwrap();
    assert_eq!(s.params_json()["long_params"]["sinks"], 2);
    let e = p(&[("long.sinks", "2"), ("long", "h2o")]).unwrap_err();
    assert!(e.to_string().contains("sinks"), "{e}");
    let e = p(&[("short_share", "1")]).unwrap_err();
    assert!(e.to_string().contains("short_share=1"), "{e}");
    let e = p(&[("bogus", "1")]).unwrap_err();
    assert!(
        e.to_string().contains("long.KEY, reservation, kv_codec"),
        "{e}"
    );
    // Both sides grow on demand from one budget: a pool up front is refused.
    let mut c = cfg(p(&[]).unwrap(), AttentionImpl::Flash, PrefillMode::Chunked);
    c.reservation = Some(kvbench_engines::policy::spec::Reservation::Fraction);
    let e = Engine::new(tiny(), c).err().expect("refused");
    assert!(e.to_string().contains("reservation=budget"), "{e}");
}

#[test]
fn quest_reads_the_pages_whose_bound_is_highest_and_the_current_one() {
    let model = tiny();
    let mut seed = 33;
    let prompt = random_tokens(40, &mut seed);
    let forced = random_tokens(4, &mut seed);
    let (page, budget) = (4usize, 0.3);
    let s = spec(
        &model,
        "quest",
        budget,
        &[("dense_layers", "0"), ("page", "4")],
    );
    let mut e = Engine::new(
        model.clone(),
        cfg(s, AttentionImpl::Flash, PrefillMode::Sequential),
    )
    .unwrap();
    e.add_request(Request {
        forced_output: forced.clone(),
        ..Request::greedy(prompt.clone(), forced.len())
    })
    .unwrap();
    // The prefill, then one decode step whose input is the first forced token.
    e.step().unwrap();
    e.step().unwrap();
    // Layer 0's queries and keys depend on the tokens alone: a plain forward of the
    // prompt and that token gives the decode row's.
    let mut seq = prompt.clone();
    seq.push(forced[0]);
    let c = &model.cfg;
    let (h, hkv, dh) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let n = seq.len();
    let mut layer0 = None;
    model
        .forward_observe(&seq, &mut |i| {
            if layer0.is_none() {
                layer0 = Some((
                    i.q.flatten_all()?.to_vec1::<f32>()?,
                    i.k.flatten_all()?.to_vec1::<f32>()?,
                ));
            }
            Ok(())
        })
        .unwrap();
    let (q, k) = layer0.unwrap();
    let pages = n.div_ceil(page);
    // ⌈0.3·41⌉ = 13 tokens: 3 pages of 4.
    let read = ((budget * n as f64).ceil() as usize / page).max(1);
    assert_eq!(read, 3);
    for g in 0..hkv {
        // U(page) = max over the group's heads of Σ_c max(q_c·M_c, q_c·m_c), in f64.
        let bound = |p: usize| {
            (g * h / hkv..(g + 1) * h / hkv)
                .map(|hq| {
                    (0..dh)
                        .map(|ch| {
                            let col = (p * page..((p + 1) * page).min(n))
                                .map(|j| k[(j * hkv + g) * dh + ch] as f64);
                            let (hi, lo) = (
                                col.clone().fold(f64::NEG_INFINITY, f64::max),
                                col.fold(f64::INFINITY, f64::min),
                            );
                            let x = q[((n - 1) * h + hq) * dh + ch] as f64;
                            (x * hi).max(x * lo)
                        })
                        .sum::<f64>()
                })
                .fold(f64::NEG_INFINITY, f64::max)
        };
        let mut order: Vec<usize> = (0..pages - 1).collect();
        order.sort_by(|&a, &b| bound(b).partial_cmp(&bound(a)).unwrap().then(a.cmp(&b)));
        let mut want: Vec<usize> = order[..read - 1].to_vec();
        want.push(pages - 1);
        want.sort_unstable();
        let want: Vec<u32> = want
            .iter()
            .flat_map(|&p| (p * page..((p + 1) * page).min(n)).map(|x| x as u32))
            .collect();
        let got = e.policy().kept_positions(0, 0, g).unwrap();
        assert_eq!(got, want, "KV head {g}");
        assert_eq!(got.len(), 2 * page + 1);
    }
}
