// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "model.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <utility>

namespace gpt {

namespace {

constexpr auto row_major = CblasRowMajor;
constexpr auto no_trans = CblasNoTrans;
constexpr auto trans = CblasTrans;

// A block's tensors in model_tensors' order.
enum block_tensor { attention_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2, block_tensor_count };

/// Y[n, out] = X[n, in] W[out, in]^T (+ Y when `add`).
void linear(const float* x, const float* w, float* y, int n, int out, int in, bool add = false) {
  cblas_sgemm(row_major, no_trans, trans, n, out, in, 1.0f, x, in, w, in, add ? 1.0f : 0.0f, y, out);
}
/// dX[n, in] (+)= dY[n, out] W[out, in].
void linear_input_grad(const float* dy, const float* w, float* dx, int n, int out, int in, bool add) {
  cblas_sgemm(row_major, no_trans, no_trans, n, in, out, 1.0f, dy, out, w, in, add ? 1.0f : 0.0f, dx, in);
}
/// dW[out, in] = dY[n, out]^T X[n, in].
void linear_weight_grad(const float* dy, const float* x, float* dw, int n, int out, int in) {
  cblas_sgemm(row_major, trans, no_trans, out, in, n, 1.0f, dy, out, x, in, 0.0f, dw, in);
}

/// y = x / rms(x) * w row by row, keeping 1 / rms for backward.
void rmsnorm(const float* x, const float* w, float* y, float* rstd, int rows, int d, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<std::size_t>(r) * d;
    float* yr = y + static_cast<std::size_t>(r) * d;
    double squares = 0.0;
    for (int j = 0; j < d; ++j) squares += static_cast<double>(xr[j]) * xr[j];
    const float s = 1.0f / std::sqrt(static_cast<float>(squares / d) + eps);
    rstd[r] = s;
    for (int j = 0; j < d; ++j) yr[j] = xr[j] * s * w[j];
  }
}

/// The gradient of rmsnorm: dx += dL/dx for dL/dy = dy; dw = dL/dw (written).
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                      int rows, int d) {
  std::fill_n(dw, d, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<std::size_t>(r) * d;
    const float* dyr = dy + static_cast<std::size_t>(r) * d;
    float* dxr = dx + static_cast<std::size_t>(r) * d;
    const float s = rstd[r];
    double ux = 0.0;  // sum of (dy * w) * x
    for (int j = 0; j < d; ++j) {
      dw[j] += dyr[j] * xr[j] * s;
      ux += static_cast<double>(dyr[j] * w[j]) * xr[j];
    }
    const float k = static_cast<float>(ux / d) * s * s * s;
    for (int j = 0; j < d; ++j) dxr[j] += s * (dyr[j] * w[j]) - k * xr[j];
  }
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

}  // namespace

std::vector<tensor_info> model_tensors(const model_config& c, int tp) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
  };
  need(c.vocab > 0 && c.dim > 0 && c.layers > 0 && c.heads > 0 && c.ffn > 0 && c.seq > 0,
       "model: every size must be positive");
  need(tp >= 1, "model: the tensor-parallel size must be positive");
  need(c.dim % c.heads == 0 && (c.dim / c.heads) % 2 == 0,
       "model: --dim " + std::to_string(c.dim) + " must be --heads " + std::to_string(c.heads) +
           " times an even head size (rotary embeddings rotate pairs)");
  need(c.heads % tp == 0, "model: --heads " + std::to_string(c.heads) + " does not divide by --tp " + std::to_string(tp));
  need(c.ffn % tp == 0, "model: --ffn " + std::to_string(c.ffn) + " does not divide by --tp " + std::to_string(tp));
  need(c.vocab % tp == 0, "model: the vocabulary (" + std::to_string(c.vocab) + ") does not divide by --tp " +
                              std::to_string(tp));
  const std::int64_t d = c.dim, f = c.ffn, v = c.vocab;
  std::vector<tensor_info> t;
  t.push_back({"tok_embeddings.weight", v, d, split::rows, 0});
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int u = l + 1;
    t.push_back({p + "attention_norm.weight", d, 1, split::none, u});
    t.push_back({p + "attention.wq.weight", d, d, split::rows, u});
    t.push_back({p + "attention.wk.weight", d, d, split::rows, u});
    t.push_back({p + "attention.wv.weight", d, d, split::rows, u});
    t.push_back({p + "attention.wo.weight", d, d, split::cols, u});
    t.push_back({p + "ffn_norm.weight", d, 1, split::none, u});
    t.push_back({p + "feed_forward.w1.weight", f, d, split::rows, u});
    t.push_back({p + "feed_forward.w3.weight", f, d, split::rows, u});
    t.push_back({p + "feed_forward.w2.weight", d, f, split::cols, u});
  }
  t.push_back({"norm.weight", d, 1, split::none, c.layers + 1});
  t.push_back({"output.weight", v, d, split::rows, c.layers + 1});
  return t;
}

