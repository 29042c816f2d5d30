//! The f32 weight matrices of a CPU model in one buffer backed by huge pages. A batch-1
//! decode step streams every weight once; with 4 KiB pages that is a TLB miss every
//! 1,024 floats, with 2 MiB pages one every half a million. Linux gives huge pages to
//! anonymous memory only where asked (`transparent_hugepage=madvise`, a common
//! default), and a matrix of a small model (1–4 MB) rarely holds an aligned 2 MiB page
//! of its own: the matrices are copied into one buffer advised `MADV_HUGEPAGE` before
//! it is touched, each weight a view of it. Elsewhere the weights stay as they are.

use crate::error::Result;
use candle_core::Tensor;

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
        let mut buf: Vec<f32> = Vec::with_capacity(total);
        advise_huge(buf.as_mut_ptr() as usize, total * 4);
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
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 6000.0, &dev)
            .unwrap()
            .reshape((60, 100))
            .unwrap();
        let b = Tensor::arange(0f32, 64.0, &dev).unwrap();
        let half = a.to_dtype(DType::BF16).unwrap();
        let strided = a.t().unwrap();
        let out =
            in_one_huge_buffer(vec![a.clone(), b.clone(), half.clone(), strided.clone()]).unwrap();
        for (x, y) in [(&out[0], &a), (&out[1], &b)] {
            assert_eq!(x.dims(), y.dims());
            assert!(x.is_contiguous());
            let d = (x - y).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        }
        // One buffer: the second weight starts where the first ends.
        assert_eq!(out[1].layout().start_offset(), 6000);
        // Other dtypes and strided tensors come back as they were.
        assert_eq!(out[2].id(), half.id());
        assert_eq!(out[3].id(), strided.id());
    }
}
