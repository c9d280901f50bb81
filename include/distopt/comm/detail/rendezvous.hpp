// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The meeting point of `threads` ranks: the world one `run_ranks` starts (one lock,
/// one condition variable, the first failure), a group of ranks and the collective in
/// progress on it (its phases, see comm/threads.hpp), and the check that the ranks' calls
/// agree.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../../concepts.hpp"
#include "rank_order.hpp"

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

}  // namespace distopt

namespace distopt::detail {

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

}  // namespace distopt::detail
