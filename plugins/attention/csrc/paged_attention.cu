// pagoda PagedAttention decode kernel and KV write kernel.
//
// Decode: one thread block per (sequence, KV head, partition). The block owns the
// `group` query heads that share its KV head (GQA), so each K/V row is read from
// global memory once per block. Threads form groups of TG lanes per key row; each
// lane reads 16-byte vectors of the row (coalesced: a warp reads 32 / TG adjacent
// rows of one block at a time). fp32 accumulation, storage in fp32, fp16 or bf16.
//
//   phase 1: scores q.k for every key of the partition -> shared memory
//   phase 2: per head, max and sum of exp over the partition (one warp per head)
//   phase 3: out = sum_t p_t * v_t, heads in tiles of G_TILE kept in registers
//
// A sequence longer than one partition is split (split-K): each partition writes
// its output normalised by its own sum, with its max and sum; a second kernel
// merges the partitions of each (sequence, head).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "paged_attention.h"

namespace pagoda {
namespace {

constexpr int kThreads = 128;  // 4 warps per block
constexpr int kGroupTile = 8;  // query heads accumulated at once in phase 3

// elements per 16-byte vector
template <typename T> struct VecWidth { static constexpr int value = 16 / sizeof(T); };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// one 16-byte load, widened to float: ptr must be 16-byte aligned
template <typename T>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[VecWidth<T>::value]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VecWidth<T>::value; ++i) out[i] = to_float(elems[i]);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// lanes per key row: the next power of two of the row's vectors, at most a warp
__host__ __device__ constexpr int next_pow2_upto32(int n) {
  return n > 16 ? 32 : n > 8 ? 16 : n > 4 ? 8 : n > 2 ? 4 : n > 1 ? 2 : 1;
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeParams p) {
  constexpr int VEC = VecWidth<T>::value;
  static_assert(HEAD_DIM % VEC == 0, "a row must be whole 16-byte vectors");
  constexpr int NVEC = HEAD_DIM / VEC;          // vectors per key row
  constexpr int TG = next_pow2_upto32(NVEC);     // lanes per key row
  constexpr int VPT = (NVEC + TG - 1) / TG;      // vectors per lane
  constexpr int WARPS = kThreads / 32;
  constexpr int ROWS_PER_WARP = 32 / TG;
  constexpr int ROWS_PER_ITER = WARPS * ROWS_PER_WARP;

  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.z;
  const int seq_len = p.seq_lens[seq];
  const int start = part * p.partition_size;
  if (start >= seq_len) return;  // the whole block leaves: this partition is past the sequence
  const int end = min(start + p.partition_size, seq_len);
  const int n = end - start;
  const int group = p.num_heads / p.num_kv_heads;
  const int head0 = kv_head * group;

  extern __shared__ float smem[];
  float* q_s = smem;                                // [group][HEAD_DIM], pre-scaled
  float* logits = q_s + group * HEAD_DIM;           // [group][partition_size]: scores, then exp
  float* out_s = logits + group * p.partition_size; // [kGroupTile][HEAD_DIM]
  float* stats = out_s + kGroupTile * HEAD_DIM;     // [2][group]: max, sum

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int row_slot = lane / TG;  // which of the warp's rows this lane works on
  const int li = lane % TG;        // lane within the row's group

  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < group * HEAD_DIM; i += kThreads) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    q_s[i] = to_float(q[seq * p.q_stride_t + (head0 + g) * p.q_stride_h + d]) * p.scale;
  }
  __syncthreads();

  const int block_size = 1 << p.block_size_log2;
  const int64_t head_stride = static_cast<int64_t>(block_size) * HEAD_DIM;
  const int64_t block_stride = head_stride * p.num_kv_heads;
  const T* k_base = static_cast<const T*>(p.kv_cache) + kv_head * head_stride;
  const T* v_base = k_base + p.cache_stride_kv;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;

  // phase 1: scores. The loop bound is uniform per warp, so every lane reaches the shuffles.
  for (int base = start + warp * ROWS_PER_WARP; base < end; base += ROWS_PER_ITER) {
    const int t = base + row_slot;
    const bool valid = t < end;
    float k_reg[VPT][VEC];
    if (valid) {
      const int64_t block = table[t >> p.block_size_log2];
      const T* row = k_base + block * block_stride + static_cast<int64_t>(t & (block_size - 1)) * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vi = li + j * TG;
        if (vi < NVEC) {
          load_vec<T>(row + vi * VEC, k_reg[j]);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) k_reg[j][e] = 0.f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) k_reg[j][e] = 0.f;
    }
    for (int g = 0; g < group; ++g) {
      const float* qg = q_s + g * HEAD_DIM;
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vi = li + j * TG;
        if (vi < NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot += qg[vi * VEC + e] * k_reg[j][e];
        }
      }