std::vector<std::vector<float>> initial_weights(const model_config& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::vector<float>> whole;
  for (const tensor_info& t : model_tensors(c, 1)) {
    whole.emplace_back(static_cast<std::size_t>(t.rows * t.cols), 1.0f);
    if (t.matrix())
      for (float& x : whole.back()) x = normal(rng);
  }
  return whole;
}

namespace {
/// Visits the (whole index, part index) pairs of TP rank `rank`'s part, row by row.
template <class F>
void for_part(const tensor_info& t, int tp, int rank, F&& f) {
  const std::int64_t rows = t.local_rows(tp), cols = t.local_cols(tp);
  const std::int64_t first_row = t.how == split::rows ? rank * rows : 0;
  const std::int64_t first_col = t.how == split::cols ? rank * cols : 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      f(static_cast<std::size_t>((first_row + r) * t.cols + first_col + c), static_cast<std::size_t>(r * cols + c));
}
}  // namespace

std::vector<float> part_of(const tensor_info& t, std::span<const float> whole, int tp, int rank) {
  if (whole.size() != static_cast<std::size_t>(t.rows * t.cols))
    throw std::invalid_argument(t.name + ": " + std::to_string(whole.size()) + " values for a tensor of " +
                                std::to_string(t.rows * t.cols));
  std::vector<float> part(static_cast<std::size_t>(t.local_rows(tp) * t.local_cols(tp)));
  for_part(t, tp, rank, [&](std::size_t w, std::size_t p) { part[p] = whole[w]; });
  return part;
}

void place_part(const tensor_info& t, std::span<const float> part, int tp, int rank, std::span<float> whole) {
  if (whole.size() != static_cast<std::size_t>(t.rows * t.cols) ||
      part.size() != static_cast<std::size_t>(t.local_rows(tp) * t.local_cols(tp)))
    throw std::invalid_argument(t.name + ": a part or whole of the wrong size");
  for_part(t, tp, rank, [&](std::size_t w, std::size_t p) { whole[w] = part[p]; });
}


