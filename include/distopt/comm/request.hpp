// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file `comm_request`: the handle an asynchronous collective returns. Every
/// communicator's `i`-forms (iall_reduce, ireduce_scatter, iall_gather, ibroadcast) start
/// the collective and return one; the buffers passed in must stay alive and untouched
/// until `wait()` returns.

#include <exception>
#include <memory>
#include <utility>

namespace distopt {

namespace detail {
/// What a communicator puts behind a request: how to finish it and how to poll it.
struct request_state {
  virtual ~request_state() = default;
  /// Blocks until the collective is complete; throws what the collective threw.
  virtual void wait() = 0;
  /// True once the collective is complete (wait() then returns at once); never blocks.
  virtual bool test() = 0;
};
}  // namespace detail

/// A started asynchronous collective. Move-only. `wait()` completes it (and rethrows its
/// failure); a request destroyed without `wait()` waits in its destructor and, since a
/// destructor must not throw, terminates the program if the collective failed: call
/// `wait()` to handle errors.
class comm_request {
 public:
  /// A request that is already complete (what a one-rank communicator returns).
  comm_request() = default;
  explicit comm_request(std::unique_ptr<detail::request_state> s) noexcept : state_(std::move(s)) {}
  comm_request(comm_request&&) noexcept = default;
  comm_request& operator=(comm_request&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      state_ = std::move(o.state_);
    }
    return *this;
  }
  comm_request(const comm_request&) = delete;
  comm_request& operator=(const comm_request&) = delete;
  ~comm_request() { finish_quietly(); }

  /// Blocks until the collective is complete. Rethrows its failure once; later calls return.
  void wait() {
    if (!state_) return;
    std::unique_ptr<detail::request_state> s = std::move(state_);
    s->wait();
  }
  /// True when the collective has completed (or there was none); never blocks.
  bool test() { return !state_ || state_->test(); }
  /// True while a collective is attached and wait() has not been called.
  bool pending() const noexcept { return state_ != nullptr; }

 private:
  void finish_quietly() noexcept {
    if (!state_) return;
    try {
      wait();
    } catch (...) {
      std::terminate();  // a failed collective nobody waited for: its buffers are in an unknown state
    }
  }
  std::unique_ptr<detail::request_state> state_;
};

/// Waits for every request in order; the first failure is rethrown after all have finished.
template <class... R>
void wait_all(R&... requests) {
  std::exception_ptr first;
  ((([&] {
     try {
       requests.wait();
     } catch (...) {
       if (!first) first = std::current_exception();
     }
   })()),
   ...);
  if (first) std::rethrow_exception(first);
}

}  // namespace distopt
