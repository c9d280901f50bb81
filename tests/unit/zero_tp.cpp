// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Lamb, Adafactor and CAME on a tensor-parallel grid (TP 2 x DP 2: the seed's configuration,
// ColossalAI's distributed optimizers with ZeRO-2) and beyond it: at ZeRO-2 and ZeRO-3 with
// the overlap hooks, and under ZeRO-Offload at stage 3 (the configuration ColossalAI's
// Gemini plugin does not support), params and slot-0 states equal the unsplit single rank
// at stage 1, bit for bit. Matrices split by rows and by columns, batches of matrices, rows
// that straddle blocks and DP cuts (tp_grid.hpp).

#include "layerwise_cases.hpp"
#include "zero_tp.hpp"

using namespace distopt;
using namespace harness;

BOOST_AUTO_TEST_SUITE(layerwise_at_every_stage_on_a_tp_grid)

BOOST_AUTO_TEST_CASE(lamb) { check_stages_on_the_grid<distopt::lamb>(tp_tensors(), {lamb_case()}, true); }
BOOST_AUTO_TEST_CASE(adafactor) {
  check_stages_on_the_grid<distopt::adafactor>(tp_tensors(), {adafactor_lr_beta1()}, true);
}
BOOST_AUTO_TEST_CASE(came) { check_stages_on_the_grid<distopt::came>(tp_tensors(), {came_case()}, true); }

BOOST_AUTO_TEST_SUITE_END()
