// Row-wise argmax of float32 logits on CPU, as torch's argmax: the first maximum of each row, a NaN
// counting as the maximum (the first NaN wins).
//
//   x [rows, vocab] -> out [rows] int64
//
// One pass over memory: the row is read in kChunk-float chunks, each reduced to its maximum (a vectorised
// max) and NaN flag; the first chunk holding the row's maximum (or its first NaN) is then searched again,
// from cache, for the index. torch's CPU argmax does not vectorise (49,152 floats a row took 60 us).
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace sluice::sample {

constexpr int64_t kChunk = 256;  // floats per chunk: 1 KiB, a few lines of L1

inline int64_t argmax_row(const float* row, int64_t vocab) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_chunk = 0, nan_chunk = -1;
  for (int64_t start = 0; start < vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, vocab - start);
    float m = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
      const float v = row[start + i];
      m = v > m ? v : m;
      nan |= v != v;
    }
    if (nan) {
      nan_chunk = start;
      break;
    }
    if (m > best) {  // strictly: an equal maximum in a later chunk is not the first
      best = m;
      best_chunk = start;
    }
  }
  const int64_t start = nan_chunk >= 0 ? nan_chunk : best_chunk;
  const int64_t end = std::min(start + kChunk, vocab);
  for (int64_t i = start; i < end; ++i) {
    const float v = row[i];
    if (nan_chunk >= 0 ? v != v : v == best) return i;
  }
  return start;  // not reached: the chunk holds its maximum (an all -inf row: index 0, as torch's)
}

// A new [rows] int64 tensor (one call from Python: right after a forward each dispatched op is cold).
inline torch::Tensor argmax_rows(const torch::Tensor& x_in) {
  const torch::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  torch::Tensor out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* x_data = x.data_ptr<float>();
  int64_t* out_data = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_data[r] = argmax_row(x_data + r * vocab, vocab);
  });
  return out;
}

}  // namespace sluice::sample
