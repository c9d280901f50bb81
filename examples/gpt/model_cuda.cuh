// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// model.hpp's decoder on one GPU (--backend cuda; no tensor parallelism): the matrix
// products on cuBLAS (fp32, its default math: no TF32), attention's per head and batched over
// the sequences, the rest as kernels (the embedding, RMSNorm, the rotary embedding, the
// causal softmax, SwiGLU, the cross-entropy), all on one stream, the optimizer's. Weights and
// gradients are distopt's device buffers, handed in per unit as model.hpp's are (unit_calls);
// the activations live here.
//
// Every sum runs in a fixed order (no atomics on floats), so a run repeats its bits on the same
// GPU. It does not give the CPU's bits: cuBLAS sums its products in another order than
// OpenBLAS, the row reductions run as warp trees, and expf is CUDA's.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda_support.cuh"
#include "model.hpp"

namespace gpt::gpu {

using examples::cuda::check;
using examples::cuda::device_array;

class device_model {
 public:
  /// `max_sequences`: the most sequences of one call. Throws std::invalid_argument for a bad
  /// shape (model_tensors' checks).
  device_model(model_config c, int max_sequences, cudaStream_t stream);
  ~device_model();
  device_model(const device_model&) = delete;
  device_model& operator=(const device_model&) = delete;

  const model_config& config() const noexcept { return c_; }

  /// As model::train_batch, with `inputs` and `targets` in device memory (n x seq tokens each,
  /// inside the vocabulary: the caller checks them) and every tensor_ref a device pointer.
  /// Returns the sum of the losses, which it waits for (a copy of 8 bytes) after queueing
  /// backward: the gradients' kernels are then done too. The unit_calls run as the kernels
  /// are queued, not once they have run: release and grads_written are stream-ordered.
  double train_batch(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                     double divisor);
  /// The summed cross-entropy of `n` sequences, forward only (waits for it).
  double loss(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n);

 private:
  struct block_acts {  // as model::block_acts, on the device
    device_array<float> x_in, normed1, rstd1, q, k, v, probs, heads, x_mid, normed2, rstd2, gate, up, act;
  };
  /// Queues forward (with divisor > 0, dL/dlogits into logits_) and the summed loss into loss_.
  void forward(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n, double divisor);
  /// Waits for the stream and returns loss_.
  double summed_loss();
  void block_forward(int l, const std::vector<tensor_ref>& t, int n);
  void block_backward(int l, const std::vector<tensor_ref>& t, int n);
  /// Row-major C[m, n] = alpha op(A) op(B) + beta C over `batch` matrices `stride_*` apart.
  void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, long long stride_a,
            const float* b, int ldb, long long stride_b, float beta, float* c, int ldc, long long stride_c,
            int batch = 1) const;
  void linear(const float* x, const float* w, float* y, int rows, int out, int in, bool add = false) const;
  void linear_input_grad(const float* dy, const float* w, float* dx, int rows, int out, int in, bool add) const;
  void linear_weight_grad(const float* dy, const float* x, float* dw, int rows, int out, int in) const;
  /// An RMSNorm's weight gradient (written), summed over the rows in a fixed order.
  void norm_weight_grad(const float* x, const float* rstd, const float* dy, float* dw, int rows, int d) const;

  model_config c_;
  int max_seq_;
  cudaStream_t stream_;
  cublasHandle_t blas_ = nullptr;
  int head_dim_;
  device_array<float> cos_, sin_;  // [seq, head_dim / 2]
  std::vector<block_acts> blocks_;
  device_array<float> x_, final_in_, final_normed_, final_rstd_, logits_, dx_;
  device_array<float> scratch_;  // [rows, dim] | 3 x [rows, ffn] | 4 x [rows, dim] | [n, heads, seq, seq]
  device_array<double> row_loss_, loss_;
  device_array<float> weight_grad_partial_;  // norm_weight_grad's [chunks, dim]
};

}  // namespace gpt::gpu
