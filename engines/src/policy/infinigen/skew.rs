//! InfiniGen's offline skewing (algorithms.md §4): per layer and KV head an orthogonal
//! dh×dh matrix `A` from the SVD of calibration queries, so that skewed queries and keys
//! concentrate their energy in few columns while `(qA)·(kA) = q·k` stays exact.
//!
//! Calibration runs once per model and calibration text; the result is cached on disk
//! under a fingerprint of the weights, so a changed model never reuses stale matrices.

use crate::error::{Error, Result};
use crate::model::{Linear, Llama};
use crate::policy::LayerInput;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Name of the one tensor in a skewing file: `[layers, kv_heads, dh, dh]` f32.
const TENSOR_NAME: &str = "skew";

/// Largest `max |AᵀA − I|` a loaded file may have: f32 storage of f64 singular vectors
/// stays near 1e-7, so anything past this is corruption, not rounding.
const LOAD_ORTHO_TOL: f32 = 1e-3;

/// Skewing matrices `A[layer][kv_head]`, each dh×dh row-major; column c is the c-th
/// right singular vector of the stacked calibration queries, in descending singular
/// value order (so `(qA)·(kA) = q·k` and energy concentrates in the first columns).
#[derive(Debug, Clone, PartialEq)]
pub struct Skewing {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `[layer][kv_head][row][col]`.
    mats: Vec<f32>,
}

impl Skewing {
    /// Identity matrices (tests; "no skewing").
    pub fn identity(num_layers: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let dh = head_dim;
        let mut mats = vec![0f32; num_layers * num_kv_heads * dh * dh];
        for m in mats.chunks_exact_mut(dh * dh) {
            for i in 0..dh {
                m[i * dh + i] = 1.0;
            }
        }
        Self {
            num_layers,
            num_kv_heads,
            head_dim,
            mats,
        }
    }

    /// From post-RoPE calibration queries of every layer: `queries[layer]` is
    /// `[n, H, dh]` f32 row-major. Per KV head g (GQA [adapt]) the G query heads
    /// `g·G..(g+1)·G` are stacked row-wise into a (G·n)×dh matrix `Q = U Σ Vᵀ` and
    /// `A = V` (SVD in f64 for accuracy, stored f32).
    pub fn from_queries(
        queries: &[Vec<f32>],
        n: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let mut mats = Vec::with_capacity(queries.len() * num_kv_heads * head_dim * head_dim);
        for (layer, q) in queries.iter().enumerate() {
            let m = layer_matrices(q, n, num_heads, num_kv_heads, head_dim)
                .map_err(|e| Error::Config(format!("skewing, layer {layer}: {e}")))?;
            mats.extend_from_slice(&m);
        }
        Ok(Self {
            num_layers: queries.len(),
            num_kv_heads,
            head_dim,
            mats,
        })
    }

    /// A of (layer, kv head): dh×dh row-major. Panics when out of range, like indexing.
    pub fn matrix(&self, layer: usize, kv_head: usize) -> &[f32] {
        let sz = self.head_dim * self.head_dim;
        let i = (layer * self.num_kv_heads + kv_head) * sz;
        &self.mats[i..i + sz]
    }

    /// Every matrix, `[layer][kv_head][row][col]` (uploads to a device).
    pub fn all(&self) -> &[f32] {
        &self.mats
    }

    /// Max over (layer, head) of `max |AᵀA − I|` element-wise.
    pub fn orthogonality_error(&self) -> f32 {
        let dh = self.head_dim;
        if dh == 0 {
            return 0.0;
        }
        self.mats
            .par_chunks_exact(dh * dh)
            .map(|a| {
                let mut worst = 0f32;
                for i in 0..dh {
                    for j in 0..dh {
                        let dot: f32 = (0..dh).map(|r| a[r * dh + i] * a[r * dh + j]).sum();
                        let want = if i == j { 1.0 } else { 0.0 };
                        worst = worst.max((dot - want).abs());
                    }
                }
                worst
            })
            .reduce(|| 0f32, f32::max)
    }

