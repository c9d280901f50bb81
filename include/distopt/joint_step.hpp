// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file distopt::joint_step: one step of a model whose tensors two optimizers hold (the
/// dense tensors over the dense grid, the experts over the expert grid of a
/// mixture-of-experts model, comm/mesh.hpp), decided on one global gradient norm.

#include <cmath>
#include <stdexcept>
#include <string>

#include "memory_report.hpp"
#include "norm_part.hpp"
#include "options.hpp"

namespace distopt {

namespace detail {
/// Throws when the two optimizers would decide a joint step differently: the finite check
/// (check_finite or loss scaling), max_grad_norm, or the loss scaler's constants.
inline void check_joint_options(const optimizer_options& a, const optimizer_options& b) {
  const auto refuse = [](const std::string& what) {
    throw std::invalid_argument("distopt::joint_step: the two optimizers differ in " + what +
                                "; a joint step decides once for both, so set the same on each");
  };
  if ((a.check_finite || a.loss_scale) != (b.check_finite || b.loss_scale)) refuse("the finite check (check_finite)");
  if (a.max_grad_norm != b.max_grad_norm)
    refuse("max_grad_norm (" + std::to_string(a.max_grad_norm) + " and " + std::to_string(b.max_grad_norm) + ")");
  if (a.loss_scale.has_value() != b.loss_scale.has_value()) refuse("loss scaling (on in one only)");
  if (a.loss_scale && (a.loss_scale->init_scale != b.loss_scale->init_scale ||
                       a.loss_scale->growth_factor != b.loss_scale->growth_factor ||
                       a.loss_scale->backoff_factor != b.loss_scale->backoff_factor ||
                       a.loss_scale->growth_interval != b.loss_scale->growth_interval))
    refuse("the loss scaler's constants");
}

template <class Dense, class Experts>
typename Dense::step_return joint_step_across(Dense& dense, Experts& experts, typename Experts::comm_type* ep) {
  check_joint_options(dense.options(), experts.options());
  norm_part total = dense.begin_joint_step();
  total += experts.begin_joint_step(ep);
  experts.end_joint_step(total);
  return dense.end_joint_step(total);
}
}  // namespace detail

/// One step of `dense` and `experts`, decided together: the global gradient norm counts
/// every element of the model once (dense: over `dense`'s DP and TP groups; experts: over
/// `experts`' groups, then summed over `ep`, the ranks that hold the other experts), and
/// both optimizers clip by it, skip on a NaN or Inf anywhere, and step their loss scalers
/// alike. The norm is summed exactly, so it has the bits of one optimizer that held every
/// tensor; what each optimizer then does per element is what its step() does.
/// Collective over every rank of the world. Both optimizers need the same check_finite,
/// max_grad_norm and loss scaling (checked); clip_grad_norm is refused (it gives one
/// optimizer's norm alone). Returns `dense`'s result; `experts` decides the same.
template <class Dense, class Experts>
typename Dense::step_return joint_step(Dense& dense, Experts& experts, typename Experts::comm_type& ep) {
  return detail::joint_step_across(dense, experts, &ep);
}

/// joint_step over the expert-parallel group that `experts` was given
/// (set_expert_parallel_group); without one, its expert tensors (layout::add_experts) must
/// be every expert.
template <class Dense, class Experts>
typename Dense::step_return joint_step(Dense& dense, Experts& experts) {
  return detail::joint_step_across(dense, experts, static_cast<typename Experts::comm_type*>(nullptr));
}

/// One rank's memory of a model held by `dense` and `experts` (joint_step's optimizers):
/// the dense optimizer's categories, then the expert optimizer's as "experts <category>";
/// the parameters are both optimizers' (this rank's TP parts of the dense tensors and of
/// its experts), so bytes per parameter are of what this rank holds.
template <class Dense, class Experts>
memory_report joint_memory(const Dense& dense, const Experts& experts) {
  memory_report r = dense.memory();
  const memory_report x = experts.memory();
  for (const auto& e : x.entries) r.entries.push_back({"experts " + e.category, e.bytes});
  r.parameters += x.parameters;
  return r;
}

}  // namespace distopt
