// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Sharded storage with fp32 params: every element-wise policy, fp32 and bf16 states, on
// awkward layouts, gives bit-identical params, master weights and states for d = 1..8
// ranks and any thread count, equal to the single-rank replicated run (which policies.cpp
// checks against float64 and tests/reference against PyTorch).

#include "sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <cmath>

namespace {

using namespace distopt;
using namespace harness;

template <class Policy, class Enc, class Prec = precision<float>>
void check_every_d(const std::vector<typename Policy::hyper_params>& h, run_options ro, int max_d = 8,
                   dtype t = dtype::f32) {
  for (const layout_case& c : awkward_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    const outcome ref = run_single<Policy, Enc, Prec>(l, h, ro);
    for (int d = 1; d <= max_d; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        const outcome got = run_threads<Policy, sharded<Enc>, Prec>(d, l, h, ro);
        BOOST_TEST((got.params == ref.params));
        BOOST_TEST((got.master == ref.master));
        BOOST_TEST((got.states == ref.states));
        BOOST_TEST((got.skipped == ref.skipped));
        // NaN != NaN: compare the norms' bits.
        BOOST_TEST(std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0);
      }
    }
  }
}

sgd::hyper_params sgd_momentum() {
  sgd::hyper_params h;
  h.lr = 0.05;
  h.momentum = 0.9;
  h.dampening = 0.1;
  h.weight_decay = 0.01;
  return h;
}
sgd::hyper_params sgd_nesterov() {
  sgd::hyper_params h;
  h.lr = 0.05;
  h.momentum = 0.8;
  h.nesterov = true;
  h.maximize = true;
  return h;
}
adam::hyper_params adam_amsgrad() {
  adam::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.amsgrad = true;
  return h;
}
adamw::hyper_params adamw_default() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  return h;
}
lion::hyper_params lion_default() {
  lion::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.1;
  return h;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sharded_fp32_params)

BOOST_AUTO_TEST_CASE(sgd_plain_and_momentum_every_d) {
  sgd::hyper_params plain;
  plain.lr = 0.1;
  check_every_d<sgd, fp32>({plain}, {});
  check_every_d<sgd, fp32>({sgd_momentum(), sgd_nesterov()}, {});
  check_every_d<sgd, bf16>({sgd_momentum()}, {});
}

BOOST_AUTO_TEST_CASE(adam_amsgrad_every_d) {
  check_every_d<adam, fp32>({adam_amsgrad()}, {});
  check_every_d<adam, bf16>({adam_amsgrad()}, {});
}

BOOST_AUTO_TEST_CASE(adamw_with_clipping_every_d) {
  run_options ro;
  ro.clip = 1.0;  // the global norm (about 20) clips every step: a wrong norm shows
  check_every_d<adamw, fp32>({adamw_default()}, ro);
  check_every_d<adamw, bf16>({adamw_default()}, ro);
}

// optimizer_options::max_grad_norm clips inside the step with the bits of clip_grad_norm
// called before it, for every d, with the finite check on or off.
BOOST_AUTO_TEST_CASE(max_grad_norm_clips_as_clip_grad_norm_every_d) {
  const layout l = make_layout(awkward_layouts()[0], dtype::f32);
  run_options called;
  called.clip = 1.0;
  const outcome ref = run_single<adamw, fp32, precision<float>>(l, {adamw_default()}, called);
  BOOST_TEST(!(run_single<adamw, fp32, precision<float>>(l, {adamw_default()}, {}).params == ref.params));  // it clips
  for (bool check : {true, false}) {
    run_options in_step;
    in_step.options.max_grad_norm = 1.0;
    in_step.options.check_finite = check;
    for (int d = 1; d <= 4; ++d)
      BOOST_TEST_CONTEXT("check_finite " << check << ", d=" << d) {
        BOOST_TEST((run_threads<adamw, sharded<fp32>, precision<float>>(d, l, {adamw_default()}, in_step) == ref));
      }
  }
}

BOOST_AUTO_TEST_CASE(lion_every_d) {
  check_every_d<lion, fp32>({lion_default()}, {});
  check_every_d<lion, bf16>({lion_default()}, {});
}

// A NaN on a rank other than 0 skips the step on every rank; the next steps go on.
BOOST_AUTO_TEST_CASE(nan_on_any_rank_skips_everywhere) {
  run_options ro;
  ro.steps = 6;
  ro.nan_step = 2;
  const layout l = make_layout(awkward_layouts()[0], dtype::f32);
  for (int d = 2; d <= 4; ++d) {
    ro.nan_rank = d - 1;
    const outcome got = run_threads<adamw, sharded<fp32>, precision<float>>(d, l, {adamw_default()}, ro);
    run_options single_ro = ro;
    single_ro.nan_rank = 0;
    const outcome ref = run_single<adamw, fp32, precision<float>>(l, {adamw_default()}, single_ro);
    BOOST_TEST((got.skipped == (std::vector<char>{0, 0, 1, 0, 0, 0})));
    BOOST_TEST((got.params == ref.params));
    BOOST_TEST((got.states == ref.states));
  }
}

// Thread count per rank does not change a bit.
BOOST_AUTO_TEST_CASE(thread_count_does_not_matter) {
  const layout l = make_layout(awkward_layouts()[0], dtype::f32);
  run_options ro;
  ro.clip = 1.0;
  ro.threads = 1;
  const outcome one = run_threads<adam, sharded<fp32>, precision<float>>(3, l, {adam_amsgrad()}, ro);
  ro.threads = 3;
  const outcome three = run_threads<adam, sharded<fp32>, precision<float>>(3, l, {adam_amsgrad()}, ro);
  BOOST_TEST((one == three));
}

// The global norm is the float64 norm of the global gradient, for every d.
BOOST_AUTO_TEST_CASE(global_norm_matches_float64) {
  const layout l = make_layout(awkward_layouts()[3], dtype::f32);
  double exact = 0.0;
  for (std::size_t t = 0; t < l.tensors().size(); ++t)
    for (std::size_t i = 0; i < l.tensors()[t].numel; ++i) {
      const double g = grad_value(0, t, i);
      exact += g * g;
    }
  exact = std::sqrt(exact);
  run_options ro;
  ro.steps = 1;
  ro.options.bucket_elems = 512;
  for (int d = 1; d <= 8; ++d) {
    const outcome got = run_threads<sgd, sharded<fp32>, precision<float>>(d, l, {sgd_momentum()}, ro);
    BOOST_TEST(std::abs(got.norms.at(0) - exact) <= 1e-14 * exact);
  }
}

BOOST_AUTO_TEST_SUITE_END()
