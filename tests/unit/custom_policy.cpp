// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The user-written Signum policy of examples/custom_policy, run through distopt::optimizer
// and checked step by step against an independent float64 re-computation of Bernstein et
// al.'s update (m = momentum*m + (1-momentum)*g; p -= lr*(sign(m) + weight_decay*p)) that
// keeps its own double state and never reads the library's. Also: invalid hyper-parameters
// are rejected with distopt::invalid_hyper_parameter naming the argument.
//
// Tolerances. sign(m) is discontinuous at 0: where the exact m is within fp32 rounding of 0,
// fp32 and float64 may disagree on its sign and the params then differ by 2*lr, which no
// tolerance should hide. The test data are therefore constructed to keep every exact m at
// least `margin` * (the tensor's gradient scale) away from 0 (a drawn gradient that would
// bring m closer is drawn again), except where m is exactly 0 in both (no gradient yet, or
// momentum 0 and a zero gradient), where sign(0) = 0 on both sides. The fp32 m differs from
// the exact one by at most ~ kSteps * 3 * 2^-24 * max|g| < 5e-6 * max|g| < 5e-5 * grad_scale
// (|g| < 10 * grad_scale: 5 sigma times the per-step factor 2), 20x below the margin.
// With the signs equal, each step of p costs three fp32 roundings of size <= |p| + lr, so
// atol = 4 * kSteps * 2^-24 * (max|p| + lr) per tensor; for m, 4 * kSteps * 2^-24 * max|g|.

#include <boost/test/unit_test.hpp>

#include "../../examples/custom_policy/signum.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int kSteps = 25;
constexpr int kZeroStep = 10;     // every tensor gets an all-zero gradient on this step
constexpr double kMargin = 1e-3;  // |exact m| >= kMargin * grad_scale unless it is exactly 0
constexpr double kRtol = 1e-5;
constexpr double kEps32 = 0x1p-24;

struct tensor_spec {
  std::string name;
  std::int64_t numel;
  double param_scale, grad_scale;
};

// Tile-edge sizes, params and grads of scales from 1e-3 to 10.
const std::vector<tensor_spec> specs{
    {"one", 1, 1.0, 10.0},
    {"three", 3, 0.5, 1e-3},
    {"t257", 257, 2.0, 1.0},
    {"t4097", 4097, 0.25, 1e-2}};

/// "three" also starts with a zero gradient: m stays exactly 0 and sign(0) = 0.
bool zero_grad_at(const tensor_spec& t, int step) {
  return step == kZeroStep || (t.name == "three" && step == 1);
}

struct reference_tensor {
  std::vector<double> p, m;
};

void check_close(const std::string& what, std::span<const float> got,
                 const std::vector<double>& want, double atol) {
  std::size_t bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, err / (atol + kRtol * std::abs(want[i])));
    if (!(err <= atol + kRtol * std::abs(want[i]))) {
      if (bad++ < 3)
        BOOST_ERROR(what << "[" << i << "]: got " << got[i] << ", float64 reference " << want[i]
                         << " (atol " << atol << ", rtol " << kRtol << ")");
    }
  }
  BOOST_CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << want.size()
                                     << " elements outside tolerance");
  BOOST_TEST_MESSAGE(what << ": worst error / tolerance " << worst);
}

