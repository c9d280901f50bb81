// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file `nccl`: a communicator over NCCL, one rank per GPU. It wraps an `ncclComm_t` and
/// the `cudaStream_t` its collectives are enqueued on; every span points to DEVICE memory
/// on the communicator's device. Plain host C++ (no nvcc): it includes <cuda_runtime.h>
/// and <nccl.h> (NCCL 2.18 or newer) and links CUDA::cudart and NCCL, which the CMake
/// target `distopt::nccl` (option DISTOPT_ENABLE_NCCL) provides.
///
/// Waiting. A blocking collective enqueues and then waits for the stream to drain; an
/// `i`-form enqueues, records an event and returns a `comm_request` whose wait() waits
/// for that event. Both wait by polling (cudaStreamQuery / cudaEventQuery) and checking
/// ncclCommGetAsyncError between polls, as NCCL recommends, so that an asynchronous NCCL
/// failure (a peer that died, a network error) is thrown, not waited on forever.
///
/// Errors. Sizes, roots and aliasing are checked on the calling rank only, before
/// anything is enqueued, and throw std::invalid_argument. NCCL has no cross-rank check:
/// a rank that throws leaves the others waiting inside NCCL (unlike `threads`, where
/// every rank throws the same error). Every NCCL and CUDA call is checked; a failure
/// throws std::runtime_error naming the call, the rank and NCCL's or CUDA's reason.

#include <cuda_runtime.h>
#include <nccl.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "../types/fp16.hpp"
#include "request.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "distopt/comm/nccl.hpp needs NCCL 2.18 or newer (ncclCommSplit, ncclAvg, ncclBfloat16)"
#endif

