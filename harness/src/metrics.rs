//! Metrics of one cell from the engine's request outputs and step traces, with vLLM's
//! definitions (`benchmarks/benchmark_serving.py`, now `vllm/benchmarks/serve.py`):
//! TTFT = first token − arrival; TPOT per request = (E2E − TTFT) / (output tokens − 1);
//! ITL = every gap between consecutive tokens, pooled over requests; E2E = finish −
//! arrival; mean, population standard deviation (numpy's `std`) and percentiles with
//! linear interpolation (numpy's default); throughputs over the benchmark's duration,
//! from its start (the clock's 0, before the first inter-arrival gap) to the last
//! finish; goodput = requests meeting every given SLO per second of that duration;
//! peak output tokens/s = most output tokens in one 1-second bucket counted from the
//! first arrival; peak concurrency = most requests in flight (arrival → finish). A
//! metric with no sample is `None`, never 0.

use kvbench_engines::trace::{RequestOutput, StepTrace};
use serde::Serialize;

/// Mean, spread and percentiles of one metric.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
    /// Population standard deviation (numpy's `np.std`, ddof = 0), as vLLM reports.
    pub std: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// numpy's `percentile` (linear interpolation) of sorted data, `q` in [0, 100].
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

impl Dist {
    /// `None` without samples.
    pub fn of(mut xs: Vec<f64>) -> Option<Self> {
        if xs.is_empty() {
            return None;
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Some(Self {
            n: xs.len(),
            mean,
            std: var.sqrt(),
            p50: percentile(&xs, 50.0),
            p90: percentile(&xs, 90.0),
            p99: percentile(&xs, 99.0),
        })
    }
}

/// Service-level objectives for goodput, in seconds (vLLM's `--goodput ttft:… tpot:…
/// e2el:…`, there in milliseconds). A request is good when it meets every one given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub e2e_s: Option<f64>,
}

impl Slo {
    /// Whether any objective is given (else there is no goodput).
    pub fn is_set(&self) -> bool {
        self.ttft_s.is_some() || self.tpot_s.is_some() || self.e2e_s.is_some()
    }
}

/// Where the engine's wall time went, seconds summed over steps. A step that mixes
/// prefill chunks and decode tokens is split by its token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Compute of prefill tokens.
    pub prefill_s: f64,
    /// Compute of decode tokens.
    pub decode_compute_s: f64,
    /// Cache operations: K/V writes, eviction, statistics, selection, transfers.
    pub cache_ops_s: f64,
    /// Of which host↔device transfers.
    pub transfer_s: f64,
    pub scheduling_s: f64,
    pub sampling_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellMetrics {
    pub num_requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Benchmark start to last finish (`None` without requests).
    pub duration_s: Option<f64>,
    pub ttft_s: Option<Dist>,
    pub tpot_s: Option<Dist>,
    pub itl_s: Option<Dist>,
    pub e2e_s: Option<Dist>,
    /// Completed requests per second.
    pub request_throughput: Option<f64>,
    /// Output tokens per second over the duration.
    pub output_throughput: Option<f64>,
    /// Prompt and output tokens per second over the duration.
    pub total_token_throughput: Option<f64>,
    /// Most output tokens in one second (1-second buckets from the first arrival).
    pub peak_output_throughput: Option<f64>,
    /// Most requests in flight at once (arrival → finish).
    pub peak_concurrency: Option<usize>,
    /// Decode tokens per second of decode wall time (the study's decode throughput).
    pub decode_throughput: Option<f64>,
    /// Requests meeting every given SLO, per second (`None` without an SLO).
    pub goodput: Option<f64>,
    /// Fraction of requests meeting each SLO (`None` when that SLO is not set).
    pub slo_ttft_frac: Option<f64>,
    pub slo_tpot_frac: Option<f64>,
    pub slo_e2e_frac: Option<f64>,
    /// `None` without steps (nothing was timed).
    pub breakdown: Option<Breakdown>,
    pub num_preemptions: usize,
}

/// TPOT of one request; `None` with fewer than two tokens.
fn tpot_of(r: &RequestOutput) -> Option<f64> {
    let n = r.token_times_s.len();
    let ttft = r.ttft_s()?;
    (n > 1).then(|| (r.finished_s - r.arrival_s - ttft) / (n - 1) as f64)
}

