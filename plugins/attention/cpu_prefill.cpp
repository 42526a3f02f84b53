// Causal attention of fresh prompts (no cached context) for bf16 models, on AVX-512 BF16 CPUs.
//
// Flash-style: one work item is (prompt, kv head, block of 16 query tokens). The query rows of that
// block and of the kv head's group of query heads stream over the prompt's 16-key blocks up to the
// diagonal with an online softmax in fp32, so no score matrix is ever stored. Both products run on
// vdpbf16ps (bf16 pairs, fp32 sums): scores exactly as a bf16 matmul computes them, probabilities
// rounded to bf16 for P.V as GEMM-based attention kernels do.
//
// So that each instruction multiplies 16 lanes by one broadcast bf16 pair, K and V are first re-laid
// out per 16-key block (a pass over K/V, cheap next to the n^2 work):
//   kt[h][block][p][16 keys]   = (k[key][2p], k[key][2p + 1])       scores: lanes are keys
//   vt[h][block][8][head_dim]  = (v[2i][d], v[2i + 1][d])           P.V: lanes are dims
// Keys past a prompt's end are zero and masked.
//
// Without AVX-512 BF16, an AVX2 + FMA + F16C build runs the same flash-style items in fp32 on 8-lane
// registers for bf16, fp16 and fp32 prompts: K and V are widened to fp32 once by the re-layout
// (kt[h][block][d][16 keys], vt[h][block][16 keys][head_dim]), probabilities stay fp32, and the output is
// rounded to the prompt dtype once.
//
// Layers that ask for more than causal attention (Gemma 2/3, gpt-oss, Mistral) take the same items: with a
// sliding window an item starts at the first key block its earliest token sees and masks the keys before each
// token's window; a logit soft-cap turns each score s into tanh(s / cap) * cap before the softmax; a head's
// sink logit joins its rows' softmax denominators only, added to the running sum at the end.

#include "pagoda_torch.h"
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "csrc/cpu_softmax.h"

namespace {

using pagoda_attention::online_softmax_advance;

constexpr int64_t kBlock = 16;  // keys per block, and query tokens per work item
constexpr float kLog2e = 1.4426950408889634f;

// What an item does to its scores before the online softmax, which works in base 2.
struct ScoreShape {
  float q_mult;            // what q.k is multiplied by: scale * log2(e), or scale / softcap with a soft-cap
  float cap_log2 = 0.f;    // with a soft-cap: tanh of the product, times softcap * log2(e); 0: none
  int64_t window = 0;      // each token sees itself and the window - 1 keys before it; 0: every earlier key
  const float* sinks = nullptr;  // [heads] sink logits (natural log units), or nullptr

  ScoreShape(double scale, int64_t window_, double softcap, const float* sinks_)
      : q_mult(static_cast<float>(softcap > 0 ? scale / softcap : scale * kLog2e)),
        cap_log2(static_cast<float>(softcap > 0 ? softcap * kLog2e : 0.0)), window(window_), sinks(sinks_) {}

  // the first key block that query block `diag`'s earliest token sees
  int64_t first_block(int64_t diag) const {
    return window > 0 ? std::max<int64_t>(0, diag * kBlock - window + 1) / kBlock : 0;
  }
  // the first key position that the token at `pos` sees
  int64_t first_key(int64_t pos) const { return window > 0 ? pos - window + 1 : 0; }
};

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGODA_AVX2_PREFILL 1
#endif

// the ISA path of this build's kernel: "avx512_bf16" (bf16 prompts), "avx2" (bf16, fp16, fp32), "" (none)
const char* prefill_path() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return "avx512_bf16";
#elif defined(PAGODA_AVX2_PREFILL)
  return "avx2";
#else
  return "";
#endif
}

bool has_prefill_kernel() { return prefill_path()[0] != '\0'; }

