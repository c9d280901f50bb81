// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The one place that decides how a collective reaches the memory it works on. An
/// optimizer's collectives are of two kinds:
///  - on host memory (the statistics and norm wires, the layout and hook-order checks, the
///    checkpoint's agreement): in place with a communicator of host memory, through device
///    scratch with one of device memory (nccl), which is handed nothing else;
///  - on the executor's memory (grads, params, the device's norm wire): in place, inside
///    the executor's collective scope (the emulated device opens its memory for it), or,
///    on an executor of device code only (cuda) with a communicator of host memory, through
///    host staging buffers (blocking, in the communicator's own order: the same bits).

#include <cstddef>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "../comm/request.hpp"
#include "../concepts.hpp"
#include "../detail/buffer.hpp"
#include "../exec/transfer.hpp"

namespace distopt::detail {

/// What a collective in flight holds open until it is waited for (the emulated device's memory).
template <class Exec>
using collective_hold = std::optional<decltype(collective_scope(std::declval<Exec&>()))>;

/// The collectives of an optimizer on executor Exec over groups of type Comm, with the
/// staging buffers they need. The executor is passed to each call (the adapter moves
/// with its optimizer).
template <class Comm, class Exec>
class comm_adapter {
 public:
  /// Buckets in the executor's memory are copied to host memory for the communicator.
  static constexpr bool stages =
      !runs_host_functions<Exec> && !host_memory<Exec> && !collectives_in_device_memory<Comm>;

  /// Sums (or maxes) `v`, in host memory, over group `c`.
  void all_reduce_host(Exec& e, Comm& c, std::span<double> v, reduce_op op) {
    if constexpr (collectives_in_device_memory<Comm>) {
      const std::span<double> dev = scratch(e, v.size());
      copy_bytes(e, dev.data(), v.data(), v.size_bytes());
      {
        [[maybe_unused]] const auto open = collective_scope(e);
        c.all_reduce(dev, op);
      }
      copy_bytes(e, v.data(), dev.data(), v.size_bytes());
    } else {
      c.all_reduce(v, op);
    }
  }
  /// Gathers `in` of every rank of `c` into `out`, in host memory.
  void all_gather_host(Exec& e, Comm& c, std::span<const double> in, std::span<double> out) {
    if constexpr (collectives_in_device_memory<Comm>) {
      const std::span<double> dev = scratch(e, in.size() + out.size());
      copy_bytes(e, dev.data(), in.data(), in.size_bytes());
      {
        [[maybe_unused]] const auto open = collective_scope(e);
        c.all_gather(std::span<const double>(dev.first(in.size())), dev.subspan(in.size()));
      }
      copy_bytes(e, out.data(), dev.data() + in.size(), out.size_bytes());
    } else {
      c.all_gather(in, out);
    }
  }

  /// Sums `n` doubles in the executor's memory over group `c`.
  void all_reduce_exec(Exec& e, Comm& c, double* p, std::size_t n) {
    if constexpr (stages) {
      std::vector<double> host(n);
      copy_bytes(e, host.data(), p, n * sizeof(double));
      c.all_reduce(std::span<double>(host), reduce_op::sum);
      copy_bytes(e, p, host.data(), n * sizeof(double));
    } else {
      [[maybe_unused]] const auto open = collective_scope(e);
      c.all_reduce(std::span<double>(p, n), reduce_op::sum);
    }
  }

  /// Reduces `bucket` (the executor's memory) over `c` into `mine`: its reduce-scatter
  /// (Sharded) or all-reduce, whose result is copied to `mine` when it lies elsewhere.
  /// Asynchronously into `*req` when given and the communicator can, with `*hold` keeping
  /// the executor's memory open until it is waited for.
  template <bool Sharded, class T>
  void reduce(Exec& e, Comm& c, std::span<T> bucket, std::span<T> mine, reduce_op op, comm_request* req,
              collective_hold<Exec>* hold) {
    if constexpr (stages) {
      const std::span<T> in = staged<T>(in_, bucket.size());
      copy_bytes(e, in.data(), bucket.data(), bucket.size_bytes());
      if constexpr (Sharded) {
        const std::span<T> out = staged<T>(out_, mine.size());
        c.reduce_scatter(std::span<const T>(in), out, op);
        copy_bytes(e, mine.data(), out.data(), mine.size_bytes());
      } else {  // one shard: `mine` is the whole bucket, where the step reads it
        c.all_reduce(in, op);
        copy_bytes(e, mine.data(), in.data(), mine.size_bytes());
      }
      return;
    }
    if constexpr (async_communicator<Comm>) {
      if (req) {
        hold->emplace(collective_scope(e));
        if constexpr (Sharded) *req = c.ireduce_scatter(std::span<const T>(bucket), mine, op);
        else *req = c.iall_reduce(bucket, op);
        return;
      }
    }
    [[maybe_unused]] const auto open = collective_scope(e);
    if constexpr (Sharded) {
      c.reduce_scatter(std::span<const T>(bucket), mine, op);
    } else {
      c.all_reduce(bucket, op);
      // One shard: `mine` is the whole bucket. When it is elsewhere (the fp32 grads, reduced
      // from the staging bucket), the reduced values are copied there.
      if (mine.data() != bucket.data()) copy_bytes(e, mine.data(), bucket.data(), mine.size_bytes());
    }
  }

  /// All-gathers `in` (this rank's shard, in the executor's memory) into `out`: into `*req`
  /// when given and the communicator can, with `*hold` keeping the executor's memory open
  /// until it is waited for; else blocking.
  template <class T>
  void all_gather(Exec& e, Comm& c, std::span<const T> in, std::span<T> out, comm_request* req,
                  collective_hold<Exec>* hold) {
    if constexpr (stages) {
      const std::span<T> host_in = staged<T>(in_, in.size());
      const std::span<T> host_out = staged<T>(out_, out.size());
      copy_bytes(e, host_in.data(), in.data(), in.size_bytes());
      c.all_gather(std::span<const T>(host_in), host_out);
      copy_bytes(e, out.data(), host_out.data(), out.size_bytes());
      return;
    }
    if constexpr (async_communicator<Comm>) {
      if (req) {
        hold->emplace(collective_scope(e));
        *req = c.iall_gather(in, out);
        return;
      }
    }
    [[maybe_unused]] const auto open = collective_scope(e);
    c.all_gather(in, out);
  }

 private:
  /// `n` elements of T in host staging buffer `b` (grown as needed).
  template <class T>
  static std::span<T> staged(std::vector<std::byte>& b, std::size_t n) {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
    if (b.size() < n * sizeof(T)) b.resize(n * sizeof(T));
    return {reinterpret_cast<T*>(b.data()), n};
  }
  /// `n` doubles of device scratch for the host-memory collectives (grown as needed).
  std::span<double> scratch(Exec& e, std::size_t n) {
    if (scratch_.size() < n) scratch_ = buffer<double, Exec>(e, n);
    return scratch_.span().first(n);
  }

  std::vector<std::byte> in_, out_;  // host copies of a bucket (stages)
  buffer<double, Exec> scratch_;     // host-memory collectives on a device communicator
};

}  // namespace distopt::detail
