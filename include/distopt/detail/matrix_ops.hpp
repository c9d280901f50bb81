// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The dense matrix operations GaLore's engine runs on an executor's memory: a
/// row-major float product and the projection factors of a thin SVD. `matrix_ops<E>` is
/// what an executor provides:
///   - host memory (cpu, kokkos): BLAS and LAPACK on one BLAS thread (detail/lapack.hpp);
///   - device memory the host may open (emulated_device): the same calls, inside an
///     access scope, so its results are the host's bit for bit;
///   - distopt::cuda: cuBLAS and cuSOLVER (exec/cuda/matrix_ops.cuh specialises it).
/// Any other executor of device code only is refused at compile time, naming the header.

#include <cstdint>
#include <span>
#include <type_traits>

#include "../concepts.hpp"
#include "lapack.hpp"

namespace distopt::detail {

/// Whether executor E's memory is the host's, or can be opened to the host (open_memory).
template <class E>
inline constexpr bool host_reachable = host_memory<E> || (runs_host_functions<E> && requires(E& e) { e.open_memory(); });

template <class E>
struct matrix_ops {
  static_assert(host_reachable<E>,
                "distopt: GaLore's matrix products and SVD on this executor of device code only need its "
                "matrix operations: for distopt::cuda include <distopt/exec/cuda/matrix_ops.cuh> and link "
                "distopt::cuda_galore (cuBLAS, cuSOLVER)");

  /// Row-major c = op(a) op(b): op(a) is rows x inner, op(b) inner x cols, c's rows `cols`
  /// apart; lda and ldb are the row strides of a and b as stored (sgemm_row_major).
  static void gemm(E& e, bool trans_a, bool trans_b, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c) {
    [[maybe_unused]] const auto open = opened(e);
    sgemm_row_major(trans_a, trans_b, rows, cols, inner, a, lda, b, ldb, c);
  }

  /// The thin SVD G = U S Vh of the row-major m x n matrix `g` (torch.linalg.svd's meaning)
  /// and its first `r` factors: Q = U[:, :r] (m x r) into `q`, P = Vh[:r, :] (r x n) into
  /// `p`, row-major; a null pointer skips that factor.
  static void svd_factors(E& e, const float* g, std::int64_t m, std::int64_t n, std::int64_t r, float* q,
                          float* p) {
    [[maybe_unused]] const auto open = opened(e);
    take_factors(svd_thin<float>(std::span<const float>(g, static_cast<std::size_t>(m * n)), m, n), r, q, p);
  }

 private:
  static auto opened(E& e) {
    if constexpr (host_memory<E>) return 0;
    else return e.open_memory();
  }
};

}  // namespace distopt::detail
