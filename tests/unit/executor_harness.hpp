// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Runs one optimizer configuration through the CPU executor and through another executor
// (Kokkos, the emulated device: one rank, and d ranks as threads with sharded state) and
// checks that everything it leaves is bit-identical.
#pragma once

#include "sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <type_traits>
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
/// rank and on d = 1..max_d ranks as threads (sharded `Enc` states, sum reduction), their
/// communicator `Comm` made from each rank's `threads` handle. With a Comm other than
/// `threads` (device_threads), only the ranks' runs: the one-rank run is Exec's own.
template <class Exec, class Policy, class Enc, class Prec, class Comm = threads>
void check_executor(const std::vector<typename Policy::hyper_params>& h, run_options ro, dtype t = dtype::f32,
                    std::vector<layout_case> layouts = awkward_layouts(), int max_d = 4) {
  using exec = Exec;
  // Under a sanitizer 6 steps (the emulated suite's cases ran 80 s under TSan at 20), when
  // no step is singled out.
  if (ro.nan_step < 0) ro.steps = sanitized_steps(ro.steps, 6);
  for (const layout_case& c : layouts) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    const outcome ref = run_single<Policy, Enc, Prec, cpu>(l, h, ro);
    if constexpr (std::is_same_v<Comm, threads>) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " one rank") {
        check_same(run_single<Policy, Enc, Prec, exec>(l, h, ro), ref);
      }
    }
    for (int d = 1; d <= max_d; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        check_same(run_threads<Policy, sharded<Enc>, Prec, exec, Comm>(d, l, h, ro), ref);
      }
    }
  }
}

/// Replicated AdamW states over d = 2 and 3 ranks, bf16 params and grads with fp32 master
/// weights, the grads all-reduced in fp32 on an awkward layout of several buckets (`ro`
/// says how the step clips): executor `Exec` with `Comm` against the CPU's one-rank run.
/// The all-reduced fp32 bucket must reach the fp32 grads the update reads.
template <class Exec, class Comm = threads>
void check_replicated_bf16_reduced_in_fp32(run_options ro) {
  const layout_case c = awkward_layouts()[3];  // several buckets
  const layout l = make_layout(c, dtype::bf16);
  adamw::hyper_params h;
  h.lr = 1e-2;
  ro.options.grad_reduce_in_fp32 = true;
  ro.options.bucket_elems = c.bucket;
  const outcome ref = run_single<adamw, fp32, precision<bf16, bf16>>(l, {h}, ro);
  for (int d : {2, 3})
    BOOST_TEST_CONTEXT("d=" << d) {
      check_same(run_threads<adamw, replicated<fp32>, precision<bf16, bf16>, Exec, Comm>(d, l, {h}, ro), ref);
    }
}
}  // namespace harness
