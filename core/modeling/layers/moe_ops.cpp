// The experts of a Mixture-of-Experts layer on a CPU, in one call per layer: the (token, slot) pairs the
// router chose are grouped by expert, and each active expert multiplies only its own tokens
//   h = act(x W13[e]^T + b13[e]),  y = h W2[e]^T + b2[e],  out[t] = sum_j weight[t, j] * y[t, j]
// with W13 = [gate rows | up rows]. Every expert, whatever its number of tokens, runs on grouped tiles: each
// chunk of its weights is read once and used for all its tokens. fp32 math, one rounding to the activations'
// dtype at the end; except for bf16 experts on bf16 activations on a CPU with bf16 dot products
// (AVX512_BF16), whose tiles multiply bf16 pairs into fp32 sums, the gated hidden state rounded to bf16 once
// (as a bf16 MLP rounds it). On such a CPU these tiles ran a 64-expert layer in 0.54x the time of the per-expert
// bf16 GEMMs at 16 tokens per expert and 0.88x at 144 (docs/moe.md): no token count favours a GEMM.
//
// Weights: fp32, bf16 (widened in registers: a bf16 is the top half of an fp32), or int8 with one fp32
// scale per output row. The vector width is a template parameter written with GCC vector types: 8 lanes
// compile to AVX2, 16 to AVX-512 (and to pairs of AVX2 registers where the CPU has no AVX-512, which is how
// an AVX2 machine tests the 16-lane code).

#include "pagoda_torch.h"
#include "pagoda_bf16_dot.h"
#include "pagoda_float.h"
#include "pagoda_parallel.h"
#include "pagoda_routing.h"
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using pagoda::from_f;
using pagoda::to_f;

inline float wf(float w) { return w; }
inline float wf(c10::BFloat16 w) { return to_f(w); }
inline float wf(int8_t w) { return static_cast<float>(w); }

// GCC vector types need a constant size: one definition per width
// (the *U types: unaligned, aliasing loads of the same vectors, one instruction each)
#define PAGODA_MOE_VEC(NAME, L)                                                                     \
  struct NAME {                                                                                     \
    typedef float F __attribute__((vector_size(L * 4)));                                            \
    typedef uint32_t U __attribute__((vector_size(L * 4)));                                         \
    typedef float FU __attribute__((vector_size(L * 4), aligned(1), may_alias));                    \
    typedef uint16_t HU __attribute__((vector_size(L * 2), aligned(1), may_alias));                 \
    typedef int8_t BU __attribute__((vector_size(L), aligned(1), may_alias));                       \
    static F load(const float* p) { return *reinterpret_cast<const FU*>(p); }                       \
    static F load(const c10::BFloat16* p) {                                                         \
      const U u = __builtin_convertvector(*reinterpret_cast<const HU*>(p), U) << 16;                \
      return reinterpret_cast<F>(u);                                                                \
    }                                                                                               \
    static F load(const int8_t* p) { return __builtin_convertvector(*reinterpret_cast<const BU*>(p), F); } \
    static float sum(F v) {                                                                         \
      float s = 0.f;                                                                                \
      for (int i = 0; i < L; ++i) s += v[i];                                                        \
      return s;                                                                                     \
    }                                                                                               \
  };
PAGODA_MOE_VEC(Vec8, 8)
PAGODA_MOE_VEC(Vec16, 16)
#undef PAGODA_MOE_VEC

template <int L> struct VecOf;
template <> struct VecOf<8> { using type = Vec8; };
template <> struct VecOf<16> { using type = Vec16; };
template <int L> using Vec = typename VecOf<L>::type;

