// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The GPU benchmarks' device check, and the host-timed ones' clock (distopt-bench-gpu-step,
// -layerwise): the best of repeated calls, each ended by a stream synchronisation, and the
// device's copy bandwidth (the roofline) measured the same way.
#pragma once

#include <cuda_runtime.h>

#include <distopt/exec/cuda/error.cuh>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace gpu_bench {

/// Device 0's properties; without a CUDA device, a message naming `program` and exit 1.
inline cudaDeviceProp device_or_exit(const char* program) {
  int devices = 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "%s: no CUDA device\n", program);
    std::exit(1);
  }
  return prop;
}

/// The best of `repeats` calls of f (after one warm-up), in seconds, each ended by a
/// synchronisation of `stream`.
template <class F>
double best_seconds(int repeats, cudaStream_t stream, F&& f) {
  namespace ce = distopt::cuda_exec;
  f();
  ce::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ce::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

/// A device-to-device copy of `bytes` on `stream`, best of `repeats`: GB/s counting the
/// bytes read and written.
inline double copy_gbps(std::size_t bytes, int repeats, cudaStream_t stream) {
  namespace ce = distopt::cuda_exec;
  void *src = nullptr, *dst = nullptr;
  ce::check(cudaMalloc(&src, bytes), "cudaMalloc");
  ce::check(cudaMalloc(&dst, bytes), "cudaMalloc");
  const double s = best_seconds(repeats, stream, [&] {
    ce::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / s * 1e-9;
}

}  // namespace gpu_bench
