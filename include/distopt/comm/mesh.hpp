// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The groups of a mixture-of-experts job, built from one world communicator.
///
/// One world of ranks is folded into two grids, as Megatron-Core's "parallel folding" does:
///  - dense tensors: tp ranks split each tensor, and dp = world / tp ranks hold the same part
///    (data parallel); world rank r = dp_index * tp + tp_index;
///  - expert tensors: etp ranks split each expert, ep ranks hold different experts, and
///    edp = world / (etp * ep) ranks hold the same experts (expert data parallel); world rank
///    r = (edp_index * ep + ep_index) * etp + etp_index.
/// With etp = tp an expert's tensor-parallel group is the dense one. The dense tensors'
/// gradients are reduced over `dp`, the experts' over `edp` (today: one optimizer over
/// each, docs/experts.md). Every group comes from `split`, so it works for every
/// communicator that has one (threads, mpi, nccl).
///
///     distopt::mesh<distopt::threads> m = distopt::make_mesh(world, {.tp = 2, .ep = 4});
///     // m.dp: the dense data-parallel group; m.edp: the ranks holding the same experts

#include <concepts>
#include <stdexcept>
#include <string>
#include <utility>

#include "../concepts.hpp"
#include "../layout/registry.hpp"  // expert_range

namespace distopt {

/// A communicator that splits into sub-groups: split(color, key) gathers the ranks that
/// pass the same color, ordered by key.
template <class C>
concept splittable_communicator = communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
};

/// The sizes of the two grids over a world of ranks: tensor parallel for the dense tensors
/// (tp), expert parallel (ep) and tensor parallel inside an expert (etp) for the expert
/// tensors. The data-parallel sizes follow: dp = world / tp, edp = world / (etp * ep).
struct mesh_shape {
  int tp = 1;
  int ep = 1;
  int etp = 1;
};

/// Where one world rank sits in both grids: its index along each axis.
struct mesh_coords {
  int tp = 0, dp = 0;            // dense: rank = dp * tp_size + tp
  int etp = 0, ep = 0, edp = 0;  // experts: rank = (edp * ep_size + ep) * etp_size + etp
};

/// Checks `s` against a world of `world` ranks: every size at least 1, tp and etp * ep
/// dividing the world. Throws std::invalid_argument naming the size that does not fit.
inline void check_mesh_shape(const mesh_shape& s, int world) {
  const auto fail = [&](const std::string& what) {
    throw std::invalid_argument("distopt::make_mesh: " + what + " (world of " + std::to_string(world) + " ranks, tp = " +
                                std::to_string(s.tp) + ", ep = " + std::to_string(s.ep) + ", etp = " +
                                std::to_string(s.etp) + ")");
  };
  if (s.tp < 1 || s.ep < 1 || s.etp < 1) fail("tp, ep and etp must be at least 1");
  if (world % s.tp != 0) fail("tp = " + std::to_string(s.tp) + " does not divide the world");
  if (world % (s.etp * s.ep) != 0)
    fail("etp * ep = " + std::to_string(s.etp * s.ep) + " does not divide the world");
}

/// The coordinates of world rank `rank` (of `world`) in the grids of `s` (checked).
inline mesh_coords mesh_coords_of(int rank, int world, const mesh_shape& s) {
  check_mesh_shape(s, world);
  if (rank < 0 || rank >= world)
    throw std::invalid_argument("distopt::mesh_coords_of: rank " + std::to_string(rank) + " is not in a world of " +
                                std::to_string(world));
  mesh_coords c;
  c.tp = rank % s.tp;
  c.dp = rank / s.tp;
  c.etp = rank % s.etp;
  c.ep = rank / s.etp % s.ep;
  c.edp = rank / (s.etp * s.ep);
  return c;
}

/// The experts of `experts` that the ranks at expert-parallel index `ep_index` (of `ep`)
/// hold: [first, first + count), whole experts in order. Throws std::invalid_argument when
/// ep does not divide the number of experts.
inline expert_range experts_of(int experts, int ep, int ep_index) {
  if (experts < 1 || ep < 1 || experts % ep != 0)
    throw std::invalid_argument("distopt::experts_of: " + std::to_string(experts) + " experts do not split into ep = " +
                                std::to_string(ep) + " equal parts of whole experts");
  if (ep_index < 0 || ep_index >= ep)
    throw std::invalid_argument("distopt::experts_of: expert-parallel index " + std::to_string(ep_index) +
                                " is not in 0.." + std::to_string(ep - 1));
  return {ep_index * (experts / ep), experts / ep};
}

/// One rank's groups of both grids (each a communicator this handle owns), with the shape
/// and this rank's coordinates. Move-only where Comm is.
template <splittable_communicator Comm>
struct mesh {
  mesh_shape shape;
  int world_size = 1;
  int world_rank = 0;
  mesh_coords at;
  Comm tp;   // dense tensor parallel: tp ranks, ordered by tp index
  Comm dp;   // dense data parallel: world / tp ranks, ordered by dp index
  Comm etp;  // tensor parallel inside an expert: etp ranks
  Comm ep;   // expert parallel: ep ranks holding different experts
  Comm edp;  // expert data parallel: world / (etp * ep) ranks holding the same experts

  int dp_size() const noexcept { return world_size / shape.tp; }
  int edp_size() const noexcept { return world_size / (shape.etp * shape.ep); }
  /// The experts (of `experts` in all) this rank holds.
  expert_range experts(int experts) const { return experts_of(experts, shape.ep, at.ep); }
};

/// Splits `world` into the groups of `s` (collectively: every rank of `world` calls it with
/// the same shape). The shape is checked first, on every rank alike, so a bad one throws
/// everywhere before any split starts.
template <splittable_communicator Comm>
mesh<Comm> make_mesh(Comm& world, const mesh_shape& s) {
  const int n = world.size(), r = world.rank();
  const mesh_coords c = mesh_coords_of(r, n, s);
  // A group's color: the indices along the other axes, made into one number.
  Comm tp = world.split(c.dp, c.tp);
  Comm dp = world.split(c.tp, c.dp);
  Comm etp = world.split(c.edp * s.ep + c.ep, c.etp);
  Comm ep = world.split(c.edp * s.etp + c.etp, c.ep);
  Comm edp = world.split(c.ep * s.etp + c.etp, c.edp);
  return mesh<Comm>{s, n, r, c, std::move(tp), std::move(dp), std::move(etp), std::move(ep), std::move(edp)};
}

}  // namespace distopt