model::model(model_config c, int max_sequences, tp_group tp) : c_(c), max_seq_(max_sequences), tp_(std::move(tp)) {
  if (max_seq_ < 1) throw std::invalid_argument("model: needs room for one sequence");
  if (tp_.size < 1 || tp_.rank < 0 || tp_.rank >= tp_.size || (tp_.size > 1 && (!tp_.sum || !tp_.max)))
    throw std::invalid_argument("model: bad tensor-parallel group");
  (void)model_tensors(c_, tp_.size);  // the shape checks
  heads_local_ = c_.heads / tp_.size;
  head_dim_ = c_.dim / c_.heads;
  dim_local_ = heads_local_ * head_dim_;
  ffn_local_ = c_.ffn / tp_.size;
  vocab_local_ = c_.vocab / tp_.size;
  const int half = head_dim_ / 2;
  cos_.resize(static_cast<std::size_t>(c_.seq) * half);
  sin_.resize(cos_.size());
  for (int t = 0; t < c_.seq; ++t)
    for (int i = 0; i < half; ++i) {  // in double, rounded once (as the PyTorch reference's table)
      const double inv_freq = 1.0 / std::pow(static_cast<double>(c_.rope_theta), 2.0 * i / head_dim_);
      const double angle = t * inv_freq;
      cos_[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::cos(angle));
      sin_[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::sin(angle));
    }
  const std::size_t rows = static_cast<std::size_t>(max_seq_) * c_.seq, d = c_.dim;
  const std::size_t dl = dim_local_, fl = ffn_local_;
  blocks_.resize(static_cast<std::size_t>(c_.layers));
  for (block_acts& a : blocks_) {
    a.x_in.resize(rows * d);
    a.normed1.resize(rows * d);
    a.rstd1.resize(rows);
    a.q.resize(rows * dl);
    a.k.resize(rows * dl);
    a.v.resize(rows * dl);
    a.probs.resize(static_cast<std::size_t>(max_seq_) * heads_local_ * c_.seq * c_.seq);
    a.heads.resize(rows * dl);
    a.x_mid.resize(rows * d);
    a.normed2.resize(rows * d);
    a.rstd2.resize(rows);
    a.gate.resize(rows * fl);
    a.up.resize(rows * fl);
    a.act.resize(rows * fl);
  }
  x_.resize(rows * d);
  final_in_.resize(rows * d);
  final_normed_.resize(rows * d);
  final_rstd_.resize(rows);
  logits_.resize(rows * static_cast<std::size_t>(vocab_local_));
  dx_.resize(rows * d);
  // backward's products: [rows, d] + 3 x [rows, fl] + 4 x [rows, dl] + 2 x [seq, seq]
  scratch_.resize(rows * d + 3 * rows * fl + 4 * rows * dl + 2 * static_cast<std::size_t>(c_.seq) * c_.seq);
}

void model::all_sum(float* p, std::size_t count) const {
  if (tp_.size > 1) tp_.sum(std::span<float>(p, count));
}

double model::train_batch(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                          double divisor) {
  const double total = forward(calls, inputs, targets, n, divisor);
  const int rows = n * c_.seq, d = c_.dim, vl = vocab_local_;
  const auto urows = static_cast<std::size_t>(rows);

  // The head: logits_ hold dL/dlogits (forward wrote them).
  const int head = c_.layers + 1;
  {
    std::vector<tensor_ref> t = calls.acquire(head, true);
    linear_weight_grad(logits_.data(), final_normed_.data(), t[1].g, rows, vl, d);
    float* dnormed = scratch_.data();
    linear_input_grad(logits_.data(), t[1].w, dnormed, rows, vl, d, false);
    all_sum(dnormed, urows * d);  // partial over the vocabulary's parts
    std::fill_n(dx_.data(), urows * d, 0.0f);
    rmsnorm_backward(final_in_.data(), t[0].w, final_rstd_.data(), dnormed, dx_.data(), t[0].g, rows, d);
    calls.grads_written(head);
    calls.release(head);
  }
  for (int l = c_.layers - 1; l >= 0; --l) {
    std::vector<tensor_ref> t = calls.acquire(l + 1, true);
    block_backward(l, t, n);
    calls.grads_written(l + 1);
    calls.release(l + 1);
  }
  // The embedding: each rank adds the rows of its own tokens, in position order.
  {
    std::vector<tensor_ref> t = calls.acquire(0, true);
    const std::int32_t first = tp_.rank * vl;
    std::fill_n(t[0].g, static_cast<std::size_t>(vl) * d, 0.0f);
    for (std::size_t r = 0; r < urows; ++r) {
      const std::int32_t tok = inputs[r] - first;
      if (tok < 0 || tok >= vl) continue;
      float* g = t[0].g + static_cast<std::size_t>(tok) * d;
      const float* dr = dx_.data() + r * d;
      for (int j = 0; j < d; ++j) g[j] += dr[j];
    }
    calls.grads_written(0);
    calls.release(0);
  }
  return total;
}

double model::loss(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n) {
  return forward(calls, inputs, targets, n, 0.0);
}