/// vLLM's peak output throughput: each token counted in the 1-second bucket of its
/// time since the first arrival, the fullest bucket's count.
fn peak_output_per_s(outputs: &[RequestOutput]) -> Option<f64> {
    let first = outputs.iter().map(|r| r.arrival_s).min_by(f64::total_cmp)?;
    let mut buckets: std::collections::BTreeMap<u64, usize> = Default::default();
    for t in outputs.iter().flat_map(|r| &r.token_times_s) {
        // Python's int() of a non-negative number: the floor.
        *buckets.entry((t - first).max(0.0) as u64).or_default() += 1;
    }
    // Buckets without a token count 0, as numpy's zero-initialised array does.
    Some(buckets.values().copied().max().unwrap_or(0) as f64)
}

/// vLLM's peak concurrency: a sweep over half-open [arrival, finish) intervals, a
/// finish before an arrival at the same instant.
fn peak_in_flight(outputs: &[RequestOutput]) -> Option<usize> {
    if outputs.is_empty() {
        return None;
    }
    let mut events: Vec<(f64, i32)> = outputs
        .iter()
        .flat_map(|r| [(r.arrival_s, 1), (r.finished_s, -1)])
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        now += i64::from(d);
        peak = peak.max(now);
    }
    Some(peak as usize)
}

