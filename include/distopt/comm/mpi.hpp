// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file `mpi`: a communicator over an MPI communicator, blocking and asynchronous, for
/// ranks that are processes (tested with Open MPI); `mpi_session` initialises MPI. Link
/// `distopt::mpi` (CMake option DISTOPT_ENABLE_MPI=ON).
///
/// It follows `threads` (threads.hpp): the same element types, ops, size rules, aliasing
/// rules, error messages and byte model. Where it differs, because MPI decides how a
/// collective runs:
///  - Order of reductions. float and double sums use MPI_SUM in T, in whatever order the
///    algorithm Open MPI picks (by process count and message size) adds them: not rank
///    order, so a float sum can differ from `threads` in the last bits. It is the same on
///    every rank (each algorithm reduces an element once and copies it, or adds the same
///    pairs commutatively; the tests check it, the MPI standard only recommends it) and
///    the same from run to run for the same process count, sizes and MPI settings. The
///    i-forms may run another algorithm: all_reduce and iall_reduce of the same floats
///    can differ in the last bits (seen with 3 processes), so do not mix them on data
///    that must stay identical across steps.
///  - bf16 and fp16 sums are widened to float in a temporary buffer, summed in float and
///    rounded once, as in `threads`. A user-defined op on the 2-byte type would round
///    after every pairwise combine (d-1 roundings, in tree order); the price is that the
///    sum travels as float, twice the bytes of the model, and needs 4 N bytes of memory.
///  - max is a user-defined op for all four types, because MPI_MAX's comparison keeps or
///    drops a NaN depending on the order of its operands; NaN wins, as in `threads`.
///    bf16 and fp16 travel as two bytes (MPI_Type_contiguous(2, MPI_BYTE)).
///  - Checks are local. Each rank checks its own sizes, root and color and throws
///    std::invalid_argument before it communicates, so calls that are wrong on every
///    rank throw on every rank; calls that disagree between ranks (sizes, op, root, or
///    different collectives) are not detected as `threads` does: MPI may report an error
///    (MPI_ERR_TRUNCATE) on some ranks, or hang.
///  - Failures. MPI errors come back (MPI_ERRORS_RETURN is set on the communicator) and
///    are thrown as std::runtime_error naming the call, the rank and MPI's message. They
///    are not propagated to the other ranks, which wait in their next collective: end
///    the job with MPI_Abort, or let the exception leave main (std::terminate; mpirun
///    then aborts the others). Returning from main through ~mpi_session instead runs
///    MPI_Finalize, which may wait for the stuck ranks forever.
///  - Counts are int in MPI 3.1: every buffer a call takes (the full one for all_gather
///    and reduce_scatter) is limited to INT_MAX elements (std::invalid_argument).

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "../types/fp16.hpp"
#include "../types/rounding.hpp"
#include "request.hpp"
#include "detail/rank_order.hpp"  // the accumulator and chunk_begin that the byte model shares

namespace distopt {

namespace detail {

/// bf16 and fp16: the element types MPI has no datatype or arithmetic for.
template <class T>
inline constexpr bool mpi_half_type = std::same_as<T, bf16> || std::same_as<T, fp16>;

/// MPI's text for `code`, or the number when MPI has none.
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS || len <= 0)
    return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws "distopt::mpi::<what>: MPI error on rank <rank>: <MPI's message>" unless
/// `code` is MPI_SUCCESS.
inline void mpi_check(int code, const char* what, int rank) {
  if (code == MPI_SUCCESS) return;
  throw std::runtime_error(std::string("distopt::mpi::") + what + ": MPI error on rank " + std::to_string(rank) +
                           ": " + mpi_error_text(code));
}

/// This process's rank in MPI_COMM_WORLD, or -1: for errors before a rank is known.
inline int mpi_world_rank() noexcept {
  int r = -1;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &r) != MPI_SUCCESS) r = -1;
  return r;
}

/// The MPI datatype of T. bf16 and fp16 get a committed two-byte type each, made on
/// first use (so after MPI_Init) and left for MPI_Finalize to free.
template <class T>
MPI_Datatype mpi_datatype(const char* what, int rank) {
  if constexpr (std::same_as<T, float>) {
    return MPI_FLOAT;
  } else if constexpr (std::same_as<T, double>) {
    return MPI_DOUBLE;
  } else {
    static const MPI_Datatype type = [&] {
      MPI_Datatype t = MPI_DATATYPE_NULL;
      mpi_check(MPI_Type_contiguous(2, MPI_BYTE, &t), what, rank);
      mpi_check(MPI_Type_commit(&t), what, rank);
      return t;
    }();
    return type;
  }
}

