// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file `threads`: d ranks as threads of one process over shared memory, with
/// deterministic rank-order arithmetic; `run_ranks` starts them. The default communicator
/// for tests and one-node CPU training: nothing to install or start.
///
/// How a collective works. All handles of a group share one `detail::thread_group`. A
/// collective is a sequence of barriers (phases) on it:
///   A  every rank publishes what it was called with (kind, element type, spans, op, root)
///      and waits; the last to arrive checks that the calls agree and leaves one verdict
///      for all, so a mismatch throws the same std::invalid_argument on every rank;
///   -  each rank then computes its own output, reading the others' inputs in rank order;
///   B  nobody returns (and so frees or reuses its input) before everyone has read it.
/// all_reduce adds a phase C: each rank reduces one chunk into a scratch buffer between
/// A and B and copies the others' chunks between B and C, so that every element is
/// reduced once and read O(d) times in all, not O(d^2).
///
/// Failures. Every group started by one `run_ranks` (sub-groups from `split` included)
/// shares one `detail::thread_world`. A rank whose function throws, a wait that times out,
/// or a rank that returns while others wait for it poisons the world: every rank waiting
/// in or entering a collective throws `rank_failure` naming the rank that failed first,
/// and `run_ranks` rethrows that failure on the caller. Nothing waits forever. Failures
/// and the timeout act on phase A only, the wait for every rank to enter: once all have
/// entered, the collective completes (the later phases only copy and add), because a rank
/// that left early could free a buffer another rank is still reading.
///
/// Asynchronous forms. A handle's rank state (`detail::thread_rank`, on the heap so that
/// the handle can move) starts, on the first i-form, one worker thread with a FIFO queue. An i-form queues the blocking collective and returns a
/// `comm_request`; the worker runs the queue in order, acting as the rank in the phases
/// above, while the rank's own thread computes. A blocking call (and split) first waits
/// for the handle's queue to empty, so a handle's collectives run in the order they were
/// called, async and blocking mixed, and the ranks meet in the same order. A rank has
/// "returned" (for the failure rules) only once its function has returned and every
/// async collective it queued, on any of its handles, has ended: `thread_world::pending`
/// counts those, and `run_ranks` waits for it to reach zero before marking the rank exited.

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

#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "../types/dtype.hpp"
#include "../types/fp16.hpp"
#include "request.hpp"

namespace distopt {

/// A rank of a `threads` group failed: it threw, timed out, or returned while the others
/// waited for it. `rank()` is the failing rank's index in the group `run_ranks` started.
class rank_failure : public std::runtime_error {
 public:
  rank_failure(const std::string& what, int rank) : std::runtime_error(what), rank_(rank) {}
  /// The rank (in the group `run_ranks` started) whose failure this reports.
  int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

class threads;
template <class F>
void run_ranks(int d, F&& f, std::chrono::milliseconds timeout = std::chrono::seconds(60));

namespace detail {

/// What a rank entered; compared across ranks to catch mismatched calls.
enum class collective_kind : unsigned char { all_reduce, all_gather, reduce_scatter, reduce, broadcast, split };

inline const char* collective_name(collective_kind k) noexcept {
  switch (k) {
  case collective_kind::all_reduce: return "all_reduce";
  case collective_kind::all_gather: return "all_gather";
  case collective_kind::reduce_scatter: return "reduce_scatter";
  case collective_kind::reduce: return "reduce";
  case collective_kind::broadcast: return "broadcast";
  case collective_kind::split: return "split";
  }
  return "?";
}

inline const char* reduce_op_name(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum: return "sum";
  case reduce_op::avg: return "avg";
  case reduce_op::max: return "max";
  }
  return "?";
}

template <class T>
constexpr const char* comm_type_name() noexcept {
  if constexpr (std::same_as<T, float>) return "float";
  else if constexpr (std::same_as<T, double>) return "double";
  else if constexpr (std::same_as<T, bf16>) return "bf16";
  else return "fp16";
}

/// The type reductions accumulate in: double for double, float otherwise, so that bf16
/// and fp16 are rounded once, at the end.
template <class T>
using comm_accumulator = std::conditional_t<std::same_as<T, double>, double, float>;

template <class T>
DISTOPT_INLINE comm_accumulator<T> comm_load(T x) noexcept {
  return static_cast<comm_accumulator<T>>(x);
}
template <class T>
DISTOPT_INLINE T comm_store(comm_accumulator<T> a) noexcept {
  return T(a);
}

/// One rank's call, as published to the others at phase A.
struct collective_call {
  collective_kind kind{};
  const char* type = "";   // element type name; pointer identity is not relied on
  reduce_op op{};
  const void* in = nullptr;
  void* out = nullptr;
  void* scratch = nullptr;  // all_reduce: where this rank leaves its reduced chunk
  std::size_t in_n = 0;
  std::size_t out_n = 0;
  int root = 0;             // broadcast, reduce: the root; split: the color
  int key = 0;              // split: the key
};

/// State shared by every group one `run_ranks` started: one lock and one condition
/// variable for all of them, so a failure anywhere wakes every waiter.
struct thread_world {
  explicit thread_world(int d, std::chrono::milliseconds t)
      : exited(static_cast<std::size_t>(d), 0), pending(static_cast<std::size_t>(d), 0), timeout(t) {}

