//! f32 weight matrices laid out for the CPU's matrix-vector path. A batch-1 decode step
//! reads every weight once. Read one row after another, SmolLM2's matrices (a pass over
//! the thread pool each, as the products run) streamed at 76–84 % of the read probe on
//! the 2-vCPU development machine; stored as groups of four rows with each 8-column
//! chunk of the four side by side, the same bytes are one stream that feeds four dot
//! products, and read at 87–96 % (`examples/row_order.rs`,
//! docs/correctness-and-performance.md). gemm cannot read this layout, so a product of
//! more rows (prefill, a larger decode batch) unpacks a block of rows at a time into a
//! buffer that stays in cache and runs gemm on it.

use crate::error::{Error, Result};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use rayon::prelude::*;

/// Rows in a group.
pub const GROUP: usize = 4;
/// Rows unpacked at a time for gemm: about a megabyte of SmolLM2's rows, so the block
/// is still in cache when gemm reads it.
const UNPACK_ROWS: usize = 512;
/// Rows of input up to which a product of the rows-first form (`W·xᵀ`) runs, as
/// [`super::Linear::forward`] does for the row layout (measured faster for few rows).
const SMALL_M: usize = 64;
/// Multiply-adds of a product below which it runs on the calling thread (gemm's own
/// threshold for splitting one is 48·48·256).
const SERIAL_WORK: usize = 48 * 48 * 256;

thread_local! {
    /// The unpacked block [`PackedRows::matmul`] hands to gemm, kept between products.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An f32 matrix `[n, k]` on the CPU held as `ceil(n / 4)` groups of four rows (zero
/// rows pad the last group). A group is `4·k` floats: for each 8-column chunk the four
/// rows' 8 floats one after another, then the four rows' last `k % 8` columns, row by
/// row.
#[derive(Debug, Clone)]
pub struct PackedRows {
    /// `[groups · 4 · k]` f32 on the CPU (a view into the model's huge-page buffer once
    /// it is moved there).
    data: Tensor,
    n: usize,
    k: usize,
}

/// `w` (`[n, k]` row-major) packed: groups of four rows as [`PackedRows`] lays them out.
pub fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert!(
        w.len() >= n * k,
        "pack: {} floats for a {n}×{k} matrix",
        w.len()
    );
    let full = k / 8 * 8;
    let tail = k - full;
    let mut out = vec![0f32; n.div_ceil(GROUP) * GROUP * k];
    out.par_chunks_mut(GROUP * k)
        .enumerate()
        .for_each(|(g, dst)| {
            for r in 0..GROUP.min(n - g * GROUP) {
                let src = &w[(g * GROUP + r) * k..][..k];
                for c in (0..full).step_by(8) {
                    dst[GROUP * c + 8 * r..][..8].copy_from_slice(&src[c..c + 8]);
                }
                dst[GROUP * full + r * tail..][..tail].copy_from_slice(&src[full..]);
            }
        });
    out
}

/// The four rows of a packed group (`4·k` floats) into `out` (`[4, k]` row-major).
pub fn unpack_group(group: &[f32], k: usize, out: &mut [f32]) {
    let full = k / 8 * 8;
    let tail = k - full;
    for (r, row) in out.chunks_exact_mut(k).take(GROUP).enumerate() {
        for c in (0..full).step_by(8) {
            row[c..c + 8].copy_from_slice(&group[GROUP * c + 8 * r..][..8]);
        }
        row[full..].copy_from_slice(&group[GROUP * full + r * tail..][..tail]);
    }
}

impl PackedRows {
    /// `w` packed, when it is a `[n, k]` f32 matrix on the CPU; `None` otherwise.
    pub fn from_tensor(w: &Tensor) -> Result<Option<Self>> {
        if !w.device().is_cpu() || w.dtype() != DType::F32 || w.rank() != 2 {
            return Ok(None);
        }
        let (n, k) = w.dims2()?;
        let rows = w.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let packed = pack(&rows, n, k);
        let len = packed.len();
        Ok(Some(Self {
            data: Tensor::from_vec(packed, len, &Device::Cpu)?,
            n,
            k,
        }))
    }

