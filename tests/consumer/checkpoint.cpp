// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Component checkpoint (distopt::checkpoint): saves after two AdamW steps, loads into a new
// optimizer, and exits 0 when both then take the same third step, bit for bit.
#include <distopt/checkpoint.hpp>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>

#include <cstdio>
#include <vector>

namespace {

distopt::layout model() {
  distopt::layout l;
  l.add("w", {300});
  return l;
}

void step(distopt::optimizer<distopt::adamw>& opt, int k) {
  auto g = opt.grad("w");
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>((i * 7 + k) % 13) - 0.06f;
  opt.step();
}

}  // namespace

int main(int argc, char** argv) {
  const char* dir = argc > 1 ? argv[1] : "consumer-checkpoint";
  distopt::optimizer<distopt::adamw> saved(model(), distopt::adamw::hyper_params{});
  step(saved, 0);
  step(saved, 1);
  saved.save(dir);
  distopt::optimizer<distopt::adamw> loaded(model(), distopt::adamw::hyper_params{});
  loaded.load(dir);
  step(saved, 2);
  step(loaded, 2);
  const auto a = saved.param("w"), b = loaded.param("w");
  const bool same = std::vector<float>(a.begin(), a.end()) == std::vector<float>(b.begin(), b.end());
  std::printf("checkpoint: %s\n", same ? "loaded and stepped, the same params" : "DIFFERENT");
  return same ? 0 : 1;
}