    /// Save as safetensors (one `[L, Hkv, dh, dh]` f32 tensor). Atomic: written to a
    /// temporary file in the same directory and renamed, so a concurrent reader or a
    /// crash never sees a half-written cache entry.
    pub fn save(&self, path: &Path) -> Result<()> {
        let t = Tensor::from_slice(
            &self.mats,
            (
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.head_dim,
            ),
            &Device::Cpu,
        )?;
        let tmp = temp_path(path);
        let map = HashMap::from([(TENSOR_NAME.to_string(), t)]);
        let written = candle_core::safetensors::save(&map, &tmp)
            .map_err(|e| Error::Io {
                path: tmp.clone(),
                source: std::io::Error::other(e.to_string()),
            })
            .and_then(|()| {
                std::fs::rename(&tmp, path).map_err(|e| Error::Io {
                    path: path.into(),
                    source: e,
                })
            });
        if written.is_err() {
            // Best effort: the error being returned is the one that matters.
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Load a file written by [`Skewing::save`], checking it holds f32 matrices of the
    /// expected dims that are finite and orthogonal; any mismatch errors naming the file.
    pub fn load(
        path: &Path,
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let bad = |m: String| Error::model(path.display(), format!("skewing file: {m}"));
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.into(),
            source: e,
        })?;
        let map = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let t = map
            .get(TENSOR_NAME)
            .ok_or_else(|| bad(format!("no tensor `{TENSOR_NAME}`")))?;
        let want = [num_layers, num_kv_heads, head_dim, head_dim];
        if t.dims() != want {
            return Err(bad(format!(
                "shape {:?}, expected [layers, kv_heads, dh, dh] = {want:?}",
                t.dims()
            )));
        }
        if t.dtype() != DType::F32 {
            return Err(bad(format!("dtype {:?}, expected f32", t.dtype())));
        }
        let mats = t.flatten_all()?.to_vec1::<f32>()?;
        if mats.iter().any(|x| !x.is_finite()) {
            return Err(bad("non-finite entries".into()));
        }
        let s = Self {
            num_layers,
            num_kv_heads,
            head_dim,
            mats,
        };
        let err = s.orthogonality_error();
        if err > LOAD_ORTHO_TOL {
            return Err(bad(format!("matrices are not orthogonal (error {err})")));
        }
        Ok(s)
    }
}

