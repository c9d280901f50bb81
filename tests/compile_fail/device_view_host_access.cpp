// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "device memory has no host element access".
// An optimizer on an executor of device memory hands out device_spans: writing a grad
// element from host code is refused at compile time, with the copy to use instead.
#include <distopt/distopt.hpp>

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::adamw, distopt::replicated<distopt::fp32>, distopt::single, distopt::emulated_device>
      opt(l, distopt::adamw::hyper_params{});
  opt.grad("w")[0] = 1.0f;
}
