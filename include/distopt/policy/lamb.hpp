// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <tuple>

#include "../config.hpp"
#include "../engine/layerwise.hpp"
#include "../layerwise.hpp"
#include "../step_info.hpp"
#include "hyper_params.hpp"

namespace distopt {

/// Lamb (You et al., "Large Batch Optimization for Deep Learning"), following
/// torch-optimizer's Lamb (0.3.0): Adam moments without bias correction (unless `debias`),
/// the Adam step u = m / (sqrt(v) + eps) + weight_decay * p, and the per-tensor trust
/// ratio min(||p||, clamp_value) / ||u|| (1 when either norm is 0).
///
/// apex's FusedLAMB differs in defaults, offered as options: bias correction on
/// (`debias=true`), no clamp (`clamp_value=inf`), and the trust ratio applied only to
/// tensors with weight decay unless use_nvlamb (`always_adapt=false`). `adam=true` uses a
/// trust ratio of 1 (Adam with Lamb's update form).
///
/// Two phases: (0) update the moments and sum p^2 and u^2 per tensor; (1) recompute u from
/// the stored moments and apply it with the trust ratio. Per element state: 0 exp_avg,
/// 1 exp_avg_sq.
struct lamb {
  static constexpr std::string_view name = "lamb";
  static constexpr int max_state_slots = 2;
  static constexpr int min_state_slots = 2;  // the update loops are built for 2..max_state_slots

  /// torch-optimizer's Lamb arguments and defaults, plus apex's always_adapt.
  struct hyper_params {
    double lr = 1e-3;
    std::array<double, 2> betas{0.9, 0.999};
    double eps = 1e-6;
    double weight_decay = 0.0;
    double clamp_value = 10.0;
    bool adam = false;
    bool debias = false;
    bool always_adapt = true;

    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
          hyper_field<hyper_params, double>{"clamp_value", &hyper_params::clamp_value},
          hyper_field<hyper_params, bool>{"adam", &hyper_params::adam},
          hyper_field<hyper_params, bool>{"debias", &hyper_params::debias},
          hyper_field<hyper_params, bool>{"always_adapt", &hyper_params::always_adapt}};
    }

    void validate() const {
      require_lr(name, lr);
      require(std::isfinite(eps) && eps >= 0.0, name, "eps", eps, "must be a finite value >= 0");
      require_betas(name, betas);
      require_weight_decay(name, weight_decay);
      require(clamp_value >= 0.0 && clamp_value == clamp_value, name, "clamp_value", clamp_value,
              "must be >= 0 (inf: no clamp)");
    }
  };

  static int state_slots(const hyper_params&) { return 2; }

  struct scalars {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    double step_size;   // lr, times the bias correction with debias
    double clamp_value;
    bool adapt;         // false: trust ratio 1 (adam, or no weight decay without always_adapt)
  };

  static scalars prepare(const hyper_params& h, const step_info& s) {
    const double step = static_cast<double>(s.step);
    double correction = 1.0;
    if (h.debias)
      correction = std::sqrt(1.0 - std::pow(h.betas[1], step)) / (1.0 - std::pow(h.betas[0], step));
    return {static_cast<float>(h.betas[0]),
            static_cast<float>(1.0 - h.betas[0]),
            static_cast<float>(h.betas[1]),
            static_cast<float>(1.0 - h.betas[1]),
            static_cast<float>(h.eps),
            static_cast<float>(h.weight_decay),
            h.lr * correction,
            h.clamp_value,
            !h.adam && (h.always_adapt || h.weight_decay != 0.0)};
  }

  // ---- layer-wise declaration ----
  static constexpr std::array<phase_spec, 2> phases{{
      {.tensor_sums = 2, .reads_param = true, .reads_slots = 3u, .writes_slots = 3u},
      {.reads_param = true, .writes_param = true, .reads_slots = 3u},
  }};
  static constexpr int tensor_values = 1;  // -step_size * trust_ratio
  static constexpr int row_values = 0, col_values = 0, row_states = 0, col_states = 0;

  static bool factored(const hyper_params&, std::span<const std::int64_t>) { return false; }
  static bool uses_slot(const hyper_params&, int, bool) { return true; }

  template <int Phase, bool Factored>
  DISTOPT_HD static void element(const scalars& s, const element_stats& e, float& p, float g,
                                 float* state, float* sums) {
    float& m = state[0];
    float& v = state[1];
    if constexpr (Phase == 0) {
      m = m * s.beta1 + s.one_minus_beta1 * g;
      v = v * s.beta2 + (s.one_minus_beta2 * g) * g;
    }
    const float u = m / (std::sqrt(v) + s.eps) + s.weight_decay * p;
    if constexpr (Phase == 0) {
      sums[0] = p * p;
      sums[1] = u * u;
    } else {
      p = p + e.tensor[0] * u;
    }
  }

  template <int Phase>
  static void finish(const hyper_params&, const scalars& s, tensor_stats& t) {
    if constexpr (Phase == 0) {
      float weight_norm = static_cast<float>(std::sqrt(t.sums[0]));
      if (weight_norm > s.clamp_value) weight_norm = static_cast<float>(s.clamp_value);
      const float adam_norm = static_cast<float>(std::sqrt(t.sums[1]));
      float trust = 1.0f;
      if (s.adapt && weight_norm != 0.0f && adam_norm != 0.0f) trust = weight_norm / adam_norm;
      t.values[0] = static_cast<float>(-s.step_size * static_cast<double>(trust));
    }
  }
};

}  // namespace distopt