// The blocks of one call's prompts (kBlock tokens each, the last one short), numbered across prompts, and the
// two parallel passes over them that both kernels make: the re-layout of each kv head's K/V block, then the
// work items, one per kv head and query block, attending to the prompt's blocks up to the diagonal.
// `query_from` (empty: each prompt's begin) gives, per prompt, the first token whose output is wanted: the query
// blocks wholly before it are skipped (a prompt whose first tokens' K/V came from a cache). A row's output does
// not depend on the other rows of its block, so it is the same bits as with every block computed.
struct PromptBlocks {
  PromptBlocks(const std::vector<int64_t>& ranges, const std::vector<int64_t>& query_from) : begin(ranges.data()) {
    const int64_t num_prompts = static_cast<int64_t>(ranges.size()) / 2;  // prompt i: begin[2i] .. begin[2i + 1]
    first_block.assign(num_prompts + 1, 0);
    for (int64_t i = 0; i < num_prompts; ++i)
      first_block[i + 1] = first_block[i] + (begin[2 * i + 1] - begin[2 * i] + kBlock - 1) / kBlock;
    count = first_block[num_prompts];
    items.reserve(count);
    for (int64_t i = 0; i < num_prompts; ++i)
      for (int64_t b = 0; b < first_block[i + 1] - first_block[i]; ++b) items.emplace_back(i, b);
    for (int64_t gb = 0; gb < count; ++gb) {
      const auto [i, b] = items[gb];
      const int64_t from = query_from.empty() ? begin[2 * i] : query_from[i];
      if (begin[2 * i] + (b + 1) * kBlock > from) queries.push_back(gb);
    }
  }

  // fn(h, gb, t0, n) for kv head h and every block gb (its tokens t0 .. t0 + n), in parallel
  template <typename Fn>
  void for_each_block(int64_t kv_heads, const Fn& fn) const {
    at::parallel_for(0, kv_heads * count, 1, [&](int64_t first, int64_t last) {
      for (int64_t w = first; w < last; ++w) {
        const int64_t gb = w % count;
        const auto [i, b] = items[gb];
        const int64_t t0 = begin[2 * i] + b * kBlock;
        fn(w / count, gb, t0, std::min(kBlock, begin[2 * i + 1] - t0));
      }
    });
  }

  // fn(h, first, b, t0, n) for kv head h and query block b (tokens t0 .. t0 + n) of the prompt whose blocks
  // start at block `first`. Items differ in cost by up to the prompt length, so threads take the next one as
  // they finish, later query blocks (which see more keys) first.
  template <typename Fn>
  void for_each_item(int64_t kv_heads, const Fn& fn) const {
    const int64_t nq = static_cast<int64_t>(queries.size());
    std::vector<int64_t> order(kv_heads * nq);
    for (int64_t w = 0; w < kv_heads * nq; ++w) order[w] = w;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return items[queries[a % nq]].second > items[queries[b % nq]].second;
    });
    std::atomic<int64_t> next{0};
    const int64_t num_items = kv_heads * nq;
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t w = next++; w < num_items; w = next++) {
        const auto [i, b] = items[queries[order[w] % nq]];
        const int64_t t0 = begin[2 * i] + b * kBlock;
        fn(order[w] / nq, first_block[i], b, t0, std::min(kBlock, begin[2 * i + 1] - t0));
      }
    });
  }

  const int64_t* begin;
  std::vector<int64_t> first_block;  // prompt i's first block (num_prompts + 1 entries)
  std::vector<std::pair<int64_t, int64_t>> items;  // block -> (prompt, block within it)
  std::vector<int64_t> queries;  // the blocks whose query rows are computed
  int64_t count = 0;
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)

using pagoda_attention::exp2_16;
using pagoda_attention::tanh16;

inline uint32_t pair(const uint16_t* lo, const uint16_t* hi) {
  return static_cast<uint32_t>(*lo) | (static_cast<uint32_t>(*hi) << 16);
}

// fp32 -> bf16 bits, round to nearest even (finite values)
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16));
}

// Re-lay one 16-key block of one kv head (see the header); `n` valid keys, the rest zero.
template <int D>
void relayout_block(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int64_t n,
                    uint32_t* kt, uint32_t* vt) {
  constexpr int P = D / 2;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < kBlock; ++j)
      kt[p * kBlock + j] = j < n ? pair(k + j * k_stride + 2 * p, k + j * k_stride + 2 * p + 1) : 0u;
  static const uint16_t zero = 0;
  for (int64_t i = 0; i < kBlock / 2; ++i) {
    const uint16_t* v0 = 2 * i < n ? v + 2 * i * v_stride : nullptr;
    const uint16_t* v1 = 2 * i + 1 < n ? v + (2 * i + 1) * v_stride : nullptr;
    for (int64_t d = 0; d < D; ++d) vt[i * D + d] = pair(v0 ? v0 + d : &zero, v1 ? v1 + d : &zero);
  }
}

