// Paged attention on CPU for a mixed batch (prefill chunks, chunks after a cached prefix, decodes), reading
// K/V in place from the paged cache through the block table: no sequence's context is ever gathered. And
// store_kv, which writes a step's new K/V into the cache first.
//
// One task = (sequence, KV head, tile of up to kQueryTile query tokens) and covers every query head of that
// KV head's GQA group, so each key/value row is loaded once for all of them. Tasks are handed out
// dynamically (an atomic counter) to the threads of at::parallel_for (or of a team, cpu_team.h), largest
// first.
//
//   query row r of sequence s sits at context position  seq_len - query_len + (r - query_start)
//   and sees positions <= its own; position p lives at   k_cache[block_tables[s][p / block_size],
//                                                                p % block_size, kv_head, :]
//   with a sliding window W it sees only positions > its own - W, and blocks wholly before the first row's
//   window are never read.
//
// Per block of the context, each query vector does an online-softmax step (running max m, exp-sum l,
// unnormalised accumulator acc, all fp32); the output is acc / l. Inputs may be fp32, bf16 or fp16.
// head_dim 64 and 128 take attend_vectorized: whole-vector rows, the scores of up to kLanes positions summed by
// one butterfly, and the next block's rows prefetched.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_team.h"
#include "cpu_vector_math.h"

