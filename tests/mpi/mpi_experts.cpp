// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// joint_step between processes (run under mpiexec -n 4): the dense and expert optimizers of
// experts_harness.hpp's mixture of experts on every grid of 4 processes (TP 1 or 2, EP 1, 2
// or 4), against the reference run in this process with ranks as threads (one optimizer
// holding every expert on the TP ranks alone), bit for bit: params, slot-0 states, each
// step's norm and skips. Each element has one reader among the processes; their parts are
// summed as bit patterns to compare whole tensors.

#include "../unit/experts_harness.hpp"

#include <distopt/comm/mpi.hpp>

#include <cstdint>
#include <cstring>

namespace {

using namespace experts_test;

struct mpi_environment {
  distopt::mpi_session session;
};

/// Every process's parts of `v` (zeros elsewhere) into whole tensors on every process.
void combine(distopt::mpi& world, std::vector<std::vector<float>>& v) {
  for (auto& x : v) {
    std::vector<double> bits(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      std::uint32_t u;
      std::memcpy(&u, &x[i], sizeof u);
      bits[i] = static_cast<double>(u);
    }
    world.all_reduce(std::span<double>(bits), distopt::reduce_op::sum);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const auto u = static_cast<std::uint32_t>(bits[i]);
      std::memcpy(&x[i], &u, sizeof u);
    }
  }
}

template <class Policy, class Storage>
void check_processes() {
  using precision = distopt::precision<float>;
  distopt::mpi world(MPI_COMM_WORLD);
  const int n = world.size();
  for (int tp : {1, 2})
    for (int ep : {1, 2, 4}) {
      if (n % (tp * ep) != 0) continue;
      BOOST_TEST_CONTEXT("tp " << tp << ", ep " << ep << ", " << n << " processes") {
        const moe_result ref = run<Policy, Storage, precision>(tp, tp, std::nullopt);
        moe_result r = empty_result();
        std::mutex m;
        const std::vector<double> norms = run_rank<Policy, Storage, precision>(world, tp, ep, r, m);
        combine(world, r.params);
        combine(world, r.states);
        BOOST_TEST(ref.ranks_agree);
        BOOST_TEST(std::memcmp(norms.data(), ref.norms.data(), steps * sizeof(double)) == 0);
        if (world.rank() == 0) BOOST_TEST(r.skipped == ref.skipped, boost::test_tools::per_element());
        BOOST_TEST(same_bits(r.params, ref.params));
        BOOST_TEST(same_bits(r.states, ref.states));
      }
    }
}

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_experts)

BOOST_AUTO_TEST_CASE(adamw_fp32_sharded) { check_processes<distopt::adamw, distopt::sharded<distopt::fp32>>(); }

BOOST_AUTO_TEST_CASE(adafactor_zero2) { check_processes<distopt::adafactor, distopt::sharded<distopt::fp32, 2>>(); }

BOOST_AUTO_TEST_SUITE_END()
