//! `kvbench bench-decode`: the paged decode kernels timed on their own over synthetic
//! caches, beside the card's copy rate (a CUDA build on a GPU; docs/cuda.md).

use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_engines::config::{preset, PRESETS};
use kvbench_engines::device::DeviceKind;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct BenchDecodeArgs {
    /// Device: cuda or cuda:N (the kernels timed are CUDA's).
    #[arg(long, default_value = "cuda", env = "KVBENCH_DEVICE")]
    pub device: String,

    /// Architecture preset whose attention shapes are used (heads, KV heads, head dim).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub preset: String,

    /// Launch shapes as BATCHxCONTEXT (every row holds CONTEXT cached tokens),
    /// comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1x1024,1x32768,1x131072,16x1024,16x4096,16x10240,64x1024,64x4096,64x10240"
    )]
    pub cases: Vec<String>,

    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,

    /// Keys per partition at most (the engines' 512).
    #[arg(long, default_value_t = 512)]
    pub partition: usize,

    /// Seed of the caches, queries and block tables.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Also write the results as one JSON object to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `BATCHxCONTEXT`, both at least 1.
fn parse_case(s: &str) -> Result<(usize, usize)> {
    let bad =
        || format!("--cases: `{s}` is not BATCHxCONTEXT (two positive integers, e.g. 16x4096)");
    let (b, c) = s.trim().split_once(['x', 'X']).with_context(bad)?;
    let b: usize = b.trim().parse().with_context(bad)?;
    let c: usize = c.trim().parse().with_context(bad)?;
    if b == 0 || c == 0 {
        bail!(bad());
    }
    Ok((b, c))
}

pub fn run(a: BenchDecodeArgs) -> Result<()> {
    let cfg = preset(&a.preset).with_context(|| {
        format!(
            "--preset: unknown preset `{}`; expected one of {}",
            a.preset,
            PRESETS.join(", ")
        )
    })?;
    let cases = a
        .cases
        .iter()
        .map(|s| parse_case(s))
        .collect::<Result<Vec<_>>>()?;
    if a.block_size == 0 || a.partition == 0 {
        bail!("--block-size and --partition must be at least 1");
    }
    let kind: DeviceKind = a.device.parse()?;
    if kind == DeviceKind::Cpu {
        bail!("bench-decode times the CUDA decode kernels: --device must be cuda or cuda:N");
    }
    bench(&a, &cfg, &cases, kind)
}

/// Keys per partition `bench-decode` pins in turn at its cases of a few rows.
#[cfg(feature = "cuda")]
const PINNED_PARTITIONS: [usize; 4] = [64, 128, 256, 512];

