// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file One rank's end of a `threads` group (detail::thread_rank): the collectives it
/// runs through the rendezvous, and the worker thread with its FIFO queue that runs the
/// asynchronous ones (thread_job, thread_request).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../concepts.hpp"
#include "../request.hpp"
#include "rank_order.hpp"
#include "rendezvous.hpp"

namespace distopt::detail {

/// One asynchronous collective: what to run and how it ended. Shared by the queue that
/// runs it and the request that waits for it, since either may outlive the other.
struct thread_job {
  std::function<void()> run;  // the blocking collective, bound to its rank and buffers
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  /// Runs the collective and publishes its end; a failure is kept for the request.
  void execute() noexcept {
    std::exception_ptr e;
    try {
      run();
    } catch (...) {
      e = std::current_exception();
    }
    run = nullptr;
    {
      std::lock_guard lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

/// What the comm_request of a `threads` i-form waits on.
class thread_request final : public request_state {
 public:
  explicit thread_request(std::shared_ptr<thread_job> job) noexcept : job_(std::move(job)) {}

  void wait() override {
    std::exception_ptr e;
    {
      std::unique_lock lock(job_->mutex);
      job_->cv.wait(lock, [this] { return job_->done; });
      // Taken out (comm_request waits once), so the exception dies on this thread.
      e = std::move(job_->error);
    }
    if (e) std::rethrow_exception(std::move(e));
  }

  bool test() override {
    std::lock_guard lock(job_->mutex);
    return job_->done;
  }

 private:
  std::shared_ptr<thread_job> job_;
};

/// One rank's end of a group: its index, its all_reduce scratch, its byte count, the
/// collectives, and the worker thread that runs its asynchronous ones. Owned through a
/// pointer by the `threads` handle, so that the worker's `this` stays valid however the
/// handle moves. One thread at a time acts for the rank: the worker while the queue holds
/// work, otherwise the rank's own thread, which calls drain() before it acts.
class thread_rank {
 public:
  thread_rank(std::shared_ptr<thread_group> g, int rank) : group_(std::move(g)), rank_(rank) {}
  thread_rank(const thread_rank&) = delete;
  thread_rank& operator=(const thread_rank&) = delete;

  /// Lets the worker run what is queued (each collective ends: it completes, fails or
  /// times out), then joins it. The requests keep their results.
  ~thread_rank() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(queue_mutex_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    worker_.join();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return group_->size(); }
  std::size_t bytes_sent() const noexcept { return bytes_sent_.load(std::memory_order_relaxed); }

  /// Waits until every queued asynchronous collective has ended, so that the caller may
  /// act for the rank next, in call order.
  void drain() {
    if (!worker_.joinable()) return;  // only the rank's own thread starts the worker
    std::unique_lock lock(queue_mutex_);
    queue_cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
  }

  /// Queues `run` (a collective on this rank) for the worker and returns its request.
  comm_request post(std::function<void()> run) {
    auto job = std::make_shared<thread_job>();
    job->run = std::move(run);
    auto request = std::make_unique<thread_request>(job);
    if (size() == 1) {
      // Nothing to overlap: every phase of a one-rank group passes at once.
      job->execute();
      return comm_request(std::move(request));
    }
    if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
    thread_world& w = *group_->world;
    const auto me = static_cast<std::size_t>(group_->members[static_cast<std::size_t>(rank_)]);
    {
      std::lock_guard lock(w.mutex);
      ++w.pending[me];
    }
    try {
      std::lock_guard lock(queue_mutex_);
      queue_.push_back(std::move(job));
    } catch (...) {
      std::lock_guard lock(w.mutex);
      --w.pending[me];
      w.cv.notify_all();
      throw;
    }
    queue_cv_.notify_all();
    return comm_request(std::move(request));
  }

  template <comm_element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    const std::size_t n = data.size(), d = static_cast<std::size_t>(size());
    const std::size_t r = static_cast<std::size_t>(rank_);
    const std::size_t c0 = chunk_begin(n, d, r), cn = chunk_begin(n, d, r + 1) - c0;
    T* scratch = scratch_for<T>(cn);
    std::vector<const T*> ins(d);
    collective_call call{collective_kind::all_reduce, comm_type_name<T>(), op,
                         data.data(), data.data(), scratch, n, n, 0, 0};
    std::unique_lock lock = enter(call);
    lock.unlock();
    // Between A and B: reduce my chunk of everyone's data into my scratch (the data
    // cannot be reduced in place: the others are still reading my other chunks).
    peer_pointers(ins, [&](const collective_call& c) { return static_cast<const T*>(c.in) + c0; });
    reduce_rank_order(scratch, ins.data(), d, cn, op);
    phase(lock);
    // Between B and C: collect every chunk from its owner's scratch.
    for (std::size_t q = 0; q < d; ++q) {
      const std::size_t b = chunk_begin(n, d, q), e = chunk_begin(n, d, q + 1);
      copy_elements(data.data() + b, static_cast<const T*>(group_->calls[q].scratch), e - b);
    }
    phase(lock);
    if (d > 1) bytes_sent_.fetch_add((n + (d - 2) * cn) * sizeof(T), std::memory_order_relaxed);
  }

  template <comm_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    const std::size_t d = static_cast<std::size_t>(size()), m = in.size();
    collective_call call{collective_kind::all_gather, comm_type_name<T>(), reduce_op::sum,
                         in.data(), out.data(), nullptr, in.size(), out.size(), 0, 0};
    std::unique_lock lock = enter(call);
    lock.unlock();
    for (std::size_t q = 0; q < d; ++q)
      copy_elements(out.data() + q * m, static_cast<const T*>(group_->calls[q].in), m);
    phase(lock);
    bytes_sent_.fetch_add((d - 1) * m * sizeof(T), std::memory_order_relaxed);
  }

  template <comm_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    const std::size_t d = static_cast<std::size_t>(size()), m = out.size();
    const std::size_t off = static_cast<std::size_t>(rank_) * m;
    std::vector<const T*> ins(d);
    collective_call call{collective_kind::reduce_scatter, comm_type_name<T>(), op,
                         in.data(), out.data(), nullptr, in.size(), out.size(), 0, 0};
    std::unique_lock lock = enter(call);
    lock.unlock();
    peer_pointers(ins, [&](const collective_call& c) { return static_cast<const T*>(c.in) + off; });
    reduce_rank_order(out.data(), ins.data(), d, m, op);
    phase(lock);
    bytes_sent_.fetch_add((d - 1) * m * sizeof(T), std::memory_order_relaxed);
  }

