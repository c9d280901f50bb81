// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The few BLAS/LAPACK routines GaLore and Muon need (sgesdd_, dgesdd_, cblas_sgemm), declared
/// here rather than taken from <cblas.h>/<lapack.h>, whose spellings differ between vendors,
/// and a thin SVD with torch.linalg.svd(A, full_matrices=False)'s meaning for row-major
/// matrices. Declarations only: a program that uses them links a BLAS and a LAPACK
/// (CMake target distopt::galore).
///
/// Each routine is bound to its C symbol by an asm label under a distopt_ name, so these
/// declarations never clash with a vendor header included in the same translation unit
/// (cblas.h types the enum arguments, lapack.h may add hidden Fortran string lengths).
///
/// Threads: OpenBLAS does not promise the same bits for different thread counts. Its
/// threaded GEMM splits the inner (K) dimension differently from its serial GEMM once K
/// exceeds GEMM_Q (a few hundred), and sgesdd_ runs its large updates through that GEMM;
/// whether a call is threaded at all depends on the problem size, the process-wide
/// OpenBLAS setting and, in OpenMP builds, on whether the caller is inside a parallel
/// region. Every call here therefore runs under `blas_single_thread`, which pins OpenBLAS
/// to one thread for its duration, so results depend only on the inputs and the BLAS build.

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(__GNUC__) && !defined(__clang__)
#error "distopt/detail/lapack.hpp binds BLAS/LAPACK symbols with GCC/Clang asm labels"
#endif

extern "C" {
// Fortran LAPACK, LP64 (32-bit integers), all arguments by address. gfortran appends a
// hidden length for each character argument; passing it (1) is correct for every caller.
void distopt_sgesdd(const char* jobz, const int* m, const int* n, float* a, const int* lda,
                    float* s, float* u, const int* ldu, float* vt, const int* ldvt, float* work,
                    const int* lwork, int* iwork, int* info,
                    std::size_t jobz_len) __asm__("sgesdd_");
void distopt_dgesdd(const char* jobz, const int* m, const int* n, double* a, const int* lda,
                    double* s, double* u, const int* ldu, double* vt, const int* ldvt, double* work,
                    const int* lwork, int* iwork, int* info,
                    std::size_t jobz_len) __asm__("dgesdd_");
// CBLAS; the enums CBLAS_ORDER / CBLAS_TRANSPOSE are passed as int (same ABI).
void distopt_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc) __asm__("cblas_sgemm");
}

namespace distopt::detail {

/// CBLAS constants (cblas.h's CblasRowMajor, CblasNoTrans, CblasTrans).
inline constexpr int cblas_row_major = 101;
inline constexpr int cblas_no_trans = 111;
inline constexpr int cblas_trans = 112;

/// OpenBLAS's thread controls, looked up at run time (null when the process has no
/// OpenBLAS): a weak link-time reference would miss them when the program links the
/// libblas/liblapack wrappers rather than libopenblas itself. The _local form (OpenBLAS
/// >= 0.3.27) affects only the calling thread, and returns the previous value, in OpenMP
/// builds only (openblas_get_parallel() == 2); in pthreads builds it sets the process-wide
/// count like the plain form.
struct openblas_thread_api {
  int (*get)() = nullptr;
  void (*set)(int) = nullptr;
  int (*set_local)(int) = nullptr;
  int (*parallel)() = nullptr;  // 0 sequential, 1 pthreads, 2 OpenMP

  /// Whether this OpenBLAS is an OpenMP build (its thread counts are per thread).
  bool openmp() const { return parallel != nullptr && parallel() == 2; }
  /// Whether set_local affects the calling thread only.
  bool per_thread() const { return set_local != nullptr && openmp(); }

