// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// A Llama-style decoder (token embedding; blocks of RMSNorm, causal self-attention with
// rotary position embeddings, RMSNorm and a SwiGLU MLP, each with a residual; a final
// RMSNorm and an output projection) with its forward and backward passes written by hand on
// BLAS, fp32. It owns only activations: weights and gradients live in distopt's buffers and
// are handed in per unit (embedding, block l, head) by the trainer, as the ZeRO hooks need.
//
// Tensor parallelism (Megatron-LM's split, over a group of T ranks):
//  - the embedding and the output projection are vocabulary-parallel: rank r holds the rows
//    of tokens [r V/T, (r+1) V/T); the embedding's lookups are summed over the group, and the
//    cross-entropy's max, sum of exponentials and target logit are reduced over it, so that
//    no rank ever holds whole logits;
//  - wq, wk, wv, w1, w3 are column-parallel (rows split: rank r computes heads
//    [r H/T, (r+1) H/T) and its slice of the MLP's hidden units); wo and w2 row-parallel
//    (columns split: each rank's partial output is summed over the group);
//  - the norm weights are replicated: every rank computes the same full gradient for them.
// A block's input gradient, partial on each rank after the column-parallel products, is
// summed over the group before its norm's backward (two all-reduces forward, two backward).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace gpt {

/// The architecture (every rank of a run the same).
struct model_config {
  int vocab = 256;  // byte tokens
  int dim = 128;
  int layers = 4;
  int heads = 4;
  int ffn = 352;    // SwiGLU's hidden width
  int seq = 64;     // tokens per sequence
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
};

/// How one tensor is split over the tensor-parallel group.
enum class split { none, rows, cols };

/// One tensor of the model: its name (the PyTorch reference's), its whole shape, how TP splits
/// it, the unit it belongs to (0 embedding, 1 + l block l, layers + 1 the head).
struct tensor_info {
  std::string name;
  std::int64_t rows = 0, cols = 1;  // whole; a norm weight is [dim] (cols 1)
  split how = split::none;
  int unit = 0;
  bool matrix() const noexcept { return cols > 1; }
  std::int64_t local_rows(int tp) const noexcept { return how == split::rows ? rows / tp : rows; }
  std::int64_t local_cols(int tp) const noexcept { return how == split::cols ? cols / tp : cols; }
};

/// Every tensor, unit by unit, in the order of the units' refs below. Throws
/// std::invalid_argument naming what does not divide (heads by tp, dim by heads, ...).
std::vector<tensor_info> model_tensors(const model_config& c, int tp);

/// GPT-2-style initialisation, whole tensors in model_tensors' order: N(0, 0.02) for every
/// matrix (without GPT-2's 1/sqrt(2 layers) on the residual projections), ones for the norm
/// weights, drawn from one generator seeded with `seed`, so that
/// every TP size starts from the same model.
std::vector<std::vector<float>> initial_weights(const model_config& c, std::uint64_t seed);

/// TP rank `rank`'s part of a whole tensor (row-major), as model_tensors splits it.
std::vector<float> part_of(const tensor_info& t, std::span<const float> whole, int tp, int rank);
/// The inverse: writes a TP rank's part into its place in the whole tensor.
void place_part(const tensor_info& t, std::span<const float> part, int tp, int rank, std::span<float> whole);

/// A tensor of a unit as the model uses it: this rank's part of its weight and gradient.
struct tensor_ref {
  const float* w = nullptr;
  float* g = nullptr;  // null in a pass without backward
};

/// Calls around each unit of a pass. acquire(u, backward) runs before unit u is used and
/// returns its tensors (model_tensors' order within the unit); release(u) after that use;
/// grads_written(u) once backward has written unit u's gradients, before its release.
/// Forward visits units 0, 1, ..., layers + 1, backward the other way.
struct unit_calls {
  std::function<std::vector<tensor_ref>(int u, bool backward)> acquire;
  std::function<void(int u)> release;
  std::function<void(int u)> grads_written;
};

/// The TP group the model works in: this rank's index, its size, and in-place sums and maxima
/// over it (the same result on every rank). Size 1: none.
struct tp_group {
  int rank = 0, size = 1;
  std::function<void(std::span<float>)> sum, max;
};

class model {
 public:
  /// `max_sequences`: the most sequences of one call. Throws std::invalid_argument for a shape
  /// that does not split over tp.size.
  model(model_config c, int max_sequences, tp_group tp = {});

  const model_config& config() const noexcept { return c_; }
  int units() const noexcept { return c_.layers + 2; }

  /// Forward and backward over `n` sequences of tokens (`inputs` and `targets`, n x seq each);
  /// writes every gradient of (sum of the positions' cross-entropies) / `divisor` and returns
  /// that sum. divisor = n x seq is the mean over the batch; a data-parallel rank holding part
  /// of a batch passes the batch's count of positions, so that the ranks' gradients sum to the
  /// batch's mean gradient. Every rank of a TP group passes the same sequences.
  double train_batch(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                     double divisor);

  /// The summed cross-entropy of `n` sequences, forward only.
  double loss(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n);

 private:
  /// What one block keeps from forward for backward (this rank's parts), and its backward's
  /// scratch. rows = sequences x seq; dl = this rank's heads x head size; fl its hidden units.
  struct block_acts {
    std::vector<float> x_in, normed1, rstd1;  // the block's input, its attention norm
    std::vector<float> q, k, v, probs, heads;  // [rows, dl] (q, k rotated), [n, heads, seq, seq], [rows, dl]
    std::vector<float> x_mid, normed2, rstd2;  // after the attention's residual, its MLP norm
    std::vector<float> gate, up, act;          // [rows, fl]: w1 m, w3 m, silu(gate) * up
  };
  /// Forward; with divisor > 0, leaves dL/dlogits of (sum of losses) / divisor in logits_.
  double forward(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                 double divisor);
  void block_forward(int l, std::span<const tensor_ref> t, int n);
  void block_backward(int l, std::span<const tensor_ref> t, int n);
  void attention_forward(block_acts& a, int n);
  void attention_backward(block_acts& a, int n, const float* dheads, float* dq, float* dk, float* dv);
  /// The rotary embedding of `rows` rows of this rank's heads, in place (inverse: its transpose).
  void rotate(float* x, int rows, bool inverse) const;
  void all_sum(float* p, std::size_t count) const;

  model_config c_;
  int max_seq_;
  tp_group tp_;
  int heads_local_, head_dim_, dim_local_, ffn_local_, vocab_local_;
  std::vector<float> cos_, sin_;  // [seq, head_dim / 2]
  std::vector<block_acts> blocks_;
  std::vector<float> x_;          // the residual stream [rows, dim]
  std::vector<float> final_in_, final_normed_, final_rstd_, logits_;  // the head's
  std::vector<float> dx_, scratch_;  // backward: the residual's gradient; products
};

}  // namespace gpt
