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

// Keeps the device busy for `ns` nanoseconds (one thread): `kvbench bench-decode` queues
// a round of launches behind it, so they run back to back whatever the host's pace.
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
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

// Partition pass of paged decode attention. `raw` (optional, may be null) receives
// every scaled score at [rows, H, raw_stride].
// grid (rows, KVH, parts), block DECODE_THREADS. Each block takes the G query heads
// that share one KV head over keys [part * P, min(ctx, (part + 1) * P)) and writes
// the partition's max score m, sum of exp l, and unnormalized output acc (f32) to
// scratch laid out [rows, H, parts] (+ D for acc). Empty partitions write m = -inf.
// Shared memory: G * D floats of q, G * P floats of scores.
//
// Rolling positions (StreamingLLM, algorithms.md §5): the cache holds keys without
// RoPE; each key is rotated to its index in the cache as it is read. The kept set is
// the sinks plus a contiguous window, so a key at position p has index p below the
// sinks and p - (n - m) after them (n context, m kept slots, both with the new token;
// params per row: m, n, capacity, recent; sinks = capacity - recent). cos/sin rows per
// index, [indices, D/2]; halves rotated together (non-interleaved RoPE).
#define DECODE_THREADS 128
// Key rows each lane of the vector kernel loads before using any (paged_decode_part_vec).
#define DECODE_UNROLL 4
struct Rolling {
    const int32_t* pos;     // [slots, KVH]
    const int32_t* params;  // [rows, 4]
    const float* cos;
    const float* sin;
};

// Where a partition block of the decode kernels works: grid (rows, KVH, parts), keys
// [start, end) of its row's context (n of them; none past the context), head0 the
// group's first query head in [rows, H].
struct DecodePart {
    int row, kvh, part, parts, start, end, n;
    int64_t head0;
};

__device__ __forceinline__ DecodePart decode_part(const int32_t* __restrict__ ctx_lens,
                                                  int num_kv_heads, int group, int part_size) {
    DecodePart p;
    p.row = blockIdx.x;
    p.kvh = blockIdx.y;
    p.part = blockIdx.z;
    p.parts = gridDim.z;
    p.start = p.part * part_size;
    p.end = min(ctx_lens[p.row], p.start + part_size);
    p.n = p.end - p.start;
    p.head0 = (int64_t)p.row * (num_kv_heads * group) + p.kvh * group;
    return p;
}

// Per head of the group: max m and sum of exp l of the partition's n scaled scores
// (ss [G, P]), the scores turned into exp(s - m) in place (one warp per head at a time).
__device__ __forceinline__ void partition_softmax(float* __restrict__ ss,
                                                  float* __restrict__ part_m,
                                                  float* __restrict__ part_l, int64_t head0,
                                                  int group, int part_size, int n, int parts,
                                                  int part) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
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
            const int64_t o = (head0 + g) * parts + part;
            part_m[o] = m;
            part_l[o] = l;
        }
    }
}

// Partitions a chunk of the reduction's element pass weighs at a time.
#define REDUCE_CHUNK 32

// The reduction of heads head0..head0+heads-1 over their partitions (by the whole
// block): each head's max M and sum L of exp over the partitions by one warp (lanes
// stride over the partitions), then out = sum_p acc_p e^{m_p - M} / L for each of the
// heads' D elements by the block's threads, partitions in order; lse (may be null) gets
// M + log(L). Loads bypass L1: in the folded form other blocks wrote the partitions.
// The element pass takes the partitions REDUCE_CHUNK at a time: each (head, partition)'s
// weight e^{m_p - M} is computed once into sw ([heads, REDUCE_CHUNK]; -1 marks an empty
// partition, skipped), so a thread issues a chunk's loads together where it used to
// wait on a weight's load and exponential for each partition and element (a folded
// block reduces a whole group's heads alone). The same products and sums in the same
// order as one weight per element, so the outputs are unchanged to the bit.
// The launched reduction and the folded one both run it, so they agree to the bit.
// Every thread of the block must call it (it synchronizes the block).
__device__ __forceinline__ void reduce_heads(const float* __restrict__ part_m,
                                             const float* __restrict__ part_l,
                                             const float* __restrict__ part_acc,
                                             __nv_bfloat16* __restrict__ out,
                                             float* __restrict__ lse, int64_t head0, int heads,
                                             int D, int parts, float* __restrict__ sml,
                                             float* __restrict__ sw) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    for (int g = warp; g < heads; g += warps) {
        const int64_t b = (head0 + g) * parts;
        float M = -INFINITY;
        for (int p = lane; p < parts; p += WARP) M = fmaxf(M, __ldcg(part_m + b + p));
        M = warp_max(M);
        float L = 0.f;
        for (int p = lane; p < parts; p += WARP) {
            const float m = __ldcg(part_m + b + p);
            if (m > -INFINITY) L += __ldcg(part_l + b + p) * __expf(m - M);
        }
        L = warp_sum(L);
        if (lane == 0) {
            sml[2 * g] = M;
            sml[2 * g + 1] = L;
            if (lse != nullptr) lse[head0 + g] = M + logf(L);
        }
    }
    __syncthreads();
    // Trip counts the same for every thread (the barriers inside need all of them).
    const int n = heads * D;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool mine = i < n;
        const int g = mine ? i / D : 0, d = i % D;
        float acc = 0.f;
        for (int p0 = 0; p0 < parts; p0 += REDUCE_CHUNK) {
            const int c = min(REDUCE_CHUNK, parts - p0);
            for (int j = threadIdx.x; j < heads * REDUCE_CHUNK; j += blockDim.x) {
                const int h = j / REDUCE_CHUNK, p = j % REDUCE_CHUNK;
                if (p < c) {
                    const float m = __ldcg(part_m + (head0 + h) * parts + p0 + p);
                    sw[j] = m > -INFINITY ? __expf(m - sml[2 * h]) : -1.f;
                }
            }
            __syncthreads();
            if (mine) {
                // Every partition's outputs are written (an empty one's as zeros), so
                // the loads need no guard and a whole chunk's go out together.
                const float* w = sw + g * REDUCE_CHUNK;
                const float* a = part_acc + ((head0 + g) * parts + p0) * D + d;
                if (c == REDUCE_CHUNK) {
                    float x[REDUCE_CHUNK];
#pragma unroll
                    for (int p = 0; p < REDUCE_CHUNK; ++p) x[p] = __ldcg(a + (int64_t)p * D);
#pragma unroll
                    for (int p = 0; p < REDUCE_CHUNK; ++p)
                        if (w[p] >= 0.f) acc += x[p] * w[p];
                } else {
#pragma unroll 8
                    for (int p = 0; p < c; ++p) {
                        const float x = __ldcg(a + (int64_t)p * D);
                        if (w[p] >= 0.f) acc += x * w[p];
                    }
                }
            }
            __syncthreads();
        }
        if (mine) out[(head0 + g) * D + d] = __float2bfloat16(acc / sml[2 * g + 1]);
    }
}

// Largest group the folded reduction takes (its per-head M and L live in static shared
// memory); the host launches the reduction for larger ones.
#define FOLD_MAX_GROUP 16

// The reduction folded into the partition pass (null counters: it is launched after).
// counters [rows, KVH] are zero between launches; each partition block, its outputs
// written, adds one to its (row, KV head)'s, and the block that brings it to `parts`
// (the last of them to finish) reduces the group's heads and sets it back to zero, so
// the next launch on the stream (the next layer, a graph's next replay) finds zeros.
// No block waits for another. The fences are those of the CUDA programming guide's
// last-block reduction: each block's writes are visible device-wide before its count.
struct Fold {
    unsigned int* counters;
    __nv_bfloat16* out;  // [rows, H, D]
    float* lse;          // [rows, H], or null
};

__device__ __forceinline__ void fold_reduce(const float* __restrict__ part_m,
                                            const float* __restrict__ part_l,
                                            const float* __restrict__ part_acc, Fold f,
                                            const DecodePart& dp, int num_kv_heads, int group,
                                            int D) {
    if (f.counters == nullptr) return;
    __shared__ int last;
    __shared__ float sml[2 * FOLD_MAX_GROUP];
    __shared__ float sw[FOLD_MAX_GROUP * REDUCE_CHUNK];
    __threadfence();
    __syncthreads();
    unsigned int* count = f.counters + (int64_t)dp.row * num_kv_heads + dp.kvh;
    if (threadIdx.x == 0) last = atomicAdd(count, 1u) == (unsigned int)(dp.parts - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    reduce_heads(part_m, part_l, part_acc, f.out, f.lse, dp.head0, group, D, dp.parts, sml, sw);
    if (threadIdx.x == 0) *count = 0u;
}

// A partition past its row's context: m = -inf, l = 0 and a zero output for each of
// the group's heads, as the reduction expects; then its share of the folded reduction.
__device__ __forceinline__ void empty_partition(float* __restrict__ part_m,
                                                float* __restrict__ part_l,
                                                float* __restrict__ part_acc, Fold fold,
                                                const DecodePart& dp, int num_kv_heads,
                                                int group, int D) {
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const int64_t o = (dp.head0 + i) * dp.parts + dp.part;
        part_m[o] = -INFINITY;
        part_l[o] = 0.f;
    }
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int64_t o = (dp.head0 + i / D) * dp.parts + dp.part;
        part_acc[o * D + i % D] = 0.f;
    }
    fold_reduce(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
}

template <bool ROLL>
__device__ __forceinline__ void paged_decode_part(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int head_dim, int block_size, int max_blocks,
    int part_size, float scale, Fold fold, Rolling roll) {
    extern __shared__ float smem[];
    const DecodePart dp = decode_part(ctx_lens, num_kv_heads, group, part_size);
    const int row = dp.row, kvh = dp.kvh, part = dp.part, parts = dp.parts;
    const int H = num_kv_heads * group;
    const int D = head_dim;
    const int start = dp.start, n = dp.n;
    float* sq = smem;                  // [G, D]
    float* ss = smem + group * D;      // [G, P]
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;

    if (n <= 0)
        return empty_partition(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);

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
        const float *rc = nullptr, *rs = nullptr;
        if (ROLL) {
            const int p = roll.pos[slot * num_kv_heads + kvh];
            const int32_t* pr = roll.params + (int64_t)row * 4;
            const int index = p < pr[2] - pr[3] ? p : p - (pr[1] - pr[0]);
            rc = roll.cos + (int64_t)index * (D / 2);
            rs = roll.sin + (int64_t)index * (D / 2);
        }
        for (int g = 0; g < group; ++g) {
            float acc = 0.f;
            if (ROLL) {
                const int half = D / 2;
                for (int i = lane; i < half; i += WARP) {
                    const float x0 = __bfloat162float(kr[i]), x1 = __bfloat162float(kr[i + half]);
                    acc += sq[g * D + i] * (x0 * rc[i] - x1 * rs[i]) +
                           sq[g * D + i + half] * (x0 * rs[i] + x1 * rc[i]);
                }
            } else {
                for (int d = lane; d < D; d += WARP)
                    acc += sq[g * D + d] * __bfloat162float(kr[d]);
            }
            acc = warp_sum(acc);
            if (lane == 0) {
                ss[g * part_size + j] = acc * scale;
                // H2O: the scaled scores, turned into probabilities once the
                // reduction knows each head's log-sum-exp.
                if (raw != nullptr)
                    raw[((int64_t)row * H + kvh * group + g) * raw_stride + t] = acc * scale;
            }
        }
    }
    __syncthreads();

    partition_softmax(ss, part_m, part_l, (int64_t)row * H + kvh * group, group, part_size, n,
                      parts, part);
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
    fold_reduce(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
}

extern "C" __global__ void paged_decode_part_bf16(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int head_dim, int block_size, int max_blocks,
    int part_size, float scale, unsigned int* __restrict__ counters,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
    paged_decode_part<false>(q, k_cache, v_cache, tables, ctx_lens, part_m, part_l, part_acc,
                             raw, raw_stride, num_kv_heads, group, head_dim, block_size,
                             max_blocks, part_size, scale, Fold{counters, out, lse}, Rolling{});
}

// paged_decode_part_bf16 over keys cached without RoPE (rolling positions, above).
extern "C" __global__ void paged_decode_part_rolling_bf16(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int head_dim, int block_size, int max_blocks,
    int part_size, float scale, unsigned int* __restrict__ counters,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse, const int32_t* __restrict__ pos,
    const int32_t* __restrict__ params, const float* __restrict__ rope_cos,
    const float* __restrict__ rope_sin) {
    paged_decode_part<true>(q, k_cache, v_cache, tables, ctx_lens, part_m, part_l, part_acc,
                            raw, raw_stride, num_kv_heads, group, head_dim, block_size,
                            max_blocks, part_size, scale, Fold{counters, out, lse},
                            Rolling{pos, params, rope_cos, rope_sin});
}

// Eight bf16 of a 16-byte load as floats.
__device__ __forceinline__ void unpack8(const uint4& r, float out[8]) {
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h2[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// The vector kernels' scores of key j (partition-relative) for each head of the group:
// each lane's 8 products, summed over the LPR lanes of the key's row by shuffles (every
// lane of the warp takes part), written by the row's first lane when `valid` (to the
// scores in shared memory and, for H2O, to `raw`).
template <int LPR, int MAXG>
__device__ __forceinline__ void score_key(const float (&qr)[MAXG][8], const float (&k8)[8],
                                          int group, bool valid, int sl, float* __restrict__ ss,
                                          int part_size, int j, float* __restrict__ raw,
                                          int64_t head0, int raw_stride, int start,
                                          float scale) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc += qr[g][i] * k8[i];
#pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (valid && sl == 0) {
                ss[g * part_size + j] = acc * scale;
                // H2O: the scaled scores, turned into probabilities once the
                // reduction knows each head's log-sum-exp.
                if (raw != nullptr) raw[(head0 + g) * raw_stride + start + j] = acc * scale;
            }
        }
    }
}

