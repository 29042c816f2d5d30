use super::claims::shared::*;
use super::claims::*;
use super::html::*;
use super::markdown::*;
use super::read::*;
use kvbench_plots::AccRow;

const GIB: f64 = (1u64 << 30) as f64;

/// A point of `engine` at the study's budget (full: 1) under flash attention, batch
/// 1, a 512-token prompt and 32 outputs.
fn pt(engine: &str) -> Run {
    Run {
        engine: engine.into(),
        attention: "flash".into(),
        batch: Some(1.0),
        prompt_len: "512".into(),
        output_len: Some(32.0),
        budget: Some(if engine == "full" { 1.0 } else { 0.3 }),
        outcome: "ok".into(),
        ..Default::default()
    }
}

/// report.md of a runs table made of `rows` (runs.parquet's columns as JSON).
fn report_of(rows: &[serde_json::Map<String, serde_json::Value>]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let df = crate::recorder::frame(rows).unwrap();
    render(dir.path(), &df, &runs_of(&df), &[], &|_| Ok(String::new())).unwrap()
}

fn claim(runs: &[Run], id: &str) -> (Verdict, String) {
    let c = judge(runs).into_iter().find(|c| c.id == id).unwrap();
    (c.verdict, c.evidence)
}

/// Each case's verdict on claim `id`; the evidence is one line.
fn table(id: &str, cases: Vec<(&str, Vec<Run>, Verdict)>) {
    for (name, runs, want) in cases {
        let (v, ev) = claim(&runs, id);
        assert_eq!(v, want, "{id}, {name}: {ev}");
        assert!(!ev.contains('\n'), "{id}, {name}: {ev}");
    }
}

/// `runs` with `f` applied to the points of `engine`.
fn edit(mut runs: Vec<Run>, engine: &str, f: impl Fn(&mut Run)) -> Vec<Run> {
    runs.iter_mut().filter(|r| r.engine == engine).for_each(f);
    runs
}

fn without(runs: Vec<Run>, keep: impl Fn(&Run) -> bool) -> Vec<Run> {
    runs.into_iter().filter(keep).collect()
}

/// A batch-grid point: decode tok/s, mean E2E s, the device GiB the ledger holds,
/// the GiB the strategy needs (KV held) and the host peak GiB.
fn bp(engine: &str, batch: f64, tok_s: f64, e2e: f64, needed: f64, host: f64) -> Run {
    // 72 GiB reserved by every engine, as on CUDA: 16 of weights, 4 of activations.
    let (w, a, dev) = (16.0 * GIB, 4.0 * GIB, 72.0 * GIB);
    Run {
        batch: Some(batch),
        prompt_len: r#"{"uniform":[1000,10000]}"#.into(),
        output_len: Some(512.0),
        decode_tok_s: Some(tok_s),
        decode_tok_s_per_gb: Some(tok_s / (dev / 1e9)),
        e2e_mean_s: Some(e2e),
        mem_weights_bytes: Some(w),
        mem_activations_peak_bytes: Some(a),
        mem_kv_device_bytes: Some(dev - w - a),
        mem_kv_device_used_peak_bytes: Some(needed * GIB - w - a),
        mem_host_peak_bytes: Some(host * GIB),
        ..pt(engine)
    }
}

/// The study's batch scaling: full flat at 72 GiB and ≈20 s, h2o needing 30 GiB with
/// a similar peak (≈2.3× full per GB), infinigen an order of magnitude slower,
/// falling per GB, its latency superlinear and 14× full's at batch 96, 100 GiB of
/// host memory against 30.
fn batch_study() -> Vec<Run> {
    let mut v = Vec::new();
    for (i, b) in [16.0, 48.0, 96.0].into_iter().enumerate() {
        let full = ([1000.0, 2800.0, 5000.0][i], [20.0, 21.0, 22.0][i]);
        let h2o = ([950.0, 2700.0, 4800.0][i], [22.0, 26.0, 32.0][i]);
        let ig = ([300.0, 250.0, 200.0][i], [30.0, 120.0, 300.0][i]);
        v.push(bp("full", b, full.0, full.1, 72.0, 30.0));
        v.push(bp("h2o", b, h2o.0, h2o.1, 30.0, 30.0));
        v.push(bp("infinigen", b, ig.0, ig.1, 28.0, 100.0));
    }
    v
}

/// The batch study as a table that records the reservation: each engine's ledger
/// holds what it reserved as its paradigm does (full the fraction, the others what
/// they needed), and the KV used at the busiest step is far below both.
fn held_study() -> Vec<Run> {
    batch_study()
        .into_iter()
        .map(|mut r| {
            let held = r.needed_device_bytes().unwrap();
            let (w, a) = (
                r.mem_weights_bytes.unwrap(),
                r.mem_activations_peak_bytes.unwrap(),
            );
            r.mem_kv_device_bytes = Some(held - w - a);
            r.decode_tok_s_per_gb = Some(r.decode_tok_s.unwrap() / (held / 1e9));
            r.mem_kv_device_used_peak_bytes = Some(GIB);
            r.mem_kv_reservation = Some(
                if r.engine == "full" {
                    "fraction"
                } else {
                    "budget"
                }
                .into(),
            );
            r
        })
        .collect()
}

#[test]
fn c5_and_c7_read_what_each_engine_held_where_the_reservation_is_recorded() {
    use Verdict::*;
    for claim_id in ["C5", "C7"] {
        table(
            claim_id,
            vec![
                (
                    "each engine holds as its paradigm reserves",
                    held_study(),
                    Agrees,
                ),
                (
                    "h2o held the fraction, as full does: whatever its KV used",
                    edit(held_study(), "h2o", |r| {
                        r.mem_kv_device_bytes = Some(52.0 * GIB);
                        r.decode_tok_s_per_gb = Some(r.decode_tok_s.unwrap() / (72.0 * GIB / 1e9));
                        r.mem_kv_reservation = Some("fraction".into());
                    }),
                    Disagrees,
                ),
            ],
        );
    }
    let (_, ev) = claim(&held_study(), "C7");
    assert!(ev.contains("per GB held h2o"), "{ev}");
    let (_, ev) = claim(&held_study(), "C5");
    assert!(ev.contains("h2o holds (as reserved)"), "{ev}");
}

fn at(batch: f64) -> impl Fn(&Run) -> bool {
    move |r| r.batch == Some(batch)
}

