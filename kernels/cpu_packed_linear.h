// y = x W^T (+ b) on CPU in float32, with W laid out once at load as column panels:
//
//   W [N, K]  ->  packed [num_panels, K, kPanel]      packed[p, k, j] = W[p * kPanel + j, k]
//                                                      (0 where p * kPanel + j >= N)
//
// Each panel is one contiguous stream of K * kPanel floats, so a step's weights are read front to back
// (the hardware prefetcher's best case: no strided rows, no page crossings per row). A panel is as wide as
// the micro-kernel's register block (kPanelVectors vectors: 64 columns with AVX-512's 32 registers, 16 with
// AVX2's 16, 8 with SSE/NEON), so every call streams whole panel rows. Panels 64 wide on AVX2, read in
// 16-column strips, put a strip's rows 256 bytes apart: a quarter of L1's sets, so a strip did not stay in
// L1 for the next row block, and 16-wide panels were faster (docs/BENCHMARKS.md, "Figures behind the
// code"). Threads split the output columns evenly in whole vectors (kLanes columns), so a
// thread's share is whole panels plus a part of one at either end. Within its part of a panel, rows of x go
// kRows at a time through the micro-kernel, so a panel comes from memory once and from cache for the other
// row blocks. Decode steps (1-64 rows) are bandwidth- or nearly bandwidth-bound, where sgemm on small M is
// far from the machine's limits; bigger steps use the same kernel.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "cpu_team.h"
#include "cpu_vector_math.h"

namespace sluice::linear {

#if defined(__AVX512F__)
constexpr int64_t kPanelVectors = 4;  // 32 registers: up to 6 x 4 accumulators + 4 weights
#else
constexpr int64_t kPanelVectors = 2;  // 16 registers: up to 6 x 2 accumulators + 2 weights + a broadcast
#endif
constexpr int64_t kPanel = kPanelVectors * kLanes;  // columns per panel: the packing (cpu_packed_linear.py)
constexpr int64_t kRows = 6;                         // rows of x per micro-kernel call
constexpr int64_t kPrefetchFloats = 2048;            // how far ahead in its panel a first row block asks for (8 KiB)

// out[r, 0:vectors * kLanes] = sum_k x[r, k] * panel[k, 0:vectors * kLanes] for r < rows (rows <= kRows),
// `panel` pointing at the first of the vectors in a panel's row 0. from_memory (the panel's first row block):
// ask for the panel 8 KiB ahead into L2 (prefetcht2; 5-20% at 1-16 rows, where prefetcht0 lost above 1).
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
      for (int64_t f = 0; f < vectors * kLanes; f += kFloatsPerLine) __builtin_prefetch(w + kPrefetchFloats + f, 0, 1);
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

// kMicroKernels[rows][vectors] for 1 <= rows <= kRows and 1 <= vectors <= kPanelVectors.
template <int rows, size_t... v>
constexpr std::array<MicroKernel, kPanelVectors + 1> kernels_for_rows(std::index_sequence<v...>) {
  return {nullptr, micro_kernel<rows, int(v) + 1>...};
}

template <size_t... r>
constexpr std::array<std::array<MicroKernel, kPanelVectors + 1>, kRows + 1> kernel_table(std::index_sequence<r...>) {
  return {{{}, kernels_for_rows<int(r) + 1>(std::make_index_sequence<kPanelVectors>{})...}};
}

constexpr auto kMicroKernels = kernel_table(std::make_index_sequence<kRows>{});

// Vectors [first_vector, first_vector + vectors) of one panel against every row of x:
// y[:, first_col : min(N, first_col + vectors * kLanes)], first_col = p * kPanel + first_vector * kLanes.
// The first row block reads the panel from memory, the others from L1/L2. next_panel (the thread's next
// panel, or null): the calls after the first share out its prefetch into L2, so the memory stream of the
// next panel overlaps this one's compute (measured: docs/BENCHMARKS.md, "Figures behind the code").
//
//   call         rows 0            rows kRows..      ...   last rows
//   panel        from memory       from L1/L2              from L1/L2
//   prefetches   panel, 8 KiB on   next[0:n)         ...   (n lines each, one per k)
inline void panel_times_rows(const float* x, int64_t m_size, int64_t k_size, const float* panel, int64_t first_vector,
                             int64_t vectors, int64_t first_col, int64_t n_size, const float* bias, float* y,
                             const float* next_panel) {
  const int64_t row_blocks = (m_size + kRows - 1) / kRows;
  const int64_t next_lines = next_panel == nullptr ? 0 : (k_size * kPanel + kFloatsPerLine - 1) / kFloatsPerLine;
  const int64_t lines_per_call =  // at most one per k
      row_blocks == 1 ? 0 : std::min(k_size, (next_lines + row_blocks - 2) / (row_blocks - 1));
  const int64_t cols = std::min(vectors * kLanes, n_size - first_col);
  const bool whole = cols == vectors * kLanes;
  alignas(64) float tile[kRows * kPanel];  // the rows of a block where N ends inside the panel
  for (int64_t m = 0, call = 0; m < m_size; m += kRows, ++call) {
    const int64_t rows = std::min(kRows, m_size - m);
    const int64_t first_line = (call - 1) * lines_per_call;  // of next_panel, for the calls after the first
    const int64_t ahead_lines = call == 0 ? 0 : std::clamp(next_lines - first_line, int64_t{0}, lines_per_call);
    kMicroKernels[rows][vectors](x + m * k_size, k_size, panel + first_vector * kLanes, k_size,
                                 whole ? y + m * n_size + first_col : tile, whole ? n_size : kPanel,
                                 /*from_memory=*/m == 0, next_panel + std::max(first_line, int64_t{0}) * kFloatsPerLine,
                                 ahead_lines);
    if (!whole)
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + (m + r) * n_size + first_col, tile + r * kPanel, cols * sizeof(float));
  }
  if (bias != nullptr)
    for (int64_t r = 0; r < m_size; ++r)
      for (int64_t j = 0; j < cols; ++j) y[r * n_size + first_col + j] += bias[first_col + j];
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]), W packed as [num_panels, K, kPanel]. All float32, contiguous.
// parallel_for: how the columns are shared among threads (cpu_team.h).
template <class ParallelFor>
inline void packed_linear(const ParallelFor& parallel_for, torch::Tensor& y, const torch::Tensor& x,
                          const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = y.size(1);
  const int64_t num_vectors = (n_size + kLanes - 1) / kLanes;  // the padding past the last one is skipped
  const float* x_data = x.data_ptr<float>();
  const float* w_data = packed.data_ptr<float>();
  const float* b_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y_data = y.data_ptr<float>();
  parallel_for(0, num_vectors, 1, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end;) {  // one panel, or the part of it in [begin, end), per pass
      const int64_t p = v / kPanelVectors, first_vector = v % kPanelVectors;
      const int64_t vectors = std::min(kPanelVectors - first_vector, end - v);
      const float* next_panel = v + vectors < end ? w_data + (p + 1) * k_size * kPanel : nullptr;
      panel_times_rows(x_data, m_size, k_size, w_data + p * k_size * kPanel, first_vector, vectors, v * kLanes, n_size,
                       b_data, y_data, next_panel);
      v += vectors;
    }
  });
}

inline void packed_linear(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& packed,
                          const c10::optional<torch::Tensor>& bias) {
  packed_linear(AtenParallelFor{}, y, x, packed, bias);
}

}  // namespace sluice::linear
