// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The decoder's hand-written backward against finite differences of its forward, and its
// tensor-parallel split against one rank: the same loss and the same whole gradients within
// fp32 rounding for TP 2 and 4 (ranks as threads, the sums and maxima over distopt::threads).
#define BOOST_TEST_MODULE gpt_model
#include <boost/test/unit_test.hpp>

#include <distopt/comm/threads.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "model.hpp"

namespace {

/// A tiny model with weights large enough that attention is far from uniform.
gpt::model_config tiny() {
  gpt::model_config c;
  c.vocab = 16;
  c.dim = 16;
  c.layers = 2;
  c.heads = 4;
  c.ffn = 12;
  c.seq = 6;
  return c;
}

struct weights {
  std::vector<gpt::tensor_info> info;
  std::vector<std::vector<float>> w, g;  // this rank's parts

  weights(const gpt::model_config& c, int tp) : info(gpt::model_tensors(c, tp)) {
    for (const auto& t : info) {
      w.emplace_back(static_cast<std::size_t>(t.local_rows(tp) * t.local_cols(tp)));
      g.emplace_back(w.back().size());
    }
  }
  gpt::unit_calls calls() {
    gpt::unit_calls u;
    u.acquire = [this](int unit, bool backward) {
      std::vector<gpt::tensor_ref> refs;
      for (std::size_t i = 0; i < info.size(); ++i)
        if (info[i].unit == unit) refs.push_back({w[i].data(), backward ? g[i].data() : nullptr});
      return refs;
    };
    u.release = [](int) {};
    u.grads_written = [](int) {};
    return u;
  }
};

/// Whole initial tensors: N(0, 0.3) matrices, norm weights 1 + N(0, 0.1).
std::vector<std::vector<float>> draw(const std::vector<gpt::tensor_info>& info, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> whole;
  for (const auto& t : info) {
    whole.emplace_back(static_cast<std::size_t>(t.rows * t.cols));
    for (float& x : whole.back()) x = t.matrix() ? 0.3f * normal(rng) : 1.0f + 0.1f * normal(rng);
  }
  return whole;
}

struct batch {
  int n = 3;
  std::vector<std::int32_t> inputs, targets;
  explicit batch(const gpt::model_config& c) {
    std::mt19937 rng(11);
    std::uniform_int_distribution<std::int32_t> token(0, c.vocab - 1);
    for (int i = 0; i < n * c.seq; ++i) {
      inputs.push_back(token(rng));
      targets.push_back(token(rng));
    }
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(backward_matches_finite_differences) {
  const gpt::model_config c = tiny();
  weights p(c, 1);
  p.w = draw(p.info, 3);
  const batch b(c);
  gpt::model m(c, b.n);
  const gpt::unit_calls calls = p.calls();
  m.train_batch(calls, b.inputs.data(), b.targets.data(), b.n, 1.0);  // the gradient of the sum
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float eps = 1e-2f;
  for (std::size_t i = 0; i < p.info.size(); ++i) {
    // Along a random unit direction v of this tensor: (L(w + eps v) - L(w - eps v)) / 2 eps
    // against <grad, v>. The fp32 forward's rounding (about 1e-6 of a loss near 50) gives
    // 2.5e-3 over 2 eps, the O(eps^2) term under 1 %; a wrong formula is off by far more.
    std::vector<float> v(p.w[i].size());
    double norm = 0.0;
    for (float& x : v) {
      x = normal(rng);
      norm += static_cast<double>(x) * x;
    }
    for (float& x : v) x = static_cast<float>(x / std::sqrt(norm));
    const std::vector<float> saved = p.w[i];
    double analytic = 0.0;
    for (std::size_t k = 0; k < v.size(); ++k) analytic += static_cast<double>(p.g[i][k]) * v[k];
    auto loss_at = [&](float s) {
      for (std::size_t k = 0; k < v.size(); ++k) p.w[i][k] = saved[k] + s * v[k];
      return m.loss(calls, b.inputs.data(), b.targets.data(), b.n);
    };
    const double numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
    p.w[i] = saved;
    BOOST_TEST_INFO(p.info[i].name << ": analytic " << analytic << ", finite differences " << numeric);
    BOOST_TEST(std::abs(analytic - numeric) <= 5e-3 + 1e-2 * std::abs(numeric));
  }
}

BOOST_AUTO_TEST_CASE(divisor_scales_the_gradient_not_the_loss) {
  const gpt::model_config c = tiny();
  weights p(c, 1);
  p.w = draw(p.info, 3);
  const batch b(c);
  gpt::model m(c, b.n);
  const double sum = m.train_batch(p.calls(), b.inputs.data(), b.targets.data(), b.n, 1.0);
  const auto g1 = p.g;
  const double again = m.train_batch(p.calls(), b.inputs.data(), b.targets.data(), b.n, 4.0);
  BOOST_TEST(sum == again);
  BOOST_TEST(sum / (b.n * c.seq) > 1.0);  // a cross-entropy over 16 classes
  for (std::size_t i = 0; i < g1.size(); ++i)
    for (std::size_t k = 0; k < g1[i].size(); ++k)
      BOOST_TEST(std::abs(p.g[i][k] * 4.0f - g1[i][k]) <= 1e-6f * (1.0f + std::abs(g1[i][k])));
}

BOOST_AUTO_TEST_CASE(tensor_parallel_matches_one_rank) {
  const gpt::model_config c = tiny();
  const batch b(c);
  weights one(c, 1);
  const auto whole = draw(one.info, 7);
  one.w = whole;
  gpt::model m1(c, b.n);
  const double loss1 = m1.train_batch(one.calls(), b.inputs.data(), b.targets.data(), b.n, b.n * c.seq);
  for (int tp : {2, 4}) {
    std::vector<std::vector<std::vector<float>>> parts(static_cast<std::size_t>(tp));  // [rank][tensor]
    std::vector<double> losses(static_cast<std::size_t>(tp));
    distopt::run_ranks(tp, [&](distopt::threads& comm) {
      const int r = comm.rank();
      weights p(c, tp);
      for (std::size_t i = 0; i < p.info.size(); ++i) p.w[i] = gpt::part_of(p.info[i], whole[i], tp, r);
      gpt::tp_group group{r, tp, [&comm](std::span<float> x) { comm.all_reduce(x, distopt::reduce_op::sum); },
                          [&comm](std::span<float> x) { comm.all_reduce(x, distopt::reduce_op::max); }};
      gpt::model m(c, b.n, group);
      losses[static_cast<std::size_t>(r)] = m.train_batch(p.calls(), b.inputs.data(), b.targets.data(), b.n, b.n * c.seq);
      parts[static_cast<std::size_t>(r)] = std::move(p.g);
    });
    std::vector<std::vector<float>> grads(one.info.size());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      grads[i].resize(whole[i].size());
      const gpt::tensor_info& t = one.info[i];
      for (int r = 0; r < tp; ++r) {
        const std::vector<float>& part = parts[static_cast<std::size_t>(r)][i];
        if (t.how != gpt::split::none || r == 0)
          gpt::place_part(t, part, tp, r, grads[i]);
        else  // a replicated tensor's gradient: the same bits on every TP rank
          BOOST_TEST((part == grads[i]), t.name << " differs on TP rank " << r);
      }
    }
    for (double l : losses) BOOST_TEST(l == losses[0]);  // every TP rank the same loss
    BOOST_TEST(std::abs(losses[0] - loss1) <= 1e-5 * loss1, "TP " << tp << " loss " << losses[0] << " against " << loss1);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      float scale = 0.0f;
      for (float x : one.g[i]) scale = std::max(scale, std::abs(x));
      for (std::size_t k = 0; k < grads[i].size(); ++k)
        BOOST_TEST(std::abs(grads[i][k] - one.g[i][k]) <= 1e-5f * scale,
                   "TP " << tp << " " << one.info[i].name << "[" << k << "]: " << grads[i][k] << " against " << one.g[i][k]);
    }
  }
}

BOOST_AUTO_TEST_CASE(shapes_that_do_not_split_are_refused) {
  gpt::model_config c = tiny();
  BOOST_CHECK_EXCEPTION(gpt::model_tensors(c, 3), std::invalid_argument, [](const std::invalid_argument& e) {
    return std::string(e.what()).find("--heads 4 does not divide by --tp 3") != std::string::npos;
  });
  c.dim = 12;  // head size 3: odd
  BOOST_CHECK_THROW(gpt::model_tensors(c, 1), std::invalid_argument);
}