  std::mutex mutex;
  std::condition_variable cv;
  int failed_rank = -1;         // world rank that failed first; -1 while healthy
  std::string failure;          // its message
  std::vector<char> exited;     // per world rank: its function and its async collectives have ended
  std::vector<int> pending;     // per world rank: async collectives queued or running
  std::chrono::milliseconds timeout;

  /// Records the first failure and wakes everyone; later failures are consequences.
  void fail_locked(int world_rank, std::string what) {
    if (failed_rank < 0) {
      failed_rank = world_rank;
      failure = std::move(what);
    }
    cv.notify_all();
  }
};

struct thread_group;

/// What `split` hands one rank: its sub-group and its index there.
struct split_result {
  std::shared_ptr<thread_group> group;
  int rank = 0;
};

/// The ranks of one group (the world or a sub-group from `split`) and the rendezvous
/// state of the collective in progress.
struct thread_group {
  thread_group(std::shared_ptr<thread_world> w, std::vector<int> m)
      : world(std::move(w)), members(std::move(m)), here(members.size(), 0), calls(members.size()) {}

  std::shared_ptr<thread_world> world;
  std::vector<int> members;          // world rank of each local rank
  std::uint64_t generation = 0;      // completed phases
  int arrived = 0;
  std::vector<char> here;            // per local rank: arrived at the phase in progress
  std::vector<collective_call> calls;
  std::string verdict;               // phase A's finding, empty when the calls agree
  std::vector<split_result> splits;  // split: each local rank's new group

  int size() const noexcept { return static_cast<int>(members.size()); }
  bool is_world() const noexcept { return size() == static_cast<int>(world->exited.size()) &&
                                          std::is_sorted(members.begin(), members.end()); }

  /// "rank 2" in the world, "rank 2 (world rank 6)" in a sub-group.
  std::string rank_label(int local) const {
    std::string s = "rank " + std::to_string(local);
    if (!is_world()) s += " (world rank " + std::to_string(members[static_cast<std::size_t>(local)]) + ")";
    return s;
  }

  /// The ranks that have not arrived at the phase in progress, as "1, 3".
  std::string missing_list() const {
    std::string s;
    for (int q = 0; q < size(); ++q) {
      if (here[static_cast<std::size_t>(q)]) continue;
      if (!s.empty()) s += ", ";
      s += std::to_string(q);
      if (!is_world()) s += " (world " + std::to_string(members[static_cast<std::size_t>(q)]) + ")";
    }
    return s;
  }

  /// A missing rank whose function has already returned, or -1.
  int missing_exited() const {
    for (int q = 0; q < size(); ++q)
      if (!here[static_cast<std::size_t>(q)] && world->exited[static_cast<std::size_t>(members[static_cast<std::size_t>(q)])])
        return q;
    return -1;
  }

