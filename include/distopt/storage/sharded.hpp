// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "q8_encoding.hpp"

namespace distopt {

/// The fp32 master weights and optimizer state are split over the data-parallel ranks,
/// encoded as `Encoding` (fp32, bf16 or q8); each rank stores and updates 1/d of them.
/// `Stage` says what else is split, as DeepSpeed's ZeRO stages do:
///  - 1 (ZeRO-1, Megatron's distributed optimizer): every rank holds the full params and
///    the full grads. Each step reduce-scatters the grads, updates the local shard and
///    all-gathers the params.
///  - 2 (ZeRO-2): the grads live sharded too. A bucket's full gradient exists only from
///    the first `grad()` view of one of its tensors in a step until its reduce-scatter is
///    done (started by `grads_ready` or by `step()`); then its buffer goes back to a pool.
///  - 3 (ZeRO-3): the params live sharded too. A tensor's full params exist only between
///    `gather` and `release` of a layer holding it, all-gathered into a pooled buffer;
///    `step()` updates each rank's shard and gathers nothing.
/// The stage changes where params and grads live, never the arithmetic: the same global
/// gradients give the same bits at every stage.
template <class Encoding, int Stage = 1>
struct sharded {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = true;
  static constexpr int zero_stage = Stage;
  static_assert(state_encoding<Encoding>,
                "distopt::sharded<Encoding>: Encoding must be fp32 (float), bf16 or q8");
  static_assert(Stage >= 1 && Stage <= 3,
                "distopt::sharded<Encoding, Stage>: Stage is 1 (sharded states), 2 (sharded grads too) or 3 "
                "(sharded params too)");
};

}  // namespace distopt
