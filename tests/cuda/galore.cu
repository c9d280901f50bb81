// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore-AdamW on cuda (cuBLAS products, cuSOLVER's SVD) against cpu (OpenBLAS, LAPACK):
// 10 steps within one projection window, on matrices projected on each side and on both,
// with grads whose singular values are well apart (8, 4, 2, 1 over smaller ones), so that
// the rank-4 subspace is well defined and the two SVDs differ by rounding and by the
// singular vectors' signs only. Held to the CPU:
//   - the plain group's tensors (AdamW elements) bit for bit;
//   - the projected matrices' params within 2e-5 (the update does not depend on the signs);
//   - exp_avg_sq's low-rank state within 1e-4 relative (nor does it);
//   - the projection's vectors up to sign within 1e-4.
// Without a CUDA device the program exits 77 (ctest: skipped).

#include "check_cases.hpp"
#include "../unit/galore_cases.hpp"

#include <distopt/exec/cuda/matrix_ops.cuh>
#include <distopt/policy/galore_adamw.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace distopt;
using cuda_check::checks;
using cuda_check::failures;

struct matrix_case {
  const char* name;
  std::int64_t m, n;
};
const matrix_case matrices[] = {{"tall", 40, 30}, {"wide", 17, 33}, {"square", 24, 24}};

layout make_layout() {
  layout l;
  for (const auto& c : matrices) l.add(c.name, {c.m, c.n}, dtype::f32, 1);
  l.add("bias", {30}, dtype::f32, 0);
  return l;
}

/// A value in [-1, 1) from three integers (a fixed hash).
float noise(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return static_cast<float>(x >> 40) / static_cast<float>(1u << 23) - 1.0f;
}

/// Step t's grad of tensor `k` (m x n): sum over j of s_j a_j b_j^T, s = 8, 4, 2, 1, then
/// 0.1 and 0.05, with a_j and b_j fixed pseudo-random vectors, scaled by 1 + 0.1 t.
std::vector<float> grad_of(std::size_t k, std::int64_t m, std::int64_t n, int t) {
  const float s[] = {8.0f, 4.0f, 2.0f, 1.0f, 0.1f, 0.05f};
  std::vector<float> g(static_cast<std::size_t>(m * n), 0.0f);
  for (int j = 0; j < 6; ++j)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t c = 0; c < n; ++c)
        g[static_cast<std::size_t>(i * n + c)] += s[j] * noise(k, 2 * j, i) * noise(k, 2 * j + 1, c) * (1.0f + 0.1f * t);
  return g;
}

struct run_result {
  std::vector<std::vector<float>> params, v, factors;  // per matrix (factors: left then right); params + bias
};

template <class Exec>
run_result run(galore_proj type) {
  const layout l = make_layout();
  optimizer<galore_adamw, replicated<fp32>, single, Exec> opt(l, harness::galore_groups(type, 200));  // one refresh
  for (std::size_t k = 0; k < l.tensors().size(); ++k) {
    const auto& t = l.tensors()[k];
    std::vector<float> p(t.numel);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = 0.5f * noise(99, k, i);
    upload(opt.executor(), std::span<const float>(p), opt.param(t.name));
  }
  for (int step = 0; step < 10; ++step) {
    for (std::size_t k = 0; k < l.tensors().size(); ++k) {
      const auto& t = l.tensors()[k];
      const std::vector<float> g = t.shape.size() == 2 ? grad_of(k, t.shape[0], t.shape[1], step)
                                                       : std::vector<float>(t.numel, 0.01f * (step + 1));
      upload(opt.executor(), std::span<const float>(g), opt.grad(t.name));
    }
    opt.step();
  }
  run_result r;
  for (const auto& t : l.tensors()) {
    std::vector<float> p(t.numel);
    download(opt.executor(), opt.param(t.name), std::span<float>(p));
    r.params.push_back(std::move(p));
  }
  for (const auto& c : matrices) {
    r.v.push_back(opt.projected_state(c.name, 1));
    const auto& proj = opt.projector(c.name);
    r.factors.emplace_back(proj.left().begin(), proj.left().end());
    r.factors.emplace_back(proj.right().begin(), proj.right().end());
  }
  return r;
}

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

/// Largest |a - b| (sizes must match).
float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0.0f;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return a.size() == b.size() ? d : INFINITY;
}

/// Whether the vectors of `a` and `b` (a's columns when `columns`, else rows, of a
/// rows x cols row-major matrix) agree up to sign within `tol`.
bool same_up_to_sign(const std::vector<float>& a, const std::vector<float>& b, std::int64_t rows, std::int64_t cols,
                     bool columns, float tol) {
  if (a.size() != b.size() || a.size() != static_cast<std::size_t>(rows * cols)) return false;
  const std::int64_t count = columns ? cols : rows, len = columns ? rows : cols;
  for (std::int64_t v = 0; v < count; ++v) {
    float same = 0.0f, flipped = 0.0f;
    for (std::int64_t e = 0; e < len; ++e) {
      const std::size_t at = static_cast<std::size_t>(columns ? e * cols + v : v * cols + e);
      same = std::max(same, std::fabs(a[at] - b[at]));
      flipped = std::max(flipped, std::fabs(a[at] + b[at]));
    }
    if (std::min(same, flipped) > tol) return false;
  }
  return true;
}

void check_type(galore_proj type) {
  const std::string tag = std::string("proj ") + std::string(galore_proj_name(type)) + ": ";
  const run_result cpu_r = run<cpu>(type), gpu_r = run<cuda>(type);
  expect(gpu_r.params.back() == cpu_r.params.back(), tag + "the plain group's bias bit for bit");
  for (std::size_t j = 0; j < std::size(matrices); ++j) {
    const auto& c = matrices[j];
    const std::string name = tag + c.name;
    const float dp = max_diff(gpu_r.params[j], cpu_r.params[j]);
    expect(dp <= 2e-5f, name + ": params differ by " + std::to_string(dp));
    float vmax = 0.0f;
    for (float x : cpu_r.v[j]) vmax = std::max(vmax, std::fabs(x));
    const float dv = max_diff(gpu_r.v[j], cpu_r.v[j]);
    expect(vmax > 0.0f && dv <= 1e-4f * vmax, name + ": exp_avg_sq differs by " + std::to_string(dv) + " of " +
                                                 std::to_string(vmax));
    const std::vector<float>& q = cpu_r.factors[2 * j];
    const std::vector<float>& p = cpu_r.factors[2 * j + 1];
    expect(!q.empty() || !p.empty(), name + ": a projection");
    if (!q.empty())  // Q: m x 4, its columns
      expect(same_up_to_sign(gpu_r.factors[2 * j], q, c.m, 4, true, 1e-4f), name + ": Q's columns up to sign");
    if (!p.empty())  // P: 4 x n, its rows
      expect(same_up_to_sign(gpu_r.factors[2 * j + 1], p, 4, c.n, false, 1e-4f), name + ": P's rows up to sign");
  }
}

}  // namespace

int main() {
  cuda_check::skip_without_device("GaLore on cuda against cpu");
  try {
    for (const galore_proj type : {galore_proj::std_, galore_proj::reverse_std, galore_proj::full}) check_type(type);
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d GaLore checks on cuda within tolerance of cpu\n", checks - failures, checks);
  return failures ? 1 : 0;
}
