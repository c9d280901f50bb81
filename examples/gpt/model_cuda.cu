// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "model_cuda.cuh"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>

namespace gpt::gpu {
namespace {

constexpr int threads = 256;
static_assert(threads % 32 == 0, "the row kernels take whole warps a row");
constexpr int warps_per_block = threads / 32;
constexpr int weight_grad_chunks = 64;  // rmsnorm_weight_grad's row chunks (a fixed count: a fixed order)
constexpr unsigned full_mask = 0xffffffffu;

unsigned blocks_for(std::size_t count) {
  return static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 65535));
}
/// One warp a row.
unsigned blocks_for_rows(int rows) { return static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block); }

#define DISTOPT_GPT_GRID_STRIDE(i, count)                                                                  \
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < (count); \
       i += std::size_t{gridDim.x} * blockDim.x)

template <class T>
__device__ T warp_sum(T v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(full_mask, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(full_mask, v, o));
  return v;
}
/// This thread's row (a warp each) and lane; whole warps leave together past the last row.
__device__ std::size_t warp_row() { return (std::size_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; }
__device__ int lane() { return static_cast<int>(threadIdx.x % 32); }

// x[r] = table[tokens[r]] (rows of d).
__global__ void embed(const std::int32_t* tokens, const float* table, float* x, int rows, int d) {
  DISTOPT_GPT_GRID_STRIDE(i, static_cast<std::size_t>(rows) * d) {
    const std::size_t r = i / d, j = i % d;
    x[i] = table[static_cast<std::size_t>(tokens[r]) * d + j];
  }
}

// g[v] = the sum of dx's rows whose token is v, in position order (a thread per element of g).
__global__ void embed_grad(const std::int32_t* tokens, const float* dx, float* g, int rows, int vocab, int d) {
  DISTOPT_GPT_GRID_STRIDE(i, static_cast<std::size_t>(vocab) * d) {
    const auto v = static_cast<std::int32_t>(i / d);
    const std::size_t j = i % d;
    float s = 0.0f;
    for (int r = 0; r < rows; ++r)
      if (tokens[r] == v) s += dx[static_cast<std::size_t>(r) * d + j];
    g[i] = s;
  }
}

// y = x / rms(x) * w a row a warp (the squares summed in double, as model.cpp), 1 / rms kept.
__global__ void rmsnorm(const float* x, const float* w, float* y, float* rstd, int rows, int d, float eps) {
  const std::size_t r = warp_row();
  if (r >= static_cast<std::size_t>(rows)) return;
  const float* xr = x + static_cast<std::size_t>(r) * d;
  float* yr = y + static_cast<std::size_t>(r) * d;
  double squares = 0.0;
  for (int j = lane(); j < d; j += 32) squares += static_cast<double>(xr[j]) * xr[j];
  squares = warp_sum(squares);
  const float s = 1.0f / sqrtf(static_cast<float>(squares / d) + eps);
  if (lane() == 0) rstd[r] = s;
  for (int j = lane(); j < d; j += 32) yr[j] = xr[j] * s * w[j];
}

// dx += dL/dx of rmsnorm for dL/dy = dy, a row a warp.
__global__ void rmsnorm_input_grad(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                                   int rows, int d) {
  const std::size_t r = warp_row();
  if (r >= static_cast<std::size_t>(rows)) return;
  const float* xr = x + static_cast<std::size_t>(r) * d;
  const float* dyr = dy + static_cast<std::size_t>(r) * d;
  float* dxr = dx + static_cast<std::size_t>(r) * d;
  const float s = rstd[r];
  double ux = 0.0;
  for (int j = lane(); j < d; j += 32) ux += static_cast<double>(dyr[j] * w[j]) * xr[j];
  ux = warp_sum(ux);
  const float k = static_cast<float>(ux / d) * s * s * s;
  for (int j = lane(); j < d; j += 32) dxr[j] += s * (dyr[j] * w[j]) - k * xr[j];
}

// dw[j] = sum over rows of dy x x x rstd in two passes of a fixed order: block c sums its
// chunk of rows into partial[c] (a thread a column), then each column's chunks are summed in
// chunk order.
__global__ void rmsnorm_weight_grad_chunks(const float* x, const float* rstd, const float* dy, float* partial, int rows,
                                           int d, int chunk_rows) {
  const int first = static_cast<int>(blockIdx.x) * chunk_rows, last = min(rows, first + chunk_rows);
  for (int j = static_cast<int>(threadIdx.x); j < d; j += static_cast<int>(blockDim.x)) {
    float s = 0.0f;
    for (int r = first; r < last; ++r) {
      const std::size_t at = static_cast<std::size_t>(r) * d + j;
      s += dy[at] * x[at] * rstd[r];
    }
    partial[static_cast<std::size_t>(blockIdx.x) * d + j] = s;
  }
}
__global__ void sum_chunks(const float* partial, float* dw, int chunks, int d) {
  DISTOPT_GPT_GRID_STRIDE(j, static_cast<std::size_t>(d)) {
    float s = 0.0f;
    for (int c = 0; c < chunks; ++c) s += partial[static_cast<std::size_t>(c) * d + j];
    dw[j] = s;
  }
}

// The rotary embedding in place: each head's pairs (i, i + half) turned by the position's
// angle (inverse: turned back), a thread a pair.
__global__ void rotate(float* x, const float* cos_t, const float* sin_t, int rows, int seq, int heads, int head_dim,
                       bool inverse) {
  const int half = head_dim / 2;
  DISTOPT_GPT_GRID_STRIDE(p, static_cast<std::size_t>(rows) * heads * half) {
    const int i = static_cast<int>(p % half);
    const std::size_t rh = p / half;  // row x heads + head
    const int r = static_cast<int>(rh / heads);
    const int pos = r % seq;
    float* v = x + rh * head_dim;
    const float cs = cos_t[static_cast<std::size_t>(pos) * half + i];
    const float sn = inverse ? -sin_t[static_cast<std::size_t>(pos) * half + i] : sin_t[static_cast<std::size_t>(pos) * half + i];
    const float a = v[i], b = v[i + half];
    v[i] = a * cs - b * sn;
    v[i + half] = b * cs + a * sn;
  }
}

// The causal softmax of scores [rows, seq] in place, a row a warp (query i = row % seq sees
// keys 0..i; the rest become 0).
__global__ void causal_softmax(float* p, int rows, int seq) {
  const std::size_t r = warp_row();
  if (r >= static_cast<std::size_t>(rows)) return;
  const int i = static_cast<int>(r % seq);
  float* pr = p + static_cast<std::size_t>(r) * seq;
  float m = -FLT_MAX;
  for (int j = lane(); j <= i; j += 32) m = fmaxf(m, pr[j]);
  m = warp_max(m);
  float s = 0.0f;
  for (int j = lane(); j <= i; j += 32) s += pr[j] = expf(pr[j] - m);
  s = warp_sum(s);
  const float inv = 1.0f / s;
  for (int j = lane(); j < seq; j += 32) pr[j] = j <= i ? pr[j] * inv : 0.0f;
}

// Through the causal softmax, in place: dp becomes dS = P (dP - sum_j P dP), a row a warp.
__global__ void causal_softmax_grad(const float* p, float* dp, int rows, int seq) {
  const std::size_t r = warp_row();
  if (r >= static_cast<std::size_t>(rows)) return;
  const int i = static_cast<int>(r % seq);
  const float* pr = p + static_cast<std::size_t>(r) * seq;
  float* dr = dp + static_cast<std::size_t>(r) * seq;
  float dot = 0.0f;
  for (int j = lane(); j <= i; j += 32) dot += pr[j] * dr[j];
  dot = warp_sum(dot);
  for (int j = lane(); j < seq; j += 32) dr[j] = j <= i ? pr[j] * (dr[j] - dot) : 0.0f;
}

__device__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

__global__ void swiglu(const float* gate, const float* up, float* act, std::size_t count) {
  DISTOPT_GPT_GRID_STRIDE(i, count) {
    const float z = gate[i];
    act[i] = z * sigmoid(z) * up[i];
  }
}

__global__ void swiglu_grad(const float* gate, const float* up, const float* dact, float* dgate, float* dup,
                            std::size_t count) {
  DISTOPT_GPT_GRID_STRIDE(i, count) {
    const float z = gate[i], sg = sigmoid(z), silu = z * sg;
    dup[i] = dact[i] * silu;
    dgate[i] = dact[i] * up[i] * sg * (1.0f + z * (1.0f - sg));
  }
}

__global__ void add_into(float* x, const float* y, std::size_t count) {
  DISTOPT_GPT_GRID_STRIDE(i, count) x[i] += y[i];
}

// The cross-entropy of each row of logits [rows, vocab] with its target, a row a warp, into
// row_loss; with `grad`, the logits become dL/dlogits of (sum of losses) x scale.
__global__ void cross_entropy(float* logits, const std::int32_t* targets, int rows, int vocab, float scale, bool grad,
                              double* row_loss) {
  const std::size_t r = warp_row();
  if (r >= static_cast<std::size_t>(rows)) return;
  float* lr = logits + static_cast<std::size_t>(r) * vocab;
  const int t = targets[r];
  const float target_logit = lr[t];
  float m = -FLT_MAX;
  for (int j = lane(); j < vocab; j += 32) m = fmaxf(m, lr[j]);
  m = warp_max(m);
  float s = 0.0f;
  for (int j = lane(); j < vocab; j += 32) s += expf(lr[j] - m);
  s = warp_sum(s);
  if (lane() == 0) row_loss[r] = log(static_cast<double>(s)) + m - target_logit;
  if (!grad) return;
  __syncwarp();  // every lane has read the target's logit
  const float inv = 1.0f / s;
  for (int j = lane(); j < vocab; j += 32) {
    const float g = expf(lr[j] - m) * inv * scale;
    lr[j] = j == t ? g - scale : g;
  }
}

#undef DISTOPT_GPT_GRID_STRIDE

}  // namespace