double model::forward(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                      double divisor) {
  if (n < 1 || n > max_seq_) throw std::invalid_argument("model: " + std::to_string(n) + " sequences do not fit");
  const int rows = n * c_.seq, d = c_.dim, vl = vocab_local_;
  const auto urows = static_cast<std::size_t>(rows);
  for (std::size_t r = 0; r < urows; ++r)
    if (inputs[r] < 0 || inputs[r] >= c_.vocab || targets[r] < 0 || targets[r] >= c_.vocab)
      throw std::invalid_argument("model: a token outside the vocabulary of " + std::to_string(c_.vocab));
  // The embedding: this rank's rows, zero elsewhere, summed over the group.
  {
    std::vector<tensor_ref> t = calls.acquire(0, false);
    const std::int32_t first = tp_.rank * vl;
    for (std::size_t r = 0; r < urows; ++r) {
      const std::int32_t tok = inputs[r] - first;
      float* xr = x_.data() + r * d;
      if (tok >= 0 && tok < vl)
        std::copy_n(t[0].w + static_cast<std::size_t>(tok) * d, d, xr);
      else
        std::fill_n(xr, d, 0.0f);
    }
    calls.release(0);
    all_sum(x_.data(), urows * d);
  }
  for (int l = 0; l < c_.layers; ++l) {
    std::vector<tensor_ref> t = calls.acquire(l + 1, false);
    block_forward(l, t, n);
    calls.release(l + 1);
  }
  // The head: final norm, this rank's logits, the cross-entropy reduced over the group.
  const int head = c_.layers + 1;
  std::vector<tensor_ref> t = calls.acquire(head, false);
  std::copy_n(x_.data(), urows * d, final_in_.data());
  rmsnorm(final_in_.data(), t[0].w, final_normed_.data(), final_rstd_.data(), rows, d, c_.norm_eps);
  linear(final_normed_.data(), t[1].w, logits_.data(), rows, vl, d);
  calls.release(head);
  std::vector<float> row_max(urows), row_sum(urows), target_logit(urows, 0.0f);
  const std::int32_t first = tp_.rank * vl;
  for (std::size_t r = 0; r < urows; ++r) {
    const float* lr = logits_.data() + r * vl;
    row_max[r] = *std::max_element(lr, lr + vl);
    const std::int32_t tok = targets[r] - first;
    if (tok >= 0 && tok < vl) target_logit[r] = lr[tok];
  }
  if (tp_.size > 1) tp_.max(std::span<float>(row_max));
  for (std::size_t r = 0; r < urows; ++r) {
    float* lr = logits_.data() + r * vl;
    float s = 0.0f;
    for (int j = 0; j < vl; ++j) s += std::exp(lr[j] - row_max[r]);
    row_sum[r] = s;
  }
  all_sum(row_sum.data(), urows);
  all_sum(target_logit.data(), urows);
  double total = 0.0;
  for (std::size_t r = 0; r < urows; ++r)
    total += std::log(static_cast<double>(row_sum[r])) + row_max[r] - target_logit[r];
  if (divisor > 0.0) {  // dL/dlogits of (sum of losses) / divisor, into logits_
    const auto scale = static_cast<float>(1.0 / divisor);
    for (std::size_t r = 0; r < urows; ++r) {
      float* lr = logits_.data() + r * vl;
      const float inv = 1.0f / row_sum[r];
      for (int j = 0; j < vl; ++j) lr[j] = std::exp(lr[j] - row_max[r]) * inv * scale;
      const std::int32_t tok = targets[r] - first;
      if (tok >= 0 && tok < vl) lr[tok] -= scale;
    }
  }
  return total;
}

void model::block_forward(int l, std::span<const tensor_ref> t, int n) {
  block_acts& a = blocks_[static_cast<std::size_t>(l)];
  const int rows = n * c_.seq, d = c_.dim, dl = dim_local_, fl = ffn_local_;
  const auto urows = static_cast<std::size_t>(rows);
  std::copy_n(x_.data(), urows * d, a.x_in.data());
  rmsnorm(a.x_in.data(), t[attention_norm].w, a.normed1.data(), a.rstd1.data(), rows, d, c_.norm_eps);
  linear(a.normed1.data(), t[wq].w, a.q.data(), rows, dl, d);
  linear(a.normed1.data(), t[wk].w, a.k.data(), rows, dl, d);
  linear(a.normed1.data(), t[wv].w, a.v.data(), rows, dl, d);
  rotate(a.q.data(), rows, false);
  rotate(a.k.data(), rows, false);
  attention_forward(a, n);
  // The row-parallel projection: this rank's heads' share of the output, summed over the group.
  float* y = scratch_.data();
  linear(a.heads.data(), t[wo].w, y, rows, d, dl);
  all_sum(y, urows * d);
  for (std::size_t i = 0; i < urows * d; ++i) x_[i] += y[i];
  std::copy_n(x_.data(), urows * d, a.x_mid.data());
  rmsnorm(a.x_mid.data(), t[ffn_norm].w, a.normed2.data(), a.rstd2.data(), rows, d, c_.norm_eps);
  linear(a.normed2.data(), t[w1].w, a.gate.data(), rows, fl, d);
  linear(a.normed2.data(), t[w3].w, a.up.data(), rows, fl, d);
  for (std::size_t i = 0; i < urows * fl; ++i) {
    const float z = a.gate[i];
    a.act[i] = z * sigmoid(z) * a.up[i];
  }
  linear(a.act.data(), t[w2].w, y, rows, d, fl);
  all_sum(y, urows * d);
  for (std::size_t i = 0; i < urows * d; ++i) x_[i] += y[i];
}

