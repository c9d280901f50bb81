// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "mlp_cuda.cuh"

#include <algorithm>
#include <cfloat>

namespace fmnist::gpu {
namespace {

constexpr int threads = 256;

unsigned blocks_for(std::size_t count) {
  return static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 65535));
}

// out[r, c] = bias[c]: the product then accumulates onto it (beta = 1), as mlp.cpp does.
__global__ void broadcast_bias(float* out, const float* bias, int n, int m) {
  const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(m);
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x)
    out[i] = bias[i % static_cast<std::size_t>(m)];
}

__global__ void relu(float* v, std::size_t count) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x)
    v[i] = fmaxf(v[i], 0.0f);
}

// Softmax cross-entropy of row r (a thread each): its loss into row_loss[r], and its
// gradient w.r.t. the logits, (softmax - one_hot) * inv, into delta.
__global__ void softmax_cross_entropy(const float* logits, const std::uint8_t* labels, int n, int classes, float inv,
                                      float* delta, double* row_loss) {
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= n) return;
  const float* z = logits + static_cast<std::size_t>(r) * classes;
  float* d = delta + static_cast<std::size_t>(r) * classes;
  float top = -FLT_MAX;
  for (int c = 0; c < classes; ++c) top = fmaxf(top, z[c]);
  float sum = 0.0f;
  for (int c = 0; c < classes; ++c) sum += d[c] = expf(z[c] - top);
  const int label = labels[r];
  row_loss[r] = log(static_cast<double>(sum)) + static_cast<double>(top) - static_cast<double>(z[label]);
  for (int c = 0; c < classes; ++c) d[c] *= inv / sum;
  d[label] -= inv;
}

// grad[c] = sum over rows of d[r, c] (a thread per column, rows in order): the bias grads.
__global__ void column_sums(const float* d, int n, int m, float* grad) {
  const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= m) return;
  float s = 0.0f;
  for (int r = 0; r < n; ++r) s += d[static_cast<std::size_t>(r) * m + c];
  grad[c] = s;
}

// Through the ReLU below: zero where its output was not positive.
__global__ void relu_backward(float* delta, const float* below, std::size_t count) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x)
    if (!(below[i] > 0.0f)) delta[i] = 0.0f;
}

// Counts the rows whose first highest logit is at their label (integer atomics: exact).
__global__ void count_at_label(const float* logits, const std::uint8_t* labels, int n, int classes, int* correct) {
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= n) return;
  const float* z = logits + static_cast<std::size_t>(r) * classes;
  int best = 0;
  for (int c = 1; c < classes; ++c)
    if (z[c] > z[best]) best = c;
  if (best == labels[r]) atomicAdd(correct, 1);
}

__global__ void gather_rows(const float* images, const std::uint8_t* labels, const std::uint32_t* order,
                            std::size_t first, int n, int pixels, float* x, std::uint8_t* y) {
  const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(pixels);
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::size_t r = i / static_cast<std::size_t>(pixels), p = i % static_cast<std::size_t>(pixels);
    const std::size_t s = order[first + r];
    x[i] = images[s * static_cast<std::size_t>(pixels) + p];
    if (p == 0) y[r] = labels[s];
  }
}

}  // namespace

device_mlp::device_mlp(std::vector<int> sizes, int max_batch, cudaStream_t stream)
    : sizes_(std::move(sizes)), max_batch_(max_batch), stream_(stream) {
  if (sizes_.size() < 2 || max_batch_ < 1) throw std::invalid_argument("device_mlp: needs two sizes and a batch");
  check(cublasCreate(&blas_), "cublasCreate");
  check(cublasSetStream(blas_, stream_), "cublasSetStream");
  // fp32 products in fp32: cuBLAS's default math (no TF32 tensor cores), said here.
  check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  int widest = 0;
  for (std::size_t l = 1; l < sizes_.size(); ++l) {
    out_.emplace_back(static_cast<std::size_t>(max_batch_) * static_cast<std::size_t>(sizes_[l]));
    widest = std::max(widest, sizes_[l]);
  }
  delta_ = device_array<float>(static_cast<std::size_t>(max_batch_) * static_cast<std::size_t>(widest));
  delta_next_ = device_array<float>(delta_.size());
  row_loss_ = device_array<double>(static_cast<std::size_t>(max_batch_));
  loss_ = device_array<double>(1);
  correct_ = device_array<int>(1);
}

device_mlp::~device_mlp() {
  if (blas_) cublasDestroy(blas_);
}

