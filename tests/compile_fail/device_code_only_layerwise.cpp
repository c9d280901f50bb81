// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "the layer-wise and GaLore engines are still host loops".
// An executor that runs device code only (as distopt::cuda) takes the element-wise and
// 8-bit phases; a layer-wise policy, whose engine is still a host loop, is refused with a
// message that says what runs there.
#include <distopt/distopt.hpp>

struct device_code_only : distopt::emulated_device {
  static constexpr bool runs_host_functions = false;
};

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::adafactor, distopt::replicated<distopt::fp32>, distopt::single, device_code_only> opt(
      l, distopt::adafactor::hyper_params{});
}