// R query rows (token-major: row = token * group + head) of one work item against key blocks
// 0..diag; rows past `rows` repeat the last one and are not stored.
template <int D, int R>
void attend_rows(const uint16_t* q, int64_t q_token_stride, uint16_t* out, int64_t out_token_stride,
                 const uint32_t* kt, const uint32_t* vt, int64_t diag, int64_t group, int64_t row0, int64_t rows,
                 const ScoreShape& shape, const float* sinks) {
  constexpr int P = D / 2;        // bf16 pairs per row
  constexpr int C = D / 16;       // 16-lane chunks of an output row
  const uint32_t* qp[R];
  int64_t token[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + std::min<int64_t>(r, rows - 1);
    token[r] = row / group;
    qp[r] = reinterpret_cast<const uint32_t*>(q + token[r] * q_token_stride + (row % group) * D);
  }
  __m512 o[R][C], l[R];
  float m[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
    l[r] = _mm512_setzero_ps();
    m[r] = -INFINITY;
  }
  const __m512 scale = _mm512_set1_ps(shape.q_mult);
  const __m512 cap = _mm512_set1_ps(shape.cap_log2);
  for (int64_t b = shape.first_block(diag); b <= diag; ++b) {
    const uint32_t* kb = kt + b * P * kBlock;
    const uint32_t* vb = vt + b * (kBlock / 2) * D;
    // two sums per row over alternate pairs: 2R independent chains hide the dot instruction's latency
    __m512 s[R], s2[R];
    for (int r = 0; r < R; ++r) s[r] = s2[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int p = 0; p < P; p += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kBlock);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (p + 1) * kBlock);
      for (int r = 0; r < R; ++r) {
        s[r] = _mm512_dpbf16_ps(s[r], k0, (__m512bh)_mm512_set1_epi32(qp[r][p]));
        s2[r] = _mm512_dpbf16_ps(s2[r], k1, (__m512bh)_mm512_set1_epi32(qp[r][p + 1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      s[r] = _mm512_mul_ps(_mm512_add_ps(s[r], s2[r]), scale);
      if (shape.cap_log2 > 0.f) s[r] = _mm512_mul_ps(tanh16(s[r]), cap);
    }
    alignas(64) uint32_t probs[R][kBlock / 2];
    __m512 x[R];
    __mmask16 valid[R];
    alignas(64) float shift[16] = {};  // log2 of each row's alpha, the rescale of what was summed so far
    for (int r = 0; r < R; ++r) {
      // keys after the row's own token (diagonal block only) do not exist for it, nor those before its window
      const int64_t pos = diag * kBlock + token[r] % kBlock, before = shape.first_key(pos) - b * kBlock;
      valid[r] = b < diag ? __mmask16(0xFFFF) : __mmask16((2u << (token[r] % kBlock)) - 1u);
      if (before > 0) valid[r] &= before >= kBlock ? __mmask16(0) : __mmask16(~((1u << before) - 1u));
      x[r] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[r], s[r]);
      const float block_max = _mm512_reduce_max_ps(x[r]);
      // -inf on the first block; a block wholly before the row's window changes nothing (alpha 1)
      shift[r] = block_max == -INFINITY ? 0.f : online_softmax_advance(m[r], block_max);
    }
    alignas(64) float alpha[16];
    _mm512_store_ps(alpha, exp2_16(_mm512_load_ps(shift)));  // all rows at once
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      const __m512 pr = _mm512_maskz_mov_ps(valid[r], exp2_16(_mm512_sub_ps(x[r], _mm512_set1_ps(m[r]))));
      l[r] = _mm512_fmadd_ps(l[r], a, pr);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(o[r][c], a);
      _mm256_store_si256(reinterpret_cast<__m256i*>(probs[r]), to_bf16(pr));
    }
    for (int i = 0; i < kBlock / 2; ++i) {
      for (int c = 0; c < C; ++c) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + i * D + 16 * c);
        for (int r = 0; r < R; ++r)
          o[r][c] = _mm512_dpbf16_ps(o[r][c], vv, (__m512bh)_mm512_set1_epi32(probs[r][i]));
      }
    }
  }
  for (int r = 0; r < R && r < rows; ++r) {
    const int64_t row = row0 + r;
    float sum = _mm512_reduce_add_ps(l[r]);
    if (sinks != nullptr) sum += std::exp2(sinks[row % group] * kLog2e - m[r]);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    uint16_t* dst = out + token[r] * out_token_stride + (row % group) * D;
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), to_bf16(_mm512_mul_ps(o[r][c], inv)));
  }
}

