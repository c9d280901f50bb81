// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with: "a communicator of device memory (nccl) needs an executor of device memory".
// A communicator whose collectives take device memory, as nccl's do, with the CPU
// executor: every buffer it would be handed lies in host memory, which NCCL would read as
// device addresses. `single` with the declaration added stands in for nccl, so that this
// test needs no CUDA toolkit.
#include <distopt/distopt.hpp>

struct device_single : distopt::single {
  static constexpr bool collectives_in_device_memory = true;
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::sgd, distopt::replicated<distopt::fp32>, device_single, distopt::cpu> opt(
      tensors, distopt::sgd::hyper_params{});
  opt.step();
}
