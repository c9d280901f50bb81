// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ctest `experts`, Muon (with BLAS): each matrix whole on one rank of its data-parallel group
// (owned: the dense ones over dense DP, each expert's over expert-DP), the biases in Muon's
// AdamW group, against one optimizer holding every expert (experts_harness.hpp).

#include "experts_harness.hpp"

#include <distopt/policy/muon.hpp>

using namespace experts_test;

BOOST_AUTO_TEST_SUITE(experts)

BOOST_AUTO_TEST_CASE(muon_owned) { check_grids<distopt::muon, distopt::owned<distopt::fp32>>(); }

BOOST_AUTO_TEST_SUITE_END()