template <int D>
void prefill_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  const std::vector<int64_t>& ranges, const std::vector<int64_t>& query_from,
                  const ScoreShape& shape) {
  // rows per sweep: R * (D / 16 + 2) registers of sums and scores
  constexpr int R = D <= 64 ? 4 : (D <= 128 ? 2 : 1);
  const int64_t heads = q.size(1), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), os = out.stride(0);
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const PromptBlocks blocks(ranges, query_from);
  const int64_t count = blocks.count;

  const int64_t kt_size = (D / 2) * kBlock, vt_size = (kBlock / 2) * D;  // uint32 per block
  // every entry is written by the re-layout (padding included), so no zero-fill first
  std::unique_ptr<uint32_t[]> kt(new uint32_t[kv_heads * count * kt_size]);
  std::unique_ptr<uint32_t[]> vt(new uint32_t[kv_heads * count * vt_size]);
  blocks.for_each_block(kv_heads, [&](int64_t h, int64_t gb, int64_t t0, int64_t n) {
    relayout_block<D>(kd + t0 * ks + h * D, ks, vd + t0 * vs + h * D, vs, n, &kt[(h * count + gb) * kt_size],
                      &vt[(h * count + gb) * vt_size]);
  });
  blocks.for_each_item(kv_heads, [&](int64_t h, int64_t first, int64_t b, int64_t t0, int64_t n) {
    const uint32_t* kh = &kt[(h * count + first) * kt_size];
    const uint32_t* vh = &vt[(h * count + first) * vt_size];
    const float* sinks = shape.sinks == nullptr ? nullptr : shape.sinks + h * group;
    // rows of this item: its n tokens x the group's heads, token-major
    for (int64_t r0 = 0; r0 < n * group; r0 += R)
      attend_rows<D, R>(qd + t0 * qs + h * group * D, qs, od + t0 * os + h * group * D, os, kh, vh, b, group, r0,
                        std::min<int64_t>(R, n * group - r0), shape, sinks);
  });
}

#endif

#ifdef PAGODA_AVX2_PREFILL

using pagoda_attention::exp2_8;
using pagoda_attention::load8;
using pagoda_attention::max8;
using pagoda_attention::store8;
using pagoda_attention::sum8;
using pagoda_attention::tanh8;

// One 16-key block of one kv head in fp32: kt [D][16 keys], vt [16 keys][D]; keys past `n` are zero.
template <int D, typename T>
void relayout_block_f32(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t n, float* kt,
                        float* vt) {
  alignas(32) float row[D];
  for (int64_t j = 0; j < kBlock; ++j) {
    if (j < n) {
      for (int d = 0; d < D; d += 8) _mm256_store_ps(row + d, load8(k + j * k_stride + d));
      for (int d = 0; d < D; ++d) kt[d * kBlock + j] = row[d];
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vt + j * D + d, load8(v + j * v_stride + d));
    } else {
      for (int d = 0; d < D; ++d) kt[d * kBlock + j] = 0.f;
      for (int d = 0; d < D; ++d) vt[j * D + d] = 0.f;
    }
  }
}

