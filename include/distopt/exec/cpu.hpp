// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/function_ref.hpp"

namespace distopt {

namespace detail {

/// A job of the thread pool: f(begin, end) over a run of items.
using range_job = function_ref<void(std::size_t, std::size_t)>;

/// A fixed set of worker threads that run one job at a time. A job is n items: the
/// caller's thread and the workers claim runs of `grain` consecutive items from a shared
/// counter until none is left, and the caller returns once every item is done. It does not
/// wait for a worker that has not started: when another program's threads hold the cores
/// (a BLAS library's workers spin for a while after each call, as OpenBLAS's do), the caller
/// does the items itself instead of waiting for the scheduler to run a worker. It waits only
/// for a worker caught between joining the job and finding it closed (a few instructions).
///
/// Waits spin for up to spin_time before they block: a step is a few jobs a few
/// microseconds apart, and waking a thread blocked on a condition variable takes tens of
/// microseconds (more than a whole 500 k-parameter pass). Between steps the workers block,
/// so they leave the cores to the training code.
class thread_pool {
 public:
  static constexpr std::chrono::microseconds spin_time{50};

  explicit thread_pool(int threads);
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool();

  int size() const noexcept { return n_; }

  /// Calls f(begin, end) over runs of at most `grain` items that cover [0, n) once, on the
  /// caller's thread and the workers; rethrows the first exception once all are done.
  void run(std::size_t n, std::size_t grain, range_job f);

 private:
  void work();
  /// Claims and runs runs of items of the open job until none is left.
  void claim();
  /// Spins until ready() or spin_time has passed; returns ready().
  template <class Ready>
  static bool spin_until(Ready ready);

  int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  // The open job: set under mutex_ before open_ is raised, read by the threads inside it.
  const range_job* job_ = nullptr;
  std::size_t items_ = 0, grain_ = 1;
  std::atomic<std::size_t> next_{0};      ///< the first item not yet claimed
  std::atomic<std::size_t> finished_{0};  ///< items done
  std::atomic<bool> open_{false};         ///< a worker may join the job
  std::atomic<int> inside_{0};            ///< workers that may still read the job
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
};

template <class Ready>
bool thread_pool::spin_until(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + spin_time;
  for (unsigned i = 1;; ++i) {
    if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
    if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return ready();
  }
}

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN thread_pool::thread_pool(int threads) : n_(threads) {
  for (int t = 1; t < n_; ++t) workers_.emplace_back([this] { work(); });
}

DISTOPT_CORE_FN thread_pool::~thread_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  start_.notify_all();
  for (auto& w : workers_) w.join();
}

DISTOPT_CORE_FN void thread_pool::run(std::size_t n, std::size_t grain, range_job f) {
  if (n == 0) return;
  if (n_ == 1) return f(0, n);
  std::lock_guard one_job(run_mutex_);  // copies of an executor share the pool
  {
    // Under the mutex, so that a worker about to block sees the new generation or is
    // woken by the notify below.
    std::lock_guard lock(mutex_);
    job_ = &f;
    items_ = n;
    grain_ = std::max<std::size_t>(grain, 1);
    error_ = nullptr;
    next_.store(0, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    open_.store(true);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_.notify_all();
  claim();
  const auto done = [&] { return finished_.load(std::memory_order_acquire) == n; };
  if (!spin_until(done)) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, done);
  }
  // Every item is done; close the job and wait for the workers still inside it. They claim
  // nothing more and leave at once. A worker that comes later sees the job closed: its
  // increment of inside_ and this store are sequentially consistent.
  open_.store(false);
  const auto left = [&] { return inside_.load() == 0; };
  while (!spin_until(left)) std::this_thread::yield();  // one preempted between two loads
  std::lock_guard lock(mutex_);
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

DISTOPT_CORE_FN void thread_pool::claim() {
  for (;;) {
    const std::size_t begin = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (begin >= items_) return;
    const std::size_t end = std::min(begin + grain_, items_);
    try {
      (*job_)(begin, end);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    if (finished_.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == items_) {
      // The caller checks finished_ under the mutex before it blocks: taking the mutex here
      // makes sure it is either not yet checking or already waiting for this notify.
      { std::lock_guard lock(mutex_); }
      done_.notify_one();
    }
  }
}

DISTOPT_CORE_FN void thread_pool::work() {
  std::uint64_t seen = 0;
  const auto woken = [&] {
    return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
  };
  for (;;) {
    if (!spin_until(woken)) {
      std::unique_lock lock(mutex_);
      start_.wait(lock, woken);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    inside_.fetch_add(1);
    if (open_.load()) claim();
    inside_.fetch_sub(1);
  }
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace detail

/// The CPU executor: host memory, items claimed in runs of consecutive items by a fixed
/// number of threads. Loops inside an item are plain contiguous loops the compiler vectorises.
class cpu {
 public:
  using executor_concept = executor_tag;
  using memory_space = host_space;

  /// One thread, the caller's: no pool (so that a default-constructed executor, as an
  /// empty buffer keeps one, costs nothing).
  cpu() noexcept = default;
  /// `threads` worker threads (including the caller's); 0 means one per hardware thread.
  explicit cpu(int threads);

  /// The number of threads items are spread over.
  int concurrency() const noexcept { return pool_ ? pool_->size() : 1; }

  /// 64-byte aligned, zero-filled host memory.
  void* allocate_bytes(std::size_t bytes) {
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = ::operator new(rounded, std::align_val_t{64});
    std::fill_n(static_cast<unsigned char*>(p), rounded, 0);
    return p;
  }
  void deallocate_bytes(void* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }

  /// Calls f(i) once for each i in [0, n), over the pool's threads: each claims runs of
  /// about n / (4 x threads) consecutive items until none is left (so a thread the OS does
  /// not run in time leaves its share to the others).
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    const auto threads = static_cast<std::size_t>(concurrency());
    if (n == 0) return;
    if (threads == 1 || n == 1) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    const auto items = [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) f(i);
    };
    pool_->run(n, n / (4 * threads), items);
  }

 private:
  std::shared_ptr<detail::thread_pool> pool_;  // none with one thread
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN cpu::cpu(int threads) {
  if (threads < 0)
    throw std::invalid_argument("distopt::cpu: threads must be >= 0 (0 = one per core), got " +
                                std::to_string(threads));
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (threads > 1) pool_ = std::make_shared<detail::thread_pool>(threads);  // one thread needs none
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt
