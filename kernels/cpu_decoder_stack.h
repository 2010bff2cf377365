// A Llama-style decoder stack (Llama 2/3, Mistral, Qwen2) run as one call per step,
// float32 on CPU: the kernels the layers call one at a time from Python (kernels/cpu_*.h), called here in
// the same order with the same roundings, so the hidden states are bit-for-bit the layers' own. What it
// removes is the Python and dispatch between ~300 kernel calls a step (docs/BENCHMARKS.md, "Figures
// behind the code").
//
//   residual = embeddings                                   (the caller's tensor, updated in place)
//   per layer:  x = norm(residual)                           (after the first: residual += mlp_out first)
//               q | k | v = x Wqkv^T (+ b);  rotate q, k;  store k, v;  attn = paged_attention(q)
//               residual += attn Wo^T;  x = norm(residual)
//               mlp_out = (silu(x Wgate^T) * x Wup^T) Wdown^T
//   out = norm(residual + mlp_out)                          (the final norm)
//
// Weights are the layers' own packed panels (kernels/cpu_packed_linear.h), held by reference. A projection
// quantized with --quantization (engine/worker/layers/quantization.py) runs torch's int4 / int8 kernel
// instead on steps of up to its max_rows rows, with bf16 activations, as the layer does. The caller
// (kernels/cpu_decoder_stack.py) checks the step's tensors once; the ranges the kernels index are checked
// here, before any kernel runs.
//
// Threads: a stack without quantized projections runs the whole step in one OpenMP parallel region, as a
// team (kernels/cpu_team.h): each kernel takes this thread's share and the threads meet at a spinning
// barrier before the next, instead of a parallel region per kernel whose threads sleep and wake between
// them. torch's quantized kernels open regions of their own, so a stack with them keeps one per kernel. The
// shares differ, the results do not: every output element is computed the same way by whichever thread.
#pragma once
#include <torch/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <sched.h>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_packed_linear.h"
#include "cpu_paged_attention.h"
#include "cpu_rms_norm.h"
#include "cpu_rotary.h"
#include "cpu_silu_and_mul.h"
#include "cpu_team.h"

namespace sluice::stack {

// A projection's weight-only quantized form: (weight, scales, group_size, max_rows). int4 (group_size > 0):
// the weight packed for _weight_int4pack_mm_for_cpu and its scales_and_zeros; int8 (group_size 0): the
// [out, in] codes for _weight_int8pack_mm and the per-row scales.
using Quantized = std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t>;

struct Projection {
  torch::Tensor packed;  // panels for the float32 kernel
  std::optional<Quantized> quantized;
};

// y = x W^T (+ bias): the quantized kernel for steps of up to its max_rows rows, else the packed one. A
// team never meets a quantized projection (see the top of the file).
template <class ParallelFor>
void linear(const ParallelFor& parallel_for, torch::Tensor& y, const torch::Tensor& x, const Projection& w,
            const std::optional<torch::Tensor>& bias) {
  if constexpr (std::is_same_v<ParallelFor, sluice::AtenParallelFor>) {
    if (w.quantized) {
      const auto& [weight, scales, group_size, max_rows] = *w.quantized;
      if (x.size(0) <= max_rows) {
        const torch::Tensor activations = x.to(torch::kBFloat16);
        y.copy_(group_size > 0 ? at::_weight_int4pack_mm_for_cpu(activations, weight, group_size, scales)
                               : at::_weight_int8pack_mm(activations, weight, scales));
        if (bias) y.add_(*bias);
        return;
      }
    }
  }
  sluice::linear::packed_linear(parallel_for, y, x, w.packed, bias);
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  Projection qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;
  int64_t sliding_window;  // 0 for none
};

class DecoderStack {
 public:
  // Per layer i: input_norms[i], qkv[i], qkv_biases[i] (None: no bias), o[i], post_norms[i], gate_up[i],
  // down[i], sliding_windows[i] (0: none), quantized[i] (qkv, o, gate_up, down: each None or Quantized);
  // final_norm after the last layer. Sizes in elements.
  DecoderStack(const std::vector<torch::Tensor>& input_norms, const std::vector<torch::Tensor>& qkv,
               const std::vector<std::optional<torch::Tensor>>& qkv_biases, const std::vector<torch::Tensor>& o,
               const std::vector<torch::Tensor>& post_norms, const std::vector<torch::Tensor>& gate_up,
               const std::vector<torch::Tensor>& down, const std::vector<int64_t>& sliding_windows,
               const std::vector<std::vector<std::optional<Quantized>>>& quantized, torch::Tensor final_norm,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
               double scale)
      : final_norm_(std::move(final_norm)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        intermediate_size_(intermediate_size),
        eps_(eps),
        scale_(scale) {
    const size_t n = input_norms.size();
    TORCH_CHECK(n > 0, "DecoderStack: no layers");
    TORCH_CHECK(qkv.size() == n && qkv_biases.size() == n && o.size() == n && post_norms.size() == n &&
                    gate_up.size() == n && down.size() == n && sliding_windows.size() == n && quantized.size() == n,
                "DecoderStack: every weight list needs one entry per layer (", n, ")");
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(quantized[i].size() == 4, "DecoderStack: quantized[", i, "] needs qkv, o, gate_up and down");
      layers_.push_back({input_norms[i], post_norms[i], Projection{qkv[i], quantized[i][0]},
                         Projection{o[i], quantized[i][1]}, Projection{gate_up[i], quantized[i][2]},
                         Projection{down[i], quantized[i][3]}, qkv_biases[i], sliding_windows[i]});
      TORCH_CHECK(sliding_windows[i] >= 0, "sliding_windows[", i, "]: must be >= 0 (0 for none)");
      for (const auto& projection : quantized[i]) quantized_ = quantized_ || projection.has_value();
    }
    team_ = !quantized_;
  }