  static const openblas_thread_api& instance() {
    static const openblas_thread_api api = [] {
      openblas_thread_api a;
      a.get = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
      a.set = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
      a.set_local =
          reinterpret_cast<int (*)(int)>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads_local"));
      a.parallel = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
      return a;
    }();
    return api;
  }
};

/// Pins OpenBLAS to one thread while alive (see the file comment for why). With an OpenMP
/// build of OpenBLAS >= 0.3.27 only the calling thread is affected. Otherwise (pthreads
/// builds, and Debian 12's 0.3.21) the setting is process-wide: the guard then serialises distopt's own BLAS calls
/// with a (recursive) mutex and restores the old value on exit; an unrelated BLAS call
/// made by another thread meanwhile also runs on one thread (slower, and its bits may
/// differ from a threaded run). A BLAS that is not OpenBLAS is left alone (reference BLAS
/// is serial; for MKL set MKL_NUM_THREADS=1 or link its sequential library).
class blas_single_thread {
 public:
  blas_single_thread() {
    const auto& api = openblas_thread_api::instance();
    if (api.per_thread()) {
      previous_ = api.set_local(1);
      mode_ = mode::local;
    } else if (api.set != nullptr && api.get != nullptr) {
      lock_ = std::unique_lock<std::recursive_mutex>(global_mutex());
      previous_ = api.get();
      if (previous_ != 1) api.set(1);
      mode_ = mode::global;
    }
  }
  ~blas_single_thread() {
    const auto& api = openblas_thread_api::instance();
    if (mode_ == mode::local)
      api.set_local(previous_);
    else if (mode_ == mode::global && previous_ != 1)
      api.set(previous_);
  }
  blas_single_thread(const blas_single_thread&) = delete;
  blas_single_thread& operator=(const blas_single_thread&) = delete;

 private:
  enum class mode { none, local, global };
  static std::recursive_mutex& global_mutex() {
    static std::recursive_mutex m;
    return m;
  }
  mode mode_ = mode::none;
  int previous_ = 1;
  std::unique_lock<std::recursive_mutex> lock_;
};

/// Checks that a dimension fits LAPACK's 32-bit integers.
inline int lapack_dim(std::int64_t v, const char* routine, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw std::invalid_argument(std::string(routine) + ": " + what + " = " + std::to_string(v) +
                                " does not fit a 32-bit LAPACK integer");
  return static_cast<int>(v);
}

/// C = alpha op(A) op(B) + beta C (C is read only when beta != 0), row-major, through
/// cblas_sgemm on whatever BLAS threads the caller has set (see sgemm_row_major). op(A) is
/// m x k, op(B) is k x n; lda/ldb/ldc are the row strides of A, B and C as stored.
inline void sgemm_as_set(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                         std::int64_t ldc, float alpha = 1.0f, float beta = 0.0f) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  distopt_cblas_sgemm(cblas_row_major, trans_a ? cblas_trans : cblas_no_trans,
                      trans_b ? cblas_trans : cblas_no_trans, lapack_dim(m, "cblas_sgemm", "m"),
                      lapack_dim(n, "cblas_sgemm", "n"), lapack_dim(k, "cblas_sgemm", "k"), alpha, a,
                      lapack_dim(lda, "cblas_sgemm", "lda"), b,
                      lapack_dim(ldb, "cblas_sgemm", "ldb"), beta, c,
                      lapack_dim(ldc, "cblas_sgemm", "ldc"));
}

/// sgemm_as_set on one BLAS thread (blas_single_thread).
inline void sgemm_row_major(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                            const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                            float alpha = 1.0f, float beta = 0.0f) {
  const blas_single_thread one_thread;
  sgemm_as_set(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, n, alpha, beta);
}

/// A worker thread of a parallel region whose caller holds a blas_single_thread, calling
/// sgemm_as_set. With per-thread control (an OpenMP build, >= 0.3.27) it pins this thread
/// to one BLAS thread too, and restores it. In an older OpenMP build the count is the
/// calling thread's OpenMP setting: it sets this thread's to 1 (left so: a worker of
/// distopt's pool runs no other OpenMP code), without the mutex, which the caller holds. In
/// a pthreads build the caller's guard has set the process-wide count: it does nothing.
class blas_worker_thread {
 public:
  blas_worker_thread() {
    const auto& api = openblas_thread_api::instance();
    if (api.per_thread()) previous_ = api.set_local(1), local_ = true;
    else if (api.openmp() && api.set != nullptr) api.set(1);
  }
  ~blas_worker_thread() {
    if (local_) openblas_thread_api::instance().set_local(previous_);
  }
  blas_worker_thread(const blas_worker_thread&) = delete;
  blas_worker_thread& operator=(const blas_worker_thread&) = delete;

 private:
  bool local_ = false;
  int previous_ = 1;
};

/// A thin SVD A = U diag(S) Vh of a row-major m x n matrix, k = min(m, n):
/// U is m x k, S has k values in descending order, Vh is k x n, all row-major.
template <class T>
struct thin_svd {
  std::int64_t m = 0, n = 0, k = 0;
  std::vector<T> u, s, vh;
};