device_model::device_model(model_config c, int max_sequences, cudaStream_t stream)
    : c_(c), max_seq_(max_sequences), stream_(stream) {
  if (max_seq_ < 1) throw std::invalid_argument("device_model: needs room for one sequence");
  (void)model_tensors(c_, 1);  // the shape checks
  head_dim_ = c_.dim / c_.heads;
  const int half = head_dim_ / 2;
  std::vector<float> cs(static_cast<std::size_t>(c_.seq) * half), sn(cs.size());
  for (int t = 0; t < c_.seq; ++t)
    for (int i = 0; i < half; ++i) {  // model.cpp's table, the same expression
      const double inv_freq = 1.0 / std::pow(static_cast<double>(c_.rope_theta), 2.0 * i / head_dim_);
      const double angle = t * inv_freq;
      cs[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::cos(angle));
      sn[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::sin(angle));
    }
  cos_ = device_array<float>(cs.size());
  sin_ = device_array<float>(sn.size());
  cos_.upload(cs);
  sin_.upload(sn);
  const std::size_t rows = static_cast<std::size_t>(max_seq_) * c_.seq, d = c_.dim, f = c_.ffn;
  const std::size_t probs = static_cast<std::size_t>(max_seq_) * c_.heads * c_.seq * c_.seq;
  blocks_.resize(static_cast<std::size_t>(c_.layers));
  for (block_acts& a : blocks_) {
    for (device_array<float>* p : {&a.x_in, &a.normed1, &a.q, &a.k, &a.v, &a.heads, &a.x_mid, &a.normed2})
      *p = device_array<float>(rows * d);
    for (device_array<float>* p : {&a.gate, &a.up, &a.act}) *p = device_array<float>(rows * f);
    a.rstd1 = device_array<float>(rows);
    a.rstd2 = device_array<float>(rows);
    a.probs = device_array<float>(probs);
  }
  for (device_array<float>* p : {&x_, &final_in_, &final_normed_, &dx_}) *p = device_array<float>(rows * d);
  final_rstd_ = device_array<float>(rows);
  logits_ = device_array<float>(rows * static_cast<std::size_t>(c_.vocab));
  scratch_ = device_array<float>(rows * d + 3 * rows * f + 4 * rows * d + probs);
  row_loss_ = device_array<double>(rows);
  loss_ = device_array<double>(1);
  weight_grad_partial_ = device_array<float>(static_cast<std::size_t>(weight_grad_chunks) * d);
  // The handle last: nothing after it throws, so the destructor always frees it.
  check(cublasCreate(&blas_), "cublasCreate");
  check(cublasSetStream(blas_, stream_), "cublasSetStream");
  check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");  // fp32 products in fp32 (no TF32)
}

