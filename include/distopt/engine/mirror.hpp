// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The host's copy of the step's decisions (step counter, loss scaler, which groups'
/// states have started, master weights loaded, the last step's result) and the device's
/// (the step_control of engine/decisions.hpp in the executor's memory): each is brought up
/// to date from the other when it changed, by one copy.

#include <cstddef>
#include <type_traits>
#include <vector>

#include "../concepts.hpp"
#include "../detail/buffer.hpp"
#include "../detail/exact_sum.hpp"
#include "../exec/transfer.hpp"
#include "decisions.hpp"

namespace distopt::detail {

/// Refreshes the host's copy of the decisions when steps were decided since it was last
/// read: one copy from the executor's memory (on a device, a synchronisation).
template <class Ctx>
void sync_decisions(const Ctx& c) {
  if (!c.mirror_stale_) return;
  step_control& s = c.control_host_;
  copy_bytes(c.exec_, &s, c.control_.data(), sizeof s);
  std::vector<unsigned char> started(c.groups_.size());
  copy_bytes(c.exec_, started.data(), c.started_dev_.data(), started.size());
  c.step_ = s.step;
  if (c.scaler_) c.scaler_->restore(s.loss_scale, s.growth_tracker);
  c.state_started_.assign(started.begin(), started.end());
  c.master_ready_ = s.master_ready != 0;
  c.last_result_ = step_result{s.skipped != 0, s.skipped != 0, s.grad_norm, s.step, c.scaler_ ? s.loss_scale : 1.0};
  c.mirror_stale_ = false;
}

/// The loss scale of the next step (1 without loss scaling), from the host's copy.
template <class Ctx>
double loss_scale_of(const Ctx& c) {
  sync_decisions(c);
  return c.scaler_ ? c.scaler_->scale() : 1.0;
}

/// Copies what the host changed of the decisions (after construction, set_hyper, a
/// checkpoint load, the master weights loaded) to the executor's memory, where the next
/// step reads it.
template <class Ctx>
void push_decisions(Ctx& c) {
  using Exec = typename Ctx::executor_type;
  static_assert(host_memory<Exec> || std::is_trivially_copyable_v<typename Ctx::hyper_params>,
                "distopt: a device executor reads the hyper-parameters in its memory: they must be trivially copyable");
  if (c.control_.size() == 0) {
    c.control_ = buffer<step_control, Exec>(c.exec_, 1);
    c.norm_wire_ = buffer<double, Exec>(c.exec_, exact_sum::wire_size);
    c.step_scalars_ = buffer<typename Ctx::policy_type::scalars, Exec>(c.exec_, c.groups_.size());
  }
  if (c.decisions_changed_) {
    sync_decisions(c);
    step_control s;
    s.step = c.step_;
    s.loss_scale = c.scaler_ ? c.scaler_->scale() : 1.0;
    s.growth_tracker = c.scaler_ ? c.scaler_->growth_tracker() : 0;
    s.master_ready = c.master_ready_;
    copy_bytes(c.exec_, c.control_.data(), &s, sizeof s);
    c.control_host_ = s;
    std::vector<unsigned char> started(c.groups_.size());
    for (std::size_t g = 0; g < c.groups_.size(); ++g) started[g] = g < c.state_started_.size() && c.state_started_[g];
    c.to_exec(started, c.started_dev_);
    c.decisions_changed_ = false;
  }
  if (c.groups_changed_) {  // set_hyper: the hyper-parameters and slot counts only
    if constexpr (!host_memory<Exec>) c.to_exec(c.groups_, c.groups_dev_);  // (a host reads groups_ in place)
    c.to_exec(c.group_slots(), c.step_slots_);
    c.groups_changed_ = false;
  }
}

}  // namespace distopt::detail
