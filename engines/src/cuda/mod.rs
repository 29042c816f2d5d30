//! CUDA kernels of kvbench (behind the `cuda` feature): paged K/V writes and gathers,
//! and paged decode attention reading K/V through block tables. `kernels.cu` is
//! compiled to PTX at build time (engines/build.rs) and loaded through candle's device.
//! [`check`] compares every kernel with the CPU reference on random inputs.

pub mod bench;
pub mod check;
#[cfg(any(feature = "flash-attn", feature = "flash-attn3"))]
pub mod flash_attn;
pub mod graph;

use crate::attention::prefill::ColumnStats;
use crate::error::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Shape, Storage, Tensor};
use half::bf16;

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
pub(crate) const MODULE: &str = "kvbench";
/// Threads per block of the decode partition kernel (four warps).
pub(crate) const DECODE_THREADS: u32 = 128;

/// The CUDA device behind a candle device, or a named error.
pub fn device_of(d: &candle_core::Device) -> Result<CudaDevice> {
    match d {
        candle_core::Device::Cuda(c) => Ok(c.clone()),
        other => Err(Error::Config(format!(
            "a CUDA kernel was called with a tensor on {other:?}"
        ))),
    }
}

/// Load (and so have the driver compile) the kvbench kernels' module now rather than
/// inside the first timed step.
pub fn load_kernels(d: &candle_core::Device) -> Result<()> {
    let dev = device_of(d)?;
    dev.get_or_load_custom_func("kv_write_bf16", MODULE, PTX)?;
    Ok(())
}

/// Total and free bytes of the device's memory, from the driver.
pub fn memory_info(dev: &CudaDevice) -> Result<(u64, u64)> {
    let (free, total) = dev.cuda_stream().context().mem_get_info().w()?;
    Ok((total as u64, free as u64))
}

/// Wait for all work queued on the device (phase boundaries of timed regions).
pub fn synchronize(dev: &CudaDevice) -> Result<()> {
    dev.cuda_stream().synchronize().w()?;
    Ok(())
}

/// Seconds between the two events of each pair, draining `events`; pairs whose time
/// cannot be read are counted in `errors`. Call once the events have completed (the
/// step's output was read back).
pub fn drain_event_seconds(events: &mut Vec<(CudaEvent, CudaEvent)>, errors: &mut u64) -> f64 {
    let mut s = 0.0;
    for (a, b) in events.drain(..) {
        match a.elapsed_ms(&b) {
            Ok(ms) => s += ms as f64 / 1e3,
            Err(_) => *errors += 1,
        }
    }
    s
}

/// A bf16 view of a contiguous CUDA tensor's elements.
pub(crate) fn view<'a>(s: &'a Storage, l: &Layout, what: &str) -> Result<CudaView<'a, bf16>> {
    view_of::<bf16>(s, l, what)
}

/// A view of a contiguous CUDA tensor's elements as `T` (its dtype).
pub(crate) fn view_of<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a Storage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(c) = s else {
        return Err(Error::Config(format!("{what}: expected a CUDA tensor")));
    };
    if !l.is_contiguous() {
        return Err(Error::Config(format!(
            "{what}: expected a contiguous tensor"
        )));
    }
    let start = l.start_offset();
    Ok(c.as_cuda_slice::<T>()?
        .slice(start..start + l.shape().elem_count()))
}

