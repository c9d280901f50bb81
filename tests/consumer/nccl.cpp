// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Component nccl (distopt::nccl, plain C++ against the CUDA runtime and NCCL): compiled and
// linked (the test machine may have no GPU; run, it exits 77 without one).
#include <distopt/comm/nccl.hpp>

#include <cstdio>
#include <span>
#include <vector>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return std::puts("no CUDA device"), 77;
  const int device = 0;
  std::vector<distopt::nccl> comms = distopt::nccl::init_all(std::span<const int>(&device, 1));
  std::printf("nccl: rank %d of %d\n", comms[0].rank(), comms[0].size());
}