namespace sluice::attention {

constexpr int64_t kQueryTile = 16;

template <typename scalar_t>
inline vec load_lanes(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load(p);
  } else {
    vec v;
    for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}

// out[t] = the sum of p[t]'s lanes, for t < kLanes: a butterfly of two-source shuffles and adds (kLanes - 1
// of each) instead of kLanes horizontal sums. Level by level, each vector holds halves of twice as many sums
// (16 lanes):
//   a[j] = [p[2j] (8 partial sums) | p[2j+1] (8)],  b[j] = [p[4j] (4) | ... | p[4j+3] (4)],  ...
inline vec sum_lanes(const vec (&p)[kLanes]) {
#if defined(__AVX512F__)
  vec a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)
    a[j] =
        __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(p[2 * j], p[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(__AVX__)
  vec a[4], b[2];
  for (int j = 0; j < 4; ++j)
    a[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * j], p[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  vec sums;
  for (int64_t t = 0; t < kLanes; ++t) {
    sums[t] = 0.0f;
    for (int64_t i = 0; i < kLanes; ++i) sums[t] += p[t][i];
  }
  return sums;
#endif
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < head_dim; ++i) sum += q[i] * static_cast<float>(k[i]);
  return sum;
}

template <typename scalar_t>
inline void add_scaled(float* acc, float p, const scalar_t* v, int64_t head_dim) {
#pragma omp simd
  for (int64_t i = 0; i < head_dim; ++i) acc[i] += p * static_cast<float>(v[i]);
}

struct Task {
  int64_t seq;
  int64_t kv_head;
  int64_t first_row;  // global query row (token index)
  int64_t num_rows;
  int64_t first_position;  // context position of first_row
  int64_t cost;
  int64_t window;  // sliding window W (row at position p sees p - W + 1 .. p), 0 for none

  // The first context position row r (0-based in the task) sees.
  int64_t lowest_visible(int64_t row) const {
    return window > 0 ? std::max<int64_t>(0, first_position + row - window + 1) : 0;
  }
  // One past the last context position the task reads (its last row sees them all).
  int64_t end() const { return first_position + num_rows; }
  // The first block's first position: blocks before the first row's window are never read (a windowed cache
  // may have freed them).
  int64_t first_block_start(int64_t block_size) const { return lowest_visible(0) / block_size * block_size; }
};

struct Strides {
  int64_t q_row, q_head, out_row, out_head;
  int64_t k_block, k_slot, k_head, v_block, v_slot, v_head;
  int64_t bt_seq;
};

// The key and value rows of one block of a task's context, for its KV head.
template <typename scalar_t>
struct BlockRows {
  const scalar_t* keys = nullptr;
  const scalar_t* values = nullptr;
  int64_t len = 0;  // rows in use: block_size, or fewer in the context's last block

  BlockRows() = default;
  // The block holding position `start` (a multiple of block_size, < task.end()).
  BlockRows(const Task& task, int64_t start, const scalar_t* k_cache, const scalar_t* v_cache,
            const int32_t* block_tables, const Strides& st, int64_t block_size) {
    const int64_t block = block_tables[task.seq * st.bt_seq + start / block_size];
    keys = k_cache + block * st.k_block + task.kv_head * st.k_head;
    values = v_cache + block * st.v_block + task.kv_head * st.v_head;
    len = std::min(block_size, task.end() - start);
  }

  // Asks for row t (< len) of both into L2 (prefetcht2 beat prefetcht0 at batch-64 decode, and asking two
  // blocks ahead: docs/BENCHMARKS.md, "Figures behind the code").
  template <int64_t kHeadDim>
  void prefetch(int64_t t, const Strides& st) const {
    for (int64_t byte = 0; byte < kHeadDim * int64_t(sizeof(scalar_t)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(keys + t * st.k_slot) + byte, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(values + t * st.v_slot) + byte, 0, 1);
    }
  }
};

// Where a task's query vector i (row first_row + i / group, head kv_head * group + i % group) sits in a
// [num_tokens, num_heads, head_dim] tensor with these row and head strides.
inline int64_t vector_offset(const Task& task, int64_t i, int64_t group, int64_t row_stride, int64_t head_stride) {
  return (task.first_row + i / group) * row_stride + (task.kv_head * group + i % group) * head_stride;
}

// Any head_dim, one scalar dot product per (query vector, position).
template <typename scalar_t>
void attend(const Task& task, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
            const int32_t* block_tables, scalar_t* out, const Strides& st, int64_t group, int64_t head_dim,
            int64_t block_size, float scale) {
  const int64_t num_vectors = task.num_rows * group;  // vector i: row i / group, head kv_head*group + i % group
  std::vector<float> qf(num_vectors * head_dim), acc(num_vectors * head_dim, 0.0f);
  std::vector<float> running_max(num_vectors, -std::numeric_limits<float>::infinity());
  std::vector<float> exp_sum(num_vectors, 0.0f), scores(block_size);
  for (int64_t i = 0; i < num_vectors; ++i) {
    const scalar_t* src = q + vector_offset(task, i, group, st.q_row, st.q_head);
    for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = static_cast<float>(src[d]) * scale;
  }
  for (int64_t start = task.first_block_start(block_size); start < task.end(); start += block_size) {
    const BlockRows<scalar_t> here(task, start, k_cache, v_cache, block_tables, st, block_size);
    const scalar_t *keys = here.keys, *values = here.values;
    for (int64_t i = 0; i < num_vectors; ++i) {  // it sees slots [first, visible) of this block
      const int64_t visible = std::min(block_size, task.first_position + i / group + 1 - start);
      const int64_t first = std::max<int64_t>(0, task.lowest_visible(i / group) - start);
      if (visible <= first) continue;
      const float* qi = qf.data() + i * head_dim;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = first; t < visible; ++t) {
        scores[t] = dot(qi, keys + t * st.k_slot, head_dim);
        block_max = std::max(block_max, scores[t]);
      }
      const float new_max = std::max(running_max[i], block_max);
      const float correction = sluice::exp_nonpositive(running_max[i] - new_max);  // ~0 on the first block
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = first; t < visible; ++t) {
        scores[t] = sluice::exp_nonpositive(scores[t] - new_max);
        sum += scores[t];
      }
      float* acc_i = acc.data() + i * head_dim;
      if (correction != 1.0f) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc_i[d] *= correction;
      }
      for (int64_t t = first; t < visible; ++t) add_scaled(acc_i, scores[t], values + t * st.v_slot, head_dim);
      exp_sum[i] = exp_sum[i] * correction + sum;
      running_max[i] = new_max;
    }
  }
  for (int64_t i = 0; i < num_vectors; ++i) {
    scalar_t* dst = out + vector_offset(task, i, group, st.out_row, st.out_head);
    const float inv = 1.0f / exp_sum[i];
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i * head_dim + d] * inv);
  }
}

