// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The layer-wise policies on distopt::cuda against the CPU executor, bit for bit: Lamb's
// trust ratios, Adafactor's and CAME's row and column statistics (exact sums on the
// device, merged and reduced on the host), after 20 steps on the layouts whose matrices
// straddle the shard cuts and a matrix too wide for the kernel's shared memory, on one
// rank and on d = 1..4 ranks as threads sharing the GPU.
// Without a CUDA device the program exits 77 (ctest: skipped).

#include "check_cases.hpp"

#include "../unit/layerwise_cases.hpp"

#include <cstdio>
#include <exception>

int main() {
  using namespace distopt;
  using namespace cuda_check;
  skip_without_device("the layer-wise policies on cuda against cpu");
  // "wide": a matrix of 12,800 columns, whose column counters (8 B each) do not fit the
  // kernel's shared memory (exec/cuda/layer_phase.cuh keeps them in global memory), and
  // one of 600 rows (its work items hold 64 rows or more).
  auto layouts = harness::layerwise_layouts();
  layouts.push_back({"wide", {{3, 12800}, {600, 40}, {64}}, std::size_t{1} << 22});
  try {
    check_case<lamb, fp32, precision<float>>("lamb trust ratios, fp32", {harness::lamb_case()}, {}, dtype::f32,
                                             layouts);
    check_case<adafactor, fp32, precision<bf16, bf16>>("adafactor beta1, bf16 params + master",
                                                       {harness::adafactor_lr_beta1()}, {}, dtype::bf16,
                                                       layouts);
    check_case<came, bf16, precision<float>>("came, bf16 states", {harness::came_case()}, {}, dtype::f32,
                                             layouts);
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d layer-wise runs on cuda equal to cpu bit for bit\n", checks - failures, checks);
  return failures ? 1 : 0;
}