// acc[g] += p[g, j] · V row j (8 elements of it) for each head of the group.
template <int MAXG>
__device__ __forceinline__ void accumulate_value(float (&acc)[MAXG][8], const float (&v8)[8],
                                                 const float* __restrict__ ss, int group,
                                                 int part_size, int j) {
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
            const float p = ss[g * part_size + j];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] += p * v8[i];
        }
    }
}

// The end of the vector kernels' V pass: each lane's 8 output elements of every head
// summed over the lanes of its warp that hold the same elements (same sl, other keys),
// then over the warps through shared memory `sacc` ([warps, G, D] floats; where it
// reuses memory the block has just read, the caller syncs first), into part_acc.
template <int D, int MAXG>
__device__ __forceinline__ void write_partition_output(const float (&acc)[MAXG][8],
                                                       float* __restrict__ sacc,
                                                       float* __restrict__ part_acc,
                                                       int64_t head0, int group, int parts,
                                                       int part) {
    constexpr int LPR = D / 8;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    const int sub = lane / LPR, sl = lane % LPR;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float x = acc[g][i];
#pragma unroll
                for (int o = LPR; o < WARP; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
                if (sub == 0) sacc[(warp * group + g) * D + sl * 8 + i] = x;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        float x = 0.f;
        for (int w = 0; w < warps; ++w) x += sacc[w * group * D + i];
        const int64_t o = (head0 + i / D) * parts + part;
        part_acc[o * D + i % D] = x;
    }
}

// The partition pass with 16-byte loads, for D = 64 or 128 and groups of up to MAXG
// query heads: same grid, outputs and scratch layout as paged_decode_part_bf16. A key's
// row for one KV head (D bf16 = D * 2 bytes) is read by D / 8 lanes, 8 elements each,
// so a warp takes 32 / (D / 8) keys at a time, and each row is read once for the whole
// group (every lane keeps its 8 elements of the group's queries in registers). The V
// pass splits keys across lanes and warps the same way: each lane accumulates its 8
// output elements of every head, then the lanes and warps that hold the same elements
// are summed. Shared memory: G * P floats of scores, then warps * G * D floats.
// (Four blocks per SM in the launch bounds: without them ptxas spills the G = 4 build.)
//
// Rolling positions (ROLL): the key is rotated to its index in the cache as the scalar
// kernel does it; dimension i pairs with i + D/2, which lies in the lane D/16 further
// on, so each lane takes its partner's 8 elements by a shuffle.
template <int D, int MAXG, bool ROLL, int UNROLL>
__device__ __forceinline__ void paged_decode_part_vec(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int block_size, int max_blocks,
    int part_size, float scale, Fold fold, Rolling roll) {
    constexpr int LPR = D / 8;          // lanes per key row
    constexpr int RPW = WARP / LPR;     // keys per warp step
    extern __shared__ float smem[];
    const DecodePart dp = decode_part(ctx_lens, num_kv_heads, group, part_size);
    if (dp.n <= 0)
        return empty_partition(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
    const int row = dp.row, kvh = dp.kvh, part = dp.part, parts = dp.parts;
    const int start = dp.start, n = dp.n;
    const int64_t head0 = dp.head0;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    const int sub = lane / LPR, sl = lane % LPR;
    float* ss = smem;                          // [G, P]
    float* sacc = smem + group * part_size;    // [warps, G, D]

    // This lane's 8 elements of each query head of the group. Scalar loads: q may be a
    // view at any element offset (the cache rows are 16-byte aligned, q need not be).
    float qr[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                qr[g][i] = __bfloat162float(q[(head0 + g) * D + sl * 8 + i]);
        }
    }

    const int32_t* table = tables + (int64_t)row * max_blocks;
    const int64_t row_elems = (int64_t)num_kv_heads * D;
    // Each warp step takes DECODE_UNROLL groups of RPW keys: their rows are all loaded
    // before any is used, so a lane keeps that many 16-byte loads in flight (with one,
    // the kernel read K/V at about a third of the copy rate at batch 16 and up).
    // Every lane of a warp runs the same number of steps (the shuffles need them all);
    // lanes past the partition's last key load nothing and write nothing.
    // (Half as many for groups of up to 8, whose queries and outputs take twice the
    // registers: with four, ptxas spills. UNROLL = 1 is the form of earlier builds,
    // one row in flight: KVBENCH_PAGED_DECODE=vec1.)
    constexpr int U = UNROLL == 1 ? 1 : (MAXG <= 4 ? UNROLL : UNROLL / 2);
    for (int base = warp * RPW * U; base < n; base += warps * RPW * U) {
        uint4 raw_k[U];
        int64_t slots[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * RPW + sub;
            slots[u] = 0;
            raw_k[u] = make_uint4(0, 0, 0, 0);
            if (j < n) {
                const int t = start + j;
                slots[u] = (int64_t)table[t / block_size] * block_size + t % block_size;
                raw_k[u] = *reinterpret_cast<const uint4*>(
                    k_cache + slots[u] * row_elems + (int64_t)kvh * D + sl * 8);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * RPW + sub;
            const bool valid = j < n;
            const int64_t slot = slots[u];
            float k8[8];
            unpack8(raw_k[u], k8);
            if (ROLL) {
                // Every lane shuffles (the partner of a lane past the last key holds zeros).
                float other[8];
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    other[i] = __shfl_xor_sync(0xffffffffu, k8[i], LPR / 2);
                if (valid) {
                    const int p = roll.pos[slot * num_kv_heads + kvh];
                    const int32_t* pr = roll.params + (int64_t)row * 4;
                    const int index = p < pr[2] - pr[3] ? p : p - (pr[1] - pr[0]);
                    const float* rc =
                        roll.cos + (int64_t)index * (D / 2) + (sl % (LPR / 2)) * 8;
                    const float* rs =
                        roll.sin + (int64_t)index * (D / 2) + (sl % (LPR / 2)) * 8;
                    const bool first_half = sl < LPR / 2;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        // (x0, x1) = (dimension i, dimension i + D/2) of the pair.
                        const float c = rc[i], s_ = rs[i];
                        k8[i] = first_half ? k8[i] * c - other[i] * s_
                                           : other[i] * s_ + k8[i] * c;
                    }
                }
            }
            score_key<LPR, MAXG>(qr, k8, group, valid, sl, ss, part_size, j, raw, head0,
                                 raw_stride, start, scale);
        }
    }
    __syncthreads();

    partition_softmax(ss, part_m, part_l, head0, group, part_size, n, parts, part);
    __syncthreads();

    float acc[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    for (int base = warp * RPW * U; base < n; base += warps * RPW * U) {
        uint4 raw_v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * RPW + sub;
            raw_v[u] = make_uint4(0, 0, 0, 0);
            if (j < n) {
                const int t = start + j;
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                raw_v[u] = *reinterpret_cast<const uint4*>(
                    v_cache + slot * row_elems + (int64_t)kvh * D + sl * 8);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * RPW + sub;
            if (j < n) {
                float v8[8];
                unpack8(raw_v[u], v8);
                accumulate_value<MAXG>(acc, v8, ss, group, part_size, j);
            }
        }
    }
    write_partition_output<D, MAXG>(acc, sacc, part_acc, head0, group, parts, part);
    fold_reduce(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
}

#define PAGED_DECODE_VEC(D, MAXG, VEC, U)                                                    \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 4)                          \
        paged_decode_part_##VEC##_d##D##_g##MAXG##_bf16(                                     \
            const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,  \
            const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,   \
            const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,                \
            float* __restrict__ part_l, float* __restrict__ part_acc,                        \
            float* __restrict__ raw, int raw_stride, int num_kv_heads, int group,            \
            int head_dim, int block_size, int max_blocks, int part_size, float scale,        \
            unsigned int* __restrict__ counters, __nv_bfloat16* __restrict__ out,            \
            float* __restrict__ lse) {                                                       \
        paged_decode_part_vec<D, MAXG, false, U>(                                            \
            q, k_cache, v_cache, tables, ctx_lens, part_m, part_l, part_acc, raw, raw_stride, \
            num_kv_heads, group, block_size, max_blocks, part_size, scale,                   \
            Fold{counters, out, lse}, Rolling{});                                            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 4)                          \
        paged_decode_part_##VEC##_rolling_d##D##_g##MAXG##_bf16(                             \
            const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,  \
            const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,   \
            const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,                \
            float* __restrict__ part_l, float* __restrict__ part_acc,                        \
            float* __restrict__ raw, int raw_stride, int num_kv_heads, int group,            \
            int head_dim, int block_size, int max_blocks, int part_size, float scale,        \
            unsigned int* __restrict__ counters, __nv_bfloat16* __restrict__ out,            \
            float* __restrict__ lse, const int32_t* __restrict__ pos,                        \
            const int32_t* __restrict__ params, const float* __restrict__ rope_cos,          \
            const float* __restrict__ rope_sin) {                                            \
        paged_decode_part_vec<D, MAXG, true, U>(                                             \
            q, k_cache, v_cache, tables, ctx_lens, part_m, part_l, part_acc, raw, raw_stride, \
            num_kv_heads, group, block_size, max_blocks, part_size, scale,                   \
            Fold{counters, out, lse}, Rolling{pos, params, rope_cos, rope_sin});             \
    }
PAGED_DECODE_VEC(64, 4, vec, DECODE_UNROLL)
PAGED_DECODE_VEC(64, 8, vec, DECODE_UNROLL)
PAGED_DECODE_VEC(128, 4, vec, DECODE_UNROLL)
PAGED_DECODE_VEC(128, 8, vec, DECODE_UNROLL)
PAGED_DECODE_VEC(64, 4, vec1, 1)
PAGED_DECODE_VEC(64, 8, vec1, 1)
PAGED_DECODE_VEC(128, 4, vec1, 1)
PAGED_DECODE_VEC(128, 8, vec1, 1)

// Reduction pass, launched after the partition pass when it is not folded into it
// (KVBENCH_DECODE_REDUCE=launch, groups over FOLD_MAX_GROUP): grid (rows, H), block a
// multiple of 32 threads. out = sum_p acc_p e^{m_p - M} / sum_p l_p e^{m_p - M}; lse
// (optional, may be null) = M + log(L) in natural log of the scaled scores.
extern "C" __global__ void paged_decode_reduce_bf16(
    const float* __restrict__ part_m, const float* __restrict__ part_l,
    const float* __restrict__ part_acc, __nv_bfloat16* __restrict__ out,
    float* __restrict__ lse, int num_heads, int head_dim, int parts) {
    __shared__ float sml[2];
    __shared__ float sw[REDUCE_CHUNK];
    reduce_heads(part_m, part_l, part_acc, out, lse,
                 (int64_t)blockIdx.x * num_heads + blockIdx.y, 1, head_dim, parts, sml, sw);
}

// ---------------------------------------------------------------------------------
// Flash prefill on mma.sync (FlashAttention-2's structure): the same inputs, outputs and
// grid as flash_prefill_d*_bf16 below, but the scores, probabilities and output stay in
// registers. grid (ceil(T / 64), H), block 128: each warp owns 16 query rows, whose Q
// fragments it loads once (ldmatrix). Key tiles of 64 rows of K and V are copied
// through the block table with cp.async into one of two shared buffers while the warps
// work on the other. Per tile and warp: S = Q K^T (m16n8k16, bf16 in, f32 out), causal
// mask, online softmax on the accumulators (a row's four lanes reduce with shuffles),
// then the accumulators become P's A fragments as they are (FA2's register reuse) and
// O += P V reads V with ldmatrix.trans. Rows of 2 * (D + 8) bytes keep ldmatrix free of
// bank conflicts.
#define FM_BM 64
#define FM_BN 64
#define FM_THREADS 128

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                          uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += a (16x16, row) * b (16x8, col); bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragments for mma_bf16: rows row0..row0+15 and columns kk*16.. of a shared tile of
// `ld` bf16 per row.
__device__ __forceinline__ void ldsm_a(const __nv_bfloat16* tile, int ld, int row0, int kk,
                                       uint32_t* a) {
    const int lane = threadIdx.x % WARP;
    const int r = row0 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int c = kk * 16 + (lane / 16) * 8;
    ldsm_x4(smem_u32(tile + r * ld + c), a[0], a[1], a[2], a[3]);
}

// B fragments of two n-tiles for mma_bf16, a shared tile's rows as N and its columns
// kk*16.. as K: rows row0..row0+7 into (b0, b1), row0+8..row0+15 into (b2, b3).
__device__ __forceinline__ void ldsm_b2(const __nv_bfloat16* tile, int ld, int row0, int kk,
                                        uint32_t& b0, uint32_t& b1, uint32_t& b2, uint32_t& b3) {
    const int lane = threadIdx.x % WARP;
    const int r = row0 + (lane % 8) + (lane / 16) * 8;
    const int c = kk * 16 + ((lane / 8) % 2) * 8;
    ldsm_x4(smem_u32(tile + r * ld + c), b0, b1, b2, b3);
}

// The two-buffer pipeline's step: with a next tile, its copies (already issued) form a
// group and all but that group are awaited; on the last tile, everything.
__device__ __forceinline__ void cp_async_next(bool more) {
    if (more) {
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
    }
}

// 16 bytes global -> shared, zero-filled when `valid` is false (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// One 64-row tile of head h's queries, rows row0.. (`rows` of them; the rest zeros), into
// shared rows of D + 8 bf16, 16 bytes per cp.async.
template <int D, int NT = FM_THREADS>
__device__ __forceinline__ void cp_async_q_tile(const __nv_bfloat16* __restrict__ q, int row0,
                                                int rows, int num_heads, int h,
                                                __nv_bfloat16* dst) {
    constexpr int CH = D / 8, LD = D + 8;
    for (int i = threadIdx.x; i < FM_BM * CH; i += NT) {
        const int r = i / CH, c = (i % CH) * 8;
        const bool ok = r < rows;
        const __nv_bfloat16* src = ok ? q + ((int64_t)(row0 + r) * num_heads + h) * D + c : q;
        cp_async16(smem_u32(dst + r * LD + c), src, ok);
    }
}

