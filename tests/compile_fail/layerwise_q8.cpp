// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "8-bit (q8) states are for element-wise policies".
// Lamb, Adafactor and CAME have no block-wise 8-bit reference (bitsandbytes' LAMB8bit
// is Adam without a trust ratio on its block-wise path), so the combination is refused.
#include <distopt/distopt.hpp>

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::lamb, distopt::replicated<distopt::q8>> opt(l, distopt::lamb::hyper_params{});
}