  [[noreturn]] void throw_aborted(int me, const char* what) const {
    throw rank_failure("threads communicator: " + std::string(what) + " on " + rank_label(me) +
                           " aborted because rank " + std::to_string(world->failed_rank) +
                           " failed: " + world->failure,
                       world->failed_rank);
  }

  /// Phase A: marks local rank `me` as arrived and waits for the others. The last to
  /// arrive runs `on_complete` (under the lock) before releasing everyone. Throws
  /// rank_failure when the world is or becomes poisoned, when a missing rank has
  /// returned, or on timeout; the last two poison the world themselves, since the phase
  /// can never complete (and no rank may arrive at it any more).
  template <class OnComplete>
  void arrive(std::unique_lock<std::mutex>& lock, int me, const char* what, OnComplete&& on_complete) {
    thread_world& w = *world;
    if (w.failed_rank >= 0) throw_aborted(me, what);
    here[static_cast<std::size_t>(me)] = 1;
    if (++arrived == size()) {
      on_complete();
      arrived = 0;
      std::fill(here.begin(), here.end(), 0);
      ++generation;
      w.cv.notify_all();
      return;
    }
    const std::uint64_t gen = generation;
    const auto deadline = std::chrono::steady_clock::now() + w.timeout;
    for (;;) {
      // A completed phase wins over a later failure: this rank's collective did finish.
      if (generation != gen) return;
      if (w.failed_rank >= 0) throw_aborted(me, what);
      if (const int q = missing_exited(); q >= 0) {
        std::string msg = "threads communicator: " + std::string(what) + " on " + rank_label(me) +
                          " cannot complete: " + rank_label(q) + " returned without calling it";
        w.fail_locked(members[static_cast<std::size_t>(me)], msg);
        throw rank_failure(msg, members[static_cast<std::size_t>(me)]);
      }
      if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout && generation == gen &&
          w.failed_rank < 0) {
        std::string msg = "threads communicator: " + std::string(what) + " on " + rank_label(me) +
                          " timed out after " + std::to_string(w.timeout.count()) +
                          " ms waiting for rank(s) " + missing_list();
        w.fail_locked(members[static_cast<std::size_t>(me)], msg);
        throw rank_failure(msg, members[static_cast<std::size_t>(me)]);
      }
    }
  }

