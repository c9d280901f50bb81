// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <cstddef>
#include <span>
#include <utility>

namespace distopt::detail {

/// An owning, zero-filled array of T in an executor's memory space. It keeps its own copy
/// of the executor (executors are cheap handles), so it stays valid when its owner moves.
template <class T, class Exec>
class buffer {
 public:
  buffer() = default;
  buffer(Exec& exec, std::size_t n)
      : exec_(exec), data_(static_cast<T*>(exec_.allocate_bytes(n * sizeof(T)))), size_(n) {}
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  buffer(buffer&& o) noexcept { swap(o); }
  buffer& operator=(buffer&& o) noexcept {
    buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~buffer() {
    if (data_) exec_.deallocate_bytes(data_, size_ * sizeof(T));
  }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::span<T> span() const noexcept { return {data_, size_}; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }

 private:
  void swap(buffer& o) noexcept {
    std::swap(exec_, o.exec_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  Exec exec_{};
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace distopt::detail
