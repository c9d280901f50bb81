// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// What the examples' --backend cuda parts share (distopt-fashion-mnist, distopt-gpt): error
// checks, device arrays, a GPU timer around the optimizer's step, and a sum in a fixed order.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace examples::cuda {

/// Throws std::runtime_error naming `what` unless `e` is cudaSuccess.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
inline void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(int(e)));
}

/// `n` elements of device memory, freed when it goes.
template <class T>
class device_array {
 public:
  device_array() = default;
  explicit device_array(std::size_t n) : n_(n) {
    if (n) check(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)),
                 ("cudaMalloc of " + std::to_string(n * sizeof(T)) + " bytes").c_str());
  }
  device_array(device_array&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  device_array& operator=(device_array&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~device_array() {
    if (p_) cudaFree(p_);
  }
  T* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  /// Copies `v` in (`v` has at most size() elements) and waits for the device: a cudaMemcpy
  /// from pageable memory may return before its copy lands, and kernels on a non-blocking
  /// stream are not ordered after it.
  void upload(const std::vector<T>& v) {
    if (v.size() > n_) throw std::invalid_argument("device_array::upload: more values than room");
    check(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (to the device)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (after an upload)");
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A CUDA event pair around each optimizer step, so that the optimizer's share is GPU time
/// (the host only enqueues the step).
class step_timer {
 public:
  step_timer() {
    check(cudaEventCreate(&begin_), "cudaEventCreate");
    check(cudaEventCreate(&end_), "cudaEventCreate");
  }
  ~step_timer() {
    cudaEventDestroy(begin_);
    cudaEventDestroy(end_);
  }
  step_timer(const step_timer&) = delete;
  step_timer& operator=(const step_timer&) = delete;
  void begin(cudaStream_t s) {
    collect();
    check(cudaEventRecord(begin_, s), "cudaEventRecord");
  }
  void end(cudaStream_t s) {
    check(cudaEventRecord(end_, s), "cudaEventRecord");
    open_ = true;
  }
  /// Seconds of the steps timed so far (waits for the last).
  double seconds() {
    collect();
    return seconds_;
  }

 private:
  void collect() {
    if (!open_) return;
    float ms = 0.0f;
    check(cudaEventSynchronize(end_), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&ms, begin_, end_), "cudaEventElapsedTime");
    seconds_ += static_cast<double>(ms) * 1e-3;
    open_ = false;
  }
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
  bool open_ = false;
  double seconds_ = 0.0;
};

/// Throws std::runtime_error unless this process sees a CUDA device (with the driver's reason).
inline void require_device() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0)
    throw std::runtime_error(std::string("--backend cuda: no CUDA device is visible to this process") +
                             (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : std::string()));
}

/// A non-blocking stream, destroyed with this (after whatever frees on it: declare it first).
class owned_stream {
 public:
  owned_stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~owned_stream() { cudaStreamDestroy(s_); }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// The sum of n doubles in a fixed order, into *out: launch with one block of Threads
/// threads (a power of two); each sums a stride, then a tree.
template <int Threads>
__global__ void sum_in_order(const double* v, int n, double* out) {
  __shared__ double part[Threads];
  double s = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += Threads) s += v[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = Threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = part[0];
}

}  // namespace examples::cuda
