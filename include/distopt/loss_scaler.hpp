// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "config.hpp"

namespace distopt {

/// Settings of the dynamic loss scaler, with torch.amp.GradScaler's names and defaults.
struct dynamic_loss_scale {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;

  /// Throws std::invalid_argument naming the first setting out of range.
  void validate() const;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void dynamic_loss_scale::validate() const {
  auto fail = [](const char* what, double v, const char* why) {
    throw std::invalid_argument(std::string("dynamic_loss_scale: invalid ") + what + " " +
                                std::to_string(v) + ": " + why);
  };
  if (!(std::isfinite(init_scale) && init_scale > 0)) fail("init_scale", init_scale, "must be finite and > 0");
  if (!(growth_factor > 1.0)) fail("growth_factor", growth_factor, "must be > 1");
  if (!(backoff_factor > 0.0 && backoff_factor < 1.0)) fail("backoff_factor", backoff_factor, "must be in (0, 1)");
  if (growth_interval < 1) fail("growth_interval", static_cast<double>(growth_interval), "must be >= 1");
}
#endif  // DISTOPT_CORE_BODIES

/// A dynamic loss scale for fp16 training: the caller multiplies the loss by `scale()`;
/// the optimizer unscales the gradients inside its fused step, halves the scale when a
/// gradient overflows (and skips the step), and doubles it after `growth_interval` clean steps.
class loss_scaler {
 public:
  loss_scaler() = default;
  explicit loss_scaler(const dynamic_loss_scale& o) : opts_(o), scale_(o.init_scale) { o.validate(); }

  /// The factor the loss must be multiplied by before the backward pass.
  double scale() const noexcept { return scale_; }
  /// Clean steps since the last change of scale.
  std::int64_t growth_tracker() const noexcept { return tracker_; }

  /// Sets the scale and the count of clean steps (a checkpoint's); the options stay.
  void restore(double scale, std::int64_t growth_tracker) noexcept {
    scale_ = scale;
    tracker_ = growth_tracker;
  }

  /// Records one step's outcome, as GradScaler.update().
  void update(bool found_inf) noexcept {
    if (found_inf) {
      scale_ *= opts_.backoff_factor;
      tracker_ = 0;
    } else if (++tracker_ == opts_.growth_interval) {
      scale_ *= opts_.growth_factor;
      tracker_ = 0;
    }
  }

 private:
  dynamic_loss_scale opts_{};
  double scale_ = 1.0;
  std::int64_t tracker_ = 0;
};

}  // namespace distopt
