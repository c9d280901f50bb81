// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The layer-wise policies through the Kokkos executor: Lamb's trust ratios and
// Adafactor's and CAME's row and column statistics, on layouts whose matrices straddle
// the shard cuts, give the CPU executor's bits on one rank and on d = 1..4 ranks.

#include "kokkos_harness.hpp"

#include <boost/test/unit_test.hpp>

using namespace distopt;
using namespace harness;

namespace {

std::vector<layout_case> matrix_layouts() {
  auto v = awkward_layouts();
  v.push_back({"straddle", {{33, 300}, {300, 9}, {5, 7, 40}, {513}, {2, 3}}, std::size_t{1} << 22});
  return v;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(kokkos_equals_cpu_layerwise)

BOOST_AUTO_TEST_CASE(lamb_trust_ratios) {
  distopt::lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  h.debias = true;
  h.clamp_value = 1.0;
  check_kokkos<distopt::lamb, fp32, precision<float>>({h}, run_options{}, dtype::f32, matrix_layouts());
}

BOOST_AUTO_TEST_CASE(adafactor_beta1_bf16_params_with_master) {
  adafactor::hyper_params h;
  h.lr = 1e-2;
  h.relative_step = false;
  h.scale_parameter = false;
  h.beta1 = 0.9;
  h.weight_decay = 0.01;
  h.clip_threshold = 0.5;
  check_kokkos<distopt::adafactor, fp32, precision<bf16, bf16>>({h}, run_options{}, dtype::bf16, matrix_layouts());
}

BOOST_AUTO_TEST_CASE(came_factored_statistics) {
  distopt::came::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  check_kokkos<distopt::came, fp32, precision<float>>({h}, run_options{}, dtype::f32, matrix_layouts());
}

BOOST_AUTO_TEST_SUITE_END()
