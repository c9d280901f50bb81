// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include "../concepts.hpp"
#include "../types/bf16.hpp"
#include "q8_encoding.hpp"

namespace distopt {

/// `sharded`, except that each matrix an optimizer updates whole (GaLore's projected
/// groups, Muon's orthogonalised groups) belongs to one data-parallel rank: its gradient
/// is reduced to that rank, its states live only there, the owner alone projects or
/// orthogonalises it, and its new params are broadcast to the others. Owners are balanced
/// by the matrices' cost (m n min(m, n)) and depend only on the layout and d; the other
/// tensors are cut over the ranks as with `sharded`. Encoded as `Encoding` (fp32, bf16, or
/// q8 for GaLore: Muon refuses 8-bit states). `Stage` is the ZeRO stage, as for
/// `sharded<Encoding, Stage>`: at 2 a matrix's reduced grads live on its owner only.
template <class Encoding, int Stage = 1>
struct owned {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = true;
  static constexpr bool owns_matrices = true;
  static constexpr int zero_stage = Stage;
  static_assert(state_encoding<Encoding>,
                "distopt::owned<Encoding>: Encoding must be fp32 (float), bf16 or q8");
  static_assert(Stage >= 1 && Stage <= 3,
                "distopt::owned<Encoding, Stage>: Stage is 1 (sharded states), 2 (sharded grads too: each matrix's "
                "reduced grads live on its owner only) or 3 (sharded params too)");
};

}  // namespace distopt