/// inout[i] = max(in[i], inout[i]) where a NaN wins, compared in comm_accumulator<T> and
/// stored as `threads` stores it (a bf16/fp16 NaN is quietened, other values kept).
template <class T>
void mpi_max_function(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const comm_accumulator<T> v = comm_load(a[i]), acc = comm_load(b[i]);
    b[i] = comm_store<T>((v > acc || v != v) ? v : acc);
  }
}

/// The NaN-propagating max of T as a commutative MPI op, made on first use.
template <class T>
MPI_Op mpi_max_op(const char* what, int rank) {
  static const MPI_Op op = [&] {
    MPI_Op o = MPI_OP_NULL;
    mpi_check(MPI_Op_create(&mpi_max_function<T>, /*commute=*/1, &o), what, rank);
    return o;
  }();
  return op;
}

/// A collective started with MPI and what remains when it completes: divide an average,
/// round a float sum back to bf16/fp16, or copy a staged result into place. It owns the
/// temporary buffers, so they live until the request does.
template <class T>
class mpi_pending final : public request_state {
 public:
  mpi_pending(const char* what, int rank) noexcept : what_(what), rank_(rank) {}
  // MPI holds &request and pointers into the buffers while the collective runs.
  mpi_pending(const mpi_pending&) = delete;
  mpi_pending& operator=(const mpi_pending&) = delete;

  MPI_Request request = MPI_REQUEST_NULL;
  T* out = nullptr;    // where the result ends up
  std::size_t n = 0;   // its elements
  int divisor = 0;     // avg: size(), applied after the sum; 0 for sum and max

  /// A float copy of `src` for MPI to sum in (the result lands in its first n elements).
  float* widen(const T* src, std::size_t count) {
    wide_ = std::make_unique_for_overwrite<float[]>(count);
    for (std::size_t i = 0; i < count; ++i) wide_[i] = to_float(src[i]);
    return wide_.get();
  }
  /// A buffer of `count` elements for a result that must not land in place at once.
  T* stage(std::size_t count) {
    staged_ = std::make_unique_for_overwrite<T[]>(count);
    return staged_.get();
  }

  void wait() override {
    if (done_) return;
    mpi_check(MPI_Wait(&request, MPI_STATUS_IGNORE), what_, rank_);
    finish();
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    mpi_check(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), what_, rank_);
    if (flag) finish();
    return flag != 0;
  }

  /// Runs once, after MPI has completed the collective.
  void finish() {
    done_ = true;
    if constexpr (mpi_half_type<T>) {
      if (wide_) {
        // Divided in float, rounded once: exactly `threads`' comm_store(acc / d).
        const float dd = static_cast<float>(divisor);
        for (std::size_t i = 0; i < n; ++i) out[i] = from_float<T>(divisor ? wide_[i] / dd : wide_[i]);
        return;
      }
    }
    if (staged_) std::copy(staged_.get(), staged_.get() + n, out);
    if constexpr (!mpi_half_type<T>) {
      // A division, not a multiplication by 1/d, so avg is exactly sum / size.
      if (divisor)
        for (std::size_t i = 0; i < n; ++i) out[i] /= static_cast<T>(divisor);
    }
  }

 private:
  const char* what_;
  int rank_;
  bool done_ = false;
  std::unique_ptr<float[]> wide_;
  std::unique_ptr<T[]> staged_;
};

}  // namespace detail

