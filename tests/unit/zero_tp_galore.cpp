// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore-AdamW on the TP 2 x DP 2 grid at ZeRO-2 and ZeRO-3 with the hooks and under
// ZeRO-Offload, sharded and owned: the split tensors in a plain AdamW group, two whole
// matrices (replicated over TP: projecting needs the whole matrix) projected, refreshed
// every other step. Params equal the unsplit single rank at stage 1, bit for bit.

#include "galore_cases.hpp"
#include "zero_tp.hpp"

#include <distopt/policy/galore_adamw.hpp>

using namespace distopt;
using namespace harness;

namespace {

std::vector<tp_tensor> with_projected_matrices() {
  auto xs = tp_tensors();
  xs.push_back({{16, 24}, tp_split::none, 1});
  xs.push_back({{40, 12}, tp_split::none, 1});
  return xs;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(galore_at_every_stage_on_a_tp_grid)

BOOST_AUTO_TEST_CASE(sharded) {
  check_stages_on_the_grid<galore_adamw>(with_projected_matrices(), galore_groups(galore_proj::std_, 2), false);
}
BOOST_AUTO_TEST_CASE(owned) {
  check_stages_on_the_grid<galore_adamw, distopt::owned>(with_projected_matrices(), galore_groups(galore_proj::std_, 2),
                                                         false);
}

BOOST_AUTO_TEST_SUITE_END()