/// A step's attention output in row order: decode rows (`decode[i]` for sequence `i`)
/// are the consecutive rows of `dec`, prefill chunks come from `prefill`.
pub(crate) fn join_rows(
    batch: &crate::policy::StepBatch,
    decode: &[bool],
    dec: Option<&Tensor>,
    mut prefill: impl FnMut(crate::policy::StepSeq) -> Result<Tensor>,
) -> Result<Tensor> {
    let missing = || Error::Config("decode rows without output".into());
    let n_dec = decode.iter().filter(|&&d| d).count();
    if n_dec == batch.num_tokens {
        return dec.cloned().ok_or_else(missing);
    }
    let mut pieces = Vec::with_capacity(batch.seqs.len());
    let mut next_dec = 0;
    for (&s, &is_dec) in batch.seqs.iter().zip(decode) {
        if is_dec {
            pieces.push(dec.ok_or_else(missing)?.narrow(0, next_dec, 1)?);
            next_dec += 1;
        } else {
            pieces.push(prefill(s)?);
        }
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

pub(crate) fn check_bf16(t: &Tensor, what: &str) -> Result<()> {
    if t.dtype() != DType::BF16 {
        return Err(Error::Config(format!(
            "{what}: the CUDA kernels take bf16, got {:?}",
            t.dtype()
        )));
    }
    Ok(())
}

/// A tensor owning a device buffer.
pub fn tensor_from<S: Into<Shape>>(dev: &CudaDevice, s: CudaSlice<bf16>, shape: S) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Whether a contiguous bf16 tensor's elements start on a 16-byte boundary (the fused
/// kernels' vector loads).
fn aligned16(l: &Layout) -> bool {
    l.start_offset().is_multiple_of(8)
}

/// SwiGLU's product on the batched gate/up output (`[2, t, ff]` bf16, contiguous, gate
/// first): `silu(gate) · up` as `[t, ff]`, in one kernel where candle takes two (and
/// an intermediate). `None` where the kernel does not apply (ff not a multiple of 8,
/// an unaligned start): the caller takes candle's path.
pub fn silu_mul(gu: &Tensor) -> Result<Option<Tensor>> {
    let (two, t, ff) = gu.dims3()?;
    if two != 2 || gu.dtype() != DType::BF16 || !gu.is_contiguous() || !ff.is_multiple_of(8) {
        return Ok(None);
    }
    let dev = device_of(gu.device())?;
    let n = t * ff;
    if n == 0 {
        return Ok(None);
    }
    let (gs, gl) = gu.storage_and_layout();
    if !aligned16(gl) {
        return Ok(None);
    }
    let g = view(&gs, gl, "silu_mul gate/up")?;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(n)? };
    let f = dev.get_or_load_custom_func("silu_mul_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let n64 = n as i64;
    b.arg(&g).arg(&mut out).arg(&n64);
    let threads = 256u32;
    let blocks = (n / 8).div_ceil(threads as usize).clamp(1, 132 * 16) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop(gs);
    Ok(Some(tensor_from(&dev, out, (t, ff))))
}

/// RoPE (halves rotated together) on a step's queries `[t, H, D]` and keys `[t, KVH, D]`
/// in one kernel where candle takes one per tensor: `cos`/`sin` `[t, D/2]`, all bf16.
/// `None` where the kernel does not apply (other dtypes, shapes or layouts).
pub fn rope_pair(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    let (Ok((t, h, d)), Ok((tk, kvh, dk))) = (q.dims3(), k.dims3()) else {
        return Ok(None);
    };
    let usable = |u: &Tensor| u.dtype() == DType::BF16 && u.is_contiguous();
    if tk != t
        || dk != d
        || t == 0
        || !d.is_multiple_of(2)
        || cos.dims() != [t, d / 2]
        || sin.dims() != [t, d / 2]
        || ![q, k, cos, sin].into_iter().all(usable)
    {
        return Ok(None);
    }
    let dev = device_of(q.device())?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (cs, cl) = cos.storage_and_layout();
    let (ss, sl) = sin.storage_and_layout();
    let (qv, kv) = (view(&qs, ql, "rope q")?, view(&ks, kl, "rope k")?);
    let (cv, sv) = (view(&cs, cl, "rope cos")?, view(&ss, sl, "rope sin")?);
    // SAFETY: the kernel writes every element of both.
    let (mut qo, mut ko) = unsafe {
        (
            dev.alloc::<bf16>(t * h * d)?,
            dev.alloc::<bf16>(t * kvh * d)?,
        )
    };
    let f = dev.get_or_load_custom_func("rope_qk_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let (h_i, kvh_i, d_i) = (
        as_i32(h, "heads")?,
        as_i32(kvh, "KV heads")?,
        as_i32(d, "head dim")?,
    );
    b.arg(&qv)
        .arg(&kv)
        .arg(&cv)
        .arg(&sv)
        .arg(&mut qo)
        .arg(&mut ko)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(&d_i);
    // A thread per rotated pair (Llama-3.1-8B: 2,560 a row, ten blocks).
    const THREADS: usize = 256;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, ((h + kvh) * d / 2).div_ceil(THREADS) as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop((qs, ks, cs, ss));
    Ok(Some((
        tensor_from(&dev, qo, (t, h, d)),
        tensor_from(&dev, ko, (t, kvh, d)),
    )))
}

/// [`rope_pair`] and [`kv_write_at`] in one kernel: the queries `q` (`[t, H, D]`)
/// rotated and returned, the keys `k` (`[t, KVH, D]`) rotated and the values `v` copied
/// straight into `cache` at `slots` (one per row), with `cos`/`sin` `[t, D/2]`, all
/// bf16 and contiguous. The same bits as the two kernels; one launch a layer fewer in a
/// decode step of `full` replayed from a CUDA graph.
pub fn rope_write(
    cache: &mut LayerCache,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (cos, sin): (&Tensor, &Tensor),
    slots: &CudaSlice<i32>,
) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (tk, kvh, dk) = k.dims3()?;
    let usable = |u: &Tensor| u.dtype() == DType::BF16 && u.is_contiguous();
    if tk != t
        || dk != d
        || v.dims() != k.dims()
        || t == 0
        || d == 0
        || !d.is_multiple_of(2)
        || cos.dims() != [t, d / 2]
        || sin.dims() != [t, d / 2]
        || slots.len() < t
        || !cache.k.len().is_multiple_of(kvh * d)
        || ![q, k, v, cos, sin].into_iter().all(usable)
    {
        return Err(Error::Config(format!(
            "rope_write: q {:?}, k {:?}, v {:?}, cos {:?} (bf16, contiguous, one slot a row; \
             {} slots given)",
            q.dims(),
            k.dims(),
            v.dims(),
            cos.dims(),
            slots.len()
        )));
    }
    let dev = device_of(q.device())?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (cs, cl) = cos.storage_and_layout();
    let (ss, sl) = sin.storage_and_layout();
    let (qv, kv, vv) = (
        view(&qs, ql, "rope_write q")?,
        view(&ks, kl, "rope_write k")?,
        view(&vs, vl, "rope_write v")?,
    );
    let (cv, sv) = (
        view(&cs, cl, "rope_write cos")?,
        view(&ss, sl, "rope_write sin")?,
    );
    // SAFETY: the kernel writes every element.
    let mut qo = unsafe { dev.alloc::<bf16>(t * h * d)? };
    let f = dev.get_or_load_custom_func("rope_write_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let (h_i, kvh_i, d_i) = (
        as_i32(h, "heads")?,
        as_i32(kvh, "KV heads")?,
        as_i32(d, "head dim")?,
    );
    b.arg(&qv)
        .arg(&kv)
        .arg(&vv)
        .arg(&cv)
        .arg(&sv)
        .arg(&mut qo)
        .arg(&mut cache.k)
        .arg(&mut cache.v)
        .arg(slots)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(&d_i);
    const THREADS: usize = 256;
    let cfg = LaunchConfig {
        grid_dim: (
            t as u32,
            ((h + 2 * kvh) * d / 2).div_ceil(THREADS) as u32,
            1,
        ),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop((qs, ks, vs, cs, ss));
    Ok(tensor_from(&dev, qo, (t, h, d)))
}

/// Rolling positions: each decode row of `x` (`[R, H, D]` bf16) rotated to its cache's
/// last index, `params[4 r] - 1` (the row's kept slots with the new token, as the
/// evicting policies lay out their per-row parameters), by the rotation rows `cos`/`sin`
/// (`[indices, D/2]` f32, non-interleaved RoPE) the rolling decode kernel rotates keys
/// with. Nothing comes from the host, so a CUDA graph can replay it.
pub fn rope_last_index(
    x: &Tensor,
    params: &CudaSlice<i32>,
    cos: &CudaSlice<f32>,
    sin: &CudaSlice<f32>,
) -> Result<Tensor> {
    check_bf16(x, "rope_last_index x")?;
    let (r, h, d) = x.dims3()?;
    if r == 0 || d == 0 || !d.is_multiple_of(2) || params.len() < 4 * r {
        return Err(Error::Config(format!(
            "rope_last_index: {r} rows of head dim {d} with {} parameters",
            params.len()
        )));
    }
    let dev = device_of(x.device())?;
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let xv = view(&xs, xl, "rope_last_index x")?;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(r * h * d)? };
    let f = dev.get_or_load_custom_func("rope_last_index_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let (h_i, d_i) = (as_i32(h, "heads")?, as_i32(d, "head dim")?);
    let n_i = as_i32(cos.len().min(sin.len()) / (d / 2), "rotation rows")?;
    b.arg(&xv)
        .arg(params)
        .arg(cos)
        .arg(sin)
        .arg(&mut out)
        .arg(&h_i)
        .arg(&d_i)
        .arg(&n_i);
    const THREADS: usize = 256;
    let cfg = LaunchConfig {
        grid_dim: (r as u32, (h * d / 2).div_ceil(THREADS) as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop(xs);
    Ok(tensor_from(&dev, out, (r, h, d)))
}

/// The residual add and the RMSNorm after it, for every row in one kernel where candle
/// takes two: `(x + a, rms_norm(x + a) · w)`, both `[t, hidden]` bf16 (the sum rounded
/// to bf16 before the norm, as the separate add leaves it). `None` where the kernel
/// does not apply (hidden not a multiple of 8, other dtypes or layouts).
pub fn add_rms_norm(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    let (t, hidden) = x.dims2()?;
    let usable = |u: &Tensor| u.dtype() == DType::BF16 && u.is_contiguous();
    if a.dims() != x.dims()
        || w.dims() != [hidden]
        || !usable(x)
        || !usable(a)
        || !usable(w)
        || !hidden.is_multiple_of(8)
        || t == 0
    {
        return Ok(None);
    }
    let dev = device_of(x.device())?;
    let (xs, xl) = x.storage_and_layout();
    let (as_, al) = a.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    if !(aligned16(xl) && aligned16(al) && aligned16(wl)) {
        return Ok(None);
    }
    let (xv, av, wv) = (
        view(&xs, xl, "add_rms_norm x")?,
        view(&as_, al, "add_rms_norm residual")?,
        view(&ws, wl, "add_rms_norm weight")?,
    );
    // SAFETY: the kernel writes every element of both.
    let (mut xo, mut h) = unsafe {
        (
            dev.alloc::<bf16>(t * hidden)?,
            dev.alloc::<bf16>(t * hidden)?,
        )
    };
    let f = dev.get_or_load_custom_func("add_rms_norm_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let hid = as_i32(hidden, "hidden size")?;
    b.arg(&xv)
        .arg(&av)
        .arg(&wv)
        .arg(&mut xo)
        .arg(&mut h)
        .arg(&hid)
        .arg(&eps);
    // One row per block, a thread per 16-byte chunk up to 1,024 (4,096: 512 threads).
    let threads = ((hidden / 8).div_ceil(32) * 32).clamp(32, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop((xs, as_, ws));
    Ok(Some((
        tensor_from(&dev, xo, (t, hidden)),
        tensor_from(&dev, h, (t, hidden)),
    )))
}

/// Rows at most that [`gemv`] takes (`GEMV_MAX_ROWS` in kernels.cu: its accumulators).
pub const GEMV_MAX_ROWS: usize = 4;
/// Warps of a `gemv_bf16` block (`GEMV_WARPS` in kernels.cu).
const GEMV_WARPS: usize = 8;
/// Blocks of a `gemv_bf16` launch at most: eight per SM of a 132-SM card, each warp
/// then taking several matrix rows in turn (the head's 128K).
const GEMV_MAX_BLOCKS: usize = 132 * 8;

/// `x · Wᵀ` of a decode step's few rows in kvbench's matrix-vector kernel
/// (`gemv_bf16`) where cuBLAS's would run: `x` `[t, k]` with `w` `[n, k]` gives `[t, n]`;
/// with a stack `[g, nb, k]` (the K/V or gate/up pair), `x` broadcast over it, `[g, t,
/// nb]`, as candle's batched product. f32 sums rounded once, in another order than
/// cuBLAS's. `None` where the kernel does not apply: not CUDA, not bf16, more than
/// [`GEMV_MAX_ROWS`] rows, `k` not a multiple of 8, a tensor not contiguous or not
/// starting on 16 bytes.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.dtype() != DType::BF16 || w.dtype() != DType::BF16 {
        return Ok(None);
    }
    let Ok((t, k)) = x.dims2() else {
        return Ok(None);
    };
    let (g, nb, kw) = match *w.dims() {
        [n, k] => (1, n, k),
        [g, n, k] => (g, n, k),
        _ => return Ok(None),
    };
    let n = g * nb;
    if kw != k
        || t == 0
        || t > GEMV_MAX_ROWS
        || n == 0
        || !k.is_multiple_of(8)
        || !x.is_contiguous()
        || !w.is_contiguous()
    {
        return Ok(None);
    }
    let dev = device_of(x.device())?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    if !(aligned16(xl) && aligned16(wl)) {
        return Ok(None);
    }
    let (xv, wv) = (view(&xs, xl, "gemv input")?, view(&ws, wl, "gemv matrix")?);
    // SAFETY: the kernel writes every element (each of the n rows for each of the t inputs).
    let mut y = unsafe { dev.alloc::<bf16>(t * n)? };
    let f = dev.get_or_load_custom_func("gemv_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    let (n32, k32, t32, nb32) = (
        as_i32(n, "gemv rows")?,
        as_i32(k, "gemv width")?,
        as_i32(t, "gemv inputs")?,
        as_i32(nb, "gemv rows per matrix")?,
    );
    b.arg(&wv)
        .arg(&xv)
        .arg(&mut y)
        .arg(&n32)
        .arg(&k32)
        .arg(&t32)
        .arg(&nb32);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(GEMV_WARPS).min(GEMV_MAX_BLOCKS) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop((xs, ws));
    Ok(Some(if w.rank() == 2 {
        tensor_from(&dev, y, (t, nb))
    } else {
        tensor_from(&dev, y, (g, t, nb))
    }))
}

/// Which kernel makes the greedy choice on a CUDA device (`KVBENCH_ARGMAX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgmaxChoice {
    /// kvbench's [`argmax_rows`]: many blocks per row, then one warp per row.
    Kvbench,
    /// candle's `argmax` (one block per row): the fallback, and the "before".
    Candle,
}

/// [`ArgmaxChoice`] from the environment, read once per process; any other value is an
/// error naming it.
pub fn argmax_choice() -> Result<ArgmaxChoice> {
    static CHOICE: std::sync::OnceLock<std::result::Result<ArgmaxChoice, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_ARGMAX",
        &[("candle", ArgmaxChoice::Candle)],
        ArgmaxChoice::Kvbench,
        "kvbench's kernel",
    )
}

/// Blocks the greedy choice aims for over all rows: two per SM of a 132-SM card.
const ARGMAX_MIN_BLOCKS: usize = 264;
/// Threads of an `argmax_part_f32` block: `ARGMAX_THREADS` in kernels.cu, which sizes
/// the block's shared candidates by it.
const ARGMAX_THREADS: u32 = 256;
/// Logits a block scans at least (eight per thread).
const ARGMAX_MIN_CHUNK: usize = 2048;

/// Each row's greedy token of `logits` (`[rows, vocab]` on a CUDA device): the index of
/// its largest value, ties to the smallest index, NaN skipped (0 for a row of NaN
/// only), as the host's [`crate::engine::argmax_rows`]. Only the ids come back to the
/// host. A row is split over enough blocks to fill the card (candle's `argmax` scans a
/// row with one block).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 || vocab == 0 {
        return Ok(vec![0; rows]);
    }
    if rows > 65_535 {
        return Err(Error::Config(format!(
            "argmax over {rows} rows: at most 65,535 (the grid's second dimension)"
        )));
    }
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let dev = device_of(logits.device())?;
    let vocab_i = as_i32(vocab, "vocabulary")?;
    let parts = ARGMAX_MIN_BLOCKS
        .div_ceil(rows)
        .min(vocab.div_ceil(ARGMAX_MIN_CHUNK))
        .max(1);
    let chunk = vocab.div_ceil(parts);
    // No empty part: the last one starts before the end of the row.
    let parts = vocab.div_ceil(chunk);
    let (s, l) = logits.storage_and_layout();
    let x = view_of::<f32>(&s, l, "argmax logits")?;
    // SAFETY: the first kernel writes every candidate, the second every id.
    let (mut part_v, mut part_i, mut ids) = unsafe {
        (
            dev.alloc::<f32>(rows * parts)?,
            dev.alloc::<i32>(rows * parts)?,
            dev.alloc::<u32>(rows)?,
        )
    };
    let f = dev.get_or_load_custom_func("argmax_part_f32", MODULE, PTX)?;
    let mut b = f.builder();
    let chunk_i = as_i32(chunk, "argmax chunk")?;
    b.arg(&x)
        .arg(&vocab_i)
        .arg(&chunk_i)
        .arg(&mut part_v)
        .arg(&mut part_i);
    let cfg = LaunchConfig {
        grid_dim: (parts as u32, rows as u32, 1),
        block_dim: (ARGMAX_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop(s);
    let f = dev.get_or_load_custom_func("argmax_merge", MODULE, PTX)?;
    let mut b = f.builder();
    let parts_i = as_i32(parts, "argmax parts")?;
    b.arg(&part_v).arg(&part_i).arg(&parts_i).arg(&mut ids);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(dev.cuda_stream().clone_dtoh(&ids).w()?)
}

pub(crate) fn upload_i32(dev: &CudaDevice, v: &[i32]) -> Result<CudaSlice<i32>> {
    Ok(dev.cuda_stream().clone_htod(v).w()?)
}

pub(crate) fn as_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| Error::Config(format!("{what} = {x} exceeds the kernels' i32 range")))
}