// One 64-key tile of KV head kvh's cache, keys kt.. through the block table, into shared
// rows of D + 8 bf16, 16 bytes per cp.async; keys at or past n_keys are zero-filled. V
// too when WITH_V.
template <int D, bool WITH_V, int NT = FM_THREADS>
__device__ __forceinline__ void cp_async_kv_tile(const __nv_bfloat16* __restrict__ k_cache,
                                                 const __nv_bfloat16* __restrict__ v_cache,
                                                 const int32_t* __restrict__ table, int kt,
                                                 int n_keys, int block_size, int num_kv_heads,
                                                 int kvh, __nv_bfloat16* k_dst,
                                                 __nv_bfloat16* v_dst) {
    constexpr int CH = D / 8, LD = D + 8;
    for (int i = threadIdx.x; i < FM_BN * CH; i += NT) {
        const int j = i / CH, c = (i % CH) * 8;
        const int t = kt + j;
        const bool ok = t < n_keys;
        int64_t off = 0;
        if (ok) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            off = (slot * num_kv_heads + kvh) * D + c;
        }
        cp_async16(smem_u32(k_dst + j * LD + c), k_cache + off, ok);
        if (WITH_V) cp_async16(smem_u32(v_dst + j * LD + c), v_cache + off, ok);
    }
}

// S = Q K^T for one warp: its 16 query rows (A fragments qf) against the shared tile's
// key rows key0..key0 + 8 * NT (ld bf16 a row), NT n-tiles of 8 keys.
template <int NT, int D>
__device__ __forceinline__ void scores_qk(float (&s)[NT][4], const uint32_t (&qf)[D / 16][4],
                                          const __nv_bfloat16* Kt, int ld, int key0) {
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_b2(Kt, ld, key0 + np * 16, kk, b0, b1, b2, b3);
            mma_bf16(s[2 * np], qf[kk], b0, b1);
            mma_bf16(s[2 * np + 1], qf[kk], b2, b3);
        }
    }
}

// One warp's step of FA2's online softmax over a tile of 8 * NT keys, on the mma
// accumulators: the scores s (scaled, masked to -inf) and this lane's part of each row's
// max over them mx (rows g and g + 8) in; the row max reduced over the row's four
// lanes, the running max and sum updated, the output rescaled, then O += P V with P
// rounded to bf16 as the A fragments as it is (the accumulators' layout is the A
// operand's) and the shared tile's V rows key0.. (ld bf16 a row) read transposed.
template <int NT, int D>
__device__ __forceinline__ void online_softmax_pv(float (&s)[NT][4], float (&mx)[2],
                                                  float (&m_run)[2], float (&l_run)[2],
                                                  float (&o)[D / 8][4],
                                                  const __nv_bfloat16* Vt, int ld, int key0) {
    const int lane = threadIdx.x % WARP;
    float alpha[2], m_use[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
        const float m_new = fmaxf(m_run[hr], mx[hr]);
        m_use[hr] = m_new == -INFINITY ? 0.f : m_new;
        alpha[hr] = __expf(m_run[hr] - m_use[hr]);
        m_run[hr] = m_new;
    }
    // P = exp(S - m), its row sums, and P as the A fragments of P V.
    float sum[2] = {0.f, 0.f};
    uint32_t pa[NT / 2][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = __expf(s[nt][e] - m_use[e >> 1]);
            s[nt][e] = p;
            sum[e >> 1] += p;
        }
        // n-tile nt covers keys 8 * nt..: the lower (even) or upper half of a 16-key
        // chunk of P's A fragment.
        pa[nt / 2][(nt % 2) * 2 + 0] = pack_bf16(s[nt][0], s[nt][1]);
        pa[nt / 2][(nt % 2) * 2 + 1] = pack_bf16(s[nt][2], s[nt][3]);
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        sum[hr] += __shfl_xor_sync(0xffffffffu, sum[hr], 1);
        sum[hr] += __shfl_xor_sync(0xffffffffu, sum[hr], 2);
        l_run[hr] = l_run[hr] * alpha[hr] + sum[hr];
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
    }
    // O += P V: V rows are keys, read transposed into B fragments.
#pragma unroll
    for (int kc = 0; kc < NT / 2; ++kc) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            const int key = key0 + kc * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
            const int c = dp * 16 + (lane / 16) * 8;
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(smem_u32(Vt + key * ld + c), b0, b1, b2, b3);
            mma_bf16(o[2 * dp], pa[kc], b0, b1);
            mma_bf16(o[2 * dp + 1], pa[kc], b2, b3);
        }
    }
}

template <int D>
struct FlashMmaSmem {
    static constexpr int LD = D + 8;                  // bf16 per shared row
    static constexpr int TILE = FM_BN * LD;           // bf16 per K or V tile
    static constexpr int Q = 0;                       // [BM, LD]
    static constexpr int K = Q + FM_BM * LD;          // [2][BN, LD]
    static constexpr int V = K + 2 * TILE;            // [2][BN, LD]
    static constexpr int BYTES = (V + 2 * TILE) * 2;
};

template <int D>
__device__ void flash_prefill_mma(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ table,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    using L = FlashMmaSmem<D>;
    extern __shared__ __align__(128) unsigned char fmsmem[];
    __nv_bfloat16* sm = (__nv_bfloat16*)fmsmem;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment row group, thread in group
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    // Last row tiles first: under the causal mask they see the most keys, so the
    // longest blocks start first and the short ones fill the tail (as FlashAttention-2).
    const int row0 = (gridDim.x - 1 - blockIdx.x) * FM_BM;
    const int rows = min(FM_BM, T - row0);
    const int n_keys = ctx_before + row0 + rows;  // keys the block's last row sees
    const int wrow0 = warp * 16;
    const int wlast = ctx_before + row0 + min(wrow0 + 15, rows - 1);

    // Q tile (rows past T are zeros), then one tile of K/V per cp.async group.
    cp_async_q_tile<D>(q, row0, rows, num_heads, h, sm + L::Q);
    auto load_tile = [&](int kt, int buf) {
        cp_async_kv_tile<D, true>(k_cache, v_cache, table, kt, n_keys, block_size, num_kv_heads, kvh,
                            sm + L::K + buf * L::TILE, sm + L::V + buf * L::TILE);
    };
    load_tile(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);

    uint32_t qf[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};  // rows g and g + 8
    float l_run[2] = {0.f, 0.f};
    const int pos0 = ctx_before + row0 + wrow0 + g;  // position of row g (g + 8: + 8)

    const int tiles = (n_keys + FM_BN - 1) / FM_BN;
    for (int it = 0; it < tiles; ++it) {
        const int kt = it * FM_BN, buf = it & 1;
        if (it + 1 < tiles) load_tile(kt + FM_BN, buf ^ 1);
        cp_async_next(it + 1 < tiles);
        __syncthreads();
        if (it == 0) {
            // This warp's Q fragments, once (rows wrow0.., all of D).
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) ldsm_a(sm + L::Q, L::LD, wrow0, kk, qf[kk]);
        }
        // Tiles wholly above the diagonal for this warp's rows, and warps past T, skip.
        if (wrow0 < rows && kt <= wlast) {
            const __nv_bfloat16* Kt = sm + L::K + buf * L::TILE;
            const __nv_bfloat16* Vt = sm + L::V + buf * L::TILE;
            // S = Q K^T: 16 x 64, eight n-tiles of 8 keys.
            float s[FM_BN / 8][4];
            scores_qk<FM_BN / 8, D>(s, qf, Kt, L::LD, 0);
            // Scale, causal mask, and each row's max over the tile.
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < FM_BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt + nt * 8 + tig * 2 + (e & 1);
                    const int pos = pos0 + (e >> 1) * 8;
                    float x = s[nt][e] * scale;
                    if (key > pos || key >= n_keys) x = -INFINITY;
                    s[nt][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            }
            online_softmax_pv<FM_BN / 8, D>(s, mx, m_run, l_run, o, Vt, L::LD, 0);
        }
        // Every warp is done with this buffer before the next iteration's copy refills it.
        __syncthreads();
    }

    // O / l, rows g and g + 8 of the warp, two columns per n-tile.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = wrow0 + g + hr * 8;
        if (r >= rows) continue;
        const float inv = 1.f / l_run[hr];
        const int64_t base = ((int64_t)(row0 + r) * num_heads + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            const __nv_bfloat162 v =
                __floats2bfloat162_rn(o[dt][hr * 2] * inv, o[dt][hr * 2 + 1] * inv);
            *reinterpret_cast<__nv_bfloat162*>(out + base + dt * 8 + tig * 2) = v;
        }
        if (lse != nullptr && tig == 0)
            lse[(int64_t)(row0 + r) * num_heads + h] = m_run[hr] + logf(l_run[hr]);
    }
}

extern "C" __global__ void __launch_bounds__(FM_THREADS) flash_prefill_mma_d64_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const int32_t* table, __nv_bfloat16* out, float* lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    flash_prefill_mma<64>(q, k_cache, v_cache, table, out, lse, T, ctx_before, num_heads,
                          num_kv_heads, block_size, scale);
}
extern "C" __global__ void __launch_bounds__(FM_THREADS) flash_prefill_mma_d128_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const int32_t* table, __nv_bfloat16* out, float* lse, int T, int ctx_before,
    int num_heads, int num_kv_heads, int block_size, float scale) {
    flash_prefill_mma<128>(q, k_cache, v_cache, table, out, lse, T, ctx_before, num_heads,
                           num_kv_heads, block_size, scale);
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

// ---------------------------------------------------------------------------------
// Paged decode, pipelined: the partition pass with K and V staged through shared memory by cp.async
// (KVBENCH_PAGED_DECODE=pipe): same grid, outputs, scratch layout and arithmetic as
// paged_decode_part_vec (lanes, shuffles and warps take keys alike), but a key row reaches
// its lanes from a ring of PIPE_STAGES tiles of PIPE_TILE keys that the whole block fills
// ahead of use, so up to PIPE_STAGES - 1 tiles of each block are in flight whatever the
// registers allow (the vector kernel keeps DECODE_UNROLL 16-byte loads a lane, 32 KB an
// SM at four blocks). Tile i of a pass sits in slot i % PIPE_STAGES; at step i the block
// waits for tile i (cp.async.wait_group PIPE_STAGES - 2: all but the newest groups), syncs
// (every lane done with tile i - 1, whose slot the next copy reuses), issues tile
// i + PIPE_STAGES - 1 (an empty group past the last), then computes on tile i. Rows past
// the partition are zero-filled and skipped. V's first tiles are issued before the
// softmax, which reads only the scores. Shared memory: the ring (PIPE_STAGES * PIPE_TILE *
// D bf16), then G * P floats of scores; the warps' partial outputs reuse the ring once
// the V pass is done. Not rolling: streaming's rolling positions run the vector kernel.
#define PIPE_TILE 32
#define PIPE_STAGES 4

// Tile `tile` of the partition's keys [start, end) of KV head kvh into ring slot
// tile % PIPE_STAGES, one 16-byte cp.async per chunk, then one commit (an empty group
// for a tile past the last, so every step commits exactly one).
template <int D>
__device__ __forceinline__ void pipe_issue(const __nv_bfloat16* __restrict__ cache,
                                           const int32_t* __restrict__ table, __nv_bfloat16* ring,
                                           int tile, int tiles, int start, int end,
                                           int block_size, int64_t row_elems, int kvh) {
    constexpr int CH = D / 8;
    if (tile < tiles) {
        __nv_bfloat16* dst = ring + (tile % PIPE_STAGES) * PIPE_TILE * D;
        for (int i = threadIdx.x; i < PIPE_TILE * CH; i += blockDim.x) {
            const int j = i / CH, c = (i % CH) * 8;
            const int t = start + tile * PIPE_TILE + j;
            const bool ok = t < end;
            int64_t off = 0;
            if (ok) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                off = slot * row_elems + (int64_t)kvh * D + c;
            }
            cp_async16(smem_u32(dst + j * D + c), cache + off, ok);
        }
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

__device__ __forceinline__ void pipe_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PIPE_STAGES - 2));
}

