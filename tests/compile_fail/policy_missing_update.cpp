// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: the Policy needs `DISTOPT_HD static void
//   update(const scalars&, float& param, float grad, float* state)`
// A policy that forgot its per-element update.

#include <distopt/distopt.hpp>

#include <string_view>

struct no_update {
  static constexpr std::string_view name = "no_update";
  static constexpr int max_state_slots = 0;
  struct hyper_params {
    double lr = 0.1;
    void validate() const {}
  };
  static int state_slots(const hyper_params&) { return 0; }
  struct scalars {
    float lr;
  };
  static scalars prepare(const hyper_params& h, const distopt::step_info&) {
    return {static_cast<float>(h.lr)};
  }
  // Missing: DISTOPT_HD static void update(const scalars&, float& p, float g, float* state);
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<no_update> opt(tensors, no_update::hyper_params{});
  opt.step();
}
