// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The groups make_mesh should build, found by enumerating the world, and what a rank sees
// of one group it holds: tests/unit/mesh.cpp (threads) and tests/mpi/mpi_comm.cpp (mpi).
#pragma once

#include <distopt/comm/mesh.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace mesh_test {

/// The world ranks in `s`'s grid over `world` ranks that share rank r's group along `axis`
/// (0 tp, 1 dp, 2 etp, 3 ep, 4 edp), in the order of their index along it: every rank whose
/// indices on the grid's other axes equal r's, from the rank formulas of mesh.hpp's header.
inline std::vector<int> expected_group(int world, const distopt::mesh_shape& s, int r, int axis) {
  const int dp = world / s.tp, edp = world / (s.etp * s.ep);
  const auto dense = [&](int tp_i, int dp_i) { return dp_i * s.tp + tp_i; };
  const auto expert = [&](int etp_i, int ep_i, int edp_i) { return (edp_i * s.ep + ep_i) * s.etp + etp_i; };
  int tp_r = 0, dp_r = 0, etp_r = 0, ep_r = 0, edp_r = 0;
  for (int a = 0; a < s.tp; ++a)
    for (int b = 0; b < dp; ++b)
      if (dense(a, b) == r) tp_r = a, dp_r = b;
  for (int a = 0; a < s.etp; ++a)
    for (int b = 0; b < s.ep; ++b)
      for (int c = 0; c < edp; ++c)
        if (expert(a, b, c) == r) etp_r = a, ep_r = b, edp_r = c;
  std::vector<int> g;
  if (axis == 0)
    for (int a = 0; a < s.tp; ++a) g.push_back(dense(a, dp_r));
  if (axis == 1)
    for (int b = 0; b < dp; ++b) g.push_back(dense(tp_r, b));
  if (axis == 2)
    for (int a = 0; a < s.etp; ++a) g.push_back(expert(a, ep_r, edp_r));
  if (axis == 3)
    for (int b = 0; b < s.ep; ++b) g.push_back(expert(etp_r, b, edp_r));
  if (axis == 4)
    for (int c = 0; c < edp; ++c) g.push_back(expert(etp_r, ep_r, c));
  return g;
}

/// What a rank saw of one group: its rank and size there, and the world ranks of its
/// members in group-rank order (each member writes its world rank at its group rank; a sum).
struct seen {
  int rank = -1, size = -1;
  std::vector<int> members;
};

template <class Comm>
seen look_at(Comm& g, int world_rank) {
  seen s;
  s.rank = g.rank();
  s.size = g.size();
  std::vector<double> at(static_cast<std::size_t>(g.size()), 0.0);
  at[static_cast<std::size_t>(g.rank())] = world_rank + 1;
  g.all_reduce(std::span<double>(at), distopt::reduce_op::sum);
  for (double x : at) s.members.push_back(static_cast<int>(x) - 1);
  return s;
}

}  // namespace mesh_test