template <int D, int MAXG>
__device__ __forceinline__ void paged_decode_part_pipe(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int block_size, int max_blocks,
    int part_size, float scale, Fold fold) {
    constexpr int LPR = D / 8;          // lanes per key row
    constexpr int RPW = WARP / LPR;     // keys per warp step
    static_assert(PIPE_TILE % (RPW * (DECODE_THREADS / WARP)) == 0,
                  "a tile is whole block steps");
    extern __shared__ uint4 pipe_smem[];
    __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(pipe_smem);
    float* ss = reinterpret_cast<float*>(ring + PIPE_STAGES * PIPE_TILE * D);  // [G, P]
    float* sacc = reinterpret_cast<float*>(ring);  // [warps, G, D], after the V pass
    const DecodePart dp = decode_part(ctx_lens, num_kv_heads, group, part_size);
    if (dp.n <= 0)
        return empty_partition(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
    const int row = dp.row, kvh = dp.kvh, part = dp.part, parts = dp.parts;
    const int start = dp.start, end = dp.end, n = dp.n;
    const int64_t head0 = dp.head0;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    const int sub = lane / LPR, sl = lane % LPR;
    const int32_t* table = tables + (int64_t)row * max_blocks;
    const int64_t row_elems = (int64_t)num_kv_heads * D;
    const int tiles = (n + PIPE_TILE - 1) / PIPE_TILE;
    for (int s = 0; s < PIPE_STAGES - 1; ++s)
        pipe_issue<D>(k_cache, table, ring, s, tiles, start, end, block_size, row_elems, kvh);

    float qr[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < group) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
                qr[g][i] = __bfloat162float(q[(head0 + g) * D + sl * 8 + i]);
        }
    }

    for (int tile = 0; tile < tiles; ++tile) {
        pipe_wait();
        __syncthreads();
        pipe_issue<D>(k_cache, table, ring, tile + PIPE_STAGES - 1, tiles, start, end,
                      block_size, row_elems, kvh);
        const __nv_bfloat16* buf = ring + (tile % PIPE_STAGES) * PIPE_TILE * D;
        for (int jl = warp * RPW + sub; jl < PIPE_TILE; jl += warps * RPW) {
            const int j = tile * PIPE_TILE + jl;
            // One 16-byte shared load (a load through the reference would be split).
            const uint4 r = *reinterpret_cast<const uint4*>(buf + jl * D + sl * 8);
            float k8[8];
            unpack8(r, k8);
            score_key<LPR, MAXG>(qr, k8, group, j < n, sl, ss, part_size, j, raw, head0,
                                 raw_stride, start, scale);
        }
    }
    // Every copy landed (the groups left are empty) and every lane is done with the
    // ring and has written its scores: V's tiles may fill it.
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    for (int s = 0; s < PIPE_STAGES - 1; ++s)
        pipe_issue<D>(v_cache, table, ring, s, tiles, start, end, block_size, row_elems, kvh);

    partition_softmax(ss, part_m, part_l, head0, group, part_size, n, parts, part);

    float acc[MAXG][8];
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    for (int tile = 0; tile < tiles; ++tile) {
        pipe_wait();
        // Also orders the softmax's probabilities before the first tile's use.
        __syncthreads();
        pipe_issue<D>(v_cache, table, ring, tile + PIPE_STAGES - 1, tiles, start, end,
                      block_size, row_elems, kvh);
        const __nv_bfloat16* buf = ring + (tile % PIPE_STAGES) * PIPE_TILE * D;
        for (int jl = warp * RPW + sub; jl < PIPE_TILE; jl += warps * RPW) {
            const int j = tile * PIPE_TILE + jl;
            if (j < n) {
                const uint4 r = *reinterpret_cast<const uint4*>(buf + jl * D + sl * 8);
                float v8[8];
                unpack8(r, v8);
                accumulate_value<MAXG>(acc, v8, ss, group, part_size, j);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // the ring is free: the warps' partial outputs go there
    write_partition_output<D, MAXG>(acc, sacc, part_acc, head0, group, parts, part);
    fold_reduce(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
}

#define PAGED_DECODE_PIPE(D, MAXG)                                                           \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 4)                          \
        paged_decode_part_pipe_d##D##_g##MAXG##_bf16(                                        \
            const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,  \
            const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,   \
            const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,                \
            float* __restrict__ part_l, float* __restrict__ part_acc,                        \
            float* __restrict__ raw, int raw_stride, int num_kv_heads, int group,            \
            int head_dim, int block_size, int max_blocks, int part_size, float scale,        \
            unsigned int* __restrict__ counters, __nv_bfloat16* __restrict__ out,            \
            float* __restrict__ lse) {                                                       \
        paged_decode_part_pipe<D, MAXG>(q, k_cache, v_cache, tables, ctx_lens, part_m,       \
                                        part_l, part_acc, raw, raw_stride, num_kv_heads,     \
                                        group, block_size, max_blocks, part_size, scale,     \
                                        Fold{counters, out, lse});                           \
    }
PAGED_DECODE_PIPE(64, 4)
PAGED_DECODE_PIPE(64, 8)
PAGED_DECODE_PIPE(128, 4)
PAGED_DECODE_PIPE(128, 8)

// The partition pass on tensor cores (KVBENCH_PAGED_DECODE=mma): same grid, outputs and
// scratch layout as paged_decode_part_vec, for head dims 64 and 128 and groups of up to
// 16. The group's query heads are the rows of one m16n8k16 A operand (rows past the
// group are zeros), so each K/V row is read once for the whole group and the scores and
// the output are tensor-core products, as FlashInfer's decode does for grouped heads:
// the vector kernel spends 64 fp32 multiply-adds, 16 shuffles and the unpacking per lane
// and key, and reads K/V at 32-64 % of the copy rate on an H100 however many bytes it
// keeps in flight (the pipelined kernel's 1.01-1.09x). Tiles of 64 keys are copied
// through the block table with cp.async into one of two buffers while the warps work on
// the other (the prefill's cp_async_kv_tile, keys past the partition zero-filled); warp
// w takes keys 16w..16w+15 of each tile: S = Q K^T (two n-tiles of 8 keys), the online
// softmax on the accumulators (FA2's, each warp its own running max and sum), P as the A
// fragment of P V (V by ldmatrix.trans). At the end the four warps' states are merged
// through shared memory (the buffers, free by then) into the partition's m, l and
// unnormalized output. H2O's `raw` gets the scaled scores as in the other kernels.
// Shared memory: 16 query rows, then two K and two V tiles, rows of D + 8 bf16.
template <int D>
struct MmaDecodeSmem {
    static constexpr int LD = D + 8;
    static constexpr int TILE = FM_BN * LD;
    static constexpr int Q = 0;                 // [16, LD]
    static constexpr int K = Q + 16 * LD;       // [2][FM_BN, LD]
    static constexpr int V = K + 2 * TILE;      // [2][FM_BN, LD]
    static constexpr int BYTES = (V + 2 * TILE) * 2;
};

template <int D>
__device__ __forceinline__ void paged_decode_part_mma(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,
    float* __restrict__ part_l, float* __restrict__ part_acc, float* __restrict__ raw,
    int raw_stride, int num_kv_heads, int group, int block_size, int max_blocks,
    int part_size, float scale, Fold fold) {
    using L = MmaDecodeSmem<D>;
    static_assert(DECODE_THREADS == FM_THREADS && FM_BN == 16 * (DECODE_THREADS / WARP),
                  "each warp takes 16 keys of a tile");
    extern __shared__ __align__(128) unsigned char mdsmem[];
    __nv_bfloat16* sm = reinterpret_cast<__nv_bfloat16*>(mdsmem);
    const DecodePart dp = decode_part(ctx_lens, num_kv_heads, group, part_size);
    if (dp.n <= 0)
        return empty_partition(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
    const int row = dp.row, kvh = dp.kvh, part = dp.part, parts = dp.parts;
    const int start = dp.start, end = dp.end, n = dp.n;
    const int64_t head0 = dp.head0;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane >> 2, tig = lane & 3;  // fragment row group, thread in group
    const int32_t* table = tables + (int64_t)row * max_blocks;
    auto load_tile = [&](int it, int buf) {
        cp_async_kv_tile<D, true, DECODE_THREADS>(k_cache, v_cache, table, start + it * FM_BN,
                                                  end, block_size, num_kv_heads, kvh,
                                                  sm + L::K + buf * L::TILE,
                                                  sm + L::V + buf * L::TILE);
    };
    load_tile(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);
    // The group's queries as rows 0..group-1 (scalar loads: q may be a view at any
    // element offset), zeros below.
    for (int i = threadIdx.x; i < 16 * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        sm[L::Q + r * L::LD + c] = r < group ? q[(head0 + r) * D + c] : __float2bfloat16(0.f);
    }

    uint32_t qf[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};  // rows g and g + 8
    float l_run[2] = {0.f, 0.f};

    const int tiles = (n + FM_BN - 1) / FM_BN;
    for (int it = 0; it < tiles; ++it) {
        const int buf = it & 1;
        if (it + 1 < tiles) load_tile(it + 1, buf ^ 1);
        cp_async_next(it + 1 < tiles);
        __syncthreads();
        if (it == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) ldsm_a(sm + L::Q, L::LD, 0, kk, qf[kk]);
        }
        const int j0 = it * FM_BN + warp * 16;  // the warp's first key, partition-relative
        if (j0 < n) {
            const __nv_bfloat16* Kt = sm + L::K + buf * L::TILE;
            const __nv_bfloat16* Vt = sm + L::V + buf * L::TILE;
            float s[2][4];
            scores_qk<2, D>(s, qf, Kt, L::LD, warp * 16);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = j0 + nt * 8 + tig * 2 + (e & 1);
                    const int r = g + (e >> 1) * 8;
                    float x = s[nt][e] * scale;
                    if (j >= n) x = -INFINITY;
                    else if (raw != nullptr && r < group)
                        raw[(head0 + r) * raw_stride + start + j] = x;
                    s[nt][e] = x;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                }
            }
            online_softmax_pv<2, D>(s, mx, m_run, l_run, o, Vt, L::LD, warp * 16);
        }
        // Every warp is done with this buffer before the next iteration's copy refills it.
        __syncthreads();
    }

    // Merge the warps: each writes its rows' m and l ([warps, 16] each) and its output
    // ([warps, 16, D] floats) over the buffers, then the block sums them rescaled to the
    // partition's max.
    float* sml = reinterpret_cast<float*>(mdsmem);
    float* sacc = sml + 2 * 16 * (DECODE_THREADS / WARP);
    const int warps = DECODE_THREADS / WARP;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = g + hr * 8;
        if (r < group) {
            if (tig == 0) {
                sml[warp * 16 + r] = m_run[hr];
                sml[(warps + warp) * 16 + r] = l_run[hr];
            }
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                float* dst = sacc + ((int64_t)warp * 16 + r) * D + dt * 8 + tig * 2;
                dst[0] = o[dt][hr * 2];
                dst[1] = o[dt][hr * 2 + 1];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        float M = -INFINITY;
        for (int w = 0; w < warps; ++w) M = fmaxf(M, sml[w * 16 + r]);
        float acc = 0.f, l = 0.f;
        for (int w = 0; w < warps; ++w) {
            const float mw = sml[w * 16 + r];
            // A warp that saw no key of the partition holds m = -inf, l = 0, o = 0.
            const float f = mw == -INFINITY ? 0.f : __expf(mw - M);
            acc += sacc[((int64_t)w * 16 + r) * D + c] * f;
            l += sml[(warps + w) * 16 + r] * f;
        }
        const int64_t o_ = (head0 + r) * parts + part;
        part_acc[o_ * D + c] = acc;
        if (c == 0) {
            part_m[o_] = M;
            part_l[o_] = l;
        }
    }
    fold_reduce(part_m, part_l, part_acc, fold, dp, num_kv_heads, group, D);
}

#define PAGED_DECODE_MMA(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 3)                          \
        paged_decode_part_mma_d##D##_bf16(                                                   \
            const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,  \
            const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ tables,   \
            const int32_t* __restrict__ ctx_lens, float* __restrict__ part_m,                \
            float* __restrict__ part_l, float* __restrict__ part_acc,                        \
            float* __restrict__ raw, int raw_stride, int num_kv_heads, int group,            \
            int head_dim, int block_size, int max_blocks, int part_size, float scale,        \
            unsigned int* __restrict__ counters, __nv_bfloat16* __restrict__ out,            \
            float* __restrict__ lse) {                                                       \
        paged_decode_part_mma<D>(q, k_cache, v_cache, tables, ctx_lens, part_m, part_l,      \
                                 part_acc, raw, raw_stride, num_kv_heads, group, block_size, \
                                 max_blocks, part_size, scale, Fold{counters, out, lse});    \
    }
PAGED_DECODE_MMA(64)
PAGED_DECODE_MMA(128)

// ---------------------------------------------------------------------------------
// Evicting strategies (H2O, StreamingLLM). Slot i of (sequence, KV head) holds any
// position that head kept there; beside K/V every (slot, KV head) has an f32 score and
// an int32 position: score/pos [num_slots, KVH].

// Metadata of freshly written slots: position and a zero score for every KV head.
// grid T, any block size.
extern "C" __global__ void slot_meta_init(const int32_t* __restrict__ slots,
                                          const int32_t* __restrict__ positions,
                                          float* __restrict__ score, int32_t* __restrict__ pos,
                                          int num_kv_heads) {
    const int t = blockIdx.x;
    for (int g = threadIdx.x; g < num_kv_heads; g += blockDim.x) {
        const int64_t o = (int64_t)slots[t] * num_kv_heads + g;
        score[o] = 0.f;
        pos[o] = positions[t];
    }
}

