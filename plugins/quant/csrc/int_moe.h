// The routed experts of one Mixture-of-Experts layer from packed int / MXFP4 / FP8 weights: the (token, slot)
// pairs grouped by expert, each active expert's gate_up and down projections cut into items of rows run through
// int_linear.h's run() in one parallel region, and the weighted sum of the experts' outputs (int_moe_experts, with
// the checks of its arguments).
//
// Part of the one translation unit cpu_int_kernels.cpp (its definitions are internal to that build, in an unnamed
// namespace); the build's name covers this file's text, so an edit here builds the kernel anew.
#pragma once

#include "pagoda_parallel.h"
#include "pagoda_routing.h"
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "int_codes.h"
#include "int_linear.h"

namespace {

// An expert some token chose: its tokens, their activations [m, H], gate_up sums [m, 2I], h [m, I], outputs [m, H]
struct ActiveExpert {
  int64_t e;
  at::Tensor tokens, x, gate_up, h, y;
};

// The packed experts of one layer: codes w_q [E, rows, bytes] (integers, FP4 or FP8: `codes`), scales
// [E, rows, groups] (and zero points for integer codes), biases [E, rows] in the model dtype or none, and for
// act-order checkpoints each expert's order of the input columns perm [E, parts, in] int64 (the packed column j
// multiplies input perm[e, part, j]; parts: gate and up for w13, one for w2) or none
struct PackedExperts {
  at::Tensor q, scales;
  c10::optional<at::Tensor> zeros, bias, perm;
  int64_t group_size;
  int codes;