// attend() for a head_dim that is a multiple of kLanes, fixed at compile time: query vectors, accumulators and
// key rows are whole vectors, and each chunk of up to kLanes positions gets its scores from one sum_lanes.
// A query vector scores a whole block into `scores` before its one online-softmax step for the block (with
// AVX2's 8-position chunks, a step per chunk cost 12-17% more at 64 sequences with the cache hot).
//
// While a block is computed, the block after it is asked for, one row per position the first query vector
// scores (spread out, so the loads of this block are not queued behind a burst of requests); after the last
// block, the first block of next_task, the task this thread runs next (or null). Together faster than a
// burst for the next block alone (docs/BENCHMARKS.md, "Figures behind the code").
template <typename scalar_t, int64_t kHeadDim>
void attend_vectorized(const Task& task, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int32_t* block_tables, scalar_t* out, const Strides& st, int64_t group, int64_t block_size,
                       float scale, const Task* next_task) {
  constexpr int64_t kVectors = kHeadDim / kLanes;
  const int64_t num_vectors = task.num_rows * group;  // vector i: row i / group, head kv_head*group + i % group
  thread_local std::vector<vec> q_scaled, acc;        // [num_vectors * kVectors]; reused across tasks
  thread_local std::vector<float> running_max, exp_sum, scores;  // scores: one block's, whole vectors
  q_scaled.resize(num_vectors * kVectors);
  scores.resize((block_size + kLanes - 1) / kLanes * kLanes);
  acc.assign(num_vectors * kVectors, vec{});
  running_max.assign(num_vectors, -std::numeric_limits<float>::infinity());
  exp_sum.assign(num_vectors, 0.0f);
  for (int64_t i = 0; i < num_vectors; ++i) {
    const scalar_t* src = q + vector_offset(task, i, group, st.q_row, st.q_head);
    for (int64_t v = 0; v < kVectors; ++v) q_scaled[i * kVectors + v] = load_lanes(src + v * kLanes) * scale;
  }
  for (int64_t start = task.first_block_start(block_size); start < task.end(); start += block_size) {
    const BlockRows<scalar_t> here(task, start, k_cache, v_cache, block_tables, st, block_size);
    BlockRows<scalar_t> ahead;
    if (start + block_size < task.end()) {
      ahead = BlockRows<scalar_t>(task, start + block_size, k_cache, v_cache, block_tables, st, block_size);
    } else if (next_task != nullptr) {
      ahead = BlockRows<scalar_t>(*next_task, next_task->first_block_start(block_size), k_cache, v_cache, block_tables,
                                  st, block_size);
    }
    const scalar_t *keys = here.keys, *values = here.values;
    int64_t asked = -1;                          // ahead rows asked for, by the block's first query vector
    for (int64_t i = 0; i < num_vectors; ++i) {  // it sees slots [first, visible) of this block
      const int64_t visible = std::min(here.len, task.first_position + i / group + 1 - start);
      const int64_t first = std::max<int64_t>(0, task.lowest_visible(i / group) - start);
      if (visible <= first) continue;
      const bool ask = asked < 0;
      const vec* qi = q_scaled.data() + i * kVectors;
      const int64_t lo = first / kLanes * kLanes, hi = (visible + kLanes - 1) / kLanes * kLanes;
      for (int64_t chunk = lo; chunk < hi; chunk += kLanes) {  // scores of the chunk's kLanes slots
        vec partial[kLanes];
        for (int64_t t = 0; t < kLanes; ++t) {
          if (ask && chunk + t < ahead.len) ahead.template prefetch<kHeadDim>(chunk + t, st);
          partial[t] = vec{};
          if (chunk + t < first || chunk + t >= visible) continue;
          const scalar_t* key = keys + (chunk + t) * st.k_slot;
          for (int64_t v = 0; v < kVectors; ++v) partial[t] += qi[v] * load_lanes(key + v * kLanes);
        }
        store(scores.data() + chunk, sum_lanes(partial));
      }
      if (ask) asked = hi;
      float block_max = scores[first];
      for (int64_t t = first + 1; t < visible; ++t) block_max = std::max(block_max, scores[t]);
      const float new_max = std::max(running_max[i], block_max);
      const float correction = sluice::exp_nonpositive(running_max[i] - new_max);  // ~0 on the first block
      float sum = 0.0f;
      float* block_scores = scores.data();
#pragma omp simd reduction(+ : sum)
      for (int64_t t = lo; t < hi; ++t) {  // unseen slots hold 0: keep exp's argument <= 0 there too
        const bool seen = t >= first && t < visible;
        const float e = sluice::exp_nonpositive(seen ? block_scores[t] - new_max : 0.0f);
        block_scores[t] = seen ? e : 0.0f;
        sum += block_scores[t];
      }
      vec row[kVectors];
      for (int64_t v = 0; v < kVectors; ++v) row[v] = acc[i * kVectors + v] * correction;
      for (int64_t t = first; t < visible; ++t) {
        const scalar_t* value = values + t * st.v_slot;
        for (int64_t v = 0; v < kVectors; ++v) row[v] += block_scores[t] * load_lanes(value + v * kLanes);
      }
      for (int64_t v = 0; v < kVectors; ++v) acc[i * kVectors + v] = row[v];
      exp_sum[i] = exp_sum[i] * correction + sum;
      running_max[i] = new_max;
    }
    // Ahead rows the first query vector's chunks did not reach (a partial last block before a next task's
    // whole first one).
    for (int64_t t = std::max<int64_t>(asked, 0); t < ahead.len; ++t) ahead.template prefetch<kHeadDim>(t, st);
  }
  for (int64_t i = 0; i < num_vectors; ++i) {
    scalar_t* dst = out + vector_offset(task, i, group, st.out_row, st.out_head);
    const vec row_scale = vec{} + 1.0f / exp_sum[i];
    for (int64_t v = 0; v < kVectors; ++v) {
      const vec result = acc[i * kVectors + v] * row_scale;
      for (int64_t d = 0; d < kLanes; ++d) dst[v * kLanes + d] = static_cast<scalar_t>(result[d]);
    }
  }
}

