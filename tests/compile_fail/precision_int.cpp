// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::precision<Param, Grad>: each must be float,
//   distopt::bf16 or distopt::fp16
// Params and grads are floating-point numbers.

#include <distopt/distopt.hpp>

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::sgd, distopt::replicated<distopt::fp32>, distopt::single,
                     distopt::cpu, distopt::precision<int>>
      opt(tensors, distopt::sgd::hyper_params{});
  opt.step();
}
