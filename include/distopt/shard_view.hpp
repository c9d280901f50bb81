// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the optimizer's accessors of sharded master weights and states return.

#include <cstddef>
#include <span>
#include <vector>

#include "space.hpp"

namespace distopt {

/// One rank's part of a tensor's master weights or state: `values` are elements
/// [first, first + values.size()) of the tensor (in its flat, row-major order), a
/// std::span in host memory or a device_span in device memory.
template <class T, class Space = host_space>
struct shard_view {
  span_in<T, Space> values;
  std::size_t first = 0;
};

/// A decoded copy of one rank's part of a tensor's state: elements [first, first + size).
struct shard_values {
  std::vector<float> values;
  std::size_t first = 0;
};

}  // namespace distopt
