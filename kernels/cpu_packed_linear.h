// y = x W^T (+ b) on CPU in float32, with W laid out once at load as column panels:
//
//   W [N, K]  ->  packed [num_panels, K, kPanel]      packed[p, k, j] = W[p * kPanel + j, k]
//                                                      (0 where p * kPanel + j >= N)
//
// Each panel is one contiguous stream of K * kPanel floats, so a step's weights are read front to back
// (the hardware prefetcher's best case: no strided rows, no page crossings per row). Threads split the
// output columns evenly in whole vectors (kLanes columns), so a thread's share is whole panels plus a part
// of one at either end, and 9 panels split over 2 threads as evenly as 8 do. Within its part of a panel,
// rows of x go kRows at a time through a register-blocked micro-kernel (rows x a strip of the panel's
// columns in accumulators: the whole panel row with AVX-512's 32 registers, 16 columns with AVX2's 16), so
// each strip comes from memory once and from cache for the other row blocks. Decode steps (1-64 rows) are
// bandwidth- or nearly bandwidth-bound, where sgemm on small M is far from the machine's limits; bigger
// steps use the same kernel.
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "cpu_vector_math.h"

namespace sluice::linear {

constexpr int64_t kPanel = 64;                 // output columns per panel: the packing (kernels/cpu_packed_linear.py)
constexpr int64_t kVectors = kPanel / kLanes;  // vectors per panel row: 4 (AVX-512), 8 (AVX2)
constexpr int64_t kRows = 6;                   // rows of x per micro-kernel call
constexpr int64_t kLinesPerPanelRow = kPanel / kFloatsPerLine;

// Vectors of a panel row per micro-kernel call with `rows` rows: its rows x vectors accumulators, the
// vectors of weights and a broadcast must fit in the vector registers, or the loop spills.
constexpr int64_t strip_vectors(int64_t rows) {
#if defined(__AVX512F__)
  return kVectors;  // 32 registers: up to 6 x 4 accumulators + 4 weights
#else
  return std::min(kVectors, rows == 1 ? int64_t{8} : rows <= 3 ? int64_t{4} : int64_t{2});  // 16 registers: <= 12
#endif
}

// out[r, 0:vectors * kLanes] = sum_k x[r, k] * panel[k, 0:vectors * kLanes] for r < rows (rows <= kRows),
// `panel` pointing at the first of the vectors in a panel's row 0. from_memory (the panel's first row block):
// ask for the panel 32 rows ahead into L2 (prefetcht2; 5-20% at 1-16 rows, where prefetcht0 lost above 1).
// ahead: ask for `ahead_lines` (<= k_size) cache lines from there into L2, one per k (the next panel, while
// this one comes from L2).
template <int rows, int vectors>
inline void micro_kernel(const float* x, int64_t x_stride, const float* panel, int64_t k_size, float* out,
                         int64_t out_stride, bool from_memory, const float* ahead, int64_t ahead_lines) {
  vec acc[rows][vectors];
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < vectors; ++v) acc[r][v] = vec{};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanel;
    if (from_memory)
      for (int64_t f = 0; f < vectors * kLanes; f += kFloatsPerLine) __builtin_prefetch(w + 32 * kPanel + f, 0, 1);
    if (k < ahead_lines) __builtin_prefetch(ahead + k * kFloatsPerLine, 0, 1);
    vec wv[vectors];
    for (int v = 0; v < vectors; ++v) wv[v] = load(w + v * kLanes);
    for (int r = 0; r < rows; ++r) {
      const float xs = x[r * x_stride + k];  // vector * scalar: a broadcast load, no shuffle
      for (int v = 0; v < vectors; ++v) acc[r][v] += wv[v] * xs;
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < vectors; ++v) store(out + r * out_stride + v * kLanes, acc[r][v]);
}

using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, const float*,
                             int64_t);

// kMicroKernels[rows][vectors] for 1 <= rows <= kRows and vectors <= strip_vectors(rows) (only those are
// compiled; the rest are null).
template <int rows, int vectors>
constexpr MicroKernel micro_kernel_if_used() {
  if constexpr (vectors <= strip_vectors(rows)) {
    return micro_kernel<rows, vectors>;
  } else {
    return nullptr;
  }
}

template <int rows, size_t... v>
constexpr std::array<MicroKernel, kVectors + 1> kernels_for_rows(std::index_sequence<v...>) {
  return {nullptr, micro_kernel_if_used<rows, int(v) + 1>()...};
}

template <size_t... r>
constexpr std::array<std::array<MicroKernel, kVectors + 1>, kRows + 1> kernel_table(std::index_sequence<r...>) {
  return {{{}, kernels_for_rows<int(r) + 1>(std::make_index_sequence<kVectors>{})...}};
}