/// `dir/.name.tmp-PID-N`: unique per process and call, in the target's directory so
/// the final rename stays on one file system.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "skew".into());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// The Hkv skewing matrices of one layer, concatenated, from its queries `[n, H, dh]`.
/// KV heads are independent, so their SVDs run in parallel.
fn layer_matrices(
    q: &[f32],
    n: usize,
    num_heads: usize,
    num_kv_heads: usize,
    dh: usize,
) -> std::result::Result<Vec<f32>, String> {
    if n == 0 || dh == 0 || num_kv_heads == 0 {
        return Err(format!(
            "need n, dh and num_kv_heads > 0 (got n={n}, dh={dh}, Hkv={num_kv_heads})"
        ));
    }
    if !num_heads.is_multiple_of(num_kv_heads) {
        return Err(format!(
            "num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        ));
    }
    if q.len() != n * num_heads * dh {
        return Err(format!(
            "{} query values, expected n·H·dh = {n}·{num_heads}·{dh}",
            q.len()
        ));
    }
    if q.iter().any(|x| !x.is_finite()) {
        return Err("queries contain non-finite values".into());
    }
    let g = num_heads / num_kv_heads;
    let per_head: Vec<Vec<f32>> = (0..num_kv_heads)
        .into_par_iter()
        .map(|kv| group_matrix(q, n, num_heads, g, kv, dh))
        .collect::<std::result::Result<_, _>>()?;
    Ok(per_head.concat())
}

/// `A = V` of the (G·n)×dh matrix of KV head `kv`'s query heads, row-major, columns in
/// descending singular value order, each column's sign fixed (largest entry positive)
/// so the result does not depend on the SVD routine's sign choices.
fn group_matrix(
    q: &[f32],
    n: usize,
    num_heads: usize,
    g: usize,
    kv: usize,
    dh: usize,
) -> std::result::Result<Vec<f32>, String> {
    let rows = g * n;
    let stacked = faer::Mat::<f64>::from_fn(rows, dh, |r, c| {
        let (h, t) = (kv * g + r / n, r % n);
        q[(t * num_heads + h) * dh + c] as f64
    });
    // Thin SVD gives a square V only when rows ≥ dh; with fewer rows (tiny calibration)
    // the full SVD is needed, and it is cheap then since U is rows×rows.
    let svd = if rows >= dh {
        stacked.thin_svd()
    } else {
        stacked.svd()
    }
    .map_err(|e| format!("SVD of KV head {kv} failed: {e:?}"))?;
    let v = svd.V();
    if v.nrows() != dh || v.ncols() != dh {
        return Err(format!(
            "SVD of KV head {kv} gave V of {}×{}, expected {dh}×{dh}",
            v.nrows(),
            v.ncols()
        ));
    }
    let mut a = vec![0f32; dh * dh];
    for c in 0..dh {
        let pivot =
            (0..dh)
                .map(|r| v[(r, c)])
                .fold(0f64, |best, x| if x.abs() > best.abs() { x } else { best });
        let sign = if pivot < 0.0 { -1.0 } else { 1.0 };
        for r in 0..dh {
            a[r * dh + c] = (sign * v[(r, c)]) as f32;
        }
    }
    Ok(a)
}

/// Run the model over `tokens` (no cache) and record every layer's post-RoPE queries,
/// then skew as [`Skewing::from_queries`]. Each layer's matrices are computed as soon
/// as its queries are seen, so only one layer's queries are held at a time.
pub fn calibrate(model: &Llama, tokens: &[u32]) -> Result<Skewing> {
    let c = &model.cfg;
    if tokens.is_empty() {
        return Err(Error::Config(
            "skewing calibration needs at least one token".into(),
        ));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::Config(format!(
            "calibration token {bad} is outside the vocabulary of {} ({} tokens)",
            c.name, c.vocab_size
        )));
    }
    let n = tokens.len();
    let mut layers: Vec<Option<Vec<f32>>> = vec![None; c.num_layers];
    let mut observe = |input: &LayerInput<'_>| -> Result<()> {
        let q = input
            .q
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let m = layer_matrices(&q, n, c.num_heads, c.num_kv_heads, c.head_dim)
            .map_err(|e| Error::model(&c.name, format!("skewing, layer {}: {e}", input.layer)))?;
        let slot = layers.get_mut(input.layer).ok_or_else(|| {
            Error::model(&c.name, format!("unexpected layer index {}", input.layer))
        })?;
        *slot = Some(m);
        Ok(())
    };
    model.forward_observe(tokens, &mut observe)?;
    let mut mats = Vec::with_capacity(c.num_layers * c.num_kv_heads * c.head_dim * c.head_dim);
    for (i, m) in layers.into_iter().enumerate() {
        let m = m.ok_or_else(|| {
            Error::model(
                &c.name,
                format!("layer {i} was not observed in calibration"),
            )
        })?;
        mats.extend_from_slice(&m);
    }
    Ok(Skewing {
        num_layers: c.num_layers,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        mats,
    })
}

/// Stable 64-bit fingerprint (xxh3) of the model's weights and config: every weight's
/// bytes as held (dense: raw bytes in their dtype; quantized: the raw GGUF blocks) with
/// its dtype and shape, plus the config and weight dtype. Tensors are hashed in
/// parallel and the per-tensor hashes combined in a fixed order.
pub fn weights_fingerprint(model: &Llama) -> Result<u64> {
    // A packed table hashes as its rows do (`Weight::hash`): the layout is not the weights.
    let mut weights: Vec<Weight<'_>> = vec![Weight::Linear(model.embed())];
    for l in model.layers() {
        for w in l.matrices() {
            weights.push(Weight::Linear(w));
        }
        weights.push(Weight::Dense(&l.attn_norm));
        weights.push(Weight::Dense(&l.ffn_norm));
    }
    weights.push(Weight::Dense(model.final_norm()));
    // A tied dense head is the embedding table again: hashing it twice would double
    // the cost of the largest tensor for nothing (the config records the tying).
    if !model.head_tied() {
        weights.push(Weight::Linear(model.lm_head()));
    }
    let hashes: Vec<u64> = match model.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => device_hashes(&weights, dev)?,
        _ => weights
            .par_iter()
            .map(Weight::hash)
            .collect::<Result<_>>()?,
    };
    let cfg = serde_json::to_string(&model.cfg)
        .map_err(|e| Error::model(&model.cfg.name, format!("cannot serialize config: {e}")))?;
    let mut h = Xxh3::new();
    h.update(b"kvbench-weights-v1\0");
    h.update(cfg.as_bytes());
    h.update(model.weight_dtype.to_string().as_bytes());
    h.update(&(hashes.len() as u64).to_le_bytes());
    for x in hashes {
        h.update(&x.to_le_bytes());
    }
    Ok(h.digest())
}