// sums[m * R + r] = x[m] . rows[r] for MB fp32 activation rows (stride k) and R weight rows: each weight
// vector is loaded (and widened) once and used for all MB rows of x
template <int L, int R, int MB, typename W>
inline void dot_tile(const float* x, int64_t k, const W* const* rows, float* sums) {
  using V = Vec<L>;
  typename V::F acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = typename V::F{};
  const int64_t kv = k / L * L;
  for (int64_t i = 0; i < kv; i += L) {
    typename V::F wv[R];
    for (int r = 0; r < R; ++r) wv[r] = V::load(rows[r] + i);
    for (int m = 0; m < MB; ++m) {
      const typename V::F xv = V::load(x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = V::sum(acc[m][r]);
      for (int64_t i = kv; i < k; ++i) s += wf(rows[r][i]) * x[m * k + i];
      sums[m * R + r] = s;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBf16Dot = true;

// dot_tile for bf16 activations and weights: bf16 dot products, 32 weights a step
template <int L, int R, int MB>
inline void dot_tile(const c10::BFloat16* x, int64_t k, const c10::BFloat16* const* rows, float* sums) {
  pagoda::bf16_dot_tile<R, MB>(x, k, rows, k, sums);
}
#else
constexpr bool kBf16Dot = false;
#endif

// One register block: MB rows of x against RN weight rows n.. of wa and, when PAIR, the same rows of wb (an
// expert's gate and up rows side by side, so the activation sees both): emit(token, n, x.wa[n], x.wb[n]).
template <int L, int MB, int RN, bool PAIR, typename X, typename W, typename Emit>
inline void block(const X* x, int64_t m0, int64_t k, const W* wa, const W* wb, int64_t n, const Emit& emit) {
  constexpr int R = PAIR ? 2 * RN : RN;
  const W* rows[R];
  for (int r = 0; r < RN; ++r) {
    rows[r] = wa + (n + r) * k;
    if (PAIR) rows[RN + r] = wb + (n + r) * k;
  }
  float sums[MB * R];
  dot_tile<L, R, MB>(x + m0 * k, k, rows, sums);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RN; ++r) emit(m0 + m, n + r, sums[m * R + r], PAIR ? sums[m * R + RN + r] : 0.f);
}

// MB rows of x against weight rows [n0, n1): at most 8 accumulators with fp32 x (AVX2 has 16 registers: 8 sums,
// the weight vectors and one of x), 16 with bf16 x (AVX-512's 32 registers; each x vector then serves 4 to 8
// weight rows)
template <int L, int MB, bool PAIR, typename X, typename W, typename Emit>
inline void block_rows(const X* x, int64_t m0, int64_t k, const W* wa, const W* wb, int64_t n0, int64_t n1,
                       const Emit& emit) {
  constexpr int kWide = std::is_same<X, float>::value ? 1 : 2;
  constexpr int RN = kWide * (MB >= 4 ? 2 : 4) / (PAIR ? 2 : 1);
  int64_t n = n0;
  for (; n + RN <= n1; n += RN) block<L, MB, RN, PAIR>(x, m0, k, wa, wb, n, emit);
  for (; n < n1; ++n) block<L, MB, 1, PAIR>(x, m0, k, wa, wb, n, emit);
}

// All m rows of x ([m, k], fp32 or bf16) against weight rows [n0, n1) of wa (and wb): four rows of x at a time, so
// the chunk of weights (a few dozen KiB, read from memory once) is used from L1 for every token of the expert
template <int L, bool PAIR, typename X, typename W, typename Emit>
void grouped_rows(const X* x, int64_t m, int64_t k, const W* wa, const W* wb, int64_t n0, int64_t n1,
                  const Emit& emit) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m; m0 += 4) block_rows<L, 4, PAIR>(x, m0, k, wa, wb, n0, n1, emit);
  if (m0 + 2 <= m) {
    block_rows<L, 2, PAIR>(x, m0, k, wa, wb, n0, n1, emit);
    m0 += 2;
  }
  if (m0 < m) block_rows<L, 1, PAIR>(x, m0, k, wa, wb, n0, n1, emit);
}

using pagoda::ActParams;
using pagoda::activate;
using pagoda::kClampedSwiglu;
using pagoda::kSiluMul;

// one unit of phase 1's work: rows [n0, n1) of expert e's gate projection, with the same rows of its up one
struct Item {
  int64_t e, n0, n1;
};

// about 32 KiB of weights per work item, in whole 4-row tiles
inline int64_t chunk_rows(int64_t k, int64_t elem_bytes) {
  return std::max<int64_t>(4, (32768 / std::max<int64_t>(1, k * elem_bytes)) / 4 * 4);
}

// Phase 2 of moe_impl, in one parallel region with phase 1 (the gate_up items): work item j is output
// columns [j * tile, (j + 1) * tile) of every token, over the active experts in ascending order, each expert's
// down rows of those columns read once for all its tokens and its weighted outputs added to the tokens' fp32
// sums as they come out; the item then rounds its columns to T. Per token the sum runs in ascending expert
// order, whatever the threads do.
template <int L, typename X, typename W, typename T, typename GateUp>
void down_and_combine(const T*, int64_t num_tokens, int64_t hidden, const W* w2, const float* s2, const float* b2,
                      int64_t inter, const std::vector<int64_t>& offsets, const std::vector<int64_t>& order,
                      const float* weights, int64_t top_k, const X* hsp, const std::vector<Item>& gate_items,
                      const GateUp& gate_up_item, T* out) {
  std::vector<int64_t> active;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e)
    if (offsets[e + 1] > offsets[e]) active.push_back(e);
  // about 32 KiB of one expert's weights per tile and at least four tiles per thread, in whole cache lines
  // of the fp32 sums (16 columns)
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t tile = std::max<int64_t>(16, chunk_rows(inter, sizeof(W)) / 16 * 16);
  tile = std::min(tile, std::max<int64_t>(16, (hidden + 4 * threads * 16 - 1) / (4 * threads * 16) * 16));
  const int64_t num_tiles = (hidden + tile - 1) / tile;
  auto sums = at::empty({num_tokens, hidden}, at::TensorOptions().dtype(at::kFloat));
  float* acc = sums.data_ptr<float>();
  const auto gate_up_at = [&](int64_t i) { gate_up_item(gate_items[i]); };
  pagoda::parallel_two_phases(static_cast<int64_t>(gate_items.size()), gate_up_at, num_tiles, [&](int64_t j) {
    const int64_t n0 = j * tile, n1 = std::min(hidden, n0 + tile);
    for (int64_t t = 0; t < num_tokens; ++t) std::fill(acc + t * hidden + n0, acc + t * hidden + n1, 0.f);
    for (const int64_t e : active) {
      const int64_t m = offsets[e + 1] - offsets[e];
      const float* se = s2 ? s2 + e * hidden : nullptr;
      const float* be = b2 ? b2 + e * hidden : nullptr;
      const int64_t* slots = order.data() + offsets[e];
      const W* we = w2 + e * hidden * inter;
      grouped_rows<L, false>(hsp + offsets[e] * inter, m, inter, we, we, n0, n1,
                             [&](int64_t r, int64_t n, float v, float) {
        const int64_t s = slots[r];
        acc[(s / top_k) * hidden + n] += ((se ? v * se[n] : v) + (be ? be[n] : 0.f)) * weights[s];
      });
    }
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t n = n0; n < n1; ++n) out[t * hidden + n] = from_f<T>(acc[t * hidden + n]);
  });
}

