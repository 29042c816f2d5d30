//! Request arrival times: all at t = 0 (offline batch, as the study), or a Poisson
//! process with burstiness, vLLM's convention: gamma-distributed inter-arrival times
//! with shape `burstiness` and mean `1 / rate` (burstiness 1 = Poisson; below 1 burstier,
//! above 1 more regular). As vLLM's `get_request` does at a fixed rate, the arrival
//! times are then scaled so that the last of n requests arrives at exactly n / rate.

use crate::{Error, Result};
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    AllAtZero,
    Poisson { rate: f64, burstiness: f64 },
}

impl Arrivals {
    /// Arrival time in seconds of each of `n` requests, non-decreasing, reproducible.
    /// The first request arrives after one gap (not at 0), the last at `n / rate`.
    pub fn times(&self, n: usize, seed: u64) -> Result<Vec<f64>> {
        match *self {
            Arrivals::AllAtZero => Ok(vec![0.0; n]),
            Arrivals::Poisson { rate, burstiness } => {
                if !(rate.is_finite() && rate > 0.0 && burstiness.is_finite() && burstiness > 0.0) {
                    return Err(Error::Invalid(format!(
                        "request rate {rate} and burstiness {burstiness} must be finite and > 0"
                    )));
                }
                let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))
                    .map_err(|e| Error::Invalid(format!("gamma arrivals: {e}")))?;
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut t = 0.0;
                let times: Vec<f64> = (0..n)
                    .map(|_| {
                        t += gamma.sample(&mut rng);
                        t
                    })
                    .collect();
                // The sum of sampled gaps misses n / rate by a few percent; scaling it
                // there keeps the offered load, hence throughputs, equal across seeds.
                let last = times.last().copied().unwrap_or(0.0);
                if last > 0.0 && last.is_finite() {
                    let scale = n as f64 / rate / last;
                    Ok(times.into_iter().map(|x| x * scale).collect())
                } else {
                    Ok(times)
                }
            }
        }
    }
}

/// vLLM benchmark_serving's `--max-concurrency`, on the client side: at most `cap`
/// requests in flight (sent and not finished). A request whose scheduled arrival comes
/// while every slot is taken waits for the first slot that frees, FIFO, and is sent
/// then; the time it is sent is its arrival (TTFT and E2E are measured from it), as
/// vLLM's client does. Without a cap the gate hands every request over at once with
/// its scheduled time (the engine's scheduler waits for each arrival).
///
/// The caller drives it: [`ConcurrencyGate::release`] when a request finishes (with
/// its finish time), [`ConcurrencyGate::ready`] to take the requests to send now,
/// [`ConcurrencyGate::next_send`] to know how long nothing can be sent.
#[derive(Debug, Clone)]
pub struct ConcurrencyGate {
    scheduled: Vec<f64>,
    next: usize,
    cap: Option<usize>,
    /// Since when each free slot has been free (−∞: free from the start).
    free: Vec<f64>,
    released: usize,
}

impl ConcurrencyGate {
    /// `scheduled`: each request's scheduled arrival, non-decreasing (as
    /// [`Arrivals::times`] gives them); `cap`: most requests in flight, `None` for no cap.
    pub fn new(scheduled: Vec<f64>, cap: Option<usize>) -> Result<Self> {
        if cap == Some(0) {
            return Err(Error::Invalid(
                "max concurrency must be at least 1 request in flight".into(),
            ));
        }
        if scheduled.iter().any(|t| t.is_nan()) || scheduled.windows(2).any(|w| w[1] < w[0]) {
            return Err(Error::Invalid(
                "scheduled arrivals must be non-decreasing".into(),
            ));
        }
        let free = vec![f64::NEG_INFINITY; cap.unwrap_or(0)];
        Ok(Self {
            scheduled,
            next: 0,
            cap,
            free,
            released: 0,
        })
    }

    /// Requests sent and not yet released.
    pub fn in_flight(&self) -> usize {
        self.next - self.released
    }

    /// Requests sent so far.
    pub fn sent(&self) -> usize {
        self.next
    }

    /// Every request has been sent.
    pub fn all_sent(&self) -> bool {
        self.next == self.scheduled.len()
    }

    /// A request finished at `t_s`: its slot is free from then on.
    pub fn release(&mut self, t_s: f64) {
        debug_assert!(
            self.released < self.next,
            "released more requests than were sent"
        );
        self.released = (self.released + 1).min(self.next);
        if self.cap.is_some_and(|c| self.free.len() < c) {
            self.free.push(t_s);
        }
    }

    /// Index of the slot free the longest.
    fn earliest_free(&self) -> Option<usize> {
        (0..self.free.len()).min_by(|&a, &b| self.free[a].total_cmp(&self.free[b]))
    }

    /// When the next request can be sent: its scheduled time, or when its slot freed,
    /// whichever is later. `None` when all are sent or every slot is taken (wait for a
    /// release).
    pub fn next_send(&self) -> Option<f64> {
        let &t = self.scheduled.get(self.next)?;
        match self.cap {
            None => Some(t),
            Some(_) => self.earliest_free().map(|i| t.max(self.free[i])),
        }
    }

