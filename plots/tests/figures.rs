//! Every figure renders from a real run's tables (`tests/fixtures/plots-fixture/`:
//! `kvbench run` of the YAML beside it on preset:tiny, 128 cells, four engines, eager
//! attention out of memory at 2048 tokens, two repeats), the PNGs decode at the
//! expected size and are not blank, and figures without their data say so.

use kvbench_plots::{
    parse_figures, render, render_tables, Context, Error, FigureId, Report, Tables,
};
use polars::prelude::*;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plots-fixture")
}

fn fixture_runs() -> DataFrame {
    let f = std::fs::File::open(fixture().join("runs.parquet")).unwrap();
    ParquetReader::new(f).finish().unwrap()
}

/// Decode a PNG; check its size; return (distinct colours, share of non-white pixels).
fn png_stats(path: &Path, size: (u32, u32)) -> (usize, f64) {
    let img = image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_rgb8();
    assert_eq!(img.dimensions(), size, "{}", path.display());
    let mut colours = HashSet::new();
    let mut ink = 0usize;
    for p in img.pixels() {
        colours.insert(p.0);
        if p.0 != [255, 255, 255] {
            ink += 1;
        }
    }
    (colours.len(), ink as f64 / (size.0 * size.1) as f64)
}

fn has_colour(path: &Path, rgb: [u8; 3]) -> bool {
    let img = image::open(path).unwrap().to_rgb8();
    img.pixels().any(|p| p.0 == rgb)
}

/// Where a test writes its figures: a temporary directory, or
/// `$KVBENCH_TEST_FIGURES/<test>` to look at them.
fn ctx(out: &Path, test: &str) -> Context {
    let dir = match std::env::var_os("KVBENCH_TEST_FIGURES") {
        Some(d) => PathBuf::from(d).join(test),
        None => out.to_path_buf(),
    };
    Context {
        model: Some("preset:tiny".into()),
        out_dir: Some(dir),
    }
}

fn by_figure(reports: &[Report], f: FigureId) -> &Report {
    reports.iter().find(|r| r.figure == f).unwrap()
}

#[test]
fn every_figure_renders_from_a_real_run() {
    let out = tempfile::tempdir().unwrap();
    let reports = render(&fixture(), &FigureId::ALL, &ctx(out.path(), "real")).unwrap();
    assert_eq!(reports.len(), 8);
    for r in &reports {
        assert!(r.png.is_file() && r.svg.is_file(), "{r}");
        let (colours, ink) = png_stats(&r.png, r.figure.size());
        let svg = std::fs::read_to_string(&r.svg).unwrap();
        assert!(svg.starts_with("<svg"), "{}", r.svg.display());
        assert!(
            svg.contains("DejaVu Sans"),
            "SVG text names the embedded font"
        );
        if r.figure <= FigureId::Fig6 {
            assert!(r.no_data.is_none(), "{r}");
            assert!(colours >= 20, "{r}: {colours} colours");
            assert!(ink > 0.04, "{r}: {:.3} of the pixels drawn", ink);
        } else {
            // No accuracy table in this run: a placeholder that says so.
            let why = r.no_data.as_deref().unwrap_or_default();
            assert!(why.contains("accuracy.parquet"), "{r}");
            assert!(ink > 0.001, "{r}: the placeholder has text");
            assert!(svg.contains("No data"));
        }
    }
    // The fixed engine colours: full blue, h2o orange, infinigen green, streaming red.
    let fig1 = by_figure(&reports, FigureId::Fig1);
    for rgb in [[31, 119, 180], [230, 115, 0], [44, 160, 44], [214, 39, 40]] {
        assert!(
            has_colour(&fig1.png, rgb),
            "fig1 lacks engine colour {rgb:?}"
        );
    }
    // The out-of-memory cells are marked and named, not left out.
    assert!(
        fig1.notes
            .iter()
            .any(|n| n.contains("Out of memory") && n.contains("full · eager at 2048")),
        "{fig1}"
    );
    assert!(fig1.notes.iter().any(|n| n.contains("repeats")), "{fig1}");
    // What a figure does not show is said.
    let fig3 = by_figure(&reports, FigureId::Fig3);
    assert!(fig3.notes.iter().any(|n| n.contains("not shown")), "{fig3}");
    // The title names the model, the device and the experiment.
    let svg = std::fs::read_to_string(&fig1.svg).unwrap();
    for s in ["preset:tiny", "CPU (", "plots-fixture", "Fig. 1"] {
        assert!(svg.contains(s), "fig1 title lacks {s}");
    }
}

