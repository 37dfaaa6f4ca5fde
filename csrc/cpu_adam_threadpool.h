// Persistent worker pool for the CPU Adam kernel (no OpenMP: torch ships its own libgomp).
//
// One job at a time: run(ntasks, fn, ctx) calls fn(ctx, i) for i in [0, ntasks); the calling
// thread runs task 0 itself and the workers run the others (idle workers just acknowledge). Workers are created once and
// reused, never per call. Between jobs a worker spins (with pause) for a short while, then
// sleeps on a condition variable: waking a sleeping thread takes milliseconds on some VMs,
// which would serialize back-to-back optimizer steps; like libgomp's default wait policy, the
// short spin keeps consecutive calls parallel. After fork() the child gets a fresh pool on
// first use (the parent's threads do not exist there).
#pragma once
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace inf_cpu {

using TaskFn = void (*)(void* ctx, int task);

class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs fn(ctx, 0..ntasks-1) and returns when all are done. Serialized across callers.
  void run(int ntasks, TaskFn fn, void* ctx) {
    if (ntasks <= 1) {
      fn(ctx, 0);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);
    ensure_workers(ntasks - 1);
    fn_ = fn;
    ctx_ = ctx;
    ntasks_ = ntasks;
    // Every worker acknowledges every job (idle ones just count down), so none can still be
    // reading this job's description when the next run() rewrites it.
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1);  // seq_cst: publishes the job (Dekker pair with sleepers_)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_work_.notify_all();
    }
    fn(ctx, 0);
    if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(mu_);
      caller_sleeping_.store(true);
      cv_done_.wait(lk, [this] { return pending_.load() == 0; });
      caller_sleeping_.store(false);
    }
  }

 private:
  static constexpr std::chrono::microseconds kSpin{2000};

  template <typename Pred>
  static bool spin_until(Pred pred) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (unsigned i = 1;; ++i) {
      if (pred()) return true;
      _mm_pause();
      if ((i & 255u) == 0) {
        if (std::chrono::steady_clock::now() > deadline) return pred();
        sched_yield();  // let other runnable threads in when the CPUs are oversubscribed
      }
    }
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size()) + 1;  // task 0 is the caller's
      const uint64_t start_generation = generation_.load();  // no job running (run_mu_ held)
      workers_.emplace_back([this, index, start_generation] {
        worker_loop(index, start_generation);
      });
      workers_.back().detach();  // the pool lives until process exit
    }
  }

  void worker_loop(int index, uint64_t seen) {
    for (;;) {
      auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_work_.wait(lk, fresh);
        sleepers_.fetch_sub(1);
      }
      seen = generation_.load();
      if (index < ntasks_) fn_(ctx_, index);
      if (pending_.fetch_sub(1) == 1 && caller_sleeping_.load()) {
        std::lock_guard<std::mutex> lk(mu_);
        cv_done_.notify_one();
      }
    }
  }

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards the sleeping paths only
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_sleeping_{false};
  // Job description: written before generation_ is bumped, read after it is observed.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int ntasks_ = 0;
};

// Number of CPUs this process may run on (its affinity mask), at least 1.
inline int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

}  // namespace inf_cpu