device_model::~device_model() {
  if (blas_) cublasDestroy(blas_);
}

// A row-major [r, c] array is the column-major [c, r] one, so C = op(A) op(B) is, column-major,
// C' = op(B)' op(A)': the operands swap, each keeping its op.
void device_model::gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                        long long stride_a, const float* b, int ldb, long long stride_b, float beta, float* c, int ldc,
                        long long stride_c, int batch) const {
  check(cublasSgemmStridedBatched(blas_, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
                                  k, &alpha, b, ldb, stride_b, a, lda, stride_a, &beta, c, ldc, stride_c, batch),
        "cublasSgemmStridedBatched");
}
// As model.cpp's: Y[rows, out] = X W^T (+ Y); dX[rows, in] (+)= dY W; dW[out, in] = dY^T X.
void device_model::linear(const float* x, const float* w, float* y, int rows, int out, int in, bool add) const {
  gemm(false, true, rows, out, in, 1.0f, x, in, 0, w, in, 0, add ? 1.0f : 0.0f, y, out, 0);
}
void device_model::linear_input_grad(const float* dy, const float* w, float* dx, int rows, int out, int in,
                                     bool add) const {
  gemm(false, false, rows, in, out, 1.0f, dy, out, 0, w, in, 0, add ? 1.0f : 0.0f, dx, in, 0);
}
void device_model::norm_weight_grad(const float* x, const float* rstd, const float* dy, float* dw, int rows,
                                    int d) const {
  const int chunk_rows = (rows + weight_grad_chunks - 1) / weight_grad_chunks;
  const int chunks = (rows + chunk_rows - 1) / chunk_rows;
  rmsnorm_weight_grad_chunks<<<static_cast<unsigned>(chunks), threads, 0, stream_>>>(
      x, rstd, dy, weight_grad_partial_.data(), rows, d, chunk_rows);
  sum_chunks<<<blocks_for(d), threads, 0, stream_>>>(weight_grad_partial_.data(), dw, chunks, d);
}
void device_model::linear_weight_grad(const float* dy, const float* x, float* dw, int rows, int out, int in) const {
  gemm(true, false, out, in, rows, 1.0f, dy, out, 0, x, in, 0, 0.0f, dw, in, 0);
}

