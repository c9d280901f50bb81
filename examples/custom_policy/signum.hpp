// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <distopt/distopt.hpp>
#include <string_view>
#include <tuple>

/// Signum, signSGD with momentum (Bernstein et al. 2018), written outside the library:
/// m = momentum*m + (1-momentum)*g;  p -= lr*(sign(m) + weight_decay*p).
struct signum {
  static constexpr std::string_view name = "signum";
  static constexpr int max_state_slots = 1;  ///< slot 0: the momentum m
  struct hyper_params {
    double lr = 1e-3, momentum = 0.9, weight_decay = 0.0;
    static constexpr auto fields() {
      using field = distopt::hyper_field<hyper_params, double>;
      return std::tuple{field{"lr", &hyper_params::lr}, field{"momentum", &hyper_params::momentum},
                        field{"weight_decay", &hyper_params::weight_decay}};
    }
    void validate() const {  // the library's checks: invalid_hyper_parameter naming the argument
      distopt::require_lr(name, lr);
      distopt::require(momentum >= 0.0 && momentum < 1.0, name, "momentum", momentum,
                               "must be in [0, 1)");
      distopt::require_weight_decay(name, weight_decay);
    }
  };
  static int state_slots(const hyper_params&) { return 1; }
  struct scalars { float lr, beta, one_minus_beta, lr_wd; };
  static scalars prepare(const hyper_params& h, const distopt::step_info&) {  // host, double
    return {float(h.lr), float(h.momentum), float(1.0 - h.momentum), float(h.lr * h.weight_decay)};
  }
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    float& m = state[0];
    m = m * s.beta + s.one_minus_beta * g;
    p = p - s.lr * float((m > 0.0f) - (m < 0.0f)) - s.lr_wd * p;
  }
};