constexpr auto kMicroKernels = kernel_table(std::make_index_sequence<kRows>{});

// Vectors [first_vector, first_vector + vectors) of one panel against every row of x:
// y[:, first_col : min(N, first_col + vectors * kLanes)], first_col = p * kPanel + first_vector * kLanes.
// They go a strip (strip_vectors) at a time, each strip through every row block, so a strip comes from
// memory once and from L1/L2 for the other row blocks. On AVX2, where a panel row is 4 strips, against
// every strip per row block: 35-80% faster on one core with the weights hot, 15-31% at 4-16 rows on
// SmolLM2's 30 layers with both cores, -7% to 0% at 64-256 rows there. next_panel (the thread's next panel, or null): the calls after the first
// share out its prefetch into L2, so the memory stream of the next panel overlaps this one's compute (2-8%
// at 16-64 rows on AVX-512).
//
//   call         strip 0, rows 0   strip 0, rows kRows..   ...   last strip, last rows
//   strip        from memory       from L1/L2                    from L1/L2
//   prefetches   strip, 32 k on    next[0:n)               ...   (n lines each, one per k)
inline void panel_times_rows(const float* x, int64_t m_size, int64_t k_size, const float* panel, int64_t first_vector,
                             int64_t vectors, int64_t first_col, int64_t n_size, const float* bias, float* y,
                             const float* next_panel) {
  const int64_t strip = strip_vectors(std::min(kRows, m_size));  // the fewer rows of a last block fit too
  const int64_t row_blocks = (m_size + kRows - 1) / kRows;
  const int64_t later_calls = (vectors + strip - 1) / strip * row_blocks - 1;
  const int64_t next_lines = next_panel == nullptr ? 0 : k_size * kLinesPerPanelRow;
  const int64_t lines_per_call = later_calls == 0 ? 0 : std::min(k_size, (next_lines + later_calls - 1) / later_calls);
  alignas(64) float tile[kRows * kPanel];  // a strip's rows where N ends inside it
  int64_t call = 0;
  for (int64_t s = 0; s < vectors; s += strip) {
    const int64_t strip_col = first_col + s * kLanes, strip_vectors_here = std::min(strip, vectors - s);
    const int64_t cols = std::min(strip_vectors_here * kLanes, n_size - strip_col);
    const bool whole = cols == strip_vectors_here * kLanes;
    for (int64_t m = 0; m < m_size; m += kRows, ++call) {
      const int64_t rows = std::min(kRows, m_size - m);
      const int64_t first_line = (call - 1) * lines_per_call;  // of next_panel, for the calls after the first
      const int64_t ahead_lines = call == 0 ? 0 : std::clamp(next_lines - first_line, int64_t{0}, lines_per_call);
      kMicroKernels[rows][strip_vectors_here](
          x + m * k_size, k_size, panel + (first_vector + s) * kLanes, k_size,
          whole ? y + m * n_size + strip_col : tile, whole ? n_size : kPanel, /*from_memory=*/m == 0,
          next_panel + std::max(first_line, int64_t{0}) * kFloatsPerLine, ahead_lines);
      if (!whole)
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(y + (m + r) * n_size + strip_col, tile + r * kPanel, cols * sizeof(float));
    }
  }
  if (bias != nullptr) {
    const int64_t cols = std::min(vectors * kLanes, n_size - first_col);
    for (int64_t r = 0; r < m_size; ++r)
      for (int64_t j = 0; j < cols; ++j) y[r * n_size + first_col + j] += bias[first_col + j];
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]), W packed as [num_panels, K, kPanel]. All float32, contiguous.
inline void packed_linear(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& packed,
                          const c10::optional<torch::Tensor>& bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = y.size(1);
  const int64_t num_vectors = (n_size + kLanes - 1) / kLanes;  // the padding past the last one is skipped
  const float* x_data = x.data_ptr<float>();
  const float* w_data = packed.data_ptr<float>();
  const float* b_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, num_vectors, 1, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end;) {  // one panel, or the part of it in [begin, end), per pass
      const int64_t p = v / kVectors, first_vector = v % kVectors;
      const int64_t vectors = std::min(kVectors - first_vector, end - v);
      const float* next_panel = v + vectors < end ? w_data + (p + 1) * k_size * kPanel : nullptr;
      panel_times_rows(x_data, m_size, k_size, w_data + p * k_size * kPanel, first_vector, vectors, v * kLanes, n_size,
                       b_data, y_data, next_panel);
      v += vectors;
    }
  });
}

}  // namespace sluice::linear
