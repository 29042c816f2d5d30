//! The f32 weight matrices of a CPU model in one buffer backed by huge pages. A batch-1
//! decode step streams every weight once; with 4 KiB pages that is a TLB miss every
//! 1,024 floats, with 2 MiB pages one every half a million. Linux gives huge pages to
//! anonymous memory only where asked (`transparent_hugepage=madvise`, a common
//! default), and a matrix of a small model (1–4 MB) rarely holds an aligned 2 MiB page
//! of its own: the matrices are copied into one buffer advised `MADV_HUGEPAGE` before
//! it is touched, each weight a view of it. Elsewhere the weights stay as they are.

use crate::error::Result;
use candle_core::Tensor;

/// Floats in a 64-byte cache line.
const LINE_FLOATS: usize = 16;

/// `ts` as views of one buffer in huge pages where the platform gives them; tensors
/// that are not contiguous f32 on the CPU, and every tensor off Linux, come back as
/// they were. Each tensor is dropped once copied, so a model held only here costs its
/// weights once more at most by the largest tensor, not twice.
pub fn in_one_huge_buffer(ts: Vec<Tensor>) -> Result<Vec<Tensor>> {
    #[cfg(target_os = "linux")]
    {
        use candle_core::{CpuStorage, DType, Storage};
        let movable =
            |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
        let total: usize = ts
            .iter()
            .filter(|t| movable(t))
            .map(Tensor::elem_count)
            .sum();
        if total == 0 {
            return Ok(ts);
        }
        // Each tensor starts on a cache line: the allocator hands a buffer this large
        // 16 bytes into a page, and the packed kernel's 32-byte loads from a matrix at
        // such an offset split a line every other load (from the L2, a product took
        // 1.6x as long).
        let lines = ts.len() + 1;
        let cap = total + lines * LINE_FLOATS;
        let mut buf: Vec<f32> = Vec::with_capacity(cap);
        advise_huge(buf.as_mut_ptr() as usize, cap * 4);
        // Where each tensor went: its offset and shape in the buffer, or itself.
        let mut placed: Vec<std::result::Result<(usize, candle_core::Shape), Tensor>> =
            Vec::with_capacity(ts.len());
        for t in ts {
            if !movable(&t) {
                placed.push(Err(t));
                continue;
            }
            let copied = {
                let (storage, layout) = t.storage_and_layout();
                match &*storage {
                    Storage::Cpu(CpuStorage::F32(data)) => {
                        let start = layout.start_offset();
                        // Up to the next cache line (within the capacity reserved).
                        let misaligned = (buf.as_ptr() as usize + buf.len() * 4) % 64 / 4;
                        if misaligned != 0 {
                            buf.resize(buf.len() + LINE_FLOATS - misaligned, 0.0);
                        }
                        let off = buf.len();
                        buf.extend_from_slice(&data[start..start + t.elem_count()]);
                        Some(off)
                    }
                    _ => None,
                }
            };
            placed.push(match copied {
                Some(off) => Ok((off, t.shape().clone())),
                None => Err(t),
            });
        }
        let n = buf.len();
        let arena = Tensor::from_vec(buf, n, &candle_core::Device::Cpu)?;
        placed
            .into_iter()
            .map(|p| match p {
                Ok((off, shape)) => Ok(arena.narrow(0, off, shape.elem_count())?.reshape(shape)?),
                Err(t) => Ok(t),
            })
            .collect()
    }
    #[cfg(not(target_os = "linux"))]
    {
        Ok(ts)
    }
}

/// `n` copies of `v` in a buffer advised huge pages as the weights are (the read
/// bandwidth probe measures memory as the weights sit in it).
pub fn huge_vec(n: usize, v: f32) -> Vec<f32> {
    let mut buf: Vec<f32> = Vec::with_capacity(n);
    #[cfg(target_os = "linux")]
    advise_huge(buf.as_mut_ptr() as usize, n * 4);
    buf.resize(n, v);
    buf
}

