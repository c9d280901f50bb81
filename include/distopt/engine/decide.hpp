// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file A step's decisions and the step around its stages, as functions of the context:
/// whether it is skipped (a NaN or Inf gradient), its gradient scale (clip coefficient /
/// loss scale), the step counter, the loss scaler's update, each group's scalars, and the
/// master weights' first load. On the host, or on the device (engine/decisions.hpp's
/// phases) where the step needs nothing from the host.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "../step_info.hpp"
#include "collectives.hpp"
#include "decisions.hpp"
#include "elementwise.hpp"
#include "mirror.hpp"
#include "norm.hpp"
#include "phases.hpp"

namespace distopt::detail {

/// The master load phase over this rank's pieces; with `control`, as the device decided.
template <class Ctx>
void launch_master_load(Ctx& c, const step_control* control) {
  master_load_phase<typename Ctx::param_type> load;
  load.pieces = c.exec_pieces();
  load.params = c.params_.data();
  load.params_local = c.shards_params();
  load.master = c.master_.data();
  load.control = control;
  launch(c.exec_, c.plan_.pieces().size(), load);
}

/// Copies this rank's params into its fp32 master weights (optimizer::load_master_from_params).
template <class Ctx>
void load_master(Ctx& c) {
  if (!c.uses_master()) return;
  launch_master_load(c, nullptr);
  sync_decisions(c);
  c.master_ready_ = true;
  c.decisions_changed_ = true;  // a device executor's control learns it before the next step
}

/// Each group's scalars for the step decided on the host (Policy::prepare) and its state
/// slots in use; records the groups whose state has started.
template <class Ctx>
std::vector<typename Ctx::policy_type::scalars> host_group_scalars(Ctx& c, std::vector<int>& active) {
  using Policy = typename Ctx::policy_type;
  std::vector<typename Policy::scalars> sc;
  active.clear();
  c.state_started_.resize(c.groups_.size(), false);
  for (std::size_t g = 0; g < c.groups_.size(); ++g) {
    const int slots = Policy::state_slots(c.groups_[g]);
    sc.push_back(Policy::prepare(c.groups_[g], step_info{c.step_, slots > 0 && !c.state_started_[g]}));
    active.push_back(slots);
    if (slots > 0) c.state_started_[g] = true;
  }
  return sc;
}

/// The per-step inputs of the update phases in the executor's memory: each group's
/// scalars and slot counts (`sc` and `active` decided on the host; none when the device
/// decided them, `control`), and each tensor's percentile-clipping scale.
template <class Ctx, class G>
step_inputs<typename Ctx::policy_type, G> update_inputs(Ctx& c, const std::vector<typename Ctx::policy_type::scalars>& sc,
                                                       std::vector<int> active, const G* grads, float grad_scale,
                                                       std::uint64_t key, const step_control* control) {
  step_inputs<typename Ctx::policy_type, G> in;
  in.scalars = control ? c.step_scalars_.data() : c.in_exec(sc, c.step_scalars_);
  in.slots = control ? c.step_slots_.data() : c.in_exec(active, c.step_slots_);
  in.tensor_scale = c.clip_scale_.empty() ? nullptr : c.in_exec(c.clip_scale_, c.step_clip_scale_);
  in.grads = grads;
  in.grads_local = c.template grads_local<G>();
  in.control = control;
  in.grad_scale = grad_scale;
  in.key = key;
  in.host_scalars = &sc;
  in.active = std::move(active);
  return in;
}

/// The step decided on the host: the norm's exact sums are copied to the host, which
/// decides, prepares the group scalars and runs the stages with them.
template <class Ctx, class Stages>
step_result host_step(Ctx& c, Stages& stages) {
  step_result r;
  double norm = std::numeric_limits<double>::quiet_NaN();
  double coef = 1.0;
  if (c.clip_) {
    norm = c.clip_->norm;
    coef = c.clip_->coef;
  } else if (c.options_.check_finite || c.scaler_ || c.options_.max_grad_norm > 0.0) {
    norm = grad_norm(c);
    if (c.options_.max_grad_norm > 0.0) coef = clip_coefficient(c.options_.max_grad_norm, norm);
  }
  reduce_grads(c);
  c.clip_.reset();
  next_step_grads(c);
  r.grad_norm = norm;
  r.found_inf = (c.options_.check_finite || c.scaler_) && !std::isfinite(norm);
  if (r.found_inf) {
    if (c.scaler_) c.scaler_->update(true);
    r.skipped = true;
    r.step = c.step_;
    r.loss_scale = loss_scale_of(c);
    return r;
  }
  ++c.step_;
  c.params_told_ = 0;
  if (c.uses_master() && !c.master_ready_) load_master(c);
  const float grad_scale = static_cast<float>(coef / loss_scale_of(c));
  if (c.options_.percentile_clipping < 100) percentile_scales(c, coef);
  c.with_reduced_grads([&](const auto* grads) { stages.run_host(c, grads, grad_scale); });
  if (c.scaler_) c.scaler_->update(false);
  wait_pending(c);  // the all-gathers the update started, bucket by bucket
  tell_params(c, c.plan_.buckets().size(), true);
  r.step = c.step_;
  r.loss_scale = loss_scale_of(c);
  return r;
}

/// A step decided on the device: the norm's exact sums, the decision, each group's
/// scalars and the update are launches that read and write the executor's memory only.
template <class Ctx, class Stages>
void device_step(Ctx& c, Stages& stages) {
  push_decisions(c);
  reduce_grads(c);
  step_rules rules;
  rules.check = c.options_.check_finite || c.scaler_;
  rules.scaler = c.scaler_.has_value();
  if (c.options_.loss_scale) {
    rules.growth_factor = c.options_.loss_scale->growth_factor;
    rules.backoff_factor = c.options_.loss_scale->backoff_factor;
    rules.growth_interval = c.options_.loss_scale->growth_interval;
  }
  rules.seed = c.options_.seed;
  rules.max_norm = c.options_.max_grad_norm;
  if (c.clip_) {
    rules.clip = true;
    rules.clip_norm = c.clip_->norm;
    rules.clip_coef = c.clip_->coef;
  }
  rules.master = c.uses_master();
  const double* wire = !c.clip_ && (rules.check || rules.max_norm > 0.0) ? device_norm_wire(c) : nullptr;
  c.clip_.reset();
  next_step_grads(c);
  decide_phase decide;
  decide.wire = wire;
  decide.rules = rules;
  decide.control = c.control_.data();
  launch(c.exec_, 1, decide);
  if (c.uses_master()) launch_master_load(c, c.control_.data());  // loads at the first step taken
  prepare_phase<typename Ctx::policy_type> prepare;
  prepare.groups = c.groups_dev_.data();
  prepare.slots = c.step_slots_.data();
  prepare.started = c.started_dev_.data();
  prepare.out = c.step_scalars_.data();
  prepare.control = c.control_.data();
  launch(c.exec_, c.groups_.size(), prepare);
  c.with_reduced_grads([&](const auto* grads) { stages.run_device(c, grads); });
  wait_pending(c);
  c.mirror_stale_ = true;
}

}  // namespace distopt::detail
