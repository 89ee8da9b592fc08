// The kernels' own thread pool: workers that spin while a pass runs and sleep between passes.
//
// Why not OpenMP: Parrot runs torch with OMP_WAIT_POLICY=PASSIVE (spinning threads starved
// neighbouring processes on 2-core machines; docs/ARCHITECTURE.md, "Choices, measured"), and the kernels share
// torch's OpenMP runtime. With passive threads every parallel region wakes its threads through
// the kernel (a futex), and a decoding pass has about five regions per layer: on the embedded
// model that doubled the cost of a one-token pass. Here a worker spins while a pass holds the pool
// (Hold) and for SPIN_NS after its last job, so the regions of one pass follow each other without
// a system call, then sleeps.
// Short: between passes the engine's Python and the HTTP thread need the core (with 0.2 ms of
// spinning, a served token took 14 ms against 11 with 30 us, AVX2 machine).
//
// parallel_for(count, f, shares) calls f(i) for i in [0, count), split into `shares` contiguous
// equal shares (default: one per thread) that the threads claim in order, each taking the next
// unclaimed one when done with its last. The caller runs the first share, then claims like the
// workers: a worker that the OS has not scheduled (a busy neighbour process holds its core, or it
// sleeps and wakes late) never holds the pass up, and with more shares than threads a thread that
// started late or reads slower memory takes fewer of them instead of keeping the others waiting. Waiting for it instead made an 8-token pass take 0.58 s against
// 0.02 s while a niced process kept one of 2 cores busy. Which thread runs a share never changes a
// result here: every kernel writes each output from its own fixed sequence of operations.

#pragma once

#include <algorithm>
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
    for (int id = 1; id < threads_; ++id) workers_.emplace_back([this] { work(); });
  }

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return threads_; }

  // While a Hold lives (a forward pass), workers spin between jobs however long the gap, instead
  // of sleeping after SPIN_NS: a layer's jobs can be further apart than that (the caller running
  // the last share of a layer), and a sleeping worker costs the next job a wake-up.
  class Hold {
   public:
    explicit Hold(Pool& p) : p_(p) { p_.held_.fetch_add(1, std::memory_order_relaxed); }
    ~Hold() { p_.held_.fetch_sub(1, std::memory_order_relaxed); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    Pool& p_;
  };

  template <class F>
  void parallel_for(int64_t count, F&& f, int64_t shares = 0) {
    shares = std::min<int64_t>(std::max<int64_t>(shares > 0 ? shares : threads_, 1), std::min<int64_t>(count, 0xffff));
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
    auto share = [&](int64_t id) {
      const int64_t begin = count * id / shares, end = count * (id + 1) / shares;
      for (int64_t i = begin; i < end; ++i) f(i);
    };
    job_ = [](void* ctx, int64_t id) { (*static_cast<decltype(share)*>(ctx))(id); };
    ctx_ = &share;
    done_.store(0, std::memory_order_relaxed);
    // Publish the job: its epoch in the high bits, then its number of shares, then the next
    // unclaimed share (1), so that a claim always compares against its own job's count.
    const uint64_t epoch = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(epoch << 32 | (uint64_t)shares << 16 | 1, std::memory_order_release);
    claim_.notify_all();  // a system call only when a worker sleeps
    share(0);
    int64_t mine = 0;  // shares after the first that this thread ran
    for (int64_t id; (id = claim(epoch)) >= 0; ++mine) share(id);
    while (done_.load(std::memory_order_acquire) != shares - 1 - mine) cpu_relax();
  }

 private:
  // The next unclaimed share of job `epoch` for the calling thread, or -1 when none is left.
  int64_t claim(uint64_t epoch) {
    uint64_t now = claim_.load(std::memory_order_acquire);
    while ((now >> 32) == epoch && (now & 0xffff) < ((now >> 16) & 0xffff)) {
      if (claim_.compare_exchange_weak(now, now + 1, std::memory_order_acq_rel)) return (int64_t)(now & 0xffff);
    }
    return -1;
  }

  void work() {
    uint64_t seen = 0;  // the last epoch this worker looked at
    for (;;) {
      uint64_t now = claim_.load(std::memory_order_acquire);
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; (now >> 32) == seen; now = claim_.load(std::memory_order_acquire)) {
        if (++spins % 256 == 0 && held_.load(std::memory_order_relaxed) == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(SPIN_NS)) {
          claim_.wait(now, std::memory_order_acquire);  // sleep until the next job
        } else {
          cpu_relax();
        }
      }
      seen = now >> 32;
      // job_ and ctx_ belong to epoch `seen` while one of its shares is claimed and not done:
      // the caller does not start the next job before every share is done.
      for (int64_t id; (id = claim(seen)) >= 0;) {
        job_(ctx_, id);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;
  std::atomic<uint64_t> claim_{0};  // epoch << 32 | shares << 16 | next unclaimed share
  std::atomic<int64_t> done_{0};     // shares done by workers in this epoch
  std::atomic<int> held_{0};         // Holds alive
  void (*job_)(void*, int64_t) = nullptr;
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

// Rows 0 .. M - 1 through f(i): on the pool's threads from PARALLEL_ROWS rows (prompt chunks),
// in this thread below (a decoding or verifying pass, where a hand-off costs more than the row
// work). Each row's arithmetic is its own, so the split changes no result. Run in this thread,
// the norms, activations, residuals and biases of a 400-token chunk took about 5% of its time
// with the other core idle (perf, Qwen2.5-Coder-1.5B, avx2 set, Intel Xeon).
constexpr int64_t PARALLEL_ROWS = 16;
template <class F>
void for_rows(int64_t M, int threads, F&& f) {
  if (M < PARALLEL_ROWS) {
    for (int64_t i = 0; i < M; ++i) f(i);
  } else {
    pool(threads).parallel_for(M, f);
  }
}