  template <comm_element T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    const std::size_t d = static_cast<std::size_t>(size()), n = in.size();
    std::vector<const T*> ins(d);
    collective_call call{collective_kind::reduce, comm_type_name<T>(), op,
                         in.data(), out.data(), nullptr, in.size(), out.size(), root, 0};
    std::unique_lock lock = enter(call);
    lock.unlock();
    // Only the root works: it reads every rank's `in`, which stays untouched until phase().
    if (root == rank_) {
      peer_pointers(ins, [](const collective_call& c) { return static_cast<const T*>(c.in); });
      reduce_rank_order(out.data(), ins.data(), d, n, op);
    }
    phase(lock);
    if (root != rank_) bytes_sent_.fetch_add(n * sizeof(T), std::memory_order_relaxed);
  }

  template <comm_element T>
  void broadcast(std::span<T> data, int root) {
    collective_call call{collective_kind::broadcast, comm_type_name<T>(), reduce_op::sum,
                         data.data(), data.data(), nullptr, data.size(), data.size(), root, 0};
    std::unique_lock lock = enter(call);
    lock.unlock();
    if (root != rank_)
      copy_elements(data.data(), static_cast<const T*>(group_->calls[static_cast<std::size_t>(root)].in),
                    data.size());
    phase(lock);
    if (root == rank_ && size() > 1) bytes_sent_.fetch_add(data.size() * sizeof(T), std::memory_order_relaxed);
  }

  split_result split(int color, int key) {
    collective_call call{};
    call.kind = collective_kind::split;
    call.type = "";
    call.root = color;
    call.key = key;
    std::unique_lock lock = enter(call, [g = group_.get()] { make_splits(*g); });
    return std::move(group_->splits[static_cast<std::size_t>(rank_)]);
  }

