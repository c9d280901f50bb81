// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// A multi-layer perceptron (Linear, ReLU, ..., Linear) with softmax cross-entropy, whose
// forward and backward passes are BLAS matrix products. It owns only activations: weights
// and gradients live in distopt's buffers and are passed in as pointers each call.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace fmnist {

/// One Linear layer as torch.nn.Linear stores it: weight [out, in] row-major, bias [out].
struct linear_ref {
  const float* weight;
  const float* bias;
  float* weight_grad;  // may be null for evaluation
  float* bias_grad;
};

class mlp {
 public:
  /// `sizes`: inputs, hidden widths..., classes. `max_batch`: the most rows of one call.
  mlp(std::vector<int> sizes, int max_batch);

  const std::vector<int>& sizes() const noexcept { return sizes_; }
  int layer_count() const noexcept { return static_cast<int>(sizes_.size()) - 1; }
  int max_batch() const noexcept { return max_batch_; }

  /// Forward and backward over `n` rows of `x`; overwrites every gradient with that of
  /// (sum of the rows' cross-entropies) / `divisor` and returns the sum. `divisor` = n is
  /// PyTorch's reduction='mean'; a data-parallel rank holding n of a batch's B rows passes
  /// B, so that the ranks' gradients sum to the batch's mean gradient.
  double train_batch(std::span<const linear_ref> layers, const float* x,
                     const std::uint8_t* labels, int n, int divisor);

  /// The number of rows whose highest logit is at their label.
  int count_correct(std::span<const linear_ref> layers, const float* x,
                    const std::uint8_t* labels, int n);

 private:
  const float* forward(std::span<const linear_ref> layers, const float* x, int n);

  std::vector<int> sizes_;
  int max_batch_;
  std::vector<std::vector<float>> out_;  // per layer: post-ReLU output (logits for the last)
  std::vector<float> delta_, delta_next_;  // dLoss/d(pre-activation), current and next layer down
};

}  // namespace fmnist