#[test]
fn figures_say_what_is_missing_instead_of_failing() {
    let out = tempfile::tempdir().unwrap();
    // Headline columns dropped, as in a table from an older recorder.
    let mut runs = fixture_runs();
    for c in ["wall_prefill_s", "decode_tok_s_per_gb", "mem_kv_host_bytes"] {
        runs = runs.drop(c).unwrap();
    }
    let t = Tables::from_frames(&fixture(), Some(&runs), None, None);
    let reports = render_tables(&t, &FigureId::ALL[..6], &ctx(out.path(), "missing")).unwrap();
    let fig2 = by_figure(&reports, FigureId::Fig2);
    assert!(fig2.no_data.is_none(), "{fig2}");
    assert!(
        fig2.notes.iter().any(|n| n.contains("TTFT shown instead")),
        "{fig2}"
    );
    assert!(
        fig2.notes
            .iter()
            .any(|n| n.contains("no column wall_prefill_s")),
        "{fig2}"
    );
    let fig4 = by_figure(&reports, FigureId::Fig4);
    assert!(
        fig4.notes.iter().any(|n| n.contains("not measured")),
        "{fig4}"
    );
    let svg = std::fs::read_to_string(&by_figure(&reports, FigureId::Fig1).svg).unwrap();
    assert!(svg.contains("model ?"), "a title without a model says so");

    // TTFT null in every cell that finished (and no cell that did not): fig1 has no
    // data and says so, rather than a drawn figure of one empty panel.
    let n = runs.height();
    let mut ttft_null = runs.clone();
    ttft_null
        .with_column(Series::new("ttft_mean_s".into(), vec![None::<f64>; n]).into())
        .unwrap();
    ttft_null
        .with_column(Series::new("outcome".into(), vec!["ok"; n]).into())
        .unwrap();
    let t = Tables::from_frames(&fixture(), Some(&ttft_null), None, None);
    let reports = render_tables(&t, &[FigureId::Fig1], &ctx(out.path(), "null")).unwrap();
    assert!(
        reports[0]
            .no_data
            .as_deref()
            .unwrap_or_default()
            .contains("TTFT not measured"),
        "{}",
        reports[0]
    );

    // Only prompt-length distributions: no TTFT-vs-length figure, and it says why.
    let dist = Series::new("prompt_len".into(), vec![r#"{"uniform":[64,2048]}"#; n]);
    runs.with_column(dist.into()).unwrap();
    let t = Tables::from_frames(&fixture(), Some(&runs), None, None);
    let reports = render_tables(
        &t,
        &[FigureId::Fig1, FigureId::Fig3],
        &ctx(out.path(), "dist"),
    )
    .unwrap();
    let fig1 = &reports[0];
    assert!(
        fig1.no_data
            .as_deref()
            .unwrap_or_default()
            .contains("distribution"),
        "{fig1}"
    );
    let (_, ink) = png_stats(&fig1.png, fig1.figure.size());
    assert!(ink > 0.001);
    assert!(
        reports[1].no_data.is_none(),
        "fig3 does not need fixed lengths"
    );

    // No rows at all.
    let empty = runs.head(Some(0));
    let t = Tables::from_frames(&fixture(), Some(&empty), None, None);
    for r in render_tables(&t, &FigureId::ALL, &ctx(out.path(), "empty")).unwrap() {
        assert!(r.no_data.is_some(), "{r}");
    }
}

#[test]
fn accuracy_figures_render_from_an_accuracy_table() {
    let out = tempfile::tempdir().unwrap();
    let mut task = Vec::new();
    let mut engine = Vec::new();
    let mut budget = Vec::new();
    let mut correct = Vec::new();
    let mut bucket: Vec<Option<&str>> = Vec::new();
    let mut turn: Vec<Option<i64>> = Vec::new();
    for (t, base) in [("piqa", 0.8), ("boolq", 0.7), ("copa", 0.9)] {
        for (e, budgets) in [
            ("full", vec![1.0]),
            ("h2o", vec![0.02, 0.1, 0.3, 0.5]),
            ("infinigen", vec![0.02, 0.1, 0.3, 0.5]),
        ] {
            for b in budgets {
                for item in 0..20 {
                    task.push(t);
                    engine.push(e);
                    budget.push(b);
                    let p: f64 = base * (0.5 + b) * if e == "h2o" { 0.85 } else { 1.0 };
                    correct.push((item as f64) < 20.0 * p.min(1.0));
                    bucket.push(None);
                    turn.push(None);
                }
            }
        }
    }
    for e in ["full", "h2o", "infinigen"] {
        for (k, bk) in ["1K-2K", "2K-4K", "4K-8K"].iter().enumerate() {
            for t in [2, 4, 6] {
                for item in 0..10 {
                    task.push("retention");
                    engine.push(e);
                    budget.push(0.3);
                    correct.push(item < 9 - k - if e == "h2o" { 3 } else { 0 });
                    bucket.push(Some(bk));
                    turn.push(Some(t));
                }
            }
        }
    }
    let acc = DataFrame::new(
        task.len(),
        vec![
            Series::new("task".into(), task).into(),
            Series::new("engine".into(), engine).into(),
            Series::new("budget".into(), budget).into(),
            Series::new("correct".into(), correct).into(),
            Series::new("bucket".into(), bucket).into(),
            Series::new("turn".into(), turn).into(),
        ],
    )
    .unwrap();
    let runs = fixture_runs();
    let t = Tables::from_frames(&fixture(), Some(&runs), Some(acc), None);
    let reports = render_tables(
        &t,
        &[FigureId::Fig7, FigureId::Fig8],
        &ctx(out.path(), "accuracy"),
    )
    .unwrap();
    for r in &reports {
        assert!(r.no_data.is_none(), "{r}");
        let (colours, ink) = png_stats(&r.png, r.figure.size());
        assert!(
            colours >= 20 && ink > 0.02,
            "{r}: {colours} colours, {ink:.3} drawn"
        );
    }
    // The full-cache reference is drawn dashed in full's colour.
    assert!(has_colour(&reports[0].png, [31, 119, 180]));
}

#[test]
fn bad_paths_are_named() {
    let out = tempfile::tempdir().unwrap();
    let missing = out.path().join("no-such-experiment");
    let e = render(&missing, &FigureId::ALL, &Context::default()).unwrap_err();
    assert!(matches!(e, Error::NotADirectory(_)));
    assert!(e.to_string().contains("no-such-experiment"), "{e}");
    let e = render(out.path(), &FigureId::ALL, &Context::default()).unwrap_err();
    assert!(e.to_string().contains("runs.parquet"), "{e}");
    std::fs::write(out.path().join("runs.parquet"), b"not parquet").unwrap();
    let e = render(out.path(), &FigureId::ALL, &Context::default()).unwrap_err();
    assert!(
        e.to_string().contains("runs.parquet") && e.to_string().contains("Parquet"),
        "{e}"
    );
}

#[test]
fn figure_lists_parse() {
    assert_eq!(
        parse_figures("fig1,3, fig1").unwrap(),
        vec![FigureId::Fig1, FigureId::Fig3]
    );
    let e = parse_figures("fig1,fig9").unwrap_err();
    assert!(
        e.to_string().contains("fig9") && e.to_string().contains("fig1 … fig8"),
        "{e}"
    );
}
