// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <condition_variable>
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
class thread_pool {
 public:
  explicit thread_pool(int threads);
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool();

  int size() const noexcept { return n_; }

  /// Runs job(t) for t in [0, size()) on the pool; rethrows the first exception.
  void run(const std::function<void(int)>& job);

 private:
  void work(int t);

  int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN thread_pool::thread_pool(int threads) : n_(threads) {
  for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { work(t); });
}

DISTOPT_CORE_FN thread_pool::~thread_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& w : workers_) w.join();
}

DISTOPT_CORE_FN void thread_pool::run(const std::function<void(int)>& job) {
  if (n_ == 1) return job(0);
  std::lock_guard one_job(run_mutex_);  // copies of an executor share the pool
  {
    std::lock_guard lock(mutex_);
    job_ = &job;
    pending_ = n_ - 1;
    error_ = nullptr;
    ++generation_;
  }
  start_.notify_all();
  std::exception_ptr mine;
  try {
    job(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

DISTOPT_CORE_FN void thread_pool::work(int t) {
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      (*job)(t);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (err && !error_) error_ = err;
    if (--pending_ == 0) done_.notify_one();
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
