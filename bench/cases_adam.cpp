// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "step_bench.hpp"

void bench::run_adam(const settings& s, std::vector<row>& out) {
  distopt::adam::hyper_params h;
  measure_all<distopt::adam>(s, h, "", out);
  h.amsgrad = true;
  out.push_back(measure<distopt::adam, float, float, float>(s, h, "amsgrad"));
}
