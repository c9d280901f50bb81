// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Components galore and muon (distopt::muon, through BLAS): one Muon step on a matrix;
// exits 0 when it moved every element.
#include <distopt/optimizer.hpp>
#include <distopt/policy/muon.hpp>

#include <cstdio>

int main() {
  distopt::layout tensors;
  tensors.add("w", {16, 8});
  distopt::optimizer<distopt::muon> opt(tensors, distopt::muon::hyper_params{});
  auto g = opt.grad("w");
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i % 5) - 0.02f;
  opt.step();
  int moved = 0;
  for (float w : opt.param("w")) moved += w != 0.0f;
  std::printf("muon: %d of %zu elements moved\n", moved, g.size());
  return moved > 0 ? 0 : 1;
}