void model::rotate(float* x, int rows, bool inverse) const {
  // Each head's pairs (i, i + half) turned by position x inv_freq[i]; backward turns back.
  const int half = head_dim_ / 2, dl = dim_local_;
  for (int r = 0; r < rows; ++r) {
    const int pos = r % c_.seq;
    const float* cs = cos_.data() + static_cast<std::size_t>(pos) * half;
    const float* sn = sin_.data() + static_cast<std::size_t>(pos) * half;
    for (int h = 0; h < heads_local_; ++h) {
      float* v = x + static_cast<std::size_t>(r) * dl + static_cast<std::size_t>(h) * head_dim_;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half], s = inverse ? -sn[i] : sn[i];
        v[i] = a * cs[i] - b * s;
        v[i + half] = b * cs[i] + a * s;
      }
    }
  }
}

void model::attention_forward(block_acts& a, int n) {
  const int T = c_.seq, hd = head_dim_, dl = dim_local_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int b = 0; b < n; ++b)
    for (int h = 0; h < heads_local_; ++h) {
      const std::size_t at = static_cast<std::size_t>(b) * T * dl + static_cast<std::size_t>(h) * hd;
      float* p = a.probs.data() + (static_cast<std::size_t>(b) * heads_local_ + h) * T * T;
      cblas_sgemm(row_major, no_trans, trans, T, T, hd, scale, a.q.data() + at, dl, a.k.data() + at, dl, 0.0f, p, T);
      for (int i = 0; i < T; ++i) {  // causal softmax: key j <= query i
        float* pr = p + static_cast<std::size_t>(i) * T;
        const float m = *std::max_element(pr, pr + i + 1);
        float s = 0.0f;
        for (int j = 0; j <= i; ++j) s += pr[j] = std::exp(pr[j] - m);
        const float inv = 1.0f / s;
        for (int j = 0; j <= i; ++j) pr[j] *= inv;
        std::fill(pr + i + 1, pr + T, 0.0f);
      }
      cblas_sgemm(row_major, no_trans, no_trans, T, hd, T, 1.0f, p, T, a.v.data() + at, dl, 0.0f, a.heads.data() + at,
                  dl);
    }
}

void model::attention_backward(block_acts& a, int n, const float* dheads, float* dq, float* dk, float* dv) {
  const int T = c_.seq, hd = head_dim_, dl = dim_local_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* dp = scratch_.data() + scratch_.size() - 2 * static_cast<std::size_t>(T) * T;
  float* ds = dp + static_cast<std::size_t>(T) * T;
  for (int b = 0; b < n; ++b)
    for (int h = 0; h < heads_local_; ++h) {
      const std::size_t at = static_cast<std::size_t>(b) * T * dl + static_cast<std::size_t>(h) * hd;
      const float* p = a.probs.data() + (static_cast<std::size_t>(b) * heads_local_ + h) * T * T;
      cblas_sgemm(row_major, no_trans, trans, T, T, hd, 1.0f, dheads + at, dl, a.v.data() + at, dl, 0.0f, dp, T);
      cblas_sgemm(row_major, trans, no_trans, T, hd, T, 1.0f, p, T, dheads + at, dl, 0.0f, dv + at, dl);
      for (int i = 0; i < T; ++i) {  // through the softmax: dS = P (dP - sum_j P dP)
        const float* pr = p + static_cast<std::size_t>(i) * T;
        const float* dpr = dp + static_cast<std::size_t>(i) * T;
        float* dsr = ds + static_cast<std::size_t>(i) * T;
        float dot = 0.0f;
        for (int j = 0; j <= i; ++j) dot += pr[j] * dpr[j];
        for (int j = 0; j <= i; ++j) dsr[j] = pr[j] * (dpr[j] - dot);
        std::fill(dsr + i + 1, dsr + T, 0.0f);
      }
      cblas_sgemm(row_major, no_trans, no_trans, T, hd, T, scale, ds, T, a.k.data() + at, dl, 0.0f, dq + at, dl);
      cblas_sgemm(row_major, trans, no_trans, T, hd, T, scale, ds, T, a.q.data() + at, dl, 0.0f, dk + at, dl);
    }
}