// R query rows (token-major: row = token * group + head) of one work item against key blocks 0..diag; rows
// past `rows` repeat the last one and are not stored. Scores: 2 registers of 16 keys per row; the running
// output rows live in an L1 buffer, 16 dims x R rows in registers while a block's values are added.
template <int D, int R, typename T>
void attend_rows_f32(const T* q, int64_t q_token_stride, T* out, int64_t out_token_stride, const float* kt,
                     const float* vt, int64_t diag, int64_t group, int64_t row0, int64_t rows,
                     const ScoreShape& shape, const float* sinks) {
  // query rows in fp32, times scale * log2(e): scores come out in base 2 (with a soft-cap, times scale / cap,
  // and into base 2 after the tanh)
  alignas(32) float qf[R][D];
  alignas(32) float o[R][D];
  alignas(32) float probs[R][kBlock];
  int64_t token[R];
  float m[R], l[R];
  const __m256 scale = _mm256_set1_ps(shape.q_mult);
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + std::min<int64_t>(r, rows - 1);
    token[r] = row / group;
    const T* src = q + token[r] * q_token_stride + (row % group) * D;
    for (int d = 0; d < D; d += 8) _mm256_store_ps(qf[r] + d, _mm256_mul_ps(load8(src + d), scale));
    for (int d = 0; d < D; ++d) o[r][d] = 0.f;
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 cap = _mm256_set1_ps(shape.cap_log2);
  for (int64_t b = shape.first_block(diag); b <= diag; ++b) {
    const float* kb = kt + b * D * kBlock;
    const float* vb = vt + b * kBlock * D;
    __m256 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_load_ps(kb + d * kBlock), k1 = _mm256_load_ps(kb + d * kBlock + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_broadcast_ss(&qf[r][d]);
        s[r][0] = _mm256_fmadd_ps(qv, k0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(qv, k1, s[r][1]);
      }
    }
    if (shape.cap_log2 > 0.f) {
      for (int r = 0; r < R; ++r) {
        s[r][0] = _mm256_mul_ps(tanh8(s[r][0]), cap);
        s[r][1] = _mm256_mul_ps(tanh8(s[r][1]), cap);
      }
    }
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      // keys after the row's own token (diagonal block only) do not exist for it, nor those before its window:
      // lanes first..last of this block
      const int64_t pos = diag * kBlock + token[r] % kBlock;
      const __m256 last = _mm256_set1_ps(static_cast<float>(std::min<int64_t>(pos - b * kBlock, kBlock)));
      const __m256 first = _mm256_set1_ps(static_cast<float>(std::max<int64_t>(shape.first_key(pos) - b * kBlock, -1)));
      const __m256 lane1 = _mm256_add_ps(lane, _mm256_set1_ps(8.f));
      const __m256 valid0 = _mm256_and_ps(_mm256_cmp_ps(lane, last, _CMP_LE_OQ), _mm256_cmp_ps(lane, first, _CMP_GE_OQ));
      const __m256 valid1 =
          _mm256_and_ps(_mm256_cmp_ps(lane1, last, _CMP_LE_OQ), _mm256_cmp_ps(lane1, first, _CMP_GE_OQ));
      const __m256 ninf = _mm256_set1_ps(-INFINITY);
      const __m256 x0 = _mm256_blendv_ps(ninf, s[r][0], valid0), x1 = _mm256_blendv_ps(ninf, s[r][1], valid1);
      const float block_max = max8(_mm256_max_ps(x0, x1));
      // 0 on the first block; a block wholly before the row's window changes nothing (alpha 1)
      alpha[r] = block_max == -INFINITY ? 1.f : std::exp2(online_softmax_advance(m[r], block_max));
      const __m256 mv = _mm256_set1_ps(m[r]);
      const __m256 p0 = _mm256_and_ps(valid0, exp2_8(_mm256_sub_ps(x0, mv)));
      const __m256 p1 = _mm256_and_ps(valid1, exp2_8(_mm256_sub_ps(x1, mv)));
      l[r] = l[r] * alpha[r] + sum8(_mm256_add_ps(p0, p1));
      _mm256_store_ps(probs[r], p0);
      _mm256_store_ps(probs[r] + 8, p1);
    }
    for (int c = 0; c < D; c += 16) {
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
        acc[r][0] = _mm256_mul_ps(_mm256_load_ps(o[r] + c), a);
        acc[r][1] = _mm256_mul_ps(_mm256_load_ps(o[r] + c + 8), a);
      }
      for (int j = 0; j < kBlock; ++j) {
        const __m256 v0 = _mm256_loadu_ps(vb + j * D + c), v1 = _mm256_loadu_ps(vb + j * D + c + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 p = _mm256_broadcast_ss(&probs[r][j]);
          acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(o[r] + c, acc[r][0]);
        _mm256_store_ps(o[r] + c + 8, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R && r < rows; ++r) {
    const int64_t row = row0 + r;
    const float sum = sinks == nullptr ? l[r] : l[r] + std::exp2(sinks[row % group] * kLog2e - m[r]);
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    T* dst = out + token[r] * out_token_stride + (row % group) * D;
    for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_load_ps(o[r] + d), inv));
  }
}

