//! The machine's memory read bandwidth with a given number of threads: the bound a
//! batch-1 f32 decode step works against (it reads every weight once). Sums a 1 GiB
//! f32 buffer, advised huge pages as the model's weights are, split evenly over the
//! threads; prints the best of seven passes in GB/s (10^9 bytes per second).
//!
//!   cargo run --release -p kvbench-engines --example read_bandwidth -- [threads] [MiB]

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
    let mut best = f64::INFINITY;
    for _ in 0..7 {
        let (dt, total) = kvbench_engines::model::pages::read_pass(&a, threads);
        // Keep the sums: a pass the optimizer could skip would measure nothing.
        if total.is_nan() || total <= 0.0 {
            eprintln!("read_bandwidth: the sum came out {total}");
            std::process::exit(1);
        }
        best = best.min(dt);
    }
    println!("{:.1}", n as f64 * 4.0 / best / 1e9);
    eprintln!("read bandwidth: {mib} MiB, {threads} thread(s), best of 7");
}