inline std::vector<Task> make_tasks(const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                                    int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t window) {
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    const int64_t seq_len = lens[s];
    TORCH_CHECK(query_len >= 0 && query_len <= seq_len, "sequence ", s, ": query_len ", query_len,
                " must be in [0, seq_len=", seq_len, "]");
    TORCH_CHECK((seq_len + block_size - 1) / block_size <= max_blocks, "block_tables: sequence ", s, " needs ",
                (seq_len + block_size - 1) / block_size, " blocks, the table has ", max_blocks);
    for (int64_t r = 0; r < query_len; r += kQueryTile) {
      const int64_t rows = std::min(kQueryTile, query_len - r);
      const int64_t first_position = seq_len - query_len + r;
      const int64_t seen = window > 0 ? std::min(first_position + rows, window) : first_position + rows;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({s, h, starts[s] + r, rows, first_position, rows * seen, window});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// Every block a sequence's rows read is an index into the cache, which the kernel reads unchecked (a bad
// one read NaN or another request's rows, or past the cache: SIGSEGV). Blocks wholly before a sliding
// window are not read: they may be freed. After make_tasks, which checks the tables' width.
inline void check_block_ids(const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                            const torch::Tensor& seq_lens, int64_t block_size, int64_t num_blocks, int64_t window) {
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t seq_len = lens[s], query_len = starts[s + 1] - starts[s];
    const int64_t first_seen = window > 0 ? std::max<int64_t>(0, seq_len - query_len - window + 1) : 0;
    for (int64_t b = first_seen / block_size; b < (seq_len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables: sequence ", s, " block ", b, " is ", block,
                        ", not one of the cache's ", num_blocks, " blocks");
    }
  }
}

// The tasks of make_tasks on every thread parallel_for names (cpu_team.h), each claiming the next from
// `next` (0 before the first thread starts; shared by the threads). Arguments as paged_attention's.
template <class ParallelFor>
inline void run_tasks(const ParallelFor& parallel_for, std::atomic<int64_t>& next, const std::vector<Task>& tasks,
                      torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, double scale) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const Strides st{q.stride(0),       q.stride(1),       out.stride(0),         out.stride(1),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),     v_cache.stride(0),
                   v_cache.stride(1), v_cache.stride(2), block_tables.stride(0)};
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    auto run = [&](auto fixed_head_dim) {
      constexpr int64_t kHeadDim = decltype(fixed_head_dim)::value;
      parallel_for(0, std::min<int64_t>(parallel_for.threads(), num_tasks), 1, [&](int64_t, int64_t) {
        // Each thread claims its next task before it runs this one, so the last block can ask for the next's first.
        for (int64_t i = next++, after = 0; i < num_tasks; i = after) {
          after = next++;
          if constexpr (kHeadDim > 0) {
            attend_vectorized<scalar_t, kHeadDim>(tasks[i], q_ptr, k_ptr, v_ptr, tables, out_ptr, st, group, block_size,
                                                  static_cast<float>(scale),
                                                  after < num_tasks ? &tasks[after] : nullptr);
          } else {
            attend<scalar_t>(tasks[i], q_ptr, k_ptr, v_ptr, tables, out_ptr, st, group, head_dim, block_size,
                             static_cast<float>(scale));
          }
        }
      });
    };
    if (head_dim == 64) {
      run(std::integral_constant<int64_t, 64>{});
    } else if (head_dim == 128) {
      run(std::integral_constant<int64_t, 128>{});
    } else {
      run(std::integral_constant<int64_t, 0>{});
    }
  });
}

