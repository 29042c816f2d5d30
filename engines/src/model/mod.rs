//! The Llama-family decoder (GQA, RoPE with llama3 scaling, RMSNorm, SwiGLU) on candle.
//! Attention is delegated to a [`KvPolicy`]; [`Llama::forward_dense`] is the no-cache
//! reference every policy is checked against.

mod elementwise;
pub mod load;
pub mod packed;
pub mod pages;
pub mod team;

use crate::attention::dense::causal_attention;
use crate::config::{rope_inv_freq, ModelConfig};
use crate::error::Result;
use crate::policy::{KvPolicy, LayerInput, Rope, StepBatch};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use packed::{PackedRows, SendPtr};

/// Attention of one layer → output `[T, H, dh]`.
type AttendFn<'a> = dyn FnMut(&LayerInput<'_>) -> Result<Tensor> + 'a;

/// How weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// GGUF matrices kept in their quantized format (candle `QMatMul`).
    Quantized,
    F32,
    F16,
    Bf16,
}

impl WeightDtype {
    /// The dtype activations (and the KV cache) use.
    pub fn compute(&self) -> DType {
        match self {
            WeightDtype::Quantized | WeightDtype::F32 => DType::F32,
            WeightDtype::F16 => DType::F16,
            WeightDtype::Bf16 => DType::BF16,
        }
    }
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightDtype::Quantized => "quantized",
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::Bf16 => "bf16",
        })
    }
}

/// Row count up to which dense matmuls use the transposed form (see `Linear::forward`).
const SMALL_M: usize = 64;

/// A weight matrix `[out, in]`, quantized, dense, or dense f32 packed for the CPU's
/// matrix-vector path ([`packed`]).
#[derive(Debug, Clone)]
pub enum Linear {
    Quantized { mm: QMatMul, bytes: u64 },
    Dense(Tensor),
    Packed(PackedRows),
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // One to a few rows (decode at small batch): a matrix-vector product that
        // streams each weight row once, split over the threads by output rows; gemm's
        // path for so few rows reads the weights at a fraction of the memory bandwidth
        // (docs/correctness-and-performance.md).
        if let Some(m) = self.mat() {
            if let Some(y) = gemv_many(&[m], x)? {
                return Ok(y.into_iter().next().unwrap_or_else(|| unreachable!()));
            }
        }
        Ok(match self {
            Linear::Quantized { mm, .. } => mm.forward(x)?,
            Linear::Packed(p) => p.matmul(x)?,
            // Few rows (decode): W·xᵀ runs the weight matrix through gemm as the left,
            // row-major operand, measured 1.3–1.9× faster than x·Wᵀ at 16 rows.
            Linear::Dense(w) if x.device().is_cpu() && x.rank() == 2 && x.dim(0)? <= SMALL_M => {
                w.matmul(&x.t()?)?.t()?.contiguous()?
            }
            Linear::Dense(w) => x.matmul(&w.t()?)?,
        })
    }

    /// The matrix as the matrix-vector path reads it; `None` for a quantized one.
    fn mat(&self) -> Option<Mat<'_>> {
        match self {
            Linear::Dense(w) => Some(Mat::Rows(w)),
            Linear::Packed(p) => Some(Mat::Packed(p)),
            Linear::Quantized { .. } => None,
        }
    }

    /// Several products of the same input: as one pass over the thread pool when all
    /// take the matrix-vector path, one by one otherwise.
    pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let mats: Option<Vec<Mat<'_>>> = ls.iter().map(|l| l.mat()).collect();
        if let Some(ms) = mats {
            if let Some(ys) = gemv_many(&ms, x)? {
                if let Ok(ys) = <[Tensor; N]>::try_from(ys) {
                    return Ok(ys);
                }
            }
        }
        let ys: Vec<Tensor> = ls.iter().map(|l| l.forward(x)).collect::<Result<_>>()?;
        Ok(<[Tensor; N]>::try_from(ys).unwrap_or_else(|_| unreachable!("one output per input")))
    }

    /// Whether both are the same weights in memory (a head tied to its embedding).
    pub fn same_as(&self, other: &Linear) -> bool {
        match (self, other) {
            (Linear::Dense(a), Linear::Dense(b)) => a.id() == b.id(),
            (Linear::Packed(a), Linear::Packed(b)) => a.data().id() == b.data().id(),
            _ => false,
        }
    }

    pub fn bytes(&self) -> u64 {
        match self {
            Linear::Quantized { bytes, .. } => *bytes,
            Linear::Dense(w) => tensor_bytes(w),
            Linear::Packed(p) => p.bytes(),
        }
    }

    /// The matrix in the row layout: a packed one unpacked (a new tensor), any other
    /// as it is.
    pub fn unpacked(&self) -> Result<Linear> {
        Ok(match self {
            Linear::Packed(p) => Linear::Dense(p.unpack()?),
            l => l.clone(),
        })
    }
}

/// Rows of input up to which [`gemv_many`] replaces gemm.
const GEMV_MAX_ROWS: usize = 4;
/// The layers' matrices' bytes from which the loader packs them
/// ([`Llama::with_packed_rows`]): SmolLM2-135M's are 424 MB, the tiny preset's 0.2 MB.
pub const PACK_MIN_LAYER_BYTES: u64 = 32 << 20;
/// Multiply-adds below which a matrix-vector pass runs on the calling thread: about
/// 20 µs of work, a few hand-offs to the pool (the tiny preset's products at a decode
/// batch of 16 ran a third slower handed off).
const GEMV_SERIAL_WORK: usize = 1 << 18;
/// The same for packed matrices, which gemm reads only once unpacked: their groups of
/// four rows dotted with two inputs at a time keep up with gemm on the row layout at a
/// decode batch of 16 and 32.
const PACKED_GEMV_MAX_ROWS: usize = 64;

/// A dense matrix as the matrix-vector path reads it.
#[derive(Clone, Copy)]
enum Mat<'a> {
    /// `[out, in]` in the row layout.
    Rows(&'a Tensor),
    /// Packed in groups of four rows ([`packed`]).
    Packed(&'a PackedRows),
}

impl Mat<'_> {
    /// Whether the matrix-vector path takes this matrix on `rows` input rows: packed, up
    /// to [`PACKED_GEMV_MAX_ROWS`]; in the row layout, a contiguous f32 CPU matrix, up
    /// to [`GEMV_MAX_ROWS`].
    fn takes(&self, rows: usize) -> bool {
        match self {
            Mat::Packed(_) => rows <= PACKED_GEMV_MAX_ROWS,
            Mat::Rows(w) => {
                rows <= GEMV_MAX_ROWS
                    && elementwise::cpu_f32(w)
                    && w.rank() == 2
                    && w.is_contiguous()
            }
        }
    }
}

/// `x·Wᵀ` for an f32 `x` of at most [`GEMV_MAX_ROWS`] rows and a contiguous f32 `W`
/// (`[out, in]`) on the CPU: each weight row is read once and dotted with every input
/// row while it is in cache. `None` where it does not apply (gemm then runs).
#[cfg(test)]
fn gemv(w: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
    Ok(gemv_many(&[Mat::Rows(w)], x)?.map(|mut ys| ys.remove(0)))
}

