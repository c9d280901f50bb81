// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <tuple>

#include "../config.hpp"
#include "../step_info.hpp"
#include "hyper_params.hpp"

namespace distopt {
namespace detail {

/// b^n for n >= 0 by repeated squaring: IEEE multiplications only, so host and device
/// code give the same bits (a device's pow is not the host's). Within about 2 log2(n)
/// double roundings of std::pow, far below the fp32 scalars' rounding.
DISTOPT_HD inline double pow_steps(double b, std::int64_t n) noexcept {
  double r = 1.0;
  while (n > 0) {
    if (n & 1) r *= b;
    b *= b;
    n >>= 1;
  }
  return r;
}

/// Adam and AdamW differ only in how weight decay enters (L2 on the gradient, or decoupled
/// on the parameter) and in its default; the rest follows torch.optim.Adam's single-tensor
/// path: lerp for the first moment, mul + addcmul for the second, bias corrections in double.
template <bool Decoupled>
struct adam_family {
  /// Slots: 0 exp_avg, 1 exp_avg_sq, 2 max_exp_avg_sq (amsgrad only).
  static constexpr int max_state_slots = 3;
  static constexpr int min_state_slots = 2;  // the update loops are built for 2..max_state_slots
  /// The second moments never go negative (8-bit states give them the unsigned map).
  static constexpr bool nonnegative_slot(int k) { return k >= 1; }
  static constexpr std::string_view family_name = Decoupled ? "adamw" : "adam";

  /// torch.optim.Adam / AdamW arguments and defaults.
  struct hyper_params {
    double lr = 1e-3;
    std::array<double, 2> betas{0.9, 0.999};
    double eps = 1e-8;
    double weight_decay = Decoupled ? 1e-2 : 0.0;
    bool amsgrad = false;
    bool maximize = false;

    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
          hyper_field<hyper_params, bool>{"amsgrad", &hyper_params::amsgrad},
          hyper_field<hyper_params, bool>{"maximize", &hyper_params::maximize}};
    }

    void validate() const {
      require_lr(family_name, lr);
      require(std::isfinite(eps) && eps >= 0.0, family_name, "eps", eps,
                      "must be a finite value >= 0");
      require_betas(family_name, betas);
      require_weight_decay(family_name, weight_decay);
    }
  };

  static int state_slots(const hyper_params& h) { return h.amsgrad ? 3 : 2; }

  struct scalars {
    float grad_sign;             // -1 with maximize, else 1
    float weight_decay;          // L2 coefficient (Adam)
    float decay;                 // 1 - lr * weight_decay (AdamW)
    float w1;                    // lerp weight 1 - beta1
    float beta2, one_minus_beta2;
    float amsgrad;               // 1 with amsgrad, else 0
    float bias_correction2_sqrt;
    float eps;
    float neg_step_size;         // -lr / (1 - beta1^step)
  };

  /// Host and device code (a device executor prepares each step on the device).
  DISTOPT_HD static scalars prepare(const hyper_params& h, const step_info& s) {
    const double bc1 = 1.0 - pow_steps(h.betas[0], s.step);
    const double bc2 = 1.0 - pow_steps(h.betas[1], s.step);
    return {h.maximize ? -1.0f : 1.0f,
            static_cast<float>(h.weight_decay),
            static_cast<float>(1.0 - h.lr * h.weight_decay),
            static_cast<float>(1.0 - h.betas[0]),
            static_cast<float>(h.betas[1]),
            static_cast<float>(1.0 - h.betas[1]),
            h.amsgrad ? 1.0f : 0.0f,
            static_cast<float>(std::sqrt(bc2)),
            static_cast<float>(h.eps),
            static_cast<float>(-(h.lr / bc1))};
  }

  // Options enter as arithmetic on per-step scalars (a sign, a 0/1 factor, a zero weight
  // decay), not as branches: GCC does not vectorise a loop that selects on a bool and
  // stores bf16 ("control flow in loop"). Each form is exact: g * 1, g + 0 * p, max(v, 0).
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    g = g * s.grad_sign;
    if constexpr (Decoupled) p = p * s.decay;
    else g = g + s.weight_decay * p;
    float& m = state[0];
    float& v = state[1];
    // torch's lerp (start + w * (end - start)); torch switches to end - (end - start) * (1 - w)
    // for w >= 0.5, i.e. beta1 <= 0.5, which differs from this by at most one rounding.
    m = m + s.w1 * (g - m);
    v = v * s.beta2 + (s.one_minus_beta2 * g) * g;
    // amsgrad: slot 2 keeps the running max of v (stored only when amsgrad is on); without
    // amsgrad the max below is max(v, 0) = v.
    state[2] = state[2] > v ? state[2] : v;
    const float ams = state[2] * s.amsgrad;
    const float second = v > ams ? v : ams;
    const float denom = std::sqrt(second) / s.bias_correction2_sqrt + s.eps;
    p = p + s.neg_step_size * m / denom;
  }
};

}  // namespace detail

/// Adam with L2 weight decay, as torch.optim.Adam (same argument names and defaults).
struct adam : detail::adam_family<false> {
  static constexpr std::string_view name = "adam";
};

}  // namespace distopt
