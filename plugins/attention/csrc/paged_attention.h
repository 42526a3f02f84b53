// pagoda PagedAttention CUDA kernels: parameters shared by the kernels (.cu) and the torch binding (.cpp).
// Plain C++ on purpose: the binding compiles without CUDA headers.
#pragma once

#include <cstdint>

namespace pagoda {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// KV layout: [2, num_blocks, num_kv_heads, block_size, head_dim], contiguous (K then V).
struct DecodeParams {
  void* out;                 // [num_seqs, num_heads, head_dim] storage dtype, row strides below
  const void* q;             // [num_seqs, num_heads, head_dim] storage dtype, row strides below
  const void* kv_cache;
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  const int32_t* seq_lens;      // [num_seqs]
  float* part_out;           // [num_seqs, num_heads, max_parts, head_dim]   (used when max_parts > 1)
  float* part_max;           // [num_seqs, num_heads, max_parts]   max score of a partition
  float* part_sum;           // [num_seqs, num_heads, max_parts]   sum of exp(score - max) of a partition
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t cache_stride_kv;   // elements between the K and the V half
  int block_table_stride;
  int num_seqs, num_heads, num_kv_heads, head_dim;
  int block_size_log2;       // block_size is a power of two
  int partition_size;        // keys per partition (split-K)
  int max_parts;             // partitions of the longest sequence
  float scale;               // softmax scale
};

struct KVWriteParams {
  const void* k;             // [num_tokens, num_kv_heads, head_dim], row strides below
  const void* v;
  void* kv_cache;
  const int64_t* slot_mapping;  // [num_tokens], -1 = skip
  int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h;
  int64_t cache_stride_kv;
  int num_tokens, num_kv_heads, head_dim, block_size;
};

// Each returns 0 or a cudaError_t value; -1 for an unsupported head_dim or dtype.
int paged_decode(const DecodeParams& params, int dtype, void* stream);
int kv_write(const KVWriteParams& params, int dtype, void* stream);
const char* error_string(int code);

}  // namespace pagoda
