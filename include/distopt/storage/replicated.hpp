// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "../concepts.hpp"
#include "../types/bf16.hpp"

namespace distopt {

/// fp32 state encoding: the state is stored as it is computed.
using fp32 = float;

/// Every rank holds the whole optimizer state, encoded as `Encoding` (fp32 or bf16).
/// bf16 states are decoded to fp32 for the update and stored back rounded to nearest even.
template <class Encoding>
struct replicated {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = false;
  static_assert(state_encoding<Encoding>,
                "distopt::replicated<Encoding>: Encoding must be fp32 (float) or bf16");
};

}  // namespace distopt