enum Weight<'a> {
    Dense(&'a Tensor),
    Linear(&'a Linear),
}

/// The weights' hashes when they live on a CUDA device, each as [`Weight::hash`] gives
/// it, the dense ones read through one pinned host buffer ([`hash_staged`]).
#[cfg(feature = "cuda")]
fn device_hashes(weights: &[Weight<'_>], dev: &candle_core::CudaDevice) -> Result<Vec<u64>> {
    let mut stage = Stage::new(dev)?;
    weights
        .iter()
        .map(|w| match *w {
            Weight::Dense(t) | Weight::Linear(Linear::Dense(t)) => {
                hash_staged("dense", t, &mut stage)
            }
            _ => w.hash(),
        })
        .collect()
}

/// A pinned host buffer that device tensors are copied through to be hashed.
#[cfg(feature = "cuda")]
pub(crate) struct Stage {
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    buf: candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u8>,
}

#[cfg(feature = "cuda")]
impl Stage {
    /// Bytes copied (and hashed) at a time.
    const BYTES: usize = 64 << 20;

    pub(crate) fn new(dev: &candle_core::CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        // Plain page-locked memory (no flags): the host reads it, and reads of
        // write-combined memory (cudarc's `alloc_pinned`) are slow.
        // SAFETY: only the bytes a copy has just written are read.
        let buf = unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<u8>(Self::BYTES, 0)
        }
        .map_err(|e| Error::Config(format!("pinning a buffer to fingerprint weights: {e}")))?;
        Ok(Self { stream, buf })
    }
}

/// [`hash_tensor`] of a tensor on a CUDA device, the same digest: its bytes (only its
/// view's, not the whole storage's) copied through `stage` a buffer at a time and hashed
/// as they land. `hash_tensor` copies the whole storage to pageable host memory through
/// candle: for Llama-3.1-8B's 16 GB of bf16 weights that took about 18 s of each
/// InfiniGen cell on an H100 before its first step. Tensors not on CUDA, or not
/// contiguous, go to `hash_tensor`.
#[cfg(feature = "cuda")]
pub(crate) fn hash_staged(tag: &str, t: &Tensor, stage: &mut Stage) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::CudaView;
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cuda(c), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        drop(storage);
        return hash_tensor(tag, t);
    };
    let n = (end - start) * t.dtype().size_in_bytes();
    // SAFETY: any element type's bytes are valid bytes.
    let bytes: Option<CudaView<'_, u8>> = unsafe {
        match t.dtype() {
            DType::BF16 => c
                .as_cuda_slice::<half::bf16>()?
                .slice(start..end)
                .transmute(n),
            DType::F16 => c
                .as_cuda_slice::<half::f16>()?
                .slice(start..end)
                .transmute(n),
            DType::F32 => c.as_cuda_slice::<f32>()?.slice(start..end).transmute(n),
            DType::F64 => c.as_cuda_slice::<f64>()?.slice(start..end).transmute(n),
            DType::U8 => c.as_cuda_slice::<u8>()?.slice(start..end).transmute(n),
            DType::U32 => c.as_cuda_slice::<u32>()?.slice(start..end).transmute(n),
            DType::I64 => c.as_cuda_slice::<i64>()?.slice(start..end).transmute(n),
            other => {
                return Err(Error::Config(format!(
                    "cannot fingerprint a weight of dtype {other:?}"
                )))
            }
        }
    };
    let bytes =
        bytes.ok_or_else(|| Error::Config("fingerprint: a view past its storage".into()))?;
    let mut h = Xxh3::new();
    h.update(format!("{tag}:{:?}:{:?}", t.dtype(), t.dims()).as_bytes());
    let fail = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        Error::Config(format!("copying a weight to fingerprint it: {e}"))
    };
    let mut off = 0;
    while off < n {
        let len = Stage::BYTES.min(n - off);
        // The host side is cut to the view's length: cudarc copies as many bytes as
        // the destination holds, so the whole pinned buffer would read past the view
        // (CUDA_ERROR_INVALID_VALUE at a weight's end).
        let dst = &mut stage.buf.as_mut_slice().map_err(fail)?[..len];
        stage
            .stream
            .memcpy_dtoh(&bytes.slice(off..off + len), dst)
            .map_err(fail)?;
        // The copy into pinned memory is asynchronous, and the buffer's own event is
        // never recorded with cudarc's event tracking off (engines/src/device.rs), so
        // `as_slice` would not wait for it: the stream is waited on instead.
        stage.stream.synchronize().map_err(fail)?;
        h.update(&stage.buf.as_slice().map_err(fail)?[..len]);
        off += len;
    }
    Ok(h.digest())
}

