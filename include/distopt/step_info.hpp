// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <cstdint>

namespace distopt {

/// What a policy's host-side `prepare` sees about the step being taken.
struct step_info {
  /// The step being taken, counting from 1 (as PyTorch's `state["step"]` after its increment).
  std::int64_t step = 1;
  /// True on the group's first step with state in use (its slots still hold zeros), like
  /// PyTorch's lazily created buffers: a momentum switched on later starts from the gradient.
  bool fresh_state = true;
};

/// What `optimizer::step()` reports.
struct step_result {
  /// True when the step was skipped because a gradient was NaN or Inf; params and states are untouched.
  bool skipped = false;
  /// True when a non-finite gradient was found (skipped == found_inf in this version).
  bool found_inf = false;
  /// The global gradient norm when it was computed (clip_grad_norm), otherwise NaN.
  double grad_norm = 0.0 / 0.0;
  /// The number of steps taken so far, after this one.
  std::int64_t step = 0;
  /// The loss scale to use for the next backward pass (1 without loss scaling).
  double loss_scale = 1.0;
};

/// What `optimizer::step()` returns on a device executor: the step's outcome stays in device
/// memory until it is read here (a synchronisation). Read it before the next step().
template <class Optimizer>
class step_ticket {
 public:
  step_ticket(const Optimizer& o, std::int64_t call) noexcept : opt_(&o), call_(call) {}
  /// The step's result, copied from the device.
  step_result get() const { return opt_->step_outcome(call_); }
  operator step_result() const { return get(); }  // NOLINT: reads like the host executors' step_result

 private:
  const Optimizer* opt_;
  std::int64_t call_;
};

}  // namespace distopt