/// Initialises MPI for the lifetime of the object and finalises it after, unless MPI was
/// already initialised (then it only checks the thread level and leaves MPI alone).
/// Construct one at the top of main, before any `mpi`; not copyable or movable.
///
/// The default thread level is MPI_THREAD_FUNNELED: distopt calls MPI only from the
/// thread that calls the communicator, never from executor workers, so the main thread
/// may drive training while worker threads compute. Ask for MPI_THREAD_SERIALIZED when
/// another thread calls the communicator, MPI_THREAD_MULTIPLE when several do.
class mpi_session {
 public:
  /// MPI_Init_thread without command-line arguments.
  explicit mpi_session(int required = MPI_THREAD_FUNNELED) : mpi_session(nullptr, nullptr, required) {}
  /// MPI_Init_thread(&argc, &argv, required): MPI may remove its own arguments.
  mpi_session(int& argc, char**& argv, int required = MPI_THREAD_FUNNELED) : mpi_session(&argc, &argv, required) {}
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  /// MPI_Finalize, when this session initialised MPI and nobody has finalised it since.
  ~mpi_session() {
    int finalized = 1;
    if (owner_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Finalize();
  }

  /// The thread level MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  int thread_level() const noexcept { return provided_; }
  /// True when this session initialised MPI (and so finalises it).
  bool owns_mpi() const noexcept { return owner_; }

 private:
  mpi_session(int* argc, char*** argv, int required) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) throw std::logic_error("distopt::mpi_session: MPI has been finalised and cannot start again");
    if (initialized) {
      if (const int code = MPI_Query_thread(&provided_); code != MPI_SUCCESS)
        throw std::runtime_error("distopt::mpi_session: MPI_Query_thread failed: " + detail::mpi_error_text(code));
    } else {
      const int code = MPI_Init_thread(argc, argv, required, &provided_);
      if (code != MPI_SUCCESS)
        throw std::runtime_error("distopt::mpi_session: MPI_Init_thread failed: " + detail::mpi_error_text(code));
      owner_ = true;
    }
    if (provided_ < required) {
      if (owner_) MPI_Finalize();
      throw std::runtime_error("distopt::mpi_session: MPI provides thread level " + std::to_string(provided_) +
                               ", below the required " + std::to_string(required));
    }
  }

  int provided_ = MPI_THREAD_SINGLE;
  bool owner_ = false;
};

/// One rank's handle on an MPI communicator. Models `distopt::communicator` and
/// `distopt::async_communicator`. `mpi(MPI_COMM_WORLD)` wraps an existing communicator
/// without owning it; `split` returns handles that own (and free) theirs. Move-only.
/// The constructor sets MPI_ERRORS_RETURN on the communicator, also on one it wraps:
/// distopt turns error codes into exceptions, and the handler belongs to the communicator.
///
/// Collectives follow `threads` (every rank calls the same one with the same sizes, op
/// and root; `avg` is the sum divided by size(); `max` propagates NaN); the file comment
/// says where MPI differs. The i-forms start the collective and return a `comm_request`;
/// the buffers must stay alive and untouched until it is waited for, and several may be
/// in flight if every rank starts them in the same order (any wait order is fine).
///
/// Byte model of `bytes_sent()`: the one threads.hpp documents (a bandwidth-optimal
/// ring's traffic, not what MPI's chosen algorithm sends, so that communicators compare).
/// d = size(), r = rank(), N = elements of the full buffer, s = sizeof(T),
/// c_r = chunk_begin(N, d, r + 1) - chunk_begin(N, d, r):
///   all_reduce      (N + (d-2) * c_r) * s if d > 1, else 0
///   reduce_scatter  (d-1) * out.size() * s
///   all_gather      (d-1) * in.size() * s
///   reduce          N * s on every rank but the root, 0 on the root
///   broadcast       N * s on the root if d > 1, else 0
///   split           0
/// An i-form counts when it starts.
class mpi {
 public:
  using communicator_concept = communicator_tag;