// X: the activations' type in the tiles, float (widened weights, fp32 FMAs) or c10::BFloat16 (bf16 dot products)
template <int L, typename X, typename W, typename T>
void moe_impl(const T* x, int64_t num_tokens, int64_t hidden, const W* w13, const float* s13, const W* w2,
              const float* s2, const float* b13, const float* b2, int64_t num_experts, int64_t inter,
              const int64_t* ids, const float* weights, int64_t top_k, const ActParams& act, T* out) {
  const int64_t slots = num_tokens * top_k;
  // group the (token, slot) pairs by expert: order[offsets[e] .. offsets[e + 1]) are expert e's slots
  std::vector<int64_t> offsets(num_experts + 1, 0), order(slots);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, "expert id ", ids[s], " out of range [0, ", num_experts, ")");
    ++offsets[ids[s] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t s = 0; s < slots; ++s) order[fill[ids[s]]++] = s;
  }
  // activations gathered by expert as X, [slots, hidden]; the gated hidden states [slots, inter]
  const at::TensorOptions x_opts =
      at::TensorOptions().dtype(std::is_same<X, float>::value ? at::kFloat : at::kBFloat16);
  const at::Tensor xs = at::empty({slots, hidden}, x_opts), hs = at::empty({slots, inter}, x_opts);
  X* xsp = xs.data_ptr<X>();
  X* hsp = hs.data_ptr<X>();
  at::parallel_for(0, slots, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, hidden)), [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const T* src = x + (order[p] / top_k) * hidden;
      for (int64_t i = 0; i < hidden; ++i) xsp[p * hidden + i] = from_f<X>(to_f(src[i]));
    }
  });
  const int64_t gate_up_rows = 2 * inter;
  // phase 1's work items: a chunk of an active expert's gate rows, with its up rows (half as many of each)
  std::vector<Item> gate_items;
  const int64_t chunk1 = std::max<int64_t>(4, chunk_rows(hidden, sizeof(W)) / 2 / 4 * 4);
  for (int64_t e = 0; e < num_experts; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t n = 0; n < inter; n += chunk1) gate_items.push_back({e, n, std::min(inter, n + chunk1)});
  // phase 1, the grouped tiles: gate and up rows of a chunk side by side for all the expert's tokens, the
  // activation applied as each pair of sums comes out
  auto gate_up_item = [&](const Item& it) {
    const int64_t m = offsets[it.e + 1] - offsets[it.e];
    const W* we = w13 + it.e * gate_up_rows * hidden;
    const float* se = s13 ? s13 + it.e * gate_up_rows : nullptr;
    const float* be = b13 ? b13 + it.e * gate_up_rows : nullptr;
    X* h = hsp + offsets[it.e] * inter;
    grouped_rows<L, true>(xsp + offsets[it.e] * hidden, m, hidden, we, we + inter * hidden, it.n0, it.n1,
                          [&](int64_t r, int64_t n, float g, float u) {
      if (se) {
        g *= se[n];
        u *= se[inter + n];
      }
      if (be) {
        g += be[n];
        u += be[inter + n];
      }
      h[r * inter + n] = from_f<X>(activate(g, u, act));
    });
  };
  // phase 2 runs by output columns over all the active experts, and the weighted sum is taken in its tiles
  down_and_combine<L, X>(x, num_tokens, hidden, w2, s2, b2, inter, offsets, order, weights, top_k, hsp, gate_items,
                         gate_up_item, out);
}

