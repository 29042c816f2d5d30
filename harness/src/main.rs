//! `kvbench`: benchmark and characterization of KV-cache management strategies. The
//! command line and everything behind it are in the library (src/lib.rs), so that tests
//! reach them without spawning this binary.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    one_malloc_arena();
    kvbench::commands::run(kvbench::commands::Cli::parse())
}

/// glibc gives each thread that allocates an arena of its own, made of 64 MB heaps that
/// it unmaps once they empty. The engine's forward runs on a worker of the thread pool,
/// so a CPU prefill's temporary tensors (megabytes each) were carved from such heaps and
/// handed back over and over, every page faulted in and zeroed again each time; in the
/// one main arena freed memory stays for reuse up to glibc's trim threshold (a
/// 4 × 576-token prefill: two thirds fewer page faults, 7 % less time to the first token;
/// docs/correctness-and-performance.md). Set before any thread allocates.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters; called before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
