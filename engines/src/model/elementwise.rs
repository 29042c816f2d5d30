//! The layer's elementwise work on the CPU (the residual add, SwiGLU's product), split
//! over the thread pool that runs the forward. candle runs these operations on a pool
//! of its own, whose worker sleeps between two of them and is woken for each: in a
//! 576-token prefill, about half of the time the forward's thread ran alone went to
//! waiting for it, and the prefill took about 1.18× as long
//! (docs/correctness-and-performance.md). The arithmetic is candle's, element for
//! element, so the results are the same to the bit.

use crate::error::Result;
use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;

/// Elements below which the work stays on the calling thread (a decode step's rows:
/// a few microseconds).
const SERIAL: usize = 1 << 15;
/// Elements a job takes at least.
const MIN_JOB: usize = 1 << 13;

/// `a + b` for two f32 CPU tensors of one shape; `None` where that does not hold
/// (candle's operation then runs).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    zip_with(a, b, |x, y| x + y)
}

/// `silu(gate) · up` as candle computes it (`g / (1 + e^{−g}) · u`); `None` unless both
/// are f32 CPU tensors of one shape.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    zip_with(gate, up, |g, u| g / (1.0 + (-g).exp()) * u)
}

fn zip_with(a: &Tensor, b: &Tensor, f: impl Fn(f32, f32) -> f32 + Sync) -> Result<Option<Tensor>> {
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    if !cpu_f32(a) || !cpu_f32(b) || a.shape() != b.shape() {
        return Ok(None);
    }
    let n = a.elem_count();
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(da)), Storage::Cpu(CpuStorage::F32(db))) = (&*sa, &*sb)
    else {
        return Ok(None);
    };
    let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_offsets(), lb.contiguous_offsets())
    else {
        return Ok(None);
    };
    let (xa, xb) = (&da[a0..a1], &db[b0..b1]);
    let out: Vec<f32> = if n < SERIAL || rayon::current_num_threads() == 1 {
        xa.iter().zip(xb).map(|(&x, &y)| f(x, y)).collect()
    } else {
        xa.par_iter()
            .zip(xb)
            .with_min_len(MIN_JOB)
            .map(|(&x, &y)| f(x, y))
            .collect()
    };
    drop((sa, sb));
    Ok(Some(Tensor::from_vec(out, a.shape(), a.device())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| rng.random_range(-12.0f32..12.0))
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The same bits as candle's operations, on the calling thread (one row) and split
    /// over the pool (576 rows), for contiguous views at an offset (the halves of a
    /// batched gate/up product); other inputs are left to candle.
    #[test]
    fn elementwise_ops_match_candle_to_the_bit() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for rows in [1, 576] {
            let y = Tensor::stack(&[random((rows, 1536), 1), random((rows, 1536), 2)], 0).unwrap();
            let (g, u) = (y.get(0).unwrap(), y.get(1).unwrap());
            let want = (candle_nn::ops::silu(&g).unwrap() * &u).unwrap();
            let got = pool
                .install(|| silu_mul(&g, &u))
                .unwrap()
                .expect("f32 on the CPU");
            assert_eq!(got.dims(), want.dims());
            let (got, want) = (
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let want = (&g + &u)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let got = pool
                .install(|| add(&g, &u))
                .unwrap()
                .expect("f32 on the CPU");
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        let a = random((4, 8), 3);
        assert!(
            add(&a, &random((8, 4), 4)).unwrap().is_none(),
            "shapes differ"
        );
        assert!(
            add(&a.t().unwrap(), &random((8, 4), 5)).unwrap().is_none(),
            "strided"
        );
        let bf = a.to_dtype(DType::BF16).unwrap();
        assert!(silu_mul(&bf, &bf).unwrap().is_none(), "bf16");
    }
}
