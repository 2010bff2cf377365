// How the C++ CPU kernels share their work among threads: a policy with the call of at::parallel_for,
//
//   parallel_for(begin, end, grain, f)    f(b, e) on the calling thread's share(s) of [begin, end)
//   parallel_for.threads()                 the threads that split it
//
// AtenParallelFor is at::parallel_for itself: one OpenMP parallel region per call, for kernels called one
// at a time from Python. A Team is one thread of a parallel region that runs a whole sequence of kernels
// (the decoder stack's step, `run_team`): each call takes this thread's share, split as at::parallel_for
// splits it, then waits at a barrier for the rest of the team, so the next kernel sees every result.
//
// Why the decoder stack needs it: its ~150 parallel regions a decode step follow each other within
// microseconds, but libgomp's wait between regions is spin-then-sleep, and the engine core spins only
// briefly (GOMP_SPINCOUNT=1000, ~20 us: engine/process/threads.py) so that its threads do not hold the cores
// between steps. A region that ends a little unevenly then puts one thread to sleep, its wake-up makes it
// late for the next region, where the other thread sleeps in turn: a ping-pong of futex sleeps through the
// step (18 sleeps a batch-1 token on a 2-core VM; 3 with the team: docs/BENCHMARKS.md). The team's barrier
// spins longer (kSpin) and only inside the step; between steps the pool sleeps as before.
#pragma once
#include <torch/types.h>

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>

namespace sluice {

struct AtenParallelFor {
  int64_t threads() const { return at::get_num_threads(); }

  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    at::parallel_for(begin, end, grain, f);
  }
};

namespace team {

// How long a thread at the barrier spins before it sleeps. Longer than a kernel's uneven end or a wake-up
// (tens of microseconds) and than the frontend's or a client's burst that displaces a partner on a server
// (a spin of 200 us ran out after ~0.7 ms of such a wait: the waiter's CPU then sat idle until its partner
// came back; 1 ms served 2-4% more tokens at 16 streams on 2 cores, offline steps the same:
// docs/BENCHMARKS.md; ~1.5% fewer beside another process that keeps one of the two CPUs busy), short
// against a preempted partner's time slice (milliseconds on a busy machine).
// A team larger than the processors it may run on does not spin at all (as libgomp throttles its own spin
// then): the thread it waits for may be waiting for its core (4 threads on 2 cores ran 2.4x slower with
// the spin than a region per kernel).
constexpr auto kSpin = std::chrono::microseconds(1000);

// Thrown out of Barrier::wait in the other threads once one thread's kernel threw: they leave the team.
struct Aborted {};

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A central barrier for the threads of one parallel region: spin up to kSpin, then sleep on a futex; but
// never spin for a thread that was last seen on the waiter's own CPU. Two threads of a team can end up on
// one CPU (the scheduler places a woken thread beside its waker when the other CPU is busy, say with the
// server's frontend, and is slow to move either back while both look busy): a spinning waiter then holds
// the CPU its partner needs, each wait costs the whole spin, and the pair crawl through the step's kernels
// taking turns while the other CPU may sit idle (perf sched on a 2-core server at 16 concurrent streams:
// 5% of the core's CPU time so spent). Sleeping at once gives the partner the CPU, and a thread woken from
// a sleep goes to an idle CPU if there is one (docs/BENCHMARKS.md, "Team threads on one CPU").
class Barrier {
 public:
  explicit Barrier(int threads) : seats_(std::make_unique<Seat[]>(threads)), seats_size_(threads) {}

  // Every thread of the region calls this, with the region's size, before its first wait.
  void join(int threads) {
    threads_.store(threads, std::memory_order_relaxed);
    spin_.store(threads <= omp_get_num_procs(), std::memory_order_relaxed);
  }

