// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The element-wise cases (fp32, bf16 and q8 states; one rank and d = 1..4 ranks) that run
// on both emulated executors, each included by the file of one executor (emulated.cpp,
// emulated_code_only.cpp) after it names `element_wise_executors`: two translation units
// that build side by side, and each case's instantiations once per executor. The including
// file has `using namespace distopt;` and `using namespace harness;` in effect.
#pragma once

#include "executor_harness.hpp"

#include <boost/test/unit_test.hpp>

BOOST_AUTO_TEST_CASE_TEMPLATE(sgd_momentum_and_nesterov, Exec, element_wise_executors) {
  check_executor<Exec, sgd, fp32, precision<float>>(cases::sgd_momentum_and_nesterov(), run_options{});
}

BOOST_AUTO_TEST_CASE_TEMPLATE(adamw_clipped_with_percentile_clipping, Exec, element_wise_executors) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.clip = 1.0;
  ro.options.percentile_clipping = 5;
  check_executor<Exec, adamw, fp32, precision<float>>({h}, ro);
}

// Clipped inside the step (optimizer_options::max_grad_norm): decided on the device.
BOOST_AUTO_TEST_CASE_TEMPLATE(adamw_clipped_inside_the_step, Exec, element_wise_executors) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.options.max_grad_norm = 1.0;
  check_executor<Exec, adamw, fp32, precision<float>>({h}, ro);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(lion_bf16_stochastic_rounding, Exec, element_wise_executors) {
  check_executor<Exec, lion, fp32, precision<bf16, float>>({cases::lion_decayed()}, cases::stochastic_rounding(),
                                                           dtype::bf16);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(q8_adamw_with_percentile_clipping, Exec, element_wise_executors) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  check_executor<Exec, adamw, q8, precision<float>>({h}, cases::q8_percentile_clipping());
}

// bf16 params with stochastic rounding and q8 states: the random key of the step decided
// on the device reaches the 8-bit tensors and those below min_8bit_size (fp32 states).
BOOST_AUTO_TEST_CASE_TEMPLATE(q8_adamw_bf16_stochastic_rounding, Exec, element_wise_executors) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro = cases::stochastic_rounding();
  ro.options.min_8bit_size = 256;
  check_executor<Exec, adamw, q8, precision<bf16, bf16>>({h}, ro, dtype::bf16);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(q8_lion_bf16_params_with_master, Exec, element_wise_executors) {
  lion::hyper_params h;
  h.lr = 1e-3;
  run_options ro;
  ro.options.min_8bit_size = 256;
  check_executor<Exec, lion, q8, precision<bf16, bf16>>({h}, ro, dtype::bf16);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(adam_fp16_dynamic_loss_scaling, Exec, element_wise_executors) {
  check_executor<Exec, adam, fp32, precision<fp16, fp16>>({adam::hyper_params{}}, cases::fp16_loss_scaling(),
                                                          dtype::f16);
}

// Replicated states over d ranks, bf16 grads reduced in fp32: the all-reduced fp32 bucket
// must reach the fp32 grads the update reads (staged through host memory on
// device_code_only, in place on the emulated device).
BOOST_AUTO_TEST_CASE_TEMPLATE(replicated_bf16_grads_reduced_in_fp32_over_ranks, Exec, element_wise_executors) {
  run_options ro;
  ro.clip = 1.0;
  check_replicated_bf16_reduced_in_fp32<Exec>(ro);
}