#pragma unroll
      for (int off = TG / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (valid && li == 0) logits[g * p.partition_size + (t - start)] = dot;
    }
  }
  __syncthreads();

  // phase 2: softmax statistics, one warp per head; logits become exp(score - max)
  for (int g = warp; g < group; g += WARPS) {
    float* row = logits + g * p.partition_size;
    float m = -FLT_MAX;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, row[i]);
    m = warp_max(m);
    float s = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = __expf(row[i] - m);
      row[i] = e;
      s += e;
    }
    s = warp_sum(s);
    if (lane == 0) {
      stats[g] = m;
      stats[group + g] = s;
    }
  }
  __syncthreads();

  // phase 3: weighted sum of V rows, G_TILE heads at a time
  T* out = static_cast<T*>(p.out);
  for (int g0 = 0; g0 < group; g0 += kGroupTile) {
    for (int i = tid; i < kGroupTile * HEAD_DIM; i += kThreads) out_s[i] = 0.f;
    __syncthreads();
    float acc[kGroupTile][VPT][VEC];
#pragma unroll
    for (int gg = 0; gg < kGroupTile; ++gg)
#pragma unroll
      for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[gg][j][e] = 0.f;
    for (int base = start + warp * ROWS_PER_WARP; base < end; base += ROWS_PER_ITER) {
      const int t = base + row_slot;
      if (t >= end) continue;
      const int64_t block = table[t >> p.block_size_log2];
      const T* row = v_base + block * block_stride + static_cast<int64_t>(t & (block_size - 1)) * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vi = li + j * TG;
        if (vi >= NVEC) continue;
        float v_reg[VEC];
        load_vec<T>(row + vi * VEC, v_reg);
#pragma unroll
        for (int gg = 0; gg < kGroupTile; ++gg) {
          if (g0 + gg >= group) break;
          const float w = logits[(g0 + gg) * p.partition_size + (t - start)];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[gg][j][e] += w * v_reg[e];
        }
      }
    }
    // sum the rows a warp worked on: lanes with the same li hold the same columns
#pragma unroll
    for (int gg = 0; gg < kGroupTile; ++gg)
#pragma unroll
      for (int j = 0; j < VPT; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
#pragma unroll
          for (int off = TG; off < 32; off <<= 1) {
            acc[gg][j][e] += __shfl_xor_sync(0xffffffffu, acc[gg][j][e], off);
          }
    if (row_slot == 0) {
#pragma unroll
      for (int gg = 0; gg < kGroupTile; ++gg) {
        if (g0 + gg >= group) break;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int vi = li + j * TG;
          if (vi >= NVEC) continue;
#pragma unroll
          for (int e = 0; e < VEC; ++e) atomicAdd(&out_s[gg * HEAD_DIM + vi * VEC + e], acc[gg][j][e]);
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < kGroupTile * HEAD_DIM; i += kThreads) {
      const int g = g0 + i / HEAD_DIM, d = i % HEAD_DIM;
      if (g >= group) continue;
      const float value = out_s[i] / stats[group + g];
      const int head = head0 + g;
      if (p.max_parts == 1) {
        out[seq * p.out_stride_t + head * p.out_stride_h + d] = from_float<T>(value);
      } else {
        const int64_t slot = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_parts + part;
        p.part_out[slot * HEAD_DIM + d] = value;
        if (d == 0) {
          p.part_max[slot] = stats[g];
          p.part_sum[slot] = stats[group + g];
        }
      }
    }
    __syncthreads();
  }
}

