//! Metrics of one cell from the engine's request outputs and step traces, with vLLM's
//! definitions (`benchmarks/benchmark_serving.py`): TTFT = first token − arrival;
//! TPOT per request = (E2E − TTFT) / (output tokens − 1); ITL = every gap between
//! consecutive tokens, pooled over requests; E2E = finish − arrival; percentiles with
//! linear interpolation (numpy's default); throughputs over the benchmark's duration
//! (first arrival to last finish). A metric with no sample is `None`, never 0.

use kvbench_engines::trace::{RequestOutput, StepTrace};
use serde::Serialize;

/// Mean and percentiles of one metric.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
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
        Some(Self {
            n: xs.len(),
            mean: xs.iter().sum::<f64>() / xs.len() as f64,
            p50: percentile(&xs, 50.0),
            p90: percentile(&xs, 90.0),
            p99: percentile(&xs, 99.0),
        })
    }
}

/// Service-level objectives for goodput (vLLM's `--goodput ttft:… tpot:…`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
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
    /// First arrival to last finish.
    pub duration_s: f64,
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
    /// Decode tokens per second of decode wall time (the study's decode throughput).
    pub decode_throughput: Option<f64>,
    /// Requests meeting every given SLO, per second (`None` without an SLO).
    pub goodput: Option<f64>,
    pub breakdown: Breakdown,
    pub num_preemptions: usize,
}

pub fn compute(outputs: &[RequestOutput], steps: &[StepTrace], slo: Slo) -> CellMetrics {
    let ttft: Vec<f64> = outputs.iter().filter_map(|r| r.ttft_s()).collect();
    let e2e: Vec<f64> = outputs.iter().map(|r| r.finished_s - r.arrival_s).collect();
    let tpot_of = |r: &RequestOutput| -> Option<f64> {
        let n = r.token_times_s.len();
        let ttft = r.ttft_s()?;
        (n > 1).then(|| (r.finished_s - r.arrival_s - ttft) / (n - 1) as f64)
    };
    let tpot: Vec<f64> = outputs.iter().filter_map(tpot_of).collect();
    let itl: Vec<f64> = outputs
        .iter()
        .flat_map(|r| r.token_times_s.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let start = outputs
        .iter()
        .map(|r| r.arrival_s)
        .fold(f64::INFINITY, f64::min);
    let end = outputs
        .iter()
        .map(|r| r.finished_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration = if outputs.is_empty() { 0.0 } else { end - start };
    let per_s = |x: f64| (duration > 0.0).then(|| x / duration);
    let prompt_tokens: usize = outputs.iter().map(|r| r.prompt_len).sum();
    let output_tokens: usize = outputs.iter().map(|r| r.output.len()).sum();

    let mut b = Breakdown::default();
    let mut decode_wall = 0.0;
    let mut decode_tokens = 0usize;
    for t in steps {
        let tokens = (t.num_prefill_tokens + t.num_decode_tokens).max(1) as f64;
        let decode_share = t.num_decode_tokens as f64 / tokens;
        b.prefill_s += t.compute_s * (1.0 - decode_share);
        b.decode_compute_s += t.compute_s * decode_share;
        b.cache_ops_s += t.cache_ops_s;
        b.transfer_s += t.transfer_s;
        b.scheduling_s += t.schedule_s;
        b.sampling_s += t.sample_s;
        let wall = t.schedule_s + t.compute_s + t.cache_ops_s + t.sample_s;
        decode_wall += wall * decode_share;
        decode_tokens += t.num_decode_tokens;
    }
    let goodput = if slo.ttft_s.is_none() && slo.tpot_s.is_none() {
        None
    } else {
        let good = outputs
            .iter()
            .filter(|r| {
                let ttft_ok = slo
                    .ttft_s
                    .is_none_or(|s| r.ttft_s().is_some_and(|t| t <= s));
                // One-token requests have no TPOT and pass that objective, as in vLLM.
                let tpot_ok = slo.tpot_s.is_none_or(|s| tpot_of(r).is_none_or(|t| t <= s));
                ttft_ok && tpot_ok
            })
            .count();
        per_s(good as f64)
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
        decode_throughput: (decode_wall > 0.0).then(|| decode_tokens as f64 / decode_wall),
        goodput,
        breakdown: b,
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
        let m = compute(&[a, b], &steps, Slo::default());
        assert_eq!(m.ttft_s.unwrap().mean, 1.5); // (1 + 2) / 2
                                                 // TPOT only for A: (2.5 − 1) / 2.
        assert_eq!(m.tpot_s.unwrap().n, 1);
        assert_eq!(m.tpot_s.unwrap().mean, 0.75);
        // ITL pooled: 0.5 and 1.0.
        assert_eq!(m.itl_s.unwrap().n, 2);
        assert_eq!(m.itl_s.unwrap().mean, 0.75);
        assert_eq!(m.e2e_s.unwrap().mean, 2.25);
        assert_eq!(m.duration_s, 3.0);
        assert!((m.request_throughput.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.output_throughput.unwrap() - 4.0 / 3.0).abs() < 1e-12);
        assert!((m.total_token_throughput.unwrap() - 34.0 / 3.0).abs() < 1e-12);
        // The mixed step (20 prefill + 1 decode tokens) is split by tokens.
        let b = m.breakdown;
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
        };
        let m = compute(&[a.clone(), b.clone()], &[], slo);
        assert!((m.goodput.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        let m = compute(
            &[a, b],
            &[],
            Slo {
                ttft_s: None,
                tpot_s: Some(0.5),
            },
        );
        // A fails TPOT; B has no TPOT and passes.
        assert!((m.goodput.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        // No steps: no decode throughput rather than 0.
        assert!(m.decode_throughput.is_none());
        let empty = compute(&[], &[], Slo::default());
        assert!(empty.ttft_s.is_none() && empty.request_throughput.is_none());
    }
}
