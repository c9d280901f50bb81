// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The MLP of mlp.hpp on a GPU (--backend cuda, one rank, no tensor parallelism): the
// matrix products on cuBLAS (fp32, its default math: no TF32), the rest as small kernels,
// everything on one stream, the optimizer's. Weights and gradients are distopt's device
// buffers, passed in as pointers each call, as mlp.hpp's are; the activations live here.
//
// The order of every sum is fixed (no atomics on floats), so a run repeats its bits on the
// same GPU; it does not give the CPU's bits (cuBLAS's products sum in another order than
// OpenBLAS's, and expf and logf are CUDA's).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_support.cuh"

namespace fmnist::gpu {

using examples::cuda::check;
using examples::cuda::device_array;

/// One Linear layer (torch.nn.Linear's layout: weight [out, in] row-major, bias [out]) in
/// device memory; the grads may be null for evaluation.
struct device_linear {
  const float* weight;
  const float* bias;
  float* weight_grad;
  float* bias_grad;
};

class device_mlp {
 public:
  /// `sizes`: inputs, hidden widths..., classes; `max_batch`: the most rows of one call.
  device_mlp(std::vector<int> sizes, int max_batch, cudaStream_t stream);
  ~device_mlp();
  device_mlp(const device_mlp&) = delete;
  device_mlp& operator=(const device_mlp&) = delete;

  /// As mlp::train_batch: forward and backward over `n` rows of `x` (device memory, n x
  /// inputs) with `labels` (device), every gradient overwritten with that of (sum of the
  /// rows' cross-entropies) / `divisor`; returns the sum, which it waits for (one copy of
  /// 8 bytes): the gradients' kernels are then done too.
  double train_batch(std::span<const device_linear> layers, const float* x, const std::uint8_t* labels, int n,
                     int divisor);
  /// The number of rows whose highest logit is at their label (waits for it).
  int count_correct(std::span<const device_linear> layers, const float* x, const std::uint8_t* labels, int n);

 private:
  const float* forward(std::span<const device_linear> layers, const float* x, int n);

  std::vector<int> sizes_;
  int max_batch_;
  cudaStream_t stream_;
  cublasHandle_t blas_ = nullptr;
  std::vector<device_array<float>> out_;  // per layer: post-ReLU output (logits for the last)
  device_array<float> delta_, delta_next_;
  device_array<double> row_loss_, loss_;
  device_array<int> correct_;
};

/// Rows `order[first .. first + n)` of `images` (pixels floats each) and `labels` into `x`
/// and `y`, on `stream`: a training batch in the epoch's shuffled order.
void gather_batch(const float* images, const std::uint8_t* labels, const std::uint32_t* order, std::size_t first,
                  int n, int pixels, float* x, std::uint8_t* y, cudaStream_t stream);

}  // namespace fmnist::gpu
