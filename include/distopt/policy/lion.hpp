// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <array>
#include <string_view>
#include <tuple>

#include "../config.hpp"
#include "../step_info.hpp"
#include "hyper_params.hpp"

namespace distopt {

/// Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms"), in lion-pytorch's
/// order: decoupled weight decay, the sign of the interpolated momentum, then the momentum update.
struct lion {
  static constexpr std::string_view name = "lion";
  /// Slot 0: exp_avg.
  static constexpr int max_state_slots = 1;
  static constexpr int min_state_slots = 1;  // the update loops are built for 1..max_state_slots

  /// lion-pytorch's arguments and defaults.
  struct hyper_params {
    double lr = 1e-4;
    std::array<double, 2> betas{0.9, 0.99};
    double weight_decay = 0.0;

    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay}};
    }

    void validate() const {
      require_lr(name, lr);
      require_betas(name, betas);
      require_weight_decay(name, weight_decay);
    }
  };

  static int state_slots(const hyper_params&) { return 1; }

  struct scalars {
    float lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
  };

  /// Host and device code (a device executor prepares each step on the device).
  DISTOPT_HD static scalars prepare(const hyper_params& h, const step_info&) {
    return {static_cast<float>(h.lr),
            static_cast<float>(1.0 - h.lr * h.weight_decay),
            static_cast<float>(h.betas[0]),
            static_cast<float>(1.0 - h.betas[0]),
            static_cast<float>(h.betas[1]),
            static_cast<float>(1.0 - h.betas[1])};
  }

  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    float& m = state[0];
    p = p * s.decay;
    const float c = m * s.beta1 + s.one_minus_beta1 * g;
    const float sign = static_cast<float>((c > 0.0f) - (c < 0.0f));
    p = p + (-s.lr) * sign;
    m = m * s.beta2 + s.one_minus_beta2 * g;
  }
};

}  // namespace distopt
