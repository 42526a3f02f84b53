// Group-wise int4 / int8 and MXFP4 linear layers for x86 CPUs, computed straight from pagoda's packed layout.
//
// Layout (see int_linear.py and packing.py): w_q uint8 [out, bytes]; 8-bit: byte c is column c;
// 4-bit: byte c holds column c in its low nibble and column c + bytes in its high nibble. A code q
// has a value v(q) and each group of columns a scale (and a zero point), g = c / group_size:
// - integer codes: v(q) = q, w_scales / w_zeros [out, groups] in the model dtype,
//   W[o, c] = (q - zero[o, g]) * scale[o, g];
// - FP4 (e2m1) codes of MXFP4 (4-bit, groups of 32): v(q) = FP4[q] (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
//   their negatives), w_scales uint8 [out, groups] E8M0 exponents, no zero points,
//   W[o, c] = FP4[q] * 2^(e[o, g] - 127);
// - FP8 (e4m3) codes (8-bit): v(q) = the float8_e4m3fn number q encodes, w_scales [out, groups] in the model
//   dtype, no zero points, W[o, c] = v(q) * scale[o, g].
// y[m, o] = sum_c x[m, perm[c]] * W[o, c] (+ bias[o]). The two differ only where a code becomes its
// value (the segment kinds of csrc/int_codes.h) and where a row's scales are read (GroupScales); every loop is
// shared.
//
// Small batches (the direct path): the weight is never dequantized into memory. Each work item
// takes a tile of output rows and, for every "segment" of columns (one group, read from one nibble of a contiguous byte range), dots
// the codes' values with x in registers; the group's scale multiplies that partial sum once, and
// the zero point is applied at the end through per-group sums of x:
//   y[m, o] = sum_g scale[o, g] * (sum_{c in g} x[m, c] v(q[o, c]) - zero[o, g] * xsum[m, g]).
// With bf16 activations the integers become bf16 (0x4300 | q is exactly 128 + q, so a nibble needs
// one ternary-logic op), FP4 codes their exact bf16 values through a 16-entry table (one vpermw),
// FP8 codes theirs by moving their bits (fp8_bf16), and AVX512-BF16 dot products take 32 columns
// per instruction; fp32 and fp16 activations use fp32 FMAs (integers converted, FP4 codes looked up
// with vpermps, FP8 codes widened through fp16), so their results are exact up to summation order. With AVX2 + FMA (no AVX-512) every dtype computes in fp32 on 8 lanes (an FP4
// code: a vpermps of the 8 magnitudes and its sign bit moved into place), batch 1 at 4 bits reading
// both nibbles of each byte in one pass; elsewhere a portable scalar loop computes the same sums.
//
// Larger batches (the GEMM path, chosen by the caller's gemm_min_rows): tiles of rows are
// dequantized into one reused buffer in the model dtype, bit for bit what the torch path builds,
// and multiplied by torch's GEMM, whose blocking beats register tiles once the dequantization is
// shared by enough activation rows. With AVX2 and no AVX-512, torch has no fast bf16 GEMM: there
// each thread dequantizes 128 rows at a time to the same bf16 values, widens them to fp32 in its
// own buffer and multiplies them by the fp32 activations (run_gemm_widened; what the dense layers'
// gemm_bf16_fp32 does with bf16 weights).
//
// The parts, each a header in csrc/ included here (one translation unit, one build): int_codes.h (how a code
// becomes its value, per ISA path), int_direct.h (the direct path), int_gemm.h (the GEMM path), int_linear.h (one
// linear's rows: the choice of path and its driver) and int_moe.h (the MoE call). This file holds the bindings.

#include "pagoda_torch.h"

#include <string>

#include "csrc/int_codes.h"
#include "csrc/int_linear.h"
#include "csrc/int_moe.h"

namespace {

// the ISA path of the direct (small-batch) kernel: avx512_bf16, avx512, avx2 or scalar
std::string isa_path() {
#if defined(PAGODA_BF16_DOT)
  return "avx512_bf16";
#elif defined(PAGODA_AVX512)
  return "avx512";
#elif defined(PAGODA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

bool has_bf16_dot() {
#ifdef PAGODA_BF16_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

// every kernel runs without the GIL: a server's event loop and tokenizer thread go on while a step
// computes (the arguments are converted before the call and the result after it, both with the GIL)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const pybind11::call_guard<pybind11::gil_scoped_release> no_gil{};
  m.def("int_linear_rows", &int_linear_rows, "group-wise int4/int8 linear from the packed layout (CPU)",
        no_gil, pybind11::arg("x"), pybind11::arg("w_q"), pybind11::arg("w_scales"), pybind11::arg("w_zeros"),
        pybind11::arg("perm"), pybind11::arg("bits"), pybind11::arg("group_size"), pybind11::arg("row_start"),
        pybind11::arg("row_end"), pybind11::arg("y"), pybind11::arg("bias"), pybind11::arg("impl"),
        pybind11::arg("gemm_min_rows"), pybind11::arg("tile_rows"));
  m.def("int_moe_experts", &int_moe_experts,
        "the routed experts of one MoE layer from packed int, MXFP4 or FP8 weights (CPU)", no_gil, pybind11::arg("x"),
        pybind11::arg("w13_q"), pybind11::arg("s13"), pybind11::arg("z13"), pybind11::arg("w2_q"), pybind11::arg("s2"),
        pybind11::arg("z2"), pybind11::arg("b13"), pybind11::arg("b2"), pybind11::arg("p13"), pybind11::arg("p2"),
        pybind11::arg("topk_ids"),
        pybind11::arg("topk_weights"), pybind11::arg("bits"), pybind11::arg("codes"), pybind11::arg("group13"),
        pybind11::arg("group2"), pybind11::arg("activation"), pybind11::arg("alpha"), pybind11::arg("limit"), pybind11::arg("impl"),
        pybind11::arg("gemm_min_rows"), pybind11::arg("tile_rows"));
  m.def("has_bf16_dot", &has_bf16_dot, "whether the AVX512-BF16 path was compiled in");
  m.def("isa_path", &isa_path, "the ISA path of the direct kernel: avx512_bf16, avx512, avx2 or scalar");
}
