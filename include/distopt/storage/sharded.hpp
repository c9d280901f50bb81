// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "q8_encoding.hpp"

namespace distopt {

/// The fp32 master weights and optimizer state are split over the data-parallel ranks
/// (ZeRO-1, Megatron's distributed optimizer): each rank stores and updates 1/d of them,
/// encoded as `Encoding` (fp32, bf16 or q8). Every rank still holds the full params and grads.
/// Each step reduce-scatters the grads, updates the local shard and all-gathers the params.
template <class Encoding>
struct sharded {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = true;
  static_assert(state_encoding<Encoding>,
                "distopt::sharded<Encoding>: Encoding must be fp32 (float), bf16 or q8");
};

}  // namespace distopt
