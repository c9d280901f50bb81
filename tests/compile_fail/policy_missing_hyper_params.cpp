// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: the Policy needs a default-constructible
//   `hyper_params` with `void validate() const` and `static int state_slots(const hyper_params&)`
// A policy without a hyper_params struct.

#include <distopt/distopt.hpp>

#include <string_view>

struct no_hyper_params {
  static constexpr std::string_view name = "no_hyper_params";
  static constexpr int max_state_slots = 0;
  // Missing: struct hyper_params { ...; void validate() const; };
  struct scalars {
    float lr;
  };
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float*) { p -= s.lr * g; }
};

int main() {
  // Naming the type is enough: the optimizer checks its arguments when it is instantiated.
  return sizeof(distopt::optimizer<no_hyper_params>) > 0 ? 0 : 1;
}