  template <typename T>
  GroupScales<T> of(int64_t e) const {
    const GroupScales<T> all = group_scales<T>(scales, zeros);
    return all.from_row(e * q.size(1));
  }
  c10::optional<at::Tensor> bias_of(int64_t e) const {
    return bias.has_value() ? c10::optional<at::Tensor>((*bias)[e]) : c10::nullopt;
  }
  c10::optional<at::Tensor> perm_of(int64_t e, int64_t part) const {
    return perm.has_value() ? c10::optional<at::Tensor>((*perm)[e][part]) : c10::nullopt;
  }
};

// The routed experts of one Mixture-of-Experts layer in the layout above, every expert's rows stacked:
// w13 [E, 2I, bytes] (gate rows, then up rows) with scales (zeros) [E, 2I, groups] and biases [E, 2I], w2 [E, H, bytes]
// with [E, H, groups] and [E, H]. The (token, slot) pairs are grouped by expert and each active expert runs on its own
// tokens only, in one parallel region of (expert, rows) items (gate_up, then down), each item's rows through run()
// (direct tiles for few tokens, a dequantized tile and a GEMM for many; run() is serial inside a parallel region):
//   h = act(x W13[e]^T gate rows + b, x W13[e]^T up rows + b),  y = h W2[e]^T + b2[e],
// (x and h taken in each projection's packed column order where the experts were quantized in act-order),
//   out[t] = sum_j weight[t, j] y[t, j]
// with act silu(gate) * up or gpt-oss's clamped SwiGLU (pagoda::activate). The gate_up sums, h and y are rounded to
// T as a dense MLP in T rounds them (a bias in T added before the rounding); the weighted sum is fp32, in ascending
// expert order, rounded to T once.
template <typename T>
void run_moe(const at::Tensor& x, const PackedExperts& w13, const PackedExperts& w2, const at::Tensor& topk_ids,
             const at::Tensor& topk_weights, int bits, const pagoda::ActParams& act, int impl, int64_t gemm_min_rows,
             int64_t tile_rows, at::Tensor& out) {
  const int64_t num_tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  const int64_t num_experts = w13.q.size(0), inter = w13.q.size(1) / 2;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  std::vector<std::vector<int64_t>> slots(num_experts);  // each expert's slots, in token order
  for (int64_t s = 0; s < num_tokens * top_k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, "expert id ", ids[s], " out of range [0, ", num_experts, ")");
    slots[ids[s]].push_back(s);
  }
  std::vector<ActiveExpert> active;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // Work items of whole tiles of 8 rows, about four per thread: each run() call prepares its activations once
  // (a few microseconds), so items are as large as the balance of the threads allows (32 to 512 KiB of packed
  // rows); an expert on the GEMM path is one item per thread
  int64_t num_active = 0;
  for (const auto& s : slots) num_active += !s.empty();
  const auto chunk = [&](int64_t rows, int64_t row_bytes, int64_t m) {
    const int64_t bytes = std::clamp<int64_t>(num_active * rows * row_bytes / (4 * threads), 32768, 524288);
    const int64_t small = std::max<int64_t>(8, bytes / std::max<int64_t>(1, row_bytes) / 8 * 8);
    return m >= gemm_min_rows ? std::max<int64_t>(small, (rows + threads - 1) / threads) : small;
  };
  std::vector<std::tuple<int64_t, int64_t, int64_t>> gate_items, down_items;  // (active index, first row, end)
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t m = static_cast<int64_t>(slots[e].size());
    if (m == 0) continue;
    ActiveExpert a{e, at::empty({m}, at::TensorOptions().dtype(at::kLong)), {}, {}, {}, {}};
    int64_t* tp = a.tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) tp[r] = slots[e][r] / top_k;
    a.x = x.index_select(0, a.tokens);
    a.gate_up = at::empty({m, 2 * inter}, x.options());
    a.h = at::empty({m, inter}, x.options());
    a.y = at::empty({m, hidden}, x.options());
    const int64_t idx = static_cast<int64_t>(active.size());
    const int64_t c1 = chunk(inter, w13.q.size(2) * 2, m), c2 = chunk(hidden, w2.q.size(2), m);
    for (int64_t n = 0; n < inter; n += c1) gate_items.emplace_back(idx, n, std::min(inter, n + c1));
    for (int64_t n = 0; n < hidden; n += c2) down_items.emplace_back(idx, n, std::min(hidden, n + c2));
    active.push_back(std::move(a));
  }
  // the gate_up items, then the down items, in one parallel region; the worker threads take the caller's
  // inference / grad mode for the tensor ops of run()'s GEMM path
  const at::ThreadLocalState caller_state;
  const auto gate_up_item = [&](int64_t i) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const auto [idx, n0, n1] = gate_items[i];
    ActiveExpert& a = active[idx];
    for (const int64_t part : {0, 1}) {  // the gate rows, then the same up rows
      const int64_t first = part * inter + n0;
      run<T>(a.x, w13.q[a.e], w13.of<T>(a.e), w13.codes, w13.perm_of(a.e, part), bits, w13.group_size, first,
             first + n1 - n0, a.gate_up, w13.bias_of(a.e), impl, gemm_min_rows, tile_rows);
    }
    const T* gu = a.gate_up.data_ptr<T>();
    T* hp = a.h.data_ptr<T>();
    for (int64_t r = 0; r < a.x.size(0); ++r)
      for (int64_t n = n0; n < n1; ++n)
        hp[r * inter + n] = static_cast<T>(pagoda::activate(to_float(gu[r * 2 * inter + n]),
                                                            to_float(gu[r * 2 * inter + inter + n]), act));
  };
  const auto down_item = [&](int64_t i) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const auto [idx, n0, n1] = down_items[i];
    ActiveExpert& a = active[idx];
    run<T>(a.h, w2.q[a.e], w2.of<T>(a.e), w2.codes, w2.perm_of(a.e, 0), bits, w2.group_size, n0, n1, a.y,
           w2.bias_of(a.e), impl, gemm_min_rows, tile_rows);
  };
  pagoda::parallel_two_phases(static_cast<int64_t>(gate_items.size()), gate_up_item,
                              static_cast<int64_t>(down_items.size()), down_item);
  std::vector<float> acc(num_tokens * hidden, 0.f);  // [T, H] the weighted sums, experts in ascending order
  for (const ActiveExpert& a : active) {
    const T* yp = a.y.data_ptr<T>();
    const int64_t* tp = a.tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < a.x.size(0); ++r) {
      const float w = weights[slots[a.e][r]];
      float* dst = acc.data() + tp[r] * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] += w * to_float(yp[r * hidden + i]);
    }
  }
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < num_tokens * hidden; ++i) o[i] = static_cast<T>(acc[i]);
}

