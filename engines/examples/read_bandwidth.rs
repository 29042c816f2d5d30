//! The machine's memory read bandwidth with a given number of threads: the bound a
//! batch-1 f32 decode step works against (it reads every weight once). Sums a 1 GiB
//! f32 buffer, advised huge pages as the model's weights are, split evenly over the
//! threads; prints the best of seven passes in GB/s (10^9 bytes per second).
//!
//!   cargo run --release -p kvbench-engines --example read_bandwidth -- [threads] [MiB]

use std::time::Instant;

/// Sum with four independent accumulators of eight lanes (AVX2 where the CPU has it).
fn sum(a: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { sum_avx2(a) };
    }
    let mut acc = [0f32; 32];
    let chunks = a.chunks_exact(32);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (x, y) in acc.iter_mut().zip(c) {
            *x += y;
        }
    }
    acc.iter().sum::<f32>() + rest
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(a: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    let p = a.as_ptr();
    let mut i = 0;
    while i + 32 <= a.len() {
        for (j, x) in acc.iter_mut().enumerate() {
            *x = _mm256_add_ps(*x, _mm256_loadu_ps(p.add(i + 8 * j)));
        }
        i += 32;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum::<f32>() + a[i..].iter().sum::<f32>()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let parse = |v: Option<String>, what: &str, default: usize| -> usize {
        match v {
            None => default,
            Some(s) => s.parse().unwrap_or_else(|_| {
                eprintln!("read_bandwidth: {what} `{s}`: expected a positive integer");
                std::process::exit(2)
            }),
        }
    };
    let threads = parse(args.next(), "threads", 1).max(1);
    let mib = parse(args.next(), "MiB", 1024).max(1);
    let n = mib * (1 << 20) / 4;
    let a = kvbench_engines::model::pages::huge_vec(n, 1.0);
    let chunk = n.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..7 {
        let t = Instant::now();
        let total: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = a.chunks(chunk).map(|c| s.spawn(move || sum(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        let dt = t.elapsed().as_secs_f64();
        // Keep the sums: a pass the optimizer could skip would measure nothing.
        if total <= 0.0 {
            eprintln!("read_bandwidth: the sum came out {total}");
            std::process::exit(1);
        }
        best = best.min(dt);
    }
    println!("{:.1}", n as f64 * 4.0 / best / 1e9);
    eprintln!("read bandwidth: {mib} MiB, {threads} thread(s), best of 7");
}
