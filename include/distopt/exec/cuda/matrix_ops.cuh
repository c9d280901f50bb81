// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file GaLore's matrix operations on distopt::cuda (detail::matrix_ops<cuda>): the
/// row-major products through cuBLAS's sgemm and the projection factors through cuSOLVER's
/// gesvd, on the executor's stream. Include it before the optimizer type is used, and link
/// distopt::cuda_galore (cuBLAS, cuSOLVER).
///
/// cuBLAS uses its default math (fp32, no TF32 unless NVIDIA_TF32_OVERRIDE says so). Its
/// products and cuSOLVER's SVD sum in their own orders, and the singular vectors' signs are
/// cuSOLVER's: GaLore on cuda is held to the CPU within rounding, not bit for bit (within a
/// projection's refresh window the update does not depend on the signs). Each refresh reads
/// cuSOLVER's status back, a synchronisation every update_proj_gap steps.

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "../../detail/buffer.hpp"
#include "../../detail/matrix_ops.hpp"
#include "executor.cuh"

namespace distopt {

namespace cuda_exec {
inline namespace abi_v0_1 {

inline void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("distopt::cuda: ") + what + " failed: cuBLAS status " +
                             std::to_string(static_cast<int>(s)));
}
inline void check_cusolver(cusolverStatus_t s, const char* what) {
  if (s != CUSOLVER_STATUS_SUCCESS)
    throw std::runtime_error(std::string("distopt::cuda: ") + what + " failed: cuSOLVER status " +
                             std::to_string(static_cast<int>(s)));
}

/// The cuBLAS and cuSOLVER handles of the current device and `stream`: made at first use
/// and kept for the process's life (as side_copies: a handle outliving the driver's
/// teardown is harmless, one destroyed after it is not).
struct math_handles {
  cublasHandle_t blas = nullptr;
  cusolverDnHandle_t solver = nullptr;

  static math_handles& of(cudaStream_t stream) {
    static std::mutex m;
    static std::map<std::pair<int, cudaStream_t>, math_handles*> all;
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    const std::lock_guard<std::mutex> lock(m);
    math_handles*& h = all[{device, stream}];
    if (!h) {
      auto* made = new math_handles();
      check_cublas(cublasCreate(&made->blas), "cublasCreate");
      check_cublas(cublasSetStream(made->blas, stream), "cublasSetStream");
      check_cusolver(cusolverDnCreate(&made->solver), "cusolverDnCreate");
      check_cusolver(cusolverDnSetStream(made->solver, stream), "cusolverDnSetStream");
      h = made;
    }
    return *h;
  }
};

inline int blas_dim(std::int64_t v, const char* what) {
  return detail::lapack_dim(v, "distopt::cuda matrix_ops", what);
}

}  // namespace abi_v0_1
}  // namespace cuda_exec

template <>
struct detail::matrix_ops<cuda> {
  /// Row-major c = op(a) op(b) (detail::matrix_ops): as column-major, c^T = op(b)^T op(a)^T,
  /// and a row-major buffer read column-major is its transpose, so cuBLAS gets b then a
  /// with the same transposition flags.
  static void gemm(cuda& e, bool trans_a, bool trans_b, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c) {
    if (rows == 0 || cols == 0) return;
    const cuda_exec::device_guard on(e.device());
    auto& h = cuda_exec::math_handles::of(e.stream());
    const float one = 1.0f, zero = 0.0f;
    using cuda_exec::blas_dim;
    cuda_exec::check_cublas(
        cublasSgemm(h.blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                    blas_dim(cols, "cols"), blas_dim(rows, "rows"), blas_dim(inner, "inner"), &one, b,
                    blas_dim(ldb, "ldb"), a, blas_dim(lda, "lda"), &zero, c, blas_dim(cols, "ldc")),
        "cublasSgemm");
  }

