// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// A multi-layer perceptron (Linear, ReLU, ..., Linear) with softmax cross-entropy, whose
// forward and backward passes are BLAS matrix products. It owns only activations: weights
// and gradients live in distopt's buffers and are passed in as pointers each call.
//
// Tensor parallelism (--tp T, Megatron's MLP): the layers alternate between column-parallel
// (weight [out, in] split by rows, bias split: each TP rank computes its slice of the
// outputs from the whole input) and row-parallel (weight split by columns: each TP rank
// multiplies its slice of the inputs, an all-reduce over the TP group sums the partial
// outputs, and the bias, held whole by every TP rank, is added once after the sum). Layer 0
// is column-parallel, layer 1 row-parallel, and so on; the output layer is always
// row-parallel, so that every TP rank ends with the whole logits. A row-parallel layer
// after a column-parallel one reads that layer's slice as is; one after another
// row-parallel layer (the output layer of an MLP with an even number of hidden layers)
// takes its slice of the whole input. Backward: a column-parallel layer's input gradient
// is all-reduced over the TP group (each rank holds a partial sum); a row-parallel layer
// whose input was sliced all-gathers its input gradient. Every hidden width must divide by T.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

namespace fmnist {

/// One Linear layer as torch.nn.Linear stores it: weight [out, in] row-major, bias [out].
/// With tensor parallelism: this TP rank's part of them.
struct linear_ref {
  const float* weight;
  const float* bias;
  float* weight_grad;  // may be null for evaluation
  float* bias_grad;
};

/// Calls around each layer of a pass, for a trainer whose weights and gradients are not
/// always there (the ZeRO stages' gathers and the overlap hooks). `acquire(l, backward)`
/// runs before layer l is used and returns its refs for this use (the grads only when
/// `backward`); `release(l)` runs after that use; `grads_written(l)` once backward has
/// written layer l's gradients, before its release. Forward visits the layers upwards,
/// backward downwards.
struct layer_calls {
  std::function<linear_ref(int l, bool backward)> acquire;
  std::function<void(int l)> release;
  std::function<void(int l)> grads_written;
};

/// How tensor parallelism splits one layer.
enum class layer_split {
  none,    // no tensor parallelism: the whole layer on every rank
  column,  // column-parallel: weight rows (outputs) and bias split
  row,     // row-parallel: weight columns (inputs) split, bias whole, outputs all-reduced
};

/// The TP group an mlp works in: this rank's index, the group size, and the sum over the
/// group (in place, the same result on every rank). size 1: no tensor parallelism.
struct tp_group {
  int rank = 0, size = 1;
  std::function<void(std::span<float>)> all_reduce_sum;
};

class mlp {
 public:
  /// `sizes`: inputs, hidden widths..., classes. `max_batch`: the most rows of one call.
  /// With tp.size > 1 every hidden width must divide by it (std::invalid_argument).
  mlp(std::vector<int> sizes, int max_batch, tp_group tp = {});

  /// How layer `l` of `layer_count` is split over `tp_size` ranks (see above).
  static layer_split split_of(int l, int layer_count, int tp_size) noexcept {
    if (tp_size <= 1) return layer_split::none;
    return l % 2 == 1 || l == layer_count - 1 ? layer_split::row : layer_split::column;
  }

  const std::vector<int>& sizes() const noexcept { return sizes_; }
  int layer_count() const noexcept { return static_cast<int>(sizes_.size()) - 1; }
  int max_batch() const noexcept { return max_batch_; }

  /// Forward and backward over `n` rows of `x`; overwrites every gradient with that of
  /// (sum of the rows' cross-entropies) / `divisor` and returns the sum. `divisor` = n is
  /// PyTorch's reduction='mean'; a data-parallel rank holding n of a batch's B rows passes
  /// B, so that the ranks' gradients sum to the batch's mean gradient. With tensor
  /// parallelism every rank of the TP group calls it with the same rows, and gets the
  /// gradients of its parts (those of the whole output bias are the same on every rank).
  /// With `calls`, each layer's refs come from calls->acquire instead of `layers`. With
  /// `add_grads` (a micro-batch of gradient accumulation) the gradients are added into the
  /// grad buffers instead: each computed on its own, then added once per element, so that
  /// micro-batches of one rank sum as the ranks' parts of a batch do.
  double train_batch(std::span<const linear_ref> layers, const float* x, const std::uint8_t* labels, int n,
                     int divisor, const layer_calls* calls = nullptr, bool add_grads = false);

  /// The number of rows whose highest logit is at their label (collective over the TP group).
  int count_correct(std::span<const linear_ref> layers, const float* x,
                    const std::uint8_t* labels, int n, const layer_calls* calls = nullptr);

 private:
  /// Layer l's shape on this rank and where its input comes from.
  struct geometry {
    layer_split split = layer_split::none;
    int in = 0, out = 0;         // the whole layer's widths
    int in_local = 0;            // columns of this rank's weight (the inputs it multiplies)
    int out_local = 0;           // rows of this rank's weight, and columns of its output
    bool slices_input = false;   // row-parallel reading its slice of a whole input
  };
  const float* forward(std::span<const linear_ref> layers, const float* x, int n, const layer_calls* calls);
  /// Layer l's input and its row stride (offset to this rank's slice where it takes one).
  std::pair<const float*, int> input_of(int l, const float* x) const;
  void all_reduce(float* data, std::size_t count) const;

  std::vector<int> sizes_;
  int max_batch_;
  tp_group tp_;
  std::vector<geometry> geo_;
  std::vector<std::vector<float>> out_;  // per layer: post-ReLU output (logits for the last)
  std::vector<float> delta_, delta_next_;  // dLoss/d(pre-activation), current and next layer down
  std::vector<float> bias_sum_;             // add_grads: a bias gradient before it is added
};

}  // namespace fmnist
