// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The step's decisions as phases, on every executor. Whether a step is skipped, its
/// gradient scale, the step counter, the loss scale and the stochastic-rounding key live in
/// one `step_control` in the executor's memory (host memory on cpu). The phases below
/// compute them there, and the update phases read them (update_phase, q8_update_phase): on
/// a device a step needs no copy to or from the host, so a GPU's host thread never waits
/// for it, and the whole step can be captured into a CUDA graph and replayed. The host reads
/// them (one copy, engine/mirror.hpp) where it decides something itself: percentile
/// clipping's history, the layer-wise hooks, GaLore's refresh, Muon.
///
/// The arithmetic: the exact norm from the exact sums of the squares phase, the finite
/// check, clip coefficient / loss scale, GradScaler's update, and each group's scalars by
/// Policy::prepare (prepare_group: a DISTOPT_HD function where the policy runs on a device).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../config.hpp"
#include "../detail/exact_sum.hpp"
#include "../step_info.hpp"
#include "../types/rounding.hpp"

namespace distopt::detail {

/// What persists from step to step on the device, and what the last step decided.
struct step_control {
  std::int64_t step = 0;            ///< steps taken
  std::int64_t growth_tracker = 0;  ///< clean steps since the loss scale last changed
  double loss_scale = 1.0;          ///< 1 without loss scaling
  double grad_norm = 0.0;           ///< the last step's global norm (NaN when not computed)
  std::uint64_t key = 0;            ///< the last step's stochastic-rounding key
  float grad_scale = 1.0f;          ///< the last step's clip coefficient / loss scale
  double clip_coef = 1.0;           ///< the last step's clip coefficient
  double step_loss_scale = 1.0;     ///< the loss scale the last step's grads were scaled by
  int skipped = 0;                  ///< the last step was skipped (a NaN or Inf gradient)
  int master_ready = 0;             ///< the fp32 master weights hold the params
  int load_master = 0;              ///< this step loads them first (its first step not skipped)
};

/// torch.nn.utils.clip_grad_norm_'s factor, min(1, max_norm / (norm + 1e-6)); 1 for a NaN norm.
DISTOPT_HD inline double clip_coefficient(double max_norm, double norm) noexcept {
  const double q = max_norm / (norm + 1e-6);
  return q < 1.0 ? q : 1.0;
}

/// The constants of one decision, from the host (options and clip_grad_norm's result).
struct step_rules {
  bool check = false;     ///< check_finite or loss scaling: a non-finite norm skips
  bool clip = false;      ///< clip_grad_norm was called: its norm and coefficient below
  bool scaler = false;    ///< dynamic loss scaling
  bool master = false;    ///< fp32 master weights: loaded from the params at the first step taken
  double clip_norm = 0.0, clip_coef = 1.0;
  double max_norm = 0.0;  ///< optimizer_options::max_grad_norm: clip by the norm computed here (0 = off)
  double growth_factor = 2.0, backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  std::uint64_t seed = 0;
};

/// The sum of `items` exact sums as a wire image (`wire[exact_sum::wire_size]`), ready for
/// an all-reduce over ranks. One item of size 1.
struct norm_wire_phase {
  const exact_sum* sums = nullptr;
  std::size_t items = 0;
  double* wire = nullptr;
  DISTOPT_HD std::size_t size(std::size_t) const noexcept { return 1; }
  DISTOPT_HD void operator()(std::size_t, std::size_t, std::size_t) const {
    exact_sum total;
    for (std::size_t i = 0; i < items; ++i) total.add(sums[i]);
    total.to_wire(wire);
  }
};

/// Decides the step: norm (from `wire`, or NaN when it is null), skip, gradient scale,
/// step counter, key, and the loss scaler's update. One item of size 1.
struct decide_phase {
  const double* wire = nullptr;  ///< the all-reduced squared norm, or null
  step_rules rules;
  step_control* control = nullptr;

  DISTOPT_HD std::size_t size(std::size_t) const noexcept { return 1; }
  DISTOPT_HD void operator()(std::size_t, std::size_t, std::size_t) const {
    step_control& c = *control;
    double norm = bits_to_double(0x7ff8000000000000ull);  // NaN: not computed
    double coef = 1.0;
    if (rules.clip) {
      norm = rules.clip_norm;
      coef = rules.clip_coef;
    } else if (wire) {
      norm = std::sqrt(exact_sum::from_wire(wire).value());
      if (rules.max_norm > 0.0) coef = clip_coefficient(rules.max_norm, norm);
    }
    c.grad_norm = norm;
    c.clip_coef = coef;
    c.step_loss_scale = c.loss_scale;
    c.skipped = rules.check && !(norm - norm == 0.0);  // NaN or Inf
    c.load_master = rules.master && !c.skipped && !c.master_ready;
    if (c.load_master) c.master_ready = 1;
    if (c.skipped) {
      if (rules.scaler) {
        c.loss_scale *= rules.backoff_factor;
        c.growth_tracker = 0;
      }
      return;
    }
    ++c.step;
    c.grad_scale = static_cast<float>(coef / c.loss_scale);
    c.key = step_key(rules.seed, c.step);
    if (rules.scaler && ++c.growth_tracker == rules.growth_interval) {
      c.loss_scale *= rules.growth_factor;
      c.growth_tracker = 0;
    }
  }
};

/// Group g's scalars for step `step` (Policy::prepare), and `started` set where the group
/// keeps state: step_info::fresh_state is its first step with state in use. The one place
/// that computes a group's scalars: prepare_phase runs it on the executor, and the host for
/// a policy whose prepare runs on the host only on a device of device code only (cuda).
DISTOPT_HD_CALLS_HOST
template <class Policy>
DISTOPT_HD void prepare_group(const typename Policy::hyper_params& h, int slots, unsigned char& started,
                              std::int64_t step, typename Policy::scalars& out) {
  out = Policy::prepare(h, step_info{step, slots > 0 && !started});
  if (slots > 0) started = 1;
}

/// Each group's scalars for the step just decided (item g), unless it was skipped.
template <class Policy>
struct prepare_phase {
  const typename Policy::hyper_params* groups = nullptr;
  const int* slots = nullptr;  ///< per group, state slots in use
  unsigned char* started = nullptr;
  typename Policy::scalars* out = nullptr;
  const step_control* control = nullptr;

  DISTOPT_HD std::size_t size(std::size_t) const noexcept { return 1; }
  DISTOPT_HD void operator()(std::size_t g, std::size_t, std::size_t) const {
    if (!control->skipped) prepare_group<Policy>(groups[g], slots[g], started[g], control->step, out[g]);
  }
};

}  // namespace distopt::detail