void model::block_backward(int l, std::span<const tensor_ref> t, int n) {
  block_acts& a = blocks_[static_cast<std::size_t>(l)];
  const int rows = n * c_.seq, d = c_.dim, dl = dim_local_, fl = ffn_local_;
  const auto urows = static_cast<std::size_t>(rows);
  // scratch_: [rows, d] | 3 x [rows, fl] | 4 x [rows, dl] | 2 x [seq, seq]
  float* dnorm = scratch_.data();
  float* dgate = dnorm + urows * d;
  float* dup = dgate + urows * fl;
  float* dact = dup + urows * fl;
  float* dheads = dact + urows * fl;
  float* dq = dheads + urows * dl;
  float* dk = dq + urows * dl;
  float* dv = dk + urows * dl;

  // The MLP: dx_ is dL/d(block output), the residual passes it on unchanged.
  linear_weight_grad(dx_.data(), a.act.data(), t[w2].g, rows, d, fl);
  linear_input_grad(dx_.data(), t[w2].w, dact, rows, d, fl, false);
  for (std::size_t i = 0; i < urows * fl; ++i) {
    const float z = a.gate[i], sg = sigmoid(z), silu = z * sg;
    dup[i] = dact[i] * silu;
    dgate[i] = dact[i] * a.up[i] * sg * (1.0f + z * (1.0f - sg));
  }
  linear_weight_grad(dgate, a.normed2.data(), t[w1].g, rows, fl, d);
  linear_weight_grad(dup, a.normed2.data(), t[w3].g, rows, fl, d);
  linear_input_grad(dgate, t[w1].w, dnorm, rows, fl, d, false);
  linear_input_grad(dup, t[w3].w, dnorm, rows, fl, d, true);
  all_sum(dnorm, urows * d);  // partial over the hidden units' parts
  rmsnorm_backward(a.x_mid.data(), t[ffn_norm].w, a.rstd2.data(), dnorm, dx_.data(), t[ffn_norm].g, rows, d);

  // The attention: dx_ is now dL/d(x_mid).
  linear_weight_grad(dx_.data(), a.heads.data(), t[wo].g, rows, d, dl);
  linear_input_grad(dx_.data(), t[wo].w, dheads, rows, d, dl, false);
  attention_backward(a, n, dheads, dq, dk, dv);
  rotate(dq, rows, true);
  rotate(dk, rows, true);
  linear_weight_grad(dq, a.normed1.data(), t[wq].g, rows, dl, d);
  linear_weight_grad(dk, a.normed1.data(), t[wk].g, rows, dl, d);
  linear_weight_grad(dv, a.normed1.data(), t[wv].g, rows, dl, d);
  linear_input_grad(dq, t[wq].w, dnorm, rows, dl, d, false);
  linear_input_grad(dk, t[wk].w, dnorm, rows, dl, d, true);
  linear_input_grad(dv, t[wv].w, dnorm, rows, dl, d, true);
  all_sum(dnorm, urows * d);  // partial over the heads' parts
  rmsnorm_backward(a.x_in.data(), t[attention_norm].w, a.rstd1.data(), dnorm, dx_.data(), t[attention_norm].g, rows,
                   d);
}

}  // namespace gpt
