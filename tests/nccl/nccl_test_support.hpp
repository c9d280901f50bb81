// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// What the NCCL tests share: CUDA and NCCL error checks, names, inputs and a device buffer.
#pragma once

#include <distopt/comm/nccl.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/fp16.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace nccl_test {

using distopt::bf16;
using distopt::fp16;
using distopt::reduce_op;

inline void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

inline void nccl_call(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + " failed: " + ncclGetErrorString(r));
}

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else return "fp16";
}

inline std::string op_name(reduce_op op) {
  return op == reduce_op::sum ? "sum" : op == reduce_op::avg ? "avg" : "max";
}

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Values of mixed sign and magnitude (2^-6 .. 2^2), distinct from the 0xff fill.
template <class T>
std::vector<T> make_input(std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = splitmix(seed * 1000003u + i);
    const double mant = static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
    const double x = std::ldexp(mant, static_cast<int>(h % 9) - 6);
    if constexpr (std::is_same_v<T, double>) v[i] = x;
    else v[i] = T(static_cast<float>(x));
  }
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// Where `got` differs from `want` in bits: " (K of N differ, the first at I: got X, want
/// Y)", or "" when they are the same.
template <class T>
std::string difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return " (" + std::to_string(got.size()) + " elements, want " + std::to_string(want.size()) + ")";
  std::size_t count = 0, first = 0;
  for (std::size_t i = got.size(); i-- > 0;)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ++count;
      first = i;
    }
  if (count == 0) return "";
  const auto value = [](const T& x) {
    if constexpr (std::is_floating_point_v<T>) return std::to_string(static_cast<double>(x));
    else return std::to_string(static_cast<double>(distopt::to_float(x)));
  };
  return " (" + std::to_string(count) + " of " + std::to_string(got.size()) + " differ, the first at " +
         std::to_string(first) + ": got " + value(got[first]) + ", want " + value(want[first]) + ")";
}

/// n elements of T in device memory.
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : n_(n) {
    if (n_ != 0) cuda(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "cudaMalloc");
  }
  ~device_buffer() {
    if (p_ != nullptr) static_cast<void>(cudaFree(p_));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  std::span<T> span() { return {p_, n_}; }
  std::span<const T> cspan() const { return {p_, n_}; }

  /// Copies `v` in and waits for the copy (a pageable upload may return before it lands,
  /// and the communicator's non-blocking stream would not wait for it).
  void upload(const std::vector<T>& v) {
    if (n_ != 0) cuda(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
    cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  /// Fills every byte with 0xff (a NaN in every element type), so a copy that did not happen shows.
  void poison() {
    if (n_ != 0) cuda(cudaMemset(p_, 0xff, n_ * sizeof(T)), "cudaMemset");
    cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    if (n_ != 0) cuda(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

}  // namespace nccl_test