  /// The thin SVD of the row-major m x n `g` and its first r factors (detail::matrix_ops).
  /// cuSOLVER's gesvd takes column-major matrices of at least as many rows as columns:
  ///   n >= m: g read column-major is A = G^T (n x m); A = U_A S V_A^T gives G = V_A S U_A^T,
  ///     so Q[i][j] = V_A^T[j][i] (the first r of each column of V_A^T) and P = U_A's
  ///     first r columns, which read row-major are P's rows;
  ///   m > n: G transposed into column-major first; Q = U[:, :r] and P = V^T[:r, :], each
  ///     transposed back to row-major.
  /// Throws std::runtime_error with cuSOLVER's info code when it fails.
  static void svd_factors(cuda& e, const float* g, std::int64_t m, std::int64_t n, std::int64_t r, float* q,
                          float* p) {
    const cuda_exec::device_guard on(e.device());
    auto& h = cuda_exec::math_handles::of(e.stream());
    using cuda_exec::blas_dim;
    const bool wide = n >= m;
    const std::int64_t rows = wide ? n : m, k = wide ? m : n;  // column-major rows x k
    const int irows = blas_dim(rows, "rows"), ik = blas_dim(k, "k"), ir = blas_dim(r, "r");
    int lwork = 0;
    cuda_exec::check_cusolver(cusolverDnSgesvd_bufferSize(h.solver, irows, ik, &lwork), "cusolverDnSgesvd_bufferSize");
    const std::size_t a_at = 0, s_at = a_at + rows * k, u_at = s_at + k, vt_at = u_at + rows * k,
                      work_at = vt_at + k * k, rwork_at = work_at + static_cast<std::size_t>(lwork),
                      total = rwork_at + k;
    buffer<float, cuda> scratch(e, total);
    buffer<int, cuda> info(e, 1);
    float* a = scratch.data() + a_at;
    float* u = scratch.data() + u_at;
    float* vt = scratch.data() + vt_at;
    const float one = 1.0f, zero = 0.0f;
    if (wide)  // gesvd overwrites its input: a copy
      cuda_exec::check(cudaMemcpyAsync(a, g, sizeof(float) * rows * k, cudaMemcpyDeviceToDevice, e.stream()),
                       "cudaMemcpyAsync (SVD input)");
    else  // column-major G = (G^T)^T
      cuda_exec::check_cublas(cublasSgeam(h.blas, CUBLAS_OP_T, CUBLAS_OP_N, irows, ik, &one, g, ik, &zero, a, irows, a,
                                          irows),
                              "cublasSgeam (SVD input)");
    // The factors wanted: Q comes from V_A^T (wide) or U, P from U_A (wide) or V^T.
    const bool want_u = wide ? p != nullptr : q != nullptr, want_vt = wide ? q != nullptr : p != nullptr;
    const signed char job_u = want_u ? 'S' : 'N', job_vt = want_vt ? 'S' : 'N';
    cuda_exec::check_cusolver(cusolverDnSgesvd(h.solver, job_u, job_vt, irows, ik, a, irows, scratch.data() + s_at, u,
                                               irows, vt, ik, scratch.data() + work_at, lwork,
                                               scratch.data() + rwork_at, info.data()),
                              "cusolverDnSgesvd");
    if (wide) {
      if (q)  // Q (m x r) row i: V_A^T's column i, first r values (V_A^T is m x m, column-major)
        cuda_exec::check(cudaMemcpy2DAsync(q, sizeof(float) * r, vt, sizeof(float) * k, sizeof(float) * r, k,
                                           cudaMemcpyDeviceToDevice, e.stream()),
                         "cudaMemcpy2DAsync (SVD factor)");
      if (p)  // P (r x n): U_A's first r columns (n values each), row after row
        cuda_exec::check(cudaMemcpyAsync(p, u, sizeof(float) * r * rows, cudaMemcpyDeviceToDevice, e.stream()),
                         "cudaMemcpyAsync (SVD factor)");
    } else {
      if (q)  // row-major Q (m x r) is column-major Q^T (r x m) = U[:, :r]^T, U m x k column-major
        cuda_exec::check_cublas(cublasSgeam(h.blas, CUBLAS_OP_T, CUBLAS_OP_N, ir, irows, &one, u, irows, &zero, q, ir,
                                            q, ir),
                                "cublasSgeam (SVD factor)");
      if (p)  // row-major P (r x n) is column-major P^T (n x r) = (V^T[:r, :])^T, V^T k x k column-major
        cuda_exec::check_cublas(cublasSgeam(h.blas, CUBLAS_OP_T, CUBLAS_OP_N, ik, ir, &one, vt, ik, &zero, p, ik, p, ik),
                                "cublasSgeam (SVD factor)");
    }
    int status = 0;
    detail::copy_bytes(e, &status, info.data(), sizeof status);
    if (status != 0)
      throw std::runtime_error("distopt::cuda: cusolverDnSgesvd of a " + std::to_string(m) + " x " + std::to_string(n) +
                               " matrix: info = " + std::to_string(status) +
                               (status > 0 ? " (the bidiagonal QR did not converge)" : " (an illegal argument)"));
  }
};

}  // namespace distopt
