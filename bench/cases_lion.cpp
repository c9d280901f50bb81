// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "step_bench.hpp"

void bench::run_lion(const settings& s, std::vector<row>& out) {
  measure_all<distopt::lion>(s, distopt::lion::hyper_params{}, "", out);
}
