// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The sharded step over MPI ranks (run under mpiexec -n 2, 3, 4): with the rank-0 trick
// (rank 0 holds the global gradient, the others zeros, summed) every element-wise policy
// gives params bit-identical to one rank, and each rank's shard of the master weights and
// states equals the same elements of the single-rank run. MPI sums in its own order, but
// adding zeros is exact in any order, and the grad norm is an exact integer sum.

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

/// Compares this rank's run with the single-rank reference: params whole, master weights
/// and states on this rank's shard.
template <class Policy, class Enc, class Prec>
void check(const std::vector<typename Policy::hyper_params>& h, run_options ro, dtype t) {
  // fp32 master weights exist for bf16/fp16 params unless switched off.
  const bool with_master = t != dtype::f32 && ro.options.master_weights;
  std::size_t master_elements = 0;
  for (const layout_case& c : awkward_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    const outcome ref = run_single<Policy, Enc, Prec>(l, h, ro);
    using opt_t = optimizer<Policy, sharded<Enc>, mpi, cpu, Prec>;
    run_options mine = ro;
    mine.options.grad_reduce = reduce_op::sum;
    mpi comm(MPI_COMM_WORLD);
    const int rank = comm.rank();
    opt_t opt(l, h, mine.options, cpu(1), std::move(comm));
    outcome got = blank<opt_t>(l, Policy::state_slots(h.front()));
    drive(opt, rank, mine, &got);
    collect(opt, 0, got);  // every rank holds the gathered params
    BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " rank " << rank) {
      BOOST_TEST((got.params == ref.params));
      BOOST_TEST((got.skipped == ref.skipped));
      BOOST_TEST(std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0);
      for (std::size_t ti = 0; ti < l.tensors().size(); ++ti) {
        const auto& ts = l.tensors()[ti];
        if (with_master) {
          const auto m = opt.local_master(ts.name);
          master_elements += m.values.size();
          BOOST_TEST(std::memcmp(m.values.data(), ref.master[ti].data() + m.first * sizeof(float),
                                 m.values.size_bytes()) == 0,
                     "tensor " << ts.name << ": master weights differ on this rank's shard");
        }
        for (std::size_t k = 0; k < got.states.size(); ++k) {
          const auto st = opt.local_state(ts.name, static_cast<int>(k));
          BOOST_TEST(std::memcmp(got.states[k][ti].data() + st.first * sizeof(Enc),
                                 ref.states[k][ti].data() + st.first * sizeof(Enc), st.values.size_bytes()) == 0);
        }
      }
    }
  }
  // Every rank holds a shard of some tensor in every awkward layout: a master check that
  // compared nothing would be no check.
  if (with_master) BOOST_TEST(master_elements > 0u, Policy::name << ": no master weights compared");
}

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_sharded)

BOOST_AUTO_TEST_CASE(every_elementwise_policy) {
  sgd::hyper_params s;
  s.lr = 0.05;
  s.momentum = 0.9;
  s.nesterov = true;
  s.weight_decay = 0.01;
  adam::hyper_params a;
  a.lr = 1e-2;
  a.amsgrad = true;
  adamw::hyper_params w;
  w.lr = 1e-2;
  lion::hyper_params li;
  li.lr = 1e-3;
  li.weight_decay = 0.1;
  run_options clipped;
  clipped.clip = 1.0;
  check<sgd, fp32, precision<float>>({s}, {}, dtype::f32);
  check<adam, fp32, precision<float>>({a}, clipped, dtype::f32);
  check<adamw, bf16, precision<float>>({w}, clipped, dtype::f32);
  check<lion, fp32, precision<float>>({li}, {}, dtype::f32);
}

BOOST_AUTO_TEST_CASE(mixed_precision_options) {
  adamw::hyper_params w;
  w.lr = 1e-2;
  run_options master;
  master.clip = 2.0;
  master.nan_step = 4;
  master.nan_rank = 0;
  check<adamw, fp32, precision<bf16, bf16>>({w}, master, dtype::bf16);
  run_options sr;
  sr.options.master_weights = false;
  sr.options.seed = 3;
  check<adamw, fp32, precision<bf16, float>>({w}, sr, dtype::bf16);
  run_options fp32_reduce;
  fp32_reduce.options.grad_reduce_in_fp32 = true;
  check<adamw, bf16, precision<bf16, bf16>>({w}, fp32_reduce, dtype::bf16);
  run_options scaled;
  scaled.options.loss_scale = dynamic_loss_scale{};
  check<adam, fp32, precision<fp16, fp16>>({adam::hyper_params{}}, scaled, dtype::f16);
}

BOOST_AUTO_TEST_SUITE_END()
