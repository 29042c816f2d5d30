//! The real SmolLM2-135M-Instruct GGUF: our model through the paged cache against
//! candle-transformers' own quantized llama, and the GGUF tokenizer fix.

mod common;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::{engine_greedy, max_abs_diff, smollm2_path};
use kvbench_engines::engine::argmax_rows;
use kvbench_engines::model::load::{load_gguf, GgufFile};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::policy::full::{FullOptions, FullPolicy};
use kvbench_engines::policy::{KvPolicy, StepBatch};
use kvbench_engines::tokenizer::TextTokenizer;

/// Quantized matmuls quantize their *inputs* to 8 bits, which makes this Q4_1 model
/// chaotic: adding N(0, 3e-7) noise to the attention output moves the logits by up to
/// 1.06 (mean 0.40), while the f32 model moves by 1e-4. Our paged attention (online
/// softmax) and candle's (matmul + softmax) agree to ~1e-6 per layer, so with quantized
/// weights the prompt logits agree within these bounds (measured: max 0.89, mean 0.20)
/// and greedy decoding agrees on the answer but not on a long continuation. The same
/// model with plain causal attention equals candle's bit for bit, and
/// `smollm2_f32.rs` checks 32 greedy tokens and logits to 1e-3 on f32 weights.
const MAX_LOGIT_TOL: f32 = 1.5;
const MEAN_LOGIT_TOL: f32 = 0.5;

fn reference() -> ModelWeights {
    let p = smollm2_path();
    let mut f = std::fs::File::open(&p).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
}

#[test]
fn quantized_logits_and_answer_match_candle_quantized_llama() {
    let file = GgufFile::open(&smollm2_path()).unwrap();
    let tok = TextTokenizer::from_gguf(&file.content).unwrap();
    let model = load_gguf(&file, WeightDtype::Quantized, &Device::Cpu).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();

    // Prompt logits through the paged policy.
    let mut policy = FullPolicy::new(&model.cfg, FullOptions::default(), 64);
    assert!(policy.reserve(0, prompt.len()).unwrap());
    let mut batch = StepBatch::default();
    batch.push(0, 0, prompt.len());
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let ours = model
        .forward(
            &prompt,
            &pos,
            &batch,
            &[prompt.len() as u32 - 1],
            &mut policy,
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let mut refm = reference();
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let theirs = refm
        .forward(&input, 0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let dense = model.forward_dense(&prompt).unwrap();
    let dense = dense
        .get(prompt.len() - 1)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(
        max_abs_diff(&dense, &theirs),
        0.0,
        "same ops, same order: bit-exact"
    );
    let d = max_abs_diff(&ours, &theirs);
    let mean = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / ours.len() as f32;
    println!("quantized: max |Δlogit| = {d}, mean {mean}");
    assert!(d < MAX_LOGIT_TOL, "max |Δlogit| = {d}");
    assert!(mean < MEAN_LOGIT_TOL, "mean |Δlogit| = {mean}");

    // The first greedy tokens (the answer) agree, theirs with their own KV cache,
    // ours through the engine.
    let mut want = Vec::new();
    let mut next = argmax_rows(
        &Tensor::new(theirs.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap(),
    )
    .unwrap()[0];
    for i in 0..3 {
        want.push(next);
        let x = Tensor::new(&[next], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let l = refm.forward(&x, prompt.len() + i).unwrap();
        next = argmax_rows(&l).unwrap()[0];
    }
    let got = engine_greedy(model, &prompt, 3);
    assert_eq!(
        got,
        want,
        "ours: {:?}\ntheirs: {:?}",
        tok.decode(&got),
        tok.decode(&want)
    );
    let text = tok.decode(&got).unwrap();
    assert!(text.contains("Paris"), "{text}");
}

#[test]
fn f32_materialized_weights_agree_with_quantized() {
    // Dequantized f32 weights compute the same function up to the activation
    // quantization QMatMul applies (q8 of the inputs), so logits stay close and the
    // greedy answer is the same.
    let file = GgufFile::open(&smollm2_path()).unwrap();
    let tok = TextTokenizer::from_gguf(&file.content).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();
    let q = load_gguf(&file, WeightDtype::Quantized, &Device::Cpu).unwrap();
    let f = load_gguf(&file, WeightDtype::F32, &Device::Cpu).unwrap();
    assert!(f.weights_bytes() > 2 * q.weights_bytes());
    let lq = q.forward_dense(&prompt).unwrap();
    let lf = f.forward_dense(&prompt).unwrap();
    let last = prompt.len() - 1;
    let (a, b) = (
        lq.get(last).unwrap().to_vec1::<f32>().unwrap(),
        lf.get(last).unwrap().to_vec1::<f32>().unwrap(),
    );
    let d = max_abs_diff(&a, &b);
    assert!(d < 1.0, "max |Δlogit| = {d}");
    assert_eq!(
        argmax_rows(&lq.get(last).unwrap().unsqueeze(0).unwrap()).unwrap(),
        argmax_rows(&lf.get(last).unwrap().unsqueeze(0).unwrap()).unwrap()
    );
}

#[test]
fn gguf_tokenizer_matches_smollm2_pre_tokenization() {
    let file = GgufFile::open(&smollm2_path()).unwrap();
    let tok = TextTokenizer::from_gguf(&file.content).unwrap();
    // Special tokens are not followed by a spurious prefix space.
    let ids = tok.encode("<|im_start|>user\nHi<|im_end|>").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids[1], tok.token_id("user").unwrap(), "{ids:?}");
    assert_eq!(*ids.last().unwrap(), 2);
    // Digits are split one by one.
    let d = tok.encode("2024").unwrap();
    assert_eq!(d.len(), 4, "{d:?}");
    // Round trip without special tokens.
    let s = "The quick brown fox, 12 times: naïve café!\n  Indented.";
    assert_eq!(tok.decode(&tok.encode(s).unwrap()).unwrap(), s);
    // No BOS is added.
    assert_eq!(tok.encode("Hello").unwrap().len(), 1);
}

#[test]
fn gguf_config_has_smollm2_architecture() {
    let file = GgufFile::open(&smollm2_path()).unwrap();
    let c = file.config().unwrap();
    assert_eq!(
        (
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size
        ),
        (30, 9, 3, 64, 49_152, 576, 1536)
    );
    assert!(c.tie_word_embeddings && c.rope_interleaved);
    assert_eq!(c.eos_token_ids, vec![2]);
}

#[test]
fn chat_template_comes_from_the_gguf_and_encodes_chatml_markers_as_single_tokens() {
    use kvbench_engines::tokenizer::ChatTemplate;
    let file = GgufFile::open(&smollm2_path()).unwrap();
    let tok = TextTokenizer::from_gguf(&file.content).unwrap();
    let t = tok
        .chat_template
        .clone()
        .expect("SmolLM2 has a chat template");
    assert_eq!(
        t,
        ChatTemplate::ChatMl {
            default_system: Some(
                "You are a helpful AI assistant named SmolLM, trained by Hugging Face".into()
            )
        }
    );
    let text = t.render(&[("user", "Hi")], true);
    let ids = tok.encode(&text).unwrap();
    let (start, end) = (tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"));
    assert_eq!((start, end), (Some(1), Some(2)));
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2, "{ids:?}");
    // No spurious space after a marker: `<|im_start|>user` is `user`, not `Ġuser`.
    assert_eq!(tok.decode(&ids[..2]).unwrap(), "system");
    assert_eq!(tok.inner.id_to_token(ids[1]).as_deref(), Some("system"));
    assert_eq!(tok.end_of_turn_ids(), vec![2]);
}
