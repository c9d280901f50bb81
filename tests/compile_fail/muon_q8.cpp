// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "8-bit Muon states and device executors are not built yet".
// Muon's momentum lives in the orthogonalisation engine's own buffer, which has no 8-bit
// form yet: the combination is refused where the optimizer type is named.
#include <distopt/distopt.hpp>
#include <distopt/policy/muon.hpp>

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::muon, distopt::replicated<distopt::q8>> opt(l, distopt::muon::hyper_params{});
}
