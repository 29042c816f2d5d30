//! What the measuring examples share: their positional arguments and medians.

use anyhow::{Context, Result};

/// The program's positional arguments as positive integers, each with a default.
pub struct Args(std::iter::Skip<std::env::Args>);

impl Args {
    pub fn new() -> Self {
        Self(std::env::args().skip(1))
    }

    /// The next argument (`default` when there is none); `what` names it in the error.
    pub fn next(&mut self, what: &str, default: usize) -> Result<usize> {
        self.0.next().map_or(Ok(default), |s| {
            s.parse()
                .with_context(|| format!("{what} `{s}`: expected a positive integer"))
        })
    }
}

/// The read probe's best time of three over `buf` (seconds), its sum checked.
#[allow(dead_code)] // each example compiles this module; not all of them run the probe
pub fn probe_best(buf: &[f32], threads: usize) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let (secs, total) = kvbench_engines::model::pages::read_pass(buf, threads);
        anyhow::ensure!(total > 0.0, "the probe's sum came out {total}");
        best = best.min(secs);
    }
    Ok(best)
}

/// The best time of `n` runs of `f` (seconds) and the last run's result.
#[allow(dead_code)] // each example compiles this module; not all of them time passes
pub fn best_of<R>(n: usize, mut f: impl FnMut() -> R) -> (f64, R) {
    let t = std::time::Instant::now();
    let mut out = f();
    let mut best = t.elapsed().as_secs_f64();
    for _ in 1..n {
        let t = std::time::Instant::now();
        out = f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best, out)
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Every product of a batch-1 decode step, the output head included, through the
/// engine's own `Linear` path: `h` the normed input, `a` the attention output, `m`
/// SwiGLU's product (their values do not matter, only their shapes).
#[allow(dead_code)] // each example compiles this module; not all of them run products
pub fn products(
    model: &kvbench_engines::model::Llama,
    h: &candle_core::Tensor,
    a: &candle_core::Tensor,
    m: &candle_core::Tensor,
) -> Result<()> {
    use kvbench_engines::model::Linear;
    for l in model.layers() {
        Linear::forward_many([&l.wq, &l.wk, &l.wv], h)?;
        l.wo.forward(a)?;
        Linear::forward_many([&l.gate, &l.up], h)?;
        l.down.forward(m)?;
    }
    model.lm_head().forward(h)?;
    Ok(())
}