  /// A later phase of a collective whose phase A has passed. It neither times out nor
  /// aborts: every rank is inside the collective, only copying and adding (nothing there
  /// can throw or block), and a rank that left early could free a buffer another rank is
  /// still reading.
  void arrive_committed(std::unique_lock<std::mutex>& lock, int me) {
    here[static_cast<std::size_t>(me)] = 1;
    if (++arrived == size()) {
      arrived = 0;
      std::fill(here.begin(), here.end(), 0);
      ++generation;
      world->cv.notify_all();
      return;
    }
    const std::uint64_t gen = generation;
    world->cv.wait(lock, [&] { return generation != gen; });
  }
};

/// "rank 0: all_gather<float>(in 7, out 28)": one rank's call, for error messages.
inline std::string describe_call(int rank, const collective_call& c) {
  std::string s = "rank " + std::to_string(rank) + ": " + collective_name(c.kind);
  if (c.kind == collective_kind::split) return s + "(color " + std::to_string(c.root) + ")";
  s += "<" + std::string(c.type) + ">(";
  switch (c.kind) {
  case collective_kind::all_reduce: s += std::to_string(c.in_n) + ", " + reduce_op_name(c.op); break;
  case collective_kind::broadcast: s += std::to_string(c.in_n) + ", root " + std::to_string(c.root); break;
  case collective_kind::reduce:
    s += "in " + std::to_string(c.in_n) + ", out " + std::to_string(c.out_n) + ", " + reduce_op_name(c.op) + ", root " +
         std::to_string(c.root);
    break;
  case collective_kind::reduce_scatter:
    s += "in " + std::to_string(c.in_n) + ", out " + std::to_string(c.out_n) + ", " + reduce_op_name(c.op);
    break;
  default: s += "in " + std::to_string(c.in_n) + ", out " + std::to_string(c.out_n); break;
  }
  return s + ")";
}

/// Phase A's check: the calls agree and have valid shapes. Returns "" or the message
/// every rank throws.
inline std::string check_calls(const std::vector<collective_call>& calls) {
  const collective_call& c0 = calls.front();
  const std::size_t d = calls.size();
  const std::string prefix = std::string("distopt::threads::") + collective_name(c0.kind) + ": ";
  bool agree = true;
  for (const collective_call& c : calls) {
    agree = agree && c.kind == c0.kind;
    if (c0.kind == collective_kind::split) continue;
    agree = agree && std::string_view(c.type) == c0.type && c.in_n == c0.in_n;
    // reduce: only the root's out is written, the others may pass any (an empty one).
    if (c0.kind != collective_kind::reduce) agree = agree && c.out_n == c0.out_n;
    if (c0.kind == collective_kind::all_reduce || c0.kind == collective_kind::reduce_scatter ||
        c0.kind == collective_kind::reduce)
      agree = agree && c.op == c0.op;
    if (c0.kind == collective_kind::broadcast || c0.kind == collective_kind::reduce) agree = agree && c.root == c0.root;
  }
  if (!agree) {
    const bool same_kind = std::all_of(calls.begin(), calls.end(),
                                       [&](const collective_call& c) { return c.kind == c0.kind; });
    std::string s = same_kind ? prefix + "ranks' calls do not match: "
                              : std::string("distopt::threads: ranks called different collectives at once: ");
    for (std::size_t r = 0; r < d; ++r) s += (r ? "; " : "") + describe_call(static_cast<int>(r), calls[r]);
    return s;
  }
  // The calls agree, so checking rank 0's shape checks everyone's.
  switch (c0.kind) {
  case collective_kind::all_gather:
    if (c0.out_n != d * c0.in_n)
      return prefix + "out has " + std::to_string(c0.out_n) + " elements but size() * in = " + std::to_string(d) +
             " * " + std::to_string(c0.in_n) + " = " + std::to_string(d * c0.in_n);
    break;
  case collective_kind::reduce_scatter:
    if (c0.in_n != d * c0.out_n)
      return prefix + "in has " + std::to_string(c0.in_n) + " elements but size() * out = " + std::to_string(d) +
             " * " + std::to_string(c0.out_n) + " = " + std::to_string(d * c0.out_n);
    break;
  case collective_kind::broadcast:
  case collective_kind::reduce:
    if (c0.root < 0 || static_cast<std::size_t>(c0.root) >= d)
      return prefix + "root " + std::to_string(c0.root) + " does not exist in a group of " + std::to_string(d) +
             " ranks";
    if (c0.kind == collective_kind::reduce && calls[static_cast<std::size_t>(c0.root)].out_n != c0.in_n)
      return prefix + "out has " + std::to_string(calls[static_cast<std::size_t>(c0.root)].out_n) +
             " elements on the root (rank " + std::to_string(c0.root) + ") but in has " + std::to_string(c0.in_n);
    break;
  case collective_kind::split:
    for (std::size_t r = 0; r < d; ++r)
      if (calls[r].root < 0)
        return prefix + "color must be >= 0, got " + std::to_string(calls[r].root) + " on rank " + std::to_string(r);
    break;
  default: break;
  }
  return {};
}

/// The first element of chunk `r` when `n` elements are cut into `d` chunks whose sizes
/// differ by at most one (the larger ones first).
constexpr std::size_t chunk_begin(std::size_t n, std::size_t d, std::size_t r) noexcept {
  return r * (n / d) + std::min(r, n % d);
}

/// out[i] = ins[0][i] op ins[1][i] op ... op ins[d-1][i] for i in [0, n), in rank order,
/// accumulated in comm_accumulator<T> and rounded once. Blocked so that the inner loops
/// run over contiguous elements (vectorizable) while each element keeps the same order.
/// `out` may alias one of the inputs exactly: each block is read in full before written.
template <class T>
void reduce_rank_order(T* out, const T* const* ins, std::size_t d, std::size_t n, reduce_op op) {
  using acc_t = comm_accumulator<T>;
  constexpr std::size_t block = 512;
  acc_t acc[block];
  for (std::size_t b = 0; b < n; b += block) {
    const std::size_t m = std::min(block, n - b);
    const T* p0 = ins[0] + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = comm_load(p0[i]);
    for (std::size_t q = 1; q < d; ++q) {
      const T* p = ins[q] + b;
      if (op == reduce_op::max) {
        // NaN wins, like torch.max: `v > a` alone would drop a NaN that comes second.
        for (std::size_t i = 0; i < m; ++i) {
          const acc_t v = comm_load(p[i]);
          acc[i] = (v > acc[i] || v != v) ? v : acc[i];
        }
      } else {
        for (std::size_t i = 0; i < m; ++i) acc[i] += comm_load(p[i]);
      }
    }
    if (op == reduce_op::avg) {
      // A division, not a multiplication by 1/d, so avg is exactly sum / size.
      const acc_t dd = static_cast<acc_t>(d);
      for (std::size_t i = 0; i < m; ++i) acc[i] /= dd;
    }
    for (std::size_t i = 0; i < m; ++i) out[b + i] = comm_store<T>(acc[i]);
  }
}

/// std::copy that tolerates an exact self-copy (in-place all_gather), which std::copy forbids.
template <class T>
void copy_elements(T* dst, const T* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T));
}


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

}  // namespace detail

