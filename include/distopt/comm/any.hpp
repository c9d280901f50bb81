// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file `any_comm`: a communicator chosen at run time. It holds any communicator (single,
/// threads, mpi, nccl, a user's own) behind one virtual call per collective, so that a
/// program that picks its communicator from a flag instantiates its optimizers once:
/// `optimizer<Policy, sharded<fp32>, any_comm>` serves ranks as threads and MPI ranks alike.
///
/// What it costs: one indirect call and a switch per collective, nothing per element. The
/// collective itself is the held communicator's, with its bits, its checks and its error
/// messages. It carries the number types the optimizer communicates: float, double, bf16
/// and fp16. The asynchronous forms start the held communicator's own when it has them, and
/// otherwise run the blocking collective and return a completed request.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

#include "../concepts.hpp"
#include "../types/dtype.hpp"
#include "request.hpp"
#include "single.hpp"

namespace distopt {

namespace detail {

/// One collective call, with its element type as a value rather than a template argument.
struct erased_call {
  enum class kind : std::uint8_t { all_reduce, all_gather, reduce_scatter, reduce, broadcast } what;
  enum class number : std::uint8_t { f32, f64, bf16, f16 } type;
  bool async;
  const void* in;   // all_gather, reduce_scatter, reduce: the input; otherwise unused
  void* out;        // the output (all_reduce, broadcast: the data, in place)
  std::size_t in_n, out_n;
  reduce_op op;
  int root;
};

template <class T>
constexpr erased_call::number erased_number() {
  if constexpr (std::same_as<T, float>) return erased_call::number::f32;
  else if constexpr (std::same_as<T, double>) return erased_call::number::f64;
  else if constexpr (std::same_as<T, bf16>) return erased_call::number::bf16;
  else return erased_call::number::f16;
}

struct erased_comm {
  virtual ~erased_comm() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual std::size_t bytes_sent() const noexcept = 0;
  virtual comm_request run(const erased_call& c) = 0;
};

template <class C>
class erased_comm_for final : public erased_comm {
 public:
  explicit erased_comm_for(C c) : c_(std::move(c)) {}
  int rank() const noexcept override { return c_.rank(); }
  int size() const noexcept override { return c_.size(); }
  std::size_t bytes_sent() const noexcept override { return c_.bytes_sent(); }
  comm_request run(const erased_call& c) override {
    switch (c.type) {
      case erased_call::number::f32: return run_as<float>(c);
      case erased_call::number::f64: return run_as<double>(c);
      case erased_call::number::bf16: return run_as<bf16>(c);
      case erased_call::number::f16: return run_as<fp16>(c);
    }
    return {};
  }

 private:
  template <class T>
  comm_request run_as(const erased_call& c) {
    std::span<T> out(static_cast<T*>(c.out), c.out_n);
    std::span<const T> in(static_cast<const T*>(c.in), c.in_n);
    using K = erased_call::kind;
    if constexpr (async_communicator<C>) {
      if (c.async) {
        switch (c.what) {
          case K::all_reduce: return c_.iall_reduce(out, c.op);
          case K::all_gather: return c_.iall_gather(in, out);
          case K::reduce_scatter: return c_.ireduce_scatter(in, out, c.op);
          case K::reduce: return c_.ireduce(in, out, c.op, c.root);
          case K::broadcast: return c_.ibroadcast(out, c.root);
        }
      }
    }
    switch (c.what) {
      case K::all_reduce: c_.all_reduce(out, c.op); break;
      case K::all_gather: c_.all_gather(in, out); break;
      case K::reduce_scatter: c_.reduce_scatter(in, out, c.op); break;
      case K::reduce: c_.reduce(in, out, c.op, c.root); break;
      case K::broadcast: c_.broadcast(out, c.root); break;
    }
    return {};
  }

  C c_;
};

}  // namespace detail

/// A communicator chosen at run time: wraps any `communicator` (by value; move-only) and
/// forwards every collective to it. Default-constructed, it holds `single`. A moved-from
/// any_comm holds nothing: assign to it or destroy it.
class any_comm {
 public:
  using communicator_concept = communicator_tag;

  any_comm() : any_comm(single{}) {}
  /// Takes `c` over; its collectives are this one's. A communicator of host memory only:
  /// any_comm declares none of device memory, so it cannot carry nccl's contract.
  template <communicator C>
    requires(!std::same_as<std::remove_cvref_t<C>, any_comm> && !collectives_in_device_memory<C>)
  explicit any_comm(C c) : c_(std::make_unique<detail::erased_comm_for<C>>(std::move(c))) {}

  any_comm(any_comm&&) noexcept = default;
  any_comm& operator=(any_comm&&) noexcept = default;
  any_comm(const any_comm&) = delete;
  any_comm& operator=(const any_comm&) = delete;

  int rank() const noexcept { return c_->rank(); }
  int size() const noexcept { return c_->size(); }
  /// The held communicator's count of bytes sent.
  std::size_t bytes_sent() const noexcept { return c_->bytes_sent(); }

  template <comm_element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    call<T>(kind::all_reduce, false, nullptr, 0, data.data(), data.size(), op, 0);
  }
  template <comm_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    call<T>(kind::all_gather, false, in.data(), in.size(), out.data(), out.size(), reduce_op::sum, 0);
  }
  template <comm_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    call<T>(kind::reduce_scatter, false, in.data(), in.size(), out.data(), out.size(), op, 0);
  }
  template <comm_element T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    call<T>(kind::reduce, false, in.data(), in.size(), out.data(), out.size(), op, root);
  }
  template <comm_element T>
  void broadcast(std::span<T> data, int root) {
    call<T>(kind::broadcast, false, nullptr, 0, data.data(), data.size(), reduce_op::sum, root);
  }

  template <comm_element T>
  comm_request iall_reduce(std::span<T> data, reduce_op op) {
    return call<T>(kind::all_reduce, true, nullptr, 0, data.data(), data.size(), op, 0);
  }
  template <comm_element T>
  comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    return call<T>(kind::all_gather, true, in.data(), in.size(), out.data(), out.size(), reduce_op::sum, 0);
  }
  template <comm_element T>
  comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    return call<T>(kind::reduce_scatter, true, in.data(), in.size(), out.data(), out.size(), op, 0);
  }
  template <comm_element T>
  comm_request ireduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    return call<T>(kind::reduce, true, in.data(), in.size(), out.data(), out.size(), op, root);
  }
  template <comm_element T>
  comm_request ibroadcast(std::span<T> data, int root) {
    return call<T>(kind::broadcast, true, nullptr, 0, data.data(), data.size(), reduce_op::sum, root);
  }

 private:
  using kind = detail::erased_call::kind;

  template <class T>
  comm_request call(kind what, bool async, const T* in, std::size_t in_n, T* out, std::size_t out_n, reduce_op op,
                    int root) {
    return c_->run(detail::erased_call{what, detail::erased_number<T>(), async, in, out, in_n, out_n, op, root});
  }

  std::unique_ptr<detail::erased_comm> c_;
};

}  // namespace distopt
