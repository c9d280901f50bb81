// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "step_bench.hpp"

void bench::run_adamw(const settings& s, std::vector<row>& out) {
  measure_all<distopt::adamw>(s, distopt::adamw::hyper_params{}, "", out);
}
