// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The GaLore test groups the GaLore, owned-placement and device suites share.

#include <vector>

#include <distopt/policy/galore_adamw.hpp>

namespace harness {

/// Group 0 plain AdamW (lr 1e-2, weight decay 0.05), group 1 GaLore with rank 4, scale 0.5
/// and projection `type`, refreshed every `gap` steps (5: at steps 0, 5, 10, 15 of 20).
inline std::vector<distopt::galore_adamw::hyper_params> galore_groups(distopt::galore_proj type = distopt::galore_proj::std_,
                                                                     int gap = 5) {
  distopt::galore_adamw::hyper_params plain;
  plain.lr = 1e-2;
  plain.weight_decay = 0.05;
  distopt::galore_adamw::hyper_params g = plain;
  g.rank = 4;
  g.update_proj_gap = gap;
  g.scale = 0.5;
  g.proj_type = type;
  return {plain, g};
}

}  // namespace harness