// H2O's exact column statistics, second pass (algorithms.md section 9): with each
// query row's log-sum-exp from the attention pass, add the sum over rows and over the
// group's query heads of p_ij = exp(s_ij - lse_i) to the score of key j, per KV head.
// grid (ceil(n_keys / 64), KVH), block 128 (4 warps x 16 rows of a 64-row query tile).
// One block owns its 64 keys' scores for one KV head: no atomics, fixed order.
// Shared memory: the flash layout (Q and K tiles, per-warp scores, partial sums).
template <int D>
__device__ void attn_colsum(const __nv_bfloat16* __restrict__ q,
                            const __nv_bfloat16* __restrict__ k_cache,
                            const int32_t* __restrict__ table, const float* __restrict__ lse,
                            float* __restrict__ score, int T, int ctx_before, int num_heads,
                            int num_kv_heads, int block_size, float scale) {
    using L = FlashSmem<D>;
    extern __shared__ __align__(128) unsigned char fsmem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)(fsmem + L::Q);
    __nv_bfloat16* Ks = (__nv_bfloat16*)(fsmem + L::K);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float* Sw = (float*)(fsmem + L::S) + warp * 16 * L::LDS;
    float* Cw = (float*)(fsmem + L::O);  // [FP_WARPS, FP_BN] partial column sums
    float* Lr = (float*)(fsmem + L::M);  // lse of the tile's rows
    const int kvh = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const int n_keys = ctx_before + T;
    const int kt = blockIdx.x * FP_BN;
    constexpr int CH = D / 8;

    for (int i = threadIdx.x; i < FP_BN * CH; i += blockDim.x) {
        const int j = i / CH, c = (i % CH) * 8;
        const int t = kt + j;
        uint4 kx = make_uint4(0, 0, 0, 0);
        if (t < n_keys) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            kx = *(const uint4*)(k_cache + (slot * num_kv_heads + kvh) * D + c);
        }
        *(uint4*)(Ks + j * L::LDQ + c) = kx;
    }
    float c0 = 0.f, c1 = 0.f;  // this lane's columns lane and lane + 32
    // Rows before the first that can see key kt (position >= kt) contribute nothing.
    const int first = max(0, kt - ctx_before) / FP_BM * FP_BM;
    const int wrow0 = warp * 16;
    for (int gi = 0; gi < group; ++gi) {
        const int h = kvh * group + gi;
        for (int row0 = first; row0 < T; row0 += FP_BM) {
            __syncthreads();
            const int rows = min(FP_BM, T - row0);
            for (int i = threadIdx.x; i < FP_BM * CH; i += blockDim.x) {
                const int r = i / CH, c = (i % CH) * 8;
                uint4 x = make_uint4(0, 0, 0, 0);
                if (r < rows)
                    x = *(const uint4*)(q + ((int64_t)(row0 + r) * num_heads + h) * D + c);
                *(uint4*)(Qs + r * L::LDQ + c) = x;
            }
            if (threadIdx.x < FP_BM)
                Lr[threadIdx.x] =
                    threadIdx.x < rows ? lse[(int64_t)(row0 + threadIdx.x) * num_heads + h] : 0.f;
            __syncthreads();
            if (wrow0 >= rows) continue;
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
            const int wrows = min(16, rows - wrow0);
            for (int r = 0; r < wrows; ++r) {
                const int p = ctx_before + row0 + wrow0 + r;
                const float l = Lr[wrow0 + r];
                if (kt + lane <= p && kt + lane < n_keys)
                    c0 += __expf(Sw[r * L::LDS + lane] * scale - l);
                if (kt + lane + 32 <= p && kt + lane + 32 < n_keys)
                    c1 += __expf(Sw[r * L::LDS + lane + 32] * scale - l);
            }
            __syncwarp();
        }
    }
    __syncthreads();
    Cw[warp * FP_BN + lane] = c0;
    Cw[warp * FP_BN + lane + 32] = c1;
    __syncthreads();
    if (threadIdx.x < FP_BN) {
        const int t = kt + threadIdx.x;
        if (t < n_keys) {
            float sum = 0.f;
            for (int w = 0; w < FP_WARPS; ++w) sum += Cw[w * FP_BN + threadIdx.x];
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            score[slot * num_kv_heads + kvh] += sum;
        }
    }
}

// attn_colsum on mma.sync: the same inputs and outputs, grid (ceil(n_keys / (16 *
// WARPS)), KVH), block WARPS warps. The block's keys are the A operand (each warp keeps
// 16 keys' K fragments in registers) and each 64-row query tile the B operand, so a
// warp computes S^T = K Q^T (16 keys x 8 rows per mma) and adds exp(s * scale - lse_row)
// of the rows that see each key; a key's four lanes reduce at the end and one lane
// writes it (no atomics, fixed order). Query tiles of each head of the group go through
// two shared buffers with cp.async, with their rows' log-sum-exp (times log2 e, so the
// exponential is one ex2 after one FMA). The default form (attn_colsum_mma_*) has 8
// warps, 128 keys a block (half the query traffic per key of 64), and skips the mask
// on tiles whose rows all see all the warp's keys (every tile off the diagonal); the
// form of earlier builds (attn_colsum_mma64_*: 4 warps, every tile masked) stays as
// KVBENCH_H2O_STATS=mma64.
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int D, int WARPS, bool SKIP_MASK>
__device__ void attn_colsum_mma(const __nv_bfloat16* __restrict__ q,
                                const __nv_bfloat16* __restrict__ k_cache,
                                const int32_t* __restrict__ table, const float* __restrict__ lse,
                                float* __restrict__ score, int T, int ctx_before, int num_heads,
                                int num_kv_heads, int block_size, float scale) {
    constexpr int LD = D + 8;
    constexpr int CS_THREADS = WARPS * WARP, CS_BN = WARPS * 16;
    extern __shared__ __align__(128) unsigned char fmsmem[];
    __nv_bfloat16* Ks = (__nv_bfloat16*)fmsmem;                   // [CS_BN, LD]
    __nv_bfloat16* Qs = Ks + CS_BN * LD;                          // [2][BM, LD]
    float* Lr = (float*)(fmsmem + (CS_BN + 2 * FM_BM) * LD * 2);  // [2][BM], lse * log2 e
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int g = lane >> 2, tig = lane & 3;
    const int kvh = blockIdx.y;
    const int group = num_heads / num_kv_heads;
    const int n_keys = ctx_before + T;
    const int kt = blockIdx.x * CS_BN;
    const int wkey0 = kt + warp * 16;  // the warp's first key
    const float sl2 = scale * LOG2E;

#pragma unroll
    for (int half = 0; half < CS_BN / FM_BN; ++half)
        cp_async_kv_tile<D, false, CS_THREADS>(k_cache, nullptr, table, kt + half * FM_BN, n_keys,
                                               block_size, num_kv_heads, kvh,
                                               Ks + half * FM_BN * LD, nullptr);
    // Query tiles from the first whose last row can see key kt, for every head.
    const int first = max(0, kt - ctx_before) / FM_BM * FM_BM;
    const int per_head = T > first ? (T - first + FM_BM - 1) / FM_BM : 0;
    const int tiles = per_head * group;
    auto load_tile = [&](int it, int buf) {
        const int h = kvh * group + it / per_head;
        const int row0 = first + (it % per_head) * FM_BM;
        const int rows = min(FM_BM, T - row0);
        cp_async_q_tile<D, CS_THREADS>(q, row0, rows, num_heads, h, Qs + buf * FM_BM * LD);
        if (threadIdx.x < FM_BM)
            Lr[buf * FM_BM + threadIdx.x] =
                threadIdx.x < rows ? lse[(int64_t)(row0 + threadIdx.x) * num_heads + h] * LOG2E
                                   : 0.f;
    };
    if (tiles > 0) load_tile(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);

    uint32_t kf[D / 16][4];
    float acc[2] = {0.f, 0.f};  // keys wkey0 + g and wkey0 + g + 8, this lane's rows
    if (tiles == 0) asm volatile("cp.async.wait_group 0;\n" ::);
    for (int it = 0; it < tiles; ++it) {
        const int buf = it & 1;
        const int row0 = first + (it % per_head) * FM_BM;
        const int rows = min(FM_BM, T - row0);
        if (it + 1 < tiles) load_tile(it + 1, buf ^ 1);
        cp_async_next(it + 1 < tiles);
        __syncthreads();
        if (it == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) ldsm_a(Ks, LD, warp * 16, kk, kf[kk]);
        }
        // Rows whose positions are all before this warp's first key add nothing.
        const int last_pos = ctx_before + row0 + rows - 1;
        if (wkey0 < n_keys && last_pos >= wkey0) {
            const __nv_bfloat16* Qt = Qs + buf * FM_BM * LD;
            const float* Lt = Lr + buf * FM_BM;
            // Every row of the tile sees every key of the warp: no mask (positions
            // ctx_before + row0.. are all at or past the warp's last key, which is
            // then below n_keys).
            const bool whole = SKIP_MASK && rows == FM_BM && ctx_before + row0 >= wkey0 + 15;
#pragma unroll
            for (int np = 0; np < FM_BM / 16; ++np) {
                float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_b2(Qt, LD, np * 16, kk, b0, b1, b2, b3);
                    mma_bf16(s0, kf[kk], b0, b1);
                    mma_bf16(s1, kf[kk], b2, b3);
                }
                // Element e: tile row np * 16 + (e >> 2) * 8 + tig * 2 + (e & 1), key
                // wkey0 + g + ((e >> 1) & 1) * 8.
                if (whole) {
                    float l[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) l[j] = Lt[np * 16 + (j >> 1) * 8 + tig * 2 + (j & 1)];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float x = e < 4 ? s0[e] : s1[e - 4];
                        acc[(e >> 1) & 1] += ex2_approx(fmaf(x, sl2, -l[((e >> 2) << 1) | (e & 1)]));
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const float x = e < 4 ? s0[e] : s1[e - 4];
                        const int col = np * 16 + (e >> 2) * 8 + tig * 2 + (e & 1);
                        const int key = wkey0 + g + ((e >> 1) & 1) * 8;
                        const int pos = ctx_before + row0 + col;
                        if (col < rows && key <= pos && key < n_keys)
                            acc[(e >> 1) & 1] += ex2_approx(fmaf(x, sl2, -Lt[col]));
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float x = acc[hr];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int t = wkey0 + g + hr * 8;
        if (tig == 0 && t < n_keys) {
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            score[slot * num_kv_heads + kvh] += x;
        }
    }
}

#define ATTN_COLSUM_MMA(NAME, D, WARPS, SKIP)                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * WARP) NAME(                         \
        const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const int32_t* table,          \
        const float* lse, float* score, int T, int ctx_before, int num_heads,                \
        int num_kv_heads, int block_size, float scale) {                                     \
        attn_colsum_mma<D, WARPS, SKIP>(q, k_cache, table, lse, score, T, ctx_before,        \
                                        num_heads, num_kv_heads, block_size, scale);         \
    }
ATTN_COLSUM_MMA(attn_colsum_mma_d64_bf16, 64, 8, true)
ATTN_COLSUM_MMA(attn_colsum_mma_d128_bf16, 128, 8, true)
ATTN_COLSUM_MMA(attn_colsum_mma64_d64_bf16, 64, 4, false)
ATTN_COLSUM_MMA(attn_colsum_mma64_d128_bf16, 128, 4, false)

extern "C" __global__ void __launch_bounds__(128) attn_colsum_d64_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const int32_t* table,
    const float* lse, float* score, int T, int ctx_before, int num_heads, int num_kv_heads,
    int block_size, float scale) {
    attn_colsum<64>(q, k_cache, table, lse, score, T, ctx_before, num_heads, num_kv_heads,
                    block_size, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_colsum_d128_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const int32_t* table,
    const float* lse, float* score, int T, int ctx_before, int num_heads, int num_kv_heads,
    int block_size, float scale) {
    attn_colsum<128>(q, k_cache, table, lse, score, T, ctx_before, num_heads, num_kv_heads,
                     block_size, scale);
}

// Decode rows' probabilities into the scores: score[slot(t), kvh] += sum over the
// group's heads of exp(raw - lse). grid (rows, KVH, ceil(max_ctx / blockDim)).
extern "C" __global__ void decode_scores_accum(const float* __restrict__ raw,
                                               const float* __restrict__ lse,
                                               const int32_t* __restrict__ tables,
                                               const int32_t* __restrict__ ctx_lens,
                                               float* __restrict__ score, int num_kv_heads,
                                               int group, int block_size, int max_blocks,
                                               int raw_stride) {
    const int row = blockIdx.x, kvh = blockIdx.y;
    const int t = blockIdx.z * blockDim.x + threadIdx.x;
    if (t >= ctx_lens[row]) return;
    const int H = num_kv_heads * group;
    float acc = 0.f;
    for (int g = 0; g < group; ++g) {
        const int64_t o = (int64_t)row * H + kvh * group + g;
        acc += __expf(raw[o * raw_stride + t] - lse[o]);
    }
    const int32_t* table = tables + (int64_t)row * max_blocks;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    score[slot * num_kv_heads + kvh] += acc;
}

// Column sums [KVH, n] (f32) of a sequence's first n slots added to their scores.
// grid ceil(n / blockDim).
extern "C" __global__ void scores_add(float* __restrict__ score, const float* __restrict__ col,
                                      const int32_t* __restrict__ table, int n,
                                      int num_kv_heads, int block_size) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    for (int g = 0; g < num_kv_heads; ++g)
        score[slot * num_kv_heads + g] += col[(int64_t)g * n + t];
}

// Scores of a sequence's first n slots as [KVH, n]. grid ceil(n / blockDim).
extern "C" __global__ void scores_gather(const float* __restrict__ score,
                                         float* __restrict__ out,
                                         const int32_t* __restrict__ table, int n,
                                         int num_kv_heads, int block_size) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    for (int g = 0; g < num_kv_heads; ++g)
        out[(int64_t)g * n + t] = score[slot * num_kv_heads + g];
}

// Victim rules (the Eviction rules of the CPU policies, same total orders):
//   0 lowest score among positions older than the window, newest on ties (H2O)
//   1 newest position older than the window (H2O with frozen heavy hitters)
//   2 oldest position that is not a sink (StreamingLLM)
__device__ __forceinline__ bool victim_better(int mode, float s, int p, float sb, int pb) {
    if (mode == 0) return s < sb || (s == sb && p > pb);
    if (mode == 1) return p > pb;
    return p < pb;
}

