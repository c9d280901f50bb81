// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "mlp.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace fmnist {

mlp::mlp(std::vector<int> sizes, int max_batch, tp_group tp)
    : sizes_(std::move(sizes)), max_batch_(max_batch), tp_(std::move(tp)) {
  if (sizes_.size() < 2 || max_batch_ < 1) throw std::invalid_argument("mlp: needs two sizes and a batch");
  if (tp_.size < 1 || tp_.rank < 0 || tp_.rank >= tp_.size || (tp_.size > 1 && !tp_.all_reduce_sum))
    throw std::invalid_argument("mlp: bad tensor-parallel group");
  const int tp_size = tp_.size;
  std::size_t widest = 0;
  for (int l = 0; l < layer_count(); ++l) {
    geometry g;
    g.split = split_of(l, layer_count(), tp_size);
    g.in = g.in_local = sizes_[l];
    g.out = g.out_local = sizes_[l + 1];
    auto divide = [&](int width) {
      if (width % tp_size != 0)
        throw std::invalid_argument("mlp: width " + std::to_string(width) + " of layer " + std::to_string(l + 1) +
                                    " does not divide by the tensor-parallel size " + std::to_string(tp_size));
      return width / tp_size;
    };
    if (g.split == layer_split::column) g.out_local = divide(g.out);
    if (g.split == layer_split::row) {
      g.in_local = divide(g.in);
      g.slices_input = l == 0 || geo_.back().split == layer_split::row;
    }
    geo_.push_back(g);
    out_.emplace_back(static_cast<std::size_t>(max_batch_) * static_cast<std::size_t>(g.out_local));
    widest = std::max(widest, static_cast<std::size_t>(sizes_[l + 1]));
  }
  delta_.resize(static_cast<std::size_t>(max_batch_) * widest);
  delta_next_.resize(delta_.size());
}

void mlp::all_reduce(float* data, std::size_t count) const {
  if (tp_.size > 1) tp_.all_reduce_sum(std::span<float>(data, count));
}

std::pair<const float*, int> mlp::input_of(int l, const float* x) const {
  const float* in = l == 0 ? x : out_[static_cast<std::size_t>(l - 1)].data();
  const int stride = l == 0 ? sizes_[0] : geo_[static_cast<std::size_t>(l - 1)].out_local;
  const geometry& g = geo_[static_cast<std::size_t>(l)];
  if (g.slices_input) in += static_cast<std::size_t>(tp_.rank) * static_cast<std::size_t>(g.in_local);
  return {in, stride};
}

const float* mlp::forward(std::span<const linear_ref> layers, const float* x, int n, const layer_calls* calls) {
  for (int l = 0; l < layer_count(); ++l) {
    const linear_ref layer = calls ? calls->acquire(l, false) : layers[static_cast<std::size_t>(l)];
    const geometry& g = geo_[static_cast<std::size_t>(l)];
    const auto [in, ld] = input_of(l, x);
    const int k = g.in_local, m = g.out_local;
    float* out = out_[static_cast<std::size_t>(l)].data();
    if (g.split != layer_split::row) {
      // The bias goes in first so that the product accumulates onto it (beta = 1).
      for (int r = 0; r < n; ++r) std::copy_n(layer.bias, m, out + std::size_t(r) * m);
      // out[n, m] += in[n, k] * weight[m, k]^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, in, ld, layer.weight, k,
                  1.0f, out, m);
    } else {
      // Partial sums over this rank's inputs, summed over the TP group; then the whole bias.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, in, ld, layer.weight, k,
                  0.0f, out, m);
      all_reduce(out, std::size_t(n) * m);
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < m; ++c) out[std::size_t(r) * m + c] += layer.bias[c];
    }
    if (calls) calls->release(l);
    if (l + 1 < layer_count())
      for (std::size_t i = 0, e = std::size_t(n) * m; i < e; ++i) out[i] = std::max(out[i], 0.0f);
  }
  return out_.back().data();
}

