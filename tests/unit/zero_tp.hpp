// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The check of zero_tp.cpp and zero_tp_galore.cpp: a policy on the TP 2 x DP 2 grid at
// ZeRO-2 and ZeRO-3 with the hooks, and under ZeRO-Offload, equals the unsplit single
// rank at stage 1 without hooks, bit for bit.
#pragma once

#include "tp_grid.hpp"

#include <distopt/offload.hpp>

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <vector>

namespace harness {

/// Params (and with `states`, slot-0 states) of every tensor of `xs`: the grid at `Storage`
/// with the hooks on executor Exec against the single rank.
template <class Policy, class Storage, class Exec = distopt::cpu>
void check_grid_at(const std::vector<tp_tensor>& xs, const std::vector<typename Policy::hyper_params>& h,
                   const std::vector<std::vector<float>>& ref, const std::vector<std::vector<float>>* ref_states) {
  std::vector<std::vector<float>> states;
  const auto got =
      run_grid<Policy, Storage, Exec>(xs, h, {.dp = 2, .tp = 2, .steps = 12, .hooks = true}, ref_states ? &states : nullptr);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    BOOST_TEST_CONTEXT("tensor t" << i) {
      BOOST_TEST(std::memcmp(got[i].data(), ref[i].data(), ref[i].size() * sizeof(float)) == 0);
      if (ref_states)
        BOOST_TEST(std::memcmp(states[i].data(), (*ref_states)[i].data(), ref[i].size() * sizeof(float)) == 0);
      BOOST_TEST(ref[i][0] != init_value(i, 0));  // not vacuous: the params moved
    }
  }
}

/// Stages 2 and 3 on cpu, and offload at stage 3 (params and grads in the emulated
/// device's memory, states on the host), against the single rank at stage 1.
template <class Policy, template <class, int> class Storage = distopt::sharded>
void check_stages_on_the_grid(const std::vector<tp_tensor>& xs, const std::vector<typename Policy::hyper_params>& h,
                              bool with_states) {
  using distopt::fp32;
  std::vector<std::vector<float>> ref_states;
  const auto ref = run_grid<Policy>(xs, h, {.steps = 12}, with_states ? &ref_states : nullptr);
  const auto* rs = with_states ? &ref_states : nullptr;
  BOOST_TEST_CONTEXT(Policy::name << " ZeRO-2") check_grid_at<Policy, Storage<fp32, 2>>(xs, h, ref, rs);
  BOOST_TEST_CONTEXT(Policy::name << " ZeRO-3") check_grid_at<Policy, Storage<fp32, 3>>(xs, h, ref, rs);
  BOOST_TEST_CONTEXT(Policy::name << " ZeRO-3 offload")
  check_grid_at<Policy, Storage<fp32, 3>, distopt::offload<distopt::emulated_device>>(xs, h, ref, rs);
}

}  // namespace harness