/// K and V of one layer in a paged pool: `[num_slots, KVH, D]` bf16 each.
pub struct LayerCache {
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
}

impl LayerCache {
    pub fn new(dev: &CudaDevice, slots: usize, row_elems: usize) -> Result<Self> {
        Ok(Self {
            k: dev.alloc_zeros::<bf16>(slots * row_elems)?,
            v: dev.alloc_zeros::<bf16>(slots * row_elems)?,
        })
    }

    /// Grow to `slots` slots, keeping the stored rows (a pool grown on demand).
    pub fn grow(&mut self, dev: &CudaDevice, slots: usize, row_elems: usize) -> Result<()> {
        grow_slice(dev, &mut self.k, slots * row_elems)?;
        grow_slice(dev, &mut self.v, slots * row_elems)
    }
}

/// Grow `buf` to `len` elements (zeros past the old ones), its contents copied on the
/// device: how a pool reserved with `reservation=budget` grows. The old and the new
/// buffer coexist for the copy; nothing happens when `buf` is long enough.
pub fn grow_slice<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<()> {
    if len <= buf.len() {
        return Ok(());
    }
    let mut out = dev.alloc_zeros::<T>(len)?;
    dev.cuda_stream().memcpy_dtod(&*buf, &mut out).w()?;
    *buf = out;
    Ok(())
}

/// Blocks a device pool allocates at start-up: all of them under `fraction`; under
/// `budget` one (its buffers then grow as the pool does; CUDA has no empty allocation).
pub fn initial_blocks(reservation: crate::policy::spec::Reservation, limit: usize) -> usize {
    match reservation {
        crate::policy::spec::Reservation::Fraction => limit,
        crate::policy::spec::Reservation::Budget => limit.min(1),
    }
}

/// Write rows `k`, `v` (`[T, KVH, D]` bf16) to `slots` (one per row) of `cache`.
pub fn kv_write(cache: &mut LayerCache, k: &Tensor, v: &Tensor, slots: &[i32]) -> Result<()> {
    if k.dim(0)? == 0 {
        return Ok(());
    }
    let dev = device_of(k.device())?;
    kv_write_at(cache, k, v, &upload_i32(&dev, slots)?)
}

