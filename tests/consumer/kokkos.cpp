// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Component kokkos (distopt::kokkos): one AdamW step on Kokkos's default host space; exits 0
// when it moved the parameter by lr (Adam's first step is lr * sign(grad)).
#include <distopt/exec/kokkos.hpp>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>

#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos_scope(argc, argv);
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::adamw::hyper_params h;
  h.lr = 0.5;
  h.weight_decay = 0.0;
  distopt::optimizer<distopt::adamw, distopt::replicated<distopt::fp32>, distopt::single, distopt::kokkos<>> opt(
      tensors, h);
  for (auto& g : opt.grad("w")) g = 2.0f;
  opt.step();
  const float w = opt.param("w")[0];
  std::printf("kokkos: w after one step: %g\n", w);
  return std::fabs(w + 0.5f) < 1e-6f ? 0 : 1;
}