/// Metrics of `outputs` and `steps`. `start_s` is the benchmark's start on the
/// engine clock (vLLM's `benchmark_start_time`), before the first inter-arrival gap:
/// at a finite request rate the first request arrives after it, and the throughputs
/// count that wait, as vLLM's do.
pub fn compute(
    outputs: &[RequestOutput],
    steps: &[StepTrace],
    slo: Slo,
    start_s: f64,
) -> CellMetrics {
    let ttft: Vec<f64> = outputs.iter().filter_map(|r| r.ttft_s()).collect();
    let e2e_of = |r: &RequestOutput| r.finished_s - r.arrival_s;
    let e2e: Vec<f64> = outputs.iter().map(e2e_of).collect();
    let tpot: Vec<f64> = outputs.iter().filter_map(tpot_of).collect();
    let itl: Vec<f64> = outputs
        .iter()
        .flat_map(|r| r.token_times_s.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let end = outputs.iter().map(|r| r.finished_s).max_by(f64::total_cmp);
    let duration = end.map(|e| e - start_s);
    let per_s = |x: f64| duration.filter(|&d| d > 0.0).map(|d| x / d);
    let prompt_tokens: usize = outputs.iter().map(|r| r.prompt_len).sum();
    let output_tokens: usize = outputs.iter().map(|r| r.output.len()).sum();

    let breakdown = (!steps.is_empty()).then(|| {
        let mut b = Breakdown::default();
        for t in steps {
            let tokens = (t.num_prefill_tokens + t.num_decode_tokens).max(1) as f64;
            let decode_share = t.num_decode_tokens as f64 / tokens;
            b.prefill_s += t.compute_s * (1.0 - decode_share);
            b.decode_compute_s += t.compute_s * decode_share;
            b.cache_ops_s += t.cache_ops_s;
            b.transfer_s += t.transfer_s;
            b.scheduling_s += t.schedule_s;
            b.sampling_s += t.sample_s;
        }
        b
    });
    let mut decode_wall = 0.0;
    let mut decode_tokens = 0usize;
    for t in steps {
        let tokens = (t.num_prefill_tokens + t.num_decode_tokens).max(1) as f64;
        let decode_share = t.num_decode_tokens as f64 / tokens;
        let wall = t.schedule_s + t.compute_s + t.cache_ops_s + t.sample_s;
        decode_wall += wall * decode_share;
        decode_tokens += t.num_decode_tokens;
    }

    // Each objective per request, as vLLM judges it (`slo >= value`): a request without
    // a first token misses the TTFT objective; one with fewer than two tokens has no
    // TPOT (vLLM counts it as 0) and meets that objective.
    let meets_ttft = |r: &RequestOutput| {
        slo.ttft_s
            .is_none_or(|s| r.ttft_s().is_some_and(|t| t <= s))
    };
    let meets_tpot =
        |r: &RequestOutput| slo.tpot_s.is_none_or(|s| tpot_of(r).is_none_or(|t| t <= s));
    let meets_e2e = |r: &RequestOutput| slo.e2e_s.is_none_or(|s| e2e_of(r) <= s);
    let frac = |set: Option<f64>, meets: &dyn Fn(&RequestOutput) -> bool| {
        set.filter(|_| !outputs.is_empty())
            .map(|_| outputs.iter().filter(|r| meets(r)).count() as f64 / outputs.len() as f64)
    };
    let goodput = if slo.is_set() {
        let good = outputs
            .iter()
            .filter(|r| meets_ttft(r) && meets_tpot(r) && meets_e2e(r))
            .count();
        per_s(good as f64)
    } else {
        None
    };
    CellMetrics {
        num_requests: outputs.len(),
        prompt_tokens,
        output_tokens,
        duration_s: duration,
        ttft_s: Dist::of(ttft),
        tpot_s: Dist::of(tpot),
        itl_s: Dist::of(itl),
        e2e_s: Dist::of(e2e),
        request_throughput: per_s(outputs.len() as f64),
        output_throughput: per_s(output_tokens as f64),
        total_token_throughput: per_s((prompt_tokens + output_tokens) as f64),
        peak_output_throughput: peak_output_per_s(outputs),
        peak_concurrency: peak_in_flight(outputs),
        decode_throughput: (decode_wall > 0.0).then(|| decode_tokens as f64 / decode_wall),
        goodput,
        slo_ttft_frac: frac(slo.ttft_s, &meets_ttft),
        slo_tpot_frac: frac(slo.tpot_s, &meets_tpot),
        slo_e2e_frac: frac(slo.e2e_s, &meets_e2e),
        breakdown,
        num_preemptions: outputs.iter().map(|r| r.num_preemptions).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbench_engines::trace::{FinishReason, StepKind};

    fn req(arrival: f64, times: &[f64], finish: f64, prompt: usize) -> RequestOutput {
        RequestOutput {
            id: 0,
            prompt_len: prompt,
            output: vec![1; times.len()],
            arrival_s: arrival,
            admitted_s: arrival,
            token_times_s: times.to_vec(),
            finished_s: finish,
            finish_reason: FinishReason::Length,
            num_preemptions: 0,
            kv_device_bytes: 0,
            kv_host_bytes: 0,
            logits: vec![],
        }
    }

    fn step(prefill: usize, decode: usize, compute: f64, cache: f64) -> StepTrace {
        StepTrace {
            step: 0,
            kind: StepKind::Mixed,
            t_start_s: 0.0,
            num_seqs: 1,
            num_tokens: prefill + decode,
            num_prefill_tokens: prefill,
            num_decode_tokens: decode,
            num_preempted: 0,
            schedule_s: 0.0,
            compute_s: compute,
            cache_ops_s: cache,
            launch_s: None,
            sample_s: 0.0,
            h2d_bytes: 0,
            d2h_bytes: 0,
            transfer_s: 0.0,
            kv_device_used_bytes: 0,
            kv_host_used_bytes: 0,
            activation_bytes: 0,
            attended_tokens: None,
            context_tokens: None,
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        // numpy.percentile([1, 2, 3, 4], [50, 90, 99]) = 2.5, 3.7, 3.97
        let d = Dist::of(vec![4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((d.n, d.mean, d.p50), (4, 2.5, 2.5));
        assert!((d.p90 - 3.7).abs() < 1e-12 && (d.p99 - 3.97).abs() < 1e-12);
        assert!(Dist::of(vec![]).is_none());
    }

    #[test]
    fn vllm_definitions_on_a_hand_made_run() {
        // A: arrives 0, tokens at 1, 1.5, 2.5, done 2.5. B: arrives 1, one token at 3.
        let a = req(0.0, &[1.0, 1.5, 2.5], 2.5, 10);
        let b = req(1.0, &[3.0], 3.0, 20);
        let steps = [
            step(10, 0, 0.8, 0.2),
            step(0, 1, 0.3, 0.1),
            step(20, 1, 1.0, 0.0),
        ];
        let m = compute(&[a, b], &steps, Slo::default(), 0.0);
        assert_eq!(m.ttft_s.unwrap().mean, 1.5); // (1 + 2) / 2
                                                 // TPOT only for A: (2.5 − 1) / 2.
        assert_eq!(m.tpot_s.unwrap().n, 1);
        assert_eq!(m.tpot_s.unwrap().mean, 0.75);
        // ITL pooled: 0.5 and 1.0.
        assert_eq!(m.itl_s.unwrap().n, 2);
        assert_eq!(m.itl_s.unwrap().mean, 0.75);
        assert_eq!(m.e2e_s.unwrap().mean, 2.25);
        assert_eq!(m.duration_s, Some(3.0));
        assert!((m.request_throughput.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.output_throughput.unwrap() - 4.0 / 3.0).abs() < 1e-12);
        assert!((m.total_token_throughput.unwrap() - 34.0 / 3.0).abs() < 1e-12);
        // The mixed step (20 prefill + 1 decode tokens) is split by tokens.
        let b = m.breakdown.unwrap();
        assert!((b.prefill_s - (0.8 + 1.0 * 20.0 / 21.0)).abs() < 1e-12);
        assert!((b.decode_compute_s - (0.3 + 1.0 / 21.0)).abs() < 1e-12);
        assert!((b.cache_ops_s - 0.3).abs() < 1e-12);
        // Decode throughput: 2 decode tokens over 0.4 + 1.0/21 s of decode wall time.
        assert!((m.decode_throughput.unwrap() - 2.0 / (0.4 + 1.0 / 21.0)).abs() < 1e-9);
        assert!(m.goodput.is_none());
    }

    #[test]
    fn goodput_counts_requests_within_every_slo() {
        let a = req(0.0, &[1.0, 1.5, 2.5], 2.5, 10); // TTFT 1, TPOT 0.75
        let b = req(1.0, &[3.0], 3.0, 20); // TTFT 2, no TPOT
        let slo = Slo {
            ttft_s: Some(1.5),
            tpot_s: Some(1.0),
            e2e_s: None,
        };
        let m = compute(&[a.clone(), b.clone()], &[], slo, 0.0);
        assert!((m.goodput.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        let m = compute(
            &[a, b],
            &[],
            Slo {
                tpot_s: Some(0.5),
                ..Slo::default()
            },
            0.0,
        );
        // A fails TPOT; B has no TPOT and passes.
        assert!((m.goodput.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        // No steps: no decode throughput rather than 0.
        assert!(m.decode_throughput.is_none());
        let empty = compute(&[], &[], Slo::default(), 0.0);
        assert!(empty.ttft_s.is_none() && empty.request_throughput.is_none());
    }

    #[test]
    fn standard_deviation_is_numpys_population_std() {
        // numpy.std([1, 2, 3, 4]) = sqrt(1.25); numpy.std([5]) = 0.
        let d = Dist::of(vec![4.0, 1.0, 3.0, 2.0]).unwrap();
        assert!((d.std - 1.25f64.sqrt()).abs() < 1e-15, "{}", d.std);
        assert_eq!(Dist::of(vec![5.0]).unwrap().std, 0.0);
        // Every distribution of a cell carries it: ITL gaps 0.5 and 1.0, std 0.25.
        let m = compute(
            &[req(0.0, &[1.0, 1.5, 2.5], 2.5, 1)],
            &[],
            Slo::default(),
            0.0,
        );
        assert!((m.itl_s.unwrap().std - 0.25).abs() < 1e-12);
    }

    #[test]
    fn throughput_runs_from_the_benchmark_start_not_the_first_arrival() {
        // A finite rate: the first request arrives 1 s after the start, the last
        // finishes at 5 s. vLLM's duration is 5 s (start → last finish), not 4.
        let a = req(1.0, &[2.0, 3.0], 3.0, 4);
        let b = req(2.0, &[4.0, 5.0], 5.0, 4);
        let m = compute(&[a.clone(), b.clone()], &[], Slo::default(), 0.0);
        assert_eq!(m.duration_s, Some(5.0));
        assert!((m.request_throughput.unwrap() - 2.0 / 5.0).abs() < 1e-12);
        assert!((m.output_throughput.unwrap() - 4.0 / 5.0).abs() < 1e-12);
        assert!((m.total_token_throughput.unwrap() - 12.0 / 5.0).abs() < 1e-12);
        // All arriving at the start (rate inf): first arrival and start agree.
        let c = req(0.0, &[1.0], 1.0, 4);
        let m = compute(&[c.clone(), c], &[], Slo::default(), 0.0);
        assert_eq!(m.duration_s, Some(1.0));
    }

    #[test]
    fn nothing_measured_is_null_never_zero() {
        let m = compute(&[], &[], Slo::default(), 0.0);
        assert_eq!(m.duration_s, None, "no request: no duration");
        assert_eq!(m.breakdown, None, "no step: no breakdown");
        assert_eq!(m.peak_output_throughput, None);
        assert_eq!(m.peak_concurrency, None);
        let slo = Slo {
            ttft_s: Some(1.0),
            ..Slo::default()
        };
        let m = compute(&[], &[], slo, 0.0);
        assert_eq!((m.goodput, m.slo_ttft_frac), (None, None));
        // Steps but no request still time the engine.
        let m = compute(&[], &[step(4, 0, 0.5, 0.0)], Slo::default(), 0.0);
        assert_eq!(m.breakdown.map(|b| b.prefill_s), Some(0.5));
        assert_eq!(m.duration_s, None);
    }

    #[test]
    fn an_e2e_objective_and_the_fraction_meeting_each_objective() {
        // A: TTFT 1, TPOT 0.75, E2E 2.5. B: TTFT 2, one token, E2E 2. C: TTFT 0.5,
        // TPOT 0.25, E2E 1.5 (arrives 2, done 3.5). Duration: 0 → 3.5.
        let a = req(0.0, &[1.0, 1.5, 2.5], 2.5, 10);
        let b = req(1.0, &[3.0], 3.0, 20);
        let c = req(2.0, &[2.5, 3.0, 3.5], 3.5, 5);
        let outs = [a, b, c];
        let only_e2e = Slo {
            e2e_s: Some(2.0),
            ..Slo::default()
        };
        let m = compute(&outs, &[], only_e2e, 0.0);
        // B (E2E 2, at the objective) and C meet it; A does not.
        assert!((m.goodput.unwrap() - 2.0 / 3.5).abs() < 1e-12);
        assert!((m.slo_e2e_frac.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!((m.slo_ttft_frac, m.slo_tpot_frac), (None, None));
        let all = Slo {
            ttft_s: Some(1.0),
            tpot_s: Some(0.5),
            e2e_s: Some(2.0),
        };
        let m = compute(&outs, &[], all, 0.0);
        // TTFT: A and C; TPOT: B (one token) and C; E2E: B and C. Every one: C.
        assert!((m.slo_ttft_frac.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.slo_tpot_frac.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.slo_e2e_frac.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.goodput.unwrap() - 1.0 / 3.5).abs() < 1e-12);
        // No objective: no goodput and no fractions.
        let m = compute(&outs, &[], Slo::default(), 0.0);
        assert_eq!(
            (m.goodput, m.slo_ttft_frac, m.slo_tpot_frac, m.slo_e2e_frac),
            (None, None, None, None)
        );
    }

    #[test]
    fn peak_output_rate_and_peak_concurrency_as_vllm_counts_them() {
        // Buckets of 1 s from the first arrival (0.5): tokens at 0.9 and 1.2 fall in
        // bucket 0, 1.6, 1.7 and 2.4 in bucket 1, 3.0 in bucket 2. Peak: 3 tokens/s.
        let a = req(0.5, &[0.9, 1.6, 2.4], 2.4, 1);
        let b = req(1.0, &[1.2, 1.7], 1.7, 1);
        let c = req(1.7, &[3.0], 3.0, 1);
        let m = compute(&[a, b, c], &[], Slo::default(), 0.0);
        assert_eq!(m.peak_output_throughput, Some(3.0));
        // In flight: a [0.5, 2.4), b [1, 1.7), c [1.7, 3): b leaves as c arrives, so
        // never three at once.
        assert_eq!(m.peak_concurrency, Some(2));
        let d = req(0.0, &[1.0], 1.0, 1);
        let e = req(0.0, &[1.0], 1.0, 1);
        let m = compute(&[d, e], &[], Slo::default(), 0.0);
        assert_eq!(m.peak_concurrency, Some(2));
        assert_eq!(m.peak_output_throughput, Some(2.0));
    }
}
