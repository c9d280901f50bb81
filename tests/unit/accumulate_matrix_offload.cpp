// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore and Muon with gradient accumulation under ZeRO-Offload (params and grads in the
// emulated device's memory, the step on the host; stages 1 and 3, sharded and owned), and
// GaLore with bf16 grads reduced in fp32 (grad_reduce_in_fp32; sharded at stage 1, whose
// gather of the fp32 shard is stage 2's too, and owned at stage 3): each run equals one
// rank at stage 1 on cpu fed the global gradient its schedule forms, bit for bit
// (accumulate_harness.hpp). Both refresh their projection or orthogonalise every step, so a
// projection of a micro-batch's grads, or of the grads before the last copy from the
// device, would not give its bits.
#include "accumulate_harness.hpp"

#include <distopt/offload.hpp>
#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/muon.hpp>

#include "galore_cases.hpp"
#include "muon_cases.hpp"

using namespace distopt;
using namespace acc;

namespace {

template <class Policy, class Storage, class Exec = cpu, class Prec = precision<float>>
using on_threads = optimizer<Policy, Storage, threads, Exec, Prec>;
using dev = offload<emulated_device>;

}  // namespace

BOOST_AUTO_TEST_SUITE(accumulate_matrix_offload)

BOOST_AUTO_TEST_CASE(galore_under_offload_at_zero_1_and_3) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::galore_groups(galore_proj::std_, 1);  // a new projection every step
  using ref = on_threads<galore_adamw, sharded<float>>;
  BOOST_TEST_CONTEXT("sharded, stage 1")
  check_schedules<on_threads<galore_adamw, sharded<float>, dev>, ref>(l, h, {}, {1, 3}, false, {1, 4});
  BOOST_TEST_CONTEXT("owned, stage 3")
  check_schedules<on_threads<galore_adamw, owned<float, 3>, dev>, ref>(l, h, {}, {2, 3}, false, {1, 4});
}

BOOST_AUTO_TEST_CASE(muon_under_offload_at_zero_1_and_3) {
  const layout l = harness::matrices_and_vectors(dtype::f32);
  const auto h = harness::muon_groups();
  using ref = on_threads<muon, sharded<float>>;
  BOOST_TEST_CONTEXT("owned, stage 1")
  check_schedules<on_threads<muon, owned<float>, dev>, ref>(l, h, {}, {1, 3}, false, {1, 4});
  BOOST_TEST_CONTEXT("sharded, stage 3")
  check_schedules<on_threads<muon, sharded<float, 3>, dev>, ref>(l, h, {}, {2, 3}, false, {1, 4});
}

// bf16 params (fp32 master weights) and bf16 grads reduced in fp32: the projection reads this
// rank's fp32 shard (gathered when sharded) instead of the bf16 grads. The parts are exact
// (small multiples of 2^-16, their sums too in bf16 and fp32), so every order of the sums
// gives one global gradient: that of one rank fed it as fp32 grads.
BOOST_AUTO_TEST_CASE(galore_reduces_bf16_grads_in_fp32_sharded_and_owned) {
  const layout l = harness::matrices_and_vectors(dtype::bf16);
  const auto h = harness::galore_groups(galore_proj::std_, 1);
  optimizer_options o;
  o.grad_reduce_in_fp32 = true;
  using ref = on_threads<galore_adamw, sharded<float>, cpu, precision<bf16, float>>;
  using wide = precision<bf16, bf16>;
  BOOST_TEST_CONTEXT("sharded, stage 1")
  check_schedules<on_threads<galore_adamw, sharded<float>, cpu, wide>, ref>(l, h, o, {2, 3}, true, {1, 4});
  BOOST_TEST_CONTEXT("owned, stage 3")
  check_schedules<on_threads<galore_adamw, owned<float, 3>, cpu, wide>, ref>(l, h, o, {2, 3}, true, {1, 4});
}

BOOST_AUTO_TEST_SUITE_END()
