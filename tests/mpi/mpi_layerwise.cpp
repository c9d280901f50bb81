// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Layer-wise policies over MPI ranks (run under mpiexec -n 2, 3, 4): with the rank-0 trick,
// 100 steps of Lamb, Adafactor and CAME give params bit-identical to one rank, each rank's
// shard of every state slot equals the same elements of the single-rank run, and every
// rank holding part of a factored tensor keeps row and column states equal to the single
// rank's. The statistics are exact integer sums, so MPI's reduction order cannot show.

#include "../unit/sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mpi.hpp>

#include <cstring>

namespace {

using namespace distopt;
using namespace harness;

struct mpi_environment {
  mpi_session session;
};

template <class Opt>
std::vector<std::vector<float>> factors(const Opt& opt) {
  using P = typename Opt::policy_type;
  std::vector<std::vector<float>> f;
  for (const auto& t : opt.tensors().tensors()) {
    for (int k = 0; k < P::row_states; ++k) {
      const auto s = opt.row_state(t.name, k);
      f.emplace_back(s.begin(), s.end());
    }
    for (int k = 0; k < P::col_states; ++k) {
      const auto s = opt.col_state(t.name, k);
      f.emplace_back(s.begin(), s.end());
    }
  }
  return f;
}

template <class Policy>
void check(const typename Policy::hyper_params& h) {
  auto layouts = awkward_layouts();
  layouts.push_back({"straddle", {{33, 300}, {300, 9}, {5, 7, 40}, {513}, {2, 3}}, std::size_t{1} << 22});
  run_options ro;
  ro.steps = 100;
  const std::vector<typename Policy::hyper_params> hs{h};
  for (const layout_case& c : layouts) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::f32);
    using single_t = optimizer<Policy, replicated<fp32>, single>;
    single_t ref_opt(l, hs, ro.options);
    outcome ref = blank<single_t>(l, Policy::state_slots(h));
    drive(ref_opt, 0, ro, &ref);
    collect(ref_opt, 0, ref);
    const auto ref_f = factors(ref_opt);

    using opt_t = optimizer<Policy, sharded<fp32>, mpi>;
    run_options mine = ro;
    mine.options.grad_reduce = reduce_op::sum;
    mpi comm(MPI_COMM_WORLD);
    const int rank = comm.rank();
    opt_t opt(l, hs, mine.options, cpu(1), std::move(comm));
    outcome got = blank<opt_t>(l, Policy::state_slots(h));
    drive(opt, rank, mine, &got);
    collect(opt, 0, got);  // every rank holds the gathered params
    BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " rank " << rank) {
      BOOST_TEST((got.params == ref.params));
      for (std::size_t ti = 0; ti < l.tensors().size(); ++ti) {
        const auto& ts = l.tensors()[ti];
        for (std::size_t k = 0; k < got.states.size(); ++k) {
          const auto st = opt.local_state(ts.name, static_cast<int>(k));
          BOOST_TEST(std::memcmp(got.states[k][ti].data() + st.first * sizeof(float),
                                 ref.states[k][ti].data() + st.first * sizeof(float), st.values.size_bytes()) == 0);
        }
      }
      const auto f = factors(opt);
      for (std::size_t i = 0; i < f.size(); ++i)
        if (!f[i].empty()) BOOST_TEST((f[i] == ref_f[i]), "factored state " << i);
    }
  }
}

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_layerwise)

BOOST_AUTO_TEST_CASE(lamb_100_steps) {
  lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  h.clamp_value = 1.0;
  check<lamb>(h);
}

BOOST_AUTO_TEST_CASE(adafactor_100_steps) {
  check<adafactor>(adafactor::hyper_params{});
  adafactor::hyper_params h;
  h.lr = 1e-2;
  h.relative_step = false;
  h.beta1 = 0.9;
  h.weight_decay = 0.01;
  check<adafactor>(h);
}

BOOST_AUTO_TEST_CASE(came_100_steps) {
  came::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  check<came>(h);
}

BOOST_AUTO_TEST_SUITE_END()
