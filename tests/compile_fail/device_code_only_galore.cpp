// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "GaLore's matrix products and SVD on this executor of device code only".
// An executor that runs device code only (as distopt::cuda) runs GaLore's products and SVD
// through its detail::matrix_ops: distopt::cuda's are in exec/cuda/matrix_ops.cuh. Without
// them GaLore is refused with a message that names that header.
#include <distopt/distopt.hpp>
#include <distopt/policy/galore_adamw.hpp>

struct device_code_only : distopt::emulated_device {
  static constexpr bool runs_host_functions = false;
};

int main() {
  distopt::layout l;
  l.add("w", {64, 64}, distopt::dtype::f32);
  distopt::optimizer<distopt::galore_adamw, distopt::replicated<distopt::fp32>, distopt::single, device_code_only> opt(
      l, distopt::galore_adamw::hyper_params{});
}
