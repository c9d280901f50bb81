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
///
/// The parts: detail/rank_order.hpp (the arithmetic, shared with mpi), detail/rendezvous.hpp
/// (the world, the groups and their phases), detail/thread_rank.hpp (a rank's collectives
/// and its worker); here the handle and run_ranks, which starts the ranks.

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "detail/rank_order.hpp"
#include "detail/rendezvous.hpp"
#include "detail/thread_rank.hpp"
#include "request.hpp"

namespace distopt {

class threads;
/// The default time a collective waits for the other ranks: 30 minutes, as
/// torch.distributed's default process-group timeout, so that a slow rank (a long backward,
/// a checkpoint write, a first touch of a large model) does not kill a healthy run. A test
/// that wants a dead rank named quickly passes its own.
inline constexpr std::chrono::milliseconds default_rank_timeout = std::chrono::minutes(30);
template <class F>
void run_ranks(int d, F&& f, std::chrono::milliseconds timeout = default_rank_timeout);

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
