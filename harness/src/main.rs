//! `kvbench`: benchmark and characterization of KV-cache management strategies. The
//! command line and everything behind it are in the library (src/lib.rs), so that tests
//! reach them without spawning this binary.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    // Output piped into a reader that closes early (`kvbench models | head -1`) ends
    // the process quietly, as other command-line tools do, instead of a panic in
    // `println!`. A sweep writes its tables before it prints anything after its cells.
    #[cfg(target_os = "linux")]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    kvbench::commands::run(kvbench::commands::Cli::parse())
}
