// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "q8_encoding.hpp"

namespace distopt {

/// fp32 state encoding: the state is stored as it is computed.
using fp32 = float;

/// Every rank holds the whole optimizer state, encoded as `Encoding` (fp32, bf16
/// or q8). bf16 states are decoded to fp32 for the update and stored back rounded to nearest
/// even; q8 states are 8-bit codes with an fp32 scale per block of 256 (storage/q8.hpp).
template <class Encoding>
struct replicated {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = false;
  static_assert(state_encoding<Encoding>,
                "distopt::replicated<Encoding>: Encoding must be fp32 (float), bf16 or q8");
};

}  // namespace distopt