template <int D, typename T>
void prefill_impl_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                      const std::vector<int64_t>& ranges, const std::vector<int64_t>& query_from,
                      const ScoreShape& shape) {
  constexpr int R = 4;  // rows per sweep: 8 score registers, 8 output registers while values are added
  const int64_t heads = q.size(1), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), os = out.stride(0);
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const PromptBlocks blocks(ranges, query_from);
  const int64_t count = blocks.count;
  const int64_t block_floats = D * kBlock;  // per block, in each of kt and vt
  std::unique_ptr<float[], decltype(&std::free)> kt(
      static_cast<float*>(std::aligned_alloc(32, sizeof(float) * kv_heads * count * block_floats)), &std::free);
  std::unique_ptr<float[], decltype(&std::free)> vt(
      static_cast<float*>(std::aligned_alloc(32, sizeof(float) * kv_heads * count * block_floats)), &std::free);
  blocks.for_each_block(kv_heads, [&](int64_t h, int64_t gb, int64_t t0, int64_t n) {
    relayout_block_f32<D>(kd + t0 * ks + h * D, ks, vd + t0 * vs + h * D, vs, n, &kt[(h * count + gb) * block_floats],
                          &vt[(h * count + gb) * block_floats]);
  });
  blocks.for_each_item(kv_heads, [&](int64_t h, int64_t first, int64_t b, int64_t t0, int64_t n) {
    const float* kh = &kt[(h * count + first) * block_floats];
    const float* vh = &vt[(h * count + first) * block_floats];
    const float* sinks = shape.sinks == nullptr ? nullptr : shape.sinks + h * group;
    for (int64_t r0 = 0; r0 < n * group; r0 += R)
      attend_rows_f32<D, R>(qd + t0 * qs + h * group * D, qs, od + t0 * os + h * group * D, os, kh, vh, b, group,
                            r0, std::min<int64_t>(R, n * group - r0), shape, sinks);
  });
}

template <typename T>
void prefill_avx2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  const std::vector<int64_t>& ranges, const std::vector<int64_t>& query_from,
                  const ScoreShape& shape) {
  const int64_t d = q.size(2);
  if (d == 64) return prefill_impl_f32<64, T>(q, k, v, out, ranges, query_from, shape);
  if (d == 128) return prefill_impl_f32<128, T>(q, k, v, out, ranges, query_from, shape);
  if (d == 256) return prefill_impl_f32<256, T>(q, k, v, out, ranges, query_from, shape);
  if (d == 96) return prefill_impl_f32<96, T>(q, k, v, out, ranges, query_from, shape);
  if (d == 80) return prefill_impl_f32<80, T>(q, k, v, out, ranges, query_from, shape);
  if (d == 32) return prefill_impl_f32<32, T>(q, k, v, out, ranges, query_from, shape);
  TORCH_CHECK(false, "prefill_attention: no kernel for head_dim ", d, " on this CPU");
}

#endif

// q [T, H, D], k/v [T, Hkv, D] bf16 with unit dim stride and heads packed; out [T, H, D] likewise.
// ranges: [begin_0, end_0, begin_1, end_1, ...], the tokens of each prompt, which attends causally to
// itself only; tokens outside every range are left alone. query_from (empty, or one token per prompt within
// its range): outputs are wanted from that token on; the 16-token query blocks before it are not computed (their
// rows of out may be left alone or written; their rows of q need not be set).
// window > 0: each token attends to itself and the window - 1 tokens before it only; softcap > 0: scores become
// tanh(s / softcap) * softcap; sinks ([heads] float32): each head's sink logit joins its softmax's denominator.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                       const std::vector<int64_t>& ranges, double scale, const std::vector<int64_t>& query_from,
                       int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
              "q, k, v and out must share one dtype");
