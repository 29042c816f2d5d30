//! FlashAttention's forward kernels, vendored and trimmed to bf16, head dim 128, as
//! kvbench's `fa2` flash prefill (FlashAttention-2: `vendor/flash-attn`, feature
//! `flash-attn`) and `fa3` (FlashAttention-3, Hopper only: `vendor/flash-attn3`, feature
//! `flash-attn3`): one sequence's rows against its K/V gathered contiguous from the
//! paged pool, causal with the rows at the end of the keys (a cached prefix before
//! them).

use super::{as_i32, device_of, kv_gather, tensor_from, upload_i32, view, LayerCache};
use crate::error::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::WrapErr;
use candle_core::Tensor;
#[cfg(feature = "flash-attn")]
use core::ffi::c_int;
use core::ffi::c_void;
use half::bf16;

#[cfg(feature = "flash-attn")]
extern "C" {
    // vendor/flash-attn/flash_api.cu: fills FlashAttention-2's parameters and launches
    // the forward kernel on `stream_ptr`.
    fn run_mha(
        q_ptr: *const c_void,
        k_ptr: *const c_void,
        v_ptr: *const c_void,
        o_ptr: *const c_void,
        softmax_lse_ptr: *const c_void,
        alibi_slopes_ptr: *const c_void,
        cu_seqlens_q_ptr: *const i32,
        cu_seqlens_k_ptr: *const i32,
        q_batch_stride: u32,
        k_batch_stride: u32,
        v_batch_stride: u32,
        o_batch_stride: u32,
        alibi_slopes_batch_stride: u32,
        q_row_stride: u32,
        k_row_stride: u32,
        v_row_stride: u32,
        o_row_stride: u32,
        q_head_stride: u32,
        k_head_stride: u32,
        v_head_stride: u32,
        o_head_stride: u32,
        b: u32,
        h: u32,
        h_k: u32,
        d: u32,
        d_rounded: u32,
        softmax_scale: f32,
        seqlen_q: u32,
        seqlen_k: u32,
        seqlen_q_rounded: u32,
        seqlen_k_rounded: u32,
        total_q: u32,
        is_bf16: c_int,
        is_causal: c_int,
        unpadded_lse: c_int,
        window_size_left: c_int,
        window_size_right: c_int,
        softcap: f32,
        block_table_ptr: *const i32,
        block_table_batch_stride: u32,
        page_block_size: c_int,
        mm_prefix_ranges_ptr: *const i32,
        mm_prefix_range_batch_stride: u32,
        max_mm_prefix_ranges: c_int,
        stream_ptr: *mut c_void,
    );
}

#[cfg(feature = "flash-attn3")]
extern "C" {
    // vendor/flash-attn3/flash_api.cu: fills FlashAttention-3's parameters for one
    // causal sequence and launches its forward kernel on `stream_ptr`.
    fn run_mha_v3(
        q_ptr: *const c_void,
        k_ptr: *const c_void,
        v_ptr: *const c_void,
        o_ptr: *const c_void,
        softmax_lse_ptr: *const c_void,
        tile_count_semaphore_ptr: *const i32,
        q_row_stride: u32,
        k_row_stride: u32,
        v_row_stride: u32,
        o_row_stride: u32,
        q_head_stride: u32,
        k_head_stride: u32,
        v_head_stride: u32,
        o_head_stride: u32,
        h: u32,
        h_k: u32,
        d: u32,
        softmax_scale: f32,
        seqlen_q: u32,
        seqlen_k: u32,
        seqlen_q_rounded: u32,
        seqlen_k_rounded: u32,
        stream_ptr: *mut c_void,
    );
}

/// Which vendored FlashAttention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendored {
    Fa2,
    Fa3,
}

impl Vendored {
    fn name(self) -> &'static str {
        match self {
            Self::Fa2 => "fa2",
            Self::Fa3 => "fa3",
        }
    }
}

/// A size as FlashAttention's `u32` arguments take it, within the i32 range every
/// kvbench kernel argument keeps to (`as_i32`).
fn u32_of(x: usize, what: &str) -> Result<u32> {
    Ok(as_i32(x, what)? as u32)
}

