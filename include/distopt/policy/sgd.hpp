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
    float grad_sign;      // -1 with maximize, else 1
    float weight_decay;
    float buf_keep;       // momentum, or 0 on the buffer's first step (buf = g) and without momentum
    float buf_take;       // 1 - dampening, or 1 on the first step and without momentum
    float grad_keep;      // 1 with Nesterov (g + momentum * buf), else 0 (buf)
    float buf_weight;     // momentum with Nesterov, else 1
    float neg_lr;
  };

  /// Host and device code (a device executor prepares each step on the device).
  DISTOPT_HD static scalars prepare(const hyper_params& h, const step_info& s) {
    const bool fresh = h.momentum == 0.0 || s.fresh_state;
    return {h.maximize ? -1.0f : 1.0f,
            static_cast<float>(h.weight_decay),
            fresh ? 0.0f : static_cast<float>(h.momentum),
            fresh ? 1.0f : static_cast<float>(1.0 - h.dampening),
            h.nesterov ? 1.0f : 0.0f,
            h.nesterov ? static_cast<float>(h.momentum) : 1.0f,
            static_cast<float>(-h.lr)};
  }

  // Options enter as arithmetic on per-step scalars, not branches, so that the loop
  // vectorises for bf16 storage too; each form is exact (x * 1, x * 0 + y, g + 0 * p).
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    g = g * s.grad_sign;
    g = g + s.weight_decay * p;
    float& buf = state[0];
    buf = buf * s.buf_keep + s.buf_take * g;
    g = s.grad_keep * g + s.buf_weight * buf;
    p = p + s.neg_lr * g;
  }
};

}  // namespace distopt
