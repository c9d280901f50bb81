// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The plain loops distopt-bench-step holds distopt against: what the compiler makes of a
// hand-written OpenMP loop on this machine. This file alone is compiled with
// -O3 -march=native -fno-math-errno -fopenmp (bench/CMakeLists.txt), flags a header library
// cannot choose for its users, so the ceiling is the best this machine does and not the
// best of distopt's own loops.

#include "plain_loops.hpp"
#include "stream_kernel.hpp"
#include "timing.hpp"

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

namespace {

struct aligned_free {
  void operator()(float* p) const noexcept { std::free(p); }
};
using array = std::unique_ptr<float[], aligned_free>;

/// n floats, 64-byte aligned, first touched by the threads that will use them.
array make_array(std::size_t n, int threads, float value) {
  const std::size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  array a(static_cast<float*>(std::aligned_alloc(64, bytes)));
  if (!a) throw std::bad_alloc();
  float* p = a.get();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::size_t i = 0; i < n; ++i) p[i] = value;
  return a;
}

/// Best of `repeats` runs after a warm-up.
template <class F>
double timed(int repeats, F&& f) {
  f();
  return bench::best_seconds(repeats, f);
}

}  // namespace

double bench::plain_stream_gbps(std::size_t n, int rw, int threads, int repeats) {
  std::vector<array> arrays;
  for (int k = 0; k <= rw; ++k) arrays.push_back(make_array(n, threads, 1e-3f));
  std::vector<float*> a;
  for (int k = 1; k <= rw; ++k) a.push_back(arrays[static_cast<std::size_t>(k)].get());
  const float* g = arrays[0].get();
  // Each OpenMP thread takes one contiguous slice, as schedule(static) would.
  const double s = timed(repeats, [&] {
#pragma omp parallel num_threads(threads)
    {
      const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
      const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
      bench::stream_pass(rw, a.data(), g, n * t / nt, n * (t + 1) / nt);
    }
  });
  return double(n) * sizeof(float) * (2 * rw + 1) / s / 1e9;
}

double bench::plain_adamw_ns(std::size_t n, int threads, int repeats) {
  array pa = make_array(n, threads, 0.5f), ga = make_array(n, threads, 1e-3f);
  array ma = make_array(n, threads, 0.0f), va = make_array(n, threads, 0.0f);
  float* __restrict__ p = pa.get();
  const float* __restrict__ g = ga.get();
  float* __restrict__ m = ma.get();
  float* __restrict__ v = va.get();
  // torch.optim.AdamW's defaults and its per-element formula.
  const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 1e-2f;
  int step = 0;
  const double s = timed(repeats, [&] {
    ++step;
    const float bc1 = 1.0f - std::pow(beta1, float(step));
    const float bc2_sqrt = std::sqrt(1.0f - std::pow(beta2, float(step)));
    const float step_size = lr / bc1, decay = 1.0f - lr * wd;
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
      const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
      m[i] = mi;
      v[i] = vi;
      p[i] = p[i] * decay - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
    }
  });
  return s / double(n) * 1e9;
}