/// [`kv_write`] with the slots already on the device (a step uploads them once for
/// all its layers).
pub fn kv_write_at(
    cache: &mut LayerCache,
    k: &Tensor,
    v: &Tensor,
    slots: &CudaSlice<i32>,
) -> Result<()> {
    check_bf16(k, "kv_write k")?;
    let dev = device_of(k.device())?;
    let t = k.dim(0)?;
    if t == 0 {
        return Ok(());
    }
    if slots.len() < t {
        return Err(Error::Config(format!(
            "kv_write: {} slots for {t} rows",
            slots.len()
        )));
    }
    let row_elems = k.elem_count() / t;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let kv = view(&ks, kl, "kv_write k")?;
    let vv = view(&vs, vl, "kv_write v")?;
    let re = as_i32(row_elems, "KV row elements")?;
    let f = dev.get_or_load_custom_func("kv_write_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&kv)
        .arg(&vv)
        .arg(&mut cache.k)
        .arg(&mut cache.v)
        .arg(slots)
        .arg(&re);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (row_elems.min(1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The first `n` tokens of a sequence (block `table`) as contiguous `[n, KVH, D]` K and V.
pub fn kv_gather(
    dev: &CudaDevice,
    cache: &LayerCache,
    table: &[i32],
    n: usize,
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor)> {
    let row_elems = kv_heads * head_dim;
    let mut k = dev.alloc_zeros::<bf16>(n * row_elems)?;
    let mut v = dev.alloc_zeros::<bf16>(n * row_elems)?;
    if n > 0 {
        let table_d = upload_i32(dev, table)?;
        let (bs, re) = (
            as_i32(block_size, "block size")?,
            as_i32(row_elems, "KV row")?,
        );
        let f = dev.get_or_load_custom_func("kv_gather_bf16", MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&cache.k)
            .arg(&cache.v)
            .arg(&mut k)
            .arg(&mut v)
            .arg(&table_d)
            .arg(&bs)
            .arg(&re);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (row_elems.min(1024) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((
        tensor_from(dev, k, (n, kv_heads, head_dim)),
        tensor_from(dev, v, (n, kv_heads, head_dim)),
    ))
}

/// Shape of a paged decode launch.
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Keys per partition (flash-decoding split).
    pub part_size: usize,
}

/// Which partition kernel a paged decode launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeKernel {
    /// 16-byte loads, each K/V row read once for the whole query group, keys split
    /// across lanes and warps in both passes, four rows in flight per lane (rolling keys
    /// rotated as they are read): head dims 64 and 128, groups of up to 8.
    Vector,
    /// [`DecodeKernel::Vector`] with one row in flight per lane (earlier builds' form).
    VectorOneRow,
    /// The vector kernel's arithmetic over K/V tiles that the block stages through
    /// shared memory with `cp.async`, several tiles in flight a block: same shapes, not
    /// rolling keys.
    Pipelined,
    /// The group's query heads as the rows of tensor-core products (`mma.sync`): scores
    /// and output without per-lane multiply-adds or shuffles, K/V tiles staged through
    /// shared memory by `cp.async`: same shapes, not rolling keys.
    TensorCore,
    /// One warp per key with 2-byte loads, and one thread per output element walking
    /// the partition's keys: any shape, and keys rotated as they are read.
    Scalar,
}

/// Keys a tile of the pipelined decode kernel holds, and tiles in its ring (kernels.cu's
/// PIPE_TILE and PIPE_STAGES).
pub(crate) const PIPE_TILE: usize = 32;
pub(crate) const PIPE_STAGES: usize = 4;

impl DecodeKernel {
    /// The kernel `choice` asks for where it applies: the tensor-core or vector kernels
    /// for head dims 64 and 128 and groups of up to 8 (the tensor-core and pipelined ones
    /// not for rolling keys, which take the four-row vector kernel), the scalar kernel
    /// otherwise.
    pub fn choose(head_dim: usize, group: usize, choice: DecodeChoice, rolling: bool) -> Self {
        let k = match choice {
            DecodeChoice::Scalar => return Self::Scalar,
            DecodeChoice::Default | DecodeChoice::Pipelined | DecodeChoice::TensorCore
                if rolling =>
            {
                Self::Vector
            }
            other => Self::vector_form(other),
        };
        if k.applies(head_dim, group) {
            k
        } else {
            Self::Scalar
        }
    }

    /// The form of the fast kernels `choice` names for keys at their own positions (the
    /// tensor-core one for `Default`, the four-row vector one for `Scalar`): the one
    /// `kvbench verify` checks beside the scalar kernel.
    pub fn vector_form(choice: DecodeChoice) -> Self {
        match choice {
            DecodeChoice::Vector | DecodeChoice::Scalar => Self::Vector,
            DecodeChoice::VectorOneRow => Self::VectorOneRow,
            DecodeChoice::Pipelined => Self::Pipelined,
            DecodeChoice::Default | DecodeChoice::TensorCore => Self::TensorCore,
        }
    }

    pub fn applies(self, head_dim: usize, group: usize) -> bool {
        match self {
            Self::Vector | Self::VectorOneRow | Self::Pipelined | Self::TensorCore => {
                matches!(head_dim, 64 | 128) && (1..=8).contains(&group)
            }
            Self::Scalar => true,
        }
    }

    /// The name `kvbench verify` and the decode benchmark give it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Vector => "paged_decode (vector)",
            Self::VectorOneRow => "paged_decode (vector, 1 row)",
            Self::Pipelined => "paged_decode (pipelined)",
            Self::TensorCore => "paged_decode (mma)",
            Self::Scalar => "paged_decode (scalar)",
        }
    }

    /// Shared memory of one block (bytes) for a group of `group` heads of dim `d` and
    /// partitions of `part_size` keys.
    fn shared_bytes(self, group: usize, d: usize, part_size: usize) -> usize {
        let warps = DECODE_THREADS as usize / 32;
        match self {
            Self::Scalar => (group * d + group * part_size) * 4,
            Self::Vector | Self::VectorOneRow => (group * part_size + warps * group * d) * 4,
            // The warps' partial outputs reuse the ring (at most half of it: groups of
            // up to 8, tiles of 32 keys).
            Self::Pipelined => PIPE_STAGES * PIPE_TILE * d * 2 + group * part_size * 4,
            // 16 query rows and two 64-key tiles of K and of V, rows of d + 8 bf16
            // (kernels.cu's MmaDecodeSmem; the warps' merge reuses it).
            Self::TensorCore => (16 + 4 * 64) * (d + 8) * 2,
        }
    }
}

/// What `KVBENCH_PAGED_DECODE` asks for: unset, the tensor-core kernel (`mma`: on an
/// H200 it read K/V 1.3-2.2x as fast as the vector kernel alone and took `full`'s steps
/// at batch 16 and 64 after 1K-10K tokens to 1.51x and 1.62x the tokens a second), with
/// rolling keys on the four-row vector kernel; `vec`, the vector kernel with four K/V
/// rows in flight per lane (the default of earlier builds); `vec1`, the vector kernel
/// with one; `pipe`, the pipelined kernel (K/V tiles staged through shared memory;
/// 1.01-1.09x the vector kernel on an H100); `scalar`, the scalar kernel with the
/// callers' fixed partitions. The others are fallbacks should the default fail on a
/// card, and the "before" or "after" of a comparison in one sitting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeChoice {
    Default,
    Vector,
    VectorOneRow,
    Pipelined,
    TensorCore,
    Scalar,
}

/// [`DecodeChoice`] from the environment, read once per process (every layer of every
/// decode step asks); any other value is an error naming it.
pub fn decode_choice() -> Result<DecodeChoice> {
    static CHOICE: std::sync::OnceLock<std::result::Result<DecodeChoice, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_PAGED_DECODE",
        &[
            ("vec", DecodeChoice::Vector),
            ("vec1", DecodeChoice::VectorOneRow),
            ("pipe", DecodeChoice::Pipelined),
            ("mma", DecodeChoice::TensorCore),
            ("scalar", DecodeChoice::Scalar),
        ],
        DecodeChoice::Default,
        "the tensor-core kernel, rolling keys on the vector kernel",
    )
}

