// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A probe for issue 19's q8 target, not part of the build: the library's own q8 kernels on one
// thread, per block of 256 as the step calls them, over n elements (default 4,096: in L1)
// `reps` times, best of five.
// - requantize: detail::requantize_block (the portable absmax and lookup-table encode)
//   against detail::q8_avx512::requantize_block (the estimate and one threshold compare);
// - the fused loop update_range_q8 for Lion (one slot) and AdamW (two), with the AVX-512
//   decode and encode, with the decode only (the tables' estimate switched off), and with
//   neither.
// Compiled for x86-64-v4 without contraction, as the library's AVX-512 clone is, so that the
// probe's own loops (the requantize rows) are too.
//   g++ -std=c++20 -O3 -march=x86-64-v4 -ffp-contract=off -fno-math-errno -Iinclude \
//       bench/q8_encode_probe.cpp -o /tmp/q8encode
//   /tmp/q8encode; /tmp/q8encode 1048576 10
// Results: bench/RESULTS.md, "The AVX-512 encode: an estimate and one comparison".
#include <distopt/distopt.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace distopt;
using namespace distopt::detail;
using clk = std::chrono::steady_clock;

template <class F>
double best_ns_per_elem(F f, std::size_t n, int reps) {
  double best = 1e9;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = clk::now();
    for (int r = 0; r < reps; ++r) f();
    best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count());
  }
  return best / reps / static_cast<double>(n) * 1e9;
}

/// ns/param of update_range_q8 over n fp32 params with `mode`: 2 = AVX-512 decode and encode,
/// 1 = decode only, 0 = portable.
template <class P, int N>
double fused(int mode, std::size_t n, int reps, const typename P::scalars& sc) {
  std::vector<float> p(n, 0.5f), g(n), absmax[N];
  std::vector<std::uint8_t> code[N];
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : g) v = normal(rng) * 1e-3f;
  static q8_simd_tables decode_only[2];
  q8_args<float, float> a{p.data(), g.data(), nullptr, {}, {}, {}, {}, 1.0f, 7, 0};
  for (int k = 0; k < N; ++k) {
    const q8_codebook& b = k == 1 ? unsigned_codebook() : signed_codebook();
    code[k].assign(n, b.zero_code());
    absmax[k].assign(n / q8::block, 0.0f);
    decode_only[k] = b.simd();
    decode_only[k].has_estimate = false;
    a.code[k] = code[k].data();
    a.absmax[k] = absmax[k].data();
    a.map[k] = b.values().data();
    a.lut[k] = b.lookup();
    a.simd[k] = mode == 2 ? &b.simd() : mode == 1 ? &decode_only[k] : nullptr;
  }
  update_range_q8<P, N, param_mode::fp32>(sc, a, n);
  return best_ns_per_elem([&] { update_range_q8<P, N, param_mode::fp32>(sc, a, n); }, n, reps);
}

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::stoul(argv[1]) / q8::block * q8::block : 4096;
  const int reps = argc > 2 ? std::stoi(argv[2]) : 2000;
  if (!q8_avx512::available()) {
    std::printf("this CPU has no AVX-512 VBMI: nothing to compare\n");
    return 0;
  }
  std::vector<float> x(n), absmax(n / q8::block);
  std::vector<std::uint8_t> c1(n), c2(n);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (const bool is_signed : {true, false}) {
    const q8_codebook& b = is_signed ? signed_codebook() : unsigned_codebook();
    for (float& v : x) v = is_signed ? normal(rng) : normal(rng) * normal(rng);
    const auto portable = [&] {
      for (std::size_t i = 0; i < n; i += q8::block)
        requantize_block(x.data() + i, q8::block, b.lookup(), absmax[i / q8::block], c1.data() + i);
    };
    const auto avx512 = [&] {
      for (std::size_t i = 0; i < n; i += q8::block)
        q8_avx512::requantize_block(b.simd(), b.lookup(), x.data() + i, q8::block, absmax[i / q8::block], c2.data() + i);
    };
    const double tp = best_ns_per_elem(portable, n, reps), ta = best_ns_per_elem(avx512, n, reps);
    std::printf("requantize, %s map: portable %.3f, AVX-512 %.3f ns/element (codes equal: %s)\n",
                is_signed ? "signed" : "unsigned", tp, ta, c1 == c2 ? "yes" : "NO");
  }
  lion::hyper_params lh;
  lh.lr = 1e-4;
  adamw::hyper_params ah;
  ah.lr = 1e-3;
  step_info si{};
  si.step = 3;
  const auto ls = lion::prepare(lh, si);
  const auto as = adamw::prepare(ah, si);
  std::printf("update_range_q8, ns/param: decode+encode / decode only / portable\n");
  std::printf("  lion:  %.3f / %.3f / %.3f\n", fused<lion, 1>(2, n, reps, ls), fused<lion, 1>(1, n, reps, ls),
              fused<lion, 1>(0, n, reps, ls));
  std::printf("  adamw: %.3f / %.3f / %.3f\n", fused<adamw, 2>(2, n, reps, as), fused<adamw, 2>(1, n, reps, as),
              fused<adamw, 2>(0, n, reps, as));
}
