// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "mlp.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace fmnist {

mlp::mlp(std::vector<int> sizes, int max_batch) : sizes_(std::move(sizes)), max_batch_(max_batch) {
  if (sizes_.size() < 2 || max_batch_ < 1) throw std::invalid_argument("mlp: needs two sizes and a batch");
  std::size_t widest = 0;
  for (std::size_t l = 1; l < sizes_.size(); ++l) {
    out_.emplace_back(static_cast<std::size_t>(max_batch_) * static_cast<std::size_t>(sizes_[l]));
    widest = std::max(widest, static_cast<std::size_t>(sizes_[l]));
  }
  delta_.resize(static_cast<std::size_t>(max_batch_) * widest);
  delta_next_.resize(delta_.size());
}

const float* mlp::forward(std::span<const linear_ref> layers, const float* x, int n) {
  const float* in = x;
  for (int l = 0; l < layer_count(); ++l) {
    const int k = sizes_[l], m = sizes_[l + 1];
    float* out = out_[l].data();
    // The bias goes in first so that the product accumulates onto it (beta = 1).
    for (int r = 0; r < n; ++r) std::copy_n(layers[l].bias, m, out + std::size_t(r) * m);
    // out[n, m] += in[n, k] * weight[m, k]^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, in, k, layers[l].weight, k,
                1.0f, out, m);
    if (l + 1 < layer_count())
      for (std::size_t i = 0, e = std::size_t(n) * m; i < e; ++i) out[i] = std::max(out[i], 0.0f);
    in = out;
  }
  return in;
}

double mlp::train_batch(std::span<const linear_ref> layers, const float* x,
                        const std::uint8_t* labels, int n, int divisor) {
  if (n < 1 || n > max_batch_ || divisor < 1) throw std::invalid_argument("mlp::train_batch: bad row count");
  const int classes = sizes_.back();
  const float* logits = forward(layers, x, n);

  // Softmax cross-entropy; its gradient w.r.t. the logits is (softmax - one_hot) / divisor.
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
    const int k = sizes_[l], m = sizes_[l + 1];
    const float* in = l == 0 ? x : out_[l - 1].data();
    // weight_grad[m, k] = delta[n, m]^T * in[n, k]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, k, n, 1.0f, delta_.data(), m, in, k,
                0.0f, layers[l].weight_grad, k);
    float* gb = layers[l].bias_grad;
    std::fill_n(gb, m, 0.0f);
    for (int r = 0; r < n; ++r) {
      const float* d = delta_.data() + std::size_t(r) * m;
      for (int c = 0; c < m; ++c) gb[c] += d[c];
    }
    if (l == 0) break;  // no gradient is needed for the images
    // delta_next[n, k] = delta[n, m] * weight[m, k], then through the ReLU below
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, k, m, 1.0f, delta_.data(), m,
                layers[l].weight, k, 0.0f, delta_next_.data(), k);
    for (std::size_t i = 0, e = std::size_t(n) * k; i < e; ++i)
      if (!(in[i] > 0.0f)) delta_next_[i] = 0.0f;
    std::swap(delta_, delta_next_);
  }
  return loss;
}

int mlp::count_correct(std::span<const linear_ref> layers, const float* x,
                       const std::uint8_t* labels, int n) {
  const int classes = sizes_.back();
  const float* logits = forward(layers, x, n);
  int correct = 0;
  for (int r = 0; r < n; ++r) {
    const float* z = logits + std::size_t(r) * classes;
    correct += std::max_element(z, z + classes) - z == labels[r];
  }
  return correct;
}

}  // namespace fmnist