impl Weight<'_> {
    fn hash(&self) -> Result<u64> {
        match *self {
            Weight::Dense(t) | Weight::Linear(Linear::Dense(t)) => hash_tensor("dense", t),
            // As the row layout hashes: the layout is not the weights.
            Weight::Linear(Linear::Packed(p)) => hash_tensor("dense", &p.unpack()?),
            Weight::Linear(Linear::Quantized { mm, .. }) => match mm {
                QMatMul::QTensor(qt) => {
                    let data = qt.data()?;
                    let mut h = Xxh3::new();
                    h.update(format!("q:{:?}:{:?}", qt.dtype(), qt.shape().dims()).as_bytes());
                    h.update(&data);
                    Ok(h.digest())
                }
                QMatMul::Tensor(t) => hash_tensor("qmm", t),
                QMatMul::TensorF16(t) => hash_tensor("qmm-f16", t),
            },
        }
    }
}

/// xxh3 of a tag, the dtype, the shape and the raw element bytes of `t`. CPU tensors
/// are read in place; others are copied to the host first.
pub(crate) fn hash_tensor(tag: &str, t: &Tensor) -> Result<u64> {
    let mut h = Xxh3::new();
    h.update(format!("{tag}:{:?}:{:?}", t.dtype(), t.dims()).as_bytes());
    let hashed = {
        let (storage, layout) = t.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(cpu), Some((start, end))) => {
                let bytes: &[u8] = match t.dtype() {
                    DType::F32 => bytemuck::cast_slice(&cpu.as_slice::<f32>()?[start..end]),
                    DType::F16 => bytemuck::cast_slice(&cpu.as_slice::<half::f16>()?[start..end]),
                    DType::BF16 => bytemuck::cast_slice(&cpu.as_slice::<half::bf16>()?[start..end]),
                    DType::F64 => bytemuck::cast_slice(&cpu.as_slice::<f64>()?[start..end]),
                    DType::U8 => &cpu.as_slice::<u8>()?[start..end],
                    DType::U32 => bytemuck::cast_slice(&cpu.as_slice::<u32>()?[start..end]),
                    DType::I64 => bytemuck::cast_slice(&cpu.as_slice::<i64>()?[start..end]),
                    other => {
                        return Err(Error::Config(format!(
                            "cannot fingerprint a weight of dtype {other:?}"
                        )))
                    }
                };
                h.update(bytes);
                true
            }
            _ => false,
        }
    };
    if hashed {
        return Ok(h.digest());
    }
    // Not on the CPU or not contiguous: a contiguous host copy holds the same bytes.
    hash_tensor(tag, &t.to_device(&Device::Cpu)?.contiguous()?)
}