/// The matrix-vector product of several matrices on the same input in one pass over
/// the thread pool (one hand-off per group instead of one per matrix: Q, K and V; gate
/// and up). `None` unless every matrix takes the matrix-vector path.
fn gemv_many(ms: &[Mat<'_>], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    if !x.device().is_cpu() || x.rank() != 2 || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let rows = x.dim(0)?;
    if !ms.iter().all(|m| m.takes(rows)) {
        return Ok(None);
    }
    let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let Some(ys) = gemv_rows(ms, &xs, rows)? else {
        return Ok(None);
    };
    ys.into_iter()
        .map(|y| {
            let n = y.len() / rows;
            Ok(Tensor::from_vec(y, (rows, n), x.device())?)
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// [`gemv_many`] on `rows` f32 input rows `xs` (`[rows, k]`): each matrix's product
/// `[rows, n]`. `None` where a matrix is not an f32 CPU matrix of `k` columns.
fn gemv_rows(ms: &[Mat<'_>], xs: &[f32], rows: usize) -> Result<Option<Vec<Vec<f32>>>> {
    use candle_core::{CpuStorage, Storage};
    if rows == 0 || !xs.len().is_multiple_of(rows) {
        return Ok(None);
    }
    let k = xs.len() / rows;
    for m in ms {
        let width = match m {
            Mat::Rows(w) => w.dims().last().copied(),
            Mat::Packed(p) => Some(p.dims().1),
        };
        if !m.takes(rows) || width != Some(k) {
            return Ok(None);
        }
    }
    let guards: Vec<_> = ms
        .iter()
        .map(|m| match m {
            Mat::Rows(w) => w.storage_and_layout(),
            Mat::Packed(p) => p.data().storage_and_layout(),
        })
        .collect();
    let mut datas = Vec::with_capacity(ms.len());
    for (storage, layout) in &guards {
        let Storage::Cpu(CpuStorage::F32(data)) = &**storage else {
            return Ok(None);
        };
        datas.push(&data[layout.start_offset()..]);
    }
    let avx = crate::attention::paged::has_avx2_fma();
    // Output-major ([n, rows], a packed matrix's padding rows included until the end)
    // so each chunk of rows writes one contiguous run.
    let threads = rayon::current_num_threads().max(1);
    let g = packed::GROUP;
    let heights: Vec<(usize, usize)> = ms
        .iter()
        .map(|m| match m {
            Mat::Rows(w) => w.dim(0).map(|n| (n, n)),
            Mat::Packed(p) => Ok((p.dims().0, p.dims().0.next_multiple_of(g))),
        })
        .collect::<candle_core::Result<_>>()?;
    let mut outs: Vec<Vec<f32>> = heights.iter().map(|&(_, h)| vec![0f32; h * rows]).collect();
    // The pass's units (a packed matrix's groups, a row-layout matrix's rows), the
    // matrices one after another (Q, K and V as one run), each matrix's first unit.
    let unit_of = |m: &Mat<'_>| if matches!(m, Mat::Packed(_)) { g } else { 1 };
    let mut firsts = Vec::with_capacity(ms.len());
    let mut total = 0;
    for (&(_, h), m) in heights.iter().zip(ms) {
        firsts.push(total);
        total += h / unit_of(m);
    }
    let dsts: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    // Four inputs a pass in 512-bit registers where the CPU has them: a batch-16 decode
    // 1.05-1.09x faster (docs/correctness-and-performance.md, "Four decode rows a pass").
    let wide = avx && crate::attention::paged::has_avx512();
    // Units `r` of the pass: each matrix's part of them.
    let run = |r: std::ops::Range<usize>| {
        for (((m, &first), (wd, dst)), &(_, h)) in ms
            .iter()
            .zip(&firsts)
            .zip(datas.iter().zip(&dsts))
            .zip(&heights)
        {
            let unit = unit_of(m);
            let (lo, hi) = (r.start.max(first), r.end.min(first + h / unit));
            if lo >= hi {
                continue;
            }
            let (u0, n) = ((lo - first) * unit, (hi - lo) * unit);
            let w = &wd[u0 * k..(u0 + n) * k];
            // SAFETY: rows `u0..u0 + n` of this matrix's `[h, rows]` output lie inside
            // it, and no other call of `run` is given them (the parts do not overlap); the
            // buffer outlives the calls.
            let ys = unsafe { std::slice::from_raw_parts_mut(dst.get().add(u0 * rows), n * rows) };
            if matches!(m, Mat::Packed(_)) {
                gemv_packed_block(avx, wide, w, xs, k, rows, ys)
            } else {
                gemv_block(avx, w, xs, k, rows, ys)
            }
        }
    };
    // A few microseconds of work (a small model's products) cost less on this thread
    // than a hand-off to the pool.
    let work: usize = rows * k * heights.iter().map(|&(_, h)| h).sum::<usize>();
    if work < GEMV_SERIAL_WORK || threads == 1 {
        run(0..total);
    } else {
        // One contiguous part of the pass a thread: each reads one stream, as the read
        // probe does, where jobs of 16 rows left each thread jumping between the
        // blocks rayon handed it. Batch-1 decode steps at 79-82 % of the bound against
        // 76-77 %; parts claimed in chunks, a thread done early taking the others' last
        // chunks, ran slower (docs/correctness-and-performance.md, "One part a thread").
        let parts = threads.min(total);
        let start = |p: usize| p * total / parts;
        team::for_each_share(parts, &|p| run(start(p)..start(p + 1)));
    }
    drop(guards);
    let mut ys = Vec::with_capacity(outs.len());
    for (mut yt, (n, _)) in outs.into_iter().zip(heights) {
        yt.truncate(n * rows);
        if rows == 1 {
            ys.push(yt);
            continue;
        }
        // To `[rows, n]`: one pass reading the output-major buffer in order (candle's
        // strided copy of the transposed view was 4 % of a batch-16 decode step).
        let mut y = vec![0f32; n * rows];
        for (i, yr) in yt.chunks_exact(rows).enumerate() {
            for (r, &v) in yr.iter().enumerate() {
                y[r * n + i] = v;
            }
        }
        ys.push(y);
    }
    Ok(Some(ys))
}

/// Rows of `w` (`[m, k]`) dotted with each of the `rows` input rows `xs`, into `ys`
/// (`[m, rows]`). One weight row at a time, so that a block is read as one sequential
/// stream (four rows side by side read slower: docs/correctness-and-performance.md);
/// the row stays in cache for the other input rows.
fn gemv_block(avx: bool, w: &[f32], xs: &[f32], k: usize, rows: usize, ys: &mut [f32]) {
    for (yr, wr) in ys.chunks_exact_mut(rows).zip(w.chunks_exact(k)) {
        for (y, xr) in yr.iter_mut().zip(xs.chunks_exact(k)) {
            *y = crate::attention::paged::dot_row_with(avx, wr, xr);
        }
    }
}

/// [`gemv_block`] over packed groups of four rows (`w`: whole groups, `ys`: `[4 ·
/// groups, rows]`): each group is one stream read once, in cache for the other input
/// rows; the same results to the bit as the row layout's. `wide`: the 512-bit kernel
/// for more than [`GEMV_MAX_ROWS`] rows, four inputs a pass (the same results to the
/// bit as two a pass).
fn gemv_packed_block(
    avx: bool,
    wide: bool,
    w: &[f32],
    xs: &[f32],
    k: usize,
    rows: usize,
    ys: &mut [f32],
) {
    use crate::attention::paged::{dot4_packed_with, dot4x2_packed_with, dot4xn_packed_wide};
    let g = packed::GROUP;
    for (yg, wg) in ys.chunks_exact_mut(g * rows).zip(w.chunks_exact(g * k)) {
        let mut put = |r: usize, d: [f32; 4]| {
            for (j, v) in d.into_iter().enumerate() {
                yg[j * rows + r] = v;
            }
        };
        if rows <= GEMV_MAX_ROWS {
            // A decode batch of up to four: each row's outputs the same to the bit as
            // alone (and as the row layout's).
            for (r, xr) in xs.chunks_exact(k).enumerate() {
                put(r, dot4_packed_with(avx, wg, xr));
            }
        } else {
            // With `wide`, fours first: each row gets the sums a pair gives it.
            let fours = if wide { rows / 4 } else { 0 };
            for (q, quad) in xs.chunks_exact(4 * k).take(fours).enumerate() {
                let x: [&[f32]; 4] = std::array::from_fn(|j| &quad[j * k..(j + 1) * k]);
                for (j, d) in dot4xn_packed_wide(wg, x).into_iter().enumerate() {
                    put(4 * q + j, d);
                }
            }
            let done = 4 * fours;
            for (p, pair) in xs[done * k..].chunks(2 * k).enumerate() {
                let p = done / 2 + p;
                if pair.len() == 2 * k {
                    let [a, b] = dot4x2_packed_with(avx, wg, &pair[..k], &pair[k..]);
                    put(2 * p, a);
                    put(2 * p + 1, b);
                } else {
                    put(2 * p, dot4_packed_with(avx, wg, pair));
                }
            }
        }
    }
}

/// `silu(gate) · up`: on the forward's thread pool on the CPU, candle's operations
/// elsewhere.
fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if let Some(m) = elementwise::silu_mul(gate, up)? {
        return Ok(m);
    }
    Ok((candle_nn::ops::silu(gate)? * up)?)
}

/// [`Llama::activation_bytes`] from the shape alone (elements of `elem` bytes): the
/// cost model calls the same formula.
pub fn activation_bytes(c: &ModelConfig, elem: usize, tokens: usize, sampled: usize) -> u64 {
    let per_row = 2 * c.hidden_size
        + 2 * c.num_heads * c.head_dim
        + 2 * c.num_kv_heads * c.head_dim
        + 3 * c.intermediate_size;
    (tokens * per_row * elem + sampled * c.vocab_size * 4) as u64
}

pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub attn_norm: Tensor,
    pub ffn_norm: Tensor,
}

impl Layer {
    /// The layer's seven matrices, in the order of the forward.
    pub fn matrices(&self) -> [&Linear; 7] {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
    }

    /// [`Layer::matrices`], to change them.
    pub fn matrices_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
    }
}

/// One layer's fused projections: Q, K and V as one `[q + 2·kv, hidden]` matrix, whose
/// K and V rows are also one `[2, kv, hidden]` matrix, and gate and up as one `[2, ff,
/// hidden]`. A single row (a batch-1 decode step) takes Q, K and V in one product: its
/// output's column ranges are contiguous, one row being all there is. More rows take Q
/// alone and K/V as one batched product whose two outputs are contiguous
/// (`pair_product`), as gate/up always do. The layer's own `wq`, `wk`, `wv`, `gate` and
/// `up` are views into them, so nothing is held twice.
#[derive(Debug, Clone)]
struct Fused {
    qkv: Tensor,
    kv: Tensor,
    gate_up: Tensor,
}

/// `x·W₀ᵀ` and `x·W₁ᵀ` for the two halves of a `[2, n, k]` matrix as one batched
/// product: `x` (`[t, k]`) is broadcast over the pair without a copy, and each output
/// (`[t, n]`) is contiguous. One `[t, 2n]` product would leave both as column ranges,
/// so every elementwise operation after it (copies, `silu`, the product) would run
/// candle's strided kernels; on the H100 that made a 1,024-token prefill 25 % slower
/// (results/baselines/h100/NOTES.md).
/// Returns `[2, t, n]`: its two halves (`get(0)`, `get(1)`) are the products.
fn pair_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (t, k) = x.dims2()?;
    Ok(x.unsqueeze(0)?.broadcast_as((2, t, k))?.matmul(&w.t()?)?)
}

/// `x · wᵀ` by candle (cuBLAS on CUDA): `w` `[n, k]`, or a `[2, n, k]` pair with `x`
/// broadcast over it ([`pair_product`]). The model's dense products where kvbench's
/// matrix-vector kernel does not take them, and what `verify` and `bench-decode`
/// compare that kernel with.
pub(crate) fn candle_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if w.rank() == 3 {
        return pair_product(x, w);
    }
    Ok(x.matmul(&w.t()?)?)
}

/// Whether `KVBENCH_GEMV` asks for kvbench's matrix-vector kernel (`kvbench`) rather
/// than cuBLAS's products (unset or `cublas`); any other value is an error naming it.
pub fn gemv_chosen() -> Result<bool> {
    let (on, _) = crate::parse_switch(
        "KVBENCH_GEMV",
        std::env::var("KVBENCH_GEMV").ok().as_deref(),
        &[("cublas", false), ("kvbench", true)],
        false,
        "cuBLAS's products",
    )
    .map_err(crate::error::Error::Config)?;
    Ok(on)
}