/// Seconds of one pass summing `buf` split evenly over `threads` threads (each its own
/// contiguous part), and the sum: the memory read bandwidth a batch-1 f32 decode step
/// works against (`examples/read_bandwidth.rs`, `examples/decode_products.rs`). A
/// caller keeps the sum so the pass cannot be optimized away.
pub fn read_pass(buf: &[f32], threads: usize) -> (f64, f32) {
    let chunk = buf.len().div_ceil(threads.max(1)).max(1);
    let t = std::time::Instant::now();
    let total: f32 = std::thread::scope(|s| {
        let hs: Vec<_> = buf.chunks(chunk).map(|c| s.spawn(move || sum(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or(f32::NAN)).sum()
    });
    (t.elapsed().as_secs_f64(), total)
}

/// Sum with four independent accumulators of eight lanes (AVX2 where the CPU has it).
fn sum(a: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { sum_avx2(a) };
    }
    let mut acc = [0f32; 32];
    let chunks = a.chunks_exact(32);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (x, y) in acc.iter_mut().zip(c) {
            *x += y;
        }
    }
    acc.iter().sum::<f32>() + rest
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(a: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    let p = a.as_ptr();
    let mut i = 0;
    while i + 32 <= a.len() {
        for (j, x) in acc.iter_mut().enumerate() {
            *x = _mm256_add_ps(*x, _mm256_loadu_ps(p.add(i + 8 * j)));
        }
        i += 32;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum::<f32>() + a[i..].iter().sum::<f32>()
}

/// Ask for huge pages on the 2 MiB-aligned inner part of `[addr, addr + len)`, not yet
/// touched. A refusal (no THP in the kernel) leaves ordinary pages: nothing to report.
#[cfg(target_os = "linux")]
fn advise_huge(addr: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    let start = addr.next_multiple_of(HUGE);
    let end = (addr + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside an allocation this process owns; MADV_HUGEPAGE
        // only changes how its pages are backed, never their contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn weights_keep_their_values_and_shapes_as_views_of_one_buffer() {
        use candle_core::{CpuStorage, Storage};
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 6000.0, &dev)
            .unwrap()
            .reshape((60, 100))
            .unwrap();
        // 37 floats: the next tensor would start mid-line without the padding.
        let b = Tensor::arange(0f32, 37.0, &dev).unwrap();
        let c = Tensor::arange(0f32, 64.0, &dev).unwrap();
        let half = a.to_dtype(DType::BF16).unwrap();
        let strided = a.t().unwrap();
        let out = in_one_huge_buffer(vec![
            a.clone(),
            b.clone(),
            c.clone(),
            half.clone(),
            strided.clone(),
        ])
        .unwrap();
        // Where each view starts: its buffer's address and its offset in floats.
        let at = |t: &Tensor| {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cpu(CpuStorage::F32(d)) = &*storage else {
                panic!("not f32 on the CPU")
            };
            (d.as_ptr() as usize, layout.start_offset())
        };
        for (x, y) in [(&out[0], &a), (&out[1], &b), (&out[2], &c)] {
            assert_eq!(x.dims(), y.dims());
            assert!(x.is_contiguous());
            let d = (x - y).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
            // Each on a cache line of its own start.
            let (base, off) = at(x);
            assert_eq!((base + 4 * off) % 64, 0, "{:?} starts off a line", x.dims());
        }
        // One buffer: each weight starts within a line of where the one before ends.
        let (base, first) = at(&out[0]);
        assert!(first < LINE_FLOATS);
        for (i, len) in [(1, 6000), (2, 37)] {
            let (b_i, off) = at(&out[i]);
            let (_, prev) = at(&out[i - 1]);
            assert_eq!(b_i, base);
            assert!(
                (prev + len..prev + len + LINE_FLOATS).contains(&off),
                "tensor {i} at {off}"
            );
        }
        // Other dtypes and strided tensors come back as they were.
        assert_eq!(out[3].id(), half.id());
        assert_eq!(out[4].id(), strided.id());
    }

    #[test]
    fn a_read_pass_sums_every_element_once_whatever_the_threads() {
        // 1,000,003 ones: not a multiple of the threads nor of the 32-lane chunks.
        let buf = huge_vec(1_000_003, 1.0);
        for threads in [1, 2, 3, 8] {
            let (secs, total) = read_pass(&buf, threads);
            assert!(secs > 0.0);
            assert_eq!(total, 1_000_003.0, "{threads} threads");
        }
    }
}
