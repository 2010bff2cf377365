// y = x W^T (+ b) on CPU in float32, with W laid out once at load as column panels:
//
//   W [N, K]  ->  packed [num_panels, K, kPanel]      packed[p, k, j] = W[p * kPanel + j, k]
//                                                      (0 where p * kPanel + j >= N)
//
// Each panel is one contiguous stream of K * kPanel floats, so a step's weights are read front to back
// (the hardware prefetcher's best case: no strided rows, no page crossings per row). Threads split the
// output columns evenly in whole vectors (kLanes columns), so a thread's share is whole panels plus a part
// of one at either end, and 9 panels split over 2 threads as evenly as 8 do. Within its part of a panel,
// rows of x go kRows at a time through a register-blocked micro-kernel (kRows x kPanel accumulators), so
// the panel comes from memory once and from L2 for the other row blocks. Decode steps (1-64 rows) are
// bandwidth- or nearly bandwidth-bound, where sgemm on small M is far from the machine's limits; bigger
// steps use the same kernel.
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>

namespace sluice::linear {

constexpr int64_t kLanes = 16;                 // floats per vector (one AVX-512 register; two AVX2 ones)
constexpr int64_t kVectors = 4;                // vectors per panel row
constexpr int64_t kPanel = kLanes * kVectors;  // output columns per panel
constexpr int64_t kRows = 6;                   // rows of x per micro-kernel call: 6 x 4 accumulators

typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }

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
      for (int v = 0; v < vectors; ++v) __builtin_prefetch(w + 32 * kPanel + v * kLanes, 0, 1);
    if (k < ahead_lines) __builtin_prefetch(ahead + k * kLanes, 0, 1);
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

template <int rows>
constexpr std::array<MicroKernel, kVectors + 1> kernels_for_rows() {
  return {nullptr, micro_kernel<rows, 1>, micro_kernel<rows, 2>, micro_kernel<rows, 3>, micro_kernel<rows, 4>};
}

// kMicroKernels[rows][vectors]
constexpr std::array<std::array<MicroKernel, kVectors + 1>, kRows + 1> kMicroKernels = {{{},
                                                                                         kernels_for_rows<1>(),
                                                                                         kernels_for_rows<2>(),
                                                                                         kernels_for_rows<3>(),
                                                                                         kernels_for_rows<4>(),
                                                                                         kernels_for_rows<5>(),
                                                                                         kernels_for_rows<6>()}};
static_assert(kVectors == 4 && kRows == 6, "kMicroKernels lists every (rows, vectors) instance");

// Vectors [first_vector, first_vector + vectors) of one panel against every row of x:
// y[:, first_col : min(N, first_col + vectors * kLanes)], first_col = p * kPanel + first_vector * kLanes.
// next_panel (the thread's next panel, or null): the row blocks after the first share out its prefetch into
// L2, so the memory stream of the next panel overlaps this one's compute (2-8% at 16-64 rows).
//
//   row block    0                 1          2          ...   last
//   panel        from memory       from L2    from L2          from L2
//   prefetches   panel, 32 rows on next[0:n)  next[n:2n) ...   (n lines each, one per k)
inline void panel_times_rows(const float* x, int64_t m_size, int64_t k_size, const float* panel, int64_t first_vector,
                             int64_t vectors, int64_t first_col, int64_t n_size, const float* bias, float* y,
                             const float* next_panel) {
  const int64_t cols = std::min(vectors * kLanes, n_size - first_col);
  const int64_t later_blocks = (m_size - 1) / kRows;  // row blocks after the first
  const int64_t next_lines = next_panel == nullptr ? 0 : k_size * kVectors;
  const int64_t lines_per_block =
      later_blocks == 0 ? 0 : std::min(k_size, (next_lines + later_blocks - 1) / later_blocks);
  alignas(64) float tile[kRows * kPanel];
  for (int64_t m = 0; m < m_size; m += kRows) {
    const int64_t rows = std::min(kRows, m_size - m);
    const bool whole = cols == vectors * kLanes;
    float* out = whole ? y + m * n_size + first_col : tile;
    const int64_t out_stride = whole ? n_size : kPanel;
    const int64_t first_line = (m / kRows - 1) * lines_per_block;  // of next_panel, for row blocks after 0
    const int64_t ahead_lines = m == 0 ? 0 : std::clamp(next_lines - first_line, int64_t{0}, lines_per_block);
    kMicroKernels[rows][vectors](x + m * k_size, k_size, panel + first_vector * kLanes, k_size, out, out_stride,
                                 /*from_memory=*/m == 0, next_panel + std::max(first_line, int64_t{0}) * kLanes,
                                 ahead_lines);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = y + (m + r) * n_size + first_col;
      if (!whole) std::memcpy(row, tile + r * kPanel, cols * sizeof(float));
      if (bias != nullptr)
        for (int64_t j = 0; j < cols; ++j) row[j] += bias[first_col + j];
    }
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
