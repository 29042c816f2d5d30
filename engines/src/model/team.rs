//! The CPU forward's threads as one team: the forward runs on a worker of the thread
//! pool while the pool's other workers stay awake, and a kernel split into shares (one
//! contiguous part of a product a thread, attention's rows and key splits) hands them
//! to those workers through one shared slot that they watch, not through rayon's job
//! queues.
//!
//! A batch-1 decode step is about 120 matrix-vector products of 40–200 µs each. A
//! worker watching the slot takes its share about 1 µs after it is posted; rayon's
//! queues took longer, and batch-1 steps with the same shares ran about a point of the
//! bound slower through them (docs/correctness-and-performance.md, "One part a
//! thread").

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

/// A kernel's shares as the team takes them: each share claimed by exactly one thread.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    shares: usize,
    /// The next share to claim (past `shares`: all claimed).
    next: AtomicUsize,
    /// Shares run to the end (or unwound).
    done: AtomicUsize,
    /// The first panic of a share run by a worker, passed on by the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl<'a> Job<'a> {
    fn new(f: &'a (dyn Fn(usize) + Sync), shares: usize) -> Self {
        Job {
            f,
            shares,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
        }
    }

    /// Claims and runs shares until none is left.
    fn help(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= self.shares {
                return;
            }
            self.run(i);
        }
    }

    /// Runs share `i`, keeping a panic for the caller.
    fn run(&self, i: usize) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
            let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
        self.done.fetch_add(1, Ordering::AcqRel);
    }

    /// Passes on the first panic of a share, once all have run.
    fn finish(self) {
        if let Some(p) = self.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}

/// The slot a forward's runner posts its jobs in, and the workers watch.
struct Team {
    /// The job in progress (a `Job` on the runner's stack), or null.
    job: AtomicPtr<()>,
    /// Workers between reading `job` and leaving it: the runner returns (and the job
    /// goes out of scope) only once none is.
    busy: AtomicUsize,
}

impl Team {
    /// A worker's look at the slot: helps with the job there, if any. Whether it did.
    fn help(&self) -> bool {
        // A plain load first: most looks find nothing, and they should not take the
        // slot's cache line from the runner.
        if self.job.load(Ordering::Relaxed).is_null() {
            return false;
        }
        self.busy.fetch_add(1, Ordering::SeqCst);
        let p = self.job.load(Ordering::SeqCst) as *const Job<'_>;
        let helped = !p.is_null();
        if helped {
            // SAFETY: the runner clears `job` before it waits for `busy` to reach zero,
            // and the job lives until then; having counted ourselves in `busy` before
            // reading a non-null `job`, we are waited for (both in one total order).
            unsafe { (*p).help() };
        }
        self.busy.fetch_sub(1, Ordering::SeqCst);
        helped
    }
}

thread_local! {
    /// The team of the forward this thread runs, if it runs one.
    static TEAM: Cell<*const Team> = const { Cell::new(ptr::null()) };
}

/// Runs `forward` on a worker of the current thread pool while the pool's other
/// workers look for its work instead of sleeping between kernels: its shares
/// ([`for_each_share`]) and its rayon jobs. Run on a worker, the forward's parallel
/// kernels share their work with the thread that calls them rather than putting it to
/// sleep once per kernel; kept awake, the other workers take that work without a
/// wake-up on the step's path (a system call, and in a virtual machine an interrupt
/// through the host), which a decode step would otherwise pay once for each of its
/// products (about 120 in SmolLM2's): batch-1 decode steps on 2 threads at 72–81 % of
/// the memory bound against 65–72 % (docs/correctness-and-performance.md). A worker
/// with nothing to take yields its CPU to the system now and then, so a pool larger
/// than the machine does not starve the forward.
pub fn run_awake<T: Send>(forward: impl FnOnce() -> T + Send) -> T {
    /// Lets the workers go when the forward returns or unwinds, and takes the team
    /// off the runner's thread.
    struct Release<'a>(&'a AtomicBool, *const Team);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            TEAM.with(|t| t.set(self.1));
            self.0.store(true, Ordering::Release);
        }
    }
    let done = AtomicBool::new(false);
    let team = Team {
        job: AtomicPtr::new(ptr::null_mut()),
        busy: AtomicUsize::new(0),
    };
    rayon::scope(|sc| {
        let runner = rayon::current_thread_index();
        if rayon::current_num_threads() > 1 {
            let (done, team) = (&done, &team);
            sc.spawn_broadcast(move |_, _| {
                // The runner's own copy ends at once: it has the forward to run.
                if rayon::current_thread_index() == runner {
                    return;
                }
                let mut idle = 0u32;
                while !done.load(Ordering::Acquire) {
                    if team.help() {
                        idle = 0;
                        continue;
                    }
                    // The slot is looked at between pauses; rayon's queues every 16th
                    // time, and the system every 256th (a `sched_yield` is a system
                    // call, during which a posted share waits; never yielding would
                    // starve other work on a machine with fewer cores than threads).
                    idle = idle.wrapping_add(1);
                    if !idle.is_multiple_of(16) {
                        std::hint::spin_loop();
                    } else if rayon::yield_now() != Some(rayon::Yield::Executed)
                        && idle.is_multiple_of(256)
                    {
                        std::thread::yield_now();
                    }
                }
            });
        }
        // A forward inside a forward (none does) keeps the outer one's team for after.
        let outer = TEAM.with(|t| t.replace(&team));
        let _release = Release(&done, outer);
        forward()
    })
}

