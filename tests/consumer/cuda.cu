// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Component cuda (distopt::cuda, nvcc): an optimizer on the GPU, compiled and linked (the
// test machine may have no GPU; run, it exits 77 without one).
#include <distopt/exec/cuda/executor.cuh>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>

#include <cstdio>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return std::puts("no CUDA device"), 77;
  distopt::layout tensors;
  tensors.add("w", {1000});
  distopt::optimizer<distopt::adamw, distopt::replicated<distopt::fp32>, distopt::single, distopt::cuda> opt(
      tensors, distopt::adamw::hyper_params{}, {}, distopt::cuda(0, nullptr));
  opt.step();
  std::puts("cuda: stepped");
}
