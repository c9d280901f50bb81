// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The roofline kernel: one fused pass over [b, e) in which `RW` fp32 arrays are read and
// written in place and one array is read, the access shape of an optimizer step. Included
// by step_bandwidth.cpp (distopt's flags, run on distopt's thread pool) and plain_loops.cpp
// (-march=native, OpenMP): internal linkage, so the two compilations stay two functions.

#include <cstddef>

namespace bench {
namespace {

template <int RW>
void stream_pass(float* const* a, const float* __restrict__ g, std::size_t b, std::size_t e) {
  float* __restrict__ a0 = a[0];
  float* __restrict__ a1 = a[RW > 1 ? 1 : 0];
  float* __restrict__ a2 = a[RW > 2 ? 2 : 0];
  float* __restrict__ a3 = a[RW > 3 ? 3 : 0];
  float* __restrict__ a4 = a[RW > 4 ? 4 : 0];
  for (std::size_t i = b; i < e; ++i) {
    const float x = g[i];
    a0[i] = a0[i] * 0.999f + x;
    if constexpr (RW > 1) a1[i] = a1[i] * 0.999f + x;
    if constexpr (RW > 2) a2[i] = a2[i] * 0.999f + x;
    if constexpr (RW > 3) a3[i] = a3[i] * 0.999f + x;
    if constexpr (RW > 4) a4[i] = a4[i] * 0.999f + x;
  }
}

/// stream_pass with `rw` chosen at run time (1 to 5).
inline void stream_pass(int rw, float* const* a, const float* g, std::size_t b, std::size_t e) {
  switch (rw) {
    case 1: stream_pass<1>(a, g, b, e); break;
    case 2: stream_pass<2>(a, g, b, e); break;
    case 3: stream_pass<3>(a, g, b, e); break;
    case 4: stream_pass<4>(a, g, b, e); break;
    default: stream_pass<5>(a, g, b, e); break;
  }
}

}  // namespace
}  // namespace bench
