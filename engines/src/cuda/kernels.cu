// kvbench CUDA kernels: paged KV-cache writes and gathers, and paged decode attention
// that reads K/V through block tables (flash-decoding: key partitions in parallel,
// then one reduction). bf16 storage, f32 arithmetic.
//
// Layouts (one layer):
//   cache  [num_blocks * block_size, KVH, D]   slot = block * block_size + offset
//   tables [rows, max_blocks] int32             block ids of each row's sequence
//   q, out [rows, H, D]                          H = KVH * G (grouped-query attention)
//
// Compiled to PTX for sm_90 by engines/build.rs and loaded at run time.

#include <cuda_bf16.h>
#include <stdint.h>

#define WARP 32

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// k/v rows [T, KVH, D] into the cache at slots[T]; grid T, any block size.
extern "C" __global__ void kv_write_bf16(
    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
    __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ slots, int row_elems) {
    const int t = blockIdx.x;
    const int64_t dst = (int64_t)slots[t] * row_elems;
    const int64_t src = (int64_t)t * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        k_cache[dst + i] = k[src + i];
        v_cache[dst + i] = v[src + i];
    }
}

// The first n tokens of one sequence's K/V, contiguous: out [n, KVH, D]; grid n.
extern "C" __global__ void kv_gather_bf16(
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    __nv_bfloat16* __restrict__ k_out, __nv_bfloat16* __restrict__ v_out,
    const int32_t* __restrict__ table, int block_size, int row_elems) {
    const int t = blockIdx.x;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    const int64_t src = slot * row_elems;
    const int64_t dst = (int64_t)t * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        k_out[dst + i] = k_cache[src + i];
        v_out[dst + i] = v_cache[src + i];
    }
}

// Partition pass of paged decode attention.
// grid (rows, KVH, parts), block DECODE_THREADS. Each block takes the G query heads
// that share one KV head over keys [part * P, min(ctx, (part + 1) * P)) and writes
// the partition's max score m, sum of exp l, and unnormalized output acc (f32) to
// scratch laid out [rows, H, parts] (+ D for acc). Empty partitions write m = -inf.
// Shared memory: G * D floats of q, G * P floats of scores.
#define DECODE_THREADS 128
extern "C" __global__ void paged_decode_part_bf16(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, int num_kv_heads, int group,
    int head_dim, int block_size, int max_blocks, int part_size, float scale) {
    extern __shared__ float smem[];
    const int row = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int parts = gridDim.z;
    const int H = num_kv_heads * group;
    const int D = head_dim;
    const int ctx = ctx_lens[row];
    const int start = part * part_size;
    const int end = min(ctx, start + part_size);
    const int n = end - start;
    float* sq = smem;                  // [G, D]
    float* ss = smem + group * D;      // [G, P]
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;

    if (n <= 0) {
        for (int i = threadIdx.x; i < group; i += blockDim.x) {
            const int64_t o = ((int64_t)row * H + kvh * group + i) * parts + part;
            part_m[o] = -INFINITY;
            part_l[o] = 0.f;
        }
        for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
            const int g = i / D, d = i % D;
            const int64_t o = ((int64_t)row * H + kvh * group + g) * parts + part;
            part_acc[o * D + d] = 0.f;
        }
        return;
    }

    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        sq[i] = __bfloat162float(q[((int64_t)row * H + kvh * group + g) * D + d]);
    }
    __syncthreads();

    // Scores: one warp per key, lanes over the head dimension.
    const int32_t* table = tables + (int64_t)row * max_blocks;
    const int row_elems = num_kv_heads * D;
    for (int j = warp; j < n; j += warps) {
        const int t = start + j;
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const __nv_bfloat16* kr = k_cache + slot * row_elems + (int64_t)kvh * D;
        for (int g = 0; g < group; ++g) {
            float acc = 0.f;
            for (int d = lane; d < D; d += WARP) acc += sq[g * D + d] * __bfloat162float(kr[d]);
            acc = warp_sum(acc);
            if (lane == 0) ss[g * part_size + j] = acc * scale;
        }
    }
    __syncthreads();

    // Per head: max and sum of exp over the partition (one warp per head at a time).
    for (int g = warp; g < group; g += warps) {
        float m = -INFINITY;
        for (int j = lane; j < n; j += WARP) m = fmaxf(m, ss[g * part_size + j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += WARP) {
            const float p = __expf(ss[g * part_size + j] - m);
            ss[g * part_size + j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            const int64_t o = ((int64_t)row * H + kvh * group + g) * parts + part;
            part_m[o] = m;
            part_l[o] = l;
        }
    }
    __syncthreads();

    // acc[g, d] = sum_j p[g, j] * V[j, d]; threads over (g, d), keys in order.
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float acc = 0.f;
        for (int j = 0; j < n; ++j) {
            const int t = start + j;
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            acc += ss[g * part_size + j] *
                   __bfloat162float(v_cache[slot * row_elems + (int64_t)kvh * D + d]);
        }
        const int64_t o = ((int64_t)row * H + kvh * group + g) * parts + part;
        part_acc[o * D + d] = acc;
    }
}