#[cfg(feature = "cuda")]
fn bench(
    a: &BenchDecodeArgs,
    cfg: &kvbench_engines::config::ModelConfig,
    cases: &[(usize, usize)],
    kind: DeviceKind,
) -> Result<()> {
    use kvbench_engines::cuda::bench::{self, BenchCase, FORMS};
    use kvbench_engines::cuda::DecodeKernel;
    let dev = kind.candle().with_context(|| format!("opening {kind}"))?;
    let cases: Vec<BenchCase> = cases
        .iter()
        .map(|&(rows, ctx)| BenchCase { rows, ctx })
        .collect();
    eprintln!(
        "bench-decode: {} (H={} KVH={} D={}), block {}, partitions of at most {} keys, {} cases × {} kernel forms",
        a.preset,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        a.block_size,
        a.partition,
        cases.len(),
        FORMS.len()
    );
    let shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let progress = &mut |line: &str| eprintln!("{line}");
    // Each phase's results are written as it ends, so that one which fails (or a call
    // cut at its limit) keeps those before it; a phase that fails is reported with the
    // rest below.
    let write = |r: &bench::DecodeBench| -> Result<()> {
        if let Some(p) = &a.out {
            let json = serde_json::to_string_pretty(r)?;
            std::fs::write(p, json).with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    };
    // The reference (the vector kernel with its reduction launched, verified on GPUs)
    // first and alone: every other form is compared with it. Then the forms with the
    // folded reduction on the vector kernels, then the tensor-core kernel (folded and
    // launched), each in a phase of its own: a fault in one ends the device's context,
    // and an error that does not (a launch refused) leaves the phases after it to run.
    let (reference, rest): (Vec<_>, Vec<_>) =
        FORMS.iter().copied().partition(|&f| f == bench::REFERENCE);
    let (proven, newer): (Vec<_>, Vec<_>) = rest
        .into_iter()
        .partition(|f| f.kernel != DecodeKernel::TensorCore);
    let mut r = bench::run(
        &dev,
        shape,
        a.block_size,
        a.partition,
        &cases,
        &reference,
        false,
        a.seed,
        progress,
    )?;
    write(&r)?;
    let mut aborted = Vec::new();
    for (what, forms) in [
        ("the folded forms", proven),
        ("the tensor-core forms", newer),
    ] {
        match bench::run(
            &dev,
            shape,
            a.block_size,
            a.partition,
            &cases,
            &forms,
            false,
            a.seed,
            progress,
        ) {
            Ok(more) => r.rows.extend(more.rows),
            Err(e) => aborted.push(format!("{what}: {e}")),
        }
        write(&r)?;
    }
    // The step's small kernels at the cases' row counts.
    let mut rows: Vec<usize> = cases.iter().map(|c| c.rows).collect();
    rows.sort_unstable();
    rows.dedup();
    match bench::small_kernels(&dev, shape, cfg.vocab_size, &rows, progress) {
        Ok(small) => r.small = small,
        Err(e) => aborted.push(format!("the small kernels: {e}")),
    }
    write(&r)?;
    // InfiniGen's warm-up costs on 1 GiB, beside the forms they replaced.
    match bench::warmup_costs(&dev, 1 << 30, progress) {
        Ok(warmup) => r.warmup = warmup,
        Err(e) => aborted.push(format!("InfiniGen's warm-up costs: {e}")),
    }
    write(&r)?;
    // The default kernel at the cases of a few rows with each partition size pinned:
    // at one row the engine's sizes fill the card (64 keys at 1K), where a launch is
    // bound by its round trips rather than its bytes.
    let few: Vec<BenchCase> = cases.iter().copied().filter(|c| c.rows <= 4).collect();
    let default_form = [bench::DecodeForm {
        kernel: DecodeKernel::TensorCore,
        reduce: kvbench_engines::cuda::DecodeReduce::Folded,
    }];
    for p in PINNED_PARTITIONS {
        let fit: Vec<BenchCase> = few.iter().copied().filter(|c| c.ctx >= p).collect();
        if fit.is_empty() {
            continue;
        }
        match bench::run(
            &dev,
            shape,
            a.block_size,
            p,
            &fit,
            &default_form,
            true,
            a.seed,
            progress,
        ) {
            Ok(more) => r.partitions.extend(more.rows),
            Err(e) => aborted.push(format!("the partitions of {p} keys: {e}")),
        }
    }
    write(&r)?;
    // A decode step's products at 1, 2 and 4 rows, kvbench's kernel beside cuBLAS's
    // (last: the newest kernel, whose fault would end the device's context).
    match bench::products(&dev, cfg, &[1, 2, 4], r.copy_gb_per_s, progress) {
        Ok(products) => r.products = products,
        Err(e) => aborted.push(format!("the products: {e}")),
    }
    write(&r)?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    let failed: Vec<String> = r
        .rows
        .iter()
        .filter(|x| !x.pass)
        .map(|x| {
            format!(
                "{} ({} reduction) at {}x{}",
                x.kernel, x.reduction, x.rows, x.ctx
            )
        })
        .chain(
            r.small
                .iter()
                .filter(|x| !x.pass)
                .map(|x| format!("{} ({}) at {} rows", x.op, x.form, x.rows)),
        )
        .chain(
            r.warmup
                .iter()
                .filter(|x| !x.pass)
                .map(|x| format!("{} ({})", x.op, x.form)),
        )
        .chain(r.partitions.iter().filter(|x| !x.pass).map(|x| {
            format!(
                "{} at {}x{}, partitions of {}",
                x.kernel, x.rows, x.ctx, x.partition
            )
        }))
        .chain(
            r.products
                .iter()
                .filter(|x| !x.pass)
                .map(|x| format!("product {} ({}) at {} rows", x.matrix, x.form, x.rows)),
        )
        .collect();
    if !aborted.is_empty() {
        bail!(
            "bench-decode: {} phase(s) stopped with an error (the rows before them are kept): {}{}",
            aborted.len(),
            aborted.join("; "),
            if failed.is_empty() {
                String::new()
            } else {
                format!(
                    "; and {} row(s) failed: {}",
                    failed.len(),
                    failed.join(", ")
                )
            }
        );
    }
    if !failed.is_empty() {
        bail!(
            "bench-decode: {} row(s) disagree with the reference (the vector kernel with its reduction launched; candle's operations; the fingerprint's two forms; cuBLAS's products), left the folded reduction's counters raised, or could not be timed or pinned: {}",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench(
    _a: &BenchDecodeArgs,
    _cfg: &kvbench_engines::config::ModelConfig,
    _cases: &[(usize, usize)],
    kind: DeviceKind,
) -> Result<()> {
    bail!(
        "bench-decode on {kind}: this kvbench was built without CUDA; build one with \
         `just build-cuda` (docs/cuda.md)"
    )
}

#[cfg(test)]
mod tests {
    use super::parse_case;

    #[test]
    fn cases_parse_and_bad_ones_are_named() {
        assert_eq!(parse_case("16x4096").unwrap(), (16, 4096));
        assert_eq!(parse_case(" 1X131072 ").unwrap(), (1, 131072));
        for bad in ["16", "x4096", "16x", "0x10", "16x0", "ax4", "-1x4"] {
            let e = parse_case(bad).unwrap_err().to_string();
            assert!(e.contains(bad.trim()), "{bad}: {e}");
        }
    }
}
