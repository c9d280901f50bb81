// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Runs one optimizer configuration through the CPU executor and through another executor
// (Kokkos, the emulated device: one rank, and d ranks as threads with sharded state) and
// checks that everything it leaves is bit-identical.
#pragma once

#include "sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <vector>

namespace harness {

/// The CPU executor's single-rank run is the reference (the sharded suites check it
/// against the CPU executor on d ranks and any thread count, and policies.cpp against float64).
inline void check_same(const outcome& got, const outcome& ref) {
  BOOST_TEST((got.params == ref.params));
  BOOST_TEST((got.master == ref.master));
  BOOST_TEST((got.states == ref.states));
  BOOST_TEST((got.absmax == ref.absmax));
  BOOST_TEST((got.decoded == ref.decoded));
  BOOST_TEST((got.skipped == ref.skipped));
  BOOST_TEST(got.norms.size() == ref.norms.size());
  if (got.norms.size() == ref.norms.size())  // NaN != NaN: compare the bits
    BOOST_TEST(std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0);
}

/// On each layout: the CPU executor's single-rank run against executor `Exec` on one
/// rank and on d = 1..max_d ranks as threads (sharded `Enc` states, sum reduction).
template <class Exec, class Policy, class Enc, class Prec>
void check_executor(const std::vector<typename Policy::hyper_params>& h, run_options ro, dtype t = dtype::f32,
                    std::vector<layout_case> layouts = awkward_layouts(), int max_d = 4) {
  using exec = Exec;
  for (const layout_case& c : layouts) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    const outcome ref = run_single<Policy, Enc, Prec, cpu>(l, h, ro);
    BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " one rank") {
      check_same(run_single<Policy, Enc, Prec, exec>(l, h, ro), ref);
    }
    for (int d = 1; d <= max_d; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        check_same(run_threads<Policy, sharded<Enc>, Prec, exec>(d, l, h, ro), ref);
      }
    }
  }
}

/// Cases that every executor is held to (kokkos.cpp, emulated.cpp).
namespace cases {
/// Two SGD groups: momentum with dampening and weight decay, and Nesterov.
inline std::vector<sgd::hyper_params> sgd_momentum_and_nesterov() {
  sgd::hyper_params m;
  m.lr = 0.05;
  m.momentum = 0.9;
  m.dampening = 0.1;
  m.weight_decay = 0.01;
  sgd::hyper_params n;
  n.lr = 0.05;
  n.momentum = 0.8;
  n.nesterov = true;
  return {m, n};
}
inline adam::hyper_params adam_amsgrad() {
  adam::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.amsgrad = true;
  return h;
}
inline lion::hyper_params lion_decayed() {
  lion::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.1;
  return h;
}
/// bf16 params without master weights: stochastic rounding, seeded.
inline run_options stochastic_rounding() {
  run_options ro;
  ro.options.master_weights = false;
  ro.options.seed = 7;
  return ro;
}
/// q8 states on the larger tensors, fp32 on the smaller, with global and percentile clipping.
inline run_options q8_percentile_clipping() {
  run_options ro;
  ro.steps = 30;
  ro.clip = 1.0;
  ro.options.min_8bit_size = 256;
  ro.options.percentile_clipping = 5;
  return ro;
}
/// fp16 params and grads with dynamic loss scaling and one overflow (a skipped step).
inline run_options fp16_loss_scaling() {
  run_options ro;
  ro.options.loss_scale = dynamic_loss_scale{};
  ro.nan_step = 3;
  return ro;
}
}  // namespace cases

}  // namespace harness