#if defined(__AVX512F__)
constexpr int64_t kNativeLanes = 16;
#else
constexpr int64_t kNativeLanes = 8;
#endif

// bf16_dot: bf16 experts on bf16 activations take bf16 dot products (where this build has them)
template <int L, typename W>
void dispatch_x(const at::Tensor& x, const W* w13, const float* s13, const W* w2, const float* s2, const float* b13,
                const float* b2, int64_t num_experts, int64_t inter, const int64_t* ids, const float* weights,
                int64_t top_k, const ActParams& act, bool bf16_dot, at::Tensor& out) {
  const int64_t t = x.size(0), h = x.size(1);
  auto run = [&](auto x_type, auto* xp) {
    using X = decltype(x_type);
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    moe_impl<L, X>(xp, t, h, w13, s13, w2, s2, b13, b2, num_experts, inter, ids, weights, top_k, act,
                   out.data_ptr<T>());
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}, x.data_ptr<float>()); break;
    case at::kBFloat16:
      if constexpr (kBf16Dot && std::is_same<W, c10::BFloat16>::value) {
        if (bf16_dot) {
          run(c10::BFloat16{}, x.data_ptr<at::BFloat16>());
          break;
        }
      }
      run(float{}, x.data_ptr<at::BFloat16>());
      break;
    case at::kHalf: run(float{}, x.data_ptr<at::Half>()); break;
    default:
      TORCH_CHECK(false, "moe_experts: x must be float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

const float* opt_f32(const c10::optional<at::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel, name,
              " must be a contiguous float32 tensor of ", numel, " elements");
  return t->data_ptr<float>();
}

}  // namespace

