// RMSNorm with the residual add fused, float32 on CPU, one pass over each row:
//
//   residual_out = x + residual            (or x itself when there is no residual)
//   out          = residual_out * rsqrt(mean(residual_out^2) + eps) * weight
//
// The decoder's residual stream flows through its norms, so each norm call is one kernel instead of the
// ~12 small ATen ops of the composite (add, pow, mean, add, rsqrt, mul, mul, ...), whose per-op cost is
// most of a norm's time at decode batch sizes. Rows are split across threads in chunks of kRowGrain.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_team.h"

namespace sluice::norm {

constexpr int64_t kRowGrain = 16;  // rows per task: a small step runs on the calling thread

inline void rms_norm_row(const float* x, const float* residual, const float* weight, float eps, int64_t hidden,
                         float* out, float* residual_out) {
  float sum_sq = 0.0f;
  if (residual != nullptr) {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < hidden; ++i) {
      const float s = x[i] + residual[i];
      residual_out[i] = s;
      sum_sq += s * s;
    }
    x = residual_out;
  } else {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < hidden; ++i) sum_sq += x[i] * x[i];
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) out[i] = x[i] * inv_rms * weight[i];
}

// out, x, residual, residual_out: [T, hidden] contiguous float32; weight: [hidden]. parallel_for: how the
// rows are shared among threads (cpu_team.h).
template <class ParallelFor>
inline void rms_norm(const ParallelFor& parallel_for, torch::Tensor& out, torch::Tensor& residual_out,
                     const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                     double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const float* x_data = x.data_ptr<float>();
  const float* r_data = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* ro_data = residual.has_value() ? residual_out.data_ptr<float>() : nullptr;
  const float* w_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(x_data + r * hidden, r_data == nullptr ? nullptr : r_data + r * hidden, w_data,
                   static_cast<float>(eps), hidden, out_data + r * hidden,
                   ro_data == nullptr ? nullptr : ro_data + r * hidden);
  });
}

inline void rms_norm(torch::Tensor& out, torch::Tensor& residual_out, const torch::Tensor& x,
                     const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight, double eps) {
  rms_norm(AtenParallelFor{}, out, residual_out, x, residual, weight, eps);
}

}  // namespace sluice::norm