/// Cached calibration: `dir/skew-{fingerprint:016x}-{calib hash:016x}.safetensors`
/// (calib hash = xxh3 of the token ids, little-endian u32). Loaded when present and
/// valid, else calibrated and saved (an invalid file is overwritten). Returns the
/// skewing and whether it came from the cache.
pub fn load_or_calibrate(model: &Llama, tokens: &[u32], dir: &Path) -> Result<(Skewing, bool)> {
    let fp = weights_fingerprint(model)?;
    let ids: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let calib = xxh3_64(&ids);
    let path = dir.join(format!("skew-{fp:016x}-{calib:016x}.safetensors"));
    let c = &model.cfg;
    if path.is_file() {
        if let Ok(s) = Skewing::load(&path, c.num_layers, c.num_kv_heads, c.head_dim) {
            return Ok((s, true));
        }
    }
    let s = calibrate(model, tokens)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::Io {
        path: dir.into(),
        source: e,
    })?;
    s.save(&path)?;
    Ok((s, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::preset;
    use crate::model::load::load_preset;
    use crate::model::WeightDtype;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Standard normal by Box–Muller.
    fn normal(rng: &mut StdRng) -> f32 {
        let u1: f64 = rng.random::<f64>().max(1e-300);
        let u2: f64 = rng.random();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    fn unit(rng: &mut StdRng, dh: usize) -> Vec<f32> {
        let v: Vec<f32> = (0..dh).map(|_| normal(rng)).collect();
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / norm).collect()
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Row vector times A (dh×dh row-major).
    fn skew(x: &[f32], a: &[f32]) -> Vec<f32> {
        let dh = x.len();
        (0..dh)
            .map(|c| (0..dh).map(|r| x[r] * a[r * dh + c]).sum())
            .collect()
    }

    fn column(a: &[f32], dh: usize, c: usize) -> Vec<f32> {
        (0..dh).map(|r| a[r * dh + c]).collect()
    }

    /// Queries `[n, H, dh]`: per head, a combination of `dirs[h]` with scales
    /// `scales` plus small isotropic noise.
    fn planted(
        rng: &mut StdRng,
        n: usize,
        dirs: &[Vec<Vec<f32>>],
        scales: &[f32],
        noise: f32,
    ) -> Vec<f32> {
        let h = dirs.len();
        let dh = dirs[0][0].len();
        let mut q = vec![0f32; n * h * dh];
        for t in 0..n {
            for (hh, hd) in dirs.iter().enumerate() {
                let row = &mut q[(t * h + hh) * dh..(t * h + hh + 1) * dh];
                for (d, s) in hd.iter().zip(scales) {
                    let w = s * normal(rng);
                    for (x, y) in row.iter_mut().zip(d) {
                        *x += w * y;
                    }
                }
                for x in row.iter_mut() {
                    *x += noise * normal(rng);
                }
            }
        }
        q
    }

    #[test]
    fn from_queries_is_orthogonal_preserves_dots_and_sorts_energy() {
        let mut rng = StdRng::seed_from_u64(11);
        let (n, h, hkv, dh, layers) = (200, 4, 2, 16, 2);
        let queries: Vec<Vec<f32>> = (0..layers)
            .map(|_| {
                let shared: Vec<Vec<f32>> = (0..3).map(|_| unit(&mut rng, dh)).collect();
                let dirs = vec![shared; h];
                planted(&mut rng, n, &dirs, &[10.0, 5.0, 2.0], 0.05)
            })
            .collect();
        let s = Skewing::from_queries(&queries, n, h, hkv, dh).unwrap();
        assert_eq!(
            (s.num_layers, s.num_kv_heads, s.head_dim),
            (layers, hkv, dh)
        );
        let err = s.orthogonality_error();
        assert!(err < 1e-3, "orthogonality error {err}");
        for (l, ql) in queries.iter().enumerate() {
            for g in 0..hkv {
                let a = s.matrix(l, g);
                for _ in 0..20 {
                    let q: Vec<f32> = (0..dh).map(|_| normal(&mut rng)).collect();
                    let k: Vec<f32> = (0..dh).map(|_| 3.0 * normal(&mut rng)).collect();
                    let want = dot(&q, &k);
                    let got = dot(&skew(&q, a), &skew(&k, a));
                    let scale = dot(&q, &q).sqrt() * dot(&k, &k).sqrt();
                    assert!((got - want).abs() <= 1e-4 * scale, "{got} vs {want}");
                }
                // Energy of the group's own queries along each column, descending.
                let energy: Vec<f32> = (0..dh)
                    .map(|c| {
                        let col = column(a, dh, c);
                        let mut e = 0f32;
                        for t in 0..n {
                            for hh in g * 2..(g + 1) * 2 {
                                let row = &ql[(t * h + hh) * dh..(t * h + hh + 1) * dh];
                                e += dot(row, &col).powi(2);
                            }
                        }
                        e
                    })
                    .collect();
                for c in 1..dh {
                    assert!(energy[0] >= energy[c], "column {c}: {energy:?}");
                    assert!(energy[c - 1] >= energy[c] * (1.0 - 1e-4), "{energy:?}");
                }
                // Three planted directions hold nearly all of it.
                let total: f32 = energy.iter().sum();
                assert!(energy[..3].iter().sum::<f32>() > 0.99 * total, "{energy:?}");
            }
        }
    }

    #[test]
    fn gqa_stacks_each_groups_heads() {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, dh) = (128, 16);
        let d0 = unit(&mut rng, dh);
        let d1 = unit(&mut rng, dh);
        let weak0 = unit(&mut rng, dh);
        let weak1 = unit(&mut rng, dh);
        // Heads 0,1 (group 0) live along d0, heads 2,3 (group 1) along d1.
        let dirs = vec![
            vec![d0.clone(), weak0.clone()],
            vec![d0.clone(), weak0],
            vec![d1.clone(), weak1.clone()],
            vec![d1.clone(), weak1],
        ];
        let q = planted(&mut rng, n, &dirs, &[8.0, 1.0], 0.01);
        let s = Skewing::from_queries(&[q], n, 4, 2, dh).unwrap();
        let a0 = column(s.matrix(0, 0), dh, 0);
        let a1 = column(s.matrix(0, 1), dh, 0);
        assert!(dot(&a0, &d0).abs() > 0.99, "{}", dot(&a0, &d0));
        assert!(dot(&a1, &d1).abs() > 0.99, "{}", dot(&a1, &d1));
        // And not the other group's direction (they are random, so not aligned).
        assert!(dot(&a0, &d1).abs() < 0.9 && dot(&a1, &d0).abs() < 0.9);
    }

    #[test]
    fn from_queries_with_fewer_rows_than_dh_is_still_square_and_orthogonal() {
        let mut rng = StdRng::seed_from_u64(3);
        let (n, h, dh) = (3, 2, 16);
        let q: Vec<f32> = (0..n * h * dh).map(|_| normal(&mut rng)).collect();
        let s = Skewing::from_queries(&[q], n, h, 1, dh).unwrap();
        assert_eq!(s.matrix(0, 0).len(), dh * dh);
        assert!(s.orthogonality_error() < 1e-3);
    }

    #[test]
    fn from_queries_rejects_bad_input() {
        let q = vec![0.5f32; 10 * 4 * 8];
        assert!(matches!(
            Skewing::from_queries(std::slice::from_ref(&q), 10, 4, 3, 8),
            Err(Error::Config(_))
        ));
        assert!(Skewing::from_queries(std::slice::from_ref(&q), 11, 4, 2, 8).is_err());
        let mut nan = q.clone();
        nan[7] = f32::NAN;
        assert!(Skewing::from_queries(&[nan], 10, 4, 2, 8).is_err());
        assert!(Skewing::from_queries(&[q], 10, 4, 2, 8).is_ok());
    }

    #[test]
    fn identity_is_identity() {
        let s = Skewing::identity(2, 3, 4);
        assert_eq!(s.orthogonality_error(), 0.0);
        let a = s.matrix(1, 2);
        for r in 0..4 {
            for c in 0..4 {
                assert_eq!(a[r * 4 + c], if r == c { 1.0 } else { 0.0 });
            }
        }
    }

    #[test]
    fn save_load_round_trip_and_rejects_bad_files() {
        let mut rng = StdRng::seed_from_u64(9);
        let (n, h, hkv, dh) = (40, 4, 2, 8);
        let queries: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n * h * dh).map(|_| normal(&mut rng)).collect())
            .collect();
        let s = Skewing::from_queries(&queries, n, h, hkv, dh).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        s.save(&path).unwrap();
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(Skewing::load(&path, 3, hkv, dh).unwrap(), s);

        for (l, k, d) in [(2, hkv, dh), (3, 1, dh), (3, hkv, 4)] {
            let e = Skewing::load(&path, l, k, d).unwrap_err();
            assert!(e.to_string().contains("s.safetensors"), "{e}");
        }
        let missing = dir.path().join("missing.safetensors");
        assert!(matches!(
            Skewing::load(&missing, 3, hkv, dh),
            Err(Error::Io { .. })
        ));

        let bytes = std::fs::read(&path).unwrap();
        let truncated = dir.path().join("truncated.safetensors");
        for cut in [0, 5, 8, 20, bytes.len() / 2, bytes.len() - 1] {
            std::fs::write(&truncated, &bytes[..cut]).unwrap();
            let e = Skewing::load(&truncated, 3, hkv, dh).unwrap_err();
            assert!(e.to_string().contains("truncated.safetensors"), "{e}");
        }
        let garbage = dir.path().join("garbage.safetensors");
        let junk: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
        std::fs::write(&garbage, &junk).unwrap();
        assert!(Skewing::load(&garbage, 3, hkv, dh).is_err());
        // Well-formed but not orthogonal: rejected too.
        Skewing {
            mats: vec![0.5; s.mats.len()],
            ..s.clone()
        }
        .save(&garbage)
        .unwrap();
        assert!(Skewing::load(&garbage, 3, hkv, dh).is_err());
    }

    fn tiny(seed: u64) -> Llama {
        load_preset(
            preset("tiny").unwrap(),
            WeightDtype::F32,
            seed,
            &Device::Cpu,
        )
        .unwrap()
    }

    #[test]
    fn fingerprint_follows_the_weights() {
        let a = weights_fingerprint(&tiny(7)).unwrap();
        assert_eq!(a, weights_fingerprint(&tiny(7)).unwrap());
        assert_ne!(a, weights_fingerprint(&tiny(8)).unwrap());
        // Same weights in another dtype are another model for the cache.
        let bf16 =
            load_preset(preset("tiny").unwrap(), WeightDtype::Bf16, 7, &Device::Cpu).unwrap();
        assert_ne!(a, weights_fingerprint(&bf16).unwrap());
        // The layout is not the weights: packed (the tied head and its table too), the
        // same model has the same fingerprint, so its calibration is found again.
        for tie in [false, true] {
            let mut cfg = preset("tiny").unwrap();
            cfg.tie_word_embeddings = tie;
            let rows = load_preset(cfg, WeightDtype::F32, 7, &Device::Cpu).unwrap();
            let packed = rows.clone().pack_rows().unwrap();
            assert!(packed.rows_packed() && packed.head_tied() == tie);
            assert_eq!(
                weights_fingerprint(&rows).unwrap(),
                weights_fingerprint(&packed).unwrap(),
                "tie {tie}"
            );
        }
    }

    #[test]
    fn calibrate_tiny_and_cache() {
        let model = tiny(7);
        let mut rng = StdRng::seed_from_u64(1);
        let tokens: Vec<u32> = (0..64)
            .map(|_| rng.random_range(0..model.cfg.vocab_size as u32))
            .collect();
        let s = calibrate(&model, &tokens).unwrap();
        let c = &model.cfg;
        assert_eq!(
            (s.num_layers, s.num_kv_heads, s.head_dim),
            (c.num_layers, c.num_kv_heads, c.head_dim)
        );
        assert_eq!(
            s.matrix(c.num_layers - 1, c.num_kv_heads - 1).len(),
            16 * 16
        );
        assert!(s.orthogonality_error() < 1e-3);
        assert_ne!(s, Skewing::identity(2, 2, 16));

        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let (first, hit) = load_or_calibrate(&model, &tokens, &cache).unwrap();
        assert!(!hit);
        assert_eq!(first, s);
        let (second, hit) = load_or_calibrate(&model, &tokens, &cache).unwrap();
        assert!(hit);
        assert_eq!(second, first);
        // Another calibration text is another cache entry.
        let (_, hit) = load_or_calibrate(&model, &tokens[..32], &cache).unwrap();
        assert!(!hit);
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 2);

        assert!(calibrate(&model, &[]).is_err());
        assert!(calibrate(&model, &[c.vocab_size as u32]).is_err());
    }
}