/// How a paged decode combines its partitions' outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeReduce {
    /// In the partition kernel: the last of a (row, KV head)'s partition blocks to finish
    /// reduces the group's heads (one launch a layer fewer; kernels.cu's `fold_reduce`).
    Folded,
    /// A second kernel after the partition pass (earlier builds' form).
    Launched,
}

impl DecodeReduce {
    pub fn label(self) -> &'static str {
        match self {
            Self::Folded => "folded",
            Self::Launched => "launched",
        }
    }
}

/// What `KVBENCH_DECODE_REDUCE` asks for: unset, the reduction folded into the partition
/// kernel; `launch`, launched after it (the fallback, and the "before" of a comparison
/// in one sitting). Read once per process; any other value is an error naming it.
pub fn decode_reduce() -> Result<DecodeReduce> {
    static CHOICE: std::sync::OnceLock<std::result::Result<DecodeReduce, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_DECODE_REDUCE",
        &[("launch", DecodeReduce::Launched)],
        DecodeReduce::Folded,
        "the reduction folded into the partition kernel",
    )
}

/// Largest query group the folded reduction takes (kernels.cu's FOLD_MAX_GROUP).
const FOLD_MAX_GROUP: usize = 16;
/// KV heads per row the arrival counters of [`DecodeTables`] hold: the reduction of a
/// model with more is launched.
const FOLD_KV_HEADS: usize = 64;

/// Blocks a decode launch aims for: two per SM of a 132-SM H100 or H200. With few rows
/// (batch 1) partitions shrink until rows × KV heads × partitions reaches it.
const DECODE_MIN_BLOCKS: usize = 264;

/// Keys per partition: at most `max`, fewer (a multiple of 64, at least 64) when
/// `row_heads` (rows × KV heads) blocks per partition would leave SMs idle.
pub(crate) fn partition_size(max: usize, row_heads: usize, max_ctx: usize) -> usize {
    let parts = DECODE_MIN_BLOCKS.div_ceil(row_heads.max(1));
    max_ctx
        .div_ceil(parts)
        .next_multiple_of(64)
        .clamp(64, max.max(64))
        .min(max)
}

/// Block tables and context lengths of a step's decode rows, on the device: built once
/// per step and used by every layer.
pub struct DecodeTables {
    pub(crate) tables: CudaSlice<i32>,
    pub(crate) ctx: CudaSlice<i32>,
    /// The folded reduction's arrival counters, [rows, FOLD_KV_HEADS], zero between
    /// launches (each launch's last blocks set theirs back): with the tables, so a CUDA
    /// graph's replays find them where its capture did.
    pub(crate) counters: CudaSlice<u32>,
    pub(crate) rows: usize,
    pub(crate) max_blocks: usize,
    pub(crate) max_ctx: usize,
}

impl DecodeTables {
    /// Whether every folded-reduction counter is back at zero: a fold whose last block
    /// never came (a count that misses the partitions) leaves one raised, where its
    /// output would be whatever the buffer held before. (`verify` and `bench-decode`.)
    pub fn counters_settled(&self, dev: &CudaDevice) -> Result<bool> {
        let c = dev.cuda_stream().clone_dtoh(&self.counters).w()?;
        Ok(c.iter().all(|&x| x == 0))
    }

    /// Row `r` attends the first `ctx[r]` tokens of the sequence with block `tables[r]`.
    pub fn new(dev: &CudaDevice, tables: &[Vec<i32>], ctx: &[usize]) -> Result<Self> {
        let max_ctx = ctx.iter().copied().max().unwrap_or(0);
        Self::with_max_ctx(dev, tables, ctx, max_ctx)
    }

    /// [`Self::new`] for context lengths a kernel writes later, at most `max_ctx`.
    pub fn with_max_ctx(
        dev: &CudaDevice,
        tables: &[Vec<i32>],
        ctx: &[usize],
        max_ctx: usize,
    ) -> Result<Self> {
        let rows = tables.len();
        let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = vec![0i32; rows.max(1) * max_blocks];
        for (r, t) in tables.iter().enumerate() {
            flat[r * max_blocks..r * max_blocks + t.len()].copy_from_slice(t);
        }
        let mut ctx_i: Vec<i32> = ctx
            .iter()
            .map(|&c| as_i32(c, "context length"))
            .collect::<Result<_>>()?;
        ctx_i.resize(rows.max(1), 0);
        Ok(Self {
            tables: upload_i32(dev, &flat)?,
            ctx: upload_i32(dev, &ctx_i)?,
            counters: dev.alloc_zeros::<u32>(rows.max(1) * FOLD_KV_HEADS)?,
            rows,
            max_blocks,
            max_ctx,
        })
    }
}

impl DecodeTables {
    /// Tables of `rows` rows and `max_blocks` blocks each for contexts up to `max_ctx`,
    /// zeroed: the fixed buffers a CUDA graph's decode step reads, filled by
    /// [`DecodeTables::write`] before each replay.
    pub fn fixed(dev: &CudaDevice, rows: usize, max_blocks: usize, max_ctx: usize) -> Result<Self> {
        Ok(Self {
            tables: dev.alloc_zeros::<i32>(rows.max(1) * max_blocks.max(1))?,
            ctx: dev.alloc_zeros::<i32>(rows.max(1))?,
            counters: dev.alloc_zeros::<u32>(rows.max(1) * FOLD_KV_HEADS)?,
            rows,
            max_blocks: max_blocks.max(1),
            max_ctx,
        })
    }

    /// Overwrite the tables and context lengths in place (stream-ordered: kernels
    /// queued before read the old values). Each row's table is cut to the width, which
    /// must hold its context.
    pub fn write(
        &mut self,
        dev: &CudaDevice,
        tables: &[Vec<i32>],
        ctx: &[usize],
        block_size: usize,
    ) -> Result<()> {
        let flat = crate::decode_graphs::fixed_width_tables(
            tables,
            ctx,
            self.rows,
            self.max_blocks,
            self.max_ctx,
            block_size,
        )?;
        let ctx_i: Vec<i32> = ctx
            .iter()
            .map(|&c| as_i32(c, "context length"))
            .collect::<Result<_>>()?;
        let stream = dev.cuda_stream();
        stream.memcpy_htod(&flat, &mut self.tables).w()?;
        stream.memcpy_htod(&ctx_i, &mut self.ctx).w()?;
        Ok(())
    }
}

/// Paged decode attention: row `r` of `q` (`[R, H, D]` bf16) attends the first
/// `ctx[r]` tokens of its sequence through its block table, reading K/V in place.
/// Returns `[R, H, D]` bf16.
pub fn paged_decode(
    cache: &LayerCache,
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
) -> Result<Tensor> {
    paged_decode_with(cache, q, t, s, None)
}

/// Extra outputs of a paged decode for H2O: each row's log-sum-exp per head
/// (`[R, H]`) and every scaled score (`[R, H, stride]`, stride ≥ the longest context).
pub struct DecodeScores<'a> {
    pub lse: &'a mut CudaSlice<f32>,
    pub raw: &'a mut CudaSlice<f32>,
    pub stride: usize,
}

/// [`paged_decode`], optionally keeping what H2O needs to turn scores into
/// probabilities.
pub fn paged_decode_with(
    cache: &LayerCache,
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
    scores: Option<DecodeScores<'_>>,
) -> Result<Tensor> {
    paged_decode_impl(cache, q, t, s, scores, None, DecodePin::default())
}

/// Keys cached without RoPE and rotated as they are read, to their index in the cache
/// (StreamingLLM's rolling positions; kept set = sinks + a contiguous window): each
/// (slot, KV head)'s position `pos` (`[slots, KVH]`), per row `params` (kept slots m
/// and context n, both with the new token, capacity, recent window), and the rotation
/// rows `cos`/`sin` (`[indices, D/2]`, non-interleaved RoPE).
pub struct RollingKeys<'a> {
    pub pos: &'a CudaSlice<i32>,
    pub params: &'a CudaSlice<i32>,
    pub cos: &'a CudaSlice<f32>,
    pub sin: &'a CudaSlice<f32>,
}

