// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ctest `experts`, Muon and GaLore (with BLAS and LAPACK): each matrix whole on one rank of
// its data-parallel group (owned: the dense ones over dense DP, each expert's over
// expert-DP), the biases in Muon's AdamW group or a plain one, against one optimizer holding
// every expert (experts_harness.hpp).

#include "experts_harness.hpp"

#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/muon.hpp>

using namespace experts_test;

BOOST_AUTO_TEST_SUITE(experts)

BOOST_AUTO_TEST_CASE(muon_owned) { check_grids<distopt::muon, distopt::owned<distopt::fp32>>(); }

// GaLore projects whole matrices: TP 1 (a TP-split matrix is refused, naming it).
BOOST_AUTO_TEST_CASE(galore_owned) { check_grids<distopt::galore_adamw, distopt::owned<distopt::fp32>>({1}); }

BOOST_AUTO_TEST_SUITE_END()
