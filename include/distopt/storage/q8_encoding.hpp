// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The q8 encoding tag and the concept of a quantized encoding: what the concepts
/// and storage templates need to name q8. The maps, codebooks and the optimizer's 8-bit
/// engine are in storage/q8.hpp, which an optimizer with q8 states needs included.

#include <concepts>
#include <cstddef>

namespace distopt {

/// The 8-bit block-wise dynamic state encoding: `replicated<q8>`, `sharded<q8>`. Tensors
/// with fewer than `optimizer_options::min_8bit_size` elements keep fp32 states.
struct q8 {
  static constexpr bool is_quantized = true;
  /// Elements per absmax block.
  static constexpr std::size_t block = 256;
};

/// A quantized state encoding (codes plus per-block scales), as opposed to a number type.
template <class E>
concept quantized_encoding = requires {
  { E::is_quantized } -> std::convertible_to<bool>;
  { E::block } -> std::convertible_to<std::size_t>;
} && E::is_quantized;

}  // namespace distopt