namespace distopt {

/// An element type the `nccl` collectives accept: float, double, bf16 or fp16.
template <class T>
concept nccl_element = std::same_as<T, float> || std::same_as<T, double> ||
                       std::same_as<T, bf16> || std::same_as<T, fp16>;

namespace detail {

template <nccl_element T>
constexpr ncclDataType_t nccl_data_type() noexcept {
  if constexpr (std::same_as<T, float>) return ncclFloat32;
  else if constexpr (std::same_as<T, double>) return ncclFloat64;
  else if constexpr (std::same_as<T, bf16>) return ncclBfloat16;
  else return ncclFloat16;
}

constexpr ncclRedOp_t nccl_reduce_op(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum: return ncclSum;
  case reduce_op::avg: return ncclAvg;
  case reduce_op::max: return ncclMax;
  }
  return ncclSum;
}

/// " on rank 2", or nothing while the rank is not known yet.
inline std::string nccl_on_rank(int rank) {
  return rank >= 0 ? " on rank " + std::to_string(rank) : std::string();
}

/// Throws std::runtime_error unless `r` is ncclSuccess:
/// "distopt::nccl: ncclAllReduce failed on rank 0: <reason> (NCCL's last error: <text>)".
inline void nccl_check(ncclResult_t r, const char* call, int rank) {
  if (r == ncclSuccess) return;
  std::string msg = std::string("distopt::nccl: ") + call + " failed" + nccl_on_rank(rank) + ": " +
                    ncclGetErrorString(r);
  // The comm argument is unused by NCCL: the last error is per thread.
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0')
    msg += " (NCCL's last error: " + std::string(last) + ")";
  throw std::runtime_error(msg);
}

/// Throws std::runtime_error unless `e` is cudaSuccess:
/// "distopt::nccl: cudaEventQuery failed on rank 0: cudaErrorIllegalAddress: <reason>".
inline void nccl_cuda_check(cudaError_t e, const char* call, int rank) {
  if (e == cudaSuccess) return;
  throw std::runtime_error(std::string("distopt::nccl: ") + call + " failed" + nccl_on_rank(rank) + ": " +
                           cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

/// Throws if NCCL has recorded an asynchronous error on `comm` (ncclInProgress is not one).
inline void nccl_check_async(ncclComm_t comm, int rank) {
  ncclResult_t async = ncclSuccess;
  nccl_check(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError", rank);
  if (async != ncclSuccess && async != ncclInProgress)
    nccl_check(async, "a collective (asynchronous error)", rank);
}

/// Polls `query` until the work it asks about is done, checking NCCL's asynchronous
/// error state between polls, so that a failed collective throws instead of hanging.
template <class Query>
void nccl_wait(Query query, const char* query_name, ncclComm_t comm, int rank) {
  for (;;) {
    const cudaError_t e = query();
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) nccl_cuda_check(e, query_name, rank);
    nccl_check_async(comm, rank);
    std::this_thread::yield();
  }
  // The stream can drain after NCCL gave up on a collective: its results would be garbage.
  nccl_check_async(comm, rank);
}

/// Makes `device` current for a scope and restores the previous one: events and streams
/// belong to the device current when they are made.
class cuda_device_guard {
 public:
  cuda_device_guard(int device, int rank) {
    nccl_cuda_check(cudaGetDevice(&previous_), "cudaGetDevice", rank);
    if (previous_ != device) {
      nccl_cuda_check(cudaSetDevice(device), "cudaSetDevice", rank);
      switched_ = true;
    }
  }
  ~cuda_device_guard() {
    if (switched_) static_cast<void>(cudaSetDevice(previous_));
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

/// What an `nccl` i-form hands its `comm_request`: an event recorded after the collective.
class nccl_request final : public request_state {
 public:
  /// Creates the event on the current device (the caller makes the comm's device current).
  nccl_request(ncclComm_t comm, int rank) : comm_(comm), rank_(rank) {
    nccl_cuda_check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", rank);
  }
  ~nccl_request() override { static_cast<void>(cudaEventDestroy(event_)); }
  nccl_request(const nccl_request&) = delete;
  nccl_request& operator=(const nccl_request&) = delete;

  void record(cudaStream_t stream) { nccl_cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord", rank_); }

  void wait() override {
    nccl_cuda_check(error_, "cudaEventQuery", rank_);
    nccl_wait([this] { return cudaEventQuery(event_); }, "cudaEventQuery", comm_, rank_);
  }

  /// True when the collective is done or has failed (wait() then reports the failure).
  bool test() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      error_ = e;  // kept: a query error need not repeat on the next query
      return true;
    }
    ncclResult_t async = ncclSuccess;
    return ncclCommGetAsyncError(comm_, &async) != ncclSuccess || (async != ncclSuccess && async != ncclInProgress);
  }

 private:
  ncclComm_t comm_;
  int rank_;
  cudaEvent_t event_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

/// A checked collective, ready to enqueue: the NCCL call it makes (for messages), whether
/// it has no elements (then nothing is enqueued), the bytes it adds to bytes_sent(), and
/// the enqueue itself.
template <class Enqueue>
struct nccl_launch {
  const char* call;
  bool empty;
  std::size_t bytes;
  Enqueue enqueue;
};

template <class Enqueue>
nccl_launch<Enqueue> make_nccl_launch(const char* call, std::size_t count, std::size_t bytes, Enqueue enqueue) {
  return {call, count == 0, bytes, std::move(enqueue)};
}

/// Whether [a, a + na) and [b, b + nb) share an element.
template <class T>
bool ranges_overlap(const T* a, std::size_t na, const T* b, std::size_t nb) noexcept {
  if (na == 0 || nb == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + nb * sizeof(T) && pb < pa + na * sizeof(T);
}

}  // namespace detail

/// One rank's handle on an NCCL communicator and the stream its collectives run on.
/// Models `distopt::communicator` and `distopt::async_communicator`. Move-only; a handle
/// belongs to one host thread at a time (NCCL communicators are not thread-safe).
///
/// Ownership. The public constructor borrows both the communicator and the stream: the
/// caller destroys them, after this handle. `adopt` takes the communicator;
/// `init_rank`, `init_all` and `split` make communicators this handle owns (and
/// `init_rank` without a stream, and `init_all`, a non-blocking stream it owns; a handle
/// from `split` shares its parent's stream and keeps it alive). An owned communicator is
/// destroyed with ncclCommDestroy, or ncclCommAbort once NCCL has reported an error on it.
/// Wait for every request before the handle that made it goes away.
///
/// Collectives are collective: every rank calls the same one with the same sizes, op and
/// root, as with NCCL itself. A call with no elements enqueues nothing on any rank. The
/// communicator must be a blocking one (NCCL's default configuration). Numerics are
/// NCCL's: the reduction order depends on NCCL's algorithm and the topology, so results
/// are not the bit-exact rank-order sums of `threads`; `avg` is ncclAvg, `max` ncclMax.
///
/// Byte model of `bytes_sent()`: exactly `threads`' (see comm/threads.hpp), counted when
/// a collective is enqueued, for d = size(), N = elements of the full buffer, s = sizeof(T):
///   all_reduce      (N + (d-2) * c_r) * s for d > 1, c_r = this rank's chunk of N
///                   (N/d, plus one for the first N mod d ranks); 0 for d = 1
///   reduce_scatter  (d-1) * out.size() * s
///   all_gather      (d-1) * in.size() * s
///   reduce          N * s on every rank but the root, 0 on the root
///   broadcast       N * s on the root when d > 1, 0 on the others
///   split           0
/// It is what a bandwidth-optimal ring sends, a model for comparing layouts, not a count
/// of the bytes NCCL moves (its algorithm and protocol choices differ).
class nccl {
 public:
  using communicator_concept = communicator_tag;
  /// Its collectives read and write device memory (NCCL's buffers).
  static constexpr bool collectives_in_device_memory = true;

  /// Borrows `comm` and `stream` (which may be the legacy default stream, nullptr): both
  /// must outlive this handle, and `stream` must belong to the comm's device.
  nccl(ncclComm_t comm, cudaStream_t stream) : nccl(comm_handle(comm, comm_deleter{false}), borrow_stream(stream)) {}

  nccl(nccl&&) noexcept = default;
  nccl& operator=(nccl&&) noexcept = default;
  nccl(const nccl&) = delete;
  nccl& operator=(const nccl&) = delete;
  ~nccl() = default;

  /// Takes ownership of `comm` (destroyed with this handle, or at once if this throws)
  /// and borrows `stream`.
  static nccl adopt(ncclComm_t comm, cudaStream_t stream) {
    return nccl(comm_handle(comm, comm_deleter{true}), borrow_stream(stream));
  }

  /// Rank `rank` of `nranks` (ncclCommInitRank, collective over the ranks sharing `id`
  /// from ncclGetUniqueId) on the current device, with a new stream. Owns both.
  static nccl init_rank(const ncclUniqueId& id, int nranks, int rank) {
    check_init_rank(nranks, rank);
    return init_rank_with(id, nranks, rank, make_stream(rank));
  }
  /// As above, on the current device, but borrowing `stream` (of the current device).
  static nccl init_rank(const ncclUniqueId& id, int nranks, int rank, cudaStream_t stream) {
    check_init_rank(nranks, rank);
    return init_rank_with(id, nranks, rank, borrow_stream(stream));
  }

  /// A group of one rank per listed device in this process (ncclCommInitAll; rank i on
  /// devices[i]), each handle with its own stream. Call each rank's collectives from its
  /// own thread: a blocking collective returns only once every rank has entered it.
  static std::vector<nccl> init_all(std::span<const int> devices) {
    if (devices.empty()) throw std::invalid_argument("distopt::nccl::init_all: no devices given");
    const std::size_t n = devices.size();
    std::vector<ncclComm_t> raw(n, nullptr);
    std::vector<comm_handle> owned;
    owned.reserve(n);  // before the comms exist, so that wrapping them cannot throw
    std::vector<nccl> group;
    group.reserve(n);
    detail::nccl_check(ncclCommInitAll(raw.data(), static_cast<int>(n), devices.data()), "ncclCommInitAll", -1);
    for (ncclComm_t c : raw) owned.emplace_back(c, comm_deleter{true});
    for (std::size_t i = 0; i < n; ++i) {
      detail::cuda_device_guard guard(devices[i], static_cast<int>(i));
      std::shared_ptr<stream_type> stream = make_stream(static_cast<int>(i));
      group.push_back(nccl(std::move(owned[i]), std::move(stream)));
    }
    return group;
  }

  /// This rank's index in the group, 0 <= rank() < size().
  int rank() const noexcept { return rank_; }
  /// The number of ranks in the group.
  int size() const noexcept { return size_; }
  /// The CUDA device of this rank.
  int device() const noexcept { return device_; }
  /// The wrapped communicator (still owned by this handle where it was).
  ncclComm_t comm() const noexcept { return comm_.get(); }
  /// The stream collectives are enqueued on.
  cudaStream_t stream() const noexcept { return stream_.get(); }
  /// True when `s` on `device` (-1: the current one) is this handle's stream on its device
  /// (null and cudaStreamLegacy both name the legacy default stream, one per device): the
  /// optimizer on distopt::cuda requires the executor's stream and device to be these.
  bool runs_on(cudaStream_t s, int device) const noexcept {
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return false;
    const auto named = [](cudaStream_t x) { return x ? x : cudaStreamLegacy; };
    return device == device_ && named(s) == named(stream());
  }
  /// Bytes this rank has sent since the handle was made, by the model in the class docs.
  std::size_t bytes_sent() const noexcept { return bytes_sent_; }

  /// Reduces `data` over the ranks in place: every rank ends with the result.
  template <nccl_element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    run_blocking(all_reduce_launch(data, op));
  }

  /// Concatenates every rank's `in` into `out` in rank order; out.size() == size() * in.size().
  /// `in` may be this rank's own slice of `out`; otherwise they must not overlap.
  template <nccl_element T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    run_blocking(all_gather_launch(in, out));
  }

  /// Reduces `in` over the ranks and leaves slice rank() of the result in `out`;
  /// in.size() == size() * out.size(). `out` may be this rank's own slice of `in`;
  /// otherwise they must not overlap.
  template <nccl_element T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    run_blocking(reduce_scatter_launch(in, out, op));
  }

  /// Reduces `in` over the ranks into `out` on rank `root` (in.size() elements there; the
  /// others' `out` is not touched and may be empty). The root's `out` may be its `in`;
  /// otherwise they must not overlap.
  template <nccl_element T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    run_blocking(reduce_launch(in, out, op, root));
  }

  /// Copies `root`'s `data` into every rank's `data`.
  template <nccl_element T>
  void broadcast(std::span<T> data, int root) {
    run_blocking(broadcast_launch(data, root));
  }

  /// Asynchronous forms: the same checks and the same collective, enqueued on stream();
  /// the buffers stay in use until the request's wait() returns.
  template <nccl_element T>
  comm_request iall_reduce(std::span<T> data, reduce_op op) {
    return run_async(all_reduce_launch(data, op));
  }
  template <nccl_element T>
  comm_request iall_gather(std::span<const T> in, std::span<T> out) {
    return run_async(all_gather_launch(in, out));
  }
  template <nccl_element T>
  comm_request ireduce_scatter(std::span<const T> in, std::span<T> out, reduce_op op) {
    return run_async(reduce_scatter_launch(in, out, op));
  }
  template <nccl_element T>
  comm_request ireduce(std::span<const T> in, std::span<T> out, reduce_op op, int root) {
    return run_async(reduce_launch(in, out, op, root));
  }
  template <nccl_element T>
  comm_request ibroadcast(std::span<T> data, int root) {
    return run_async(broadcast_launch(data, root));
  }

  /// Splits the group (collectively, ncclCommSplit): ranks that pass the same `color`
  /// (>= 0) form a new group, ordered by `key` (give distinct keys within a color: NCCL
  /// documents no order for ties). The new handle owns its communicator and shares this
  /// handle's stream. For a DP x TP grid, rank
  /// r = dp * tp_size + tp: split(dp, tp) gives the TP group, split(tp, dp) the DP group.
  nccl split(int color, int key) {
    if (color < 0)
      throw std::invalid_argument("distopt::nccl::split: color must be >= 0, got " + std::to_string(color));
    detail::cuda_device_guard guard(device_, rank_);
    ncclComm_t sub = nullptr;
    detail::nccl_check(ncclCommSplit(comm(), color, key, &sub, nullptr), "ncclCommSplit", rank_);
    return nccl(comm_handle(sub, comm_deleter{true}), stream_);
  }

 private:
  using comm_type = std::remove_pointer_t<ncclComm_t>;
  using stream_type = std::remove_pointer_t<cudaStream_t>;

  struct comm_deleter {
    bool owns = false;
    void operator()(comm_type* c) const noexcept {
      if (!owns) return;
      // ncclCommDestroy flushes outstanding work, which never ends after an NCCL failure.
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(c, &async) == ncclSuccess && (async == ncclSuccess || async == ncclInProgress))
        static_cast<void>(ncclCommDestroy(c));
      else
        static_cast<void>(ncclCommAbort(c));
    }
  };
  using comm_handle = std::unique_ptr<comm_type, comm_deleter>;

