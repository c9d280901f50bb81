// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The emulated device configured as a GPU is, for the suites that run the optimizer on it:
//  - `device_code_only`: the emulated device declaring that it runs device code only, as
//    distopt::cuda does, so that the optimizer takes only what runs on cuda, and stages
//    the collectives of a communicator of host memory (threads) through host memory.
//  - `device_threads`: d ranks as threads that keep NCCL's memory contract on the
//    emulated device. It declares collectives_in_device_memory, as distopt::nccl does, and
//    throws std::invalid_argument, naming the collective, when a span it is handed does
//    not lie in the emulated device's memory: a host buffer that would reach
//    ncclAllReduce on a GPU (and be read there as a device address) fails here, in CI. It
//    opens that memory while a blocking collective runs, as NCCL reaches it; the i-forms
//    leave that to the caller (the optimizer holds a collective scope until it waits).
//    Otherwise it is `threads`: the same rank-order arithmetic, hence the same bits. It
//    names a stream and a device (plain numbers), as nccl does, for `streamed_device`.
//  - `streamed_device`: device_code_only naming a stream and a device, as distopt::cuda
//    does, so that the optimizer's check that they are the communicator's runs in CI.
#pragma once

#include <distopt/comm/threads.hpp>
#include <distopt/exec/emulated.hpp>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

namespace harness {

struct device_code_only : distopt::emulated_device {
  static constexpr bool runs_host_functions = false;
  using emulated_device::emulated_device;
};

struct streamed_device : device_code_only {
  explicit streamed_device(int stream = 0, int device = 0) : device_code_only(1), stream_(stream), device_(device) {}
  int stream() const noexcept { return stream_; }
  int device() const noexcept { return device_; }

 private:
  int stream_, device_;
};

class device_threads {
 public:
  using communicator_concept = distopt::communicator_tag;
  static constexpr bool collectives_in_device_memory = true;

  explicit device_threads(distopt::threads&& t, int stream = 0, int device = 0)
      : t_(std::move(t)), stream_(stream), device_(device) {}

  /// As nccl::runs_on: whether the executor's stream and device are this handle's.
  bool runs_on(int stream, int device) const noexcept { return stream == stream_ && device == device_; }

  int rank() const noexcept { return t_.rank(); }
  int size() const noexcept { return t_.size(); }
  std::size_t bytes_sent() const noexcept { return t_.bytes_sent(); }
  /// Collectives this handle was called for (blocking and i-forms), all of device memory.
  std::size_t collectives() const noexcept { return collectives_; }

  template <distopt::comm_element T>
  void all_reduce(std::span<T> data, distopt::reduce_op op) {
    const auto open = enter("all_reduce", data);
    t_.all_reduce(data, op);
  }
  template <distopt::comm_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    const auto open = enter("all_gather", in, out);
    t_.all_gather(in, out);
  }
  template <distopt::comm_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, distopt::reduce_op op) {
    const auto open = enter("reduce_scatter", in, out);
    t_.reduce_scatter(in, out, op);
  }
  template <distopt::comm_element T>
  void reduce(std::span<const T> in, std::span<T> out, distopt::reduce_op op, int root) {
    const auto open = enter("reduce", in, out);
    t_.reduce(in, out, op, root);
  }
  template <distopt::comm_element T>
  void broadcast(std::span<T> data, int root) {
    const auto open = enter("broadcast", data);
    t_.broadcast(data, root);
  }

  template <distopt::comm_element T>
  distopt::comm_request iall_reduce(std::span<T> data, distopt::reduce_op op) {
    check("iall_reduce", data);
    return t_.iall_reduce(data, op);
  }
  template <distopt::comm_element T>
  distopt::comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    check("iall_gather", in, out);
    return t_.iall_gather(in, out);
  }
  template <distopt::comm_element T>
  distopt::comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, distopt::reduce_op op) {
    check("ireduce_scatter", in, out);
    return t_.ireduce_scatter(in, out, op);
  }
  template <distopt::comm_element T>
  distopt::comm_request ireduce(std::span<const T> in, std::span<T> out, distopt::reduce_op op, int root) {
    check("ireduce", in, out);
    return t_.ireduce(in, out, op, root);
  }
  template <distopt::comm_element T>
  distopt::comm_request ibroadcast(std::span<T> data, int root) {
    check("ibroadcast", data);
    return t_.ibroadcast(data, root);
  }

  device_threads split(int color, int key) { return device_threads(t_.split(color, key), stream_, device_); }

 private:
  template <class... Spans>
  void check(const char* what, Spans... spans) {
    ++collectives_;
    const bool on_device = (distopt::detail::device_arenas::instance().contains(spans.data(), spans.size_bytes()) && ...);
    if (!on_device)
      throw std::invalid_argument(std::string("device_threads::") + what + " on rank " + std::to_string(rank()) +
                                  ": a buffer lies outside the device's memory");
  }
  template <class... Spans>
  distopt::emulated_device::access_scope enter(const char* what, Spans... spans) {
    check(what, spans...);
    return distopt::emulated_device::access_scope();
  }

  distopt::threads t_;
  int stream_, device_;
  std::size_t collectives_ = 0;
};

}  // namespace harness
