// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// Best-of-N wall-clock timing for the benchmarks (no distopt headers: plain_loops.cpp,
// compiled -march=native, includes it too).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

namespace bench {

/// Bytes that best_seconds writes, untimed, before each timed run (0, the default: none).
/// With more than the last-level cache, each run finds its arrays in memory, as a training
/// step finds the optimizer's after the model's passes (distopt-bench-step --evict).
inline std::size_t& evict_bytes() {
  static std::size_t bytes = 0;
  return bytes;
}

/// Writes one byte in every 64-byte line of an evict_bytes() buffer.
inline void evict_caches() {
  static std::vector<unsigned char> lines;
  if (evict_bytes() == 0) return;
  if (lines.size() != evict_bytes()) lines.assign(evict_bytes(), 0);
  for (std::size_t i = 0; i < lines.size(); i += 64) lines[i] = static_cast<unsigned char>(lines[i] + 1);
}

/// The shortest of `repeats` runs of f, in seconds.
template <class F>
double best_seconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    evict_caches();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace bench