/// Causal attention of `q` (`[T, H, 128]` bf16, the rows at positions `ctx_before..`)
/// over the sequence's first `ctx_before + T` keys in `cache` (through `table`), with
/// the vendored FlashAttention `which`. Writes each row's log-sum-exp per head (`[T, H]`
/// f32, natural log of the scaled scores' softmax denominator) into `lse` when given.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    cache: &LayerCache,
    q: &Tensor,
    table: &[i32],
    ctx_before: usize,
    num_kv_heads: usize,
    block_size: usize,
    lse: Option<&mut CudaSlice<f32>>,
    which: Vendored,
) -> Result<Tensor> {
    let dev = device_of(q.device())?;
    let (t, h, d) = q.dims3()?;
    let name = which.name();
    if d != 128 {
        return Err(Error::Config(format!(
            "the {name} flash prefill is built for head dim 128, not {d}: use \
             KVBENCH_FLASH_PREFILL=mma"
        )));
    }
    if num_kv_heads == 0 || h % num_kv_heads != 0 {
        return Err(Error::Config(format!(
            "{name} prefill: {h} query heads over {num_kv_heads} KV heads"
        )));
    }
    // (The block count and the log-sum-exp buffer were checked by the caller,
    // `flash_prefill_with`.)
    let n = ctx_before + t;
    // The pool's blocks are smaller than FlashAttention's pages: the keys are gathered
    // contiguous first (about a thousandth of the attention's time at 32K).
    let (k, v) = kv_gather(&dev, cache, table, n, block_size, num_kv_heads, d)?;
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (qv, kv, vv) = (
        view(&qs, ql, "flash-attn q")?,
        view(&ks, kl, "flash-attn k")?,
        view(&vs, vl, "flash-attn v")?,
    );
    // One small buffer for what each kernel reads beside the tensors: FlashAttention-2
    // the cumulative lengths of its one sequence ([0, t] for the rows, [0, n] for the
    // keys), FlashAttention-3's causal kernel a counter, from 0, that hands out its tiles.
    let aux = match which {
        Vendored::Fa2 => upload_i32(&dev, &[0, as_i32(t, "rows")?, 0, as_i32(n, "keys")?])?,
        Vendored::Fa3 => upload_i32(&dev, &[0])?,
    };
    // SAFETY: the kernel writes every element of both.
    let (mut out, mut lse_hq) =
        unsafe { (dev.alloc::<bf16>(t * h * d)?, dev.alloc::<f32>(h * t)?) };
    let round = |x: usize| x.div_ceil(128) * 128;
    let stream = dev.cuda_stream();
    let (row_q, row_kv) = (u32_of(h * d, "q row")?, u32_of(num_kv_heads * d, "k row")?);
    let n_u = u32_of(n, "keys")?;
    {
        let (qp, _g1) = qv.device_ptr(&stream);
        let (kp, _g2) = kv.device_ptr(&stream);
        let (vp, _g3) = vv.device_ptr(&stream);
        let (op, _g4) = out.device_ptr_mut(&stream);
        let (lp, _g5) = lse_hq.device_ptr_mut(&stream);
        let (ap, _g6) = aux.device_ptr(&stream);
        let aux = ap as *const i32;
        let (cu_q, cu_k, semaphore) = match which {
            Vendored::Fa2 => (aux, aux.wrapping_add(2), std::ptr::null()),
            Vendored::Fa3 => (std::ptr::null(), std::ptr::null(), aux),
        };
        let p = Launch {
            q: qp as *const c_void,
            k: kp as *const c_void,
            v: vp as *const c_void,
            o: op as *const c_void,
            lse: lp as *const c_void,
            cu_q,
            cu_k,
            semaphore,
            row_q,
            row_kv,
            h: u32_of(h, "heads")?,
            h_k: u32_of(num_kv_heads, "KV heads")?,
            d: d as u32,
            t: u32_of(t, "rows")?,
            n: n_u,
            t_rounded: u32_of(round(t), "rows rounded")?,
            n_rounded: u32_of(round(n), "keys rounded")?,
            stream: stream.cu_stream() as *mut c_void,
        };
        // SAFETY: every pointer is a live device buffer of the size FlashAttention reads
        // or writes for these shapes (q and out [t, h, 128], k and v [n, kvh, 128], lse
        // [h, t], the cumulative lengths [2] each or the counter [1]; null what the
        // kernel does not read), on the stream the buffers are ordered on.
        unsafe { launch(which, &p)? };
    }
    drop((qs, ks, vs));
    if let Some(l) = lse {
        // [H, T] as FlashAttention leaves it; kvbench's kernels take [T, H].
        let by_head = Tensor::from_storage(
            candle_core::Storage::Cuda(candle_core::cuda_backend::CudaStorage::wrap_cuda_slice(
                lse_hq,
                dev.clone(),
            )),
            (h, t),
            candle_core::op::BackpropOp::none(),
            false,
        );
        let by_row = by_head.t()?.contiguous()?;
        let (s, layout) = by_row.storage_and_layout();
        let src = super::view_of::<f32>(&s, layout, "flash-attn lse")?;
        stream.memcpy_dtod(&src, &mut l.slice_mut(0..t * h)).w()?;
    }
    Ok(tensor_from(&dev, out, (t, h, d)))
}

