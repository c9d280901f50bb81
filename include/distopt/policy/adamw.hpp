// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "adam.hpp"

namespace distopt {

/// Adam with decoupled weight decay, as torch.optim.AdamW (same argument names and
/// defaults, weight_decay = 1e-2).
struct adamw : detail::adam_family<true> {
  static constexpr std::string_view name = "adamw";
};

}  // namespace distopt