// Reduction pass: grid (rows, H), block >= D threads. out = sum_p acc_p e^{m_p - M} /
// sum_p l_p e^{m_p - M}; lse (optional, may be null) = M + log(L) in natural log of
// the scaled scores.
extern "C" __global__ void paged_decode_reduce_bf16(
    const float* __restrict__ part_m, const float* __restrict__ part_l,
    const float* __restrict__ part_acc, __nv_bfloat16* __restrict__ out,
    float* __restrict__ lse, int num_heads, int head_dim, int parts) {
    const int row = blockIdx.x, h = blockIdx.y;
    const int64_t base = ((int64_t)row * num_heads + h) * parts;
    float M = -INFINITY;
    for (int p = 0; p < parts; ++p) M = fmaxf(M, part_m[base + p]);
    float L = 0.f;
    for (int p = 0; p < parts; ++p)
        if (part_m[base + p] > -INFINITY) L += part_l[base + p] * __expf(part_m[base + p] - M);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < parts; ++p)
            if (part_m[base + p] > -INFINITY)
                acc += part_acc[(base + p) * head_dim + d] * __expf(part_m[base + p] - M);
        out[((int64_t)row * num_heads + h) * head_dim + d] = __float2bfloat16(acc / L);
    }
    if (lse != nullptr && threadIdx.x == 0) lse[(int64_t)row * num_heads + h] = M + logf(L);
}

// ---------------------------------------------------------------------------------
// Flash prefill: causal attention of T query rows of one sequence (positions
// ctx_before .. ctx_before + T - 1) over its keys 0 .. ctx_before + T - 1, read in
// place through the block table. Online softmax over key tiles (FlashAttention-2
// order), products on the tensor cores (WMMA, bf16 in, f32 accumulate); no score
// matrix leaves shared memory. grid (ceil(T / 64), H), block 128 (4 warps x 16 rows).
#include <mma.h>
using namespace nvcuda;

#define FP_BM 64
#define FP_BN 64
#define FP_WARPS 4
#define FP_PAD 8

template <int D>
struct FlashSmem {
    static constexpr int LDQ = D + FP_PAD;       // bf16 rows of Q, K, V
    static constexpr int LDS = FP_BN + 4;        // f32 scores
    static constexpr int LDP = FP_BN + FP_PAD;   // bf16 probabilities
    static constexpr int LDO = D + 4;            // f32 output accumulators
    static constexpr int Q = 0;
    static constexpr int K = Q + FP_BM * LDQ * 2;
    static constexpr int V = K + FP_BN * LDQ * 2;
    static constexpr int S = V + FP_BN * LDQ * 2;
    static constexpr int P = S + FP_WARPS * 16 * LDS * 4;
    static constexpr int O = P + FP_WARPS * 16 * LDP * 2;
    static constexpr int M = O + FP_WARPS * 16 * LDO * 4;
    static constexpr int L = M + FP_BM * 4;
    static constexpr int BYTES = L + FP_BM * 4;
};