/// Runs `f(0)`, …, `f(shares - 1)`, each once, in parallel: on the team of the forward
/// this thread runs ([`run_awake`]), the calling thread taking shares too, else on the
/// current rayon pool. Returns once all have run; a panic in any is passed on.
pub fn for_each_share(shares: usize, f: &(dyn Fn(usize) + Sync)) {
    let team = TEAM.with(|t| t.get());
    if shares <= 1 {
        if shares == 1 {
            f(0);
        }
        return;
    }
    let job = Job::new(f, shares);
    if team.is_null() {
        use rayon::prelude::*;
        (0..shares)
            .into_par_iter()
            .with_max_len(1)
            .for_each(|i| job.run(i));
        return job.finish();
    }
    // SAFETY: `TEAM` holds a team only while `run_awake` (on this thread, below it on
    // the stack) runs its forward, and the team outlives that.
    let team = unsafe { &*team };
    team.job
        .store(&job as *const Job<'_> as *mut (), Ordering::SeqCst);
    job.help();
    // Every share is claimed; no worker may start on this job from here on.
    team.job.store(ptr::null_mut(), Ordering::SeqCst);
    while job.done.load(Ordering::Acquire) < shares {
        std::hint::spin_loop();
    }
    while team.busy.load(Ordering::SeqCst) != 0 {
        std::hint::spin_loop();
    }
    job.finish()
}

#[cfg(test)]
mod tests {
    use super::{for_each_share, run_awake};
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Forwards from several threads at once on one pool (as the tests' engines, or a
    /// sweep's, share the global pool) each get their own result, their parallel work
    /// (rayon's and shares') is done exactly once, none waits for ever on workers kept
    /// awake by another, and a forward that panics lets its workers go and passes the
    /// panic on.
    #[test]
    fn forwards_with_the_pool_awake_share_one_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool of three");
        let sums: Vec<u64> = std::thread::scope(|s| {
            let runs: Vec<_> = (0..4u64)
                .map(|t| {
                    let pool = &pool;
                    s.spawn(move || {
                        (0..50u64)
                            .map(|i| {
                                pool.install(|| {
                                    run_awake(|| {
                                        let rayon_sum = (0..10_000u64)
                                            .into_par_iter()
                                            .map(|x| x * (t + i))
                                            .sum::<u64>();
                                        let shares = AtomicU64::new(0);
                                        for_each_share(7, &|s| {
                                            let part: u64 = (s as u64 * 1000
                                                ..(s as u64 + 1) * 1000)
                                                .map(|x| x * (t + i))
                                                .sum();
                                            shares.fetch_add(part, Ordering::Relaxed);
                                        });
                                        rayon_sum + shares.into_inner()
                                    })
                                })
                            })
                            .sum::<u64>()
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("no panic"))
                .collect()
        });
        let per = (0..10_000u64).sum::<u64>() + (0..7_000u64).sum::<u64>();
        for (t, got) in sums.into_iter().enumerate() {
            let want: u64 = (0..50u64).map(|i| per * (t as u64 + i)).sum();
            assert_eq!(got, want, "thread {t}");
        }
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| run_awake(|| -> u32 { panic!("a failed forward") }))
        }));
        assert!(panicked.is_err());
        assert_eq!(pool.install(|| run_awake(|| 7)), 7);
    }

    /// Each share runs exactly once, on the team and without one, and a share that
    /// panics (on whichever thread took it) reaches the caller after the others ran,
    /// the team still usable after.
    #[test]
    fn shares_run_once_and_pass_a_panic_on() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two");
        for awake in [false, true] {
            let run =
                |g: &(dyn Fn() + Sync)| pool.install(|| if awake { run_awake(g) } else { g() });
            for shares in [0, 1, 2, 3, 64] {
                let hits: Vec<AtomicU64> = (0..shares).map(|_| AtomicU64::new(0)).collect();
                run(&|| {
                    for _ in 0..20 {
                        for_each_share(shares, &|s| {
                            hits[s].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
                for (s, h) in hits.iter().enumerate() {
                    assert_eq!(h.load(Ordering::Relaxed), 20, "share {s} of {shares}");
                }
            }
            for bad in [0, 3] {
                let ran = AtomicU64::new(0);
                let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&|| {
                        for_each_share(4, &|s| {
                            if s == bad {
                                panic!("share {s}");
                            }
                            ran.fetch_add(1, Ordering::Relaxed);
                        })
                    })
                }));
                assert!(panicked.is_err(), "awake {awake}, share {bad}");
                assert_eq!(ran.load(Ordering::Relaxed), 3, "awake {awake}, share {bad}");
            }
            let after = AtomicU64::new(0);
            run(&|| {
                for_each_share(5, &|s| {
                    after.fetch_add(s as u64, Ordering::Relaxed);
                })
            });
            assert_eq!(after.into_inner(), 10);
        }
    }
}
