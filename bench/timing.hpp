// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// Best-of-N wall-clock timing for the benchmarks (no distopt headers: plain_loops.cpp,
// compiled -march=native, includes it too).

#include <algorithm>
#include <chrono>

namespace bench {

/// The shortest of `repeats` runs of f, in seconds.
template <class F>
double best_seconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace bench
