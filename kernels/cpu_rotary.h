// Rotary position embedding in place, float32 on CPU ("rotate half" layout, as kernels/rotary.py):
//
//   cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]      [max_position, head_dim]
//   x = [x1 | x2]  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]   for every head of q and k
//
// q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] may be strided views of the fused qkv
// projection (row stride, head stride; the last dim contiguous). One task per chunk of tokens.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

namespace sluice::rotary {

constexpr int64_t kTokenGrain = 8;  // tokens per task

inline void rotate_heads(float* x, int64_t num_heads, int64_t head_stride, const float* cos, const float* sin,
                         int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x1 = x + h * head_stride;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// Tokens [begin, end) of q and k.
inline void rotate_tokens(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& positions,
                          const torch::Tensor& cos_sin_cache, int64_t begin, int64_t end) {
  const int64_t half = q.size(2) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin_cache.data_ptr<float>();
  const int64_t table_stride = cos_sin_cache.stride(0);
  float* q_data = q.data_ptr<float>();
  float* k_data = k.data_ptr<float>();
  for (int64_t t = begin; t < end; ++t) {
    const float* cos = table + pos[t] * table_stride;
    const float* sin = cos + half;
    rotate_heads(q_data + t * q.stride(0), q.size(1), q.stride(1), cos, sin, half);
    rotate_heads(k_data + t * k.stride(0), k.size(1), k.stride(1), cos, sin, half);
  }
}

inline void rotary_embedding(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& positions,
                             const torch::Tensor& cos_sin_cache) {
  at::parallel_for(0, q.size(0), kTokenGrain, [&](int64_t begin, int64_t end) {
    rotate_tokens(q, k, positions, cos_sin_cache, begin, end);
  });
}

}  // namespace sluice::rotary
