// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file How the CUDA code reports a failed runtime call.

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace distopt::cuda_exec {
inline namespace abi_v0_1 {

/// Throws std::runtime_error naming `what` when `e` is not cudaSuccess.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("distopt cuda: ") + what + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
}

}  // namespace abi_v0_1
}  // namespace distopt::cuda_exec
