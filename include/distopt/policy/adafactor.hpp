// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
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

/// Adafactor (Shazeer and Stern, 2018) as transformers.optimization.Adafactor: factored
/// second moments (moving averages of row and column means of grad^2 + eps[0]) for tensors
/// with two or more dimensions, a full one otherwise; the update's RMS clipped at
/// clip_threshold; the relative step size min(1e-2 or 1e-6 * step, 1 / sqrt(step)) scaled
/// by max(eps[1], RMS(param)) per tensor; optional first moment (beta1) and weight decay.
///
/// Three phases: (0) sum p^2 per tensor and grad^2 + eps[0] per row and column, then
/// update the row/column states; (1) form the update, sum its squares per tensor; (2) clip,
/// scale by lr, first moment, weight decay, apply. Per element state: 0 exp_avg_sq
/// (unfactored tensors only), 1 exp_avg (with beta1). Per row / column: exp_avg_sq_row/col.
struct adafactor {
  static constexpr std::string_view name = "adafactor";
  static constexpr int max_state_slots = 2;
  static constexpr int min_state_slots = 1;  // the update loops are built for 1..max_state_slots

  /// transformers' Adafactor arguments and defaults (lr and beta1 may be None).
  struct hyper_params {
    std::optional<double> lr{};
    std::array<double, 2> eps{1e-30, 1e-3};
    double clip_threshold = 1.0;
    double decay_rate = -0.8;
    std::optional<double> beta1{};
    double weight_decay = 0.0;
    bool scale_parameter = true;
    bool relative_step = true;
    bool warmup_init = false;

    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, std::optional<double>>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, double>{"clip_threshold", &hyper_params::clip_threshold},
          hyper_field<hyper_params, double>{"decay_rate", &hyper_params::decay_rate},
          hyper_field<hyper_params, std::optional<double>>{"beta1", &hyper_params::beta1},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
          hyper_field<hyper_params, bool>{"scale_parameter", &hyper_params::scale_parameter},
          hyper_field<hyper_params, bool>{"relative_step", &hyper_params::relative_step},
          hyper_field<hyper_params, bool>{"warmup_init", &hyper_params::warmup_init}};
    }

    void validate() const {
      if (lr && relative_step)
        throw invalid_hyper_parameter(
            "adafactor: lr " + detail::format_number(*lr) +
            " cannot be combined with relative_step=true (set lr=None, or relative_step=false)");
      if (!lr && !relative_step)
        throw invalid_hyper_parameter("adafactor: lr is None and relative_step is false: give an lr");
      if (warmup_init && !relative_step)
        throw invalid_hyper_parameter("adafactor: warmup_init=true requires relative_step=true");
      if (lr) require_lr(name, *lr);
      for (int i = 0; i < 2; ++i)
        require(std::isfinite(eps[i]) && eps[i] >= 0.0, name, i ? "eps[1]" : "eps[0]", eps[i],
                "must be a finite value >= 0");
      require(std::isfinite(clip_threshold) && clip_threshold > 0.0, name, "clip_threshold",
              clip_threshold, "must be a finite value > 0");
      require(std::isfinite(decay_rate) && decay_rate < 0.0, name, "decay_rate", decay_rate,
              "must be a finite value < 0 (beta2 = 1 - step^decay_rate)");
      if (beta1) require(*beta1 >= 0.0 && *beta1 < 1.0, name, "beta1", *beta1, "must be in [0, 1) or None");
      require_weight_decay(name, weight_decay);
    }
  };

  static int state_slots(const hyper_params& h) { return h.beta1 ? 2 : 1; }

  struct scalars {
    float beta2t, one_minus_beta2t, eps0;
    float beta1, one_minus_beta1;
    float use_first_moment;  // 1 with beta1, else 0
    double relative_step;    // lr, or the relative step size
    double eps1, clip_threshold, weight_decay;
    bool scale_parameter;
  };

  static scalars prepare(const hyper_params& h, const step_info& s) {
    const double step = static_cast<double>(s.step);
    const double beta2t = 1.0 - std::pow(step, h.decay_rate);
    double rel = h.lr.value_or(0.0);
    if (h.relative_step) {
      const double min_step = h.warmup_init ? 1e-6 * step : 1e-2;
      rel = std::min(min_step, 1.0 / std::sqrt(step));
    }
    const double b1 = h.beta1.value_or(0.0);
    return {static_cast<float>(beta2t), static_cast<float>(1.0 - beta2t), static_cast<float>(h.eps[0]),
            static_cast<float>(b1), static_cast<float>(1.0 - b1), h.beta1 ? 1.0f : 0.0f,
            rel, h.eps[1], h.clip_threshold, h.weight_decay, h.scale_parameter};
  }

  // ---- layer-wise declaration ----
  static constexpr std::array<phase_spec, 3> phases{{
      {.tensor_sums = 1, .row_sums = 1, .col_sums = 1, .reads_param = true, .row_state_totals = true},
      {.tensor_sums = 1, .reads_param = false, .reads_slots = 1u, .writes_slots = 1u},
      {.reads_param = true, .writes_param = true, .reads_slots = 3u, .writes_slots = 2u},
  }};
  /// Tensor values: 0 lr, 1 the clipping divisor max(1, RMS(update) / clip_threshold),
  /// 2 -weight_decay * lr.
  static constexpr int tensor_values = 3;
  static constexpr int row_values = 1, col_values = 1;  // the approximation's factors
  static constexpr int row_states = 1, col_states = 1;  // exp_avg_sq_row, exp_avg_sq_col

  static bool factored(const hyper_params&, std::span<const std::int64_t> shape) {
    return detail::has_matrix_shape(shape);
  }
  /// A factored tensor keeps no slot, or exp_avg (slot 1) with beta1.
  static constexpr std::array<unsigned, 2> factored_slots{0u, 2u};
  static bool uses_slot(const hyper_params& h, int slot, bool factored) {
    return slot == 0 ? !factored : h.beta1.has_value();
  }

  template <int Phase, bool Factored>
  DISTOPT_HD static void element(const scalars& s, const element_stats& e, float& p, float g,
                                 float* state, float* sums) {
    if constexpr (Phase == 0) {
      sums[0] = p * p;
      if constexpr (Factored) {
        const float q = g * g + s.eps0;
        sums[1] = q;
        sums[2] = q;
      }
    } else if constexpr (Phase == 1) {
      if constexpr (!Factored) state[0] = state[0] * s.beta2t + s.one_minus_beta2t * (g * g + s.eps0);
      const float u = detail::factored_update<Factored>(e, g, state[0]);
      sums[0] = u * u;
    } else {
      float u = detail::factored_update<Factored>(e, g, state[0]) / e.tensor[1];
      u = u * e.tensor[0];
      const float m = state[1] * s.beta1 + s.one_minus_beta1 * u;
      state[1] = m;
      u = s.use_first_moment > 0.5f ? m : u;
      p = p + e.tensor[2] * p;
      p = p + (-u);
    }
  }

  template <int Phase>
  static void update_factors(const hyper_params&, const scalars& s, tensor_stats& t) {
    if constexpr (Phase == 0) {
      if (t.factored) detail::update_factor_states(t, 0, 0, s.beta2t, s.one_minus_beta2t);
    }
  }

  template <int Phase>
  static void finish(const hyper_params&, const scalars& s, tensor_stats& t) {
    if constexpr (Phase == 0) {
      double lr = s.relative_step;
      if (s.scale_parameter)
        lr = std::max(s.eps1, static_cast<double>(detail::rms_from_sum(t.sums[0], t.numel))) * lr;
      t.values[0] = static_cast<float>(lr);
      t.values[2] = static_cast<float>(-s.weight_decay * static_cast<double>(t.values[0]));
      if (t.factored) detail::approx_factors(t, 0, 0);
    } else if constexpr (Phase == 1) {
      const float rms = detail::rms_from_sum(t.sums[0], t.numel);
      t.values[1] = std::max(rms / static_cast<float>(s.clip_threshold), 1.0f);
    }
  }
};

}  // namespace distopt