// x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows), w2: [E, H, I], both float32, bfloat16 or int8
// (int8: s13 [E, 2I] and s2 [E, H] float32 row scales); b13 [E, 2I], b2 [E, H] float32 or none;
// topk_ids [T, k] int64, topk_weights [T, k] float32. activation: 0 silu(gate) * up, 1 gpt-oss's clamped
// SwiGLU (alpha, limit). lanes: 0 (this CPU's width), 8 or 16, for the tiles of widened weights. bf16_dot (CPUs
// with bf16 math): bf16 experts on bf16 activations take bf16 dot products instead, where this build has them
// (moe_path avx512_bf16; elsewhere the flag changes nothing).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& s13, const c10::optional<at::Tensor>& s2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t activation, double alpha,
                       double limit, int64_t lanes, bool bf16_dot) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [T, H] tensor");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "w13 and w2 must be contiguous [E, 2I, H] and [E, H, I] tensors");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "w13 and w2 must have one dtype");
  const int64_t e = w13.size(0), inter = w13.size(1) / 2, h = x.size(1);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == h && w2.size(0) == e && w2.size(1) == h &&
                  w2.size(2) == inter,
              "shapes: x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  pagoda::check_routing(x, topk_ids, topk_weights);
  TORCH_CHECK(activation == kSiluMul || activation == kClampedSwiglu, "activation must be 0 or 1");
  const bool int8 = w13.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (s13.has_value() && s2.has_value()), "int8 experts need the row scales s13 and s2");
  const float* s13p = int8 ? opt_f32(s13, e * 2 * inter, "s13") : nullptr;
  const float* s2p = int8 ? opt_f32(s2, e * h, "s2") : nullptr;
  const float* b13p = opt_f32(b13, e * 2 * inter, "b13");
  const float* b2p = opt_f32(b2, e * h, "b2");
  const int64_t k = topk_ids.size(1);
  const ActParams act{activation, static_cast<float>(alpha), static_cast<float>(limit)};
  auto out = at::empty(x.sizes(), x.options());
  if (x.size(0) == 0) return out;
  if (lanes == 0) lanes = kNativeLanes;
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 0, 8 or 16");
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* wts = topk_weights.data_ptr<float>();
#define PAGODA_MOE_CALL(L, W)                                                                                     \
  dispatch_x<L>(x, w13.data_ptr<W>(), s13p, w2.data_ptr<W>(), s2p, b13p, b2p, e, inter, ids, wts, k, act,        \
                bf16_dot, out)
#define PAGODA_MOE_WEIGHTS(L)                                                                                     \
  switch (w13.scalar_type()) {                                                                                    \
    case at::kFloat: PAGODA_MOE_CALL(L, float); break;                                                            \
    case at::kBFloat16: PAGODA_MOE_CALL(L, c10::BFloat16); break;                                                 \
    case at::kChar: PAGODA_MOE_CALL(L, int8_t); break;                                                            \
    default: TORCH_CHECK(false, "moe_experts: weights must be float32, bfloat16 or int8, not ", w13.scalar_type()); \
  }
  if (lanes == 16) {
    PAGODA_MOE_WEIGHTS(16)
  } else {
    PAGODA_MOE_WEIGHTS(8)
  }
#undef PAGODA_MOE_WEIGHTS
#undef PAGODA_MOE_CALL
  return out;
}

