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
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"

namespace distopt {

namespace detail {

/// A fixed set of worker threads that run one job at a time, each worker taking a fixed
/// contiguous slice of the items; the caller's thread takes the first slice.
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

  /// Runs job(t) for t in [0, size()) on the pool; rethrows the first exception.
  void run(const std::function<void(int)>& job);

 private:
  void work(int t);
  /// Spins until ready() or spin_time has passed; returns ready().
  template <class Ready>
  static bool spin_until(Ready ready);

  int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<int> pending_{0};
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
  for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { work(t); });
}

DISTOPT_CORE_FN thread_pool::~thread_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  start_.notify_all();
  for (auto& w : workers_) w.join();
}

DISTOPT_CORE_FN void thread_pool::run(const std::function<void(int)>& job) {
  if (n_ == 1) return job(0);
  std::lock_guard one_job(run_mutex_);  // copies of an executor share the pool
  {
    // Under the mutex, so that a worker about to block sees the new generation or is
    // woken by the notify below.
    std::lock_guard lock(mutex_);
    job_ = &job;
    error_ = nullptr;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  start_.notify_all();
  std::exception_ptr mine;
  try {
    job(0);
  } catch (...) {
    mine = std::current_exception();
  }
  const auto done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done)) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, done);
  }
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

DISTOPT_CORE_FN void thread_pool::work(int t) {
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
    std::exception_ptr err;
    try {
      (*job_)(t);
    } catch (...) {
      err = std::current_exception();
    }
    if (err) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = err;
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // The caller checks pending_ under the mutex before it blocks: taking the mutex here
      // makes sure it is either not yet checking or already waiting for this notify.
      { std::lock_guard lock(mutex_); }
      done_.notify_one();
    }
  }
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace detail

/// The CPU executor: host memory, items split into contiguous slices over a fixed number of
/// threads. Loops inside an item are plain contiguous loops the compiler vectorises.
class cpu {
 public:
  using executor_concept = executor_tag;
  using memory_space = host_space;

  /// `threads` worker threads (including the caller's); 0 means one per hardware thread.
  explicit cpu(int threads = 1);

  /// The number of threads items are spread over.
  int concurrency() const noexcept { return pool_->size(); }

  /// 64-byte aligned, zero-filled host memory.
  void* allocate_bytes(std::size_t bytes) {
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = ::operator new(rounded, std::align_val_t{64});
    std::fill_n(static_cast<unsigned char*>(p), rounded, 0);
    return p;
  }
  void deallocate_bytes(void* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }

  /// Calls f(i) once for each i in [0, n): thread t takes the t-th contiguous slice.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    const auto threads = static_cast<std::size_t>(pool_->size());
    if (n == 0) return;
    if (threads == 1 || n == 1) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    pool_->run([&](int t) {
      const std::size_t begin = n * static_cast<std::size_t>(t) / threads;
      const std::size_t end = n * (static_cast<std::size_t>(t) + 1) / threads;
      for (std::size_t i = begin; i < end; ++i) f(i);
    });
  }

 private:
  std::shared_ptr<detail::thread_pool> pool_;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN cpu::cpu(int threads) {
  if (threads < 0)
    throw std::invalid_argument("distopt::cpu: threads must be >= 0 (0 = one per core), got " +
                                std::to_string(threads));
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  pool_ = std::make_shared<detail::thread_pool>(threads);
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt
