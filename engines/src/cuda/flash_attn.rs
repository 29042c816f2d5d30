//! FlashAttention-2's forward kernel (vendored and trimmed to bf16, head dim 128:
//! `vendor/flash-attn`, feature `flash-attn`) as kvbench's `fa2` flash prefill: one
//! sequence's rows against its K/V gathered contiguous from the paged pool, causal with
//! the rows at the end of the keys (a cached prefix before them).

use super::{as_i32, device_of, kv_gather, tensor_from, upload_i32, view, LayerCache};
use crate::error::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::WrapErr;
use candle_core::Tensor;
use core::ffi::{c_int, c_void};
use half::bf16;

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

/// A size as FlashAttention's `u32` arguments take it, within the i32 range every
/// kvbench kernel argument keeps to (`as_i32`).
fn u32_of(x: usize, what: &str) -> Result<u32> {
    Ok(as_i32(x, what)? as u32)
}

/// Causal attention of `q` (`[T, H, 128]` bf16, the rows at positions `ctx_before..`)
/// over the sequence's first `ctx_before + T` keys in `cache` (through `table`), with
/// FlashAttention-2. Writes each row's log-sum-exp per head (`[T, H]` f32, natural
/// log of the scaled scores' softmax denominator) into `lse` when given.
pub fn prefill(
    cache: &LayerCache,
    q: &Tensor,
    table: &[i32],
    ctx_before: usize,
    num_kv_heads: usize,
    block_size: usize,
    lse: Option<&mut CudaSlice<f32>>,
) -> Result<Tensor> {
    let dev = device_of(q.device())?;
    let (t, h, d) = q.dims3()?;
    if d != 128 {
        return Err(Error::Config(format!(
            "the fa2 flash prefill is built for head dim 128, not {d}: use \
             KVBENCH_FLASH_PREFILL=mma"
        )));
    }
    if num_kv_heads == 0 || h % num_kv_heads != 0 {
        return Err(Error::Config(format!(
            "fa2 prefill: {h} query heads over {num_kv_heads} KV heads"
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
        view(&qs, ql, "fa2 q")?,
        view(&ks, kl, "fa2 k")?,
        view(&vs, vl, "fa2 v")?,
    );
    let cu_q = upload_i32(&dev, &[0, as_i32(t, "rows")?])?;
    let cu_k = upload_i32(&dev, &[0, as_i32(n, "keys")?])?;
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
        let (cqp, _g6) = cu_q.device_ptr(&stream);
        let (ckp, _g7) = cu_k.device_ptr(&stream);
        // SAFETY: every pointer is a live device buffer of the size FlashAttention reads
        // or writes for these shapes (q and out [t, h, 128], k and v [n, kvh, 128], lse
        // [h, t], the cumulative lengths [2]), on the stream the buffers are ordered on.
        unsafe {
            run_mha(
                qp as *const c_void,
                kp as *const c_void,
                vp as *const c_void,
                op as *const c_void,
                lp as *const c_void,
                std::ptr::null(),
                cqp as *const i32,
                ckp as *const i32,
                0,
                0,
                0,
                0,
                0,
                row_q,
                row_kv,
                row_kv,
                row_q,
                d as u32,
                d as u32,
                d as u32,
                d as u32,
                1,
                u32_of(h, "heads")?,
                u32_of(num_kv_heads, "KV heads")?,
                d as u32,
                d as u32,
                1.0 / (d as f32).sqrt(),
                u32_of(t, "rows")?,
                n_u,
                u32_of(round(t), "rows rounded")?,
                u32_of(round(n), "keys rounded")?,
                u32_of(t, "rows")?,
                1,
                1,
                1,
                // Causal as FlashAttention's API expresses it: no limit to the left (the
                // whole sequence), none to the right of each row's own position.
                n_u as c_int,
                0,
                0.0,
                std::ptr::null(),
                0,
                0,
                std::ptr::null(),
                0,
                0,
                stream.cu_stream() as *mut c_void,
            );
        }
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
        let src = super::view_of::<f32>(&s, layout, "fa2 lse")?;
        stream.memcpy_dtod(&src, &mut l.slice_mut(0..t * h)).w()?;
    }
    Ok(tensor_from(&dev, out, (t, h, d)))
}
