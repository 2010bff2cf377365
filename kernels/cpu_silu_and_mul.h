// silu(gate) * up over a packed gate_up projection, float32 on CPU:
//
//   x [T, 2d] = [gate | up]  ->  out [T, d],  out = gate * sigmoid(gate) * up
//
// One pass instead of ATen's chunk, silu and mul (each its own parallel region and temporary). The
// sigmoid uses exp of a non-positive argument only: e = exp(-|g|), sigmoid(g) = 1 / (1 + e) for g >= 0
// and e / (1 + e) below, so it never overflows and the loop vectorises.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_team.h"
#include "cpu_vector_math.h"

namespace sluice::activation {

constexpr int64_t kRowGrain = 4;  // rows per task

template <class ParallelFor>
inline void silu_and_mul(const ParallelFor& parallel_for, torch::Tensor& out, const torch::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = x_data + r * 2 * width;
      const float* up = gate + width;
      float* y = out_data + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = gate[i];
        const float e = sluice::exp_nonpositive(-std::fabs(g));
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        y[i] = g * sigmoid * up[i];
      }
    }
  });
}

inline void silu_and_mul(torch::Tensor& out, const torch::Tensor& x) { silu_and_mul(AtenParallelFor{}, out, x); }

}  // namespace sluice::activation