// one block per (sequence, head): out = sum_p w_p * out_p / sum_p w_p, w_p = sum_p * exp(max_p - max)
template <typename T, int HEAD_DIM>
__global__ void merge_partitions_kernel(const DecodeParams p) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int num_parts = (p.seq_lens[seq] + p.partition_size - 1) / p.partition_size;
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * p.max_parts;
  float m = -FLT_MAX;
  for (int i = 0; i < num_parts; ++i) m = fmaxf(m, p.part_max[base + i]);
  float total = 0.f;
  for (int i = 0; i < num_parts; ++i) total += p.part_sum[base + i] * __expf(p.part_max[base + i] - m);
  T* out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < num_parts; ++i) {
      acc += p.part_out[(base + i) * HEAD_DIM + d] * p.part_sum[base + i] * __expf(p.part_max[base + i] - m);
    }
    out[seq * p.out_stride_t + head * p.out_stride_h + d] = from_float<T>(acc / total);
  }
}

template <typename T, int HEAD_DIM>
int launch_decode(const DecodeParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const size_t smem = sizeof(float) * (static_cast<size_t>(group) * HEAD_DIM +
                                       static_cast<size_t>(group) * p.partition_size +
                                       kGroupTile * HEAD_DIM + 2 * group);
  auto kernel = paged_decode_kernel<T, HEAD_DIM>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const dim3 grid(p.num_seqs, p.num_kv_heads, p.max_parts);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  if (p.max_parts > 1) {
    merge_partitions_kernel<T, HEAD_DIM><<<dim3(p.num_seqs, p.num_heads), 128, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int dispatch_head_dim(const DecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_decode<T, 64>(p, stream);
    case 80: return launch_decode<T, 80>(p, stream);
    case 96: return launch_decode<T, 96>(p, stream);
    case 128: return launch_decode<T, 128>(p, stream);
    case 256: return launch_decode<T, 256>(p, stream);
    default: return -1;
  }
}

// one block per token, threads over (KV head, dim); a slot of -1 is a padding token
template <typename T>
__global__ void kv_write_kernel(const KVWriteParams p) {
  const int t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* cache = static_cast<T*>(p.kv_cache);
  const int width = p.num_kv_heads * p.head_dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const int h = i / p.head_dim, d = i % p.head_dim;
    const int64_t dst = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_dim + d;
    cache[dst] = k[t * p.k_stride_t + h * p.k_stride_h + d];
    cache[p.cache_stride_kv + dst] = v[t * p.v_stride_t + h * p.v_stride_h + d];
  }
}

template <typename T>
int launch_kv_write(const KVWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return 0;
  const int threads = min(1024, ((p.num_kv_heads * p.head_dim + 31) / 32) * 32);
  kv_write_kernel<T><<<p.num_tokens, threads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int paged_decode(const DecodeParams& params, int dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32: return dispatch_head_dim<float>(params, s);
    case kFloat16: return dispatch_head_dim<__half>(params, s);
    case kBFloat16: return dispatch_head_dim<__nv_bfloat16>(params, s);
    default: return -1;
  }
}

int kv_write(const KVWriteParams& params, int dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32: return launch_kv_write<float>(params, s);
    case kFloat16: return launch_kv_write<__half>(params, s);
    case kBFloat16: return launch_kv_write<__nv_bfloat16>(params, s);
    default: return -1;
  }
}

const char* error_string(int code) {
  if (code == -1) return "unsupported head_dim or dtype";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace pagoda
