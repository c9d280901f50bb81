// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <string_view>
#include <tuple>

#include "../config.hpp"
#include "../step_info.hpp"
#include "hyper_params.hpp"

namespace distopt {

/// Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight
/// decay, as torch.optim.SGD (same argument names and defaults; the momentum buffer
/// starts as a copy of the first gradient).
struct sgd {
  static constexpr std::string_view name = "sgd";
  /// Slot 0: the momentum buffer (only kept when momentum != 0).
  static constexpr int max_state_slots = 1;

  /// torch.optim.SGD's arguments and defaults.
  struct hyper_params {
    double lr = 1e-3;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
    bool maximize = false;

    static constexpr auto fields() {
      return std::tuple{hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
                        hyper_field<hyper_params, double>{"momentum", &hyper_params::momentum},
                        hyper_field<hyper_params, double>{"dampening", &hyper_params::dampening},
                        hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
                        hyper_field<hyper_params, bool>{"nesterov", &hyper_params::nesterov},
                        hyper_field<hyper_params, bool>{"maximize", &hyper_params::maximize}};
    }

    void validate() const {
      require_lr(name, lr);
      require(std::isfinite(momentum) && momentum >= 0.0, name, "momentum", momentum,
                      "must be a finite value >= 0");
      require(std::isfinite(dampening), name, "dampening", dampening, "must be finite");
      require_weight_decay(name, weight_decay);
      require(!nesterov || (momentum > 0.0 && dampening == 0.0), name, "nesterov", 1.0,
                      "Nesterov momentum requires momentum > 0 and dampening = 0");
    }
  };

  static int state_slots(const hyper_params& h) { return h.momentum != 0.0 ? 1 : 0; }

  struct scalars {
    float lr, momentum, one_minus_dampening, weight_decay;
    bool use_momentum, first_step, nesterov, maximize;
  };

  static scalars prepare(const hyper_params& h, const step_info& s) {
    return {static_cast<float>(h.lr), static_cast<float>(h.momentum),
            static_cast<float>(1.0 - h.dampening), static_cast<float>(h.weight_decay),
            h.momentum != 0.0, s.fresh_state, h.nesterov, h.maximize};
  }

  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    if (s.maximize) g = -g;
    if (s.weight_decay != 0.0f) g = g + s.weight_decay * p;
    if (s.use_momentum) {
      float& buf = state[0];
      buf = s.first_step ? g : buf * s.momentum + s.one_minus_dampening * g;
      g = s.nesterov ? g + s.momentum * buf : buf;
    }
    p = p + (-s.lr) * g;
  }
};

}  // namespace distopt