  /// Wraps `comm` (not owned: the caller frees it, after this handle is gone). MPI must
  /// be initialised (see mpi_session).
  explicit mpi(MPI_Comm comm) : mpi(comm, false) {}
  mpi(mpi&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), owned_(std::exchange(o.owned_, false)), rank_(o.rank_),
        size_(o.size_), bytes_sent_(o.bytes_sent_) {}
  mpi& operator=(mpi&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      owned_ = std::exchange(o.owned_, false);
      rank_ = o.rank_;
      size_ = o.size_;
      bytes_sent_ = o.bytes_sent_;
    }
    return *this;
  }
  // Two handles freeing one communicator would free it twice.
  mpi(const mpi&) = delete;
  mpi& operator=(const mpi&) = delete;
  /// Frees an owned communicator (MPI_Comm_free; skipped once MPI is finalised).
  ~mpi() { release(); }

  /// This rank's index in the communicator, 0 <= rank() < size().
  int rank() const noexcept { return rank_; }
  /// The number of ranks in the communicator.
  int size() const noexcept { return size_; }
  /// Bytes this rank has sent since the handle was made, by the model in the class docs.
  std::size_t bytes_sent() const noexcept { return bytes_sent_; }
  /// The MPI communicator, for calls distopt does not wrap; MPI_COMM_NULL after a move.
  MPI_Comm native() const noexcept { return comm_; }

  /// Reduces `data` over the ranks in place: every rank ends with the same result.
  template <comm_element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    start_all_reduce(data, op, "all_reduce", false);
  }
  /// Concatenates every rank's `in` into `out` in rank order; out.size() == size() * in.size().
  /// `in` may be this rank's own slice of `out` (then MPI_IN_PLACE); otherwise they must
  /// not overlap (std::invalid_argument).
  template <comm_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    start_all_gather(in, out, "all_gather", false);
  }
  /// Reduces `in` over the ranks and leaves slice rank() of the result in `out`;
  /// in.size() == size() * out.size(). `out` may be this rank's own slice of `in`;
  /// otherwise they must not overlap (std::invalid_argument). The rest of `in` is not written.
  template <comm_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    start_reduce_scatter(in, out, op, "reduce_scatter", false);
  }
  /// Reduces `in` over the ranks into `out` on rank `root` (in.size() elements there; the
  /// others' `out` is not touched and may be empty). The root's `out` may be its `in`
  /// (then MPI_IN_PLACE); otherwise they must not overlap (std::invalid_argument).
  template <comm_element T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    start_reduce(in, out, op, root, "reduce", false);
  }
  /// Copies `root`'s `data` into every rank's `data`.
  template <comm_element T>
  void broadcast(std::span<T> data, int root) {
    start_broadcast(data, root, "broadcast", false);
  }

  /// all_reduce, started: `data` holds the result once the request is waited for.
  template <comm_element T>
  comm_request iall_reduce(std::span<T> data, reduce_op op) {
    return start_all_reduce(data, op, "iall_reduce", true);
  }
  /// all_gather, started (MPI_Iallgather).
  template <comm_element T>
  comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    return start_all_gather(in, out, "iall_gather", true);
  }
  /// reduce_scatter, started (MPI_Ireduce_scatter_block).
  template <comm_element T>
  comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    return start_reduce_scatter(in, out, op, "ireduce_scatter", true);
  }
  /// reduce, started (MPI_Ireduce).
  template <comm_element T>
  comm_request ireduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    return start_reduce(in, out, op, root, "ireduce", true);
  }
  /// broadcast, started (MPI_Ibcast).
  template <comm_element T>
  comm_request ibroadcast(std::span<T> data, int root) {
    return start_broadcast(data, root, "ibroadcast", true);
  }

  /// Splits the communicator (collectively, MPI_Comm_split): ranks that pass the same
  /// `color` (>= 0) form a new one, ordered by `key`, then by rank here; the handle owns
  /// it. For a DP x TP grid, rank r = dp * tp_size + tp: split(dp, tp) gives the TP
  /// group, split(tp, dp) the DP group.
  mpi split(int color, int key) {
    if (color < 0)
      throw std::invalid_argument("distopt::mpi::split: color must be >= 0, got " + std::to_string(color) +
                                  " on rank " + std::to_string(rank_));
    MPI_Comm sub = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_split(comm_, color, key, &sub), "split", rank_);
    return mpi(sub, true);
  }

 private:
  mpi(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw std::logic_error("distopt::mpi: MPI is not initialised (construct a distopt::mpi_session first)");
    if (comm == MPI_COMM_NULL) throw std::invalid_argument("distopt::mpi: MPI_COMM_NULL is not a communicator");
    int code = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (code == MPI_SUCCESS) code = MPI_Comm_rank(comm, &rank_);
    if (code == MPI_SUCCESS) code = MPI_Comm_size(comm, &size_);
    if (code != MPI_SUCCESS) {
      release();
      detail::mpi_check(code, "mpi", detail::mpi_world_rank());
    }
  }

  void release() noexcept {
    int finalized = 1;
    if (owned_ && comm_ != MPI_COMM_NULL && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized)
      MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
    owned_ = false;
  }

  static std::string prefix(const char* what) { return std::string("distopt::mpi::") + what + ": "; }

  /// `n` as an MPI count, or std::invalid_argument naming `buffer`.
  static int checked_count(const char* what, const char* buffer, std::size_t n) {
    if (n > static_cast<std::size_t>(INT_MAX))
      throw std::invalid_argument(prefix(what) + buffer + " has " + std::to_string(n) +
                                  " elements; MPI counts are int, so at most " + std::to_string(INT_MAX));
    return static_cast<int>(n);
  }

  /// True when the two element ranges share a byte.
  template <class T>
  static bool overlap(const T* a, std::size_t na, const T* b, std::size_t nb) noexcept {
    const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
    return na != 0 && nb != 0 && pa < pb + nb * sizeof(T) && pb < pa + na * sizeof(T);
  }

  /// Starts `p`'s collective with `call(&request)` (an i-form) or runs it with
  /// `call(nullptr)` (blocking) and finishes it; counts `bytes` once MPI has accepted it.
  template <class T, class Call>
  comm_request launch(std::unique_ptr<detail::mpi_pending<T>> p, const char* what, bool async, std::size_t bytes,
                      Call call) {
    detail::mpi_check(call(async ? &p->request : nullptr), what, rank_);
    bytes_sent_ += bytes;
    if (async) return comm_request(std::move(p));
    p->finish();
    return {};
  }

  template <comm_element T>
  comm_request start_all_reduce(std::span<T> data, reduce_op op, const char* what, bool async) {
    const std::size_t n = data.size(), d = static_cast<std::size_t>(size_), r = static_cast<std::size_t>(rank_);
    const int count = checked_count(what, "data", n);
    auto p = std::make_unique<detail::mpi_pending<T>>(what, rank_);
    p->out = data.data();
    p->n = n;
    p->divisor = op == reduce_op::avg ? size_ : 0;
    void* buf = data.data();
    MPI_Datatype type = detail::mpi_datatype<T>(what, rank_);
    MPI_Op mop = MPI_SUM;
    if (op == reduce_op::max) {
      mop = detail::mpi_max_op<T>(what, rank_);
    } else if constexpr (detail::mpi_half_type<T>) {
      buf = p->widen(data.data(), n);
      type = MPI_FLOAT;
    }
    const std::size_t bytes =
        d > 1 ? (n + (d - 2) * (detail::chunk_begin(n, d, r + 1) - detail::chunk_begin(n, d, r))) * sizeof(T) : 0;
    return launch(std::move(p), what, async, bytes, [&](MPI_Request* req) {
      return req ? MPI_Iallreduce(MPI_IN_PLACE, buf, count, type, mop, comm_, req)
                 : MPI_Allreduce(MPI_IN_PLACE, buf, count, type, mop, comm_);
    });
  }

  template <comm_element T>
  comm_request start_all_gather(std::span<const T> in, std::span<T> out, const char* what, bool async) {
    const std::size_t d = static_cast<std::size_t>(size_), m = in.size();
    if (out.size() != d * m)
      throw std::invalid_argument(prefix(what) + "out has " + std::to_string(out.size()) +
                                  " elements but size() * in = " + std::to_string(d) + " * " + std::to_string(m) +
                                  " = " + std::to_string(d * m));
    checked_count(what, "out", out.size());
    const int count = static_cast<int>(m);
    const bool in_place = m == 0 || in.data() == out.data() + static_cast<std::size_t>(rank_) * m;
    if (!in_place && overlap(in.data(), m, out.data(), out.size()))
      throw std::invalid_argument(prefix(what) + "in overlaps out but is not this rank's slice of it");
    auto p = std::make_unique<detail::mpi_pending<T>>(what, rank_);
    const void* send = in_place ? MPI_IN_PLACE : in.data();
    void* recv = out.data();
    const MPI_Datatype type = detail::mpi_datatype<T>(what, rank_);
    return launch(std::move(p), what, async, (d - 1) * m * sizeof(T), [&](MPI_Request* req) {
      return req ? MPI_Iallgather(send, count, type, recv, count, type, comm_, req)
                 : MPI_Allgather(send, count, type, recv, count, type, comm_);
    });
  }

  template <comm_element T>
  comm_request start_reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op, const char* what,
                                    bool async) {
    const std::size_t d = static_cast<std::size_t>(size_), m = out.size();
    if (in.size() != d * m)
      throw std::invalid_argument(prefix(what) + "in has " + std::to_string(in.size()) +
                                  " elements but size() * out = " + std::to_string(d) + " * " + std::to_string(m) +
                                  " = " + std::to_string(d * m));
    checked_count(what, "in", in.size());
    const int count = static_cast<int>(m);
    const bool aliased = m != 0 && out.data() == in.data() + static_cast<std::size_t>(rank_) * m;
    if (!aliased && overlap(in.data(), in.size(), out.data(), m))
      throw std::invalid_argument(prefix(what) + "out overlaps in but is not this rank's slice of it");
    auto p = std::make_unique<detail::mpi_pending<T>>(what, rank_);
    p->out = out.data();
    p->n = m;
    p->divisor = op == reduce_op::avg ? size_ : 0;
    const void* send = in.data();
    void* recv = out.data();
    MPI_Datatype type = detail::mpi_datatype<T>(what, rank_);
    MPI_Op mop = MPI_SUM;
    if (op == reduce_op::max) mop = detail::mpi_max_op<T>(what, rank_);
    if constexpr (detail::mpi_half_type<T>) {
      if (op != reduce_op::max) {
        // Summed in place in a float copy of the whole input: the result is its first m.
        recv = p->widen(in.data(), in.size());
        send = MPI_IN_PLACE;
        type = MPI_FLOAT;
      }
    }
    // MPI forbids send and receive buffers that overlap; MPI_IN_PLACE would put the
    // result at the front of `in`, over rank 0's slice, so stage it instead.
    if (aliased && send != MPI_IN_PLACE) recv = p->stage(m);
    return launch(std::move(p), what, async, (d - 1) * m * sizeof(T), [&](MPI_Request* req) {
      return req ? MPI_Ireduce_scatter_block(send, recv, count, type, mop, comm_, req)
                 : MPI_Reduce_scatter_block(send, recv, count, type, mop, comm_);
    });
  }

  template <comm_element T>
  comm_request start_reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root, const char* what,
                            bool async) {
    if (root < 0 || root >= size_)
      throw std::invalid_argument(prefix(what) + "root " + std::to_string(root) + " does not exist in a group of " +
                                  std::to_string(size_) + " ranks");
    const std::size_t n = in.size();
    const int count = checked_count(what, "in", n);
    const bool me = root == rank_;
    if (me && out.size() != n)
      throw std::invalid_argument(prefix(what) + "out has " + std::to_string(out.size()) +
                                  " elements on the root but in has " + std::to_string(n));
    const bool in_place = me && n != 0 && static_cast<const T*>(out.data()) == in.data();
    if (me && !in_place && overlap(in.data(), n, static_cast<const T*>(out.data()), n))
      throw std::invalid_argument(prefix(what) + "out overlaps in but is not the same elements");
    auto p = std::make_unique<detail::mpi_pending<T>>(what, rank_);
    p->out = me ? out.data() : nullptr;
    p->n = me ? n : 0;
    p->divisor = me && op == reduce_op::avg ? size_ : 0;
    const void* send = in_place ? MPI_IN_PLACE : static_cast<const void*>(in.data());
    void* recv = me ? out.data() : nullptr;
    MPI_Datatype type = detail::mpi_datatype<T>(what, rank_);
    MPI_Op mop = MPI_SUM;
    if (op == reduce_op::max) mop = detail::mpi_max_op<T>(what, rank_);
    if constexpr (detail::mpi_half_type<T>) {
      if (op != reduce_op::max) {
        // Summed in a float copy (on the root, in place: the result is rounded into `out`).
        float* wide = p->widen(in.data(), n);
        send = me ? MPI_IN_PLACE : static_cast<const void*>(wide);
        recv = me ? wide : nullptr;
        type = MPI_FLOAT;
      }
    }
    return launch(std::move(p), what, async, me || size_ == 1 ? 0 : n * sizeof(T), [&](MPI_Request* req) {
      return req ? MPI_Ireduce(send, recv, count, type, mop, root, comm_, req)
                 : MPI_Reduce(send, recv, count, type, mop, root, comm_);
    });
  }

  template <comm_element T>
  comm_request start_broadcast(std::span<T> data, int root, const char* what, bool async) {
    if (root < 0 || root >= size_)
      throw std::invalid_argument(prefix(what) + "root " + std::to_string(root) + " does not exist in a group of " +
                                  std::to_string(size_) + " ranks");
    const int count = checked_count(what, "data", data.size());
    auto p = std::make_unique<detail::mpi_pending<T>>(what, rank_);
    void* buf = data.data();
    const MPI_Datatype type = detail::mpi_datatype<T>(what, rank_);
    const std::size_t bytes = root == rank_ && size_ > 1 ? data.size() * sizeof(T) : 0;
    return launch(std::move(p), what, async, bytes, [&](MPI_Request* req) {
      return req ? MPI_Ibcast(buf, count, type, root, comm_, req) : MPI_Bcast(buf, count, type, root, comm_);
    });
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 0;
  std::size_t bytes_sent_ = 0;
};

}  // namespace distopt