// One eviction per (decode row, KV head): among the row's m slots (the last holds the
// step's token) pick the victim, then move the last slot into it. params per row:
// m, n (context including the token), capacity, recent. grid (rows, KVH), block 256.
#define EVICT_THREADS 256
extern "C" __global__ void __launch_bounds__(EVICT_THREADS) evict_one(
    __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache,
    float* __restrict__ score, int32_t* __restrict__ pos, const int32_t* __restrict__ tables,
    const int32_t* __restrict__ params, int num_kv_heads, int head_dim, int block_size,
    int max_blocks, int mode) {
    __shared__ int sidx[EVICT_THREADS];
    __shared__ float ssc[EVICT_THREADS];
    __shared__ int spos[EVICT_THREADS];
    const int row = blockIdx.x, g = blockIdx.y;
    const int m = params[row * 4], n = params[row * 4 + 1];
    const int cap = params[row * 4 + 2], rec = params[row * 4 + 3];
    if (m <= cap) return;  // still under its capacity (or keeping everything)
    const int window_start = max(n - rec, 0), sinks = cap - rec;
    const int32_t* table = tables + (int64_t)row * max_blocks;
    int best = -1, bp = 0;
    float bs = 0.f;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int64_t slot = (int64_t)table[i / block_size] * block_size + i % block_size;
        const int p = pos[slot * num_kv_heads + g];
        const float s = score[slot * num_kv_heads + g];
        const bool eligible = mode == 2 ? p >= sinks : p < window_start;
        if (!eligible) continue;
        if (best < 0 || victim_better(mode, s, p, bs, bp)) {
            best = i;
            bs = s;
            bp = p;
        }
    }
    sidx[threadIdx.x] = best;
    ssc[threadIdx.x] = bs;
    spos[threadIdx.x] = bp;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            const int o = threadIdx.x + w;
            if (sidx[o] >= 0 &&
                (sidx[threadIdx.x] < 0 ||
                 victim_better(mode, ssc[o], spos[o], ssc[threadIdx.x], spos[threadIdx.x]))) {
                sidx[threadIdx.x] = sidx[o];
                ssc[threadIdx.x] = ssc[o];
                spos[threadIdx.x] = spos[o];
            }
        }
        __syncthreads();
    }
    const int victim = sidx[0] < 0 ? 0 : sidx[0];
    if (victim == m - 1) return;
    const int64_t src = (int64_t)table[(m - 1) / block_size] * block_size + (m - 1) % block_size;
    const int64_t dst = (int64_t)table[victim / block_size] * block_size + victim % block_size;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        k_cache[(dst * num_kv_heads + g) * head_dim + d] =
            k_cache[(src * num_kv_heads + g) * head_dim + d];
        v_cache[(dst * num_kv_heads + g) * head_dim + d] =
            v_cache[(src * num_kv_heads + g) * head_dim + d];
    }
    if (threadIdx.x == 0) {
        score[dst * num_kv_heads + g] = score[src * num_kv_heads + g];
        pos[dst * num_kv_heads + g] = pos[src * num_kv_heads + g];
    }
}

// After a prefill: keep only slots keep[g, 0..C) (ascending) of each KV head, moved to
// slots 0..C in order. Every source is at or after its destination, so chunks staged
// through shared memory in increasing order never overwrite a slot still to be read.
// grid KVH, block 256, shared 2 * COMPACT_CHUNK * D bf16 + COMPACT_CHUNK * 8 bytes.
#define COMPACT_CHUNK 32
extern "C" __global__ void compact_slots(__nv_bfloat16* __restrict__ k_cache,
                                         __nv_bfloat16* __restrict__ v_cache,
                                         float* __restrict__ score, int32_t* __restrict__ pos,
                                         const int32_t* __restrict__ table,
                                         const int32_t* __restrict__ keep, int C,
                                         int num_kv_heads, int head_dim, int block_size) {
    extern __shared__ __align__(16) unsigned char csmem[];
    __nv_bfloat16* bk = (__nv_bfloat16*)csmem;
    __nv_bfloat16* bv = bk + COMPACT_CHUNK * head_dim;
    float* bsc = (float*)(bv + COMPACT_CHUNK * head_dim);
    int* bpos = (int*)(bsc + COMPACT_CHUNK);
    const int g = blockIdx.x;
    const int32_t* kg = keep + (int64_t)g * C;
    for (int base = 0; base < C; base += COMPACT_CHUNK) {
        const int cnt = min(COMPACT_CHUNK, C - base);
        for (int e = threadIdx.x; e < cnt * head_dim; e += blockDim.x) {
            const int i = e / head_dim, d = e % head_dim;
            const int s = kg[base + i];
            const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
            bk[e] = k_cache[(slot * num_kv_heads + g) * head_dim + d];
            bv[e] = v_cache[(slot * num_kv_heads + g) * head_dim + d];
        }
        for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
            const int s = kg[base + i];
            const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
            bsc[i] = score[slot * num_kv_heads + g];
            bpos[i] = pos[slot * num_kv_heads + g];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < cnt * head_dim; e += blockDim.x) {
            const int i = e / head_dim, d = e % head_dim;
            const int s = base + i;
            const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
            k_cache[(slot * num_kv_heads + g) * head_dim + d] = bk[e];
            v_cache[(slot * num_kv_heads + g) * head_dim + d] = bv[e];
        }
        for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
            const int s = base + i;
            const int64_t slot = (int64_t)table[s / block_size] * block_size + s % block_size;
            score[slot * num_kv_heads + g] = bsc[i];
            pos[slot * num_kv_heads + g] = bpos[i];
        }
        __syncthreads();
    }
}


// ---------------------------------------------------------------------------------
// InfiniGen (algorithms.md §4). The host tier is pinned host memory mapped into the
// device's address space, allocated in chunks of `bpc` blocks; block b holds
// [offloaded layers][K, V][block_size][KVH][D] bf16. Kernels read and write it in
// place over PCIe (zero-copy): the selected rows travel host→device without a host
// gather, on the copy stream, while the compute stream runs the previous layer.
//
// Partial keys K̂ live on the device, [slots, KVH, r] bf16 per offloaded layer, with
// the same block tables as the dense layers' K/V. Per sequence and (offloaded layer,
// KV head) the r chosen columns of the skewing matrix A (f32 [KVH, D, D] per layer):
// cols [seq slots][offloaded layers][KVH][r] int32.

__device__ __forceinline__ __nv_bfloat16* host_row(const uint64_t* __restrict__ chunks,
                                                   int64_t slot, int li, int kv,
                                                   int off_layers, int block_size,
                                                   int row_elems, int bpc) {
    const int64_t b = slot / block_size, o = slot % block_size;
    __nv_bfloat16* base = (__nv_bfloat16*)chunks[b / bpc];
    return base + ((((b % bpc) * off_layers + li) * 2 + kv) * block_size + o) * row_elems;
}

// n bf16 from src to dst by threads tid, tid + step, ...; 16-byte moves when both are
// aligned (PCIe transactions of a warp then cover 512 contiguous bytes).
__device__ __forceinline__ void copy_bf16(__nv_bfloat16* __restrict__ dst,
                                          const __nv_bfloat16* __restrict__ src, int n,
                                          int tid, int step) {
    if ((n % 8) == 0 && (((uintptr_t)dst | (uintptr_t)src) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (int i = tid; i < n / 8; i += step) d[i] = s[i];
    } else {
        for (int i = tid; i < n; i += step) dst[i] = src[i];
    }
}

// K/V rows [T, KVH, D] (device) to host-tier slots[T] of offloaded layer li. grid T.
extern "C" __global__ void ig_host_write(const __nv_bfloat16* __restrict__ k,
                                        const __nv_bfloat16* __restrict__ v,
                                        const uint64_t* __restrict__ chunks,
                                        const int32_t* __restrict__ slots, int li,
                                        int off_layers, int block_size, int row_elems,
                                        int bpc) {
    const int t = blockIdx.x;
    const int64_t slot = slots[t];
    const int64_t src = (int64_t)t * row_elems;
    copy_bf16(host_row(chunks, slot, li, 0, off_layers, block_size, row_elems, bpc), k + src,
              row_elems, threadIdx.x, blockDim.x);
    copy_bf16(host_row(chunks, slot, li, 1, off_layers, block_size, row_elems, bpc), v + src,
              row_elems, threadIdx.x, blockDim.x);
}

// Positions 0..n of one sequence (host block `table`) of offloaded layer li into
// contiguous [n, KVH, D] K and V on the device. grid n.
extern "C" __global__ void ig_host_read(const uint64_t* __restrict__ chunks,
                                       const int32_t* __restrict__ table, int li,
                                       int off_layers, int block_size, int row_elems, int bpc,
                                       __nv_bfloat16* __restrict__ k_out,
                                       __nv_bfloat16* __restrict__ v_out) {
    const int t = blockIdx.x;
    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
    const int64_t dst = (int64_t)t * row_elems;
    copy_bf16(k_out + dst, host_row(chunks, slot, li, 0, off_layers, block_size, row_elems, bpc),
              row_elems, threadIdx.x, blockDim.x);
    copy_bf16(v_out + dst, host_row(chunks, slot, li, 1, off_layers, block_size, row_elems, bpc),
              row_elems, threadIdx.x, blockDim.x);
}

// Partial keys: khat[dst_slots[t], g, c] = sum_d k[src_rows[t], g, d] * A[g, d, cols_c]
// with the columns of sequence row_seq[t]. grid (T, KVH), shared D floats.
extern "C" __global__ void ig_khat_write(const __nv_bfloat16* __restrict__ k,
                                        const int32_t* __restrict__ src_rows,
                                        const int32_t* __restrict__ dst_slots,
                                        const int32_t* __restrict__ row_seq,
                                        const float* __restrict__ A,
                                        const int32_t* __restrict__ cols, int li,
                                        int off_layers, int num_kv_heads, int head_dim, int r,
                                        __nv_bfloat16* __restrict__ khat) {
    extern __shared__ float kshm[];
    const int t = blockIdx.x, g = blockIdx.y, D = head_dim;
    const __nv_bfloat16* kr = k + ((int64_t)src_rows[t] * num_kv_heads + g) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) kshm[d] = __bfloat162float(kr[d]);
    __syncthreads();
    const int32_t* cg = cols + (((int64_t)row_seq[t] * off_layers + li) * num_kv_heads + g) * r;
    const float* Ag = A + (int64_t)g * D * D;
    __nv_bfloat16* dst = khat + ((int64_t)dst_slots[t] * num_kv_heads + g) * r;
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        const int col = cg[c];
        float acc = 0.f;
        for (int d = 0; d < D; ++d) acc += kshm[d] * Ag[d * D + col];
        dst[c] = __float2bfloat16(acc);
    }
}

// Speculated scaled scores of decode row `row` over positions 0..nctx[row], for the G
// query heads of KV head g together (each K̂ row is read once for all of them):
// q̂_h = q_h · A_g[:, cols], s_hj = scale * q̂_h · K̂_j. q [R, H, D] rotated; s [R, H,
// stride] f32. grid (R, KVH, ceil(max n / blockDim)), shared G * (D + r) floats.
extern "C" __global__ void ig_spec_scores(
    const __nv_bfloat16* __restrict__ q, const float* __restrict__ A,
    const int32_t* __restrict__ cols, const int32_t* __restrict__ row_seq, int li,
    int off_layers, const __nv_bfloat16* __restrict__ khat, const int32_t* __restrict__ tables,
    int max_blocks, const int32_t* __restrict__ nctx, float* __restrict__ s, int stride,
    int num_heads, int num_kv_heads, int head_dim, int r, int block_size, float scale) {
    extern __shared__ float sp[];
    const int G = num_heads / num_kv_heads, D = head_dim;
    float* sq = sp;             // [G, D]
    float* qh = sp + G * D;     // [G, r]
    const int row = blockIdx.x, g = blockIdx.y;
    const int n = nctx[row];
    const int j0 = blockIdx.z * blockDim.x;
    if (j0 >= n) return;  // uniform over the block
    for (int e = threadIdx.x; e < G * D; e += blockDim.x)
        sq[e] = __bfloat162float(q[((int64_t)row * num_heads + g * G) * D + e]);
    __syncthreads();
    const int32_t* cg = cols + (((int64_t)row_seq[row] * off_layers + li) * num_kv_heads + g) * r;
    const float* Ag = A + (int64_t)g * D * D;
    for (int e = threadIdx.x; e < G * r; e += blockDim.x) {
        const int i = e / r, col = cg[e % r];
        float acc = 0.f;
        for (int d = 0; d < D; ++d) acc += sq[i * D + d] * Ag[d * D + col];
        qh[e] = acc;
    }
    __syncthreads();
    const int j = j0 + threadIdx.x;
    if (j >= n) return;
    const int32_t* table = tables + (int64_t)row * max_blocks;
    const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
    const __nv_bfloat16* kr = khat + (slot * num_kv_heads + g) * r;
    for (int i = 0; i < G; ++i) {
        float acc = 0.f;
        for (int c = 0; c < r; ++c) acc += qh[i * r + c] * __bfloat162float(kr[c]);
        s[((int64_t)row * num_heads + g * G + i) * stride + j] = acc * scale;
    }
}

#define IG_THREADS 256

// Block-wide sum and max of one value per thread (blockDim a multiple of 32, ≤ 1024).
__device__ float block_max(float x, float* red) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    x = warp_max(x);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < (int)blockDim.x / WARP; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

__device__ int block_sum_int(int x, int* red) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    int s = 0;
    for (int w = 0; w < (int)blockDim.x / WARP; ++w) s += red[w];
    __syncthreads();
    return s;
}

// Exclusive prefix sum over the block of one int per thread (thread order); *total
// receives the block's sum. blockDim a multiple of 32, ≤ 1024; red holds 32 ints.
__device__ int block_exclusive_scan(int x, int* red, int* total) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    int inc = x;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == WARP - 1) red[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int w = lane < warps ? red[lane] : 0;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        red[lane] = w;
    }
    __syncthreads();
    const int base = warp > 0 ? red[warp - 1] : 0;
    *total = red[warps - 1];
    __syncthreads();
    return base + inc - x;
}

// Per (decode row, query head): how many positions have a speculated score above
// the head's maximum minus alpha (alpha = inf counts every position). grid (R, H).
extern "C" __global__ void __launch_bounds__(IG_THREADS) ig_count(
    const float* __restrict__ s, const int32_t* __restrict__ nctx, int stride, float alpha,
    int32_t* __restrict__ counts) {
    __shared__ float fred[IG_THREADS / WARP];
    __shared__ int ired[IG_THREADS / WARP];
    const int row = blockIdx.x, h = blockIdx.y, H = gridDim.y;
    const int n = nctx[row];
    const float* sr = s + ((int64_t)row * H + h) * stride;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sr[j]);
    m = block_max(m, fred);
    const float thr = m - alpha;
    int c = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) c += sr[j] > thr;
    c = block_sum_int(c, ired);
    if (threadIdx.x == 0) counts[row * H + h] = c;
}

