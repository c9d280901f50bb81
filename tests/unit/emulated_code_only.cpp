// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The element-wise cases of emulated_element_wise.hpp on device_code_only: the emulated
// device configured as distopt::cuda is (device code only, collectives staged through host
// memory), against the CPU executor's bits.

#include "emulated_harness.hpp"
#include "executor_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <tuple>

using namespace distopt;
using namespace harness;

// The optimizer takes only what runs on cuda: the element-wise phases.
static_assert(!runs_host_functions<device_code_only> && runs_host_functions<emulated_device>);

using element_wise_executors = std::tuple<device_code_only>;

BOOST_AUTO_TEST_SUITE(device_code_only_equals_cpu)

#include "emulated_element_wise.hpp"

BOOST_AUTO_TEST_CASE(adam_amsgrad_bf16_params_master_bf16_states_reduced_in_fp32) {
  run_options ro;
  ro.threads = 2;
  ro.clip = 2.0;
  ro.options.grad_reduce_in_fp32 = true;
  check_executor<device_code_only, adam, bf16, precision<bf16, bf16>>({cases::adam_amsgrad()}, ro, dtype::bf16);
}

BOOST_AUTO_TEST_SUITE_END()
