// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The rank-order arithmetic of the host communicators (threads, mpi): the names of
/// collectives, ops and element types for messages, the accumulator type of reductions,
/// and how `n` elements are cut into `d` chunks and reduced in rank order. mpi.hpp includes
/// this alone for its byte model.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../../concepts.hpp"
#include "../../config.hpp"
#include "../../types/bf16.hpp"
#include "../../types/fp16.hpp"

namespace distopt::detail {

/// What a rank entered; compared across ranks to catch mismatched calls.
enum class collective_kind : unsigned char { all_reduce, all_gather, reduce_scatter, reduce, broadcast, split };

inline const char* collective_name(collective_kind k) noexcept {
  switch (k) {
  case collective_kind::all_reduce: return "all_reduce";
  case collective_kind::all_gather: return "all_gather";
  case collective_kind::reduce_scatter: return "reduce_scatter";
  case collective_kind::reduce: return "reduce";
  case collective_kind::broadcast: return "broadcast";
  case collective_kind::split: return "split";
  }
  return "?";
}

inline const char* reduce_op_name(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum: return "sum";
  case reduce_op::avg: return "avg";
  case reduce_op::max: return "max";
  }
  return "?";
}

template <class T>
constexpr const char* comm_type_name() noexcept {
  if constexpr (std::same_as<T, float>) return "float";
  else if constexpr (std::same_as<T, double>) return "double";
  else if constexpr (std::same_as<T, bf16>) return "bf16";
  else return "fp16";
}

/// The type reductions accumulate in: double for double, float otherwise, so that bf16
/// and fp16 are rounded once, at the end.
template <class T>
using comm_accumulator = std::conditional_t<std::same_as<T, double>, double, float>;

template <class T>
DISTOPT_INLINE comm_accumulator<T> comm_load(T x) noexcept {
  return static_cast<comm_accumulator<T>>(x);
}
template <class T>
DISTOPT_INLINE T comm_store(comm_accumulator<T> a) noexcept {
  return T(a);
}

/// The first element of chunk `r` when `n` elements are cut into `d` chunks whose sizes
/// differ by at most one (the larger ones first).
constexpr std::size_t chunk_begin(std::size_t n, std::size_t d, std::size_t r) noexcept {
  return r * (n / d) + std::min(r, n % d);
}

/// out[i] = ins[0][i] op ins[1][i] op ... op ins[d-1][i] for i in [0, n), in rank order,
/// accumulated in comm_accumulator<T> and rounded once. Blocked so that the inner loops
/// run over contiguous elements (vectorizable) while each element keeps the same order.
/// `out` may alias one of the inputs exactly: each block is read in full before written.
template <class T>
void reduce_rank_order(T* out, const T* const* ins, std::size_t d, std::size_t n, reduce_op op) {
  using acc_t = comm_accumulator<T>;
  constexpr std::size_t block = 512;
  acc_t acc[block];
  for (std::size_t b = 0; b < n; b += block) {
    const std::size_t m = std::min(block, n - b);
    const T* p0 = ins[0] + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = comm_load(p0[i]);
    for (std::size_t q = 1; q < d; ++q) {
      const T* p = ins[q] + b;
      if (op == reduce_op::max) {
        // NaN wins, like torch.max: `v > a` alone would drop a NaN that comes second.
        for (std::size_t i = 0; i < m; ++i) {
          const acc_t v = comm_load(p[i]);
          acc[i] = (v > acc[i] || v != v) ? v : acc[i];
        }
      } else {
        for (std::size_t i = 0; i < m; ++i) acc[i] += comm_load(p[i]);
      }
    }
    if (op == reduce_op::avg) {
      // A division, not a multiplication by 1/d, so avg is exactly sum / size.
      const acc_t dd = static_cast<acc_t>(d);
      for (std::size_t i = 0; i < m; ++i) acc[i] /= dd;
    }
    for (std::size_t i = 0; i < m; ++i) out[b + i] = comm_store<T>(acc[i]);
  }
}

/// std::copy that tolerates an exact self-copy (in-place all_gather), which std::copy forbids.
template <class T>
void copy_elements(T* dst, const T* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(static_cast<void*>(dst), static_cast<const void*>(src), n * sizeof(T));
}

}  // namespace distopt::detail
