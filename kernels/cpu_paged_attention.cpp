// Paged attention on CPU for a mixed batch (prefill chunks, chunks after a cached prefix, decodes), reading
// K/V in place from the paged cache through the block table: no sequence's context is ever gathered.
//
// One task = (sequence, KV head, tile of up to kQueryTile query tokens) and covers every query head of that
// KV head's GQA group, so each key/value row is loaded once for all of them. Tasks are handed out
// dynamically (an atomic counter) to the threads of at::parallel_for, largest first.
//
//   query row r of sequence s sits at context position  seq_len - query_len + (r - query_start)
//   and sees positions <= its own; position p lives at   k_cache[block_tables[s][p / block_size],
//                                                                p % block_size, kv_head, :]
//
// Per block of the context, each query vector does an online-softmax step (running max m, exp-sum l,
// unnormalised accumulator acc, all fp32); the output is acc / l. Inputs may be fp32, bf16 or fp16.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vector_math.h"

namespace {

constexpr int64_t kQueryTile = 16;

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
};

struct Strides {
  int64_t q_row, q_head, out_row, out_head;
  int64_t k_block, k_slot, k_head, v_block, v_slot, v_head;
  int64_t bt_seq;
};

// kHeadDim > 0 fixes head_dim at compile time (loops unrolled, the accumulator row kept in registers);
// 0 reads it from `runtime_head_dim`.
template <typename scalar_t, int64_t kHeadDim>
void attend(const Task& task, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
            const int32_t* block_tables, scalar_t* out, const Strides& st, int64_t group,
            int64_t runtime_head_dim, int64_t block_size, float scale) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t num_vectors = task.num_rows * group;  // vector i: row i / group, head kv_head*group + i % group
  std::vector<float> qf(num_vectors * head_dim), acc(num_vectors * head_dim, 0.0f);
  std::vector<float> running_max(num_vectors, -std::numeric_limits<float>::infinity());
  std::vector<float> exp_sum(num_vectors, 0.0f), scores(block_size);
  for (int64_t i = 0; i < num_vectors; ++i) {
    const scalar_t* src = q + (task.first_row + i / group) * st.q_row +
                          (task.kv_head * group + i % group) * st.q_head;
    for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] = static_cast<float>(src[d]) * scale;
  }
  const int64_t num_positions = task.first_position + task.num_rows;  // the last row sees them all
  const int32_t* table = block_tables + task.seq * st.bt_seq;
  for (int64_t start = 0; start < num_positions; start += block_size) {
    const int64_t block = table[start / block_size];
    const scalar_t* keys = k_cache + block * st.k_block + task.kv_head * st.k_head;
    const scalar_t* values = v_cache + block * st.v_block + task.kv_head * st.v_head;
    for (int64_t i = 0; i < num_vectors; ++i) {
      const int64_t visible = std::min(block_size, task.first_position + i / group + 1 - start);
      if (visible <= 0) continue;
      const float* qi = qf.data() + i * head_dim;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < visible; ++t) {
        scores[t] = dot(qi, keys + t * st.k_slot, head_dim);
        block_max = std::max(block_max, scores[t]);
      }
      const float new_max = std::max(running_max[i], block_max);
      const float correction = std::exp(running_max[i] - new_max);  // exp(-inf) = 0 on the first block
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < visible; ++t) {
        scores[t] = sluice::exp_nonpositive(scores[t] - new_max);
        sum += scores[t];
      }
      float* acc_i = acc.data() + i * head_dim;
      if (correction != 1.0f) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc_i[d] *= correction;
      }
      if constexpr (kHeadDim > 0) {
        float row[kHeadDim];  // a local copy the compiler can keep in registers across the positions
        std::memcpy(row, acc_i, sizeof(row));
        for (int64_t t = 0; t < visible; ++t) add_scaled(row, scores[t], values + t * st.v_slot, kHeadDim);
        std::memcpy(acc_i, row, sizeof(row));
      } else {
        for (int64_t t = 0; t < visible; ++t) add_scaled(acc_i, scores[t], values + t * st.v_slot, head_dim);
      }
      exp_sum[i] = exp_sum[i] * correction + sum;
      running_max[i] = new_max;
    }
  }
  for (int64_t i = 0; i < num_vectors; ++i) {
    scalar_t* dst = out + (task.first_row + i / group) * st.out_row +
                    (task.kv_head * group + i % group) * st.out_head;
    const float inv = 1.0f / exp_sum[i];
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i * head_dim + d] * inv);
  }
}

std::vector<Task> make_tasks(const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                             int64_t max_blocks, int64_t block_size, int64_t num_kv_heads) {
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    const int64_t seq_len = lens[s];
    TORCH_CHECK(query_len >= 0 && query_len <= seq_len, "sequence ", s, ": query_len ", query_len,
                " must be in [0, seq_len=", seq_len, "]");
    TORCH_CHECK((seq_len + block_size - 1) / block_size <= max_blocks, "block_tables: sequence ", s,
                " needs ", (seq_len + block_size - 1) / block_size, " blocks, the table has ", max_blocks);
    for (int64_t r = 0; r < query_len; r += kQueryTile) {
      const int64_t rows = std::min(kQueryTile, query_len - r);
      const int64_t first_position = seq_len - query_len + r;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back({s, h, starts[s] + r, rows, first_position, rows * (first_position + rows)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

}  // namespace

// out, q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
// head_dim]; block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
// seq_lens: [num_seqs] int32. The Python launcher checks shapes, dtypes and devices.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                     double scale) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<Task> tasks =
      make_tasks(query_start_loc, seq_lens, block_tables.size(1), block_size, num_kv_heads);
  const Strides st{q.stride(0),       q.stride(1),       out.stride(0),     out.stride(1),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
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
      std::atomic<int64_t> next{0};
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
        for (int64_t i = next++; i < num_tasks; i = next++) {
          attend<scalar_t, kHeadDim>(tasks[i], q_ptr, k_ptr, v_ptr, tables, out_ptr, st, group, head_dim,
                                     block_size, static_cast<float>(scale));
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a mixed batch, K/V read through block tables");
}