/// Which of a layer's elementwise operations run in kvbench's fused CUDA kernels
/// (`KVBENCH_FUSED_KERNELS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FusedKernels {
    /// candle's operations.
    Off,
    /// Residual add + RMSNorm and SwiGLU fused; RoPE by candle.
    NoRope,
    /// Those and RoPE of the queries and keys in one kernel.
    All,
}

#[derive(Debug, Clone)]
pub struct Llama {
    pub cfg: ModelConfig,
    pub weight_dtype: WeightDtype,
    /// The token embedding table `[vocab, hidden]`: dense, or packed with the output
    /// head tied to it ([`Llama::with_packed_rows`]), whose products read it far more
    /// often than the lookups do.
    embed: Linear,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Per layer, the projections that share an input as one matrix each (see
    /// [`Llama::with_fused_projections`]); `None` when they run one by one.
    fused: Option<Vec<Fused>>,
    /// The layer's elementwise work in fused CUDA kernels (residual add + RMSNorm,
    /// SwiGLU's product, RoPE of queries and keys; see [`Llama::with_fused_kernels`]).
    fused_kernels: FusedKernels,
    inv_freq: Vec<f32>,
    device: Device,
    /// Whether a step of a few rows on the CPU may run with its rows in buffers of the
    /// forward's own ([`Llama::forward_rows`]; off: the tensor path, which it matches).
    rows_path: bool,
    /// On CUDA with bf16 weights, whether the products of a step of up to
    /// `cuda::GEMV_MAX_ROWS` rows run in kvbench's matrix-vector kernel instead of
    /// cuBLAS's ([`Llama::with_gemv`]).
    gemv: bool,
}

impl Llama {
    pub fn new(
        cfg: ModelConfig,
        weight_dtype: WeightDtype,
        embed: Tensor,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Linear,
    ) -> Self {
        let device = embed.device().clone();
        Self::assemble(
            cfg,
            weight_dtype,
            Linear::Dense(embed),
            layers,
            norm,
            lm_head,
            device,
        )
    }

    fn assemble(
        cfg: ModelConfig,
        weight_dtype: WeightDtype,
        embed: Linear,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Linear,
        device: Device,
    ) -> Self {
        let inv_freq = rope_inv_freq(&cfg);
        Self {
            cfg,
            weight_dtype,
            embed,
            layers,
            norm,
            lm_head,
            fused: None,
            fused_kernels: FusedKernels::Off,
            gemv: false,
            inv_freq,
            device,
            rows_path: true,
        }
    }

    /// The same model with the rows path of small CPU steps on or off (off: every step
    /// through tensors; tests check one against the other).
    pub fn with_rows_path(mut self, on: bool) -> Self {
        self.rows_path = on;
        self
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The same model with dense weights in f32: exact for f16/bf16 weights, so the
    /// 16-bit model's rounding can be measured against it. Quantized matrices stay.
    pub fn to_f32(&self) -> Result<Llama> {
        let lin = |l: &Linear| -> Result<Linear> {
            Ok(match l {
                Linear::Dense(w) => Linear::Dense(w.to_dtype(DType::F32)?),
                q => q.clone(),
            })
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    wq: lin(&l.wq)?,
                    wk: lin(&l.wk)?,
                    wv: lin(&l.wv)?,
                    wo: lin(&l.wo)?,
                    gate: lin(&l.gate)?,
                    up: lin(&l.up)?,
                    down: lin(&l.down)?,
                    attn_norm: l.attn_norm.to_dtype(DType::F32)?,
                    ffn_norm: l.ffn_norm.to_dtype(DType::F32)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_dtype = match self.weight_dtype {
            WeightDtype::Quantized => WeightDtype::Quantized,
            _ => WeightDtype::F32,
        };
        Ok(Llama::assemble(
            self.cfg.clone(),
            weight_dtype,
            lin(&self.embed)?,
            layers,
            self.norm.to_dtype(DType::F32)?,
            lin(&self.lm_head)?,
            self.device.clone(),
        ))
    }

    pub fn dtype(&self) -> DType {
        self.weight_dtype.compute()
    }

    /// The embedding and the dense matrices moved into one buffer of huge pages
    /// ([`pages::in_one_huge_buffer`]); a head tied to the embedding stays tied. The
    /// model's own handles are given up first, so each matrix is freed once copied.
    pub fn with_weights_in_huge_pages(self) -> Result<Self> {
        let Llama {
            cfg,
            weight_dtype,
            embed,
            layers,
            norm,
            lm_head,
            fused,
            fused_kernels,
            gemv,
            inv_freq,
            device,
            rows_path,
        } = self;
        let tied = lm_head.same_as(&embed);
        // Dense matrices are handed over; quantized ones wait here, in order.
        let mut ts = Vec::new();
        let mut kept: Vec<Linear> = Vec::new();
        // What became of each matrix, in order.
        enum Moved {
            Dense,
            Packed((usize, usize)),
            Kept,
        }
        let mut order: Vec<Moved> = Vec::new();
        // A packed matrix hands over its packed floats (its shape is noted in `order`).
        let mut hand = |l: Linear, ts: &mut Vec<Tensor>| match l {
            Linear::Dense(w) => {
                order.push(Moved::Dense);
                ts.push(w)
            }
            Linear::Packed(p) => {
                order.push(Moved::Packed(p.dims()));
                ts.push(p.data().clone())
            }
            q => {
                order.push(Moved::Kept);
                kept.push(q)
            }
        };
        hand(embed, &mut ts);
        let mut norms = Vec::with_capacity(layers.len());
        for l in layers {
            for w in [l.wq, l.wk, l.wv, l.wo, l.gate, l.up, l.down] {
                hand(w, &mut ts);
            }
            norms.push((l.attn_norm, l.ffn_norm));
        }
        if tied {
            drop(lm_head);
        } else {
            hand(lm_head, &mut ts);
        }
        let mut moved = pages::in_one_huge_buffer(ts)?.into_iter();
        let mut kept = kept.into_iter();
        let missing = || crate::error::Error::Config("a weight went missing".into());
        let mut order = order.into_iter();
        let mut next = || -> Result<Linear> {
            Ok(match order.next().ok_or_else(missing)? {
                Moved::Dense => Linear::Dense(moved.next().ok_or_else(missing)?),
                Moved::Packed((n, k)) => Linear::Packed(PackedRows::from_packed(
                    moved.next().ok_or_else(missing)?,
                    n,
                    k,
                )?),
                Moved::Kept => kept.next().ok_or_else(missing)?,
            })
        };
        let embed = next()?;
        let mut layers = Vec::with_capacity(norms.len());
        for (attn_norm, ffn_norm) in norms {
            layers.push(Layer {
                wq: next()?,
                wk: next()?,
                wv: next()?,
                wo: next()?,
                gate: next()?,
                up: next()?,
                down: next()?,
                attn_norm,
                ffn_norm,
            });
        }
        let lm_head = if tied { embed.clone() } else { next()? };
        let model = Llama {
            cfg,
            weight_dtype,
            embed,
            layers,
            norm,
            lm_head,
            fused: None,
            fused_kernels,
            gemv,
            inv_freq,
            device,
            rows_path,
        };
        // The fused matrices were not moved: fuse the moved ones again.
        if fused.is_some() {
            model.fuse_projections()
        } else {
            Ok(model)
        }
    }

    /// On the CPU, when the layers' matrices take at least [`PACK_MIN_LAYER_BYTES`]
    /// (more than a cache holds), every dense f32 matrix packed for the matrix-vector
    /// path ([`packed`]: one stream per block of four rows, which a batch-1 decode step
    /// reads 7–20 points of the read probe faster than rows one after another). A head
    /// tied to the embedding is packed with it: the lookups unpack their rows.
    /// `KVBENCH_PACKED_WEIGHTS=0` keeps the row layout everywhere (the "before" of a
    /// comparison in one sitting); `=1` or unset packs, anything else is an error.
    pub fn with_packed_rows(self) -> Result<Self> {
        let var = "KVBENCH_PACKED_WEIGHTS";
        let value = std::env::var(var).ok();
        let (pack, _) = crate::parse_switch(
            var,
            value.as_deref(),
            &[("0", false), ("1", true)],
            true,
            "packed",
        )
        .map_err(crate::error::Error::Config)?;
        // Layers whose matrices stay in cache are not streamed from memory, and the
        // layout's unpacking would only add work (the tiny preset's prefill).
        let layer_bytes: u64 = self
            .layers
            .iter()
            .flat_map(Layer::matrices)
            .map(Linear::bytes)
            .sum();
        if pack && layer_bytes >= PACK_MIN_LAYER_BYTES {
            self.pack_rows()
        } else {
            Ok(self)
        }
    }

    /// [`Llama::with_packed_rows`] whatever the environment says. A model with fused
    /// projections (views of shared matrices) is returned as it is.
    pub fn pack_rows(mut self) -> Result<Self> {
        if self.fused.is_some() || !self.device.is_cpu() {
            return Ok(self);
        }
        let pack = |l: &mut Linear| -> Result<()> {
            if let Linear::Dense(w) = l {
                if let Some(p) = PackedRows::from_tensor(w)? {
                    *l = Linear::Packed(p);
                }
            }
            Ok(())
        };
        for l in &mut self.layers {
            for w in l.matrices_mut() {
                pack(w)?;
            }
        }
        // A tied head is packed with its embedding table, and stays tied: the lookups
        // unpack their rows ([`PackedRows::rows`]).
        let tied = self.lm_head.same_as(&self.embed);
        pack(&mut self.lm_head)?;
        if tied {
            self.embed = self.lm_head.clone();
        }
        Ok(self)
    }

    /// Every packed matrix back in the row layout (new tensors; the inverse of
    /// [`Llama::pack_rows`]).
    pub fn unpack_rows(mut self) -> Result<Self> {
        for l in &mut self.layers {
            for w in l.matrices_mut() {
                *w = w.unpacked()?;
            }
        }
        let tied = self.lm_head.same_as(&self.embed);
        self.lm_head = self.lm_head.unpacked()?;
        self.embed = if tied {
            self.lm_head.clone()
        } else {
            self.embed.unpacked()?
        };
        Ok(self)
    }

    /// Whether any matrix is packed ([`Llama::with_packed_rows`]).
    pub fn rows_packed(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.wq, Linear::Packed(_)))
    }

