// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A probe for issue 19's in-cache default step, not part of the build: the exact norm's
// pass (detail::add_block_squares, blocks of 256) over n floats on one thread, best of
// 2,000, against variants of the same sums: K blocks side by side (K times the independent
// chains of adds) with the multiply by a scale of 1 left out, and the block sums alone
// (without the exact accumulation). Every variant checks that it gives the library's bits.
// Compiled as the library's AVX-512 clone is (x86-64-v4, no contraction):
//   g++ -std=c++20 -O3 -Iinclude bench/norm_probe.cpp -o /tmp/norm_probe && /tmp/norm_probe [n]
// Figures: bench/RESULTS.md, "Offload's params by bucket, ... the in-cache norm pass probed".
#include <distopt/detail/update_loop.hpp>
#include <distopt/detail/exact_sum.hpp>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstdlib>
using namespace distopt;
using namespace distopt::detail;
constexpr std::size_t L = 16;
template <int K, bool Scaled>
__attribute__((always_inline)) inline void side(const float* __restrict g, double scale, std::size_t n, double* out) {
  double s[K][L] = {};
  for (std::size_t i = 0; i + L <= n; i += L)
    for (int k = 0; k < K; ++k)
#pragma GCC unroll 16
      for (std::size_t j = 0; j < L; ++j) {
        double x = static_cast<double>(g[k * n + i + j]);
        if constexpr (Scaled) x *= scale;
        s[k][j] += x * x;
      }
  for (int k = 0; k < K; ++k) out[k] = combine_lanes(s[k]);
}
template <int K>
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=off"), noinline)) void blocks(exact_sum& acc, const float* g, double scale, std::size_t n) {
  std::size_t b = 0;
  double sums[K];
  for (; b + K * 256 <= n; b += K * 256) {
    if (scale == 1.0) side<K, false>(g + b, scale, 256, sums);
    else side<K, true>(g + b, scale, 256, sums);
    for (int k = 0; k < K; ++k) acc.add(sums[k]);
  }
  for (; b < n; b += 256) acc.add(sum_of_squares(g + b, scale, std::min<std::size_t>(256, n - b)));
}
template <int K>
__attribute__((target("arch=x86-64-v4"), optimize("fp-contract=off"), noinline)) double sums_only(const float* g, std::size_t n) {
  double sums[K], t = 0;
  for (std::size_t b = 0; b + K * 256 <= n; b += K * 256) {
    side<K, false>(g + b, 1.0, 256, sums);
    for (int k = 0; k < K; ++k) t += sums[k];
  }
  return t;
}
template <class F>
double time_it(F f, std::size_t n, int reps) {
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  return best / n;
}
int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::atoll(argv[1]) : 266240;
  const int reps = 2000;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = 0.001f * float(int(i % 97) - 48);
  volatile double sink = 0;
  exact_sum ref; add_block_squares(ref, g.data(), 1.0, n, 256);
  std::printf("library: %.3f ns/element\n", time_it([&]{ exact_sum a; add_block_squares(a, g.data(), 1.0, n, 256); sink = a.value(); }, n, reps));
  auto v = [&]<int K>() {
    exact_sum a; blocks<K>(a, g.data(), 1.0, n);
    std::printf("K=%d same bits=%d  %.3f ns/element, the sums only %.3f\n", K, a.value() == ref.value(),
      time_it([&]{ exact_sum a; blocks<K>(a, g.data(), 1.0, n); sink = a.value(); }, n, reps),
      time_it([&]{ sink = sums_only<K>(g.data(), n); }, n, reps));
  };
  v.template operator()<1>(); v.template operator()<2>(); v.template operator()<4>(); v.template operator()<8>();
}