/// [`paged_decode`] over keys cached without RoPE; `q` is already rotated to the last
/// index of its row's cache.
pub fn paged_decode_rolling(
    cache: &LayerCache,
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
    roll: RollingKeys<'_>,
) -> Result<Tensor> {
    paged_decode_impl(cache, q, t, s, None, Some(roll), DecodePin::default())
}

/// Lets `f` launch with `dynamic` bytes of dynamic shared memory a block. The kernel's
/// static shared memory (the folded reduction's, for one) counts against the same
/// limit, 48 KB unless the kernel is opted in to more; past it the kernel is opted in.
/// The attribute belongs to each loaded copy of a module (one per device instance), so
/// what was set is remembered per loaded kernel: a step's first, uncaptured launch
/// sets it, and the launches a CUDA graph captures make no driver call. The record
/// holds the kernel, which keeps its module loaded: a module unloaded with its device
/// could hand its kernels' handles to the next one loaded, which would then pass for
/// opted in.
fn allow_dynamic_shared(
    dev: &CudaDevice,
    f: &CudaFunction,
    dynamic: usize,
    what: &dyn Fn() -> String,
) -> Result<()> {
    const WITHOUT_OPT_IN: usize = 48 * 1024;
    // (loaded kernel, its static bytes, the dynamic bytes it is opted in to).
    static SEEN: std::sync::Mutex<Vec<(CudaFunction, usize, usize)>> =
        std::sync::Mutex::new(Vec::new());
    let handle = f.cu_function();
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let at = match seen.iter().position(|e| e.0.cu_function() == handle) {
        Some(at) => at,
        None => {
            let fixed = usize::try_from(f.shared_size_bytes().w()?).unwrap_or(0);
            seen.push((f.clone(), fixed, WITHOUT_OPT_IN.saturating_sub(fixed)));
            seen.len() - 1
        }
    };
    let (fixed, opted) = (seen[at].1, seen[at].2);
    if dynamic <= opted {
        return Ok(());
    }
    let most = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .w()?;
    let most = usize::try_from(most).unwrap_or(0);
    if fixed + dynamic > most {
        return Err(Error::Config(format!(
            "{} needs {dynamic} B of shared memory per block besides its own {fixed} B, \
             over the {most} B a block may have on this device: lower the partition size",
            what()
        )));
    }
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        as_i32(dynamic, "shared memory")?,
    )
    .w()?;
    seen[at].2 = dynamic;
    Ok(())
}

/// What a caller pins of a paged decode launch, each `None` as the engine chooses:
/// the partition kernel and the reduction (`kvbench verify` and `bench-decode` pin
/// them), and the keys per partition (`bench-decode`'s sweep of them at a few rows).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DecodePin {
    pub kernel: Option<DecodeKernel>,
    pub reduce: Option<DecodeReduce>,
    /// Keys per partition, a multiple of 64, in place of [`partition_size`]'s.
    pub part: Option<usize>,
}

pub(crate) fn paged_decode_impl(
    cache: &LayerCache,
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
    scores: Option<DecodeScores<'_>>,
    roll: Option<RollingKeys<'_>>,
    pin: DecodePin,
) -> Result<Tensor> {
    let DecodePin {
        kernel,
        reduce,
        part,
    } = pin;
    check_bf16(q, "paged_decode q")?;
    let dev = device_of(q.device())?;
    let rows = q.dim(0)?;
    let (h, kvh, d) = (s.num_heads, s.num_kv_heads, s.head_dim);
    if rows != t.rows {
        return Err(Error::Config(format!(
            "paged_decode: {rows} query rows for {} block tables",
            t.rows
        )));
    }
    if rows == 0 {
        return Ok(Tensor::zeros(
            (0, h, d),
            DType::BF16,
            &candle_core::Device::Cpu,
        )?);
    }
    let max_blocks = t.max_blocks;
    let group = h / kvh;
    let choice = decode_choice()?;
    let kernel = kernel.unwrap_or_else(|| DecodeKernel::choose(d, group, choice, roll.is_some()));
    if !kernel.applies(d, group) {
        return Err(Error::Config(format!(
            "paged_decode: the {kernel:?} kernel does not take head dim {d}, group {group}"
        )));
    }
    if matches!(kernel, DecodeKernel::Pipelined | DecodeKernel::TensorCore) && roll.is_some() {
        return Err(Error::Config(format!(
            "paged_decode: the {} kernel does not take rolling keys",
            kernel.label()
        )));
    }
    let part_size = match part {
        Some(p) if p == 0 || !p.is_multiple_of(64) => {
            return Err(Error::Config(format!(
                "paged_decode: a pinned partition of {p} keys (expected a positive multiple of 64)"
            )))
        }
        Some(p) => p,
        None if choice == DecodeChoice::Scalar => s.part_size,
        None => partition_size(s.part_size, rows * kvh, t.max_ctx),
    };
    let parts = t.max_ctx.div_ceil(part_size).max(1);
    let reduce = match reduce {
        Some(r) => r,
        None => decode_reduce()?,
    };
    let fold = reduce == DecodeReduce::Folded && group <= FOLD_MAX_GROUP && kvh <= FOLD_KV_HEADS;

    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let qv = view(&qs, ql, "paged_decode q")?;
    // Scratch and output are left uninitialized: the partition kernel writes every
    // (row, head, partition), empty partitions included, and the reduction every
    // output element, so zeroing them would only add launches to each decode step.
    // SAFETY: every element is written by the kernels below before it is read.
    let (mut pm, mut pl, mut pacc, mut out) = unsafe {
        (
            dev.alloc::<f32>(rows * h * parts)?,
            dev.alloc::<f32>(rows * h * parts)?,
            dev.alloc::<f32>(rows * h * parts * d)?,
            dev.alloc::<bf16>(rows * h * d)?,
        )
    };
    let scale = 1.0f32 / (d as f32).sqrt();
    let (kvh_i, g_i, d_i) = (
        as_i32(kvh, "KV heads")?,
        as_i32(group, "group")?,
        as_i32(d, "D")?,
    );
    let (bs_i, mb_i, ps_i) = (
        as_i32(s.block_size, "block size")?,
        as_i32(max_blocks, "blocks")?,
        as_i32(part_size, "partition")?,
    );
    if let Some(sc) = &scores {
        if sc.stride < t.max_ctx || sc.raw.len() < rows * h * sc.stride || sc.lse.len() < rows * h {
            return Err(Error::Config(format!(
                "paged_decode: score buffers too small for {rows} rows of up to {} keys",
                t.max_ctx
            )));
        }
    }
    let null: u64 = 0;
    let (mut lse_out, raw_out, stride) = match scores {
        Some(sc) => (
            Some(sc.lse),
            Some(sc.raw),
            as_i32(sc.stride, "score stride")?,
        ),
        None => (None, None, 0),
    };
    let vector = |form: &str| {
        format!(
            "paged_decode_part_{form}{}_d{}_g{}_bf16",
            if roll.is_some() { "_rolling" } else { "" },
            if d == 64 { 64 } else { 128 },
            if group <= 4 { 4 } else { 8 },
        )
    };
    let name = match kernel {
        DecodeKernel::Scalar if roll.is_some() => "paged_decode_part_rolling_bf16".to_string(),
        DecodeKernel::Scalar => "paged_decode_part_bf16".to_string(),
        DecodeKernel::Vector => vector("vec"),
        DecodeKernel::VectorOneRow => vector("vec1"),
        DecodeKernel::Pipelined => vector("pipe"),
        // One kernel per head dim: the group is a row count of the products.
        DecodeKernel::TensorCore => format!("paged_decode_part_mma_d{d}_bf16"),
    };
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&qv)
        .arg(&cache.k)
        .arg(&cache.v)
        .arg(&t.tables)
        .arg(&t.ctx)
        .arg(&mut pm)
        .arg(&mut pl)
        .arg(&mut pacc);
    match raw_out {
        Some(r) => b.arg(r),
        None => b.arg(&null),
    };
    b.arg(&stride)
        .arg(&kvh_i)
        .arg(&g_i)
        .arg(&d_i)
        .arg(&bs_i)
        .arg(&mb_i)
        .arg(&ps_i)
        .arg(&scale);
    // Folded: the counters, the output and the log-sum-exp (null counters: the
    // reduction is launched below). The kernel writes the counters but leaves them as
    // it found them (all zero), hence a shared borrow of the tables.
    if fold {
        b.arg(&t.counters).arg(&mut out);
        match lse_out.as_mut() {
            Some(l) => b.arg(&mut **l),
            None => b.arg(&null),
        };
    } else {
        b.arg(&null).arg(&null).arg(&null);
    }
    if let Some(r) = &roll {
        b.arg(r.pos).arg(r.params).arg(r.cos).arg(r.sin);
    }
    let shared = kernel.shared_bytes(group, d, part_size);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, kvh as u32, parts as u32),
        block_dim: (DECODE_THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    allow_dynamic_shared(&dev, &f, shared, &|| {
        format!("paged decode ({name}, group {group}, partition {part_size})")
    })?;
    unsafe { b.launch(cfg) }.w()?;
    if fold {
        return Ok(tensor_from(&dev, out, (rows, h, d)));
    }

    let h_i = as_i32(h, "heads")?;
    let parts_i = as_i32(parts, "partitions")?;
    let f = dev.get_or_load_custom_func("paged_decode_reduce_bf16", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&pm).arg(&pl).arg(&pacc).arg(&mut out);
    match lse_out.as_mut() {
        Some(l) => b.arg(&mut **l),
        None => b.arg(&null),
    };
    b.arg(&h_i).arg(&d_i).arg(&parts_i);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, h as u32, 1),
        // Whole warps: the kernel reduces over partitions with warp shuffles.
        block_dim: (d.next_multiple_of(32).min(1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(tensor_from(&dev, out, (rows, h, d)))
}

/// Prefill attention of one sequence on the device with cuBLAS matrix products:
/// `q` `[T, H, D]` at positions `ctx_before..ctx_before + T` attends `k`/`v`
/// (`[n, KVH, D]`, n = ctx_before + T) causally. Query rows go in chunks of `chunk`
/// (`eager` = one chunk of T), each materializing `[H, chunk, keys]` f32 scores.
/// Returns the output `[T, H, D]` and the peak scratch bytes.
pub fn prefill_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx_before: usize,
    chunk: usize,
    scratch_limit: Option<u64>,
) -> Result<(Tensor, u64)> {
    let (o, scratch, _) = prefill_attention_stats(q, k, v, ctx_before, chunk, scratch_limit, None)?;
    Ok((o, scratch))
}