    /// On CUDA, [`Llama::fuse_projections`]. Elsewhere the model is returned as it is:
    /// the CPU runs products that share an input as one pass already
    /// (`Linear::forward_many`). `KVBENCH_FUSED_PROJECTIONS=0` keeps the separate
    /// products of earlier builds on CUDA too (a fallback, and the "before" of a
    /// comparison in one sitting); `=1` fuses on every device (to test the fused path,
    /// and `kvbench verify`'s check of it, on a CPU).
    pub fn with_fused_projections(self) -> Result<Self> {
        let fuse = match std::env::var("KVBENCH_FUSED_PROJECTIONS").as_deref() {
            Ok("0") => false,
            Ok("1") => true,
            _ => self.device.is_cuda(),
        };
        if fuse {
            self.fuse_projections()
        } else {
            Ok(self)
        }
    }

    /// Q, K and V stacked into one matrix per layer, and gate and up, in the spirit of
    /// vLLM's merged linear layers: fewer launches, which matters most at small batch,
    /// where each product is a matrix-vector pass and the small K and V matrices read
    /// well below the memory's rate. A single row runs Q, K and V as one product (its
    /// output's column ranges are contiguous); more rows run Q alone and K/V as one
    /// batched product, since column ranges of several rows are strided and every
    /// operation after them would take candle's strided kernels ([`pair_product`]).
    /// Gate and up are always one batched product. The separate matrices become views
    /// into the fused ones. A model with any quantized projection among the five is
    /// returned unfused.
    pub fn fuse_projections(mut self) -> Result<Self> {
        if self.fused.is_some() {
            return Ok(self);
        }
        // Packed matrices go back to the row layout: the fused ones are gemm's.
        for l in &mut self.layers {
            for w in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.gate, &mut l.up] {
                if matches!(w, Linear::Packed(_)) {
                    *w = w.unpacked()?;
                }
            }
        }
        let dense = |l: &Linear| match l {
            Linear::Dense(w) => Some(w.clone()),
            Linear::Quantized { .. } | Linear::Packed(_) => None,
        };
        // Every layer's five fused matrices (handles, no copy), or None if any is
        // quantized.
        let Some(parts) = self
            .layers
            .iter()
            .map(|l| {
                Some([
                    dense(&l.wq)?,
                    dense(&l.wk)?,
                    dense(&l.wv)?,
                    dense(&l.gate)?,
                    dense(&l.up)?,
                ])
            })
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(self);
        };
        // Layer by layer, each layer's handles dropped once it is fused, so the separate
        // matrices of one layer are freed before the next: the load holds one layer's
        // projections twice at most.
        let mut fused = Vec::with_capacity(self.layers.len());
        for (l, [q, k, v, g, u]) in self.layers.iter_mut().zip(parts) {
            let (nq, nk) = (q.dim(0)?, k.dim(0)?);
            let qkv = Tensor::cat(&[&q, &k, &v], 0)?;
            let f = Fused {
                kv: qkv.narrow(0, nq, 2 * nk)?.reshape((2, nk, ()))?,
                qkv,
                gate_up: Tensor::stack(&[&g, &u], 0)?,
            };
            l.wq = Linear::Dense(f.qkv.narrow(0, 0, nq)?);
            l.wk = Linear::Dense(f.kv.get(0)?);
            l.wv = Linear::Dense(f.kv.get(1)?);
            l.gate = Linear::Dense(f.gate_up.get(0)?);
            l.up = Linear::Dense(f.gate_up.get(1)?);
            fused.push(f);
        }
        self.fused = Some(fused);
        Ok(self)
    }

    /// Whether the projections that share an input run as one product each.
    pub fn projections_fused(&self) -> bool {
        self.fused.is_some()
    }

    /// On CUDA with bf16 weights, the layer's elementwise work in fused kernels: the
    /// residual add with the RMSNorm after it, SwiGLU's `silu(gate) · up` on the
    /// batched gate/up product, and RoPE of the queries and keys together
    /// (`cuda::add_rms_norm`, `cuda::silu_mul`, `cuda::rope_pair`): four launches fewer
    /// per layer, each checked against an f64 reference by `kvbench verify`.
    /// `KVBENCH_FUSED_KERNELS=0` keeps candle's operations (the fallback, and the
    /// "before" of a comparison in one sitting); `no-rope` all but the RoPE kernel
    /// (the fallback should it fail on a card; it passed on an H100); any other
    /// value is an error. Elsewhere the model is returned as it is.
    pub fn with_fused_kernels(mut self) -> Result<Self> {
        let (choice, _) = crate::parse_switch(
            "KVBENCH_FUSED_KERNELS",
            std::env::var("KVBENCH_FUSED_KERNELS").ok().as_deref(),
            &[
                ("0", FusedKernels::Off),
                ("1", FusedKernels::All),
                ("no-rope", FusedKernels::NoRope),
            ],
            FusedKernels::All,
            "every fused kernel",
        )
        .map_err(crate::error::Error::Config)?;
        let applies = cfg!(feature = "cuda")
            && self.device.is_cuda()
            && self.weight_dtype.compute() == DType::BF16;
        self.fused_kernels = if applies { choice } else { FusedKernels::Off };
        Ok(self)
    }

    /// Whether the layer's elementwise work runs in fused kernels.
    pub fn kernels_fused(&self) -> bool {
        self.fused_kernels != FusedKernels::Off
    }

    /// On CUDA with bf16 weights, the products of a step of up to `cuda::GEMV_MAX_ROWS`
    /// rows (a decode step at small batch) in kvbench's matrix-vector kernel when
    /// `KVBENCH_GEMV=kvbench`; unset or `cublas`, cuBLAS's through candle (the default
    /// until the kernel has been measured against it on a card). Any other value is an
    /// error; elsewhere the model is returned as it is.
    pub fn with_gemv(self) -> Result<Self> {
        Ok(self.with_products_in_gemv(gemv_chosen()?))
    }

    /// The same model with the few-row products in kvbench's kernel (`true`, where it
    /// applies: CUDA, bf16) or cuBLAS's: `kvbench verify` compares one with the other.
    pub fn with_products_in_gemv(mut self, on: bool) -> Self {
        self.gemv = on
            && cfg!(feature = "cuda")
            && self.device.is_cuda()
            && self.weight_dtype.compute() == DType::BF16;
        self
    }

    /// Whether a step's few-row products run in kvbench's matrix-vector kernel.
    pub fn products_in_gemv(&self) -> bool {
        self.gemv
    }

    /// `x · wᵀ` of a dense matrix `w` (`[n, k]`; or a stack `[g, nb, k]` with `x`
    /// broadcast over it, `[g, t, nb]`, as [`pair_product`]): kvbench's matrix-vector
    /// kernel where the model runs its products there and the kernel takes them,
    /// candle's product otherwise.
    fn dense_product(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.gemv {
            if let Some(y) = crate::cuda::gemv(x, w)? {
                return Ok(y);
            }
        }
        candle_product(x, w)
    }

    /// `l`'s product: [`Llama::dense_product`] for a dense matrix, [`Linear::forward`]
    /// otherwise.
    fn product(&self, l: &Linear, x: &Tensor) -> Result<Tensor> {
        match l {
            Linear::Dense(w) if self.gemv => self.dense_product(x, w),
            _ => l.forward(x),
        }
    }

    /// `x + r` (when given) and the RMSNorm of it: one CUDA kernel with fused kernels
    /// on; elsewhere the add on the CPU's thread pool ([`elementwise`]) or candle's,
    /// then candle's RMSNorm.
    fn add_norm(
        &self,
        x: Tensor,
        r: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let (true, Some(r)) = (self.kernels_fused(), r) {
            if let Some(pair) = crate::cuda::add_rms_norm(&x, r, w, eps)? {
                return Ok(pair);
            }
        }
        // The add and the norm in one pass over the rows, where they are f32.
        if let Some(pair) = elementwise::add_rms_norm(&x, r, w, eps)? {
            return Ok(pair);
        }
        let x = match r {
            Some(r) => match elementwise::add(&x, r)? {
                Some(sum) => sum,
                None => (x + r)?,
            },
            None => x,
        };
        let h = candle_nn::ops::rms_norm(&x, w, eps)?;
        Ok((x, h))
    }

    /// `silu(gate) · up` from the batched gate/up product (`[2, t, ff]`): one CUDA
    /// kernel with fused kernels on, [`silu_mul`] otherwise.
    fn swiglu_pair(&self, y: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels_fused() {
            if let Some(m) = crate::cuda::silu_mul(y)? {
                return Ok(m);
            }
        }
        silu_mul(&y.get(0)?, &y.get(1)?)
    }

    /// The same weights with the projections run one by one (the layers' matrices are
    /// views of the fused ones, so nothing is copied): the reference the fused
    /// products are verified against.
    pub fn with_separate_projections(&self) -> Llama {
        let mut m = self.clone();
        m.fused = None;
        m
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// Token embedding table `[vocab, hidden]`, dense or packed with its tied head.
    pub fn embed(&self) -> &Linear {
        &self.embed
    }

    /// Whether the output head is the embedding table itself.
    pub fn head_tied(&self) -> bool {
        self.lm_head.same_as(&self.embed)
    }

    /// The embedding rows of `ids` (`[T]` u32 on the model's device): `[T, hidden]`.
    fn embed_rows(&self, ids: &Tensor) -> Result<Tensor> {
        match &self.embed {
            Linear::Dense(t) => Ok(t.index_select(ids, 0)?),
            Linear::Packed(p) => p.rows(&ids.to_vec1::<u32>()?),
            Linear::Quantized { .. } => Err(crate::error::Error::Config(
                "a quantized embedding table cannot be looked up".into(),
            )),
        }
    }

    /// Final RMSNorm weight.
    pub fn final_norm(&self) -> &Tensor {
        &self.norm
    }

    pub fn lm_head(&self) -> &Linear {
        &self.lm_head
    }

    /// Bytes of all weights as held (quantized sizes for quantized matrices; a tied
    /// quantized head counts separately from the dense embedding table).
    pub fn weights_bytes(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.matrices().iter().map(|w| w.bytes()).sum::<u64>()
                    + tensor_bytes(&l.attn_norm)
                    + tensor_bytes(&l.ffn_norm)
            })
            .sum();
        let head = if self.head_tied() {
            0
        } else {
            self.lm_head.bytes()
        };
        layers + self.embed.bytes() + tensor_bytes(&self.norm) + head
    }

    /// Activation bytes alive at the peak of one step of `tokens` rows of which
    /// `sampled` produce logits: residual, normed input, q/k/v, attention output,
    /// SwiGLU gate/up/product and the f32 logits. Computed from shapes.
    pub fn activation_bytes(&self, tokens: usize, sampled: usize) -> u64 {
        activation_bytes(&self.cfg, self.dtype().size_in_bytes(), tokens, sampled)
    }

    /// cos/sin `[T, dh/2]` for the given positions.
    fn rope_tables(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let (cos, sin) = self.rope_rows(positions);
        let t = positions.len();
        let dt = self.dtype();
        Ok((
            Tensor::from_vec(cos, (t, half), &self.device)?.to_dtype(dt)?,
            Tensor::from_vec(sin, (t, half), &self.device)?.to_dtype(dt)?,
        ))
    }

    /// RoPE on `[T, nh, dh]`.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if !x.device().is_cpu() && !self.cfg.rope_interleaved {
            // On the GPU the [T, nh, dh] layout goes to the kernel as it is: four
            // transposing copies per layer fewer than the head-major path below.
            let x = x.contiguous()?.unsqueeze(0)?;
            return Ok(candle_nn::rotary_emb::rope_thd(&x, cos, sin)?.squeeze(0)?);
        }
        // In the layout it comes in (no transposing copies), where it is f32.
        if let Some(y) = elementwise::rope(&x.contiguous()?, cos, sin, self.cfg.rope_interleaved)? {
            return Ok(y);
        }
        let x = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
        let y = if self.cfg.rope_interleaved {
            candle_nn::rotary_emb::rope_i(&x, cos, sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, cos, sin)?
        };
        Ok(y.squeeze(0)?.transpose(0, 1)?.contiguous()?)
    }

    /// RoPE on the queries and the keys: one CUDA kernel for both with fused kernels on
    /// (non-interleaved RoPE), [`Llama::rope`] on each otherwise.
    fn rope_qk(
        &self,
        q: &Tensor,
        k: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if self.fused_kernels == FusedKernels::All && !self.cfg.rope_interleaved {
            if let Some(pair) = crate::cuda::rope_pair(q, k, cos, sin)? {
                return Ok(pair);
            }
        }
        Ok((self.rope(q, cos, sin)?, self.rope(k, cos, sin)?))
    }

    /// One forward step over packed rows. `positions[i]` is the absolute position of
    /// `tokens[i]`; `sample_rows` are the rows whose logits are returned (`[S, vocab]`, f32).
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[u32],
        batch: &StepBatch,
        sample_rows: &[u32],
        policy: &mut dyn KvPolicy,
    ) -> Result<Tensor> {
        if self.rows_path_fits(tokens.len()) {
            return self.forward_rows(tokens, positions, batch, sample_rows, policy);
        }
        self.forward_with(tokens, positions, sample_rows, &mut |input| {
            policy.attend(batch, input)
        })
    }

    /// Whether [`Llama::forward_rows`] can run a step of `t` rows: on the CPU, matrices
    /// (not fused) that all take the matrix-vector path at `t` rows, f32 norms. Any
    /// policy: one that does not take rows gets its layer inputs as tensors.
    fn rows_path_fits(&self, t: usize) -> bool {
        let fits = |l: &Linear| l.mat().is_some_and(|m| m.takes(t));
        self.rows_path
            && self.device.is_cpu()
            && self.fused.is_none()
            && t >= 1
            && elementwise::cpu_f32(&self.norm)
            && fits(&self.lm_head)
            && self.layers.iter().all(|l| {
                l.matrices().into_iter().all(fits)
                    && [&l.attn_norm, &l.ffn_norm].into_iter().all(|w| {
                        elementwise::cpu_f32(w)
                            && w.is_contiguous()
                            && w.dims() == [self.cfg.hidden_size]
                    })
            })
    }

    /// [`Llama::forward`] of a step of a few rows on the CPU (a decode batch, a short
    /// prompt chunk) with its rows in buffers of the forward's own: the same kernels on
    /// the same values in the same order as the tensor path, so the same logits to the
    /// bit (a test checks), without the tensors, storage locks and allocations that each
    /// of a layer's dozen operations makes there, which took about 0.6 ms of a 22 ms
    /// batch-1 step of SmolLM2 at 576 tokens (docs/correctness-and-performance.md, "A
    /// small step's rows in buffers of the forward's own"). A policy that takes rows
    /// ([`KvPolicy::takes_rows`]) attends on them; any other gets its [`LayerInput`] as
    /// tensors made from them (a few small copies a layer), so every strategy's step
    /// runs the same products, norms and RoPE.
    fn forward_rows(
        &self,
        tokens: &[u32],
        positions: &[u32],
        batch: &StepBatch,
        sample_rows: &[u32],
        policy: &mut dyn KvPolicy,
    ) -> Result<Tensor> {
        use candle_core::{CpuStorage, Storage};
        let c = &self.cfg;
        let t = tokens.len();
        let eps = c.rms_norm_eps as f32;
        let (cos, sin) = self.rope_rows(positions);
        let (q_row, k_row) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let takes_rows = policy.takes_rows();
        // Not met: `rows_path_fits` checked every matrix before the step.
        let missing = || {
            crate::error::Error::Config(
                "the rows path met a matrix outside the CPU's f32 matrix-vector path".into(),
            )
        };
        let products = |ls: &[&Linear], xs: &[f32]| -> Result<Vec<Vec<f32>>> {
            let ms: Option<Vec<Mat<'_>>> = ls.iter().map(|l| l.mat()).collect();
            gemv_rows(&ms.ok_or_else(missing)?, xs, t)?.ok_or_else(missing)
        };
        let mut x = self
            .embed_rows(&Tensor::new(tokens, &self.device)?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // The previous layer's MLP output, added to the residual with the next norm.
        let mut pending: Option<Vec<f32>> = None;
        for (li, l) in self.layers.iter().enumerate() {
            let (sa, la) = l.attn_norm.storage_and_layout();
            let (sf, lf) = l.ffn_norm.storage_and_layout();
            let (Storage::Cpu(CpuStorage::F32(da)), Storage::Cpu(CpuStorage::F32(df))) =
                (&*sa, &*sf)
            else {
                return Err(missing());
            };
            let attn_norm = &da[la.start_offset()..][..c.hidden_size];
            let ffn_norm = &df[lf.start_offset()..][..c.hidden_size];
            let (xn, h) = elementwise::add_rms_norm_rows(&x, pending.as_deref(), attn_norm, eps);
            x = xn;
            let Ok([mut q, mut k, v]) =
                <[Vec<f32>; 3]>::try_from(products(&[&l.wq, &l.wk, &l.wv], &h)?)
            else {
                return Err(missing());
            };
            let raw = (!takes_rows).then(|| (q.clone(), k.clone()));
            elementwise::rope_rows(&mut q, q_row, &cos, &sin, c.rope_interleaved);
            elementwise::rope_rows(&mut k, k_row, &cos, &sin, c.rope_interleaved);
            let a = match raw {
                None => policy.attend_rows(batch, li, (&q, &k, &v))?,
                Some((q_raw, k_raw)) => {
                    let dev = &self.device;
                    let heads =
                        |r: Vec<f32>, n: usize| Tensor::from_vec(r, (t, n, c.head_dim), dev);
                    let x = Tensor::from_slice(&h, (t, c.hidden_size), dev)?;
                    let (q, k, v) = (
                        heads(q, c.num_heads)?,
                        heads(k, c.num_kv_heads)?,
                        heads(v, c.num_kv_heads)?,
                    );
                    let (q_raw, k_raw) =
                        (heads(q_raw, c.num_heads)?, heads(k_raw, c.num_kv_heads)?);
                    let a = policy.attend(
                        batch,
                        &LayerInput {
                            layer: li,
                            x: &x,
                            q: &q,
                            k: &k,
                            v: &v,
                            q_raw: &q_raw,
                            k_raw: &k_raw,
                            positions,
                            rope: self,
                            rope_rows: None,
                        },
                    )?;
                    a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
                }
            };
            let o = products(&[&l.wo], &a)?.pop().ok_or_else(missing)?;
            let (xn, h) = elementwise::add_rms_norm_rows(&x, Some(&o), ffn_norm, eps);
            x = xn;
            let Ok([gate, up]) = <[Vec<f32>; 2]>::try_from(products(&[&l.gate, &l.up], &h)?) else {
                return Err(missing());
            };
            let act = elementwise::silu_mul_rows(&gate, &up);
            pending = Some(products(&[&l.down], &act)?.pop().ok_or_else(missing)?);
        }
        let dev = &self.device;
        let x = Tensor::from_vec(x, (t, c.hidden_size), dev)?;
        let pending = pending
            .map(|p| Tensor::from_vec(p, (t, c.hidden_size), dev))
            .transpose()?;
        self.logits(x, pending, sample_rows)
    }

    /// Reference: the whole sequence without a cache, plain causal attention.
    /// Returns logits for every position, `[T, vocab]`.
    pub fn forward_dense(&self, tokens: &[u32]) -> Result<Tensor> {
        let positions: Vec<u32> = (0..tokens.len() as u32).collect();
        self.forward_with(tokens, &positions, &positions, &mut |i| {
            Ok(causal_attention(i.q, i.k, i.v)?)
        })
    }

    /// As [`Llama::forward_dense`], calling `observe` with every layer's input before
    /// its attention (calibration: InfiniGen's skewing records the queries). Returns
    /// the last position's logits only (`[1, vocab]`): calibration texts are long.
    pub fn forward_observe(
        &self,
        tokens: &[u32],
        observe: &mut dyn FnMut(&LayerInput<'_>) -> Result<()>,
    ) -> Result<Tensor> {
        let positions: Vec<u32> = (0..tokens.len() as u32).collect();
        let last = [positions.len().saturating_sub(1) as u32];
        self.forward_with(tokens, &positions, &last, &mut |i| {
            observe(i)?;
            Ok(causal_attention(i.q, i.k, i.v)?)
        })
    }

    fn forward_with(
        &self,
        tokens: &[u32],
        positions: &[u32],
        sample_rows: &[u32],
        attend: &mut AttendFn<'_>,
    ) -> Result<Tensor> {
        let ids = Tensor::new(tokens, &self.device)?;
        let (cos, sin) = self.rope_tables(positions)?;
        self.forward_inputs(&ids, (&cos, &sin), positions, sample_rows, false, attend)
    }

    /// [`Llama::forward`] from inputs already on the model's device: token ids `ids`
    /// (`[T]` u32) and their RoPE rows `cos`/`sin` (`[T, dh/2]` in the model's dtype),
    /// every row's logits returned (`[T, vocab]` f32). Nothing is read from the host
    /// (`positions` only reaches the policy's `attend`), so a CUDA graph can capture it
    /// and replay it over new values in the same buffers. `policy_rotates`: the policy
    /// takes queries and keys without RoPE ([`KvPolicy::rotates_on_write`]).
    pub fn forward_device(
        &self,
        ids: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        positions: &[u32],
        policy_rotates: bool,
        attend: &mut AttendFn<'_>,
    ) -> Result<Tensor> {
        let all: Vec<u32> = (0..ids.dim(0)? as u32).collect();
        self.forward_inputs(ids, (cos, sin), positions, &all, policy_rotates, attend)
    }

    /// The f32 cos and sin rows of `positions` (`[T, dh/2]` each, row-major).
    pub fn rope_rows(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        Rope::tables(self, positions)
    }

    fn forward_inputs(
        &self,
        ids: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        positions: &[u32],
        sample_rows: &[u32],
        policy_rotates: bool,
        attend: &mut AttendFn<'_>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = ids.dim(0)?;
        let eps = c.rms_norm_eps as f32;
        let mut x = self.embed_rows(ids)?;
        let (cos, sin) = (cos.clone(), sin.clone());
        // The queries and keys left to the policy where it asked and the model would
        // have rotated them in its own fused kernel (which the policy's replaces).
        let leave_rope =
            policy_rotates && self.fused_kernels == FusedKernels::All && !self.cfg.rope_interleaved;
        // The previous layer's MLP output, added to the residual together with the
        // next norm (one kernel where `add_norm` fuses them).
        let mut pending: Option<Tensor> = None;
        for (li, l) in self.layers.iter().enumerate() {
            let fused = self.fused.as_ref().map(|f| &f[li]);
            let (xn, h) = self.add_norm(x, pending.take().as_ref(), &l.attn_norm, eps)?;
            x = xn;
            let [q_raw, k_raw, v] = match fused {
                Some(f) if t == 1 => {
                    // One product; each column range of a single row is contiguous.
                    let y = self.dense_product(&h, &f.qkv)?;
                    let (nq, nk) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
                    [
                        y.narrow(1, 0, nq)?,
                        y.narrow(1, nq, nk)?,
                        y.narrow(1, nq + nk, nk)?,
                    ]
                }
                Some(f) => {
                    let y = self.dense_product(&h, &f.kv)?;
                    [self.product(&l.wq, &h)?, y.get(0)?, y.get(1)?]
                }
                None => Linear::forward_many([&l.wq, &l.wk, &l.wv], &h)?,
            };
            let q_raw = q_raw.reshape((t, c.num_heads, c.head_dim))?;
            let k_raw = k_raw.reshape((t, c.num_kv_heads, c.head_dim))?;
            let v = v.reshape((t, c.num_kv_heads, c.head_dim))?;
            let (q, k) = if leave_rope {
                (q_raw.clone(), k_raw.clone())
            } else {
                self.rope_qk(&q_raw, &k_raw, &cos, &sin)?
            };
            let a = attend(&LayerInput {
                layer: li,
                x: &h,
                q: &q,
                k: &k,
                v: &v,
                q_raw: &q_raw,
                k_raw: &k_raw,
                positions,
                rope: self,
                rope_rows: leave_rope.then_some((&cos, &sin)),
            })?;
            let a = self.product(&l.wo, &a.reshape((t, c.num_heads * c.head_dim))?)?;
            let (xn, h) = self.add_norm(x, Some(&a), &l.ffn_norm, eps)?;
            x = xn;
            let act = match fused {
                Some(f) => self.swiglu_pair(&self.dense_product(&h, &f.gate_up)?)?,
                None => {
                    let [gate, up] = Linear::forward_many([&l.gate, &l.up], &h)?;
                    silu_mul(&gate, &up)?
                }
            };
            pending = Some(self.product(&l.down, &act)?);
        }
        self.logits(x, pending, sample_rows)
    }

    /// The step's logits from the last layer's residual `x` and its MLP output
    /// `pending`: the sampled rows' final norm and head.
    fn logits(
        &self,
        mut x: Tensor,
        pending: Option<Tensor>,
        sample_rows: &[u32],
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = x.dim(0)?;
        let eps = c.rms_norm_eps as f32;
        if sample_rows.is_empty() {
            // No logits this step (a prompt chunk that does not end its prompt). A CUDA
            // device cannot allocate an empty buffer, so the empty result lives on the CPU.
            return Ok(Tensor::zeros((0, c.vocab_size), DType::F32, &Device::Cpu)?);
        }
        if let Some(m) = pending {
            x = (x + m)?;
        }
        // Every row sampled in order (a decode step): no gather, and no upload of the
        // row list (which a CUDA graph could not capture).
        let every_row =
            sample_rows.len() == t && sample_rows.iter().zip(0u32..).all(|(&r, i)| r == i);
        let x = if every_row {
            x
        } else {
            x.index_select(&Tensor::new(sample_rows, &self.device)?, 0)?
        };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self.product(&self.lm_head, &x)?.to_dtype(DType::F32)?)
    }
}

