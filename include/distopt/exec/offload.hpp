// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The executor of ZeRO-Offload, `offload<Device>`: a device executor's memory, launches
/// and copies for the params and grads a training code reads and writes, and a `cpu` that
/// steps the master weights and states; and what its copies between the two need (host
/// memory registered with the device, the wait for the copies in flight). The optimizer over
/// it, the host optimizer plus device views and copies at the hooks, is <distopt/offload.hpp>
/// (distopt.hpp includes it).

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "cpu.hpp"
#include "transfer.hpp"

namespace distopt {

/// The executor of ZeRO-Offload: `Device` (an executor of device memory: emulated_device,
/// cuda) holds the params and grads, `cpu` steps the master weights and states. As an
/// executor it is the device's (its memory, launches and copies); `host()` is the cpu.
template <executor Device>
class offload {
  static_assert(!host_memory<Device>,
                "distopt::offload<Device>: Device is the executor of the params and grads, one of device memory "
                "(emulated_device, cuda); with cpu or kokkos the states are in host memory already");

 public:
  using executor_concept = executor_tag;
  using memory_space = typename Device::memory_space;
  using device_type = Device;
  static constexpr bool runs_host_functions = distopt::runs_host_functions<Device>;
  /// An optimizer over this executor keeps its states on the host (<distopt/offload.hpp>).
  static constexpr bool offloads_states = true;

  offload() = default;
  /// `threads` for the cpu that steps the states, and for the device where it takes a count.
  explicit offload(int threads) : host_(threads), device_(make_executor<Device>(threads)) {}
  offload(cpu host, Device device) : host_(std::move(host)), device_(std::move(device)) {}

  cpu& host() noexcept { return host_; }
  Device& device() noexcept { return device_; }
  int concurrency() const noexcept { return device_.concurrency(); }

  void* allocate_bytes(std::size_t bytes) { return device_.allocate_bytes(bytes); }
  void deallocate_bytes(void* p, std::size_t bytes) noexcept { device_.deallocate_bytes(p, bytes); }
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    device_.parallel_for(n, std::forward<F>(f));
  }
  /// Copies between host and device memory through the device (either direction).
  void copy_bytes(void* dst, const void* src, std::size_t n) { device_.copy_bytes(dst, src, n); }

 private:
  cpu host_;
  Device device_;
};

namespace detail {

/// Host memory registered with a device executor (registers_host_memory) for as long as
/// this lives: ZeRO-Offload's host params and grads, which every step copies. Moving hands
/// the registrations over. With an executor that cannot register, or default-constructed
/// (optimizer_options::pin_host_buffers off), it records nothing.
/// ZeRO-Offload registers (optimizer_options::pin_host_buffers, on by default) the host
/// params (stages 0-2) and grads (stages 0-1) at construction, and at ZeRO-2 and ZeRO-3
/// each buffer of the host optimizer's bucket pools (grads; ZeRO-3's gathered params) at
/// the first copy into or out of it (with one rank, the one grads buffer). The pools keep
/// their buffers, so each is registered once.
template <class Device>
class host_registration {
 public:
  host_registration() = default;
  explicit host_registration(const Device& device) : device_(device) {}
  host_registration(host_registration&& o) noexcept : device_(std::move(o.device_)), ranges_(std::move(o.ranges_)) {
    o.ranges_.clear();
  }
  host_registration& operator=(host_registration&& o) noexcept {
    if (this != &o) {
      release();
      device_ = std::move(o.device_);
      ranges_ = std::move(o.ranges_);
      o.ranges_.clear();
    }
    return *this;
  }
  ~host_registration() { release(); }

  /// Whether `p` was registered here (as the start of a range).
  bool holds(const void* p) const noexcept { return std::find(ranges_.begin(), ranges_.end(), p) != ranges_.end(); }

  /// Registers `bytes` from `p` (nothing when empty). `what` names the buffer in the error.
  void add(void* p, std::size_t bytes, const char* what) {
    if constexpr (registers_host_memory<Device>) {
      if (!device_ || !p || bytes == 0) return;
      ranges_.reserve(ranges_.size() + 1);  // nothing throws between the register and the record
      try {
        device_->register_host(p, bytes);
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("distopt::offload: page-locking the host ") + what + " (" +
                                 std::to_string(bytes) + " bytes) failed: " + e.what() +
                                 "; set optimizer_options::pin_host_buffers = false to copy through pageable memory");
      }
      ranges_.push_back(p);
    }
  }

 private:
  void release() noexcept {
    if constexpr (registers_host_memory<Device>)
      for (void* p : ranges_) device_->unregister_host(p);
    ranges_.clear();
  }
  std::optional<Device> device_;
  std::vector<void*> ranges_;
};

/// Waits, when it goes, for the copies (copies_async) that an offload optimizer started
/// last: declared after everything they read and write, it is destroyed first. Moving hands
/// the wait over; assigning waits for its own first.
template <class Device>
class copy_fence {
 public:
  copy_fence() = default;
  copy_fence(copy_fence&& o) noexcept : device_(std::move(o.device_)), last_(std::exchange(o.last_, 0)) {}
  copy_fence& operator=(copy_fence&& o) noexcept {
    if (this != &o) {
      wait();
      device_ = std::move(o.device_);
      last_ = std::exchange(o.last_, 0);
    }
    return *this;
  }
  ~copy_fence() { wait(); }

  /// Copy `ticket` on `device` is in flight.
  void started(const Device& device, std::uint64_t ticket) {
    if (!device_) device_.emplace(device);
    last_ = ticket;
  }
  /// Waits for every copy started so far (nothing to report: a failed wait leaves them to
  /// the device's own teardown).
  void wait() noexcept {
    if constexpr (copies_async<Device>) {
      if (last_ == 0 || !device_) return;
      try {
        device_->copy_wait(std::exchange(last_, 0));
      } catch (...) {
      }
    }
  }

 private:
  std::optional<Device> device_;
  std::uint64_t last_ = 0;
};

}  // namespace detail

}  // namespace distopt