    /// `[n, k]`: the matrix's rows and columns (without the padding rows).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held, the padding rows included.
    pub fn bytes(&self) -> u64 {
        (self.data.elem_count() * 4) as u64
    }

    /// The packed floats as one tensor (to move them, as the model's weights move into
    /// huge pages).
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    /// A `[n, k]` matrix from floats already packed (`data`: 1-D f32 on the CPU, as
    /// [`PackedRows::data`] gave them).
    pub fn from_packed(data: Tensor, n: usize, k: usize) -> Result<Self> {
        let want = n.div_ceil(GROUP) * GROUP * k;
        if data.elem_count() != want
            || data.dtype() != DType::F32
            || data.rank() != 1
            || !data.device().is_cpu()
        {
            return Err(Error::Config(format!(
                "a packed {n}×{k} matrix needs {want} f32 on the CPU, got {:?} {:?} on {:?}",
                data.dims(),
                data.dtype(),
                data.device().location()
            )));
        }
        Ok(Self { data, n, k })
    }

    /// `f` on the packed floats.
    pub fn with_slice<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        let (storage, layout) = self.data.storage_and_layout();
        match &*storage {
            Storage::Cpu(CpuStorage::F32(d)) if self.data.is_contiguous() => {
                Ok(f(&d[layout.start_offset()..][..self.data.elem_count()]))
            }
            _ => Err(Error::Config(
                "a packed matrix is not contiguous f32 on the CPU".into(),
            )),
        }
    }

    /// The matrix in the row layout (`[n, k]`).
    pub fn unpack(&self) -> Result<Tensor> {
        let (n, k) = (self.n, self.k);
        let rows = self.with_slice(|d| {
            let mut rows = vec![0f32; n.div_ceil(GROUP) * GROUP * k];
            rows.par_chunks_mut(GROUP * k)
                .zip(d.par_chunks(GROUP * k))
                .for_each(|(out, g)| unpack_group(g, k, out));
            rows.truncate(n * k);
            rows
        })?;
        Ok(Tensor::from_vec(rows, (n, k), &Device::Cpu)?)
    }

    /// Rows `ids` of the matrix (`[ids.len(), k]`): the lookup of an embedding table
    /// packed for the output head it is tied to, so the table is not held twice.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let (n, k) = (self.n, self.k);
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= n) {
            return Err(Error::Config(format!(
                "row {bad} of a packed {n}×{k} matrix"
            )));
        }
        let full = k / 8 * 8;
        let tail = k - full;
        let out = self.with_slice(|d| {
            let mut out = vec![0f32; ids.len() * k];
            for (row, &id) in out.chunks_exact_mut(k).zip(ids) {
                let (g, r) = (id as usize / GROUP, id as usize % GROUP);
                let group = &d[g * GROUP * k..][..GROUP * k];
                for c in (0..full).step_by(8) {
                    row[c..c + 8].copy_from_slice(&group[GROUP * c + 8 * r..][..8]);
                }
                row[full..].copy_from_slice(&group[GROUP * full + r * tail..][..tail]);
            }
            out
        })?;
        Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
    }

    /// `x·Wᵀ` for an f32 `x` (`[t, k]`) of any number of rows, through gemm on blocks
    /// of about [`UNPACK_ROWS`] rows, each thread unpacking its own share of the rows
    /// block by block into a buffer of its own. The
    /// matrix-vector path (few rows) reads the packed rows directly instead
    /// (`super::gemv_many`).
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        // Leading dimensions (a batch of sequences) are rows like any other.
        if x.rank() > 2 {
            let dims = x.dims();
            let k = dims[dims.len() - 1];
            let y = self.matmul(&x.reshape(((), k))?)?;
            let mut out = dims[..dims.len() - 1].to_vec();
            out.push(self.n);
            return Ok(y.reshape(out)?);
        }
        let (t, k) = x.dims2()?;
        if k != self.k || x.dtype() != DType::F32 || !x.device().is_cpu() {
            return Err(Error::Config(format!(
                "packed {}×{} matrix times a {:?} {:?} input on {:?}",
                self.n,
                self.k,
                x.dims(),
                x.dtype(),
                x.device().location()
            )));
        }
        let n = self.n;
        let x = x.contiguous()?;
        let (x_storage, x_layout) = x.storage_and_layout();
        let Storage::Cpu(CpuStorage::F32(x_data)) = &*x_storage else {
            return Err(Error::Config(
                "an f32 CPU tensor without f32 CPU storage".into(),
            ));
        };
        let xs = &x_data[x_layout.start_offset()..][..t * k];
        // Left unset: gemm writes every element (it is told not to read the
        // destination), and zeroing it first (up to 3.5 MB a product at 576 rows) took
        // about 7 % of the samples of the thread running a 576-token prefill.
        let mut out: Vec<f32> = Vec::with_capacity(t * n);
        let groups = n.div_ceil(GROUP);
        // Each thread takes one contiguous run of the matrix's rows (the output's
        // columns) and runs gemm on its own: the rows it unpacks stay in its core's
        // cache for gemm, and no thread waits for another inside a product (gemm's own
        // split over two threads waits at each of its passes, and a 576-token prefill
        // took about 1.06x as long: docs/correctness-and-performance.md, "Each thread its own
        // rows of a product"). Which thread computes an element does not change how
        // it is summed, so the results are the same to the bit.
        let threads = rayon::current_num_threads();
        // At least two groups a part and a block, so that none is a single row (gemm
        // takes a matrix-vector path for one, which sums in another order).
        let parts = if t * n * k < SERIAL_WORK {
            1
        } else {
            threads.min(groups / 2).max(1)
        };
        let dst = SendPtr(out.as_mut_ptr());
        // Part `p` of `parts` even shares of `len` groups from `start`.
        let share = |start: usize, len: usize, parts: usize, p: usize| {
            (start + p * len / parts, start + (p + 1) * len / parts)
        };
        let part = |d: &[f32], p: usize| {
            let (g0, g1) = share(0, groups, parts, p);
            // Blocks of at most about UNPACK_ROWS rows, as even as whole groups make them.
            let blocks = ((g1 - g0) * GROUP).div_ceil(UNPACK_ROWS).max(1);
            let most = (g1 - g0).div_ceil(blocks);
            // This thread's buffer from its last product: a new one each time would be
            // page faults and zeroing per block, as costly as the unpacking.
            let mut buf = SCRATCH.with(|c| c.take());
            if buf.len() < most * GROUP * k {
                buf.resize(most * GROUP * k, 0.0);
            }
            for b in 0..blocks {
                let (g, ge) = share(g0, g1 - g0, blocks, b);
                let ng = ge - g;
                let src = &d[g * GROUP * k..(g + ng) * GROUP * k];
                for (o, gr) in buf.chunks_mut(GROUP * k).zip(src.chunks(GROUP * k)) {
                    unpack_group(gr, k, o);
                }
                let r0 = g * GROUP;
                let nb = (ng * GROUP).min(n - r0);
                // SAFETY: `buf` holds `nb` rows of `k` ([nb, k] row-major), `xs` holds
                // `t` rows of `k`, and the destination is columns `r0..r0 + nb` of the
                // `[t, n]` output, which no other part writes: every index gemm forms
                // from these sizes and strides lies inside its buffer.
                unsafe {
                    let dst = dst.get().add(r0);
                    if t <= SMALL_M {
                        // The block's rows first: [nb, t] = W_b · xᵀ, written transposed.
                        gemm_abt(nb, t, k, dst, (1, n as isize), buf.as_ptr(), xs.as_ptr());
                    } else {
                        // [t, nb] = x · W_bᵀ.
                        gemm_abt(t, nb, k, dst, (n as isize, 1), xs.as_ptr(), buf.as_ptr());
                    }
                }
            }
            SCRATCH.with(|c| c.replace(buf));
        };
        // Handed out as a decode step's products are (`super::team`): one part a
        // thread, on the calling thread alone for one.
        self.with_slice(|d| super::team::for_each_share(parts, &|p| part(d, p)))?;
        drop(x_storage);
        // SAFETY: the parts cover columns `0..n` of all `t` rows, and gemm (with
        // `read_dst` false) wrote each of those elements.
        unsafe { out.set_len(t * n) };
        Ok(Tensor::from_vec(out, (t, n), &Device::Cpu)?)
    }
}

