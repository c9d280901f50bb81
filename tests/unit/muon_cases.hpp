// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The Muon test groups: AdamW (use_muon = false) as group 0, Muon as group 1.

#include <vector>

#include <distopt/policy/muon.hpp>

namespace harness {

inline std::vector<distopt::muon::hyper_params> muon_groups(
    bool nesterov = true, distopt::muon_adjust_lr adjust = distopt::muon_adjust_lr::original,
    distopt::muon_ns_dtype ns = distopt::muon_ns_dtype::fp32) {
  distopt::muon::hyper_params adamw;
  adamw.use_muon = false;
  adamw.lr = 3e-3;
  adamw.weight_decay = 0.05;
  distopt::muon::hyper_params m;
  m.lr = 2e-2;
  m.weight_decay = 0.05;
  m.nesterov = nesterov;
  m.adjust_lr_fn = adjust;
  m.ns_dtype = ns;
  return {adamw, m};
}

}  // namespace harness
