// The routing every MoE kernel takes: for x [T, H], each token's chosen experts topk_ids [T, k] (int64) and their
// weights topk_weights [T, k] (float32).
#pragma once

#include <ATen/core/Tensor.h>

namespace pagoda {

inline void check_routing(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == x.size(0),
              "topk_ids must be a contiguous int64 [T, k] tensor");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights must be a contiguous float32 tensor shaped like topk_ids");
}

}  // namespace pagoda
