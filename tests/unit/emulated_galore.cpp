// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore-AdamW on the emulated device: the projected matrices' grads, low-rank states,
// projections and work buffers sit in device memory, the scaling, the low-rank Adam and
// the update run as phases, the products and the SVD through matrix_ops (the host's BLAS
// and LAPACK inside an access scope, as cuBLAS and cuSOLVER on cuda). Params, element
// states, low-rank states and projections equal the CPU executor's bit for bit, across
// refreshes, for each projection side, with master weights and with stochastic rounding,
// on one rank and on d = 1..3 ranks as threads, on the device configured as distopt::cuda
// is (device code only: collectives staged through host memory).

#include "emulated_harness.hpp"
#include "executor_harness.hpp"
#include "galore_cases.hpp"
#include "muon_cases.hpp"
#include "sharded_harness.hpp"

#include <distopt/distopt.hpp>
#include <distopt/policy/galore_adamw.hpp>

#include <boost/test/unit_test.hpp>

#include <string>
#include <vector>

using namespace distopt;

// The emulated device configured as cuda takes GaLore's matrix operations as the emulated
// device does (cuda's are exec/cuda/matrix_ops.cuh's).
template <>
struct distopt::detail::matrix_ops<harness::device_code_only> : distopt::detail::matrix_ops<emulated_device> {};

namespace {

const char* const matrices[] = {"w0", "w1", "w2", "w3"};

struct result {
  harness::outcome out;
  std::vector<std::vector<float>> projected;  // [matrix * 2 + slot]
  std::vector<std::vector<float>> factors;    // [matrix * 2 + left/right]
};

template <class Opt>
void collect_matrices(const Opt& opt, result& r) {
  for (const char* name : matrices) {
    for (int k = 0; k < 2; ++k) r.projected.push_back(opt.projected_state(name, k));
    const auto& p = opt.projector(name);
    r.factors.emplace_back(p.left().begin(), p.left().end());
    r.factors.emplace_back(p.right().begin(), p.right().end());
  }
}

template <class Prec, class Exec>
result run_single(galore_proj type, optimizer_options o, Exec exec) {
  const layout l = harness::matrices_and_vectors(dtype_of<typename Prec::param_type>);
  optimizer<galore_adamw, replicated<fp32>, single, Exec, Prec> opt(l, harness::galore_groups(type), o, std::move(exec));
  result r;
  r.out = harness::blank<decltype(opt)>(l, 2);
  harness::drive(opt, 0, harness::run_options{}, &r.out);
  harness::collect(opt, 0, r.out);
  collect_matrices(opt, r);
  return r;
}

/// d ranks as threads, sharded fp32 states, several buckets: each matrix's low-rank states
/// and projection as the lowest rank holding part of it has them.
template <class Prec, class Exec>
result run_ranks_on(int d, galore_proj type) {
  using opt_t = optimizer<galore_adamw, sharded<fp32>, threads, Exec, Prec>;
  const layout l = harness::matrices_and_vectors(dtype_of<typename Prec::param_type>);
  optimizer_options o;
  o.grad_reduce = reduce_op::sum;
  o.bucket_elems = 1024;
  result r;
  r.out = harness::blank<opt_t>(l, 2);
  std::vector<result> per(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, harness::galore_groups(type), o, Exec(1), std::move(comm));
    harness::drive(opt, rank, harness::run_options{}, rank == 0 ? &r.out : nullptr);
    harness::collect(opt, rank, r.out);
    collect_matrices(opt, per[static_cast<std::size_t>(rank)]);
  });
  for (std::size_t j = 0; j < 2 * std::size(matrices); ++j) {
    std::size_t held = 0;
    while (held + 1 < per.size() && per[held].projected[j].empty()) ++held;
    r.projected.push_back(per[held].projected[j]);
    r.factors.push_back(per[held].factors[j]);
  }
  return r;
}

void check_same(const result& got, const result& ref) {
  harness::check_same(got.out, ref.out);
  BOOST_TEST((got.projected == ref.projected));
  BOOST_TEST((got.factors == ref.factors));
}

}  // namespace

BOOST_AUTO_TEST_SUITE(emulated_equals_cpu_galore)

BOOST_AUTO_TEST_CASE(each_side_fp32_one_rank) {
  for (const galore_proj type : {galore_proj::std_, galore_proj::reverse_std, galore_proj::full}) {
    BOOST_TEST_CONTEXT("proj " << galore_proj_name(type)) {
      const result ref = run_single<precision<float>>(type, {}, cpu(1));
      for (std::size_t j = 0; j < std::size(matrices); ++j)  // a projection on one side or both
        BOOST_TEST_REQUIRE(ref.factors[2 * j].size() + ref.factors[2 * j + 1].size() > 0u);
      check_same(run_single<precision<float>>(type, {}, emulated_device(1)), ref);
      check_same(run_single<precision<float>>(type, {}, emulated_device(2)), ref);
    }
  }
}

BOOST_AUTO_TEST_CASE(bf16_params_master_and_stochastic_rounding) {
  const result master = run_single<precision<bf16>>(galore_proj::std_, {}, cpu(1));
  check_same(run_single<precision<bf16>>(galore_proj::std_, {}, emulated_device(2)), master);
  optimizer_options sr;
  sr.master_weights = false;  // bf16 params updated with stochastic rounding
  const result rounded = run_single<precision<bf16>>(galore_proj::full, sr, cpu(1));
  BOOST_TEST(!(rounded.out.params == master.out.params));
  check_same(run_single<precision<bf16>>(galore_proj::full, sr, emulated_device(1)), rounded);
}

BOOST_AUTO_TEST_CASE(ranks_as_threads_device_code_only) {
  for (const galore_proj type : {galore_proj::std_, galore_proj::full}) {
    const result ref = run_single<precision<float>>(type, {}, cpu(1));
    for (int d = 1; d <= 3; ++d)
      BOOST_TEST_CONTEXT("proj " << galore_proj_name(type) << ", d = " << d) {
        check_same(run_ranks_on<precision<float>, harness::device_code_only>(d, type), ref);
      }
  }
  BOOST_TEST_CONTEXT("emulated_device, d = 2") {
    check_same(run_ranks_on<precision<float>, emulated_device>(2, galore_proj::std_),
               run_single<precision<float>>(galore_proj::std_, {}, cpu(1)));
  }
}

BOOST_AUTO_TEST_SUITE_END()
