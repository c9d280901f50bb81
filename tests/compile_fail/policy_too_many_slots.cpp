// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: the Policy must declare `static constexpr
//   std::string_view name` and `static constexpr int max_state_slots` (0..4)
// A policy asking for more per-element state slots than the update loop carries.

#include <distopt/distopt.hpp>

#include <string_view>

struct five_slots {
  static constexpr std::string_view name = "five_slots";
  static constexpr int max_state_slots = 5;  // at most 4
  struct hyper_params {
    void validate() const {}
  };
  static int state_slots(const hyper_params&) { return 5; }
  struct scalars {
    float lr;
  };
  static scalars prepare(const hyper_params&, const distopt::step_info&) { return {0.1f}; }
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* st) {
    for (int k = 0; k < 5; ++k) st[k] += g;
    p -= s.lr * g;
  }
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<five_slots> opt(tensors, five_slots::hyper_params{});
  opt.step();
}