  bool team() const { return team_; }

  // false: a parallel region per kernel, the team's baseline (benchmarks/engine/cpu_team.py).
  void set_team(bool team) {
    TORCH_CHECK(!team || !quantized_, "team: a stack with quantized projections runs a parallel region per kernel");
    team_ = team;
  }

  // residual [T, hidden] (the embeddings; overwritten with the residual stream) -> the final norm's output
  // [T, hidden]. positions [T] int64; cos_sin [max_position, head_dim]; k_caches[i], v_caches[i]: layer i's
  // [num_blocks, block_size, num_kv_heads, head_dim]; the rest as AttentionMetadata.
  torch::Tensor forward(torch::Tensor residual, const torch::Tensor& positions, const torch::Tensor& cos_sin,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens) const {
    const int64_t hidden = final_norm_.size(0);
    TORCH_CHECK(residual.scalar_type() == torch::kFloat && residual.dim() == 2 && residual.size(1) == hidden &&
                    residual.is_contiguous(),
                "embeddings: must be a contiguous float32 [num_tokens, ", hidden, "] tensor");
    const int64_t num_tokens = residual.size(0);
    check_step(num_tokens, positions, cos_sin, k_caches, v_caches, block_tables, query_start_loc, seq_lens);
    sluice::attention::check_slots(slot_mapping, k_caches[0]);  // every cache has layer 0's shape (check_step)
    const Tasks tasks = attention_tasks(query_start_loc, seq_lens, block_tables.size(1), k_caches[0].size(1));
    for (const auto& [window, _] : tasks)  // each window the layers read (0: every block)
      sluice::attention::check_block_ids(block_tables, query_start_loc, seq_lens, k_caches[0].size(1),
                                         k_caches[0].size(0), window);
    const Step step{residual, positions, cos_sin, k_caches, v_caches, slot_mapping, block_tables, tasks};
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const auto options = residual.options();
    Buffers buffers;
    buffers.normed = torch::empty_like(residual);
    buffers.mlp_out = torch::empty_like(residual);
    buffers.qkv = torch::empty({num_tokens, q_size + 2 * kv_size}, options);
    buffers.attn = torch::empty({num_tokens, num_heads_, head_dim_}, options);
    buffers.gate_up = torch::empty({num_tokens, 2 * intermediate_size_}, options);
    buffers.act = torch::empty({num_tokens, intermediate_size_}, options);
    buffers.q = buffers.qkv.narrow(1, 0, q_size).view({num_tokens, num_heads_, head_dim_});
    buffers.k = buffers.qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads_, head_dim_});
    buffers.v = buffers.qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads_, head_dim_});
    buffers.attn_rows = buffers.attn.view({num_tokens, q_size});
    buffers.next_task = std::make_unique<std::atomic<int64_t>[]>(layers_.size());  // all 0
    if (!team_) {
      run_layers(sluice::AtenParallelFor{}, step, buffers);
    } else {
      sluice::team::run_team([&](const sluice::team::Team& team) { run_layers(team, step, buffers); });
    }
    return buffers.normed;
  }

 private:
  using Tasks = std::map<int64_t, std::vector<sluice::attention::Task>>;  // sliding window -> attention tasks

  // A step's inputs, as forward was given them.
  struct Step {
    torch::Tensor& residual;
    const torch::Tensor& positions;
    const torch::Tensor& cos_sin;
    const std::vector<torch::Tensor>& k_caches;
    const std::vector<torch::Tensor>& v_caches;
    const torch::Tensor& slot_mapping;
    const torch::Tensor& block_tables;
    const Tasks& tasks;
  };

  // The attention tasks of each sliding window the layers use, once a step (make_tasks checks the rows
  // against seq_lens and the block tables' width).
  Tasks attention_tasks(const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, int64_t max_blocks,
                        int64_t block_size) const {
    Tasks tasks;
    for (const Layer& layer : layers_)
      if (tasks.count(layer.sliding_window) == 0)
        tasks[layer.sliding_window] = sluice::attention::make_tasks(query_start_loc, seq_lens, max_blocks, block_size,
                                                                    num_kv_heads_, layer.sliding_window);
    return tasks;
  }

  // A step's intermediate tensors, shared by the threads; next_task: each layer's attention task counter.
  struct Buffers {
    torch::Tensor normed, mlp_out, qkv, attn, gate_up, act;
    torch::Tensor q, k, v, attn_rows;  // views of qkv and attn
    std::unique_ptr<std::atomic<int64_t>[]> next_task;
  };

  // Every layer and the final norm, each kernel split among threads by parallel_for (cpu_team.h).
  template <class ParallelFor>
  void run_layers(const ParallelFor& parallel_for, const Step& step, Buffers& b) const {
    torch::Tensor& residual = step.residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        sluice::norm::rms_norm(parallel_for, b.normed, residual, residual, std::nullopt, layer.input_norm, eps_);
      } else {
        sluice::norm::rms_norm(parallel_for, b.normed, residual, b.mlp_out, residual, layer.input_norm, eps_);
      }
      linear(parallel_for, b.qkv, b.normed, layer.qkv, layer.qkv_bias);
      // Each token's keys are stored once rotated, by the thread that rotated them.
      parallel_for(0, residual.size(0), sluice::rotary::kTokenGrain, [&](int64_t begin, int64_t end) {
        sluice::rotary::rotate_tokens(b.q, b.k, step.positions, step.cos_sin, begin, end);
        sluice::attention::store_kv_rows(b.k, b.v, step.k_caches[i], step.v_caches[i], step.slot_mapping, begin,
                                         end);
      });
      sluice::attention::run_tasks(parallel_for, b.next_task[i], step.tasks.at(layer.sliding_window), b.attn, b.q,
                                   step.k_caches[i], step.v_caches[i], step.block_tables, scale_);
      linear(parallel_for, b.mlp_out, b.attn_rows, layer.o, std::nullopt);
      sluice::norm::rms_norm(parallel_for, b.normed, residual, b.mlp_out, residual, layer.post_norm, eps_);
      linear(parallel_for, b.gate_up, b.normed, layer.gate_up, std::nullopt);
      sluice::activation::silu_and_mul(parallel_for, b.act, b.gate_up);
      linear(parallel_for, b.mlp_out, b.act, layer.down, std::nullopt);
    }
    sluice::norm::rms_norm(parallel_for, b.normed, residual, b.mlp_out, residual, final_norm_, eps_);
  }

  // What the kernels below index with and do not check themselves (their Python launchers would, per call).
  void check_step(int64_t num_tokens, const torch::Tensor& positions, const torch::Tensor& cos_sin,
                  const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                  const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                  const torch::Tensor& seq_lens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "kv_caches: ", k_caches.size(),
                " for ", layers_.size(), " layers");
    for (const auto* caches : {&k_caches, &v_caches})
      for (const torch::Tensor& cache : *caches)
        TORCH_CHECK(cache.scalar_type() == torch::kFloat && cache.dim() == 4 && cache.size(2) == num_kv_heads_ &&
                        cache.size(3) == head_dim_ && cache.stride(3) == 1 &&
                        cache.sizes() == k_caches[0].sizes(),
                    "kv_caches: each must be a float32 [num_blocks, block_size, ", num_kv_heads_, ", ", head_dim_,
                    "] tensor with unit stride on head_dim, all of one shape");
    TORCH_CHECK(positions.numel() == num_tokens && positions.is_contiguous(), "positions: ", positions.numel(), " for ",
                num_tokens, " tokens");
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t)  // the rotary kernel indexes its table with them
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "positions: ", pos[t], " (token ", t,
                  ") is outside the rotary table's ", cos_sin.size(0), " rows");
    const int64_t num_seqs = seq_lens.numel();
    TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && query_start_loc.is_contiguous() &&
                    seq_lens.is_contiguous() && block_tables.size(0) >= num_seqs,
                "query_start_loc, seq_lens, block_tables: ", num_seqs + 1, ", ", num_seqs, " and >= ", num_seqs,
                " contiguous rows expected");
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    for (int64_t s = 0; s < num_seqs; ++s)
      TORCH_CHECK(starts[s] >= 0 && starts[s] <= starts[s + 1], "query_start_loc: must not decrease");
    TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens, "query_start_loc: must run from 0 to ", num_tokens);
  }

  std::vector<Layer> layers_;
  bool quantized_ = false;  // any projection
  bool team_ = true;        // a step as one team; else one parallel region per kernel (always when quantized_)
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_size_;
  double eps_, scale_;
};

