// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The layer-wise policies on the emulated device: Lamb's trust ratios and Adafactor's and
// CAME's row and column statistics, on layouts whose matrices straddle the shard cuts,
// give the CPU executor's bits on one rank and on d = 1..4 ranks. Their params, grads,
// master weights and element states sit in device memory, and the element passes are
// launches of the layer-wise phase body (one work item per call, its sums in device
// memory); the host merges the sums and keeps the row and column states. The last case
// runs on the emulated device configured as distopt::cuda is (device code only).

#include "emulated_harness.hpp"
#include "executor_harness.hpp"
#include "layerwise_cases.hpp"

#include <boost/test/unit_test.hpp>

using namespace distopt;
using namespace harness;

namespace {
/// The layer-wise layouts, and matrices of more than one piece (16 Ki elements) with more
/// rows than a device work item's minimum: several items per tensor on a device, cut
/// mid-row (600 x 40) and across matrices (3 x 300 x 40).
std::vector<layout_case> device_item_layouts() {
  auto v = layerwise_layouts();
  v.push_back({"tall", {{600, 40}, {3, 300, 40}, {17}}, std::size_t{1} << 22});
  return v;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(emulated_equals_cpu_layerwise)

BOOST_AUTO_TEST_CASE(lamb_trust_ratios) {
  check_executor<emulated_device, distopt::lamb, fp32, precision<float>>({lamb_case()}, run_options{}, dtype::f32,
                                                                         layerwise_layouts());
}

BOOST_AUTO_TEST_CASE(adafactor_beta1_bf16_params_with_master) {
  check_executor<emulated_device, distopt::adafactor, fp32, precision<bf16, bf16>>(
      {adafactor_lr_beta1()}, run_options{}, dtype::bf16, device_item_layouts());
}

BOOST_AUTO_TEST_CASE(came_factored_statistics_bf16_states) {
  check_executor<emulated_device, distopt::came, bf16, precision<float>>({came_case()}, run_options{}, dtype::f32,
                                                                         layerwise_layouts());
}

BOOST_AUTO_TEST_CASE(came_on_device_code_only_bf16_params_with_master) {
  check_executor<device_code_only, distopt::came, fp32, precision<bf16, bf16>>({came_case()}, run_options{}, dtype::bf16,
                                                                               device_item_layouts());
}

BOOST_AUTO_TEST_SUITE_END()