// One projection of the packed experts, checked against its shapes and codes: integers (scales and zeros in x's
// dtype), FP4 (4-bit, uint8 E8M0 scales, no zero points) or FP8 (8-bit, scales in x's dtype or float32, no zero
// points); biases float32 [E, rows] (the checkpoint's), taken in x's dtype; column orders int64 [E, parts, in]
PackedExperts packed_experts(const at::Tensor& w_q, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& perm,
                             int64_t parts, int64_t rows, int64_t in_features, int64_t bits, int64_t group_size,
                             int64_t codes, const at::Tensor& x, const char* name) {
  TORCH_CHECK(w_q.scalar_type() == at::kByte && w_q.dim() == 3 && w_q.is_contiguous() && w_q.size(1) == rows,
              name, "_q must be a contiguous uint8 [E, ", rows, ", bytes] tensor");
  TORCH_CHECK(group_size >= 1, "group sizes must be positive");
  const int64_t groups = (in_features + group_size - 1) / group_size;
  const int64_t bytes = bits == 4 ? (groups * group_size + 1) / 2 : groups * group_size;
  TORCH_CHECK(w_q.size(2) == bytes, name, "_q holds ", w_q.size(2), " bytes per row; ", in_features,
              " columns in groups of ", group_size, " take ", bytes);
  TORCH_CHECK(codes == kIntCodes || codes == kFp4Codes || codes == kFp8Codes, "codes must be 0, 1 or 2");
  TORCH_CHECK(zeros.has_value() == (codes == kIntCodes), name, ": integer codes take zero points, FP4 and FP8 none");
  TORCH_CHECK(codes != kFp4Codes || (bits == 4 && scales.scalar_type() == at::kByte), name,
              ": FP4 codes are 4-bit, with uint8 E8M0 scales");
  TORCH_CHECK(codes != kFp8Codes || bits == 8, name, ": FP8 codes are 8-bit");
  TORCH_CHECK(codes == kFp4Codes || scales.scalar_type() == x.scalar_type() ||
                  (codes == kFp8Codes && scales.scalar_type() == at::kFloat),
              name, " scales must be of x's dtype (or float32 for FP8 codes)");
  for (const at::Tensor* t : {&scales, zeros.has_value() ? &*zeros : &scales})
    TORCH_CHECK(t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == w_q.size(0) && t->size(1) == rows && t->size(2) == groups,
                name, " scales and zeros must be contiguous [E, ", rows, ", ", groups, "] tensors");
  c10::optional<at::Tensor> bias_t;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == w_q.size(0) &&
                    bias->size(1) == rows,
                name, " biases must be a float32 [E, ", rows, "] tensor");
    bias_t = bias->to(x.scalar_type()).contiguous();
  }
  if (perm.has_value())
    TORCH_CHECK(perm->scalar_type() == at::kLong && perm->is_contiguous() && perm->dim() == 3 &&
                    perm->size(0) == w_q.size(0) && perm->size(1) == parts && perm->size(2) == in_features,
                name, " column orders must be a contiguous int64 [E, ", parts, ", ", in_features, "] tensor");
  return {w_q, scales, zeros, bias_t, perm, group_size, static_cast<int>(codes)};
}

// x [T, H] (float32, bfloat16 or float16); w13_q [E, 2I, bytes], s13 (z13) [E, 2I, groups of H], b13 [E, 2I];
// w2_q [E, H, bytes], s2 (z2) [E, H, groups of I], b2 [E, H]; topk_ids [T, k] int64, topk_weights [T, k] float32;
// p13 [E, 2, H] (the gate's and the up's) and p2 [E, 1, I]: act-order column orders, or none;
// codes: 0 integers, 1 FP4, 2 FP8; activation: 0 silu(gate) * up, 1 gpt-oss's clamped SwiGLU (alpha, limit)
at::Tensor int_moe_experts(const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& s13,
                           const c10::optional<at::Tensor>& z13, const at::Tensor& w2_q, const at::Tensor& s2,
                           const c10::optional<at::Tensor>& z2, const c10::optional<at::Tensor>& b13,
                           const c10::optional<at::Tensor>& b2, const c10::optional<at::Tensor>& p13,
                           const c10::optional<at::Tensor>& p2, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, int64_t bits, int64_t codes, int64_t group13,
                           int64_t group2, int64_t activation, double alpha, double limit, int64_t impl, int64_t gemm_min_rows,
                           int64_t tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [T, H] tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(activation == pagoda::kSiluMul || activation == pagoda::kClampedSwiglu, "activation must be 0 or 1");
  const int64_t hidden = x.size(1), inter = w13_q.dim() == 3 ? w13_q.size(1) / 2 : 0;
  const PackedExperts w13 = packed_experts(w13_q, s13, z13, b13, p13, 2, 2 * inter, hidden, bits, group13, codes, x,
                                           "w13");
  const PackedExperts w2 = packed_experts(w2_q, s2, z2, b2, p2, 1, hidden, inter, bits, group2, codes, x, "w2");
  TORCH_CHECK(w2_q.size(0) == w13_q.size(0), "w13 and w2 must hold the same experts");
  pagoda::check_routing(x, topk_ids, topk_weights);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const pagoda::ActParams act{activation, static_cast<float>(alpha), static_cast<float>(limit)};
  const auto run_as = [&](auto dtype) {
    run_moe<decltype(dtype)>(x, w13, w2, topk_ids, topk_weights, static_cast<int>(bits), act, static_cast<int>(impl),
                             gemm_min_rows, tile_rows, out);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run_as(float{}); break;
    case at::kBFloat16: run_as(at::BFloat16{}); break;
    case at::kHalf: run_as(at::Half{}); break;
    default: TORCH_CHECK(false, "int_moe_experts supports float32, bfloat16 and float16 activations");
  }
  return out;
}

}  // namespace