double mlp::train_batch(std::span<const linear_ref> layers, const float* x, const std::uint8_t* labels, int n,
                        int divisor, const layer_calls* calls, bool add_grads) {
  if (n < 1 || n > max_batch_ || divisor < 1) throw std::invalid_argument("mlp::train_batch: bad row count");
  const int classes = sizes_.back();
  const float* logits = forward(layers, x, n, calls);

  // Softmax cross-entropy; its gradient w.r.t. the logits is (softmax - one_hot) / divisor.
  // With tensor parallelism every TP rank holds the same logits and computes the same.
  double loss = 0.0;
  const float inv_n = 1.0f / static_cast<float>(divisor);
  for (int r = 0; r < n; ++r) {
    const float* z = logits + std::size_t(r) * classes;
    float* d = delta_.data() + std::size_t(r) * classes;
    const float top = *std::max_element(z, z + classes);  // shift for a safe exp
    float sum = 0.0f;
    for (int c = 0; c < classes; ++c) sum += d[c] = std::exp(z[c] - top);
    loss += std::log(static_cast<double>(sum)) + top - z[labels[r]];
    for (int c = 0; c < classes; ++c) d[c] *= inv_n / sum;
    d[labels[r]] -= inv_n;
  }

  for (int l = layer_count() - 1; l >= 0; --l) {
    const linear_ref layer = calls ? calls->acquire(l, true) : layers[static_cast<std::size_t>(l)];
    const geometry& g = geo_[static_cast<std::size_t>(l)];
    const auto [in, ld] = input_of(l, x);
    const int k = g.in_local, m = g.out_local;
    // weight_grad[m, k] = delta[n, m]^T * in[n, k] (+ weight_grad: BLAS adds the product once)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, k, n, 1.0f, delta_.data(), m, in, ld,
                add_grads ? 1.0f : 0.0f, layer.weight_grad, k);
    if (add_grads) bias_sum_.resize(static_cast<std::size_t>(m));
    float* gb = add_grads ? bias_sum_.data() : layer.bias_grad;
    std::fill_n(gb, m, 0.0f);
    for (int r = 0; r < n; ++r) {
      const float* d = delta_.data() + std::size_t(r) * m;
      for (int c = 0; c < m; ++c) gb[c] += d[c];
    }
    if (add_grads)
      for (int c = 0; c < m; ++c) layer.bias_grad[c] += gb[c];
    if (calls) calls->grads_written(l);  // its reduction may start while the layers below compute
    if (l == 0) {  // no gradient is needed for the images
      if (calls) calls->release(l);
      break;
    }
    // delta_next[n, k] = delta[n, m] * weight[m, k], then through the ReLU below
    const float* below = out_[static_cast<std::size_t>(l - 1)].data();
    const int width = geo_[static_cast<std::size_t>(l - 1)].out_local;  // of delta_next and `below`
    if (!g.slices_input) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, k, m, 1.0f, delta_.data(), m,
                  layer.weight, k, 0.0f, delta_next_.data(), k);
      // Column-parallel: each rank's product sums over its outputs only.
      if (g.split == layer_split::column) all_reduce(delta_next_.data(), std::size_t(n) * k);
    } else {
      // Row-parallel over a slice of a whole input: this rank's columns of the input
      // gradient, gathered (as a sum with zeros elsewhere, which is exact) into the whole.
      std::fill_n(delta_next_.data(), std::size_t(n) * width, 0.0f);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, k, m, 1.0f, delta_.data(), m,
                  layer.weight, k, 0.0f, delta_next_.data() + std::size_t(tp_.rank) * k, width);
      all_reduce(delta_next_.data(), std::size_t(n) * width);
    }
    if (calls) calls->release(l);
    for (std::size_t i = 0, e = std::size_t(n) * width; i < e; ++i)
      if (!(below[i] > 0.0f)) delta_next_[i] = 0.0f;
    std::swap(delta_, delta_next_);
  }
  return loss;
}

int mlp::count_correct(std::span<const linear_ref> layers, const float* x,
                       const std::uint8_t* labels, int n, const layer_calls* calls) {
  const int classes = sizes_.back();
  const float* logits = forward(layers, x, n, calls);
  int correct = 0;
  for (int r = 0; r < n; ++r) {
    const float* z = logits + std::size_t(r) * classes;
    correct += std::max_element(z, z + classes) - z == labels[r];
  }
  return correct;
}

}  // namespace fmnist