  nccl(comm_handle comm, std::shared_ptr<stream_type> stream) : stream_(std::move(stream)), comm_(std::move(comm)) {
    if (!comm_) throw std::invalid_argument("distopt::nccl: the communicator is null");
    detail::nccl_check(ncclCommUserRank(comm_.get(), &rank_), "ncclCommUserRank", -1);
    detail::nccl_check(ncclCommCount(comm_.get(), &size_), "ncclCommCount", rank_);
    detail::nccl_check(ncclCommCuDevice(comm_.get(), &device_), "ncclCommCuDevice", rank_);
  }

  static std::shared_ptr<stream_type> borrow_stream(cudaStream_t s) {
    return std::shared_ptr<stream_type>(s, [](cudaStream_t) noexcept {});
  }
  /// A new non-blocking stream on the current device, destroyed with its last handle.
  static std::shared_ptr<stream_type> make_stream(int rank) {
    cudaStream_t s = nullptr;
    detail::nccl_cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", rank);
    return std::shared_ptr<stream_type>(s, [](cudaStream_t p) noexcept { static_cast<void>(cudaStreamDestroy(p)); });
  }

  static void check_init_rank(int nranks, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw std::invalid_argument("distopt::nccl::init_rank: rank " + std::to_string(rank) +
                                  " does not exist in a group of " + std::to_string(nranks) + " ranks");
  }
  static nccl init_rank_with(const ncclUniqueId& id, int nranks, int rank, std::shared_ptr<stream_type> stream) {
    ncclComm_t c = nullptr;
    detail::nccl_check(ncclCommInitRank(&c, nranks, id, rank), "ncclCommInitRank", rank);
    return nccl(comm_handle(c, comm_deleter{true}), std::move(stream));
  }

