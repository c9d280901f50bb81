// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Builds against an installed distopt and takes one AdamW step: exits 0 when it moved
// the parameter by lr (Adam's first step is lr * sign(grad)).
#include <distopt/distopt.hpp>

#include <cmath>
#include <cstdio>

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::adamw::hyper_params h;
  h.lr = 0.5;
  h.weight_decay = 0.0;
  distopt::optimizer<distopt::adamw> opt(tensors, h);
  for (auto& g : opt.grad("w")) g = 2.0f;
  opt.step();
  const float w = opt.param("w")[0];
  std::printf("w after one step: %g\n", w);
  return std::fabs(w + 0.5f) < 1e-6f ? 0 : 1;
}