// f32 → u32 with the same order (larger float, larger key); -0 and +0 are one key,
// as they compare equal on the host.
__device__ __forceinline__ uint32_t order_key(float x) {
    const uint32_t u = __float_as_uint(x == 0.f ? 0.f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A KV head's estimate of position j: the max over its query heads' scores.
__device__ __forceinline__ float group_est(const float* __restrict__ base, int group,
                                           int stride, int j) {
    float e = -INFINITY;
    for (int i = 0; i < group; ++i) e = fmaxf(e, base[(int64_t)i * stride + j]);
    return e;
}

// The k largest of n keys (key_of(j), j < n; ties to the smaller j) written ascending
// to out[0..k), 0 < k < n, by the whole block: radix select of the k-th largest key
// (four 8-bit passes over a shared histogram), then one ordered pass that takes every
// larger key and the first of those equal to it (block prefix sums). hist: 256 shared
// counters, red: 32 shared ints, s_prefix / s_need: shared scalars.
template <typename KeyFn>
__device__ void top_k_ascending(KeyFn key_of, int n, int k, int32_t* __restrict__ out,
                                unsigned int* hist, int* red, uint32_t* s_prefix,
                                int* s_need) {
    const int tid = threadIdx.x, bd = blockDim.x;
    uint32_t prefix = 0, mask = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += bd) hist[i] = 0;
        __syncthreads();
        for (int j = tid; j < n; j += bd) {
            const uint32_t key = key_of(j);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            int acc = 0, b = 255;
            for (; b > 0; --b) {
                if (acc + (int)hist[b] >= need) break;
                acc += hist[b];
            }
            *s_prefix = prefix | ((uint32_t)b << shift);
            *s_need = need - acc;
        }
        __syncthreads();
        prefix = *s_prefix;
        need = *s_need;
        mask |= 255u << shift;
    }
    // prefix is the k-th largest key; take every larger key and the `need` oldest
    // positions holding it, in position order.
    int eq_before = 0, written = 0;
    for (int j0 = 0; j0 < n; j0 += bd) {
        const int j = j0 + tid;
        const bool in = j < n;
        const uint32_t key = in ? key_of(j) : 0u;
        const int eq = in && key == prefix;
        int eq_total, take_total;
        const int eq_rank = block_exclusive_scan(eq, red, &eq_total);
        const int take = in && (key > prefix || (eq && eq_before + eq_rank < need));
        const int at = block_exclusive_scan(take, red, &take_total);
        if (take) out[written + at] = j;
        eq_before += eq_total;
        written += take_total;
    }
}

// The selection of one (decode row, KV head): k = min(max(floor(mean_h counts), 1),
// kmax) (every position when n ≤ kmax), then the k positions with the largest group
// estimate, ties to the older position, written ascending to sel[row, g, 0..k).
// Radix select of the k-th largest key (four 8-bit passes), then one ordered pass.
// Writes ks[row] = k and stage_ctx[row] = k + 1 (the attention's keys with the new
// token) and klog[row] = k. grid (R, KVH), block IG_THREADS.
extern "C" __global__ void __launch_bounds__(IG_THREADS) ig_select(
    const float* __restrict__ s, const int32_t* __restrict__ counts,
    const int32_t* __restrict__ nctx, const int32_t* __restrict__ kmax, int stride,
    int num_heads, int num_kv_heads, int32_t* __restrict__ sel, int kcap,
    int32_t* __restrict__ ks, int32_t* __restrict__ stage_ctx, int32_t* __restrict__ klog) {
    __shared__ unsigned int hist[256];
    __shared__ int red[WARP];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need;
    const int row = blockIdx.x, g = blockIdx.y, tid = threadIdx.x, bd = blockDim.x;
    const int H = num_heads, G = num_heads / num_kv_heads;
    const int n = nctx[row], km = max(kmax[row], 1);
    int32_t* out = sel + ((int64_t)row * num_kv_heads + g) * kcap;
    int k;
    if (n <= km) {
        k = n;
        for (int j = tid; j < n; j += bd) out[j] = j;
    } else {
        long long total = 0;
        for (int i = 0; i < H; ++i) total += counts[row * H + i];
        k = (int)min((long long)km, max(1LL, total / H));
        const float* base = s + ((int64_t)row * H + g * G) * stride;
        top_k_ascending([&](int j) { return order_key(group_est(base, G, stride, j)); }, n, k, out,
                        hist, red, &s_prefix, &s_need);
    }
    if (g == 0 && tid == 0) {
        ks[row] = k;
        stage_ctx[row] = k + 1;
        if (klog != nullptr) klog[row] = k;
    }
}

// H2O's prefill keep on the device, the host rule (`H2o::prefill_keep`) exactly: of the
// first m = n - recent positions, the `heavy` with the highest scores (ties: the older),
// then the recent window, ascending, for each KV head. score: [KVH, n] in position order
// (scores_gather); keep: [KVH, heavy + recent]. grid KVH, block KEEP_THREADS. So no copy
// to the host and back sits between a layer's statistics and its compaction. Scores
// are sums of probabilities, never NaN (a NaN would rank highest).
#define KEEP_THREADS 1024
extern "C" __global__ void __launch_bounds__(KEEP_THREADS)
    h2o_prefill_keep(const float* __restrict__ score, int32_t* __restrict__ keep, int n,
                     int recent, int heavy) {
    __shared__ unsigned int hist[256];
    __shared__ int red[WARP];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need;
    const int g = blockIdx.x;
    const float* sg = score + (int64_t)g * n;
    int32_t* kg = keep + (int64_t)g * (heavy + recent);
    const int m = n - recent;
    if (heavy >= m) {
        for (int j = threadIdx.x; j < m; j += blockDim.x) kg[j] = j;
    } else if (heavy > 0) {
        top_k_ascending([&](int j) { return order_key(sg[j]); }, m, heavy, kg, hist, red,
                        &s_prefix, &s_need);
    }
    for (int i = threadIdx.x; i < recent; i += blockDim.x) kg[heavy + i] = m + i;
}

// The selected rows of offloaded layer li from the host tier into the staging slots
// of each decode row: K/V of position sel[row, g, j] → staging slot row * B + j, head
// g. One warp per (row, g, j). grid (R, KVH, ceil(kcap / warps per block)).
extern "C" __global__ void ig_gather(const uint64_t* __restrict__ chunks,
                                     const int32_t* __restrict__ host_tables, int max_hblocks,
                                     const int32_t* __restrict__ sel, int kcap,
                                     const int32_t* __restrict__ ks, int li, int off_layers,
                                     int block_size, int num_kv_heads, int head_dim, int bpc,
                                     __nv_bfloat16* __restrict__ k_stage,
                                     __nv_bfloat16* __restrict__ v_stage, int B) {
    const int row = blockIdx.x, g = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int j = blockIdx.z * (blockDim.x / WARP) + warp;
    if (j >= ks[row]) return;
    const int p = sel[((int64_t)row * num_kv_heads + g) * kcap + j];
    const int32_t* table = host_tables + (int64_t)row * max_hblocks;
    const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
    const int row_elems = num_kv_heads * head_dim;
    const int64_t dst = (((int64_t)row * B + j) * num_kv_heads + g) * head_dim;
    copy_bf16(k_stage + dst,
              host_row(chunks, slot, li, 0, off_layers, block_size, row_elems, bpc) +
                  g * head_dim,
              head_dim, lane, WARP);
    copy_bf16(v_stage + dst,
              host_row(chunks, slot, li, 1, off_layers, block_size, row_elems, bpc) +
                  g * head_dim,
              head_dim, lane, WARP);
}

// The token-major gather (KVBENCH_IG_GATHER=tokens), first pass: marks[row, g, p] =
// j + 1 for the j-th selected position p of (row, g); 0 elsewhere (the second pass clears
// what it read, so the buffer is all zeros between gathers). grid (R, KVH,
// ceil(kcap / block)).
extern "C" __global__ void ig_mark(const int32_t* __restrict__ sel, int kcap,
                                   const int32_t* __restrict__ ks, int num_kv_heads,
                                   int stride, int32_t* __restrict__ marks) {
    const int row = blockIdx.x, g = blockIdx.y;
    const int j = blockIdx.z * blockDim.x + threadIdx.x;
    if (j >= ks[row]) return;
    const int64_t rg = (int64_t)row * num_kv_heads + g;
    marks[rg * stride + sel[rg * kcap + j]] = j + 1;
}

// Second pass: ig_gather's copies in token order. One warp per position p < nctx[row]
// (consecutive warps, consecutive positions of a row): lane g < KVH reads (and clears)
// head g's mark, then half-warps copy the K/V slices of the heads that selected p, two
// heads at a time, to the slots ig_gather writes. A token's selected slices are read
// together and a block's reads ascend through the row's host blocks: zero-copy reads of
// 256-byte rows in random order ran at 27 % of the host link's copy rate on an H200, in
// order at 92 % (results/baselines/h200/NOTES.md). KVH <= 32.
// grid (ceil(stride / warps per block), R).
extern "C" __global__ void ig_gather_tokens(
    const uint64_t* __restrict__ chunks, const int32_t* __restrict__ host_tables,
    int max_hblocks, int32_t* __restrict__ marks, int stride, const int32_t* __restrict__ nctx,
    int li, int off_layers, int block_size, int num_kv_heads, int head_dim, int bpc,
    __nv_bfloat16* __restrict__ k_stage, __nv_bfloat16* __restrict__ v_stage, int B) {
    const int row = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int p = blockIdx.x * (blockDim.x / WARP) + warp;
    if (p >= nctx[row]) return;
    int32_t* m = marks + (int64_t)row * num_kv_heads * stride + p;
    int mark = 0;
    if (lane < num_kv_heads) {
        mark = m[(int64_t)lane * stride];
        if (mark != 0) m[(int64_t)lane * stride] = 0;
    }
    if (__ballot_sync(0xffffffffu, mark != 0) == 0) return;
    const int32_t* table = host_tables + (int64_t)row * max_hblocks;
    const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
    const int row_elems = num_kv_heads * head_dim;
    const __nv_bfloat16* kr = host_row(chunks, slot, li, 0, off_layers, block_size, row_elems, bpc);
    const __nv_bfloat16* vr = host_row(chunks, slot, li, 1, off_layers, block_size, row_elems, bpc);
    const int half = lane / 16, hl = lane % 16;
    for (int g0 = 0; g0 < num_kv_heads; g0 += 2) {
        const int g = g0 + half;
        const int mg = __shfl_sync(0xffffffffu, mark, min(g, WARP - 1));
        if (g < num_kv_heads && mg != 0) {
            const int64_t dst = (((int64_t)row * B + (mg - 1)) * num_kv_heads + g) * head_dim;
            copy_bf16(k_stage + dst, kr + g * head_dim, head_dim, hl, 16);
            copy_bf16(v_stage + dst, vr + g * head_dim, head_dim, hl, 16);
        }
    }
}

// Each decode row's own new K/V (rows src_rows of k/v [T, KVH, D]) into staging slot
// row * B + ks[row], after its selection. grid R.
extern "C" __global__ void ig_stage_own(const __nv_bfloat16* __restrict__ k,
                                       const __nv_bfloat16* __restrict__ v,
                                       const int32_t* __restrict__ src_rows,
                                       const int32_t* __restrict__ ks, int B, int row_elems,
                                       __nv_bfloat16* __restrict__ k_stage,
                                       __nv_bfloat16* __restrict__ v_stage) {
    const int row = blockIdx.x;
    const int64_t src = (int64_t)src_rows[row] * row_elems;
    const int64_t dst = ((int64_t)row * B + ks[row]) * row_elems;
    copy_bf16(k_stage + dst, k + src, row_elems, threadIdx.x, blockDim.x);
    copy_bf16(v_stage + dst, v + src, row_elems, threadIdx.x, blockDim.x);
}

// ---- Fused elementwise work of a layer (one launch where candle takes two) ----

// Eight bf16 (one 16-byte load) as four float pairs, and back (rounded to nearest).
__device__ __forceinline__ void unpack8(const uint4& v, float2 (&f)[4]) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; j++) f[j] = __bfloat1622float2(p[j]);
}

__device__ __forceinline__ uint4 pack8(const float2 (&f)[4]) {
    uint4 v;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; j++) p[j] = __float22bfloat162_rn(f[j]);
    return v;
}

// SwiGLU's elementwise part on the batched gate/up product: gu holds gate then up,
// n elements each (n = rows * ff); out[i] = silu(gate[i]) * up[i] in f32, rounded
// once. Eight elements per thread-iteration (16-byte loads): n % 8 == 0 and gu, out
// 16-byte aligned (the caller checks). Grid-stride, any grid.
extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* __restrict__ gu,
                                         __nv_bfloat16* __restrict__ out, int64_t n) {
    const int64_t n8 = n / 8;
    const uint4* g = reinterpret_cast<const uint4*>(gu);
    const uint4* u = reinterpret_cast<const uint4*>(gu + n);
    uint4* o = reinterpret_cast<uint4*>(out);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
         i += (int64_t)gridDim.x * blockDim.x) {
        float2 x[4], y[4];
        unpack8(g[i], x);
        unpack8(u[i], y);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            x[j].x = x[j].x / (1.f + __expf(-x[j].x)) * y[j].x;
            x[j].y = x[j].y / (1.f + __expf(-x[j].y)) * y[j].y;
        }
        o[i] = pack8(x);
    }
}

// The pair (src[d], src[d + half]) rotated by (c, s) into dst: (x0 c - x1 s, x0 s + x1 c)
// in f32, rounded once. rope_qk_bf16, rope_write_bf16 and rope_last_index_bf16 rotate
// through it, so the first two agree to the bit.
__device__ __forceinline__ void rotate_pair(const __nv_bfloat16* __restrict__ src,
                                            __nv_bfloat16* __restrict__ dst, int d, int half,
                                            float c, float s) {
    const float x0 = __bfloat162float(src[d]), x1 = __bfloat162float(src[d + half]);
    dst[d] = __float2bfloat16(x0 * c - x1 * s);
    dst[d + half] = __float2bfloat16(x0 * s + x1 * c);
}