/// One launch's arguments, as both vendored entry points take them (a build with one of
/// them leaves the other's fields unread).
#[cfg_attr(
    not(all(feature = "flash-attn", feature = "flash-attn3")),
    allow(dead_code)
)]
struct Launch {
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    o: *const c_void,
    lse: *const c_void,
    cu_q: *const i32,
    cu_k: *const i32,
    semaphore: *const i32,
    row_q: u32,
    row_kv: u32,
    h: u32,
    h_k: u32,
    d: u32,
    t: u32,
    n: u32,
    t_rounded: u32,
    n_rounded: u32,
    stream: *mut c_void,
}

/// Launch the vendored kernel `which` (an error where this build lacks it).
///
/// # Safety
/// Every pointer in `p` is a live device buffer of the size the kernel uses for the
/// shapes in `p`, ordered on `p.stream`.
unsafe fn launch(which: Vendored, p: &Launch) -> Result<()> {
    let scale = 1.0 / (p.d as f32).sqrt();
    match which {
        #[cfg(feature = "flash-attn")]
        Vendored::Fa2 => run_mha(
            p.q,
            p.k,
            p.v,
            p.o,
            p.lse,
            std::ptr::null(),
            p.cu_q,
            p.cu_k,
            0,
            0,
            0,
            0,
            0,
            p.row_q,
            p.row_kv,
            p.row_kv,
            p.row_q,
            p.d,
            p.d,
            p.d,
            p.d,
            1,
            p.h,
            p.h_k,
            p.d,
            p.d,
            scale,
            p.t,
            p.n,
            p.t_rounded,
            p.n_rounded,
            p.t,
            1,
            1,
            1,
            // Causal as FlashAttention's API expresses it: no limit to the left (the
            // whole sequence), none to the right of each row's own position.
            p.n as c_int,
            0,
            0.0,
            std::ptr::null(),
            0,
            0,
            std::ptr::null(),
            0,
            0,
            p.stream,
        ),
        #[cfg(feature = "flash-attn3")]
        Vendored::Fa3 => run_mha_v3(
            p.q,
            p.k,
            p.v,
            p.o,
            p.lse,
            p.semaphore,
            p.row_q,
            p.row_kv,
            p.row_kv,
            p.row_q,
            p.d,
            p.d,
            p.d,
            p.d,
            p.h,
            p.h_k,
            p.d,
            scale,
            p.t,
            p.n,
            p.t_rounded,
            p.n_rounded,
            p.stream,
        ),
        #[allow(unreachable_patterns)]
        other => {
            return Err(Error::Config(format!(
                "KVBENCH_FLASH_PREFILL={}: this build has no such kernels",
                other.name()
            )))
        }
    }
    Ok(())
}
