// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the optimizer hands to distopt/checkpoint.hpp: its state as named flat
/// vectors, of which each rank holds a slice, and the scalars that go with them. The
/// optimizer knows where its bytes live; the checkpoint code knows files. Neither needs
/// the other's details.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace distopt::detail {

/// Where a vector sits under tensor parallelism: it is this TP part's `box` (row-major) of
/// an array of shape `whole` that the parts split along one axis, or each hold entire (then
/// box == whole), starting at `offset`. `whole`, `box` and `offset` have the same rank. A
/// checkpoint reshards over TP through it: a part of another TP size reads its box from the
/// boxes the saving parts wrote. Empty `whole`: the vector has no place in a TP-independent
/// array (8-bit absmax of blocks that straddle a TP cut) and loads only on the TP layout
/// that saved it.
struct tp_box {
  std::vector<std::int64_t> whole, box, offset;
  bool operator==(const tp_box&) const = default;
};

/// One flat vector of state ("<tensor>/param", "<tensor>/state.0.codes", ...) of `total`
/// elements, of which this rank holds [first, first + count).
struct checkpoint_item {
  std::string name;
  std::string tensor;                ///< the layout tensor it belongs to
  std::string key;                   ///< its tensor's key in the identity ("tensor NAME", "experts NAME")
  std::string dtype;                 ///< safetensors dtype: F32, BF16, F16, U8
  std::size_t element_size = 4;
  std::uint64_t total = 0;           ///< elements of the whole vector
  std::vector<std::int64_t> shape;   ///< the whole vector's shape, for readers
  std::uint64_t first = 0, count = 0;
  tp_box tp;                         ///< the whole vector's place under TP
  bool save = false;                 ///< this rank writes its slice (one writer per element)
  bool load = false;                 ///< this rank reads its slice on load
  const std::byte* source = nullptr; ///< count * element_size bytes, for save
  /// Device memory: copies the slice to the host (on save only) and returns it; `source`
  /// is then unused.
  std::function<const std::byte*()> fetch;
  /// Load: takes the slice's bytes once every rank has read and checked its own.
  std::function<void(std::span<const std::byte>)> install;
};

/// The optimizer's scalars: `identity` must match on load (policy, dtypes, layout, ...),
/// `state` is restored (step, seed, loss scale, hyper-parameters, ...). Key, value pairs.
struct checkpoint_scalars {
  std::vector<std::pair<std::string, std::string>> identity;
  std::vector<std::pair<std::string, std::string>> state;
  /// Per tensor ("tensor NAME"): the whole tensor over the TP group, which must match when
  /// a checkpoint loads on another TP layout (`identity` then describes the other parts).
  std::vector<std::pair<std::string, std::string>> whole;
};

}  // namespace distopt::detail