// RoPE on a step's queries and keys in one launch (candle's rope_thd takes one each):
// q [T, H, D] and k [T, KVH, D], halves rotated together (dimension i pairs with
// i + D/2): (x0 c - x1 s, x0 s + x1 c) with cos/sin [T, D/2] of each row's position,
// in f32, rounded once. grid (T, ceil(pairs / block)): a thread per pair, so that a
// decode step's few rows still spread over several SMs.
extern "C" __global__ void rope_qk_bf16(const __nv_bfloat16* __restrict__ q,
                                        const __nv_bfloat16* __restrict__ k,
                                        const __nv_bfloat16* __restrict__ cos,
                                        const __nv_bfloat16* __restrict__ sin,
                                        __nv_bfloat16* __restrict__ q_out,
                                        __nv_bfloat16* __restrict__ k_out, int num_heads,
                                        int num_kv_heads, int head_dim) {
    const int t = blockIdx.x, half = head_dim / 2;
    const int pairs = (num_heads + num_kv_heads) * half;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < pairs) {
        const int h = i / half, d = i % half;
        const float c = __bfloat162float(cos[(int64_t)t * half + d]);
        const float s_ = __bfloat162float(sin[(int64_t)t * half + d]);
        const bool is_q = h < num_heads;
        const int64_t row = is_q ? ((int64_t)t * num_heads + h) * head_dim
                                 : ((int64_t)t * num_kv_heads + (h - num_heads)) * head_dim;
        rotate_pair(is_q ? q + row : k + row, is_q ? q_out + row : k_out + row, d, half, c,
                    s_);
    }
}

// rope_qk_bf16 and kv_write_bf16 in one launch (a decode step of `full` replayed from a
// CUDA graph): queries rotated into q_out, keys rotated and values copied straight into
// the cache rows at slots[t]. Both rotate through rotate_pair: the same bits.
// grid (T, ceil((H + 2 KVH) * D/2 / block)): a thread per rotated pair, or per two
// value elements (d and d + D/2).
extern "C" __global__ void rope_write_bf16(const __nv_bfloat16* __restrict__ q,
                                           const __nv_bfloat16* __restrict__ k,
                                           const __nv_bfloat16* __restrict__ v,
                                           const __nv_bfloat16* __restrict__ cos,
                                           const __nv_bfloat16* __restrict__ sin,
                                           __nv_bfloat16* __restrict__ q_out,
                                           __nv_bfloat16* __restrict__ k_cache,
                                           __nv_bfloat16* __restrict__ v_cache,
                                           const int32_t* __restrict__ slots, int num_heads,
                                           int num_kv_heads, int head_dim) {
    const int t = blockIdx.x, half = head_dim / 2;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= (num_heads + 2 * num_kv_heads) * half) return;
    const int h = i / half, d = i % half;
    const int64_t cache_row = (int64_t)slots[t] * num_kv_heads * head_dim;
    if (h >= num_heads + num_kv_heads) {
        const int g = h - num_heads - num_kv_heads;
        const int64_t src = ((int64_t)t * num_kv_heads + g) * head_dim;
        __nv_bfloat16* dst = v_cache + cache_row + (int64_t)g * head_dim;
        dst[d] = v[src + d];
        dst[d + half] = v[src + d + half];
        return;
    }
    const float c = __bfloat162float(cos[(int64_t)t * half + d]);
    const float s_ = __bfloat162float(sin[(int64_t)t * half + d]);
    const bool is_q = h < num_heads;
    const __nv_bfloat16* src =
        is_q ? q + ((int64_t)t * num_heads + h) * head_dim
             : k + ((int64_t)t * num_kv_heads + (h - num_heads)) * head_dim;
    __nv_bfloat16* dst = is_q ? q_out + ((int64_t)t * num_heads + h) * head_dim
                              : k_cache + cache_row + (int64_t)(h - num_heads) * head_dim;
    rotate_pair(src, dst, d, half, c, s_);
}

// Rolling positions (StreamingLLM): each decode row's query rotated to its cache's last
// index, params[row * 4] - 1 (the row's kept slots m with the new token), from the
// rotation rows cos/sin [indices, D/2] (f32) the decode kernel rotates keys with, so
// the query's index comes from the device and a CUDA graph can replay the step. Halves
// rotated together (non-interleaved), in f32, rounded once. x, out [R, H, D] bf16;
// cos/sin hold `indices` rows; grid (R, ceil(H * D/2 / block)): a thread per pair.
extern "C" __global__ void rope_last_index_bf16(const __nv_bfloat16* __restrict__ x,
                                                const int32_t* __restrict__ params,
                                                const float* __restrict__ cos,
                                                const float* __restrict__ sin,
                                                __nv_bfloat16* __restrict__ out, int num_heads,
                                                int head_dim, int indices) {
    const int r = blockIdx.x, half = head_dim / 2;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= num_heads * half) return;
    const int h = i / half, d = i % half;
    const int64_t index = params[(int64_t)r * 4] - 1;
    // An index past the rows (tables not grown for it) gives NaN, which every check
    // fails, rather than another index's rotation.
    const bool ok = index >= 0 && index < indices;
    const float c = ok ? cos[index * half + d] : NAN, s_ = ok ? sin[index * half + d] : NAN;
    const int64_t row = ((int64_t)r * num_heads + h) * head_dim;
    rotate_pair(x + row, out + row, d, half, c, s_);
}

// The residual add and the next RMSNorm of one row per block: x_out = x + a (rounded
// to bf16, as the separate add), h = x_out * rsqrt(mean(x_out^2) + eps) * w (f32,
// rounded once). hidden % 8 == 0, 16-byte aligned rows; blockDim a multiple of 32, at
// most 1024.
extern "C" __global__ void add_rms_norm_bf16(const __nv_bfloat16* __restrict__ x,
                                             const __nv_bfloat16* __restrict__ a,
                                             const __nv_bfloat16* __restrict__ w,
                                             __nv_bfloat16* __restrict__ x_out,
                                             __nv_bfloat16* __restrict__ h, int hidden,
                                             float eps) {
    __shared__ float partial[32];
    const int64_t row = (int64_t)blockIdx.x * hidden;
    const int n8 = hidden / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x + row);
    const uint4* av = reinterpret_cast<const uint4*>(a + row);
    uint4* xo = reinterpret_cast<uint4*>(x_out + row);
    float ss = 0.f;
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        float2 s[4], t[4];
        unpack8(xv[i], s);
        unpack8(av[i], t);
#pragma unroll
        for (int j = 0; j < 4; j++) s[j] = make_float2(s[j].x + t[j].x, s[j].y + t[j].y);
        const uint4 r = pack8(s);
        xo[i] = r;
        unpack8(r, s);  // the rounded sum, as stored, is what the norm sees
#pragma unroll
        for (int j = 0; j < 4; j++) ss += s[j].x * s[j].x + s[j].y * s[j].y;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & (WARP - 1)) == 0) partial[threadIdx.x / WARP] = ss;
    __syncthreads();
    if (threadIdx.x < WARP) {
        const int warps = blockDim.x / WARP;
        float v = threadIdx.x < warps ? partial[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) partial[0] = rsqrtf(v / hidden + eps);
    }
    __syncthreads();
    const float inv = partial[0];
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    uint4* hv = reinterpret_cast<uint4*>(h + row);
    // Each thread reads back only the chunks it wrote above.
    for (int i = threadIdx.x; i < n8; i += blockDim.x) {
        float2 s[4], g[4];
        unpack8(xo[i], s);
        unpack8(wv[i], g);
#pragma unroll
        for (int j = 0; j < 4; j++) s[j] = make_float2(s[j].x * inv * g[j].x, s[j].y * inv * g[j].y);
        hv[i] = pack8(s);
    }
}

// Greedy sampling on the device: each row's index of its largest logit, ties to the
// smallest index, NaN skipped (index 0 for a row of NaN only), the rule of the host's
// argmax (engine.rs). Two kernels: blocks (part, row) each scan `chunk` logits of a
// row and write their candidate; one warp per row then merges the row's candidates.
// candle's argmax runs one block per row (96 us for 16 rows of 128K logits on an H100,
// results/baselines/h100/profile-decode). A candidate is (value, index), index
// ARGMAX_NONE when it holds none; the order is total over the candidates (larger
// value, then smaller index), so the merge order does not matter.
#define ARGMAX_THREADS 256
#define ARGMAX_NONE 0x7fffffff

__device__ __forceinline__ bool argmax_beats(float v, int i, float bv, int bi) {
    if (i == ARGMAX_NONE) return false;
    if (bi == ARGMAX_NONE) return true;
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void argmax_warp(float& v, int& i) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_beats(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

// logits [rows, vocab] f32; grid (parts, rows), blockDim ARGMAX_THREADS; candidates
// [rows, parts] (part_v values, part_i indices).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_part_f32(const float* __restrict__ logits, int vocab, int chunk,
                    float* __restrict__ part_v, int* __restrict__ part_i) {
    __shared__ float sv[ARGMAX_THREADS / WARP];
    __shared__ int si[ARGMAX_THREADS / WARP];
    const float* row = logits + (int64_t)blockIdx.y * vocab;
    const int lo = blockIdx.x * chunk;
    const int hi = min(vocab, lo + chunk);
    float v = 0.f;
    int i = ARGMAX_NONE;
    // Each thread's indices ascend: a strict > keeps the smallest index of a tie.
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float x = row[j];
        if (!isnan(x) && (i == ARGMAX_NONE || x > v)) {
            v = x;
            i = j;
        }
    }
    argmax_warp(v, i);
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) {
        sv[w] = v;
        si[w] = i;
    }
    __syncthreads();
    if (w == 0) {
        const bool has = lane < (int)(blockDim.x / WARP);
        v = has ? sv[lane] : 0.f;
        i = has ? si[lane] : ARGMAX_NONE;
        argmax_warp(v, i);
        if (lane == 0) {
            const int64_t at = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
            part_v[at] = v;
            part_i[at] = i;
        }
    }
}

// One warp per row (grid rows, blockDim WARP): the row's `parts` candidates merged
// into its token id.
extern "C" __global__ void argmax_merge(const float* __restrict__ part_v,
                                        const int* __restrict__ part_i, int parts,
                                        uint32_t* __restrict__ ids) {
    const int64_t base = (int64_t)blockIdx.x * parts;
    float v = 0.f;
    int i = ARGMAX_NONE;
    for (int p = threadIdx.x; p < parts; p += WARP) {
        if (argmax_beats(part_v[base + p], part_i[base + p], v, i)) {
            v = part_v[base + p];
            i = part_i[base + p];
        }
    }
    argmax_warp(v, i);
    if (threadIdx.x == 0) ids[blockIdx.x] = i == ARGMAX_NONE ? 0u : (uint32_t)i;
}

// Matrix-vector products of a decode step's few rows (kvbench's, beside cuBLAS's):
// y = x · Wᵀ for x [t, k] and W [n, k] bf16, f32 sums rounded once. A batch-1 step is
// about 90 % such products, so the rate they read the weights at bounds the step
// (docs/cuda.md). One warp per matrix row at a time (grid-stride over the rows), each
// lane reading 16-byte chunks of it, GEMV_UNROLL chunks in flight before any is used,
// streamed past L2 (a weight is read once a step); x read through L1, where every warp
// of an SM finds the same t rows. The sum of input row r and matrix row i goes to
// y[(i / nb) * t * nb + r * nb + i % nb]: [t, n] for nb = n, and for a stack of
// matrices [g, nb, k] with x broadcast over them, [g, t, nb], as candle's batched
// product lays it out. Needs k % 8 == 0, W and x 16-byte aligned, 1 <= t <=
// GEMV_MAX_ROWS (the caller checks); blockDim GEMV_WARPS * WARP, any grid.
#define GEMV_MAX_ROWS 4
#define GEMV_WARPS 8
#define GEMV_UNROLL 8

// Chunk c of each of the t rows of x dotted with one chunk of W, into acc.
__device__ __forceinline__ void gemv_chunk(const uint4& wv, const uint4* __restrict__ x,
                                           int64_t k8, int c, int t,
                                           float (&acc)[GEMV_MAX_ROWS]) {
    float2 wf[4];
    unpack8(wv, wf);
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < t) {
            float2 xf[4];
            unpack8(__ldg(x + r * k8 + c), xf);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                acc[r] = fmaf(wf[j].x, xf[j].x, acc[r]);
                acc[r] = fmaf(wf[j].y, xf[j].y, acc[r]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP, 4)
    gemv_bf16(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
              __nv_bfloat16* __restrict__ y, int n, int k, int t, int nb) {
    const int lane = threadIdx.x & (WARP - 1);
    const int64_t k8 = k / 8;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int64_t i = (int64_t)blockIdx.x * GEMV_WARPS + threadIdx.x / WARP; i < n;
         i += (int64_t)gridDim.x * GEMV_WARPS) {
        const uint4* wr = reinterpret_cast<const uint4*>(w) + i * k8;
        float acc[GEMV_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;
        int c = lane;
        for (; c + (GEMV_UNROLL - 1) * WARP < k8; c += GEMV_UNROLL * WARP) {
            uint4 wv[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) wv[u] = __ldcs(wr + c + u * WARP);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) gemv_chunk(wv[u], xv, k8, c + u * WARP, t, acc);
        }
        for (; c < k8; c += WARP) gemv_chunk(__ldcs(wr + c), xv, k8, c, t, acc);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) {
            if (r < t) {
                const float s = warp_sum(acc[r]);
                if (lane == 0)
                    y[(i / nb) * t * nb + (int64_t)r * nb + i % nb] = __float2bfloat16(s);
            }
        }
    }
}