  std::size_t ranks() const noexcept { return static_cast<std::size_t>(size_); }

  /// NCCL's op for `op`. On one rank `avg` is `sum` (the same values): the NCCL of PyTorch's
  /// nvidia-nccl-cu13 wheel on an H200 (2026-11-27) left the last of 4,097 floats unwritten
  /// in an out-of-place ncclAvg reduce_scatter or reduce on one rank (tests/nccl/nccl_comm.cpp).
  ncclRedOp_t red_op(reduce_op op) const noexcept {
    return op == reduce_op::avg && size_ == 1 ? ncclSum : detail::nccl_reduce_op(op);
  }

  template <nccl_element T>
  auto all_reduce_launch(std::span<T> data, reduce_op op) const {
    const std::size_t n = data.size(), d = ranks(), r = static_cast<std::size_t>(rank_);
    const std::size_t chunk = n / d + (r < n % d ? 1 : 0);
    const std::size_t bytes = d > 1 ? (n + (d - 2) * chunk) * sizeof(T) : 0;
    return detail::make_nccl_launch("ncclAllReduce", n, bytes, [data, o = red_op(op), c = comm(), s = stream()] {
      return ncclAllReduce(data.data(), data.data(), data.size(), detail::nccl_data_type<T>(),
                           o, c, s);
    });
  }

