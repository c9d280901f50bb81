// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ZeRO stages 2 and 3 with the overlap hooks over MPI processes (mpiexec -n 2, 3, 4): the
// training loop of zero_harness.hpp (grads that depend on the gathered params, backward
// in shuffled layer orders, each layer declared ready as it is written), with the rank-0
// trick (rank 0 writes the global gradient, the others zeros: exact in MPI's order),
// gives every rank the params of the single-rank run bit for bit, and each rank's shard of
// the states equals the same elements of that run. ZeRO-Offload too.

#include "../unit/zero_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mpi.hpp>
#include <distopt/offload.hpp>

#include <cstring>

namespace {

using namespace distopt;
using namespace harness;

struct mpi_environment {
  mpi_session session;
};

template <class Storage, class Prec, class Exec = cpu>
void check(const adamw::hyper_params& h, hook_run hr, dtype t) {
  using one_t = optimizer<adamw, sharded<float>, single, cpu, Prec>;
  using opt_t = optimizer<adamw, Storage, mpi, Exec, Prec>;
  hr.rank0_only = true;
  hr.options.grad_reduce = reduce_op::sum;
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t);
    one_t one(l, {h}, hr.options, cpu(1));
    outcome ref = blank<one_t>(l, 2);
    drive_hooks(one, 0, 1, hr, &ref);
    collect_all(one, 0, ref);
    mpi comm(MPI_COMM_WORLD);
    const int rank = comm.rank(), d = comm.size();
    opt_t opt(l, {h}, hr.options, make_executor<Exec>(1), std::move(comm));
    outcome got = blank<opt_t>(l, 2);
    drive_hooks(opt, rank, d, hr, &got);
    collect_all(opt, 0, got);  // the params in full on every rank (gathered); states: this rank's shard
    BOOST_TEST_CONTEXT("stage " << opt_t::zero_stage << " layout " << c.name << " rank " << rank) {
      BOOST_TEST((got.params == ref.params));
      BOOST_TEST((got.skipped == ref.skipped));
      BOOST_TEST(std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0);
      for (std::size_t ti = 0; ti < l.tensors().size(); ++ti)
        for (int k = 0; k < 2; ++k) {
          const auto st = opt.local_state(l.tensors()[ti].name, k);
          BOOST_TEST(std::memcmp(got.states[static_cast<std::size_t>(k)][ti].data() + st.first * sizeof(float),
                                 ref.states[static_cast<std::size_t>(k)][ti].data() + st.first * sizeof(float),
                                 st.values.size_bytes()) == 0);
        }
    }
  }
}

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_zero)

BOOST_AUTO_TEST_CASE(stage_2_fp32_with_clipping_and_a_nan_step) {
  hook_run hr;
  hr.hooks = true;
  hr.layer = 2;
  hr.nan_step = 4;
  hr.options.max_grad_norm = 1.0;
  check<sharded<float, 2>, precision<float>>(adamw_decayed(), hr, dtype::f32);
}

BOOST_AUTO_TEST_CASE(stage_3_bf16_master_weights) {
  hook_run hr;
  hr.hooks = true;
  hr.options.check_hook_order = true;  // the ranks' gathers and reductions agree: the check passes
  check<sharded<float, 3>, precision<bf16>>(adamw_decayed(), hr, dtype::bf16);
}

#if defined(__linux__)  // the emulated device (mmap)
// ZeRO-Offload (params and grads on the emulated device, states on the host) at stage 2:
// the same bits as one rank on cpu.
BOOST_AUTO_TEST_CASE(offload_stage_2_bf16_master_weights) {
  hook_run hr;
  hr.hooks = true;
  hr.layer = 2;
  hr.options.max_grad_norm = 1.0;
  check<sharded<float, 2>, precision<bf16>, offload<emulated_device>>(adamw_decayed(), hr, dtype::bf16);
}
#endif

// With check_hook_order, a rank that completes its buckets in another order is stopped
// before the mismatched reduce-scatter: every process throws, naming each rank's tensor.
BOOST_AUTO_TEST_CASE(hooks_in_different_orders_are_named) {
  layout l;
  l.add("w0", {300}, dtype::f32);
  l.add("w1", {700}, dtype::f32);
  l.add("w2", {500}, dtype::f32);
  optimizer_options o;
  o.bucket_elems = 256;  // a bucket per tensor
  o.check_hook_order = true;
  mpi comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  optimizer<adamw, sharded<float, 2>, mpi, cpu, precision<float>> opt(l, adamw_decayed(), o, cpu(1), std::move(comm));
  opt.grads_ready("w2");
  std::string what;
  try {
    opt.grads_ready(rank == 1 ? "w0" : "w1");
  } catch (const std::logic_error& e) {
    what = e.what();
  }
  BOOST_TEST_CONTEXT("rank " << rank << ": " << what) {
    BOOST_TEST(what.find("rank 0 (grads_ready) reduces the grads of 'w1', rank 1 (grads_ready) reduces the grads of 'w0'") != std::string::npos);
  }
}

BOOST_AUTO_TEST_SUITE_END()