/// [`prefill_attention`] with H2O's column statistics from the materialized
/// probabilities, `[KVH, n]` f32 summed over rows and each group's heads: `Eager` and
/// `Exact` from the attention's own rows (exact values), `Chunked` with each chunk's
/// rows softmaxed over the chunk's own keys only (the study's approximation).
pub fn prefill_attention_stats(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx_before: usize,
    chunk: usize,
    scratch_limit: Option<u64>,
    stats: Option<ColumnStats>,
) -> Result<(Tensor, u64, Option<Tensor>)> {
    let (t, h, d) = q.dims3()?;
    let (n, kvh, _) = k.dims3()?;
    if n != ctx_before + t {
        return Err(Error::Config(format!(
            "prefill: {n} keys for {t} rows after {ctx_before} cached tokens"
        )));
    }
    let g = h / kvh;
    let chunk = chunk.clamp(1, t.max(1));
    // Peak bytes per score element: bf16 product, f32 scores, f32 softmax, bf16 probs.
    let scratch = (h * chunk * n) as u64 * crate::attention::prefill::CUDA_SCORE_BYTES;
    if let Some(limit) = scratch_limit.filter(|&l| scratch > l) {
        return Err(Error::OutOfMemory {
            device: format!("{:?}", q.device().location()),
            component: crate::error::Component::Activations,
            requested: scratch,
            available: limit,
            capacity: limit,
        });
    }
    let dev = q.device();
    let scale = 1.0 / (d as f64).sqrt();
    let kt = k.permute((1, 2, 0))?.contiguous()?; // [KVH, D, n]
    let vt = v.transpose(0, 1)?.contiguous()?; // [KVH, n, D]
    let mut outs = Vec::with_capacity(t.div_ceil(chunk));
    let mut col: Option<Tensor> = None;
    for c0 in (0..t).step_by(chunk) {
        let c = chunk.min(t - c0);
        let first = ctx_before + c0; // position of the chunk's first row
        let nk = first + c; // keys its last row sees
        let qc = q
            .narrow(0, c0, c)?
            .reshape((c, kvh, g, d))?
            .permute((1, 2, 0, 3))?
            .contiguous()?
            .reshape((kvh, g * c, d))?;
        let (kk, vv) = if nk == n {
            (kt.clone(), vt.clone())
        } else {
            (
                kt.narrow(2, 0, nk)?.contiguous()?,
                vt.narrow(1, 0, nk)?.contiguous()?,
            )
        };
        // Row i sees keys 0..=first + i: a large negative bias above that.
        let cols = Tensor::arange(0u32, nk as u32, dev)?.reshape((1, nk))?;
        let rows = Tensor::arange(first as u32, (first + c) as u32, dev)?.reshape((c, 1))?;
        let bias = (cols.broadcast_gt(&rows)?.to_dtype(DType::F32)? * -1e30)?;
        let s = qc
            .matmul(&kk)?
            .to_dtype(DType::F32)?
            .affine(scale, 0.0)?
            .reshape((kvh, g, c, nk))?
            .broadcast_add(&bias)?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        if let Some(mode) = stats {
            // [KVH, keys] of this chunk, placed at key offset `off`.
            let (part, off) = match mode {
                ColumnStats::Chunked => {
                    let own =
                        candle_nn::ops::softmax_last_dim(&s.narrow(3, first, c)?.contiguous()?)?;
                    (own.sum(2)?.sum(1)?, first)
                }
                _ => (p.sum(2)?.sum(1)?, 0),
            };
            let w = part.dim(1)?;
            let part = part.pad_with_zeros(1, off, n - off - w)?;
            col = Some(match col {
                None => part,
                Some(acc) => (acc + part)?,
            });
        }
        drop(s);
        let p = p.to_dtype(q.dtype())?.reshape((kvh, g * c, nk))?;
        let o = p
            .matmul(&vv)?
            .reshape((kvh, g, c, d))?
            .permute((2, 0, 1, 3))?
            .reshape((c, h, d))?;
        outs.push(o);
    }
    Ok((Tensor::cat(&outs, 0)?, scratch, col))
}

/// [`flash_prefill`] over contiguous K/V (`[n, KVH, D]`, n = ctx_before + T) rather
/// than a pool: they are copied into a temporary cache read through an identity table.
/// Returns the output and the temporary's bytes (scratch).
pub fn flash_prefill_contiguous(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ctx_before: usize,
) -> Result<(Tensor, u64)> {
    const BLOCK: usize = 16;
    let dev = device_of(q.device())?;
    let (n, kvh, d) = k.dims3()?;
    let slots = n.div_ceil(BLOCK) * BLOCK;
    let mut tmp = LayerCache::new(&dev, slots, kvh * d)?;
    let ids: Vec<i32> = (0..n)
        .map(|i| as_i32(i, "position"))
        .collect::<Result<_>>()?;
    kv_write(
        &mut tmp,
        &k.to_dtype(DType::BF16)?,
        &v.to_dtype(DType::BF16)?,
        &ids,
    )?;
    let table: Vec<i32> = (0..(slots / BLOCK) as i32).collect();
    let out = flash_prefill(&tmp, q, &table, ctx_before, kvh, BLOCK)?;
    Ok((out, (2 * slots * kvh * d * 2) as u64))
}

/// Shared-memory bytes of the flash prefill kernel for head dimension `d` (the layout
/// of `FlashSmem` in kernels.cu: Q, K, V tiles of 64 rows, per-warp scores,
/// probabilities and output accumulators, per-row max and sum).
pub(crate) fn flash_smem_bytes(d: usize) -> usize {
    let (bm, bn, warps, pad) = (64, 64, 4, 8);
    3 * bm * (d + pad) * 2
        + warps * 16 * (bn + 4) * 4
        + warps * 16 * (bn + pad) * 2
        + warps * 16 * (d + 4) * 4
        + 2 * bm * 4
}