#[test]
fn c5_judges_flat_reservation_half_for_h2o_and_infinigen_host_memory() {
    use Verdict::*;
    let s = batch_study;
    table(
        "C5",
        vec![
            ("the study's picture", s(), Agrees),
            (
                "full's memory grows with batch",
                edit(s(), "full", |r| {
                    r.mem_kv_device_bytes = Some(r.batch.unwrap() * GIB);
                }),
                Disagrees,
            ),
            (
                "h2o needs all full reserves",
                edit(s(), "h2o", |r| {
                    r.mem_kv_device_used_peak_bytes = r.mem_kv_device_bytes;
                }),
                Disagrees,
            ),
            (
                "h2o needs a tenth of it: not about half",
                edit(s(), "h2o", |r| {
                    r.mem_weights_bytes = Some(2.0 * GIB);
                    r.mem_activations_peak_bytes = Some(GIB);
                    r.mem_kv_device_used_peak_bytes = Some(4.2 * GIB);
                }),
                Disagrees,
            ),
            (
                "infinigen needs three times h2o's device memory",
                edit(s(), "infinigen", |r| {
                    r.mem_kv_device_used_peak_bytes = Some(70.0 * GIB);
                }),
                Disagrees,
            ),
            (
                "infinigen's host memory like the others'",
                edit(s(), "infinigen", |r| {
                    r.mem_host_peak_bytes = Some(40.0 * GIB)
                }),
                Disagrees,
            ),
            (
                "a NaN in full's memory",
                edit(s(), "full", |r| {
                    if r.batch == Some(48.0) {
                        r.mem_weights_bytes = Some(f64::NAN);
                    }
                }),
                Disagrees,
            ),
            ("no h2o", without(s(), |r| r.engine != "h2o"), CannotTell),
            (
                "full at one batch",
                without(s(), |r| r.engine != "full" || at(16.0)(r)),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&batch_study(), "C5");
    assert!(ev.contains("h2o needs (KV held)"), "{ev}");
    assert!(
        ev.contains("full/h2o at batch 96: 2.40× (claim ≈2×"),
        "{ev}"
    );
    assert!(
        ev.contains("accepted within a factor of 1.5: 1.33–3×"),
        "{ev}"
    );
    assert!(ev.contains("not checked: the absolute sizes"), "{ev}");
    // Without host peaks that part is named, not passed.
    let (v, ev) = claim(
        &edit(batch_study(), "infinigen", |r| r.mem_host_peak_bytes = None),
        "C5",
    );
    assert_eq!(v, Agrees, "{ev}");
    assert!(ev.contains("not checked: InfiniGen's host memory"), "{ev}");
}

#[test]
fn c6_judges_growth_similar_peaks_and_an_order_of_magnitude() {
    use Verdict::*;
    let s = batch_study;
    table(
        "C6",
        vec![
            ("the study's picture", s(), Agrees),
            (
                "infinigen as fast as full",
                edit(s(), "infinigen", |r| {
                    r.decode_tok_s = Some(r.batch.unwrap() * 50.0);
                }),
                Disagrees,
            ),
            (
                "infinigen two orders of magnitude slower",
                edit(s(), "infinigen", |r| {
                    r.decode_tok_s = r.decode_tok_s.map(|t| t / 100.0)
                }),
                Disagrees,
            ),
            (
                "full falls at the largest batch",
                edit(s(), "full", |r| {
                    if r.batch == Some(96.0) {
                        r.decode_tok_s = Some(2700.0);
                    }
                }),
                Disagrees,
            ),
            (
                "h2o peaks at half of full",
                edit(s(), "h2o", |r| {
                    r.decode_tok_s = r.decode_tok_s.map(|t| t / 2.0)
                }),
                Disagrees,
            ),
            (
                "a NaN throughput of infinigen",
                edit(s(), "infinigen", |r| {
                    if r.batch == Some(48.0) {
                        r.decode_tok_s = Some(f64::NAN);
                    }
                }),
                Disagrees,
            ),
            (
                "no infinigen",
                without(s(), |r| r.engine != "infinigen"),
                CannotTell,
            ),
            (
                "full at one batch",
                without(s(), |r| r.engine != "full" || at(16.0)(r)),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&batch_study(), "C6");
    assert!(
        ev.contains("full/infinigen 16: 3.33×, 48: 11.20×, 96: 25× (claim: an order of magnitude, 10×, at every batch; accepted within a factor of √10: 3.16–31.62×): holds"),
        "{ev}"
    );
    assert!(
        ev.contains("not checked: that the growth is linear"),
        "{ev}"
    );
}

#[test]
fn c7_judges_three_times_per_gb_and_infinigen_falling() {
    use Verdict::*;
    let s = batch_study;
    table(
        "C7",
        vec![
            ("the study's picture", s(), Agrees),
            (
                "h2o needs what full reserves: as efficient as full",
                edit(s(), "h2o", |r| {
                    r.mem_kv_device_used_peak_bytes = r.mem_kv_device_bytes;
                }),
                Disagrees,
            ),
            (
                "h2o ten times full per GB",
                edit(s(), "h2o", |r| {
                    r.decode_tok_s = r.decode_tok_s.map(|t| t * 4.0)
                }),
                Disagrees,
            ),
            (
                "infinigen rising per GB",
                edit(s(), "infinigen", |r| {
                    r.decode_tok_s = Some(r.batch.unwrap() * 3.0);
                }),
                Disagrees,
            ),
            (
                "infinigen above full per GB",
                edit(s(), "infinigen", |r| {
                    r.decode_tok_s = Some(6000.0 - r.batch.unwrap());
                }),
                Disagrees,
            ),
            ("no h2o", without(s(), |r| r.engine != "h2o"), CannotTell),
        ],
    );
    // Without infinigen the h2o part is judged and the rest named.
    let (v, ev) = claim(&without(batch_study(), |r| r.engine != "infinigen"), "C7");
    assert_eq!(v, Agrees, "{ev}");
    assert!(
        ev.contains("claim ≈3× at every batch; accepted within a factor of 1.5: 2–4.50×"),
        "{ev}"
    );
    assert!(
        ev.contains("not checked: InfiniGen poor and falling"),
        "{ev}"
    );
}

#[test]
fn one_batch_size_can_refute_a_claim_about_every_batch_but_never_confirm_it() {
    use Verdict::*;
    let one = || without(batch_study(), at(16.0));
    // The study's picture at batch 16: every part that one batch can check holds, and
    // the verdict stays "cannot tell".
    for id in ["C6", "C7"] {
        let (v, ev) = claim(&one(), id);
        assert_eq!(v, CannotTell, "{id}: {ev}");
        assert!(ev.starts_with("at one batch size: "), "{id}: {ev}");
    }
    let (_, ev) = claim(&one(), "C7");
    assert!(ev.contains("not checked: the other batch sizes"), "{ev}");
    let (_, ev) = claim(&one(), "C6");
    assert!(
        ev.contains("full/infinigen 16: 3.33×") && ev.contains("not checked: full growing"),
        "{ev}"
    );
    table(
        "C6",
        vec![
            (
                "infinigen 2.8× below full at the one batch",
                edit(one(), "infinigen", |r| r.decode_tok_s = Some(1000.0 / 2.8)),
                Disagrees,
            ),
            (
                "a NaN throughput of infinigen",
                edit(one(), "infinigen", |r| r.decode_tok_s = Some(f64::NAN)),
                Disagrees,
            ),
            (
                "no infinigen",
                without(one(), |r| r.engine != "infinigen"),
                CannotTell,
            ),
        ],
    );
    table(
        "C7",
        vec![(
            "h2o ten times full per GB at the one batch",
            edit(one(), "h2o", |r| {
                r.decode_tok_s = r.decode_tok_s.map(|t| t * 4.0)
            }),
            Disagrees,
        )],
    );
    // The claims about the largest batch or about how a quantity changes with batch
    // are not judged at one batch, nor any at a batch outside the study's grid.
    for id in ["C5", "C8"] {
        let (v, ev) = claim(&one(), id);
        assert_eq!(v, CannotTell, "{id}: {ev}");
        assert!(ev.contains("needs a batch grid"), "{id}: {ev}");
    }
    let batch_1 = edit(
        edit(edit(one(), "full", |r| r.batch = Some(1.0)), "h2o", |r| {
            r.batch = Some(1.0)
        }),
        "infinigen",
        |r| {
            r.batch = Some(1.0);
            r.decode_tok_s = Some(1000.0 / 2.8);
        },
    );
    for id in ["C6", "C7"] {
        let (v, ev) = claim(&batch_1, id);
        assert_eq!(v, CannotTell, "{id}: {ev}");
        assert!(ev.contains("needs a batch grid"), "{id}: {ev}");
    }
}

#[test]
fn c8_judges_flat_full_superlinear_infinigen_and_14_times() {
    use Verdict::*;
    let s = batch_study;
    let e2e = |v: [f64; 3]| {
        move |r: &mut Run| {
            let i = [16.0, 48.0, 96.0].iter().position(|b| r.batch == Some(*b));
            r.e2e_mean_s = Some(v[i.unwrap()]);
        }
    };
    table(
        "C8",
        vec![
            ("the study's picture", s(), Agrees),
            (
                "infinigen 3× full at the largest batch",
                edit(s(), "infinigen", e2e([30.0, 60.0, 66.0])),
                Disagrees,
            ),
            (
                "infinigen 100× full",
                edit(s(), "infinigen", e2e([30.0, 300.0, 2200.0])),
                Disagrees,
            ),
            (
                "full's latency doubles",
                edit(s(), "full", e2e([12.0, 16.0, 24.0])),
                Disagrees,
            ),
            (
                "infinigen grows linearly",
                edit(s(), "infinigen", e2e([50.0, 150.0, 300.0])),
                Disagrees,
            ),
            (
                "h2o grows more than infinigen",
                edit(s(), "h2o", e2e([2.0, 26.0, 32.0])),
                Disagrees,
            ),
            (
                "infinigen at one batch",
                without(s(), |r| r.engine != "infinigen" || at(96.0)(r)),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&batch_study(), "C8");
    assert!(
        ev.contains("infinigen/full at batch 96: 13.64× (claim 14× at the largest batch; accepted within a factor of 2: 7–28×): holds"),
        "{ev}"
    );
    assert!(ev.contains("not checked: the absolute ≈20 s"), "{ev}");
}

/// An output-length point: one 10K-token prompt, decode tok/s.
fn op(engine: &str, output: f64, tok_s: f64) -> Run {
    Run {
        prompt_len: "10000".into(),
        output_len: Some(output),
        decode_tok_s: Some(tok_s),
        ..pt(engine)
    }
}

#[test]
fn c9_judges_fifteen_times_at_every_output_length() {
    use Verdict::*;
    let grid = |ig: [f64; 3]| -> Vec<Run> {
        [512.0, 2048.0, 8192.0]
            .iter()
            .enumerate()
            .flat_map(|(i, &o)| [op("full", o, 120.0), op("infinigen", o, ig[i])])
            .collect()
    };
    table(
        "C9",
        vec![
            ("the study's 15×", grid([8.0, 8.0, 8.0]), Agrees),
            ("2× only", grid([60.0, 60.0, 60.0]), Disagrees),
            ("120× at the longest", grid([8.0, 8.0, 1.0]), Disagrees),
            ("a NaN", grid([8.0, f64::NAN, 8.0]), Disagrees),
            (
                "no infinigen",
                without(grid([8.0; 3]), |r| r.engine != "infinigen"),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&grid([8.0; 3]), "C9");
    assert!(
        ev.contains(
            "(claim ≈15× at every output length; accepted within a factor of 2: 7.50–30×): holds"
        ),
        "{ev}"
    );
    assert!(ev.contains("prompt 10000"), "{ev}");
}

/// A TTFT-grid point (one output token): `ttft` None is an out-of-memory cell.
fn tp(engine: &str, attention: &str, len: f64, ttft: Option<f64>) -> Run {
    Run {
        attention: attention.into(),
        prompt_len: len.to_string(),
        output_len: Some(1.0),
        outcome: if ttft.is_some() { "ok" } else { "oom" }.into(),
        ttft_mean_s: ttft,
        ..pt(engine)
    }
}

const LENS: [f64; 5] = [1024.0, 4096.0, 8192.0, 16384.0, 131000.0];

/// The study's TTFT picture: full fastest and reaching 131000 tokens; h2o and
/// infinigen under flash twice as slow; under eager they run out of memory past
/// 8192 (and `eager_ok` more lengths).
fn ttft_study(eager_ok: usize) -> Vec<Run> {
    let mut v = Vec::new();
    for (i, &l) in LENS.iter().enumerate() {
        let t = l / 1e4;
        v.push(tp("full", "flash", l, Some(t)));
        for e in ["h2o", "infinigen"] {
            v.push(tp(e, "flash", l, Some(2.0 * t)));
            v.push(tp(e, "eager", l, (i < 3 + eager_ok).then_some(3.0 * t)));
        }
    }
    v
}

#[test]
fn c1_judges_lowest_ttft_reach_and_the_baselines_oom_boundary() {
    use Verdict::*;
    let s = || ttft_study(0);
    table(
        "C1",
        vec![
            ("the study's picture", s(), Agrees),
            (
                "h2o under flash faster than full at 4096",
                edit(s(), "h2o", |r| {
                    if r.prompt() == Some(4096.0) && r.attention == "flash" {
                        r.ttft_mean_s = Some(0.1);
                    }
                }),
                Disagrees,
            ),
            ("eager baselines run every length", ttft_study(2), Disagrees),
            (
                "infinigen eager out of memory already at 4096",
                edit(s(), "infinigen", |r| {
                    if r.attention == "eager" && r.prompt() != Some(1024.0) {
                        r.outcome = "oom".into();
                    }
                }),
                Disagrees,
            ),
            (
                "full out of memory at 131000",
                edit(s(), "full", |r| {
                    if r.prompt() == Some(131000.0) {
                        r.outcome = "oom".into();
                    }
                }),
                Disagrees,
            ),
            (
                "a NaN TTFT",
                edit(s(), "h2o", |r| {
                    if r.prompt() == Some(1024.0) {
                        r.ttft_mean_s = Some(f64::NAN);
                    }
                }),
                Disagrees,
            ),
            (
                "full and h2o never at the same length",
                without(s(), |r| {
                    if r.engine == "full" {
                        r.prompt() > Some(5000.0)
                    } else {
                        r.prompt() < Some(5000.0)
                    }
                }),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&ttft_study(0), "C1");
    assert!(
        ev.contains("h2o @0.3 eager runs out of memory between 8192 and 16384 tokens (claim: out of memory near 10K; accepted when the boundary lies within 5000–20000 tokens): holds"),
        "{ev}"
    );
    assert!(ev.contains("full runs a 131000-token prompt"), "{ev}");
    // A grid that stops at 8192: the lowest TTFT is judged and the rest named; it can
    // refute the claim about every length up to 128K but never confirm it.
    let short = || without(ttft_study(0), |r| r.prompt() <= Some(8192.0));
    let (v, ev) = claim(&short(), "C1");
    assert_eq!(v, CannotTell, "{ev}");
    assert!(ev.contains("by prompt length — 1024: full"), "{ev}");
    let h2o_faster = edit(short(), "h2o", |r| r.ttft_mean_s = Some(1e-3));
    let (v, ev) = claim(&h2o_faster, "C1");
    assert_eq!(v, Disagrees, "{ev}");
    assert!(
        ev.contains("not checked: full reaching 128K: the grid's longest prompt is 8192"),
        "{ev}"
    );
    assert!(ev.contains("the grid stops short of 20000"), "{ev}");
    // A boundary the grid cannot place: between 4096 and 131000.
    let coarse = without(ttft_study(0), |r| {
        ![8192.0, 16384.0].contains(&r.prompt().unwrap())
    });
    let (v, ev) = claim(&coarse, "C1");
    assert_eq!(v, Agrees, "{ev}");
    assert!(ev.contains("too coarse a grid to place it"), "{ev}");
}

/// A prefill point of `engine` under `attention` with its TTFT and prefill memory.
fn pm(engine: &str, attention: &str, len: f64, ttft: f64, mem_gib: f64) -> Run {
    Run {
        mem_activations_peak_bytes: Some(mem_gib * GIB),
        ..tp(engine, attention, len, Some(ttft))
    }
}

/// InfiniGen under chunked prefill (chunks of `chunk`) at 4096 and 16384 tokens.
fn chunked(chunk: &str, ttft: f64, mem: f64) -> Vec<Run> {
    [4096.0, 16384.0]
        .iter()
        .map(|&l| {
            let mut r = pm("infinigen", "chunked", l, ttft * l / 1e4, mem * l / 1e4);
            r.cell.insert("chunk_size".into(), chunk.into());
            r
        })
        .collect()
}

/// InfiniGen under flash at 4096 and 16384 tokens: TTFT and memory as fractions of
/// chunked's.
fn flash(ttft: f64, mem: f64) -> Vec<Run> {
    [4096.0, 16384.0]
        .iter()
        .map(|&l| pm("infinigen", "flash", l, ttft * l / 1e4, mem * l / 1e4))
        .collect()
}

#[test]
fn c3_judges_the_cuts_at_15k_within_ten_points() {
    use Verdict::*;
    let with = |a: Vec<Run>, b: Vec<Run>| [a, b].concat();
    table(
        "C3",
        vec![
            (
                "−85% memory, −75% TTFT",
                with(flash(0.25, 0.15), chunked("6144", 1.0, 1.0)),
                Agrees,
            ),
            (
                "memory halved only",
                with(flash(0.25, 0.5), chunked("6144", 1.0, 1.0)),
                Disagrees,
            ),
            (
                "TTFT cut by 99%: not the claim's 77%",
                with(flash(0.01, 0.15), chunked("6144", 1.0, 1.0)),
                Disagrees,
            ),
            (
                "a NaN memory",
                with(flash(0.25, f64::NAN), chunked("6144", 1.0, 1.0)),
                Disagrees,
            ),
            (
                "no length near 15K",
                without(with(flash(0.25, 0.15), chunked("6144", 1.0, 1.0)), |r| {
                    r.prompt() == Some(4096.0)
                }),
                CannotTell,
            ),
            (
                "no chunked",
                [flash(0.25, 0.15), flash(0.2, 0.1)].concat(),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&with(flash(0.25, 0.15), chunked("6144", 1.0, 1.0)), "C3");
    assert!(ev.contains("at 16384 tokens"), "{ev}");
    assert!(
        ev.contains("prefill memory flash vs chunked -85% (claim −85%; accepted ±10 pp: −95% to −75%): holds"),
        "{ev}"
    );
    assert!(ev.contains("not checked: reaching 128K"), "{ev}");
    // Two chunk sizes: each judged, neither taken for the other.
    let two = [
        flash(0.25, 0.15),
        chunked("6144", 1.0, 1.0),
        chunked("1024", 0.3, 0.3),
    ]
    .concat();
    let (v, ev) = claim(&two, "C3");
    assert_eq!(v, Disagrees, "{ev}");
    assert!(
        ev.contains("[infinigen @0.3 flash vs infinigen @0.3 chunked 1024] disagrees"),
        "{ev}"
    );
    assert!(
        ev.contains("[infinigen @0.3 flash vs infinigen @0.3 chunked 6144] agrees"),
        "{ev}"
    );
}

#[test]
fn c4_judges_no_gain_from_flash() {
    use Verdict::*;
    let h2o = |other: &str, ttft: f64, mem: f64| -> Vec<Run> {
        [1024.0, 4096.0]
            .iter()
            .flat_map(|&l| {
                [
                    pm("h2o", other, l, l / 1e3, l / 1e3),
                    pm("h2o", "flash", l, ttft * l / 1e3, mem * l / 1e3),
                ]
            })
            .collect()
    };
    table(
        "C4",
        vec![
            ("no gain", h2o("eager", 0.95, 1.0), Agrees),
            ("flash 70% faster", h2o("eager", 0.3, 1.0), Disagrees),
            ("flash halves memory", h2o("eager", 1.0, 0.5), Disagrees),
            (
                "against chunked when there is no eager",
                h2o("chunked", 1.0, 1.0),
                Agrees,
            ),
            (
                "no flash",
                without(h2o("eager", 1.0, 1.0), |r| r.attention != "flash"),
                CannotTell,
            ),
        ],
    );
    let (_, ev) = claim(&h2o("eager", 0.3, 1.0), "C4");
    assert!(
        ev.contains("at 4096 tokens; prefill memory flash/eager ×1 (claim: no gain; accepted ≥ ×0.8, flash saving at most 20%): holds; TTFT flash/eager ×0.300"),
        "{ev}"
    );
}

#[test]
fn variants_of_one_engine_are_judged_apart_never_mixed() {
    // A second h2o variant (other parameters), listed first, that peaks at half
    // of full: judged on its own and named, so C6 disagrees.
    let bad = edit(batch_study(), "h2o", |r| {
        r.params = "stats=eager".into();
        r.decode_tok_s = r.decode_tok_s.map(|t| t / 2.0);
    });
    let runs: Vec<Run> = bad
        .into_iter()
        .filter(|r| r.engine == "h2o")
        .chain(batch_study())
        .collect();
    let (v, ev) = claim(&runs, "C6");
    assert_eq!(v, Verdict::Disagrees, "{ev}");
    assert!(ev.contains("judged on each of 2 variants"), "{ev}");
    assert!(
        ev.contains("h2o stats=eager @0.3 flash, infinigen @0.3 flash] disagrees"),
        "{ev}"
    );
    assert!(
        ev.contains("h2o @0.3 flash, infinigen @0.3 flash] agrees"),
        "{ev}"
    );
    // h2o at another budget, listed first: the study's 0.3 is judged, and said.
    let other_budget = edit(batch_study(), "h2o", |r| {
        r.budget = Some(0.5);
        r.decode_tok_s = r.decode_tok_s.map(|t| t / 2.0);
    });
    let runs: Vec<Run> = other_budget
        .into_iter()
        .filter(|r| r.engine == "h2o")
        .chain(batch_study())
        .collect();
    let (v, ev) = claim(&runs, "C6");
    assert_eq!(v, Verdict::Agrees, "{ev}");
    assert!(
        ev.starts_with("h2o at budget 0.3 (the study's; it ran at 0.3, 0.5)"),
        "{ev}"
    );
    // Only 0.5: the nearest to the study's budget, said.
    let (v, ev) = claim(&edit(batch_study(), "h2o", |r| r.budget = Some(0.5)), "C6");
    assert_eq!(v, Verdict::Agrees, "{ev}");
    assert!(
        ev.starts_with("h2o at budget 0.5 (the nearest to the study's 0.3); "),
        "{ev}"
    );
    // The study's budget only: nothing to say.
    assert!(!claim(&batch_study(), "C6").1.contains("at budget"));
    // Two workloads (output lengths) are judged apart too.
    let mut other_output = edit(batch_study(), "infinigen", |r| {
        r.decode_tok_s = r.decode_tok_s.map(|t| t * 10.0);
    });
    other_output
        .iter_mut()
        .for_each(|r| r.output_len = Some(64.0));
    let two_outputs: Vec<Run> = batch_study().into_iter().chain(other_output).collect();
    let (v, ev) = claim(&two_outputs, "C6");
    assert_eq!(v, Verdict::Disagrees, "{ev}");
    assert!(ev.contains("[output_len=512"), "{ev}");
}

#[test]
fn each_claim_reads_only_the_workloads_that_vary_along_its_axis() {
    // A batch grid and a TTFT grid in one table: the batch claims read the batch
    // grid alone, and no single output length passes for an output grid.
    let mut runs = batch_study();
    runs.extend(ttft_study(0));
    for id in ["C5", "C6", "C7", "C8"] {
        let (v, ev) = claim(&runs, id);
        assert_eq!(v, Verdict::Agrees, "{id}: {ev}");
        assert!(!ev.contains("judged on each"), "{id}: {ev}");
    }
    let (v, ev) = claim(&runs, "C9");
    assert_eq!(v, Verdict::CannotTell, "{ev}");
}

#[test]
fn repeats_are_averaged_and_a_point_with_no_value_stays_null() {
    let rep = |tok: Option<f64>, outcome: &str| Run {
        decode_tok_s: tok,
        outcome: outcome.into(),
        ..pt("full")
    };
    let pts = points(&[
        rep(Some(900.0), "ok"),
        rep(None, "ok"),
        rep(Some(1100.0), "ok"),
    ]);
    assert_eq!(pts.len(), 1);
    assert_eq!(pts[0].decode_tok_s, Some(1000.0));
    assert_eq!(
        pts[0].ttft_mean_s, None,
        "no repeat has a TTFT: null, not 0"
    );
    assert!(pts[0].ok());
    // A NaN stays NaN; repeats that disagree on the outcome are not ok.
    let pts = points(&[rep(Some(f64::NAN), "ok"), rep(Some(1.0), "ok")]);
    assert!(pts[0].decode_tok_s.unwrap().is_nan());
    let pts = points(&[rep(Some(1.0), "ok"), rep(None, "oom")]);
    assert_eq!(pts[0].outcome, "mixed (1 ok, 1 oom)");
    assert!(!pts[0].ok());
    // Other parameters are another point.
    let other = Run {
        params: "x=1".into(),
        ..rep(Some(5.0), "ok")
    };
    assert_eq!(points(&[rep(Some(1.0), "ok"), other]).len(), 2);
    // The claims read the means: two repeats of full at each batch.
    let mut runs = batch_study();
    runs.extend(edit(batch_study(), "full", |r| {
        r.decode_tok_s = r.decode_tok_s.map(|t| t + 200.0);
    }));
    let runs = edit(runs, "full", |r| {
        r.decode_tok_s = r.decode_tok_s.map(|t| t - 100.0);
    });
    let (_, ev) = claim(&runs, "C6");
    assert!(
        ev.contains("decode tok/s full 16: 1000, 48: 2800, 96: 5000"),
        "{ev}"
    );
}

#[test]
fn the_cells_table_shows_goodput_only_when_the_sweep_set_slos() {
    use serde_json::json;
    let row = |goodput: Option<f64>, ttft_ms: Option<f64>| {
        json!({
            "experiment": "s", "engine": "full", "attention": "flash", "batch": 2,
            "prompt_len": 16, "output_len": 3, "budget": 1, "outcome": "ok",
            "ttft_mean_s": 0.25, "goodput_req_s": goodput, "slo_ttft_ms": ttft_ms,
            "slo_tpot_ms": null, "slo_e2e_ms": ttft_ms.map(|t| t * 4.0),
        })
        .as_object()
        .unwrap()
        .clone()
    };
    let with = report_of(&[row(Some(2.5), Some(500.0)), row(Some(0.0), Some(500.0))]);
    assert!(
        with.contains("- SLOs for goodput (requests meeting every one, per second): TTFT ≤ 500 ms, E2E ≤ 2000 ms"),
        "{with}"
    );
    let table: Vec<&str> = with.lines().filter(|l| l.starts_with("| full")).collect();
    assert_eq!(table.len(), 2, "{with}");
    assert!(table[0].ends_with("| 2.50 |"), "{}", table[0]);
    // A measured 0 is shown as 0.
    assert!(table[1].ends_with("| 0 |"), "{}", table[1]);
    assert!(with.contains("| host KV GiB | goodput req/s |"), "{with}");
    // No SLO: no goodput column, no SLO line.
    let without = report_of(&[row(None, None)]);
    assert!(!without.contains("goodput"), "{without}");
    // A cell without SLO beside cells with one: its goodput is –, not 0.
    let mixed = report_of(&[row(Some(1.0), Some(500.0)), row(None, None)]);
    assert!(
        mixed.contains("TTFT ≤ 500 ms, E2E ≤ 2000 ms, none"),
        "{mixed}"
    );
    let last = mixed.lines().rfind(|l| l.starts_with("| full")).unwrap();
    assert!(last.ends_with("| – |"), "{last}");
}

#[test]
fn rows_are_grouped_by_cell_point_or_else_by_the_identity_columns() {
    use serde_json::json;
    let row = |params: &str, repeat: u64, tok: f64| {
        json!({
            "engine": "h2o", "batch": 4, "decode_tok_s": tok, "outcome": "ok",
            "cell_id": format!("{params}-{repeat}"), "cell_index": repeat,
            "cell_key": format!("engine=h2o;params=stats={params};repeat={repeat}"),
            "cell_engine": "h2o", "cell_batch": 4, "cell_params_stats": params,
            "cell_repeat": repeat,
        })
        .as_object()
        .unwrap()
        .clone()
    };
    let rows = vec![
        row("exact", 0, 10.0),
        row("eager", 0, 30.0),
        row("exact", 1, 20.0),
        row("eager", 1, 50.0),
    ];
    let df = crate::recorder::frame(&rows).unwrap();
    let runs = runs_of(&df);
    assert_eq!(runs[0].params, "stats=exact");
    assert!(!runs[0].cell.contains_key("repeat") && !runs[0].cell.contains_key("id"));
    assert_eq!(runs[0].cell["params_stats"], "exact");
    let pts = points(&runs);
    let tok: Vec<(String, Option<f64>)> = pts
        .iter()
        .map(|p| (p.params.clone(), p.decode_tok_s))
        .collect();
    assert_eq!(
        tok,
        [
            (String::from("stats=exact"), Some(15.0)),
            (String::from("stats=eager"), Some(40.0))
        ]
    );
    // With `cell_point` the table's own grouping is used.
    let with_point: Vec<_> = rows
        .into_iter()
        .zip(["a", "b", "a", "c"])
        .map(|(mut r, p)| {
            r.insert("cell_point".into(), p.into());
            r
        })
        .collect();
    let pts = points(&runs_of(&crate::recorder::frame(&with_point).unwrap()));
    let tok: Vec<Option<f64>> = pts.iter().map(|p| p.decode_tok_s).collect();
    assert_eq!(tok, [Some(15.0), Some(30.0), Some(50.0)]);
}

fn ret(engine: &str, budget: f64, bucket: &str, correct: usize, of: usize) -> Vec<AccRow> {
    (0..of)
        .map(|i| AccRow {
            task: "retention".into(),
            engine: engine.into(),
            budget: Some(budget),
            repeat: Some(0),
            value: if i < correct { 1.0 } else { 0.0 },
            bucket: Some(bucket.into()),
            turn: Some(2.0),
            cell_key: None,
            params: String::new(),
        })
        .collect()
}

#[test]
fn retention_claim_follows_the_retention_rows() {
    let c11 = |acc: &[AccRow]| {
        let c = judge_all(&[], Some(acc));
        let c = c.into_iter().find(|c| c.id == "C11").unwrap();
        (c.verdict, c.evidence)
    };
    // The study's picture: full 95, InfiniGen 93, H2O 78 then 68.
    let mut study = Vec::new();
    for (b, h) in [("1K-2K", 78), ("2K-4K", 68)] {
        study.extend(ret("full", 1.0, b, 95, 100));
        study.extend(ret("infinigen", 0.3, b, 93, 100));
        study.extend(ret("h2o", 0.3, b, h, 100));
        // Other budgets are not the study's and do not count.
        study.extend(ret("h2o", 0.02, b, 100, 100));
    }
    let (v, ev) = c11(&study);
    assert_eq!(v, Verdict::Agrees, "{ev}");
    assert!(ev.contains("full 95%") && ev.contains("H2O 73%"), "{ev}");
    assert!(ev.contains("17 pp at 1K-2K, 27 pp at 2K-4K"), "{ev}");
    assert!(ev.contains("H2O 16–30 pp below it"), "{ev}");
    assert!(ev.contains("not checked: the absolute rates"), "{ev}");
    // H2O's gap narrowing with length contradicts the claim.
    let mut narrowing = study.clone();
    for r in narrowing
        .iter_mut()
        .filter(|r| r.engine == "h2o" && r.budget == Some(0.3))
    {
        if r.bucket.as_deref() == Some("2K-4K") {
            r.value = 1.0;
        }
    }
    assert_eq!(c11(&narrowing).0, Verdict::Disagrees);
    // H2O 60 pp below: far more than the claim's 16–30.
    let mut far = study.clone();
    for r in far.iter_mut().filter(|r| r.engine == "h2o") {
        r.value = 0.0;
    }
    let (v, ev) = c11(&far);
    assert_eq!(v, Verdict::Disagrees, "{ev}");
    assert!(ev.contains("fails: H2O 95 pp below full"), "{ev}");
    // H2O as good as full.
    let same: Vec<AccRow> = ["full", "infinigen", "h2o"]
        .iter()
        .flat_map(|e| ret(e, if *e == "full" { 1.0 } else { 0.3 }, "1K-2K", 90, 100))
        .collect();
    let (v, ev) = c11(&same);
    assert_eq!(v, Verdict::Disagrees, "{ev}");
    assert!(ev.contains("one bucket"), "{ev}");
    // The model fails with the full cache: nothing to compare.
    let weak: Vec<AccRow> = ["full", "infinigen", "h2o"]
        .iter()
        .flat_map(|e| ret(e, 0.3, "1K-2K", 20, 100))
        .collect();
    assert_eq!(c11(&weak).0, Verdict::CannotTell);
    // A strategy missing; no retention rows at all.
    assert_eq!(
        c11(&ret("full", 1.0, "1K-2K", 9, 10)).0,
        Verdict::CannotTell
    );
    let c = judge_all(&[], None);
    assert_eq!(
        c.iter().find(|c| c.id == "C11").unwrap().verdict,
        Verdict::CannotTell
    );
    // Two variants of h2o (their cell keys): each judged, not pooled.
    let keyed = |rows: Vec<AccRow>, params: &str| -> Vec<AccRow> {
        rows.into_iter()
            .map(|r| AccRow {
                cell_key: Some(format!(
                    "kind=retention;engine={};params={params};budget=0.3;bucket=1K-2K;attention=flash;repeat=0",
                    r.engine
                )),
                ..r
            })
            .collect()
    };
    let mut two = Vec::new();
    for (b, h) in [("1K-2K", 78), ("2K-4K", 68)] {
        two.extend(keyed(ret("full", 1.0, b, 95, 100), ""));
        two.extend(keyed(ret("infinigen", 0.3, b, 93, 100), ""));
        two.extend(keyed(ret("h2o", 0.3, b, h, 100), "stats=exact"));
        two.extend(keyed(ret("h2o", 0.3, b, 95, 100), "stats=eager"));
    }
    let (v, ev) = c11(&two);
    assert_eq!(v, Verdict::Disagrees, "{ev}");
    assert!(
        ev.contains("[h2o attention=flash;params=stats=eager] disagrees"),
        "{ev}"
    );
    assert!(
        ev.contains("[h2o attention=flash;params=stats=exact] agrees"),
        "{ev}"
    );
}

/// `of` items of a task for one engine and budget, `correct` of them right.
fn mc(task: &str, engine: &str, budget: f64, correct: usize, of: usize) -> Vec<AccRow> {
    (0..of)
        .map(|i| AccRow {
            task: task.into(),
            engine: engine.into(),
            budget: Some(budget),
            repeat: Some(0),
            value: if i < correct { 1.0 } else { 0.0 },
            bucket: None,
            turn: None,
            cell_key: None,
            params: String::new(),
        })
        .collect()
}

#[test]
fn c10_is_judged_from_the_accuracy_rows() {
    // full: piqa 80%, hellaswag 60%, boolq at chance (50%: left out of the average).
    let grid = |half_piqa: usize, low_piqa: usize| -> Vec<AccRow> {
        let mut rows = Vec::new();
        rows.extend(mc("piqa", "full", 1.0, 80, 100));
        rows.extend(mc("hellaswag", "full", 1.0, 60, 100));
        rows.extend(mc("boolq", "full", 1.0, 50, 100));
        for e in ["h2o", "infinigen"] {
            rows.extend(mc("piqa", e, 0.5, half_piqa, 100));
            rows.extend(mc("hellaswag", e, 0.5, 58, 100));
            rows.extend(mc("boolq", e, 0.5, 40, 100));
            rows.extend(mc("piqa", e, 0.02, low_piqa, 100));
            rows.extend(mc("hellaswag", e, 0.02, 27, 100));
            rows.extend(mc("boolq", e, 0.02, 50, 100));
        }
        rows
    };
    // InfiniGen at 0.1 with `piqa` and `hellaswag` right.
    let at_01 = |piqa: usize, hellaswag: usize| -> Vec<AccRow> {
        let mut rows = grid(78, 52);
        rows.extend(mc("piqa", "infinigen", 0.1, piqa, 100));
        rows.extend(mc("hellaswag", "infinigen", 0.1, hellaswag, 100));
        rows
    };
    let c10 = |rows: &[AccRow]| {
        judge_all(&[], Some(rows))
            .into_iter()
            .find(|c| c.id == "C10")
            .unwrap()
    };
    let c = c10(&grid(78, 52));
    assert_eq!(c.verdict, Verdict::Agrees, "{}", c.evidence);
    assert!(c.evidence.contains("h2o: -2.0 pp at 0.5"), "{}", c.evidence);
    assert!(
        c.evidence.contains("above chance: hellaswag, piqa"),
        "{}",
        c.evidence
    );
    assert!(
        c.evidence.contains("not checked: InfiniGen's −6 pp at 0.1"),
        "{}",
        c.evidence
    );
    let mut h2o_03 = grid(78, 52);
    h2o_03.extend(mc("piqa", "h2o", 0.3, 50, 100));
    h2o_03.extend(mc("hellaswag", "h2o", 0.3, 58, 100));
    for (name, rows, want) in [
        ("InfiniGen −6 pp at 0.1", at_01(74, 54), Verdict::Agrees),
        ("InfiniGen −35 pp at 0.1", at_01(40, 30), Verdict::Disagrees),
        ("a 20 pp loss at 0.5", grid(40, 52), Verdict::Disagrees),
        ("far above chance at 0.02", grid(78, 80), Verdict::Disagrees),
        (
            "h2o at 0.3 keeps one task of two within 10 pp",
            h2o_03,
            Verdict::Disagrees,
        ),
        (
            "no small budgets",
            grid(78, 52)
                .into_iter()
                .filter(|r| r.budget != Some(0.02))
                .collect(),
            Verdict::CannotTell,
        ),
        (
            "no full",
            grid(78, 52)
                .into_iter()
                .filter(|r| r.engine != "full")
                .collect(),
            Verdict::CannotTell,
        ),
    ] {
        let c = c10(&rows);
        assert_eq!(c.verdict, want, "{name}: {}", c.evidence);
    }
    let c = c10(&at_01(40, 30));
    assert!(
        c.evidence
            .contains("fails: infinigen at 0.1 -35.0 pp is not within 5 pp of -6 pp"),
        "{}",
        c.evidence
    );
    assert_eq!(
        judge_all(&[], None)
            .into_iter()
            .find(|c| c.id == "C10")
            .unwrap()
            .verdict,
        Verdict::CannotTell
    );
}

#[test]
fn html_keeps_tables_lists_and_images() {
    let md = "# T\n\n- a **b**  \n  *agrees*: x\n\n| h | i |\n|---|---|\n| 1 | 2 |\n\n<img src=\"data:image/png;base64,AA\">\n";
    let h = to_html(md, "t");
    assert!(h.contains("<h1>T</h1>"));
    assert!(h.contains("<li>a <b>b</b><br><i>agrees</i>: x"));
    assert!(h.contains("<tr><th>h</th><th>i</th></tr>"));
    assert!(h.contains("<tr><td>1</td><td>2</td></tr>"));
    assert!(h.contains("<img src=\"data:image/png;base64,AA\">"));
}

#[test]
fn a_claim_checked_in_part_without_a_verdict_is_partial() {
    let one_batch = |ig: f64| {
        without(batch_study(), |r| r.batch == Some(16.0))
            .into_iter()
            .map(|mut r| {
                if r.engine == "infinigen" {
                    r.decode_tok_s = Some(ig);
                }
                r
            })
            .collect::<Vec<_>>()
    };
    let c6 = |runs: &[Run]| judge(runs).into_iter().find(|c| c.id == "C6").unwrap();
    // full/infinigen 10× at one batch: the ratio holds, the growth is not checked.
    let held = c6(&one_batch(100.0));
    assert_eq!(held.verdict, Verdict::CannotTell, "{}", held.evidence);
    assert!(held.partial(), "{}", held.evidence);
    // 1.1×: the ratio fails, which is a verdict.
    let failed = c6(&one_batch(900.0));
    assert_eq!(failed.verdict, Verdict::Disagrees, "{}", failed.evidence);
    assert!(!failed.partial());
    // No infinigen and full at one batch: nothing was checked.
    let none = c6(&without(one_batch(100.0), |r| r.engine != "infinigen"));
    assert_eq!(none.verdict, Verdict::CannotTell, "{}", none.evidence);
    assert!(!none.partial(), "{}", none.evidence);
}

#[test]
fn against_full_sets_each_engine_beside_full_on_its_workload() {
    use serde_json::json;
    let row = |engine: &str, batch: u64, tok_s: f64, e2e: f64, h2d: f64, transfer: f64| {
        json!({
            "experiment": "p", "engine": engine, "attention": "flash", "batch": batch,
            "prompt_len": 1000, "output_len": 512,
            "budget": if engine == "full" { 1.0 } else { 0.3 }, "outcome": "ok",
            "decode_tok_s": tok_s, "e2e_mean_s": e2e, "h2d_bytes": h2d,
            "metrics_output_tokens": 1000.0,
            "metrics_breakdown_prefill_s": 1.0, "metrics_breakdown_decode_compute_s": 6.0,
            "metrics_breakdown_cache_ops_s": 2.0, "metrics_breakdown_transfer_s": transfer,
            "metrics_breakdown_sampling_s": 0.5, "metrics_breakdown_scheduling_s": 0.5 - transfer,
            "cell_engine": engine, "cell_batch": batch,
        })
        .as_object()
        .unwrap()
        .clone()
    };
    let out = report_of(&[
        row("full", 16, 1000.0, 10.0, 0.0, 0.0),
        row("infinigen", 16, 125.0, 52.0, 2.5e9, 0.5),
        // No full at batch 32: nothing to stand beside.
        row("h2o", 32, 900.0, 9.0, 0.0, 0.0),
    ]);
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("## Against full"))
        .filter(|l| l.starts_with("| 16") || l.starts_with("| 32"))
        .collect();
    assert_eq!(table.len(), 2, "{out}");
    assert!(
        table[0].contains("| full flash | 1000 | 1.00× | 10 | 1.00× | 0 | – | 0.0 | 20.0 |"),
        "{}",
        table[0]
    );
    // 125 / 1000 tok/s, 52 / 10 s, 2.5 GB over 1000 tokens and over 6 s of decode and
    // 0.5 s of transfer wait, 0.5 s and 2 s of 10 s.
    assert!(
        table[1].contains(
            "| infinigen @0.3 flash | 125 | 0.12× | 52 | 5.20× | 2.50 | 0.385 | 5.0 | 20.0 |"
        ),
        "{}",
        table[1]
    );
    // A workload with no other engine beside full, or with no full: no section.
    let alone = report_of(&[
        row("full", 16, 1000.0, 10.0, 0.0, 0.0),
        row("h2o", 32, 900.0, 9.0, 0.0, 0.0),
    ]);
    assert!(!alone.contains("## Against full"), "{alone}");
    // A full point that did not finish gives no ratio to stand on.
    let mut failed = row("full", 16, 1000.0, 10.0, 0.0, 0.0);
    failed.insert("outcome".into(), json!("oom"));
    let oom = report_of(&[failed, row("infinigen", 16, 125.0, 52.0, 2.5e9, 0.5)]);
    assert!(!oom.contains("## Against full"), "{oom}");
}

#[test]
fn the_environment_names_every_processor_when_cells_ran_on_several() {
    use serde_json::json;
    let row = |gpu: &str| {
        json!({
            "experiment": "g", "engine": "full", "attention": "flash", "batch": 1,
            "prompt_len": 16, "output_len": 3, "budget": 1, "outcome": "ok",
            "env_gpu_name": gpu,
        })
        .as_object()
        .unwrap()
        .clone()
    };
    let one = report_of(&[row("NVIDIA H100 80GB HBM3"), row("NVIDIA H100 80GB HBM3")]);
    assert!(one.contains("- GPU: NVIDIA H100 80GB HBM3\n"), "{one}");
    let two = report_of(&[row("NVIDIA H100 80GB HBM3"), row("NVIDIA H200")]);
    assert!(
        two.contains(
            "- GPU: NVIDIA H100 80GB HBM3, NVIDIA H200 (the cells ran on different processors)"
        ),
        "{two}"
    );
}
