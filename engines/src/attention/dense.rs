//! Plain causal attention with candle ops over contiguous K/V (no cache): the
//! reference that paged attention and every policy are checked against.

use candle_core::{DType, Device, Result, Tensor};

/// `q`: `[T, H, dh]`, `k`/`v`: `[T, Hkv, dh]` of one sequence at positions `0..T`.
/// Returns `[T, H, dh]`. Scores and softmax in f32.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (t, h, dh) = q.dims3()?;
    let hkv = k.dim(1)?;
    let g = h / hkv;
    let dtype = q.dtype();
    let q = q.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?; // [H, T, dh]
    let repeat = |x: &Tensor| -> Result<Tensor> {
        // [T, Hkv, dh] → [H, T, dh] with query head h reading KV head h / G.
        x.to_dtype(DType::F32)?
            .transpose(0, 1)?
            .unsqueeze(1)?
            .expand((hkv, g, t, dh))?
            .reshape((h, t, dh))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = (q.matmul(&k.t()?)? / (dh as f64).sqrt())?;
    let mask = causal_mask(t, q.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let p = candle_nn::ops::softmax_last_dim(&scores)?;
    p.matmul(&v)?.transpose(0, 1)?.to_dtype(dtype)
}

/// `[T, T]` with 0 on and below the diagonal, −∞ above.
pub fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(m, (t, t), device)
}
