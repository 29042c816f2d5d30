//! One-pass scoring: the logits of prompt positions kept by the engine equal a dense
//! forward of the whole sequence, and teacher-forced decoding of the same tokens gives
//! the same rows; with a small pool (preemption by recompute) rows are not repeated.

mod common;
use common::{lcg, max_abs_diff, tiny};
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::scheduler::SchedulerConfig;

fn prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n).map(|_| (lcg(&mut s) % 200) as u32 + 1).collect()
}

#[test]
fn prompt_logits_match_dense_and_teacher_forced_decode() {
    let model = tiny();
    let seq = prompt(40, 3);
    let (ctx, cont) = seq.split_at(29);
    let dense = model.forward_dense(&seq).unwrap().to_vec2::<f32>().unwrap();
    // Small chunks: the kept rows span several prefill steps.
    let cfg = EngineConfig {
        num_blocks: Some(64),
        max_model_len: Some(64),
        check_invariants: true,
        scheduler: SchedulerConfig {
            max_batched_tokens: 16,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut e = Engine::new(model.clone(), cfg).unwrap();
    let one = e
        .add_request_with_prompt_logits(Request::greedy(seq.clone(), 1), ctx.len() - 1)
        .unwrap();
    let two = e
        .add_request(Request {
            forced_output: cont.to_vec(),
            record_logits: true,
            ..Request::greedy(ctx.to_vec(), cont.len())
        })
        .unwrap();
    e.run().unwrap();
    let out = e.take_finished();
    assert!(e.finished().is_empty());
    let get = |id| out.iter().find(|o| o.id == id).unwrap();
    let (a, b) = (get(one), get(two));
    // cont.len() prompt rows, then the one generated position.
    assert_eq!(a.logits.len(), cont.len() + 1);
    assert_eq!(b.logits.len(), cont.len());
    assert_eq!(b.output, cont);
    for i in 0..=cont.len() {
        let want = &dense[ctx.len() - 1 + i];
        let d = max_abs_diff(&a.logits[i], want);
        assert!(d < 1e-4, "one-pass row {i}: Δ {d}");
        if i < cont.len() {
            let d = max_abs_diff(&b.logits[i], want);
            assert!(d < 1e-4, "decode row {i}: Δ {d}");
        }
    }
    assert!(e
        .add_request_with_prompt_logits(Request::greedy(seq.clone(), 1), seq.len())
        .is_err());
}

#[test]
fn kept_rows_are_not_repeated_after_a_preemption() {
    let model = tiny();
    // A pool too small for all of them at once: some are preempted and recomputed.
    let cfg = EngineConfig {
        num_blocks: Some(9),
        max_model_len: Some(48),
        block_size: 8,
        scheduler: SchedulerConfig {
            max_batched_tokens: 24,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut e = Engine::new(model.clone(), cfg).unwrap();
    let seqs: Vec<Vec<u32>> = (0..4).map(|k| prompt(30, 10 + k)).collect();
    for s in &seqs {
        e.add_request_with_prompt_logits(Request::greedy(s.clone(), 12), 20)
            .unwrap();
    }
    e.run().unwrap();
    let out = e.take_finished();
    assert!(
        out.iter().any(|o| o.num_preemptions > 0),
        "no preemption happened"
    );
    for o in &out {
        let s = &seqs[o.id as usize];
        assert_eq!(o.logits.len(), (s.len() - 1 - 20) + 12);
        let full: Vec<u32> = [s.as_slice(), &o.output[..11]].concat();
        let dense = model
            .forward_dense(&full)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (i, row) in o.logits.iter().enumerate() {
            let d = max_abs_diff(row, &dense[20 + i]);
            assert!(d < 1e-4, "request {} row {i}: Δ {d}", o.id);
        }
    }
}
