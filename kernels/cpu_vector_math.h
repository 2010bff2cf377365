// The vector type and math the C++ CPU kernels share, written so that loops over it vectorise (no libm calls).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sluice {

// Floats per vector: one register of the widest vector unit the build targets (-march=native). A wider
// GCC vector than the target's registers is not split into them but lowered through the stack, element
// by element (an order of magnitude slower), so the width follows the target.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // one AVX-512 register
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;  // one AVX / AVX2 register
#else
constexpr int64_t kLanes = 4;  // one SSE / NEON register
#endif
constexpr int64_t kFloatsPerLine = 16;  // one 64-byte cache line

typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }

// exp(x) for x <= 0 (e.g. scores minus their running max), Cephes' polynomial: relative error ~2e-7, and a
// loop of it vectorises (no libm call). Inputs below -87 return ~1e-38 instead of 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

}  // namespace sluice
