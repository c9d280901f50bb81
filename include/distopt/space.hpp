// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Memory spaces, and the view type of memory in each: a std::span for host memory,
/// a device_span for memory the host must not touch (it has no element access and does
/// not convert to a std::span, so a host read of device memory fails to compile).

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace distopt {

/// Memory the host reads and writes directly (cpu, kokkos on a host space).
struct host_space {};
/// Memory only the executor's launches and copies touch (a GPU's, or the emulated device's).
struct device_space {};

/// A pointer and an element count in device memory: what a kernel or a copy takes. It
/// gives the pointer (for the user's own kernels and collectives) but no element access.
template <class T>
class device_span {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  constexpr device_span() noexcept = default;
  constexpr device_span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// device_span<T> converts to device_span<const T>.
  template <class U>
    requires std::is_convertible_v<U (*)[], T (*)[]>
  constexpr device_span(device_span<U> o) noexcept : data_(o.data()), size_(o.size()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// No element access from the host: device memory is read in a launch or copied out.
  template <class I>
  T& operator[](I) const {
    static_assert(sizeof(I) == 0,
                  "distopt::device_span: device memory has no host element access; copy it with "
                  "distopt::upload / distopt::download, or pass data() to a kernel");
    return *data_;
  }
  /// Elements [offset, offset + count); throws std::out_of_range past the end.
  device_span subspan(std::size_t offset, std::size_t count) const {
    if (offset > size_ || count > size_ - offset)
      throw std::out_of_range("distopt::device_span::subspan: elements [" + std::to_string(offset) + ", " +
                              std::to_string(offset) + " + " + std::to_string(count) + ") of " +
                              std::to_string(size_));
    return {data_ + offset, count};
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// The view of T elements in memory space `Space`: std::span<T> in host memory,
/// device_span<T> in device memory.
template <class T, class Space>
using span_in = std::conditional_t<std::is_same_v<Space, host_space>, std::span<T>, device_span<T>>;

}  // namespace distopt
