// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore and Muon with gradient accumulation (both schedules) and at ZeRO-2 and ZeRO-3,
// sharded and owned, d = 1..3 (1..8 at the stages) ranks as threads: each run equals one
// rank at stage 1 fed the global gradient its schedule forms, bit for bit. GaLore refreshes
// its projection every step and Muon orthogonalises every step, so a projection or a
// Newton-Schulz run per micro-batch (on a micro-batch's grads), or on another rank's part
// of the grads, would not give the unsplit run's bits.
#include "accumulate_harness.hpp"

#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/muon.hpp>

#include <string>

#include "galore_cases.hpp"
#include "muon_cases.hpp"

using namespace distopt;
using namespace acc;

namespace {

template <class Policy, class Storage>
using on_threads = optimizer<Policy, Storage, threads, cpu, precision<float>>;

/// Eight matrices of equal cost, six in one bucket of 512 elements: owned over d = 3 ranks
/// they are cut into runs of 3, 3 and 2 matrices, so that an owner's run starts inside a
/// bucket.
layout equal_small_matrices() {
  layout l;
  l.add("b0", {30}, dtype::f32, 0);
  for (int i = 0; i < 8; ++i) l.add("s" + std::to_string(i), {8, 12}, dtype::f32, 1);
  l.add("norm", {700}, dtype::f32, 0);
  l.add("w1", {17, 9}, dtype::f32, 1);
  return l;
}

/// Stages 2 and 3 of Storage (sharded or owned) on d ranks, one and four micro-batches,
/// both schedules, hooks on and off, against one rank at stage 1 (sharded<float>).
template <class Policy, template <class, int> class Storage>
void check_stages_2_and_3(const layout& l, const std::vector<typename Policy::hyper_params>& h, std::vector<int> ds) {
  using ref = on_threads<Policy, sharded<float>>;
  BOOST_TEST_CONTEXT("stage 2")
  check_schedules<on_threads<Policy, Storage<float, 2>>, ref>(l, h, {}, ds, false, {1, 4});
  BOOST_TEST_CONTEXT("stage 3")
  check_schedules<on_threads<Policy, Storage<float, 3>>, ref>(l, h, {}, ds, false, {1, 4});
}

}  // namespace

BOOST_AUTO_TEST_SUITE(accumulate_matrix)

BOOST_AUTO_TEST_CASE(galore_projects_the_accumulated_gradient_once_per_step) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::galore_groups(galore_proj::std_, 1);  // a new projection every step
  BOOST_TEST_CONTEXT("sharded")
  check_schedules<on_threads<galore_adamw, sharded<float>>>(l, h, {}, {1, 2, 3}, false, {1, 3});
  BOOST_TEST_CONTEXT("owned")
  check_schedules<on_threads<galore_adamw, owned<float>>>(l, h, {}, {2, 3}, false, {3});
}

BOOST_AUTO_TEST_CASE(muon_orthogonalises_the_accumulated_gradient_once_per_step) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::muon_groups();
  BOOST_TEST_CONTEXT("owned")
  check_schedules<on_threads<muon, owned<float>>>(l, h, {}, {1, 2, 3}, false, {1, 3});
}

BOOST_AUTO_TEST_CASE(galore_at_zero_2_and_3) {
  const auto h = harness::galore_groups(galore_proj::std_, 1);
  BOOST_TEST_CONTEXT("sharded")
  check_stages_2_and_3<galore_adamw, sharded>(harness::matrices_and_vectors(dtype::f32), h, {1, 2, 3});
  BOOST_TEST_CONTEXT("owned") check_stages_2_and_3<galore_adamw, owned>(equal_small_matrices(), h, {2, 3, 8});
}

BOOST_AUTO_TEST_CASE(muon_at_zero_2_and_3) {
  const auto h = harness::muon_groups();
  BOOST_TEST_CONTEXT("sharded") check_stages_2_and_3<muon, sharded>(harness::matrices_and_vectors(dtype::f32), h, {2, 3});
  BOOST_TEST_CONTEXT("owned") check_stages_2_and_3<muon, owned>(equal_small_matrices(), h, {1, 3, 8});
}

BOOST_AUTO_TEST_SUITE_END()
