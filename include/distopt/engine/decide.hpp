// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file A step's decisions and what the stages read of them, as functions of the context,
/// one path on every executor: the norm's exact sums (engine/norm.hpp), then the phases of
/// engine/decisions.hpp in the executor's memory (whether the step is skipped, its gradient
/// scale, the step counter, the loss scaler's update, the master weights' first load, each
/// group's scalars). The stages read them there (the update phases) or from the host's copy
/// (engine/mirror.hpp) where they decide something on the host.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "../concepts.hpp"
#include "../detail/layout_check.hpp"
#include "../norm_part.hpp"
#include "collectives.hpp"
#include "decisions.hpp"
#include "elementwise.hpp"
#include "mirror.hpp"
#include "norm.hpp"
#include "phases.hpp"

namespace distopt::detail {

/// The master load phase over this rank's pieces; with `control`, as the step decided.
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
  c.decisions_changed_ = true;  // the control learns it before the next step
}

/// Each group's scalars for the step just decided, into step_scalars_: prepare_phase on the
/// executor, or, where the executor runs device code only (cuda) and the policy's prepare
/// runs on the host only (`OnExecutor` false: the layer-wise policies, GaLore, Muon), the
/// same prepare_group on the host over the host's copy of the decision.
template <bool OnExecutor, class Ctx>
void prepare_groups(Ctx& c) {
  using Policy = typename Ctx::policy_type;
  if constexpr (OnExecutor || runs_host_functions<typename Ctx::executor_type>) {
    prepare_phase<Policy> prepare;
    if constexpr (host_memory<typename Ctx::executor_type>) prepare.groups = c.groups_.data();
    else prepare.groups = c.groups_dev_.data();
    prepare.slots = c.step_slots_.data();
    prepare.started = c.started_dev_.data();
    prepare.out = c.step_scalars_.data();
    prepare.control = c.control_.data();
    launch(c.exec_, c.groups_.size(), prepare);
  } else {
    sync_decisions(c);
    if (c.last_result_.skipped) return;
    const std::vector<int> slots = c.group_slots();
    std::vector<unsigned char> started(c.state_started_.begin(), c.state_started_.end());
    std::vector<typename Policy::scalars> out(c.groups_.size());
    for (std::size_t g = 0; g < out.size(); ++g)
      prepare_group<Policy>(c.groups_[g], slots[g], started[g], c.step_, out[g]);
    c.to_exec(out, c.step_scalars_);
    c.to_exec(started, c.started_dev_);
    c.state_started_.assign(started.begin(), started.end());
  }
}

/// The constants of this step's decision (engine/decisions.hpp), from the options, the
/// loss scaler and clip_grad_norm's result.
template <class Ctx>
step_rules rules_of(const Ctx& c) {
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
  return rules;
}

/// Whether the decision needs the norm computed here (clip_grad_norm gave it otherwise).
inline bool needs_norm(const step_rules& r) noexcept { return !r.clip && (r.check || r.max_norm > 0.0); }

/// Decides the step in the executor's memory from `wire` (the all-reduced squared norm in
/// the executor's memory, or null): the decide phase, the master weights' first load, each
/// group's scalars (`OnExecutor`: prepare_groups). The grads were reduced.
template <bool OnExecutor, class Ctx>
void decide_from(Ctx& c, const step_rules& rules, const double* wire) {
  c.clip_.reset();
  next_step_grads(c);
  decide_phase decide;
  decide.wire = wire;
  decide.rules = rules;
  decide.control = c.control_.data();
  launch(c.exec_, 1, decide);
  c.mirror_stale_ = true;
  c.params_told_ = 0;
  if (c.uses_master()) launch_master_load(c, c.control_.data());  // loads at the first step taken
  prepare_groups<OnExecutor>(c);
}

/// Decides the step in the executor's memory: the grads reduced, the norm's wire image
/// (unless clip_grad_norm gave the norm, or nothing needs it), then decide_from.
template <bool OnExecutor, class Ctx>
void decide(Ctx& c) {
  push_decisions(c);
  reduce_grads(c);
  const step_rules rules = rules_of(c);
  decide_from<OnExecutor>(c, rules, needs_norm(rules) ? norm_wire(c) : nullptr);
}

