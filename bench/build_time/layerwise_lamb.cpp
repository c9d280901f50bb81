// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Build-time probe (bench/build_time/measure.sh): one optimizer type, constructed and stepped once.
#include <distopt/optimizer.hpp>
#include <distopt/policy/lamb.hpp>
#include <algorithm>

int main() {
  distopt::layout l;
  l.add("w", {64, 32});
  l.add("b", {32});
  distopt::optimizer<distopt::lamb> opt(l, distopt::lamb::hyper_params{});
  std::ranges::fill(opt.grad("w"), 0.01f);
  return opt.step().skipped ? 1 : 0;
}