  template <nccl_element T>
  auto all_gather_launch(std::span<const T> in, std::span<T> out) const {
    const std::size_t d = ranks(), m = in.size();
    if (out.size() != d * m)
      throw std::invalid_argument("distopt::nccl::all_gather: out has " + std::to_string(out.size()) +
                                  " elements but size() * in = " + std::to_string(d) + " * " + std::to_string(m) +
                                  " = " + std::to_string(d * m));
    if (in.data() != out.data() + static_cast<std::size_t>(rank_) * m &&
        detail::ranges_overlap(in.data(), m, static_cast<const T*>(out.data()), out.size()))
      throw std::invalid_argument("distopt::nccl::all_gather: in overlaps out but is not this rank's slice of it");
    return detail::make_nccl_launch("ncclAllGather", m, (d - 1) * m * sizeof(T), [in, out, c = comm(), s = stream()] {
      return ncclAllGather(in.data(), out.data(), in.size(), detail::nccl_data_type<T>(), c, s);
    });
  }

  template <nccl_element T>
  auto reduce_scatter_launch(std::span<const T> in, std::span<T> out, reduce_op op) const {
    const std::size_t d = ranks(), m = out.size();
    if (in.size() != d * m)
      throw std::invalid_argument("distopt::nccl::reduce_scatter: in has " + std::to_string(in.size()) +
                                  " elements but size() * out = " + std::to_string(d) + " * " + std::to_string(m) +
                                  " = " + std::to_string(d * m));
    if (static_cast<const T*>(out.data()) != in.data() + static_cast<std::size_t>(rank_) * m &&
        detail::ranges_overlap(in.data(), in.size(), static_cast<const T*>(out.data()), m))
      throw std::invalid_argument("distopt::nccl::reduce_scatter: out overlaps in but is not this rank's slice of it");
    const std::size_t bytes = (d - 1) * m * sizeof(T);
    return detail::make_nccl_launch("ncclReduceScatter", m, bytes,
                                    [in, out, o = red_op(op), c = comm(), s = stream()] {
      return ncclReduceScatter(in.data(), out.data(), out.size(), detail::nccl_data_type<T>(),
                               o, c, s);
    });
  }

