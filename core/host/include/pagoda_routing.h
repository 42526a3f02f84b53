// What every MoE kernel shares: the routing it takes (for x [T, H], each token's chosen experts topk_ids [T, k]
// (int64) and their weights topk_weights [T, k] (float32)) and the experts' activation.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagoda {

inline void check_routing(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == x.size(0),
              "topk_ids must be a contiguous int64 [T, k] tensor");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights must be a contiguous float32 tensor shaped like topk_ids");
}

// h = act(gate, up) of an expert: silu(gate) * up, or gpt-oss's clamped SwiGLU
enum Activation : int64_t { kSiluMul = 0, kClampedSwiglu = 1 };

struct ActParams {
  int64_t kind;
  float alpha, limit;  // the clamped SwiGLU's
};

inline float activate(float g, float u, const ActParams& a) {
  if (a.kind == kSiluMul) return g / (1.f + std::exp(-g)) * u;
  // gpt-oss: gate clamped from above, up on both sides, gate * sigmoid(alpha * gate) * (up + 1)
  g = std::min(g, a.limit);
  u = std::max(-a.limit, std::min(u, a.limit));
  return (u + 1.f) * (g / (1.f + std::exp(-a.alpha * g)));
}

}  // namespace pagoda