/// The thin SVD of the row-major m x n matrix `a`, with the meaning of
/// torch.linalg.svd(A, full_matrices=False) (LAPACK ?gesdd, divide and conquer, as torch
/// uses on CPU). The matrix is transposed into LAPACK's column-major layout and the SVD of A
/// itself is computed (not that of A^T, which a row-major buffer already is in column-major
/// terms): torch does the same, and the signs of the singular vectors depend on which of
/// the two is factored. Signs are whatever the LAPACK in use returns; they can differ
/// between LAPACK implementations (see tests/unit/galore.cpp).
/// Throws std::domain_error for a non-finite input and std::runtime_error naming the routine
/// and its info code when LAPACK fails.
template <class T>
thin_svd<T> svd_thin(std::span<const T> a, std::int64_t m, std::int64_t n) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  constexpr const char* routine = std::is_same_v<T, float> ? "sgesdd_" : "dgesdd_";
  if (m < 0 || n < 0 || static_cast<std::uint64_t>(a.size()) != static_cast<std::uint64_t>(m * n))
    throw std::invalid_argument(std::string(routine) + ": a " + std::to_string(m) + " x " +
                                std::to_string(n) + " matrix needs " + std::to_string(m * n) +
                                " values, got " + std::to_string(a.size()));
  thin_svd<T> out;
  out.m = m;
  out.n = n;
  out.k = std::min(m, n);
  const std::int64_t k = out.k;
  if (k == 0) return out;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(a[i]))
      throw std::domain_error(std::string(routine) + ": the matrix holds a non-finite value at (" +
                              std::to_string(static_cast<std::int64_t>(i) / n) + ", " +
                              std::to_string(static_cast<std::int64_t>(i) % n) + ")");
  const int im = lapack_dim(m, routine, "m"), in = lapack_dim(n, routine, "n");
  const int ik = static_cast<int>(k);
  lapack_dim(m * n, routine, "m * n");
  std::vector<T> col(static_cast<std::size_t>(m * n));  // A, column-major, lda = m
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) col[j * m + i] = a[i * n + j];
  std::vector<T> ucol(static_cast<std::size_t>(m * k)), vtcol(static_cast<std::size_t>(k * n));
  out.s.resize(static_cast<std::size_t>(k));
  std::vector<int> iwork(static_cast<std::size_t>(8 * k));
  const char jobz = 'S';
  int info = 0;
  const auto call = [&](T* work, int lwork) {
    if constexpr (std::is_same_v<T, float>)
      distopt_sgesdd(&jobz, &im, &in, col.data(), &im, out.s.data(), ucol.data(), &im, vtcol.data(),
                     &ik, work, &lwork, iwork.data(), &info, 1);
    else
      distopt_dgesdd(&jobz, &im, &in, col.data(), &im, out.s.data(), ucol.data(), &im, vtcol.data(),
                     &ik, work, &lwork, iwork.data(), &info, 1);
  };
  const blas_single_thread one_thread;
  T query = 0;
  call(&query, -1);
  if (info != 0)
    throw std::runtime_error(std::string(routine) +
                             " workspace query failed: info = " + std::to_string(info));
  // The size comes back as a floating-point value; round up (float has 24 bits).
  const double want = std::ceil(static_cast<double>(query) * (1.0 + 1e-6)) + 1.0;
  const int lwork = lapack_dim(static_cast<std::int64_t>(want), routine, "lwork");
  std::vector<T> work(static_cast<std::size_t>(lwork));
  call(work.data(), lwork);
  if (info < 0)
    throw std::runtime_error(std::string(routine) + ": info = " + std::to_string(info) +
                             " (argument " + std::to_string(-info) + " had an illegal value)");
  if (info > 0)
    throw std::runtime_error(std::string(routine) + ": info = " + std::to_string(info) +
                             " (the bidiagonal divide and conquer did not converge)");
  out.u.resize(static_cast<std::size_t>(m * k));
  out.vh.resize(static_cast<std::size_t>(k * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < k; ++j) out.u[i * k + j] = ucol[j * m + i];
  for (std::int64_t i = 0; i < k; ++i)
    for (std::int64_t j = 0; j < n; ++j) out.vh[i * n + j] = vtcol[j * k + i];
  return out;
}

/// GaLore's projection factors from a thin SVD: Q = U[:, :r] (m x r) into `q` and P =
/// Vh[:r, :] (r x n) into `p`, row-major; a null pointer skips that factor.
inline void take_factors(const thin_svd<float>& f, std::int64_t r, float* q, float* p) {
  if (q)
    for (std::int64_t i = 0; i < f.m; ++i) std::copy_n(f.u.begin() + i * f.k, r, q + i * r);
  if (p) std::copy_n(f.vh.begin(), r * f.n, p);
}

}  // namespace distopt::detail
