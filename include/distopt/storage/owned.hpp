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
/// q8 for GaLore: Muon refuses 8-bit states).
template <class Encoding>
struct owned {
  using storage_concept = storage_tag;
  using encoding = Encoding;
  static constexpr bool is_sharded = true;
  static constexpr bool owns_matrices = true;
  static_assert(state_encoding<Encoding>,
                "distopt::owned<Encoding>: Encoding must be fp32 (float), bf16 or q8");
};

}  // namespace distopt