/// Which flash prefill kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    /// mma.sync with the scores, probabilities and output in registers and K/V tiles
    /// copied with cp.async into two shared buffers (FlashAttention-2's structure).
    Mma,
    /// WMMA with the scores and the output accumulators in shared memory (earlier
    /// builds; the layout H2O's exact statistics pass shares).
    Wmma,
    /// FlashAttention-2's own forward kernel (vendored, bf16, head dim 128; the build
    /// feature `flash-attn`), over K/V gathered contiguous. H2O's statistics pass then
    /// runs the `Mma` one.
    Fa2,
    /// FlashAttention-3's forward kernel for Hopper (vendored, bf16, head dim 128,
    /// causal; the build feature `flash-attn3`), the same way.
    Fa3,
}

impl FlashKernel {
    /// The kernel for head dim `d`: the one `KVBENCH_FLASH_PREFILL` names (`mma`,
    /// `wmma`, `fa2` or `fa3`), else the default: `Fa2` in builds with the `flash-attn`
    /// feature (the fastest verified on an H100), `Mma` otherwise. FlashAttention is
    /// built for head dim 128 only: as the default it gives way to `Mma` at other head
    /// dims; asked for by name it is refused there, and without its feature, with a
    /// named error. `fa3` is chosen by name only until it has run on a GPU. `wmma` is
    /// the earlier kernel (a fallback, and the "before" of a comparison). Read once per
    /// process; any other value is an error.
    pub fn chosen_for(d: usize) -> Result<Self> {
        static CHOSEN: std::sync::OnceLock<std::result::Result<(FlashKernel, bool), String>> =
            std::sync::OnceLock::new();
        let (k, named) = CHOSEN
            .get_or_init(|| Self::parse(std::env::var("KVBENCH_FLASH_PREFILL").ok().as_deref()))
            .clone()
            .map_err(Error::Config)?;
        Ok(if k == Self::Fa2 && d != 128 && !named {
            Self::Mma
        } else {
            k
        })
    }

    /// The kernel a value of `KVBENCH_FLASH_PREFILL` asks for, and whether it named one.
    fn parse(v: Option<&str>) -> std::result::Result<(Self, bool), String> {
        let (unset, unset_is) = if cfg!(feature = "flash-attn") {
            (Self::Fa2, "fa2")
        } else {
            (Self::Mma, "mma")
        };
        crate::parse_switch(
            "KVBENCH_FLASH_PREFILL",
            v,
            &[
                ("mma", Self::Mma),
                ("wmma", Self::Wmma),
                ("fa2", Self::Fa2),
                ("fa3", Self::Fa3),
            ],
            unset,
            unset_is,
        )
    }

    /// For a vendored FlashAttention: its name in `KVBENCH_FLASH_PREFILL`, its build
    /// feature and whether this build has it.
    fn vendored(self) -> Option<(&'static str, &'static str, bool)> {
        match self {
            Self::Fa2 => Some(("fa2", "flash-attn", cfg!(feature = "flash-attn"))),
            Self::Fa3 => Some(("fa3", "flash-attn3", cfg!(feature = "flash-attn3"))),
            Self::Mma | Self::Wmma => None,
        }
    }

    /// The kernel of H2O's exact statistics pass that goes with this attention kernel.
    pub fn stats(self) -> Self {
        match self {
            Self::Fa2 | Self::Fa3 => Self::Mma,
            k => k,
        }
    }

    fn smem_bytes(self, d: usize) -> usize {
        match self {
            // Q, then two K and two V tiles, 64 rows of D + 8 bf16 each.
            Self::Mma => 5 * 64 * (d + 8) * 2,
            Self::Wmma => flash_smem_bytes(d),
            // Launched by FlashAttention's own code.
            Self::Fa2 | Self::Fa3 => 0,
        }
    }
}

/// Flash prefill on the tensor cores: `q` (`[T, H, D]` bf16) holds one sequence's rows
/// at positions `ctx_before..ctx_before + T`, whose K/V (all of them, this step's
/// included) are in `cache` through the block `table`. No score matrix is
/// materialized. Returns `[T, H, D]` bf16.
pub fn flash_prefill(
    cache: &LayerCache,
    q: &Tensor,
    table: &[i32],
    ctx_before: usize,
    num_kv_heads: usize,
    block_size: usize,
) -> Result<Tensor> {
    let kernel = FlashKernel::chosen_for(q.dims3()?.2)?;
    flash_prefill_with(
        cache,
        q,
        table,
        ctx_before,
        num_kv_heads,
        block_size,
        None,
        kernel,
    )
}

/// [`flash_prefill`] on the given kernel, optionally writing each row's log-sum-exp
/// per head (`[T, H]` f32, the natural log of the scaled scores' softmax denominator).
#[allow(clippy::too_many_arguments)]
pub fn flash_prefill_with(
    cache: &LayerCache,
    q: &Tensor,
    table: &[i32],
    ctx_before: usize,
    num_kv_heads: usize,
    block_size: usize,
    lse: Option<&mut CudaSlice<f32>>,
    kernel: FlashKernel,
) -> Result<Tensor> {
    check_bf16(q, "flash_prefill q")?;
    let (t, h, d) = q.dims3()?;
    if (ctx_before + t).div_ceil(block_size) > table.len() {
        return Err(Error::Config(format!(
            "flash_prefill: {} tokens need more than {} blocks",
            ctx_before + t,
            table.len()
        )));
    }
    if lse.as_ref().is_some_and(|l| l.len() < t * h) {
        return Err(Error::Config(format!(
            "flash_prefill: log-sum-exp buffer smaller than {t} rows x {h} heads"
        )));
    }
    if let Some((name, feature, built)) = kernel.vendored() {
        if !built {
            return Err(Error::Config(format!(
                "KVBENCH_FLASH_PREFILL={name}: this build has no such kernels (the `{feature}` \
                 feature; `just build-cuda` builds them)"
            )));
        }
        #[cfg(any(feature = "flash-attn", feature = "flash-attn3"))]
        return flash_attn::prefill(
            cache,
            q,
            table,
            ctx_before,
            num_kv_heads,
            block_size,
            lse,
            if kernel == FlashKernel::Fa2 {
                flash_attn::Vendored::Fa2
            } else {
                flash_attn::Vendored::Fa3
            },
        );
    }
    let dev = device_of(q.device())?;
    let name = match (kernel, d) {
        (FlashKernel::Mma, 64) => "flash_prefill_mma_d64_bf16",
        (FlashKernel::Mma, 128) => "flash_prefill_mma_d128_bf16",
        (FlashKernel::Wmma, 64) => "flash_prefill_d64_bf16",
        (FlashKernel::Wmma, 128) => "flash_prefill_d128_bf16",
        _ => {
            return Err(Error::Config(format!(
                "flash prefill has kernels for head dims 64 and 128, not {d}: use \
                 --attention chunked"
            )))
        }
    };
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let qv = view(&qs, ql, "flash_prefill q")?;
    let table_d = upload_i32(&dev, table)?;
    let mut out = dev.alloc_zeros::<bf16>(t * h * d)?;
    let smem = kernel.smem_bytes(d);
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let null: u64 = 0;
    let (t_i, cb_i) = (as_i32(t, "rows")?, as_i32(ctx_before, "context")?);
    let (h_i, kvh_i, bs_i) = (
        as_i32(h, "heads")?,
        as_i32(num_kv_heads, "KV heads")?,
        as_i32(block_size, "block size")?,
    );
    let scale = 1.0f32 / (d as f32).sqrt();
    let mut b = f.builder();
    b.arg(&qv)
        .arg(&cache.k)
        .arg(&cache.v)
        .arg(&table_d)
        .arg(&mut out);
    match lse {
        Some(l) => b.arg(l),
        None => b.arg(&null),
    };
    b.arg(&t_i)
        .arg(&cb_i)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(&bs_i)
        .arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(64) as u32, h as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(tensor_from(&dev, out, (t, h, d)))
}