/// One rank's handle on a group of ranks that are threads of one process. Models
/// `distopt::async_communicator`. Handles come from `run_ranks` and `split`; a handle
/// belongs to its rank's thread (move-only, not to be shared between threads).
///
/// Every collective is collective: all ranks of the group call the same one with the same
/// sizes, op and root, in the same order, or every rank throws the same
/// std::invalid_argument. Reductions run in rank order (rank 0 + rank 1 + ...), in float
/// for float, bf16 and fp16 and in double for double, rounded once to T; the result is
/// computed once per element and copied, so it is bit-identical on every rank and for
/// every run. `avg` is that sum divided by size(). `max` propagates NaN.
///
/// Asynchronous forms. iall_reduce, iall_gather, ireduce_scatter, ireduce and ibroadcast take what
/// the blocking forms take, return a comm_request at once, and run the blocking form on
/// the handle's worker thread while the caller computes: same bits, same byte count. The
/// buffers must stay alive and untouched until wait() returns (or test() is true).
///  - Order: a handle's collectives run in the order they were called, async and blocking
///    mixed: a blocking call (and split) first waits for the handle's queued ones. So a
///    rank may use the i-form where another uses the blocking form. Handles from split
///    have their own queues and progress independently of each other.
///  - Errors: an i-form checks nothing itself, since a rank that refused a call alone would
///    shift its later calls against the others'. Mismatches, rank_failure and timeouts are
///    the collective's, thrown by wait(), the same on every rank as for the blocking form
///    (the timeout counts from when the worker enters the collective).
///  - A request destroyed without wait() waits in its destructor and terminates the
///    program if the collective failed (comm_request's rule): wait() where ranks may fail.
///  - A rank function that returns or throws while requests are pending (kept outside it,
///    say) has not left yet: run_ranks marks it exited only once those collectives have
///    ended (if it threw, after poisoning the group, so that they end fast), so the others
///    neither wait for a rank that is gone nor fail because of one that will still arrive.
///    The requests stay valid after their handle and run_ranks are gone.
///  - Destroying a handle, or move-assigning over it, waits for its queued collectives to
///    end (each completes, fails or times out; nothing waits forever). A moved handle keeps
///    its queue: the worker belongs to the heap-allocated rank state, not to the handle.
///  - With size() == 1 an i-form completes before it returns and starts no thread.
///
/// Byte model of `bytes_sent()`: what a bandwidth-optimal (ring) implementation sends from
/// this rank, for N = elements of the full buffer and s = sizeof(T):
///   all_reduce      (N + (d-2) * c_r) * s, c_r = this rank's chunk of N (N/d rounded as
///                   in chunk_begin). Equals 2 (d-1)/d N s whenever d divides N, and the
///                   ranks' figures always add up to exactly 2 (d-1) N s.
///   reduce_scatter  (d-1) * out.size() * s   ((d-1)/d of the full input)
///   all_gather      (d-1) * in.size() * s    ((d-1)/d of the full output)
///   reduce          N * s on every rank but the root (each contributes its data once), 0
///                   on the root: (d-1) N s in all, as reduce_scatter's over its ranks
///   broadcast       N * s on the root (it injects the data once), 0 on the others
///   split           0 (metadata only)
/// It is also exactly what this implementation reads from this rank's buffers on behalf of
/// the others, except broadcast, where each of the d-1 others copies from the root.
/// An async collective is counted when it completes; reading bytes_sent() is always safe,
/// and it is up to date once every request of the handle has been waited (or tested true)
/// or after any blocking call.
class threads {
 public:
  using communicator_concept = communicator_tag;

