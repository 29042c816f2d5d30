//! SmolLM2 with dequantized f32 weights against candle-transformers' quantized llama
//! with `CANDLE_DEQUANTIZE_ALL` (also f32): no activation quantization on either side,
//! so logits agree to float rounding. Its own test binary because the variable is
//! read once per thread by candle and must not leak into other tests.

mod common;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::{engine_greedy, max_abs_diff, smollm2_path};
use kvbench_engines::engine::argmax_rows;
use kvbench_engines::model::load::{load_gguf, GgufFile};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::tokenizer::TextTokenizer;

const LOGIT_TOL: f32 = 1e-3;

#[test]
fn f32_logits_and_32_greedy_tokens_match_dequantized_candle_llama() {
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let path = smollm2_path();
    let file = GgufFile::open(&path).unwrap();
    let tok = TextTokenizer::from_gguf(&file.content).unwrap();
    let model = load_gguf(&file, WeightDtype::F32, &Device::Cpu).unwrap();
    let prompt = tok.encode("Gravity is the force that").unwrap();

    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut refm = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut logits = refm.forward(&input, 0).unwrap();

    let ours = engine_greedy(model.clone(), &prompt, 32);

    // Logits of the prompt's last position, and of every generated position, through
    // the reference's own KV cache against ours recomputed (dense) and paged (tokens).
    let dense = model
        .forward_dense(&[prompt.as_slice(), &ours].concat())
        .unwrap();
    let mut worst = 0f32;
    let mut want = Vec::new();
    for (i, &fed) in ours.iter().enumerate() {
        let theirs = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mine = dense
            .get(prompt.len() - 1 + i)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        worst = worst.max(max_abs_diff(&mine, &theirs));
        let next = argmax_rows(&logits).unwrap()[0];
        want.push(next);
        let x = Tensor::new(&[fed], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        logits = refm.forward(&x, prompt.len() + i).unwrap();
    }
    println!("f32: max |Δlogit| over 32 positions = {worst}");
    assert!(worst < LOGIT_TOL, "max |Δlogit| = {worst}");
    assert_eq!(
        ours,
        want,
        "ours: {:?}\ntheirs: {:?}",
        tok.decode(&ours),
        tok.decode(&want)
    );
}
