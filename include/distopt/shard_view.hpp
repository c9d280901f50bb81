// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the optimizer's accessors of sharded master weights and states return.

#include <cstddef>
#include <span>
#include <vector>

namespace distopt {

/// One rank's part of a tensor's master weights or state: `values` are elements
/// [first, first + values.size()) of the tensor (in its flat, row-major order).
template <class T>
struct shard_view {
  std::span<T> values;
  std::size_t first = 0;
};

/// A decoded copy of one rank's part of a tensor's state: elements [first, first + size).
struct shard_values {
  std::vector<float> values;
  std::size_t first = 0;
};

}  // namespace distopt