  threads(threads&&) noexcept = default;
  /// Waits for this handle's queued collectives to end, then takes `other`'s rank.
  threads& operator=(threads&&) noexcept = default;
  // Two handles of one rank used from two threads would corrupt the rendezvous.
  threads(const threads&) = delete;
  threads& operator=(const threads&) = delete;
  /// Waits for the handle's queued collectives to end and joins its worker.
  ~threads() = default;

  /// This rank's index in the group, 0 <= rank() < size().
  int rank() const noexcept { return self_->rank(); }
  /// The number of ranks in the group.
  int size() const noexcept { return self_->size(); }
  /// Bytes this rank has sent since the handle was made, by the model in the class docs.
  std::size_t bytes_sent() const noexcept { return self_->bytes_sent(); }

  /// Reduces `data` over the ranks in place: every rank ends with the same result.
  template <comm_element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    self_->drain();
    self_->all_reduce(data, op);
  }

  /// Concatenates every rank's `in` into `out` in rank order; out.size() == size() * in.size().
  /// `in` may be this rank's own slice of `out`; otherwise they must not overlap.
  template <comm_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    self_->drain();
    self_->all_gather(in, out);
  }

  /// Reduces `in` over the ranks and leaves slice rank() of the result in `out`;
  /// in.size() == size() * out.size(). `out` may be this rank's own slice of `in`;
  /// otherwise they must not overlap.
  template <comm_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    self_->drain();
    self_->reduce_scatter(in, out, op);
  }

  /// Reduces `in` over the ranks into `out` on rank `root` (in.size() elements there; the
  /// others' `out` is not touched and may be empty). The root's `out` may be its `in`;
  /// otherwise they must not overlap.
  template <comm_element T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    self_->drain();
    self_->reduce(in, out, op, root);
  }

  /// Copies `root`'s `data` into every rank's `data`.
  template <comm_element T>
  void broadcast(std::span<T> data, int root) {
    self_->drain();
    self_->broadcast(data, root);
  }

  /// Starts all_reduce(data, op); see "Asynchronous forms" in the class docs.
  template <comm_element T>
  comm_request iall_reduce(std::span<T> data, reduce_op op) {
    detail::thread_rank* s = self_.get();
    return s->post([s, data, op] { s->all_reduce(data, op); });
  }

  /// Starts all_gather(in, out); see "Asynchronous forms" in the class docs.
  template <comm_element T>
  comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    detail::thread_rank* s = self_.get();
    return s->post([s, in, out] { s->all_gather(in, out); });
  }

  /// Starts reduce_scatter(in, out, op); see "Asynchronous forms" in the class docs.
  template <comm_element T>
  comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    detail::thread_rank* s = self_.get();
    return s->post([s, in, out, op] { s->reduce_scatter(in, out, op); });
  }

  /// Starts reduce(in, out, op, root); see "Asynchronous forms" in the class docs.
  template <comm_element T>
  comm_request ireduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    detail::thread_rank* s = self_.get();
    return s->post([s, in, out, op, root] { s->reduce(in, out, op, root); });
  }

  /// Starts broadcast(data, root); see "Asynchronous forms" in the class docs.
  template <comm_element T>
  comm_request ibroadcast(std::span<T> data, int root) {
    detail::thread_rank* s = self_.get();
    return s->post([s, data, root] { s->broadcast(data, root); });
  }

  /// Splits the group (collectively): ranks that pass the same `color` (>= 0) form a new
  /// group, ordered by `key`, then by rank in this group. For a DP x TP grid, rank
  /// r = dp * tp_size + tp: split(dp, tp) gives the TP group, split(tp, dp) the DP group.
  threads split(int color, int key) {
    self_->drain();
    detail::split_result mine = self_->split(color, key);
    return threads(std::move(mine.group), mine.rank);
  }

 private:
  template <class F>
  friend void run_ranks(int d, F&& f, std::chrono::milliseconds timeout);

  threads(std::shared_ptr<detail::thread_group> g, int rank)
      : self_(std::make_unique<detail::thread_rank>(std::move(g), rank)) {}

  // On the heap: its worker thread refers to it while the handle moves.
  std::unique_ptr<detail::thread_rank> self_;
};