 private:
  /// The worker: runs the queue in order until the handle goes and the queue is empty.
  void work() noexcept {
    thread_world& w = *group_->world;
    const auto me = static_cast<std::size_t>(group_->members[static_cast<std::size_t>(rank_)]);
    std::unique_lock lock(queue_mutex_);
    for (;;) {
      queue_cv_.wait(lock, [this] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;
      std::shared_ptr<thread_job> job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      job->execute();
      job.reset();
      {
        std::lock_guard world_lock(w.mutex);
        --w.pending[me];
        w.cv.notify_all();  // run_ranks may be waiting for this rank's last one
      }
      lock.lock();
      busy_ = false;
      queue_cv_.notify_all();  // drain()
    }
  }

  /// Phase A: publishes `call`, waits for everyone, and throws the verdict if the calls
  /// disagree. Returns with the lock held. `extra` runs on the last arrival after a
  /// clean verdict (split builds the sub-groups there).
  template <class Extra = void (*)()>
  std::unique_lock<std::mutex> enter(const collective_call& call, Extra extra = [] {}) {
    thread_group& g = *group_;
    const char* what = collective_name(call.kind);
    std::unique_lock lock(g.world->mutex);
    if (g.world->failed_rank >= 0) g.throw_aborted(rank_, what);
    g.calls[static_cast<std::size_t>(rank_)] = call;
    g.arrive(lock, rank_, what, [&g, &extra] {
      g.verdict = check_calls(g.calls);
      if (g.verdict.empty()) extra();
    });
    if (!g.verdict.empty()) throw std::invalid_argument(g.verdict);
    return lock;
  }

  /// A later barrier of the same collective (see arrive_committed).
  void phase(std::unique_lock<std::mutex>& lock) {
    lock.lock();
    group_->arrive_committed(lock, rank_);
    lock.unlock();
  }

  /// Each rank's input pointer (adjusted by `at`), in rank order, into `ins` (sized
  /// before phase A, so that nothing between the phases allocates or throws). Read
  /// between phases A and B, when nobody writes `calls`.
  template <class T, class At>
  void peer_pointers(std::vector<const T*>& ins, At at) const {
    for (std::size_t q = 0; q < ins.size(); ++q) ins[q] = at(group_->calls[q]);
  }

  /// This rank's scratch space for `n` elements of T, grown as needed and reused.
  template <class T>
  T* scratch_for(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes > scratch_bytes_) {
      // A byte array provides storage for (and implicitly creates) the T objects.
      scratch_ = std::make_unique<std::byte[]>(bytes);
      scratch_bytes_ = bytes;
    }
    return reinterpret_cast<T*>(scratch_.get());
  }

  /// Builds the sub-groups of a split from every rank's (color, key); runs on the last
  /// rank to arrive, under the lock.
  static void make_splits(thread_group& g) {
    const std::size_t d = g.calls.size();
    std::vector<int> order(d);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const auto& ca = g.calls[static_cast<std::size_t>(a)];
      const auto& cb = g.calls[static_cast<std::size_t>(b)];
      return ca.root != cb.root ? ca.root < cb.root : ca.key < cb.key;
    });
    g.splits.assign(d, {});
    for (std::size_t i = 0; i < d;) {
      std::size_t j = i;
      std::vector<int> members;
      while (j < d && g.calls[static_cast<std::size_t>(order[j])].root == g.calls[static_cast<std::size_t>(order[i])].root)
        members.push_back(g.members[static_cast<std::size_t>(order[j++])]);
      auto sub = std::make_shared<thread_group>(g.world, std::move(members));
      for (std::size_t k = i; k < j; ++k)
        g.splits[static_cast<std::size_t>(order[k])] = {sub, static_cast<int>(k - i)};
      i = j;
    }
  }

  std::shared_ptr<thread_group> group_;
  int rank_ = 0;
  std::atomic<std::size_t> bytes_sent_{0};  // written by whichever thread acts, read by the owner
  std::unique_ptr<std::byte[]> scratch_;
  std::size_t scratch_bytes_ = 0;

  // The asynchronous queue. The worker starts on the first i-form (never for one rank).
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<thread_job>> queue_;
  bool busy_ = false;      // the worker is running a job it took off the queue
  bool stopping_ = false;  // the handle is going: run what is queued, then end
  std::thread worker_;
};

}  // namespace distopt::detail