namespace {

enum Scoring : int64_t { kSoftmax = 0, kSigmoid = 1 };

// one token's routing: the top_k experts of its logits row (ties to the lower expert id) and their weights
template <typename T>
void route_row(const T* logits, int64_t num_experts, int64_t top_k, int64_t scoring, bool renormalize,
               bool softmax_over_top_k, float* scores, int64_t* idx, int64_t* ids, float* weights) {
  for (int64_t e = 0; e < num_experts; ++e) scores[e] = to_f(logits[e]);
  if (!softmax_over_top_k) {
    if (scoring == kSoftmax) {
      const float peak = *std::max_element(scores, scores + num_experts);
      float total = 0.f;
      for (int64_t e = 0; e < num_experts; ++e) total += (scores[e] = std::exp(scores[e] - peak));
      for (int64_t e = 0; e < num_experts; ++e) scores[e] /= total;
    } else {
      for (int64_t e = 0; e < num_experts; ++e) scores[e] = 1.f / (1.f + std::exp(-scores[e]));
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) idx[e] = e;
  std::partial_sort(idx, idx + top_k, idx + num_experts, [&](int64_t a, int64_t c) {
    return scores[a] > scores[c] || (scores[a] == scores[c] && a < c);
  });
  float total = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    ids[j] = idx[j];
    weights[j] = scores[idx[j]];
  }
  if (softmax_over_top_k) {  // a softmax over the k chosen logits (the first is the largest)
    for (int64_t j = 0; j < top_k; ++j) total += (weights[j] = std::exp(weights[j] - scores[idx[0]]));
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= total;
    return;
  }
  if (!renormalize) return;
  for (int64_t j = 0; j < top_k; ++j) total += weights[j];
  for (int64_t j = 0; j < top_k; ++j) weights[j] /= total;
}

}  // namespace

// logits [T, E] (float32, bfloat16 or float16) -> (weights [T, k] float32, ids [T, k] int64): what
// moe.select_experts computes without a selection bias, in one call (scoring: 0 softmax, 1 sigmoid)
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, int64_t scoring,
                                             bool renormalize, bool softmax_over_top_k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous CPU [T, E] tensor");
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= e, "top_k must be in [1, ", e, "], not ", top_k);
  TORCH_CHECK(scoring == kSoftmax || scoring == kSigmoid, "scoring must be 0 (softmax) or 1 (sigmoid)");
  auto weights = at::empty({t, top_k}, at::TensorOptions().dtype(at::kFloat));
  auto ids = at::empty({t, top_k}, at::TensorOptions().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  auto rows = [&](auto* lp) {
    at::parallel_for(0, t, std::max<int64_t>(1, 16384 / e), [&](int64_t b, int64_t end) {
      std::vector<float> scores(e);
      std::vector<int64_t> idx(e);
      for (int64_t r = b; r < end; ++r)
        route_row(lp + r * e, e, top_k, scoring, renormalize, softmax_over_top_k, scores.data(), idx.data(),
                  ip + r * top_k, wp + r * top_k);
    });
  };
  switch (logits.scalar_type()) {
    case at::kFloat: rows(logits.data_ptr<float>()); break;
    case at::kBFloat16: rows(logits.data_ptr<at::BFloat16>()); break;
    case at::kHalf: rows(logits.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "moe_route: logits must be float32, bfloat16 or float16, not ", logits.scalar_type());
  }
  return {weights, ids};
}

// the vector width this build's tiles use: 16 lanes on AVX-512, else 8 (AVX2, or the compiler's generic code);
// avx512_bf16: bf16 dot products for bf16 experts on bf16 activations
std::string moe_path() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("moe_experts", &moe_experts, "the routed experts of one MoE layer, grouped by expert", no_gil,
        pybind11::arg("x"), pybind11::arg("w13"), pybind11::arg("w2"), pybind11::arg("s13"), pybind11::arg("s2"),
        pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("topk_ids"), pybind11::arg("topk_weights"),
        pybind11::arg("activation") = 0, pybind11::arg("alpha") = 1.702, pybind11::arg("limit") = 7.0,
        pybind11::arg("lanes") = 0, pybind11::arg("bf16_dot") = false);
  m.def("moe_route", &moe_route, "the experts and weights of each token from its router logits", no_gil,
        pybind11::arg("logits"), pybind11::arg("top_k"), pybind11::arg("scoring") = 0,
        pybind11::arg("renormalize") = true, pybind11::arg("softmax_over_top_k") = false);
  m.def("moe_path", &moe_path, "the ISA path of the grouped tiles: avx512_bf16, avx512, avx2 or generic");
}
