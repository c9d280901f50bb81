// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Gradient accumulation with GaLore and Muon (accumulation::reduce_last), sharded and owned,
// d = 1..3 ranks as threads: each run equals one rank fed the accumulated global gradient,
// bit for bit. GaLore refreshes its projection every step and Muon orthogonalises every
// step, so a projection or a Newton-Schulz run per micro-batch (on a micro-batch's grads)
// would not give the unsplit run's bits. reduce_each is refused for both.
#include "accumulate_harness.hpp"

#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/muon.hpp>

#include <stdexcept>

#include "galore_cases.hpp"
#include "muon_cases.hpp"

using namespace distopt;
using namespace acc;

namespace {

template <class Policy, class Storage>
using on_threads = optimizer<Policy, Storage, threads, cpu, precision<float>>;

const std::vector<accumulation> last_only{accumulation::reduce_last};

}  // namespace

BOOST_AUTO_TEST_SUITE(accumulate_matrix)

BOOST_AUTO_TEST_CASE(galore_projects_the_accumulated_gradient_once_per_step) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::galore_groups(galore_proj::std_, 1);  // a new projection every step
  BOOST_TEST_CONTEXT("sharded")
  check_schedules<on_threads<galore_adamw, sharded<float>>>(l, h, {}, {1, 2, 3}, false, {1, 3}, last_only);
  BOOST_TEST_CONTEXT("owned")
  check_schedules<on_threads<galore_adamw, owned<float>>>(l, h, {}, {2, 3}, false, {3}, last_only);
}

BOOST_AUTO_TEST_CASE(muon_orthogonalises_the_accumulated_gradient_once_per_step) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::muon_groups();
  BOOST_TEST_CONTEXT("owned")
  check_schedules<on_threads<muon, owned<float>>>(l, h, {}, {1, 2, 3}, false, {1, 3}, last_only);
}

BOOST_AUTO_TEST_CASE(reduce_each_is_refused) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  optimizer_options o;
  o.micro_batches = 2;
  o.accumulate = accumulation::reduce_each;
  const auto says = [](const std::invalid_argument& e) {
    BOOST_TEST_MESSAGE(e.what());
    return std::string(e.what()).find("accumulation::reduce_each is not built for GaLore and Muon") != std::string::npos;
  };
  run_ranks(1, [&](threads& comm) {
    BOOST_CHECK_EXCEPTION((on_threads<muon, owned<float>>(l, harness::muon_groups(), o, cpu(1), std::move(comm))),
                          std::invalid_argument, says);
  });
  run_ranks(1, [&](threads& comm) {
    BOOST_CHECK_EXCEPTION(
        (on_threads<galore_adamw, sharded<float>>(l, harness::galore_groups(), o, cpu(1), std::move(comm))),
        std::invalid_argument, says);
  });
}

BOOST_AUTO_TEST_SUITE_END()