/// A joint step's first half (distopt::joint_step): the grads reduced, and this
/// optimizer's part of the norm, its exact sum of squares over its DP and TP ranks, summed
/// over `across` too when given, else over the expert-parallel group when one is set; a
/// part not computed() when its decision needs no norm.
template <class Ctx, class Comm>
norm_part norm_part_of(Ctx& c, Comm* across) {
  if (!across && c.ep_) across = &*c.ep_;  // checked when set
  else check_experts_held(c.layout_, across ? across->size() : 1, "distopt::joint_step");  // before any collective
  end_param_gathers(c, "joint_step()");
  if (c.clip_)
    throw std::logic_error("distopt::joint_step: clip_grad_norm was called on one optimizer, and gives its norm "
                           "alone; clip a joint step by optimizer_options::max_grad_norm, set the same on each");
  push_decisions(c);
  reduce_grads(c);
  if (!needs_norm(rules_of(c))) return norm_part(false);
  norm_part part;
  copy_bytes(c.exec_, part.wire().data(), norm_wire(c), sizeof(double) * norm_part::wire_size);
  if (across && across->size() > 1) c.comms_.all_reduce_host(c.exec_, *across, part.wire(), reduce_op::sum);
  return part;
}

/// A joint step's decision, on `total` (every optimizer's part added, the same on every
/// rank): decide_from with it copied to the executor's memory.
template <bool OnExecutor, class Ctx>
void decide_on(Ctx& c, const norm_part& total) {
  const step_rules rules = rules_of(c);
  const double* wire = nullptr;
  if (needs_norm(rules)) {
    if (!total.computed())
      throw std::logic_error("distopt::joint_step: this optimizer checks finiteness or clips, and the total "
                             "norm holds no part");
    copy_bytes(c.exec_, c.norm_wire_.data(), total.wire().data(), sizeof(double) * norm_part::wire_size);
    wire = c.norm_wire_.data();
  }
  decide_from<OnExecutor>(c, rules, wire);
}

/// Whether the host reads this step's decision before the stages run: on executors of host
/// memory (a copy costs nothing there, and a skipped step then runs no stage), and where
/// the host decides something itself (`host_decides`: a matrix stage, the layer-wise
/// hooks; percentile clipping). On a device otherwise, the stages run as the device decided.
template <class Ctx>
bool decision_on_host(const Ctx& c, bool host_decides) {
  return host_memory<typename Ctx::executor_type> || host_decides || c.options_.percentile_clipping < 100;
}

/// What the update phases of a step read, the decision's control among them; with
/// `host_decides`, also the host's copies of the group scalars (matrix stages), and the
/// percentile clipping scales computed (on the host). False when the host knows the step
/// was skipped: nothing is to run.
template <class Ctx, class G>
bool step_inputs_of(Ctx& c, const G* grads, bool host_decides, step_inputs<typename Ctx::policy_type, G>& in,
                    std::vector<typename Ctx::policy_type::scalars>& host_scalars) {
  if (decision_on_host(c, host_decides)) {
    sync_decisions(c);
    if (c.last_result_.skipped) return false;
    if (c.options_.percentile_clipping < 100)
      percentile_scales(c, c.control_host_.clip_coef, c.control_host_.step_loss_scale);
    if (host_decides) {
      host_scalars.resize(c.groups_.size());
      copy_bytes(c.exec_, host_scalars.data(), c.step_scalars_.data(), host_scalars.size() * sizeof(host_scalars[0]));
    }
  }
  in.scalars = c.step_scalars_.data();
  in.slots = c.step_slots_.data();
  in.tensor_scale = c.clip_scale_.empty() ? nullptr : c.in_exec(c.clip_scale_, c.step_clip_scale_);
  in.grads = grads;
  in.grads_local = c.template grads_local<G>();
  in.control = c.control_.data();
  in.grad_scale = c.control_host_.grad_scale;  // the host's copies, where it read them
  in.key = c.control_host_.key;
  in.host_scalars = &host_scalars;
  in.active = c.group_slots();
  return true;
}

/// After the stages: every all-gather they started waited for, and the listener (offload)
/// told of every bucket of a step taken. On an executor of host memory the host's copy of
/// the decision is read here (a copy costs nothing there), so that the const reads that
/// follow (step_count, loss_scale) only read, as a host's did before decisions were made
/// in the executor's memory.
template <class Ctx>
void finish_step(Ctx& c) {
  wait_pending(c);
  if (host_memory<typename Ctx::executor_type> || c.params_done_) sync_decisions(c);
  if (c.params_done_ && !c.last_result_.skipped) tell_params(c, c.plan_.buckets().size(), true);
}

}  // namespace distopt::detail