void device_model::forward(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n,
                           double divisor) {
  if (n < 1 || n > max_seq_) throw std::invalid_argument("device_model: " + std::to_string(n) + " sequences do not fit");
  const int rows = n * c_.seq, d = c_.dim, V = c_.vocab;
  const auto urows = static_cast<std::size_t>(rows);
  {
    std::vector<tensor_ref> t = calls.acquire(0, false);
    embed<<<blocks_for(urows * d), threads, 0, stream_>>>(inputs, t[0].w, x_.data(), rows, d);
    calls.release(0);
  }
  for (int l = 0; l < c_.layers; ++l) {
    std::vector<tensor_ref> t = calls.acquire(l + 1, false);
    block_forward(l, t, n);
    calls.release(l + 1);
  }
  const int head = c_.layers + 1;
  std::vector<tensor_ref> t = calls.acquire(head, false);
  check(cudaMemcpyAsync(final_in_.data(), x_.data(), urows * d * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync");
  rmsnorm<<<blocks_for_rows(rows), threads, 0, stream_>>>(final_in_.data(), t[0].w, final_normed_.data(),
                                                          final_rstd_.data(), rows, d, c_.norm_eps);
  linear(final_normed_.data(), t[1].w, logits_.data(), rows, V, d);
  calls.release(head);
  cross_entropy<<<blocks_for_rows(rows), threads, 0, stream_>>>(
      logits_.data(), targets, rows, V, divisor > 0.0 ? static_cast<float>(1.0 / divisor) : 0.0f, divisor > 0.0,
      row_loss_.data());
  examples::cuda::sum_in_order<threads><<<1, threads, 0, stream_>>>(row_loss_.data(), rows, loss_.data());
  check(cudaGetLastError(), "a forward kernel's launch");
}

double device_model::summed_loss() {
  double total = 0.0;
  check(cudaMemcpyAsync(&total, loss_.data(), sizeof total, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (loss)");
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (the pass's kernels)");
  return total;
}

double device_model::loss(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets, int n) {
  forward(calls, inputs, targets, n, 0.0);
  return summed_loss();
}

double device_model::train_batch(const unit_calls& calls, const std::int32_t* inputs, const std::int32_t* targets,
                                 int n, double divisor) {
  forward(calls, inputs, targets, n, divisor);
  const int rows = n * c_.seq, d = c_.dim, V = c_.vocab;
  const auto urows = static_cast<std::size_t>(rows);
  const int head = c_.layers + 1;
  {
    std::vector<tensor_ref> t = calls.acquire(head, true);
    linear_weight_grad(logits_.data(), final_normed_.data(), t[1].g, rows, V, d);
    float* dnormed = scratch_.data();
    linear_input_grad(logits_.data(), t[1].w, dnormed, rows, V, d, false);
    check(cudaMemsetAsync(dx_.data(), 0, urows * d * sizeof(float), stream_), "cudaMemsetAsync");
    rmsnorm_input_grad<<<blocks_for_rows(rows), threads, 0, stream_>>>(final_in_.data(), t[0].w, final_rstd_.data(),
                                                                       dnormed, dx_.data(), rows, d);
    norm_weight_grad(final_in_.data(), final_rstd_.data(), dnormed, t[0].g,
                                                                rows, d);
    calls.grads_written(head);
    calls.release(head);
  }
  for (int l = c_.layers - 1; l >= 0; --l) {
    std::vector<tensor_ref> t = calls.acquire(l + 1, true);
    block_backward(l, t, n);
    calls.grads_written(l + 1);
    calls.release(l + 1);
  }
  {
    std::vector<tensor_ref> t = calls.acquire(0, true);
    embed_grad<<<blocks_for(static_cast<std::size_t>(V) * d), threads, 0, stream_>>>(inputs, dx_.data(), t[0].g, rows,
                                                                                     V, d);
    calls.grads_written(0);
    calls.release(0);
  }
  check(cudaGetLastError(), "a backward kernel's launch");
  return summed_loss();  // waits for backward too
}

namespace {
enum block_tensor { attention_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2 };  // model.cpp's order
}  // namespace

void device_model::block_forward(int l, const std::vector<tensor_ref>& t, int n) {
  block_acts& a = blocks_[static_cast<std::size_t>(l)];
  const int rows = n * c_.seq, d = c_.dim, f = c_.ffn, T = c_.seq, H = c_.heads, hd = head_dim_;
  const auto urows = static_cast<std::size_t>(rows);
  check(cudaMemcpyAsync(a.x_in.data(), x_.data(), urows * d * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync");
  rmsnorm<<<blocks_for_rows(rows), threads, 0, stream_>>>(a.x_in.data(), t[attention_norm].w, a.normed1.data(),
                                                          a.rstd1.data(), rows, d, c_.norm_eps);
  linear(a.normed1.data(), t[wq].w, a.q.data(), rows, d, d);
  linear(a.normed1.data(), t[wk].w, a.k.data(), rows, d, d);
  linear(a.normed1.data(), t[wv].w, a.v.data(), rows, d, d);
  const std::size_t pairs = urows * H * (hd / 2);
  rotate<<<blocks_for(pairs), threads, 0, stream_>>>(a.q.data(), cos_.data(), sin_.data(), rows, T, H, hd, false);
  rotate<<<blocks_for(pairs), threads, 0, stream_>>>(a.k.data(), cos_.data(), sin_.data(), rows, T, H, hd, false);
  // Per head, batched over the sequences: scores, the causal softmax (every head at once), P V.
  const long long seq_stride = static_cast<long long>(T) * d, probs_stride = static_cast<long long>(H) * T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int h = 0; h < H; ++h)
    gemm(false, true, T, T, hd, scale, a.q.data() + h * hd, d, seq_stride, a.k.data() + h * hd, d, seq_stride, 0.0f,
         a.probs.data() + static_cast<std::size_t>(h) * T * T, T, probs_stride, n);
  causal_softmax<<<blocks_for_rows(n * H * T), threads, 0, stream_>>>(a.probs.data(), n * H * T, T);
  for (int h = 0; h < H; ++h)
    gemm(false, false, T, hd, T, 1.0f, a.probs.data() + static_cast<std::size_t>(h) * T * T, T, probs_stride,
         a.v.data() + h * hd, d, seq_stride, 0.0f, a.heads.data() + h * hd, d, seq_stride, n);
  float* y = scratch_.data();
  linear(a.heads.data(), t[wo].w, y, rows, d, d);
  add_into<<<blocks_for(urows * d), threads, 0, stream_>>>(x_.data(), y, urows * d);
  check(cudaMemcpyAsync(a.x_mid.data(), x_.data(), urows * d * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "cudaMemcpyAsync");
  rmsnorm<<<blocks_for_rows(rows), threads, 0, stream_>>>(a.x_mid.data(), t[ffn_norm].w, a.normed2.data(),
                                                          a.rstd2.data(), rows, d, c_.norm_eps);
  linear(a.normed2.data(), t[w1].w, a.gate.data(), rows, f, d);
  linear(a.normed2.data(), t[w3].w, a.up.data(), rows, f, d);
  swiglu<<<blocks_for(urows * f), threads, 0, stream_>>>(a.gate.data(), a.up.data(), a.act.data(), urows * f);
  linear(a.act.data(), t[w2].w, y, rows, d, f);
  add_into<<<blocks_for(urows * d), threads, 0, stream_>>>(x_.data(), y, urows * d);
}

void device_model::block_backward(int l, const std::vector<tensor_ref>& t, int n) {
  block_acts& a = blocks_[static_cast<std::size_t>(l)];
  const int rows = n * c_.seq, d = c_.dim, f = c_.ffn, T = c_.seq, H = c_.heads, hd = head_dim_;
  const auto urows = static_cast<std::size_t>(rows);
  float* dnorm = scratch_.data();
  float* dgate = dnorm + urows * d;
  float* dup = dgate + urows * f;
  float* dact = dup + urows * f;
  float* dheads = dact + urows * f;
  float* dq = dheads + urows * d;
  float* dk = dq + urows * d;
  float* dv = dk + urows * d;
  float* dprobs = dv + urows * d;  // [n, heads, seq, seq]

  // The MLP: dx_ is dL/d(block output).
  linear_weight_grad(dx_.data(), a.act.data(), t[w2].g, rows, d, f);
  linear_input_grad(dx_.data(), t[w2].w, dact, rows, d, f, false);
  swiglu_grad<<<blocks_for(urows * f), threads, 0, stream_>>>(a.gate.data(), a.up.data(), dact, dgate, dup, urows * f);
  linear_weight_grad(dgate, a.normed2.data(), t[w1].g, rows, f, d);
  linear_weight_grad(dup, a.normed2.data(), t[w3].g, rows, f, d);
  linear_input_grad(dgate, t[w1].w, dnorm, rows, f, d, false);
  linear_input_grad(dup, t[w3].w, dnorm, rows, f, d, true);
  rmsnorm_input_grad<<<blocks_for_rows(rows), threads, 0, stream_>>>(a.x_mid.data(), t[ffn_norm].w, a.rstd2.data(),
                                                                     dnorm, dx_.data(), rows, d);
  norm_weight_grad(a.x_mid.data(), a.rstd2.data(), dnorm, t[ffn_norm].g,
                                                              rows, d);

  // The attention: dx_ is now dL/d(x_mid).
  linear_weight_grad(dx_.data(), a.heads.data(), t[wo].g, rows, d, d);
  linear_input_grad(dx_.data(), t[wo].w, dheads, rows, d, d, false);
  const long long seq_stride = static_cast<long long>(T) * d, probs_stride = static_cast<long long>(H) * T * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int h = 0; h < H; ++h) {
    const std::size_t p_at = static_cast<std::size_t>(h) * T * T;
    gemm(false, true, T, T, hd, 1.0f, dheads + h * hd, d, seq_stride, a.v.data() + h * hd, d, seq_stride, 0.0f,
         dprobs + p_at, T, probs_stride, n);  // dP = dheads V^T
    gemm(true, false, T, hd, T, 1.0f, a.probs.data() + p_at, T, probs_stride, dheads + h * hd, d, seq_stride, 0.0f,
         dv + h * hd, d, seq_stride, n);  // dV = P^T dheads
  }
  causal_softmax_grad<<<blocks_for_rows(n * H * T), threads, 0, stream_>>>(a.probs.data(), dprobs, n * H * T, T);
  for (int h = 0; h < H; ++h) {
    const std::size_t p_at = static_cast<std::size_t>(h) * T * T;
    gemm(false, false, T, hd, T, scale, dprobs + p_at, T, probs_stride, a.k.data() + h * hd, d, seq_stride, 0.0f,
         dq + h * hd, d, seq_stride, n);  // dQ = scale dS K
    gemm(true, false, T, hd, T, scale, dprobs + p_at, T, probs_stride, a.q.data() + h * hd, d, seq_stride, 0.0f,
         dk + h * hd, d, seq_stride, n);  // dK = scale dS^T Q
  }
  const std::size_t pairs = urows * H * (hd / 2);
  rotate<<<blocks_for(pairs), threads, 0, stream_>>>(dq, cos_.data(), sin_.data(), rows, T, H, hd, true);
  rotate<<<blocks_for(pairs), threads, 0, stream_>>>(dk, cos_.data(), sin_.data(), rows, T, H, hd, true);
  linear_weight_grad(dq, a.normed1.data(), t[wq].g, rows, d, d);
  linear_weight_grad(dk, a.normed1.data(), t[wk].g, rows, d, d);
  linear_weight_grad(dv, a.normed1.data(), t[wv].g, rows, d, d);
  linear_input_grad(dq, t[wq].w, dnorm, rows, d, d, false);
  linear_input_grad(dk, t[wk].w, dnorm, rows, d, d, true);
  linear_input_grad(dv, t[wv].w, dnorm, rows, d, d, true);
  rmsnorm_input_grad<<<blocks_for_rows(rows), threads, 0, stream_>>>(a.x_in.data(), t[attention_norm].w,
                                                                     a.rstd1.data(), dnorm, dx_.data(), rows, d);
  norm_weight_grad(a.x_in.data(), a.rstd1.data(), dnorm,
                                                              t[attention_norm].g, rows, d);
}

}  // namespace gpt::gpu