/// Runs `f(threads&)` on `d` ranks, each on its own thread (rank 0 on the caller's), and
/// joins them. If any rank throws, the others fail fast at their next (or current)
/// collective, and `run_ranks` throws `rank_failure("rank R failed: <what>")` for the
/// rank R that failed first. A collective that waits longer than `timeout` for the
/// others fails with a `rank_failure` naming the collective and the missing ranks.
/// A rank is done when its function has returned and every asynchronous collective it
/// started has ended (see the `threads` docs); run_ranks returns after every rank is done.
template <class F>
void run_ranks(int d, F&& f, std::chrono::milliseconds timeout) {
  if (d < 1) throw std::invalid_argument("distopt::run_ranks: need at least one rank, got " + std::to_string(d));
  if (timeout.count() <= 0)
    throw std::invalid_argument("distopt::run_ranks: timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  auto world = std::make_shared<detail::thread_world>(d, timeout);
  std::vector<int> all(static_cast<std::size_t>(d));
  std::iota(all.begin(), all.end(), 0);
  auto group = std::make_shared<detail::thread_group>(world, std::move(all));
  std::vector<threads> comms;
  comms.reserve(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) comms.push_back(threads(group, r));

  const auto finished = [&world](int r, std::exception_ptr error) {
    std::string what;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
        what = "an exception not derived from std::exception";
      }
    }
    const auto ur = static_cast<std::size_t>(r);
    std::unique_lock lock(world->mutex);
    if (error) world->fail_locked(r, std::move(what));
    // Async collectives the rank left running still act for it: it has not returned
    // until they end. Each ends (completes, fails or times out), so this wait does too.
    world->cv.wait(lock, [&] { return world->pending[ur] == 0; });
    world->exited[ur] = 1;
    // Returning normally also wakes everyone: a rank waiting for this one fails fast.
    world->cv.notify_all();
  };
  const auto body = [&](int r) {
    std::exception_ptr error;
    try {
      f(comms[static_cast<std::size_t>(r)]);
    } catch (...) {
      error = std::current_exception();
    }
    finished(r, error);
  };

  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(d - 1));
  bool started = true;
  try {
    for (int r = 1; r < d; ++r) workers.emplace_back(body, r);
  } catch (...) {
    // Ranks that never started count as failed, so the started ones do not wait for them.
    started = false;
    for (int r = static_cast<int>(workers.size()) + 1; r < d; ++r) finished(r, std::current_exception());
  }
  if (started) body(0);
  else finished(0, std::make_exception_ptr(std::runtime_error("not run: other ranks could not start")));
  for (std::thread& t : workers) t.join();

  std::lock_guard lock(world->mutex);
  if (world->failed_rank >= 0)
    throw rank_failure("rank " + std::to_string(world->failed_rank) + " failed: " + world->failure,
                       world->failed_rank);
}

}  // namespace distopt