void run_against_reference(const signum::hyper_params& h, std::uint32_t seed) {
  distopt::layout lay;
  for (const auto& t : specs) lay.add(t.name, {t.numel});
  distopt::optimizer<signum> opt(lay, h);

  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> factor(0.5, 2.0);

  std::vector<reference_tensor> ref(specs.size());
  std::vector<double> max_p(specs.size()), max_g(specs.size());
  for (std::size_t k = 0; k < specs.size(); ++k) {
    auto p = opt.param(specs[k].name);
    for (auto& x : p) x = static_cast<float>(normal(rng) * specs[k].param_scale);
    ref[k].p.assign(p.begin(), p.end());
    ref[k].m.assign(p.size(), 0.0);
    for (double x : ref[k].p) max_p[k] = std::max(max_p[k], std::abs(x));
  }

  for (int step = 1; step <= kSteps; ++step) {
    for (std::size_t k = 0; k < specs.size(); ++k) {
      const tensor_spec& t = specs[k];
      auto g = opt.grad(t.name);
      reference_tensor& r = ref[k];
      const double scale = t.grad_scale * factor(rng);
      for (std::size_t i = 0; i < g.size(); ++i) {
        float gi = 0.0f;
        if (!zero_grad_at(t, step)) {
          // Draw again while the exact new m would be within the margin of 0.
          do gi = static_cast<float>(normal(rng) * scale);
          while (std::abs(h.momentum * r.m[i] + (1.0 - h.momentum) * gi) < kMargin * t.grad_scale);
        }
        g[i] = gi;
        max_g[k] = std::max(max_g[k], std::abs(static_cast<double>(gi)));
        // The float64 re-computation of the published update.
        r.m[i] = h.momentum * r.m[i] + (1.0 - h.momentum) * static_cast<double>(gi);
        BOOST_REQUIRE(r.m[i] == 0.0 || std::abs(r.m[i]) >= h.momentum * kMargin * t.grad_scale);
        const double sign = (r.m[i] > 0.0) - (r.m[i] < 0.0);
        r.p[i] -= h.lr * (sign + h.weight_decay * r.p[i]);
        max_p[k] = std::max(max_p[k], std::abs(r.p[i]));
      }
    }
    const auto res = opt.step();
    BOOST_REQUIRE(!res.skipped);
    BOOST_REQUIRE_EQUAL(res.step, step);

    for (std::size_t k = 0; k < specs.size(); ++k) {
      const std::string where = specs[k].name + " step " + std::to_string(step);
      check_close("param " + where, opt.param(specs[k].name), ref[k].p,
                  4.0 * kSteps * kEps32 * (max_p[k] + h.lr));
      check_close("exp_avg " + where, opt.state(specs[k].name, 0), ref[k].m,
                  4.0 * kSteps * kEps32 * max_g[k]);
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(custom_policy)

BOOST_AUTO_TEST_CASE(models_optimizer_policy) {
  static_assert(distopt::optimizer_policy<signum>);
  BOOST_TEST(signum::state_slots(signum::hyper_params{}) == 1);
  const auto f = signum::hyper_params::fields();
  BOOST_TEST(std::get<0>(f).name == "lr");
  BOOST_TEST(std::get<1>(f).name == "momentum");
  BOOST_TEST(std::get<2>(f).name == "weight_decay");
}

BOOST_AUTO_TEST_CASE(matches_float64_reference) {
  run_against_reference({.lr = 1e-2, .momentum = 0.9, .weight_decay = 0.0}, 1);
  run_against_reference({.lr = 3e-3, .momentum = 0.5, .weight_decay = 0.1}, 2);
  // momentum 0: plain signSGD with weight decay; a zero gradient gives sign(0) = 0.
  run_against_reference({.lr = 1e-3, .momentum = 0.0, .weight_decay = 1e-2}, 3);
}

BOOST_AUTO_TEST_CASE(rejects_invalid_hyper_parameters) {
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  constexpr double inf = std::numeric_limits<double>::infinity();
  struct bad_case {
    signum::hyper_params h;
    std::string arg;
  };
  const std::vector<bad_case> cases{
      {{.lr = -1e-3}, "lr"},
      {{.lr = nan}, "lr"},
      {{.lr = inf}, "lr"},
      {{.momentum = 1.0}, "momentum"},
      {{.momentum = -0.1}, "momentum"},
      {{.momentum = nan}, "momentum"},
      {{.weight_decay = -1.0}, "weight_decay"},
      {{.weight_decay = inf}, "weight_decay"},
  };
  distopt::layout lay;
  lay.add("w", {4});
  for (const auto& c : cases) {
    const auto names_argument = [&](const distopt::invalid_hyper_parameter& e) {
      const std::string msg = e.what();
      const bool ok = msg.find("signum") != std::string::npos &&
                      msg.find("invalid " + c.arg + " ") != std::string::npos;
      BOOST_CHECK_MESSAGE(ok, "'" << msg << "' should name signum and " << c.arg);
      return ok;
    };
    BOOST_CHECK_EXCEPTION(c.h.validate(), distopt::invalid_hyper_parameter, names_argument);
    BOOST_CHECK_EXCEPTION(distopt::optimizer<signum>(lay, c.h), distopt::invalid_hyper_parameter,
                          names_argument);
    distopt::optimizer<signum> opt(lay, signum::hyper_params{});
    BOOST_CHECK_EXCEPTION(opt.set_hyper(0, c.h), distopt::invalid_hyper_parameter, names_argument);
    BOOST_TEST(opt.hyper().lr == signum::hyper_params{}.lr);  // unchanged after a refusal
  }
  BOOST_CHECK_NO_THROW(signum::hyper_params{}.validate());
  BOOST_CHECK_NO_THROW(
      (signum::hyper_params{.lr = 0.0, .momentum = 0.0, .weight_decay = 0.0}.validate()));
}

BOOST_AUTO_TEST_SUITE_END()
