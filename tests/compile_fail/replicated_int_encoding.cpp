// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::replicated<Encoding>: Encoding must be fp32 (float), bf16 or q8
// Optimizer state cannot be stored as integers.

#include <distopt/distopt.hpp>

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::adam, distopt::replicated<int>> opt(tensors,
                                                                  distopt::adam::hyper_params{});
  opt.step();
}