  template <nccl_element T>
  auto reduce_launch(std::span<const T> in, std::span<T> out, reduce_op op, int root) const {
    if (root < 0 || root >= size_)
      throw std::invalid_argument("distopt::nccl::reduce: root " + std::to_string(root) +
                                  " does not exist in a group of " + std::to_string(size_) + " ranks");
    const std::size_t n = in.size();
    const bool me = root == rank_;
    if (me && out.size() != n)
      throw std::invalid_argument("distopt::nccl::reduce: out has " + std::to_string(out.size()) +
                                  " elements on the root but in has " + std::to_string(n));
    if (me && static_cast<const T*>(out.data()) != in.data() &&
        detail::ranges_overlap(in.data(), n, static_cast<const T*>(out.data()), n))
      throw std::invalid_argument("distopt::nccl::reduce: out overlaps in but is not the same elements");
    const std::size_t bytes = me ? 0 : n * sizeof(T);
    return detail::make_nccl_launch("ncclReduce", n, bytes,
                                    [in, out, o = red_op(op), root, me, c = comm(), s = stream()] {
      return ncclReduce(in.data(), me ? out.data() : nullptr, in.size(), detail::nccl_data_type<T>(),
                        o, root, c, s);
    });
  }

  template <nccl_element T>
  auto broadcast_launch(std::span<T> data, int root) const {
    if (root < 0 || root >= size_)
      throw std::invalid_argument("distopt::nccl::broadcast: root " + std::to_string(root) +
                                  " does not exist in a group of " + std::to_string(size_) + " ranks");
    const std::size_t n = data.size();
    const std::size_t bytes = root == rank_ && size_ > 1 ? n * sizeof(T) : 0;
    return detail::make_nccl_launch("ncclBroadcast", n, bytes, [data, root, c = comm(), s = stream()] {
      return ncclBroadcast(data.data(), data.data(), data.size(), detail::nccl_data_type<T>(), root, c, s);
    });
  }

  template <class Launch>
  void run_blocking(Launch launch) {
    if (launch.empty) return;
    detail::cuda_device_guard guard(device_, rank_);
    detail::nccl_check(launch.enqueue(), launch.call, rank_);
    bytes_sent_ += launch.bytes;
    detail::nccl_wait([s = stream()] { return cudaStreamQuery(s); }, "cudaStreamQuery", comm(), rank_);
  }

  template <class Launch>
  comm_request run_async(Launch launch) {
    if (launch.empty) return {};
    detail::cuda_device_guard guard(device_, rank_);
    // The event exists before the collective is enqueued, so that failing to make it
    // cannot leave a collective running on buffers the caller believes free.
    auto state = std::make_unique<detail::nccl_request>(comm(), rank_);
    detail::nccl_check(launch.enqueue(), launch.call, rank_);
    bytes_sent_ += launch.bytes;
    try {
      state->record(stream());
    } catch (...) {
      static_cast<void>(cudaStreamSynchronize(stream()));  // the buffers are the caller's again
      throw;
    }
    return comm_request(std::move(state));
  }

  std::shared_ptr<stream_type> stream_;  // declared first: destroyed after the comm
  comm_handle comm_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  std::size_t bytes_sent_ = 0;
};

}  // namespace distopt
