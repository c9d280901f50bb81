// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-custom-policy: a user-written policy (Signum, signum.hpp) driving distopt::optimizer.
// Minimises f(u, v) = 0.5 * ||A [u; v] - b||^2 over two registered tensors, u with 3 and v
// with 2 elements, with the gradient computed here; exits 1 unless the loss drops 10x.

#include <array>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>

#include "signum.hpp"

namespace {

constexpr std::size_t rows = 6, cols = 5;  // w = [u; v]: u = w[0..3), v = w[3..5)
constexpr std::array<std::array<double, cols>, rows> A{{{2.0, 0.5, 0.0, -0.3, 0.1},
                                                        {0.2, 1.5, -0.4, 0.0, 0.3},
                                                        {0.0, -0.2, 1.0, 0.6, 0.0},
                                                        {0.4, 0.0, 0.3, 1.2, -0.5},
                                                        {-0.1, 0.3, 0.0, 0.2, 0.8},
                                                        {0.5, 0.5, 0.5, 0.5, 0.5}}};
// b = A w* for w* = (1, -2, 0.5, 1.5, -1), so the minimum is 0 at w*.
constexpr std::array<double, cols> w_star{1.0, -2.0, 0.5, 1.5, -1.0};

/// Loss at w, and its gradient A^T (A w - b) into grad.
double loss_and_grad(const std::array<double, cols>& w, std::array<double, cols>& grad) {
  double loss = 0.0;
  grad.fill(0.0);
  for (std::size_t i = 0; i < rows; ++i) {
    double r = 0.0;  // (A w - b)_i = (A (w - w*))_i
    for (std::size_t j = 0; j < cols; ++j) r += A[i][j] * (w[j] - w_star[j]);
    loss += 0.5 * r * r;
    for (std::size_t j = 0; j < cols; ++j) grad[j] += A[i][j] * r;
  }
  return loss;
}

}  // namespace

int main() try {
  distopt::layout tensors;
  tensors.add("u", {3});
  tensors.add("v", {2});

  constexpr int steps = 100;
  constexpr double lr0 = 0.05;
  distopt::optimizer<signum> opt(tensors, signum::hyper_params{.lr = lr0, .momentum = 0.9});
  std::span<float> u = opt.param("u"), v = opt.param("v");
  std::span<float> gu = opt.grad("u"), gv = opt.grad("v");
  for (float& x : u) x = 0.0f;
  for (float& x : v) x = 0.0f;

  std::array<double, cols> w{}, g{};
  auto gather = [&] {
    for (std::size_t j = 0; j < 3; ++j) w[j] = u[j];
    for (std::size_t j = 0; j < 2; ++j) w[3 + j] = v[j];
  };
  gather();
  const double initial = loss_and_grad(w, g);
  std::printf("signum on 0.5*||Aw - b||^2, %d steps, lr %.3g linearly decayed\n", steps, lr0);
  std::printf("step %3d  loss %.6g\n", 0, initial);

  double loss = initial;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t j = 0; j < 3; ++j) gu[j] = static_cast<float>(g[j]);
    for (std::size_t j = 0; j < 2; ++j) gv[j] = static_cast<float>(g[3 + j]);
    // A sign method moves every coordinate by lr: decay lr so the iterates settle.
    auto h = opt.hyper();
    h.lr = lr0 * (1.0 - static_cast<double>(t - 1) / steps);
    opt.set_hyper(0, h);
    opt.step();
    gather();
    loss = loss_and_grad(w, g);
    if (t % 20 == 0) std::printf("step %3d  loss %.6g\n", t, loss);
  }

  std::printf("final loss %.6g (initial %.6g, %.1fx lower)\n", loss, initial, initial / loss);
  if (!(loss * 10.0 <= initial)) {
    std::fprintf(stderr, "distopt-custom-policy: the loss did not drop by 10x\n");
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "distopt-custom-policy: %s\n", e.what());
  return 2;
}
