// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The layer-wise policies' test cases, shared by the suites that run them (layerwise.cpp
// on the CPU executor, kokkos_layerwise.cpp on the Kokkos executor): the layouts, and the
// hyper-parameters of each case.
#pragma once

#include "sharded_harness.hpp"

#include <vector>

namespace harness {

/// The layouts of the sharded tests, and one whose matrix rows (300 and 40 long) straddle
/// blocks and cuts, with a batch of matrices.
inline std::vector<layout_case> layerwise_layouts() {
  auto v = awkward_layouts();
  v.push_back({"straddle", {{33, 300}, {300, 9}, {5, 7, 40}, {513}, {2, 3}}, std::size_t{1} << 22});
  return v;
}

inline distopt::lamb::hyper_params lamb_case() {
  distopt::lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  h.debias = true;
  h.clamp_value = 1.0;
  return h;
}
inline distopt::adafactor::hyper_params adafactor_relative() { return {}; }
inline distopt::adafactor::hyper_params adafactor_lr_beta1() {
  distopt::adafactor::hyper_params h;
  h.lr = 1e-2;
  h.relative_step = false;
  h.scale_parameter = false;
  h.beta1 = 0.9;
  h.weight_decay = 0.01;
  h.clip_threshold = 0.5;
  return h;
}
inline distopt::came::hyper_params came_case() {
  distopt::came::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  return h;
}

}  // namespace harness