// Row-major products through column-major cuBLAS: a row-major [r, c] array is read as the
// column-major [c, r] one (written A' below), so out[n, m] = in[n, k] * weight[m, k]^T is
// out'[m, n] = (weight'[k, m])^T * in'[k, n]: gemm(T, N).
const float* device_mlp::forward(std::span<const device_linear> layers, const float* x, int n) {
  const float one = 1.0f;
  const int count = static_cast<int>(sizes_.size()) - 1;
  for (int l = 0; l < count; ++l) {
    const device_linear& layer = layers[static_cast<std::size_t>(l)];
    const int k = sizes_[static_cast<std::size_t>(l)], m = sizes_[static_cast<std::size_t>(l) + 1];
    const float* in = l == 0 ? x : out_[static_cast<std::size_t>(l) - 1].data();
    float* out = out_[static_cast<std::size_t>(l)].data();
    const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(m);
    broadcast_bias<<<blocks_for(elems), threads, 0, stream_>>>(out, layer.bias, n, m);
    check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, layer.weight, k, in, k, &one, out, m),
          "cublasSgemm (forward)");
    if (l + 1 < count) relu<<<blocks_for(elems), threads, 0, stream_>>>(out, elems);
  }
  check(cudaGetLastError(), "a forward kernel's launch");
  return out_.back().data();
}

double device_mlp::train_batch(std::span<const device_linear> layers, const float* x, const std::uint8_t* labels,
                               int n, int divisor) {
  if (n < 1 || n > max_batch_ || divisor < 1) throw std::invalid_argument("device_mlp::train_batch: bad row count");
  const int classes = sizes_.back(), count = static_cast<int>(sizes_.size()) - 1;
  const float* logits = forward(layers, x, n);
  softmax_cross_entropy<<<(n + threads - 1) / threads, threads, 0, stream_>>>(
      logits, labels, n, classes, 1.0f / static_cast<float>(divisor), delta_.data(), row_loss_.data());
  examples::cuda::sum_in_order<threads><<<1, threads, 0, stream_>>>(row_loss_.data(), n, loss_.data());
  const float one = 1.0f, zero = 0.0f;
  for (int l = count - 1; l >= 0; --l) {
    const device_linear& layer = layers[static_cast<std::size_t>(l)];
    const int k = sizes_[static_cast<std::size_t>(l)], m = sizes_[static_cast<std::size_t>(l) + 1];
    const float* in = l == 0 ? x : out_[static_cast<std::size_t>(l) - 1].data();
    // weight_grad[m, k] = delta[n, m]^T * in[n, k]; column-major: [k, m] = in^T[k, n] * delta[n, m]
    check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, k, m, n, &one, in, k, delta_.data(), m, &zero,
                      layer.weight_grad, k),
          "cublasSgemm (weight grads)");
    column_sums<<<(m + threads - 1) / threads, threads, 0, stream_>>>(delta_.data(), n, m, layer.bias_grad);
    if (l == 0) break;  // no gradient is needed for the images
    // delta_next[n, k] = delta[n, m] * weight[m, k]; column-major: [k, n] = weight^T[k, m] * delta^T[m, n]
    check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, k, n, m, &one, layer.weight, k, delta_.data(), m, &zero,
                      delta_next_.data(), k),
          "cublasSgemm (input grads)");
    const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(k);
    relu_backward<<<blocks_for(elems), threads, 0, stream_>>>(delta_next_.data(),
                                                              out_[static_cast<std::size_t>(l) - 1].data(), elems);
    std::swap(delta_, delta_next_);
  }
  check(cudaGetLastError(), "a backward kernel's launch");
  double loss = 0.0;
  check(cudaMemcpyAsync(&loss, loss_.data(), sizeof loss, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (loss)");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (loss)");
  return loss;
}

int device_mlp::count_correct(std::span<const device_linear> layers, const float* x, const std::uint8_t* labels,
                              int n) {
  if (n < 1 || n > max_batch_) throw std::invalid_argument("device_mlp::count_correct: bad row count");
  const float* logits = forward(layers, x, n);
  check(cudaMemsetAsync(correct_.data(), 0, sizeof(int), stream_), "cudaMemsetAsync");
  count_at_label<<<(n + threads - 1) / threads, threads, 0, stream_>>>(logits, labels, n, sizes_.back(),
                                                                       correct_.data());
  check(cudaGetLastError(), "count_at_label's launch");
  int correct = 0;
  check(cudaMemcpyAsync(&correct, correct_.data(), sizeof correct, cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync (correct)");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (correct)");
  return correct;
}

void gather_batch(const float* images, const std::uint8_t* labels, const std::uint32_t* order, std::size_t first,
                  int n, int pixels, float* x, std::uint8_t* y, cudaStream_t stream) {
  const std::size_t elems = static_cast<std::size_t>(n) * static_cast<std::size_t>(pixels);
  gather_rows<<<blocks_for(elems), threads, 0, stream>>>(images, labels, order, first, n, pixels, x, y);
  check(cudaGetLastError(), "gather_rows' launch");
}

}  // namespace fmnist::gpu
