// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A probe for the exact norm's pass over grads that are not in cache (the default step's
// extra read), not part of the build: detail::add_block_squares (blocks of 256, scale 1)
// over n floats on one thread, against the same block sums read as S runs side by side
// (block k of each run in turn), with the block length a run-time value or the constant
// 256. Before each timed pass ("cold") a 512 MB buffer is written, so the grads come from
// memory and dirty lines are written back meanwhile, as in a step after the previous
// update; "warm" passes follow each other. Best of 12 passes; every variant must give the
// library's bits. Compiled as the library's AVX-512 clone is (x86-64-v4, no contraction):
//   g++ -std=c++20 -O3 -Iinclude bench/norm_streams_probe.cpp -o /tmp/norm_streams && /tmp/norm_streams [n]
// Figures: bench/RESULTS.md, "Clang tuned as GCC: the flags table ...", the norm's pass.
#include <distopt/detail/exact_sum.hpp>
#include <distopt/detail/update_loop.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace distopt::detail;

namespace {
std::vector<float> big(std::size_t{128} << 20);
void flush() {
  for (auto& x : big) x += 1.0f;
}

template <int S, bool Constant>
__attribute__((target("arch=x86-64-v4"), optimize("O3", "fp-contract=off"), noinline)) void runs(
    exact_sum& acc, const float* g, std::size_t n, std::size_t block, double scale) {
  const std::size_t per = n / block / S;
  for (std::size_t k = 0; k < per; ++k)
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
      acc.add(sum_of_squares(g + (s * per + k) * block, scale, Constant ? 256 : block));
  for (std::size_t b = S * per * block; b < n; b += block) acc.add(sum_of_squares(g + b, scale, std::min(block, n - b)));
}

template <class F>
double best_ns(F f, std::size_t n, bool cold) {
  double best = 1e30;
  for (int r = 0; r < 12; ++r) {
    if (cold) flush();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  return best / static_cast<double>(n);
}
}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : std::size_t{16} << 20;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = 0.001f * static_cast<float>(static_cast<int>(i % 97) - 48);
  volatile std::size_t block_in = 256;  // a run-time value, as the layout's block size is
  volatile double scale_in = 1.0;
  const std::size_t block = block_in;
  const double scale = scale_in;
  volatile double sink = 0;
  exact_sum ref;
  add_block_squares(ref, g.data(), scale, n, block);
  int bad = 0;
  for (const bool cold : {true, false}) {
    std::printf("%s, ns per float: library %.3f", cold ? "cold" : "warm", best_ns([&] {
      exact_sum a;
      add_block_squares(a, g.data(), scale, n, block);
      sink = a.value();
    }, n, cold));
    auto variant = [&]<int S, bool Constant>() {
      exact_sum a;
      runs<S, Constant>(a, g.data(), n, block, scale);
      bad |= a.value() != ref.value();
      std::printf("  S=%d%s %.3f", S, Constant ? " (256 constant)" : "", best_ns([&] {
        exact_sum b;
        runs<S, Constant>(b, g.data(), n, block, scale);
        sink = b.value();
      }, n, cold));
    };
    variant.template operator()<1, false>();
    variant.template operator()<1, true>();
    variant.template operator()<4, false>();
    variant.template operator()<4, true>();
    std::printf("\n");
  }
  if (bad) std::printf("a variant gave other bits than the library\n");
  return bad;
}
