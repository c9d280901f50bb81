// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// Plain OpenMP loops compiled -O3 -march=native -fno-math-errno (plain_loops.cpp): the
// machine's best, beside distopt's own stream kernel, in distopt-bench-step.

#include <cstddef>

namespace bench {

/// GB/s of one fused pass over n floats: `rw` arrays read and written in place, one read.
double plain_stream_gbps(std::size_t n, int rw, int threads, int repeats);

/// ns per element of a plain fp32 AdamW loop (torch's formula and defaults) over n
/// elements: 28 B per element, best of `repeats` steps after a warm-up.
double plain_adamw_ns(std::size_t n, int threads, int repeats);

}  // namespace bench