/// An output buffer shared by the parts of a product, each writing its own elements.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: the parts write disjoint elements, and the buffer outlives them (the parallel
// loop returns before it is used again).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that closures take the whole `SendPtr`).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `dst = a · bᵀ` for row-major `a` (`[m, k]`) and `b` (`[n, k]`), element `(i, j)` of
/// `dst` at `dst + i·rs + j·cs` for `(rs, cs)` = `dst_strides`.
///
/// # Safety
/// `a` and `b` must be valid for `m·k` and `n·k` floats, and every element of `dst`
/// those strides reach must be inside one writable buffer.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_abt(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    (rs, cs): (isize, isize),
    a: *const f32,
    b: *const f32,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        cs,
        rs,
        false,
        a,
        1,
        k as isize,
        b,
        k as isize,
        1,
        0f32,
        1f32,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::paged::{dot4_packed_with, dot_row_with, has_avx2_fma};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Packing and unpacking give the matrix back, padding rows aside, for widths with
    /// and without whole chunks and heights with and without whole groups.
    #[test]
    fn pack_round_trips() {
        for (n, k) in [(1, 1), (4, 8), (7, 37), (130, 96), (9, 5)] {
            let w = random(n * k, 1);
            let p = PackedRows::from_tensor(
                &Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(),
            )
            .unwrap()
            .expect("a CPU f32 matrix packs");
            assert_eq!(p.dims(), (n, k));
            assert_eq!(p.bytes(), (n.div_ceil(4) * 4 * k * 4) as u64);
            let back = p.unpack().unwrap().flatten_all().unwrap();
            assert_eq!(back.to_vec1::<f32>().unwrap(), w, "{n}×{k}");
            let packed = pack(&w, n, k);
            let mut rows = vec![0f32; 4 * k];
            for (r, want) in w.chunks(k).enumerate() {
                unpack_group(&packed[r / 4 * 4 * k..], k, &mut rows);
                assert_eq!(&rows[r % 4 * k..][..k], want);
            }
        }
    }

    /// The packed kernel gives each row's dot product to the bit as the row kernel
    /// does (the same accumulators and order of sums), on the AVX2 path and the
    /// portable one.
    #[test]
    fn rows_of_a_packed_matrix_are_its_rows() {
        for (n, k) in [(1, 1), (7, 37), (130, 96), (9, 5), (13, 576)] {
            let w = random(n * k, 2);
            let p = PackedRows::from_tensor(
                &Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(),
            )
            .unwrap()
            .unwrap();
            let ids: Vec<u32> = (0..n as u32)
                .rev()
                .chain([0, n as u32 - 1, (n / 2) as u32])
                .collect();
            let got = p.rows(&ids).unwrap().to_vec2::<f32>().unwrap();
            for (row, &id) in got.iter().zip(&ids) {
                assert_eq!(
                    row.as_slice(),
                    &w[id as usize * k..][..k],
                    "{n}×{k}, row {id}"
                );
            }
            assert!(p.rows(&[n as u32]).is_err(), "row {n} of {n}");
        }
    }

    #[test]
    fn packed_dots_match_the_row_kernel_to_the_bit() {
        for k in [1, 7, 8, 16, 24, 37, 576] {
            let w = random(4 * k, k as u64);
            let x = random(k, 99);
            let packed = pack(&w, 4, k);
            for avx in [false, has_avx2_fma()] {
                let got = dot4_packed_with(avx, &packed, &x);
                for (r, g) in got.iter().enumerate() {
                    let want = dot_row_with(avx, &w[r * k..(r + 1) * k], &x);
                    assert_eq!(g.to_bits(), want.to_bits(), "k {k}, row {r}, avx {avx}");
                }
            }
        }
    }

    /// Two inputs at a time: each output within f32 rounding of the row kernel's, on
    /// the AVX2 path and the portable one.
    #[test]
    fn packed_dots_of_two_inputs_match_each_alone() {
        use crate::attention::paged::dot4x2_packed_with;
        for k in [1, 7, 8, 37, 576] {
            let w = random(4 * k, k as u64);
            let (x0, x1) = (random(k, 5), random(k, 6));
            let packed = pack(&w, 4, k);
            for avx in [false, has_avx2_fma()] {
                let got = dot4x2_packed_with(avx, &packed, &x0, &x1);
                for (x, g) in [&x0, &x1].into_iter().zip(got) {
                    for (r, v) in g.iter().enumerate() {
                        let want = dot_row_with(false, &w[r * k..(r + 1) * k], x);
                        assert!((v - want).abs() <= 1e-4, "k {k}, row {r}, avx {avx}");
                    }
                }
            }
        }
    }

    /// gemm over unpacked blocks against candle's matmul on the row layout, in both
    /// orientations (few and many input rows) and over several blocks.
    #[test]
    fn packed_matmul_matches_matmul() {
        for (n, k, t) in [(70, 96, 5), (1030, 40, 3), (9, 37, 70), (600, 24, 130)] {
            let w = Tensor::from_vec(random(n * k, 3), (n, k), &Device::Cpu).unwrap();
            let x = Tensor::from_vec(random(t * k, 4), (t, k), &Device::Cpu).unwrap();
            let p = PackedRows::from_tensor(&w).unwrap().unwrap();
            let got = p.matmul(&x).unwrap();
            let want = x.matmul(&w.t().unwrap()).unwrap();
            assert_eq!(got.dims(), want.dims());
            let diff = crate::compare::max_abs_diff_tensors(&got, &want);
            assert!(diff <= 1e-4, "{n}×{k}, {t} rows: {diff}");
        }
        // A batch of rows in a leading dimension.
        let (n, k) = (12, 16);
        let w = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(random(2 * 3 * k, 8), (2, 3, k), &Device::Cpu).unwrap();
        let got = PackedRows::from_tensor(&w)
            .unwrap()
            .unwrap()
            .matmul(&x)
            .unwrap();
        let want = x.broadcast_matmul(&w.t().unwrap()).unwrap();
        assert_eq!(got.dims(), &[2, 3, n]);
        let d = (got - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() <= 1e-5);
        let p = PackedRows::from_tensor(&Tensor::zeros((8, 16), DType::F32, &Device::Cpu).unwrap())
            .unwrap()
            .unwrap();
        let err = p
            .matmul(&Tensor::zeros((2, 15), DType::F32, &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("8×16") && err.contains("[2, 15]"), "{err}");
    }

    /// A product split over the threads (each its own rows of the matrix) gives the
    /// bits of the same product on one thread, in both orientations, with blocks and
    /// groups that do not divide evenly.
    #[test]
    fn products_split_over_threads_keep_the_bits() {
        for (n, k, t) in [
            (1030, 40, 70),
            (301, 64, 130),
            (130, 200, 40),
            (9, 37, 3000),
            (13, 37, 3000),
        ] {
            let w = Tensor::from_vec(random(n * k, 5), (n, k), &Device::Cpu).unwrap();
            let x = Tensor::from_vec(random(t * k, 6), (t, k), &Device::Cpu).unwrap();
            let p = PackedRows::from_tensor(&w).unwrap().unwrap();
            let on = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let y = pool.install(|| p.matmul(&x)).unwrap();
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            let one = on(1);
            for threads in [2, 3] {
                let split = on(threads);
                let differ = one
                    .iter()
                    .zip(&split)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{n}×{k}, {t} rows, {threads} threads");
            }
        }
    }

    #[test]
    fn only_cpu_f32_matrices_pack() {
        let dev = Device::Cpu;
        assert!(
            PackedRows::from_tensor(&Tensor::zeros(8, DType::F32, &dev).unwrap())
                .unwrap()
                .is_none()
        );
        assert!(
            PackedRows::from_tensor(&Tensor::zeros((4, 8), DType::F16, &dev).unwrap())
                .unwrap()
                .is_none()
        );
    }
}
