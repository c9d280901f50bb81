// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "step_bench.hpp"

void bench::run_sgd(const settings& s, std::vector<row>& out) {
  distopt::sgd::hyper_params h;
  h.lr = 1e-2;
  h.momentum = 0.9;
  measure_all<distopt::sgd>(s, h, "momentum=0.9", out);
  h.momentum = 0.0;
  out.push_back(measure<distopt::sgd, float, float, float>(s, h, "momentum=0"));
}