impl Rope for Llama {
    fn rotate(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor> {
        let (cos, sin) = self.rope_tables(positions)?;
        self.rope(x, &cos, &sin)
    }

    fn tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let mut cos = Vec::with_capacity(positions.len() * self.inv_freq.len());
        let mut sin = Vec::with_capacity(cos.capacity());
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }

    fn interleaved(&self) -> bool {
        self.cfg.rope_interleaved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fused K/V and gate/up products give the separate products' logits (within f32
    /// and bf16 rounding: another matmul shape sums in another order) for one token and
    /// several, hold no extra bytes, keep the separate matrices as views of the fused
    /// ones, and survive the move into one buffer. On the CPU the loader leaves models
    /// unfused (`with_fused_projections`).
    #[test]
    fn fused_projections_keep_the_logits() {
        use crate::model::load::load_preset;
        for (wd, tol) in [(WeightDtype::F32, 1e-4f32), (WeightDtype::Bf16, 2e-2)] {
            let cfg = crate::config::preset("tiny").unwrap();
            // Packed matrices (f32) go back to the row layout to be fused.
            let m = load_preset(cfg, wd, 11, &Device::Cpu)
                .unwrap()
                .pack_rows()
                .unwrap();
            assert!(!m.projections_fused(), "the CPU loader does not fuse");
            assert!(
                !m.clone().with_fused_kernels().unwrap().kernels_fused(),
                "the fused kernels are CUDA's"
            );
            assert!(
                !m.clone().with_products_in_gemv(true).products_in_gemv(),
                "the few-row products' kernel is CUDA's"
            );
            let f = m.clone().fuse_projections().unwrap();
            assert!(f.projections_fused());
            assert_eq!(f.weights_bytes(), m.weights_bytes());
            let Linear::Dense(wv) = &f.layers[1].wv else {
                panic!("dense")
            };
            assert!(
                wv.layout().start_offset() > 0,
                "wv is a view of the fused matrix"
            );
            // Each view is the matrix it replaced.
            let dense = |l: &Layer| {
                [&l.wq, &l.wk, &l.wv, &l.gate, &l.up].map(|w| match w {
                    Linear::Dense(t) => t.to_dtype(DType::F32).unwrap().flatten_all().unwrap(),
                    Linear::Packed(p) => p.unpack().unwrap().flatten_all().unwrap(),
                    Linear::Quantized { .. } => panic!("dense"),
                })
            };
            for (x, y) in dense(&m.layers[1]).iter().zip(dense(&f.layers[1]).iter()) {
                assert_eq!(x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap());
            }
            for tokens in [&[5u32][..], &[1, 2, 3, 4, 5, 6, 7, 8, 9]] {
                let a = m.forward_dense(tokens).unwrap();
                let b = f.forward_dense(tokens).unwrap();
                let scale = a
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                let d = d.to_scalar::<f32>().unwrap();
                assert!(
                    d.is_finite() && d <= tol * scale,
                    "{wd:?} {} tokens: {d} of {scale}",
                    tokens.len()
                );
            }
            let moved = f.clone().with_weights_in_huge_pages().unwrap();
            assert!(moved.projections_fused());
            let d = (f.forward_dense(&[3, 4]).unwrap() - moved.forward_dense(&[3, 4]).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        }
    }

    /// The forward from device inputs (what a CUDA graph captures: ids and RoPE rows
    /// already in tensors, every row sampled without a gather) gives the forward's
    /// logits exactly, and sampling a subset still gathers those rows.
    #[test]
    fn forward_from_device_inputs_is_the_forward() {
        use crate::model::load::load_preset;
        for wd in [WeightDtype::F32, WeightDtype::Bf16] {
            let cfg = crate::config::preset("tiny").unwrap();
            let m = load_preset(cfg, wd, 5, &Device::Cpu).unwrap();
            let tokens = [7u32, 3, 9, 1, 4];
            let positions: Vec<u32> = (0..tokens.len() as u32).collect();
            let dense = m.forward_dense(&tokens).unwrap();
            let ids = Tensor::new(&tokens[..], &Device::Cpu).unwrap();
            let (c, s) = m.rope_rows(&positions);
            let half = c.len() / tokens.len();
            let table = |v: Vec<f32>| {
                Tensor::from_vec(v, (tokens.len(), half), &Device::Cpu)
                    .unwrap()
                    .to_dtype(m.dtype())
                    .unwrap()
            };
            let (cos, sin) = (table(c), table(s));
            let mut causal = |i: &LayerInput<'_>| Ok(causal_attention(i.q, i.k, i.v)?);
            let out = m
                .forward_device(&ids, (&cos, &sin), &positions, false, &mut causal)
                .unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(out.dims(), dense.dims());
            assert!(
                flat(&out) == flat(&dense),
                "{wd:?}: not the forward's logits"
            );
            let some = m
                .forward_with(&tokens, &positions, &[1, 4], &mut causal)
                .unwrap();
            // Two rows take another product path than five (the CPU's matrix-vector
            // form), so the sums round differently: equal within rounding.
            let tol = if wd == WeightDtype::F32 { 1e-5 } else { 2e-2 };
            for (i, r) in [(0, 1), (1, 4)] {
                let (a, b) = (flat(&some.get(i).unwrap()), flat(&dense.get(r).unwrap()));
                let d = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(a.len() == b.len() && d <= tol, "{wd:?} row {r}: {d}");
            }
        }
    }

    /// Both outputs of the batched pair product are contiguous (so the elementwise
    /// operations after it take candle's contiguous kernels) and equal the two
    /// separate products, at one row and at several.
    #[test]
    fn pair_product_gives_two_contiguous_products() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (2, 6, 5), &dev).unwrap();
        for t in [1, 7] {
            let x = Tensor::randn(0f32, 1.0, (t, 5), &dev).unwrap();
            let y = pair_product(&x, &w).unwrap();
            for (i, y) in [y.get(0).unwrap(), y.get(1).unwrap()]
                .into_iter()
                .enumerate()
            {
                assert!(y.is_contiguous(), "output {i} at {t} rows");
                assert_eq!(y.dims(), &[t, 6]);
                let want = x.matmul(&w.get(i).unwrap().t().unwrap()).unwrap();
                let d = (y - want).unwrap().abs().unwrap().max_all().unwrap();
                assert!(
                    d.to_scalar::<f32>().unwrap() <= 1e-5,
                    "output {i} at {t} rows"
                );
            }
        }
    }

