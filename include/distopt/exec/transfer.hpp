// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Copies between host memory and an executor's memory: how a training code writes
/// initial params and grads into the optimizer's views, and reads results back, in any
/// memory space (for a host executor the view is a std::span and this is a plain copy).

#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../concepts.hpp"

namespace distopt {

namespace detail {
inline void check_copy_sizes(const char* what, std::size_t from, std::size_t to) {
  if (from != to)
    throw std::invalid_argument(std::string("distopt::") + what + ": " + std::to_string(from) +
                                " elements into a view of " + std::to_string(to));
}

/// Copies n bytes through executor `e` (a plain memcpy for host memory).
template <executor E>
void copy_bytes(E& e, void* dst, const void* src, std::size_t n) {
  if (n == 0) return;
  if constexpr (host_memory<E>) std::memcpy(dst, src, n);
  else e.copy_bytes(dst, src, n);
}
/// What a collective on executor memory holds while in flight: the emulated device's open
/// memory (exec/emulated.hpp); nothing for other executors.
struct no_access_scope {};
template <executor E>
auto collective_scope(E& e) {
  if constexpr (requires { e.open_memory(); }) return e.open_memory();
  else return no_access_scope{};
}
}  // namespace detail

/// Copies host values `from` into `to`, a view in executor `e`'s memory: opt.param(name) or
/// opt.grad(name), a std::span for a host executor, a device_span otherwise. The sizes
/// must match.
template <executor E, class T>
void upload(E& e, std::span<const std::type_identity_t<T>> from, std::span<T> to) {
  detail::check_copy_sizes("upload", from.size(), to.size());
  detail::copy_bytes(e, to.data(), from.data(), from.size_bytes());
}
template <executor E, class T>
void upload(E& e, std::span<const std::type_identity_t<T>> from, device_span<T> to) {
  static_assert(!host_memory<E>, "distopt::upload: a device_span with an executor of host memory");
  detail::check_copy_sizes("upload", from.size(), to.size());
  detail::copy_bytes(e, to.data(), from.data(), from.size_bytes());
}

/// Copies `from`, a view in executor `e`'s memory, into host memory `to`. The sizes must match.
template <executor E, class T>
void download(E& e, std::span<const std::type_identity_t<T>> from, std::span<T> to) {
  detail::check_copy_sizes("download", from.size(), to.size());
  detail::copy_bytes(e, to.data(), from.data(), from.size_bytes());
}
template <executor E, class T>
void download(E& e, device_span<const std::type_identity_t<T>> from, std::span<T> to) {
  static_assert(!host_memory<E>, "distopt::download: a device_span with an executor of host memory");
  detail::check_copy_sizes("download", from.size(), to.size());
  detail::copy_bytes(e, to.data(), from.data(), from.size_bytes());
}

}  // namespace distopt