#ifdef PAGODA_AVX2_PREFILL
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "prefill_attention takes bfloat16, float16 or float32 tensors");
#else
  TORCH_CHECK(dtype == at::kBFloat16, "prefill_attention takes bfloat16 tensors on this CPU");
#endif
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out must be [T, heads, D]");
  const int64_t d = q.size(2);
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d, "each token's heads must be packed rows of head_dim");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) && v.size(1) == k.size(1) && k.size(2) == d && v.size(2) == d &&
                  out.size(2) == d, "q/out [T, H, D] and k/v [T, Hkv, D] must agree");
  TORCH_CHECK(ranges.size() % 2 == 0, "ranges must be begin/end pairs");
  for (size_t i = 0; i < ranges.size(); i += 2)
    TORCH_CHECK(0 <= ranges[i] && ranges[i] <= ranges[i + 1] && ranges[i + 1] <= q.size(0), "range out of bounds");
  TORCH_CHECK(query_from.empty() || query_from.size() * 2 == ranges.size(), "query_from must have one entry per range");
  for (size_t i = 0; i < query_from.size(); ++i)
    TORCH_CHECK(ranges[2 * i] <= query_from[i] && query_from[i] <= ranges[2 * i + 1], "query_from outside its range");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or a positive number of tokens, not ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, not ", softcap);
  at::Tensor sink_values;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1),
                "sinks must be float32 with one value per query head");
    sink_values = sinks->contiguous();
  }
  const ScoreShape shape(scale, window, softcap, sinks.has_value() ? sink_values.data_ptr<float>() : nullptr);
#if defined(PAGODA_AVX2_PREFILL)
  if (dtype == at::kFloat) return prefill_avx2<float>(q, k, v, out, ranges, query_from, shape);
  if (dtype == at::kHalf) return prefill_avx2<at::Half>(q, k, v, out, ranges, query_from, shape);
  return prefill_avx2<at::BFloat16>(q, k, v, out, ranges, query_from, shape);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (d == 64) return prefill_impl<64>(q, k, v, out, ranges, query_from, shape);
  if (d == 128) return prefill_impl<128>(q, k, v, out, ranges, query_from, shape);
  if (d == 256) return prefill_impl<256>(q, k, v, out, ranges, query_from, shape);
  if (d == 96) return prefill_impl<96>(q, k, v, out, ranges, query_from, shape);
  if (d == 80) return prefill_impl<80>(q, k, v, out, ranges, query_from, shape);
  if (d == 32) return prefill_impl<32>(q, k, v, out, ranges, query_from, shape);
#endif
  TORCH_CHECK(false, "prefill_attention: no kernel for head_dim ", d, " on this CPU");
}

bool supports_head_dim(int64_t d) {
  return has_prefill_kernel() && (d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256);
}

// whether the backend sends prompts of this dtype ("bfloat16", "float16", "float32") to the kernel. fp32
// prompts keep SDPA, which is as fast there and whose sums follow HF's fp32 attention more closely (a tiny
// fp8-weight model's greedy tokens flipped on a near-tie with the kernel); prefill_attention still takes them.
bool supports_dtype(const std::string& dtype) {
  const std::string path = prefill_path();
  return path == "avx2" ? (dtype == "bfloat16" || dtype == "float16") : (path == "avx512_bf16" && dtype == "bfloat16");
}

std::string isa_path() { return prefill_path(); }

}  // namespace

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("supports_head_dim", &supports_head_dim, "whether this build has a prefill kernel for head_dim");
  m.def("supports_dtype", &supports_dtype, "whether prompts of this dtype (bfloat16, float16, float32) take the kernel");
  m.def("isa_path", &isa_path, "the ISA path of this build: avx512_bf16, avx2, or empty (none)");
  m.def("prefill_attention", &prefill_attention, "causal attention of fresh prompts (CPU: AVX-512 BF16, or AVX2)",
        no_gil, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("ranges"), pybind11::arg("scale"), pybind11::arg("query_from") = std::vector<int64_t>{},
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none());
}