template <int D>
__device__ void flash_prefill(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ table,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    using L = FlashSmem<D>;
    extern __shared__ __align__(128) unsigned char fsmem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)(fsmem + L::Q);
    __nv_bfloat16* Ks = (__nv_bfloat16*)(fsmem + L::K);
    __nv_bfloat16* Vs = (__nv_bfloat16*)(fsmem + L::V);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float* Sw = (float*)(fsmem + L::S) + warp * 16 * L::LDS;
    __nv_bfloat16* Pw = (__nv_bfloat16*)(fsmem + L::P) + warp * 16 * L::LDP;
    float* Ow = (float*)(fsmem + L::O) + warp * 16 * L::LDO;
    float* Ms = (float*)(fsmem + L::M);
    float* Ls = (float*)(fsmem + L::L);

    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int row0 = blockIdx.x * FP_BM;
    const int rows = min(FP_BM, T - row0);
    const int n_keys = ctx_before + row0 + rows;  // keys the block's last row sees
    constexpr int CH = D / 8;                     // 16-byte chunks per row

    for (int i = threadIdx.x; i < FP_BM * CH; i += blockDim.x) {
        const int r = i / CH, c = (i % CH) * 8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < rows) x = *(const uint4*)(q + ((int64_t)(row0 + r) * num_heads + h) * D + c);
        *(uint4*)(Qs + r * L::LDQ + c) = x;
    }
    for (int i = lane; i < 16 * L::LDO; i += WARP) Ow[i] = 0.f;
    if (threadIdx.x < FP_BM) {
        Ms[threadIdx.x] = -INFINITY;
        Ls[threadIdx.x] = 0.f;
    }
    // The warp's rows and the last position among them.
    const int wrow0 = warp * 16;
    const int wlast = ctx_before + row0 + min(wrow0 + 15, rows - 1);
    const int r = lane >> 1, half = lane & 1;  // softmax: two lanes per row
    const int pos = ctx_before + row0 + wrow0 + r;

    for (int kt = 0; kt < n_keys; kt += FP_BN) {
        __syncthreads();
        for (int i = threadIdx.x; i < FP_BN * CH; i += blockDim.x) {
            const int j = i / CH, c = (i % CH) * 8;
            const int t = kt + j;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (t < n_keys) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const int64_t off = (slot * num_kv_heads + kvh) * D + c;
                kx = *(const uint4*)(k_cache + off);
                vx = *(const uint4*)(v_cache + off);
            }
            *(uint4*)(Ks + j * L::LDQ + c) = kx;
            *(uint4*)(Vs + j * L::LDQ + c) = vx;
        }
        __syncthreads();
        // Tiles wholly above the diagonal for these rows, and rows past T, do nothing.
        if (wrow0 >= rows || kt > wlast) continue;

        // S = Q_w K^T (16 x 64).
        for (int nb = 0; nb < FP_BN / 16; ++nb) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
                wmma::load_matrix_sync(a, Qs + wrow0 * L::LDQ + kk * 16, L::LDQ);
                wmma::load_matrix_sync(b, Ks + nb * 16 * L::LDQ + kk * 16, L::LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(Sw + nb * 16, acc, L::LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax: lane pair (r, half) covers columns half*32 .. half*32+31.
        float mx = -INFINITY;
        for (int c = half * 32; c < half * 32 + 32; ++c) {
            const int key = kt + c;
            float s = Sw[r * L::LDS + c] * scale;
            if (key > pos || key >= n_keys) s = -INFINITY;
            Sw[r * L::LDS + c] = s;
            mx = fmaxf(mx, s);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_old = Ms[wrow0 + r];
        const float m_new = fmaxf(m_old, mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        float sum = 0.f;
        for (int c = half * 32; c < half * 32 + 32; ++c) {
            const float p = __expf(Sw[r * L::LDS + c] - m_use);
            Pw[r * L::LDP + c] = __float2bfloat16(p);
            sum += p;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        const float alpha = __expf(m_old - m_use);
        for (int c = half * (D / 2); c < half * (D / 2) + D / 2; ++c) Ow[r * L::LDO + c] *= alpha;
        __syncwarp();
        if (half == 0) {
            Ls[wrow0 + r] = Ls[wrow0 + r] * alpha + sum;
            Ms[wrow0 + r] = m_new;
        }

        // O_w += P_w V (16 x D).
        for (int db = 0; db < D / 16; ++db) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, Ow + db * 16, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < FP_BN / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
                wmma::load_matrix_sync(a, Pw + kk * 16, L::LDP);
                wmma::load_matrix_sync(b, Vs + kk * 16 * L::LDQ + db * 16, L::LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(Ow + db * 16, acc, L::LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }
    __syncthreads();
    if (wrow0 + r < rows) {
        const float l = Ls[wrow0 + r];
        const int64_t o = ((int64_t)(row0 + wrow0 + r) * num_heads + h) * D;
        for (int c = half * (D / 2); c < half * (D / 2) + D / 2; ++c)
            out[o + c] = __float2bfloat16(Ow[r * L::LDO + c] / l);
        if (lse != nullptr && half == 0)
            lse[(int64_t)(row0 + wrow0 + r) * num_heads + h] = Ms[wrow0 + r] + logf(l);
    }
}

extern "C" __global__ void __launch_bounds__(128) flash_prefill_d64_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const int32_t* table, __nv_bfloat16* out, float* lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    flash_prefill<64>(q, k_cache, v_cache, table, out, lse, T, ctx_before, num_heads,
                      num_kv_heads, block_size, scale);
}

extern "C" __global__ void __launch_bounds__(128) flash_prefill_d128_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const int32_t* table, __nv_bfloat16* out, float* lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    flash_prefill<128>(q, k_cache, v_cache, table, out, lse, T, ctx_before, num_heads,
                       num_kv_heads, block_size, scale);
}