  // For thread `thread` of the region.
  void wait(int thread) {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (aborted_.load(std::memory_order_acquire)) throw Aborted{};
    const int cpu = sched_getcpu();  // -1 if unknown
    seats_[thread].cpu.store(cpu, std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_.load(std::memory_order_relaxed)) {
      arrived_.store(0, std::memory_order_relaxed);  // seen before the next generation by every waiter
      release_all();
      return;
    }
    wait_for_next(generation, thread, cpu);
    if (aborted_.load(std::memory_order_acquire)) throw Aborted{};
  }

  // Releases every waiter (now and to come) with Aborted.
  void abort() {
    aborted_.store(true, std::memory_order_release);
    release_all();
  }

  // How many of thread `thread`'s waits spun (for the tests).
  int64_t spun_waits(int thread) const { return seats_[thread].spun_waits; }

 private:
  // A thread's own line: the CPU it was on when it last arrived (read by the others), its spun waits.
  struct alignas(64) Seat {
    std::atomic<int> cpu{-1};
    int64_t spun_waits = 0;
  };

  void release_all() {
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  // Whether another thread of the team arrived last on `cpu` (as of its last arrival: it may have moved).
  bool shares_cpu(int thread, int cpu) const {
    if (cpu < 0) return false;
    for (int other = 0; other < seats_size_; ++other)
      if (other != thread && seats_[other].cpu.load(std::memory_order_relaxed) == cpu) return true;
    return false;
  }

  void wait_for_next(uint32_t generation, int thread, int cpu) {
    if (spin_.load(std::memory_order_relaxed) && !shares_cpu(thread, cpu)) {
      ++seats_[thread].spun_waits;
      const auto deadline = std::chrono::steady_clock::now() + kSpin;
      for (int spins = 1; generation_.load(std::memory_order_acquire) == generation; ++spins) {
        pause();
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
      }
    }
    // A sleeper counts itself before it checks the generation, the releaser bumps the generation before it
    // reads the count (both sequentially consistent): one of them sees the other, so no wake-up is lost.
    while (generation_.load(std::memory_order_acquire) == generation) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == generation)
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr,
                nullptr, 0);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::atomic<uint32_t> generation_{0};
  std::atomic<int> arrived_{0};
  std::atomic<int> threads_{1};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> spin_{true};  // false: a team larger than the processors (kSpin)
  std::unique_ptr<Seat[]> seats_;
  int seats_size_;
};

// This thread's part of a team: the AtenParallelFor policy inside one parallel region.
class Team {
 public:
  Team(Barrier& barrier, int thread, int threads) : barrier_(barrier), thread_(thread), threads_(threads) {}

  int64_t thread() const { return thread_; }
  int64_t threads() const { return threads_; }

  // f on this thread's chunk of [begin, end), the chunks as at::parallel_for's (at most one per thread,
  // ceil(n / threads) long, no more threads than ceil(n / grain)); then waits for the team.
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    const int64_t n = end - begin;
    if (n > 0) {
      const int64_t used = std::min<int64_t>(threads_, at::divup(n, std::max<int64_t>(grain, 1)));
      const int64_t chunk = at::divup(n, used);
      const int64_t first = begin + thread_ * chunk;
      if (thread_ < used && first < end) f(first, std::min(end, first + chunk));
    }
    sync();
  }

  // Waits until every thread of the team has called it.
  void sync() const { barrier_.wait(static_cast<int>(thread_)); }

  // How many of this thread's waits spun before they slept (for the tests).
  int64_t spun_waits() const { return barrier_.spun_waits(static_cast<int>(thread_)); }

 private:
  Barrier& barrier_;
  int64_t thread_, threads_;
};

// body(team) on every thread of one OpenMP parallel region of at::get_num_threads() threads. The first
// exception a thread throws releases the others from their barriers and is rethrown here, after the region.
template <class Body>
void run_team(const Body& body) {
  const int threads = at::get_num_threads();  // read once: the barrier has a seat for each
  Barrier barrier(threads);
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
  {
    barrier.join(omp_get_num_threads());
    try {
      body(Team(barrier, omp_get_thread_num(), omp_get_num_threads()));
    } catch (const Aborted&) {
    } catch (...) {
      {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      barrier.abort();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace team
}  // namespace sluice
