// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "a statistic must be reduced over the axis it belongs to".
// A tensor-parallel statistic reduced over the data-parallel group: both are communicators
// and the call would run, so only the axis in the types can refuse it.
#include <distopt/comm/axis.hpp>
#include <distopt/comm/single.hpp>

int main() {
  distopt::single comm;
  distopt::axis_group<distopt::single, distopt::dp_axis> dp{&comm};
  distopt::stat_wire<distopt::tp_axis> wire;
  distopt::all_reduce_stats(dp, wire);
}