// out, q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
// head_dim]; block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
// seq_lens: [num_seqs] int32; sliding_window: 0 for none. The Python launcher checks shapes, dtypes and
// devices.
inline void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                            double scale, int64_t sliding_window) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window: must be >= 0 (0 for none), got ", sliding_window);
  const std::vector<Task> tasks = make_tasks(query_start_loc, seq_lens, block_tables.size(1), k_cache.size(1),
                                             k_cache.size(2), sliding_window);
  check_block_ids(block_tables, query_start_loc, seq_lens, k_cache.size(1), k_cache.size(0), sliding_window);
  std::atomic<int64_t> next{0};
  run_tasks(AtenParallelFor{}, next, tasks, out, q, k_cache, v_cache, block_tables, scale);
}

// The first token whose slot (slot_mapping [num_tokens] int64, contiguous) is past the cache's num_slots
// = num_blocks * block_size, or -1 when there is none. store_kv asks before it writes anything.
inline int64_t first_slot_past_cache(const torch::Tensor& slot_mapping, int64_t num_slots) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)
    if (slots[t] >= num_slots) return t;
  return -1;
}

// k_cache[slot / block_size, slot % block_size] = k[t] and the same for v, for each token t in [begin, end)
// (default: all) whose slot = slot_mapping[t] is >= 0 (kernels/store_kv.py's contract) and every slot
// already known to be in the cache: this step's keys and values into the cache, one row copy per (token, KV
// head) and no thread hand-off, as decode writes a few rows per layer.
inline void store_kv_rows(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t begin = 0,
                          int64_t end = -1) {
  const int64_t num_kv_heads = k.size(1), head_dim = k.size(2);
  if (end < 0) end = k.size(0);
  const int64_t block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv", [&] {
    const size_t row_bytes = head_dim * sizeof(scalar_t);
    for (auto [src, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
      const scalar_t* src_data = src->data_ptr<scalar_t>();
      scalar_t* cache_data = cache->data_ptr<scalar_t>();
      for (int64_t t = begin; t < end; ++t) {
        if (slots[t] < 0) continue;
        scalar_t* dst =
            cache_data + (slots[t] / block_size) * cache->stride(0) + (slots[t] % block_size) * cache->stride(1);
        for (int64_t h = 0; h < num_kv_heads; ++h)
          std::memcpy(dst + h * cache->stride(2), src_data + t * src->stride(0) + h * src->stride(1), row_bytes);
      }
    }
  });
}

// Raises (TORCH_CHECK) unless every slot of slot_mapping is in k_cache: what store_kv_rows needs. The
// decoder stack asks once a step, before any layer writes.
inline void check_slots(const torch::Tensor& slot_mapping, const torch::Tensor& k_cache) {
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping: must be contiguous");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bad = first_slot_past_cache(slot_mapping, num_slots);
  TORCH_CHECK(bad < 0, "slot_mapping: slot ", slot_mapping.data_ptr<int64_t>()[bad], " (token ", bad,
              ") is past the cache's ", num_slots, " slots");
}

// The Python binding's store_kv: check_slots' check before any write, but a slot past the cache comes back
// as the first bad token (-1: every row written) instead of a C++ exception, and the launcher raises it in
// Python. A bad slot is then an error on every build, however the extension's exceptions cross into Python
// (a JIT-built extension on one GPU machine died with SIGSEGV here instead of raising; issue 31).
inline int64_t store_kv_or_first_bad_token(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                           torch::Tensor v_cache, torch::Tensor slot_mapping) {
  const torch::Tensor slots = slot_mapping.contiguous();  // no copy when it is (the launchers' contract)
  const int64_t bad = first_slot_past_cache(slots, k_cache.size(0) * k_cache.size(1));
  if (bad < 0) store_kv_rows(k, v, k_cache, v_cache, slots);
  return bad;
}

}  // namespace sluice::attention