    /// Moving the weights into one buffer keeps every logit, the head's tie to the
    /// embedding (or its absence) and the bytes counted; bf16 matrices stay where they
    /// were.
    #[test]
    fn weights_in_one_buffer_keep_the_logits_and_the_tie() {
        use crate::model::load::load_preset;
        // (Quantized matrices come from GGUF files only: tests/smollm2.rs loads them.)
        for (tie, wd) in [
            (true, WeightDtype::F32),
            (false, WeightDtype::F32),
            (true, WeightDtype::Bf16),
        ] {
            let mut cfg = crate::config::preset("tiny").unwrap();
            cfg.tie_word_embeddings = tie;
            let m = load_preset(cfg, wd, 7, &Device::Cpu)
                .unwrap()
                .pack_rows()
                .unwrap();
            let before = m.forward_dense(&[1, 2, 3, 4]).unwrap();
            let moved = m.clone().with_weights_in_huge_pages().unwrap();
            assert_eq!(m.head_tied(), tie, "tie {tie} {wd:?}");
            assert_eq!(moved.head_tied(), tie, "tie {tie} {wd:?}");
            assert_eq!(moved.weights_bytes(), m.weights_bytes());
            let after = moved.forward_dense(&[1, 2, 3, 4]).unwrap();
            let d = (before - after).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "tie {tie} {wd:?}");
            if wd == WeightDtype::F32 {
                // The packed matrices are views of one buffer, the head among them
                // (tied, it is the embedding table, packed with it).
                assert!(
                    matches!(&moved.layers[0].wq, Linear::Packed(p) if p.data().layout().start_offset() > 0)
                );
                assert!(matches!(&moved.lm_head, Linear::Packed(_)));
                assert_eq!(matches!(moved.embed(), Linear::Packed(_)), tie);
            }
        }
    }

    /// A model with packed matrices gives the row layout's logits: to the bit where
    /// the matrix-vector path runs (up to four rows), within gemm's rounding on more
    /// rows (blocks of rows, so other sums); `KVBENCH_PACKED_WEIGHTS=0`'s model is the
    /// row layout's.
    #[test]
    fn packed_rows_keep_the_logits() {
        use crate::model::load::load_preset;
        for tie in [true, false] {
            let mut cfg = crate::config::preset("tiny").unwrap();
            cfg.tie_word_embeddings = tie;
            let m = load_preset(cfg, WeightDtype::F32, 3, &Device::Cpu).unwrap();
            assert!(
                !m.rows_packed(),
                "tiny's matrices fit in a cache: not packed"
            );
            let m = m.pack_rows().unwrap();
            assert!(m.rows_packed());
            assert_eq!(m.head_tied(), tie);
            let rows = m.clone().unpack_rows().unwrap();
            assert!(!rows.rows_packed());
            assert_eq!(rows.head_tied(), tie);
            assert!(matches!(rows.embed(), Linear::Dense(_)));
            assert_eq!(
                rows.weights_bytes(),
                m.weights_bytes(),
                "tiny's rows come in fours"
            );
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for tokens in [&[5u32][..], &[1, 2, 3, 4], &[9; 40], &[2; 70]] {
                let (a, b) = (
                    flat(m.forward_dense(tokens).unwrap()),
                    flat(rows.forward_dense(tokens).unwrap()),
                );
                if tokens.len() <= GEMV_MAX_ROWS {
                    assert!(a == b, "tie {tie}, {} tokens: other bits", tokens.len());
                } else {
                    let d = crate::compare::max_abs_diff(a.into_iter().zip(b));
                    assert!(d <= 1e-4, "tie {tie}, {} tokens: {d}", tokens.len());
                }
            }
        }
    }

    /// Small steps with their rows in the forward's own buffers (the rows path) give
    /// the tensor path's logits to the bit: prompts of 3 rows, 40 (the rows path where
    /// the matrices are packed) and 1,100 (tensors, both), then decode steps of one to
    /// three sequences, one of them past a thousand tokens (attention's keys split over
    /// the threads). `full` (which attends on the rows) with the matrices in rows and
    /// packed, on one thread and on a team of three; every other CPU strategy (its
    /// layer inputs made into tensors from the rows) packed, on three threads.
    #[test]
    fn rows_path_gives_the_tensor_paths_logits_to_the_bit() {
        use crate::model::load::load_preset;
        use crate::policy::spec::{PolicyEnv, PolicySpec};
        let mut cfg = crate::config::preset("tiny").unwrap();
        // Products large enough to be split over the team.
        cfg.hidden_size = 256;
        cfg.intermediate_size = 1024;
        cfg.head_dim = 64;
        let base = load_preset(cfg.clone(), WeightDtype::F32, 7, &Device::Cpu).unwrap();
        let skewing = std::sync::Arc::new(
            crate::policy::infinigen::skew::calibrate(
                &base,
                &(0..64).map(|i| (i * 11 + 3) % 100).collect::<Vec<u32>>(),
            )
            .unwrap(),
        );
        // Name, budget and at most one parameter (`key=value`).
        let strategies = [
            ("full", 1.0, ""),
            ("h2o", 0.3, ""),
            ("streaming", 0.3, "rolling_positions=true"),
            ("snapkv", 0.3, ""),
            ("quest", 0.3, ""),
            ("kivi", 1.0, ""),
            ("infinigen", 0.3, ""),
            ("hybrid", 0.3, ""),
        ];
        for (name, budget, param) in strategies {
            let params: Vec<(String, String)> = param
                .split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into_iter()
                .collect();
            let mut spec = PolicySpec::parse(name, budget, &params).unwrap();
            if spec.needs_skewing() {
                spec.set_skewing(skewing.clone());
            }
            let combos: &[(bool, usize)] = if name == "full" {
                &[(false, 1), (false, 3), (true, 1), (true, 3)]
            } else {
                &[(true, 3)]
            };
            for &(packed, threads) in combos {
                let rows = if packed {
                    base.clone().pack_rows().unwrap()
                } else {
                    base.clone()
                };
                let tensors = rows.clone().with_rows_path(false);
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut pa = spec.build(&rows, PolicyEnv::cpu_for_tests()).unwrap();
                let mut pb = spec.build(&tensors, PolicyEnv::cpu_for_tests()).unwrap();
                assert_eq!(pa.takes_rows(), name == "full");
                let prompts: [(u64, Vec<u32>); 3] = [
                    (1, vec![3, 1, 4]),
                    (2, (0..40).map(|i| (i * 7 + 1) % 100).collect()),
                    (3, (0..1100).map(|i| (i * 13 + 5) % 100).collect()),
                ];
                let mut ctx = [0usize; 3];
                let mut next = [0u32; 3];
                let step = |seqs: &[(usize, Vec<u32>)],
                            pa: &mut dyn KvPolicy,
                            pb: &mut dyn KvPolicy,
                            ctx: &mut [usize; 3],
                            next: &mut [u32; 3]| {
                    let mut batch = StepBatch::default();
                    let (mut tokens, mut positions) = (Vec::new(), Vec::new());
                    let mut sample = Vec::new();
                    for (i, toks) in seqs {
                        // As the scheduler does: room for the step's tokens first.
                        let (id, n) = (prompts[*i].0, ctx[*i] + toks.len());
                        assert!(pa.reserve(id, n).unwrap() && pb.reserve(id, n).unwrap());
                        batch.push(id, ctx[*i], toks.len());
                        positions.extend((ctx[*i]..ctx[*i] + toks.len()).map(|p| p as u32));
                        tokens.extend(toks);
                        sample.push((tokens.len() - 1) as u32);
                    }
                    let t = tokens.len();
                    let most = if packed {
                        PACKED_GEMV_MAX_ROWS
                    } else {
                        GEMV_MAX_ROWS
                    };
                    assert_eq!(rows.rows_path_fits(t), t <= most);
                    assert!(!tensors.rows_path_fits(t));
                    let run = |m: &Llama, p: &mut dyn KvPolicy| {
                        pool.install(|| {
                            team::run_awake(|| m.forward(&tokens, &positions, &batch, &sample, p))
                        })
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                    };
                    let (a, b) = (run(&rows, pa), run(&tensors, pb));
                    assert!(a.iter().all(|x| x.is_finite()));
                    let same = a.len() == b.len()
                        && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{name}: packed {packed}, {threads} threads, {t} rows: other bits"
                    );
                    let vocab = a.len() / seqs.len();
                    for ((i, toks), l) in seqs.iter().zip(a.chunks_exact(vocab)) {
                        ctx[*i] += toks.len();
                        next[*i] =
                            (0..vocab).max_by(|&x, &y| l[x].total_cmp(&l[y])).unwrap() as u32;
                    }
                };
                for (i, (_, p)) in prompts.iter().enumerate() {
                    step(
                        &[(i, p.clone())],
                        pa.as_mut(),
                        pb.as_mut(),
                        &mut ctx,
                        &mut next,
                    );
                }
                for n in [1, 2, 3, 3, 1] {
                    let seqs: Vec<(usize, Vec<u32>)> =
                        (3 - n..3).map(|i| (i, vec![next[i]])).collect();
                    step(&seqs, pa.as_mut(), pb.as_mut(), &mut ctx, &mut next);
                }
            }
        }
    }

    /// The matrix-vector path against candle's matmul, on random inputs whose sizes are
    /// not multiples of the SIMD width or of the thread blocks; packed, the same
    /// outputs to the bit as the row layout's.
    #[test]
    fn gemv_matches_matmul() {
        let dev = Device::Cpu;
        // Heights with whole and partial blocks and groups of four rows; widths with
        // and without a whole chunk of 16 and of 8; a weight that is a view at an
        // offset into a larger buffer (the weights in huge pages).
        for (n, k) in [(70, 96), (4, 8), (133, 37)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            let big = Tensor::randn(0f32, 1.0, n * k + 5, &dev).unwrap();
            let view = big.narrow(0, 5, n * k).unwrap().reshape((n, k)).unwrap();
            for w in [w, view] {
                for rows in 1..=GEMV_MAX_ROWS {
                    let x = Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap();
                    let y = gemv(&w, &x).unwrap().expect("gemv applies");
                    assert_eq!(y.dims(), &[rows, n]);
                    let want = x.matmul(&w.t().unwrap()).unwrap();
                    let (y, want) = (
                        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    let diff = crate::compare::max_abs_diff(y.iter().copied().zip(want));
                    assert!(diff <= 1e-4, "{n}×{k}, rows {rows}: {diff}");
                    let p = PackedRows::from_tensor(&w).unwrap().unwrap();
                    let yp = gemv_many(&[Mat::Packed(&p)], &x).unwrap().expect("applies");
                    assert_eq!(yp[0].dims(), &[rows, n]);
                    let yp = yp[0].flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    assert!(yp == y, "{n}×{k}, rows {rows}: packed gives other bits");
                }
                // Packed, more rows take the path too (two inputs at a time, an odd one
                // alone), up to its limit.
                let p = PackedRows::from_tensor(&w).unwrap().unwrap();
                for rows in [GEMV_MAX_ROWS + 1, 8, PACKED_GEMV_MAX_ROWS] {
                    let x = Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap();
                    let y = gemv_many(&[Mat::Packed(&p)], &x).unwrap().expect("applies");
                    let want = x.matmul(&w.t().unwrap()).unwrap();
                    assert_eq!(y[0].dims(), want.dims());
                    let diff = crate::compare::max_abs_diff_tensors(&y[0], &want);
                    assert!(diff <= 1e-4, "packed {n}×{k}, rows {rows}: {diff}");
                }
                let x = Tensor::randn(0f32, 1.0, (PACKED_GEMV_MAX_ROWS + 1, k), &dev).unwrap();
                assert!(gemv_many(&[Mat::Packed(&p)], &x).unwrap().is_none());
            }
        }
        let (n, k) = (133, 37);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        // More rows than it takes, or a transposed weight: gemm runs instead.
        let x = Tensor::randn(0f32, 1.0, (GEMV_MAX_ROWS + 1, k), &dev).unwrap();
        assert!(gemv(&w, &x).unwrap().is_none());
        let x = Tensor::randn(0f32, 1.0, (1, n), &dev).unwrap();
        assert!(gemv(&w.t().unwrap(), &x).unwrap().is_none());
    }

    /// The 512-bit packed kernel (four inputs a pass) gives each input row the bits
    /// the two-a-pass kernel gives it, for row counts that leave a pair, an odd row or
    /// both after the fours, and widths with and without a tail past the last chunk of
    /// 8. A CPU without AVX-512F and DQ has no wide kernel to compare; the test says so.
    #[test]
    fn wide_packed_products_match_two_at_a_time_to_the_bit() {
        use crate::attention::paged::{has_avx2_fma, has_avx512};
        if !has_avx512() {
            eprintln!("wide_packed_products_match_two_at_a_time_to_the_bit: no AVX-512F/DQ here");
            return;
        }
        let dev = Device::Cpu;
        for (n, k) in [(36, 576), (12, 1536), (20, 44), (8, 8)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            let p = packed::pack(&w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), n, k);
            for rows in [5, 6, 7, 8, 9, 10, 11, 16, 17] {
                let xs = Tensor::randn(0f32, 1.0, (rows, k), &dev)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let mut pairs = vec![0f32; n.next_multiple_of(4) * rows];
                let mut fours = pairs.clone();
                gemv_packed_block(has_avx2_fma(), false, &p, &xs, k, rows, &mut pairs);
                gemv_packed_block(true, true, &p, &xs, k, rows, &mut fours);
                assert!(pairs.iter().all(|x| x.is_finite()));
                let same = pairs
                    .iter()
                    .zip(&fours)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{n}×{k}, rows {rows}: the wide kernel gives other bits"
                );
            }
        }
    }

    /// A pass of several matrices split over 2 and 3 threads (one part a thread, on a
    /// forward's team and on the pool alone) gives every output the bits one thread
    /// gives it, in both layouts, the parts' bounds falling inside matrices of unequal
    /// heights.
    #[test]
    fn products_split_over_a_team_keep_the_bits() {
        let dev = Device::Cpu;
        let k = 256;
        let dense: Vec<Tensor> = [1002, 300, 70]
            .iter()
            .map(|&n| Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap())
            .collect();
        let packed: Vec<Linear> = dense
            .iter()
            .map(|w| Linear::Packed(PackedRows::from_tensor(w).unwrap().unwrap()))
            .collect();
        let dense: Vec<Linear> = dense.into_iter().map(Linear::Dense).collect();
        let pool = |n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        };
        for rows in [1, 3, 16] {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap();
            for ws in [&dense, &packed] {
                // Work enough to leave the calling thread (`GEMV_SERIAL_WORK`).
                assert!(rows * k * 1372 >= GEMV_SERIAL_WORK);
                if matches!(ws[0], Linear::Dense(_)) && rows > GEMV_MAX_ROWS {
                    continue;
                }
                let product = || Linear::forward_many([&ws[0], &ws[1], &ws[2]], &x).unwrap();
                let want = pool(1).install(product);
                for (threads, awake) in [(2, false), (2, true), (3, false), (3, true)] {
                    let got = pool(threads).install(|| {
                        if awake {
                            team::run_awake(product)
                        } else {
                            product()
                        }
                    });
                    for (g, w) in got.iter().zip(&want) {
                        let (g, w) = (
                            g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                            w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        );
                        assert!(w.iter().all(|v| v.is_finite()));
                        assert!(
                            g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "rows {rows}, {threads} threads, awake {awake}: other bits"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn products_of_one_input_in_one_pass_match_each_alone() {
        let dev = Device::Cpu;
        let k = 45;
        // Q, K, V of unequal heights, one not a multiple of the 64-row block.
        let ws: Vec<Linear> = [130, 64, 7]
            .iter()
            .map(|&n| Linear::Dense(Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap()))
            .collect();
        for rows in [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3] {
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev).unwrap();
            let got = Linear::forward_many([&ws[0], &ws[1], &ws[2]], &x).unwrap();
            for (g, l) in got.iter().zip(&ws) {
                let Linear::Dense(w) = l else { unreachable!() };
                let want = x.matmul(&w.t().unwrap()).unwrap();
                assert_eq!(g.dims(), want.dims());
                let diff = crate::compare::max_abs_diff_tensors(g, &want);
                assert!(diff <= 1e-4, "rows {rows}: {diff}");
            }
        }
    }
}
