// The kernels' own thread pool: workers that spin while a pass runs and sleep between passes.
//
// Why not OpenMP: Parrot runs torch with OMP_WAIT_POLICY=PASSIVE (spinning threads starved
// neighbouring processes on 2-core machines; README, "Choices, measured"), and the kernels share
// torch's OpenMP runtime. With passive threads every parallel region wakes its threads through
// the kernel (a futex), and a decoding pass has about five regions per layer: on the embedded
// model that doubled the cost of a one-token pass. Here a worker spins for SPIN_NS after its
// last job, so the regions of one pass follow each other without a system call, then sleeps.
// Short: between passes the engine's Python and the HTTP thread need the core (with 0.2 ms of
// spinning, a served token took 14 ms against 11 with 30 us, AVX2 machine).
//
// parallel_for(count, f) calls f(i) for i in [0, count), split into contiguous equal shares, one
// per thread, the caller taking the first. Which thread runs an index never changes a result
// here: every kernel writes each output from its own fixed sequence of operations.

#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }
#else
inline void cpu_relax() {}
#endif

class Pool {
 public:
  static constexpr int64_t SPIN_NS = 30000;  // 30 us: longer than the gaps inside a pass

  explicit Pool(int threads) : threads_(threads < 1 ? 1 : threads) {
    for (int id = 1; id < threads_; ++id) workers_.emplace_back([this, id] { work(id); });
  }

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return threads_; }

  template <class F>
  void parallel_for(int64_t count, F&& f) {
    if (threads_ == 1 || count <= 1) {
      for (int64_t i = 0; i < count; ++i) f(i);
      return;
    }
    // One job at a time; a caller that finds the pool busy (another Python thread) runs alone.
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock()) {
      for (int64_t i = 0; i < count; ++i) f(i);
      return;
    }
    auto share = [&](int id) {
      const int64_t begin = count * id / threads_, end = count * (id + 1) / threads_;
      for (int64_t i = begin; i < end; ++i) f(i);
    };
    job_ = [](void* ctx, int id) { (*static_cast<decltype(share)*>(ctx))(id); };
    ctx_ = &share;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();  // a system call only when a worker sleeps
    share(0);
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
  }

 private:
  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = epoch_.load(std::memory_order_acquire);
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; now == seen; now = epoch_.load(std::memory_order_acquire)) {
        if (++spins % 256 == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(SPIN_NS)) {
          epoch_.wait(seen, std::memory_order_acquire);  // sleep until the next job
        } else {
          cpu_relax();
        }
      }
      seen = now;
      job_(ctx_, id);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  void (*job_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
};

// The pool for `threads` threads, made on first use and kept for the life of the process (its
// workers sleep when idle; a pool is never destroyed, so no thread can be left using it).
inline Pool& pool(int threads) {
  static std::mutex guard;
  static std::vector<Pool*> pools;
  std::lock_guard<std::mutex> lock(guard);
  for (Pool* p : pools)
    if (p->threads() == (threads < 1 ? 1 : threads)) return *p;
  pools.push_back(new Pool(threads));
  return *pools.back();
}
