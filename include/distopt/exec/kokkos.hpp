// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The Kokkos executor: the optimizer's work items run through Kokkos::parallel_for
/// on a Kokkos execution space, in memory from Kokkos::kokkos_malloc. Written against the
/// part of the Kokkos API that Kokkos 3.4 and 4.x share (RangePolicy with an index type,
/// kokkos_malloc/kokkos_free, fence, concurrency). Tested with Debian 12's Trilinos Kokkos
/// 3.4.1 on Kokkos::Serial (CI) and with Kokkos 4.6.99 on Kokkos::OpenMP (by hand).
///
/// The optimizer reads and writes its buffers from host code (the params and grads users
/// fill, checkpoints, layer-wise statistics), so the space's memory must be host
/// accessible. Device spaces (Kokkos::Cuda, HIP, SYCL) are refused at compile time.
///
/// Reductions stay in the optimizer: each work item computes its own partial result and
/// the partials are combined in a fixed order, never with Kokkos::parallel_reduce, whose
/// combination order depends on the space's thread count. That is what keeps the results
/// bit-identical to the CPU executor's for any thread count.
///
/// Needs Kokkos initialised (Kokkos::ScopeGuard in main) before the first allocation or
/// work item, and every optimizer using it destroyed before Kokkos::finalize.

#include <Kokkos_Core.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../concepts.hpp"

namespace distopt {

/// Executor over the Kokkos execution space `Space` (default: Kokkos's default host space).
template <class Space = Kokkos::DefaultHostExecutionSpace>
class kokkos {
  static_assert(Kokkos::is_execution_space<Space>::value,
                "distopt::kokkos<Space>: Space must be a Kokkos execution space, e.g. Kokkos::Serial or "
                "Kokkos::OpenMP");
  static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Space::memory_space>::accessible,
                "distopt::kokkos<Space>: the optimizer reads its buffers on the host, so Space's memory must be "
                "host accessible (Kokkos::Serial, OpenMP, Threads); device spaces are not supported");

 public:
  using executor_concept = executor_tag;
  using memory_space = host_space;
  using execution_space = Space;

  /// Runs on the space's default instance, looked up when work runs (so an executor, and
  /// the optimizer holding it, may be made before Kokkos is initialised).
  kokkos() = default;
  /// Runs on `space`, an instance of the execution space (exactly Space: Kokkos 4's
  /// OpenMP converts from an int, which must not make this executor take a thread count).
  template <class S>
    requires std::same_as<std::remove_cvref_t<S>, Space>
  explicit kokkos(S&& space) : space_(std::forward<S>(space)) {}

  /// The execution space instance work runs on.
  Space space() const {
    require_initialised("space");
    return space_ ? *space_ : Space();
  }

  /// The space's concurrency: how many threads may run work items at once.
  int concurrency() const { return static_cast<int>(space().concurrency()); }

  /// Zero-filled memory from Kokkos::kokkos_malloc in the space's memory space.
  void* allocate_bytes(std::size_t bytes) {
    require_initialised("allocate");
    const std::size_t n = bytes == 0 ? 1 : bytes;
    void* p = Kokkos::kokkos_malloc<typename Space::memory_space>("distopt", n);
    std::memset(p, 0, n);
    return p;
  }
  void deallocate_bytes(void* p, std::size_t) noexcept { Kokkos::kokkos_free<typename Space::memory_space>(p); }

  /// Calls f(i) once for each i in [0, n) through Kokkos::parallel_for, then fences. An
  /// exception from f is caught where it is thrown (a parallel region must not unwind)
  /// and the first one is rethrown here, after every item has run.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    if (n == 0) return;
    const Space sp = space();
    error_slot err;
    const item_functor<std::remove_reference_t<F>> body{&f, &err};
    Kokkos::parallel_for("distopt::kokkos::parallel_for",
                         Kokkos::RangePolicy<Space, Kokkos::IndexType<std::int64_t>>(sp, 0,
                                                                                     static_cast<std::int64_t>(n)),
                         body);
    sp.fence();
    if (err.failed.load(std::memory_order_acquire)) std::rethrow_exception(err.first);
  }

 private:
  static void require_initialised(const char* what) {
    if (!Kokkos::is_initialized())
      throw std::logic_error(std::string("distopt::kokkos: ") + what +
                             " before Kokkos is initialised; call Kokkos::initialize (or hold a Kokkos::ScopeGuard) "
                             "first, and destroy the optimizers using this executor before Kokkos::finalize");
  }

  struct error_slot {
    std::atomic<bool> failed{false};
    std::mutex mutex;
    std::exception_ptr first;
  };

  // A copyable functor for Kokkos: the caller's function and the error slot, by pointer.
  template <class F>
  struct item_functor {
    F* f;
    error_slot* err;
    void operator()(std::int64_t i) const {
      try {
        (*f)(static_cast<std::size_t>(i));
      } catch (...) {
        std::lock_guard lock(err->mutex);
        if (!err->first) err->first = std::current_exception();
        err->failed.store(true, std::memory_order_release);
      }
    }
  };

  std::optional<Space> space_;
};

}  // namespace distopt
