// Torch binding of pagoda's PagedAttention CUDA kernels. No CUDA headers here: the
// current stream arrives from Python as an integer (torch.cuda.current_stream().cuda_stream).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

#include "paged_attention.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return pagoda::kFloat32;
    case at::kHalf: return pagoda::kFloat16;
    case at::kBFloat16: return pagoda::kBFloat16;
    default:
      TORCH_CHECK(false, "pagoda cuda attention: dtype ", t.scalar_type(), " is not float32, float16 or bfloat16");
  }
  return -1;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "pagoda cuda attention: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.stride(-1) == 1, "pagoda cuda attention: ", name, " must be contiguous in its last dimension");
}

int log2_exact(int64_t n) {
  TORCH_CHECK(n > 0 && (n & (n - 1)) == 0, "pagoda cuda attention: block_size must be a power of two, got ", n);
  int shift = 0;
  while ((int64_t{1} << shift) < n) ++shift;
  return shift;
}

// out, q: [num_seqs, num_heads, head_dim]; kv_cache: [2, num_blocks, num_kv_heads, block_size, head_dim]
void paged_attention_decode(at::Tensor out, at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, at::Tensor part_out, at::Tensor part_max,
                            at::Tensor part_sum, int64_t partition_size, int64_t max_parts, double scale,
                            int64_t stream) {
  check_cuda(out, "out");
  check_cuda(q, "q");
  check_cuda(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "pagoda cuda attention: kv_cache must be a contiguous "
              "[2, num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "pagoda cuda attention: q, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "pagoda cuda attention: block_tables must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "pagoda cuda attention: seq_lens must be contiguous int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0,
              "pagoda cuda attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(partition_size > 0 && max_parts > 0, "pagoda cuda attention: partition_size and max_parts must be > 0");
  if (max_parts > 1) {
    const int64_t slots = q.size(0) * q.size(1) * max_parts;
    TORCH_CHECK(part_out.is_contiguous() && part_max.is_contiguous() && part_sum.is_contiguous() &&
                    part_out.scalar_type() == at::kFloat && part_max.scalar_type() == at::kFloat &&
                    part_sum.scalar_type() == at::kFloat && part_out.numel() >= slots * q.size(2) &&
                    part_max.numel() >= slots && part_sum.numel() >= slots,
                "pagoda cuda attention: partition buffers must be contiguous float32 "
                "[num_seqs, num_heads, max_parts(, head_dim)]");
  }
  pagoda::DecodeParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.part_out = max_parts > 1 ? part_out.data_ptr<float>() : nullptr;
  p.part_max = max_parts > 1 ? part_max.data_ptr<float>() : nullptr;
  p.part_sum = max_parts > 1 ? part_sum.data_ptr<float>() : nullptr;
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.out_stride_t = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.cache_stride_kv = kv_cache.stride(0);
  p.block_table_stride = static_cast<int>(block_tables.stride(0));
  p.num_seqs = static_cast<int>(q.size(0));
  p.num_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(kv_cache.size(2));
  p.head_dim = static_cast<int>(q.size(2));
  p.block_size_log2 = log2_exact(kv_cache.size(3));
  p.partition_size = static_cast<int>(partition_size);
  p.max_parts = static_cast<int>(max_parts);
  p.scale = static_cast<float>(scale);
  if (p.num_seqs == 0) return;
  const int err = pagoda::paged_decode(p, dtype_code(q), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "pagoda cuda attention: decode kernel failed: ", pagoda::error_string(err),
              " (head_dim ", p.head_dim, ")");
}

// k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64, -1 = skip
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slot_mapping, int64_t stream) {
  check_cuda(k, "k");
  check_cuda(v, "v");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "pagoda cuda attention: kv_cache must be contiguous 5-d");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "pagoda cuda attention: k, v and kv_cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "pagoda cuda attention: slot_mapping must be contiguous int64");
  pagoda::KVWriteParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.v_stride_t = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.cache_stride_kv = kv_cache.stride(0);
  p.num_tokens = static_cast<int>(k.size(0));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(k.size(2));
  p.block_size = static_cast<int>(kv_cache.size(3));
  const int err = pagoda::kv_write(p, dtype_code(k), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "pagoda cuda attention: KV write kernel failed: ", pagoda::error_string(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagoda PagedAttention CUDA kernels";
  m.def("paged_attention_decode", &paged_attention_decode, "split-K paged decode attention (GQA)");
  m.def("write_kv", &write_kv, "scatter K/V into their paged slots");
}