    /// The requests to send by `now_s`, as (index, arrival time), in order. Without a
    /// cap: every request not yet sent, at its scheduled time.
    pub fn ready(&mut self, now_s: f64) -> Vec<(usize, f64)> {
        let mut out = Vec::new();
        if self.cap.is_none() {
            out.extend((self.next..self.scheduled.len()).map(|i| (i, self.scheduled[i])));
            self.next = self.scheduled.len();
            return out;
        }
        while let Some(t) = self.next_send().filter(|&t| t <= now_s) {
            if let Some(i) = self.earliest_free() {
                self.free.swap_remove(i);
            }
            out.push((self.next, t));
            self.next += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exact event simulation: request i takes `service[i]` seconds from its send;
    /// the gate is consulted at every arrival and finish. Returns (sent, finished).
    fn simulate(scheduled: &[f64], cap: Option<usize>, service: &[f64]) -> Vec<(f64, f64)> {
        let mut g = ConcurrencyGate::new(scheduled.to_vec(), cap).unwrap();
        let mut out: Vec<Option<(f64, f64)>> = vec![None; scheduled.len()];
        let mut running: Vec<(usize, f64)> = Vec::new(); // (request, finish time)
        let mut now = 0.0f64;
        let mut peak = 0;
        loop {
            // Finishes due by now, in time order, release their slots.
            running.sort_by(|a, b| a.1.total_cmp(&b.1));
            while let Some(&(_, f)) = running.first().filter(|r| r.1 <= now) {
                running.remove(0);
                g.release(f);
            }
            for (i, t) in g.ready(now) {
                // Uncapped, requests go at once with their scheduled (future) times.
                assert!(t <= now || cap.is_none());
                out[i] = Some((t, t + service[i]));
                running.push((i, t + service[i]));
            }
            peak = peak.max(g.in_flight());
            assert_eq!(g.in_flight(), running.len());
            // The next event: a finish or a send.
            let next_finish = running.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
            let next = next_finish.min(g.next_send().unwrap_or(f64::INFINITY));
            if next.is_infinite() {
                break;
            }
            now = next;
        }
        assert!(g.all_sent());
        if let Some(c) = cap {
            assert!(peak <= c, "{peak} in flight over a cap of {c}");
        }
        out.into_iter().map(|x| x.unwrap()).collect()
    }

    #[test]
    fn a_cap_of_two_sends_later_requests_when_earlier_ones_finish() {
        // Five requests at t = 0, two in flight at most.
        let got = simulate(&[0.0; 5], Some(2), &[1.0, 2.0, 3.0, 1.0, 1.0]);
        let sent: Vec<f64> = got.iter().map(|x| x.0).collect();
        let finished: Vec<f64> = got.iter().map(|x| x.1).collect();
        // r0 and r1 at 0; r2 when r0 finishes (1), r3 when r1 finishes (2), r4 when
        // r3 finishes (3), before r2 (4).
        assert_eq!(sent, [0.0, 0.0, 1.0, 2.0, 3.0]);
        assert_eq!(finished, [1.0, 2.0, 4.0, 3.0, 4.0]);
        assert_eq!(sent[2], finished[0]);
        assert_eq!(sent[3], finished[1]);
        assert_eq!(sent[4], finished[3]);
    }

    #[test]
    fn a_free_slot_keeps_the_scheduled_arrival() {
        // r1 is scheduled after r0 finished: sent on time; r2 comes while r1 runs and
        // waits for it; r3 waits for r2.
        let got = simulate(&[0.0, 2.0, 2.5, 2.6], Some(1), &[1.0, 1.0, 1.0, 1.0]);
        assert_eq!(got, [(0.0, 1.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0)]);
        // Uncapped, or a cap never reached: the scheduled times stand.
        let times = Arrivals::Poisson {
            rate: 2.0,
            burstiness: 1.0,
        }
        .times(20, 7)
        .unwrap();
        for cap in [None, Some(20)] {
            let got = simulate(&times, cap, &[5.0; 20]);
            assert!(got.iter().zip(&times).all(|(g, t)| g.0 == *t), "{cap:?}");
        }
    }

    #[test]
    fn the_gate_rejects_a_zero_cap_and_unordered_arrivals() {
        assert!(ConcurrencyGate::new(vec![0.0], Some(0)).is_err());
        assert!(ConcurrencyGate::new(vec![1.0, 0.5], Some(1)).is_err());
        let mut g = ConcurrencyGate::new(vec![0.0, 0.0], Some(1)).unwrap();
        assert_eq!(g.ready(0.0), [(0, 0.0)]);
        // Every slot taken: nothing to send until a release.
        assert_eq!(g.next_send(), None);
        assert!(g.ready(10.0).is_empty());
        g.release(0.75);
        assert_eq!(g.next_send(), Some(0.75));
        assert_eq!(g.ready(10.0), [(1, 0.75)]);
        assert!(g.all_sent() && g.next_send().is_none());
    }
}
