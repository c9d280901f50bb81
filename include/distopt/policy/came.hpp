// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <tuple>

#include "../config.hpp"
#include "../engine/layerwise.hpp"
#include "../layerwise.hpp"
#include "../step_info.hpp"
#include "factored.hpp"
#include "hyper_params.hpp"

namespace distopt {

/// CAME (Luo et al., "CAME: Confidence-guided Adaptive Memory Efficient Optimization") as
/// the authors' came-pytorch (0.1.3): Adafactor's factored second moment (beta2) and RMS
/// clipping, a first moment (beta1), and a second factored moving average (beta3) of the
/// instability (update - exp_avg)^2 + eps[1], whose rank-1 approximation scales exp_avg.
/// The two factored averages are kept apart at every step.
///
/// Four phases: (0) grad^2 + eps[0] per row and column, update the second-moment factors;
/// (1) form the update, sum its squares; (2) clip, update exp_avg, instability per row and
/// column, update the instability factors; (3) weight decay and the confidence-scaled
/// step. Per element state: 0 exp_avg, 1 exp_avg_sq (unfactored tensors only). Per row /
/// column: 0 exp_avg_sq_row/col, 1 exp_avg_res_row/col.
struct came {
  static constexpr std::string_view name = "came";
  static constexpr int max_state_slots = 2;
  static constexpr int min_state_slots = 2;  // the update loops are built for 2..max_state_slots

  /// came-pytorch's arguments and defaults (it has no default lr; ours is the paper's 2e-4).
  struct hyper_params {
    double lr = 2e-4;
    std::array<double, 2> eps{1e-30, 1e-16};
    double clip_threshold = 1.0;
    std::array<double, 3> betas{0.9, 0.999, 0.9999};
    double weight_decay = 0.0;

    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, double>{"clip_threshold", &hyper_params::clip_threshold},
          hyper_field<hyper_params, std::array<double, 3>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay}};
    }

    void validate() const {
      require(std::isfinite(lr) && lr > 0.0, name, "lr", lr, "must be a finite value > 0");
      for (int i = 0; i < 2; ++i)
        require(std::isfinite(eps[i]) && eps[i] >= 0.0, name, i ? "eps[1]" : "eps[0]", eps[i],
                "must be a finite value >= 0");
      require(std::isfinite(clip_threshold) && clip_threshold > 0.0, name, "clip_threshold",
              clip_threshold, "must be a finite value > 0");
      for (int i = 0; i < 3; ++i)
        require(betas[i] >= 0.0 && betas[i] <= 1.0, name, "betas[" + std::to_string(i) + "]",
                betas[i], "must be in [0, 1]");
      require_weight_decay(name, weight_decay);
    }
  };

  static int state_slots(const hyper_params&) { return 2; }

  struct scalars {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3;
    float eps0, eps1, lr, neg_wd_lr;
    double clip_threshold;
  };

  static scalars prepare(const hyper_params& h, const step_info&) {
    return {static_cast<float>(h.betas[0]), static_cast<float>(1.0 - h.betas[0]),
            static_cast<float>(h.betas[1]), static_cast<float>(1.0 - h.betas[1]),
            static_cast<float>(h.betas[2]), static_cast<float>(1.0 - h.betas[2]),
            static_cast<float>(h.eps[0]),   static_cast<float>(h.eps[1]),
            static_cast<float>(h.lr),       static_cast<float>(-h.weight_decay * h.lr),
            h.clip_threshold};
  }

  // ---- layer-wise declaration ----
  static constexpr std::array<phase_spec, 4> phases{{
      {.row_sums = 1, .col_sums = 1, .reads_param = false, .row_state_totals = true},
      {.tensor_sums = 1, .reads_param = false, .reads_slots = 2u, .writes_slots = 2u},
      {.row_sums = 1, .col_sums = 1, .reads_param = false, .reads_slots = 3u, .writes_slots = 1u,
       .row_state_totals = true},
      {.reads_param = true, .writes_param = true, .reads_slots = 1u},
  }};
  static constexpr int tensor_values = 1;  // the clipping divisor
  static constexpr int row_values = 2, col_values = 2;  // factors of exp_avg_sq, of exp_avg_res
  static constexpr int row_states = 2, col_states = 2;

  static bool factored(const hyper_params&, std::span<const std::int64_t> shape) {
    return detail::has_matrix_shape(shape);
  }
  static constexpr unsigned factored_slots = 1u;  // a factored tensor keeps exp_avg only
  static bool uses_slot(const hyper_params&, int slot, bool factored) { return slot == 0 || !factored; }

  template <int Phase, bool Factored>
  DISTOPT_HD static void element(const scalars& s, const element_stats& e, float& p, float g,
                                 float* state, float* sums) {
    if constexpr (Phase == 0) {
      if constexpr (Factored) {
        const float q = g * g + s.eps0;
        sums[0] = q;
        sums[1] = q;
      }
    } else if constexpr (Phase == 1) {
      if constexpr (!Factored) state[1] = state[1] * s.beta2 + s.one_minus_beta2 * (g * g + s.eps0);
      const float u = detail::factored_update<Factored>(e, g, state[1]);
      sums[0] = u * u;
    } else if constexpr (Phase == 2) {
      const float u = detail::factored_update<Factored>(e, g, state[1]) / e.tensor[0];
      const float m = state[0] * s.beta1 + s.one_minus_beta1 * u;
      state[0] = m;
      if constexpr (Factored) {
        const float d = u - m;
        const float res = d * d + s.eps1;
        sums[0] = res;
        sums[1] = res;
      }
    } else {
      float update;
      if constexpr (Factored) update = (e.row[1] * e.col[1]) * state[0];
      else update = state[0];
      p = p + s.neg_wd_lr * p;
      p = p + (-(update * s.lr));
    }
  }

  template <int Phase>
  static void update_factors(const hyper_params&, const scalars& s, tensor_stats& t) {
    if (!t.factored) return;
    if constexpr (Phase == 0) detail::update_factor_states(t, 0, 0, s.beta2, s.one_minus_beta2);
    else if constexpr (Phase == 2) detail::update_factor_states(t, 1, 0, s.beta3, s.one_minus_beta3);
  }

  template <int Phase>
  static void finish(const hyper_params&, const scalars& s, tensor_stats& t) {
    if constexpr (Phase == 0) {
      if (t.factored) detail::approx_factors(t, 0, 0);
    } else if constexpr (Phase == 1) {
      t.values[0] = std::max(detail::rms_from_sum(t.sums[0], t.numel) / static_cast<float>(s.clip_threshold), 1.0f);
    } else if constexpr (Phase == 2) {
      if (t.factored) detail::approx_factors(t, 1, 1);
    }
  }
};

}  // namespace distopt
