// Scalar dtype <-> fp32 conversions shared by pagoda's C++ kernels. to_f widens exactly; from_f<T> rounds to
// nearest even (a NaN stays a NaN), as torch's own conversions do; round_to<T> is the value an fp32 result takes
// once stored in T and read back, where a kernel must round exactly where the torch ops it replaces do.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagoda {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  c10::BFloat16 out;
  out.x = std::isnan(f) ? static_cast<uint16_t>(0x7FC0)
                        : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return out;
}
template <> inline c10::Half from_f<c10::Half>(float f) { return static_cast<c10::Half>(f); }

template <typename T> inline float round_to(float f) { return to_f(from_f<T>(f)); }

}  // namespace pagoda