// The team's barrier on its own (for the tests): `rounds` rounds on at::get_num_threads() threads, each adding
// 1 to a shared count and then, past a barrier, checking it holds every thread's addition (none ran ahead).
// Returns how many of those checks failed (0); with failing_thread >= 0, that thread throws in round
// rounds / 2, which must end the region and come back as the error.
inline int64_t team_barrier_check(int64_t rounds, int64_t failing_thread) {
  std::atomic<int64_t> count{0}, failed{0};
  sluice::team::run_team([&](const sluice::team::Team& team) {
    for (int64_t round = 0; round < rounds; ++round) {
      TORCH_CHECK(!(round == rounds / 2 && team.thread() == failing_thread), "thread ", failing_thread,
                  " failed in round ", round);
      count.fetch_add(1);
      team.sync();
      if (count.load() != (round + 1) * team.threads()) failed.fetch_add(1);
      team.sync();
    }
  });
  return failed.load();
}

// The team's barrier with its threads pinned (for the tests): each thread pins itself to a CPU this process
// may run on (the first one for every thread if one_cpu, else one of its own), goes through `rounds`
// barriers, and is given back its CPUs. Returns how many of the waits spun. With one CPU, at most the
// first round's, before any thread has been seen on it (a waiter that spins would hold the CPU its partner
// needs to arrive); with a CPU each, every wait but the last arriver's.
inline int64_t team_spun_waits(int64_t rounds, bool one_cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  TORCH_CHECK(sched_getaffinity(0, sizeof(allowed), &allowed) == 0, "sched_getaffinity failed");
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  TORCH_CHECK(one_cpu || static_cast<int64_t>(cpus.size()) >= at::get_num_threads(), "team_spun_waits: ",
              at::get_num_threads(), " threads, ", cpus.size(), " CPUs to pin them to");
  std::atomic<int64_t> spun{0};
  sluice::team::run_team([&](const sluice::team::Team& team) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[one_cpu ? 0 : team.thread()], &one);
    TORCH_CHECK(sched_setaffinity(0, sizeof(one), &one) == 0, "sched_setaffinity failed");
    for (int64_t round = 0; round < rounds; ++round) team.sync();
    spun.fetch_add(team.spun_waits());
    TORCH_CHECK(sched_setaffinity(0, sizeof(allowed), &allowed) == 0, "sched_setaffinity failed");
  });
  return spun.load();
}

}  // namespace sluice::stack
