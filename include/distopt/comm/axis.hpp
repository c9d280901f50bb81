// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Communicators named by the axis of the parallel grid they span, and statistics
/// buffers named by the axis they must be reduced over. Reducing a tensor-parallel
/// statistic over the data-parallel group (or the reverse) does not compile:
///
///     axis_group<Comm, dp_axis> dp{&comm};
///     stat_wire<tp_axis> w(n);
///     all_reduce_stats(dp, w);   // error: a statistic must be reduced over the axis it belongs to
///
/// Both collectives would run and return plausible numbers; only the types can tell them apart.

#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../concepts.hpp"

namespace distopt {

/// The data-parallel axis: ranks holding the same model part, each with a shard of the state.
struct dp_axis {
  static constexpr std::string_view name = "data-parallel";
};
/// The tensor-parallel axis: ranks holding different rows or columns of the same tensors.
struct tp_axis {
  static constexpr std::string_view name = "tensor-parallel";
};

/// A communicator spanning one axis of the grid (not owned).
template <communicator Comm, class Axis>
struct axis_group {
  using axis = Axis;
  Comm* comm = nullptr;
  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
};

/// Doubles to be summed over the ranks of axis `Axis`, and over no other.
template <class Axis>
struct stat_wire {
  using axis = Axis;
  std::vector<double> values;
  std::span<double> span() noexcept { return values; }
};

namespace detail {
/// A communicator's own all_reduce (sum) of a statistics wire in host memory.
struct plain_all_reduce {
  template <class Comm>
  void operator()(Comm& c, std::span<double> v) const {
    c.all_reduce(v, reduce_op::sum);
  }
};
}  // namespace detail

/// Sums `w` element-wise over the ranks of `g`: a no-op on one rank. The axes must agree,
/// or it does not compile. `all_reduce(comm, values)` runs the collective on the wire's
/// host memory (the optimizer passes one that stages it through device memory for a
/// communicator of device memory, nccl).
template <communicator Comm, class GroupAxis, class WireAxis, class AllReduce = detail::plain_all_reduce>
void all_reduce_stats(axis_group<Comm, GroupAxis>& g, stat_wire<WireAxis>& w, AllReduce&& all_reduce = {}) {
  static_assert(std::is_same_v<GroupAxis, WireAxis>,
                "distopt::all_reduce_stats: a statistic must be reduced over the axis it belongs to "
                "(tensor-parallel statistics over the TP group, data-parallel ones over the DP group)");
  if (g.size() > 1 && !w.values.empty()) all_reduce(*g.comm, w.span());
}

}  // namespace distopt
