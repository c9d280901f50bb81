// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// SGD, Adam, AdamW and Lion, each option, checked step by step against an independent
// float64 re-implementation of the published algorithms (torch.optim.SGD / Adam / AdamW
// pseudo-code, lion-pytorch), written here plainly in double. The reference keeps its own
// double state from the same initial params and the same fp32 gradients; it never reads the
// library's state. Also: bit-identical results for 1, 2 and 3 threads, rejection of invalid
// hyper-parameters, and PyTorch's documented defaults.

#include <boost/test/unit_test.hpp>

#include <distopt/exec/cpu.hpp>
#include <distopt/layout/registry.hpp>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adam.hpp>
#include <distopt/policy/adamw.hpp>
#include <distopt/policy/hyper_params.hpp>
#include <distopt/policy/lion.hpp>
#include <distopt/policy/sgd.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

constexpr int kSteps = 25;

// ---------------------------------------------------------------------------------------
// Test data: one layout of odd sizes, random params and grads of varied scale, zero grads.
// ---------------------------------------------------------------------------------------

struct tensor_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  int group;
  double param_scale;  // params ~ N(0, 1) * param_scale
  double grad_scale;   // grads  ~ N(0, 1) * grad_scale * (a per-step factor in [0.5, 2])
};

// 1, 3, 255, 257 and 4097 elements, a 2-D [17, 33] and a 3-D [3, 4, 5] tensor; two
// hyper-parameter groups (group 1 runs at half the learning rate); grad scales from 1e-3 to 10.
std::vector<tensor_spec> odd_tensors() {
  return {
      {"one", {1}, 0, 1.0, 10.0},      {"three", {3}, 0, 0.5, 1e-3},
      {"t255", {255}, 1, 2.0, 0.1},    {"t257", {257}, 0, 1.0, 1.0},
      {"t4097", {4097}, 0, 0.25, 1e-2}, {"mat", {17, 33}, 1, 1.5, 3.0},
      {"cube", {3, 4, 5}, 0, 3.0, 3e-3},
  };
}

// Zero gradients: "three" on its first two steps (momentum buffers / moments start from an
// all-zero gradient, Lion's sign(0) = 0), "t255" on steps 5, 6, 7 and 15 (moments decay
// without input), and every tensor on step 10.
bool zero_grad_at(const std::string& name, int step) {
  if (step == 10) return true;
  if (name == "three") return step == 1 || step == 2;
  if (name == "t255") return step == 5 || step == 6 || step == 7 || step == 15;
  return false;
}

struct problem {
  distopt::layout lay;
  std::vector<tensor_spec> specs;
  std::vector<std::vector<float>> init;                // [tensor][element]
  std::vector<std::vector<std::vector<float>>> grads;  // [step - 1][tensor][element]
};

std::size_t numel_of(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

// `with_big` adds a [229, 233] tensor (53357 elements > 3 chunks of 16384) in the middle.
problem make_problem(bool with_big) {
  problem pr;
  pr.specs = odd_tensors();
  if (with_big) pr.specs.insert(pr.specs.begin() + 4, {"big", {229, 233}, 1, 0.5, 0.3});
  std::mt19937 rng(20260314u);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> factor(0.5, 2.0);
  for (const auto& s : pr.specs) pr.lay.add(s.name, s.shape, distopt::dtype::f32, s.group);
  for (const auto& s : pr.specs) {
    std::vector<float> p(numel_of(s.shape));
    for (auto& x : p) x = static_cast<float>(normal(rng) * s.param_scale);
    pr.init.push_back(std::move(p));
  }
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<std::vector<float>> gs;
    for (const auto& s : pr.specs) {
      const double f = factor(rng);
      std::vector<float> g(numel_of(s.shape), 0.0f);
      if (!zero_grad_at(s.name, step))
        for (auto& x : g) x = static_cast<float>(normal(rng) * s.grad_scale * f);
      gs.push_back(std::move(g));
    }
    pr.grads.push_back(std::move(gs));
  }
  return pr;
}

// ---------------------------------------------------------------------------------------
// float64 references, one element at a time. `s` holds the element's state: the same slot
// order as the library's (sgd: 0 momentum_buffer; adam: 0 exp_avg, 1 exp_avg_sq,
// 2 max_exp_avg_sq; lion: 0 exp_avg) plus s[3], bookkeeping private to the test.
// `ambiguous` is set when fp32 may legitimately take a different discrete branch.
// ---------------------------------------------------------------------------------------

// torch.optim.SGD.
void ref_sgd(const distopt::sgd::hyper_params& h, std::int64_t step, double& p, double g,
             double* s, bool& /*ambiguous*/) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0) g = g + h.weight_decay * p;
  if (h.momentum != 0.0) {
    double& buf = s[0];
    if (step == 1)
      buf = g;  // torch.clone(g): the first step takes the gradient as is, no dampening
    else
      buf = h.momentum * buf + (1.0 - h.dampening) * g;
    if (h.nesterov)
      g = g + h.momentum * buf;
    else
      g = buf;
  }
  p = p - h.lr * g;
}

// torch.optim.Adam (Decoupled = false) and torch.optim.AdamW (Decoupled = true).
template <bool Decoupled, class H>
void ref_adam(const H& h, std::int64_t step, double& p, double g, double* s, bool& /*ambiguous*/) {
  const double beta1 = h.betas[0];
  const double beta2 = h.betas[1];
  if (h.maximize) g = -g;
  if (Decoupled)
    p = p * (1.0 - h.lr * h.weight_decay);
  else if (h.weight_decay != 0.0)
    g = g + h.weight_decay * p;
  double& m = s[0];
  double& v = s[1];
  m = beta1 * m + (1.0 - beta1) * g;
  v = beta2 * v + (1.0 - beta2) * g * g;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const double step_size = h.lr / bias_correction1;
  double denom;
  if (h.amsgrad) {
    s[2] = std::max(s[2], v);
    denom = std::sqrt(s[2]) / std::sqrt(bias_correction2) + h.eps;
  } else {
    denom = std::sqrt(v) / std::sqrt(bias_correction2) + h.eps;
  }
  p = p - step_size * m / denom;
}

// lion-pytorch: p *= 1 - lr*wd; update = sign(beta1*m + (1-beta1)*g); p -= lr*update;
// m = beta2*m + (1-beta2)*g.
void ref_lion(const distopt::lion::hyper_params& h, std::int64_t /*step*/, double& p, double g,
              double* s, bool& ambiguous) {
  const double beta1 = h.betas[0];
  const double beta2 = h.betas[1];
  double& m = s[0];
  double& m_max = s[3];  // largest |m| this element has held so far
  p = p * (1.0 - h.lr * h.weight_decay);
  const double c = beta1 * m + (1.0 - beta1) * g;
  // fp32 computes c from an m that carries up to ~25 steps x 2 roundings x 6e-8 = 3e-6 of
  // the largest |m| it held, plus ~2 roundings of its own terms, and from beta1 rounded to
  // fp32: so fp32's sign can differ from the exact one only when |c| is below ~4e-6 of
  // beta1*max|m| + (1-beta1)*|g|. With margin we call |c| below 1e-5 of that ambiguous (the
  // caller then stops comparing this element's param; its exp_avg does not depend on the
  // sign and is still compared). When m and g are exactly zero, c is exactly zero in fp32
  // too, the bound is 0 and nothing is flagged: sign(0) = 0 is then checked.
  if (std::abs(c) < 1e-5 * (beta1 * m_max + (1.0 - beta1) * std::abs(g))) ambiguous = true;
  const double update = (c > 0.0) ? 1.0 : (c < 0.0 ? -1.0 : 0.0);
  p = p - h.lr * update;
  m = beta2 * m + (1.0 - beta2) * g;
  m_max = std::max(m_max, std::abs(m));
}

// ---------------------------------------------------------------------------------------
// The harness: run the library and the reference side by side, compare after every step.
// ---------------------------------------------------------------------------------------

// Tolerance: |ours - ref| <= atol + rtol * |ref|, rtol = 1e-5.
//
// atol = 1e-6 * M, where M is the largest |value| the reference has held in that tensor
// (params) or in that tensor's state slot (states) up to this step: the param scale (about
// 3.5 standard deviations of N(0, 1) * param_scale over a few thousand elements), or larger
// once the optimizer has moved the params. Why: fp32 rounds each result to <= 2^-24 ~ 6e-8
// of the magnitudes involved, which are bounded by M; the library's scalars (lr, betas,
// 1 - lr*wd, bias corrections, eps) are fp32 roundings of the exact ones (<= 6e-8 relative).
// Over 25 steps with a few roundings each, the unbiased rounding errors grow like a random
// walk, ~sqrt(75) * 3.5e-8 ~ 3e-7 of M; only values that pass near zero (cancellation in
// p -= lr*u, or in exp_avg = beta1*m + (1-beta1)*g) keep an absolute error relative to the
// M they came from instead of their own size. rtol = 1e-5 covers values far from zero,
// whose relative error is at most ~25 * 3 * 6e-8 ~ 5e-6 and typically far less.
constexpr double kRtol = 1e-5;
constexpr double kAtolFactor = 1e-6;

struct run_output {
  std::vector<float> data;          // every tensor's params, then every state slot
  std::vector<double> grad_norms;   // step_result::grad_norm of each step
  std::size_t ambiguous = 0;        // Lion elements whose param stopped being compared
};

template <class Policy, class Ref>
run_output run_case(const problem& pr, const typename Policy::hyper_params& h, int slots, Ref ref,
                    int threads, const std::string& label) {
  BOOST_TEST_CONTEXT(label << " (" << threads << " thread(s))") {
    using H = typename Policy::hyper_params;
    H h1 = h;
    h1.lr = h.lr * 0.5;  // group 1: same options, half the learning rate
    const std::array<H, 2> hp{h, h1};
    distopt::optimizer<Policy> opt(pr.lay, std::vector<H>{h, h1}, {}, distopt::cpu(threads));

    const std::size_t T = pr.specs.size();
    struct ref_tensor {
      std::vector<double> p;
      std::vector<std::array<double, 4>> s;
      std::vector<char> skip_param;
      double p_max = 0.0;
      std::array<double, 3> s_max{};
    };
    std::vector<ref_tensor> ref_t(T);
    for (std::size_t t = 0; t < T; ++t) {
      const auto& init = pr.init[t];
      auto dst = opt.param(pr.specs[t].name);
      BOOST_TEST_REQUIRE(dst.size() == init.size());
      std::copy(init.begin(), init.end(), dst.begin());
      ref_t[t].p.assign(init.begin(), init.end());
      ref_t[t].s.assign(init.size(), std::array<double, 4>{0.0, 0.0, 0.0, 0.0});
      ref_t[t].skip_param.assign(init.size(), 0);
      for (double x : ref_t[t].p) ref_t[t].p_max = std::max(ref_t[t].p_max, std::abs(x));
    }
    // Exactly `slots` state slots are allocated.
    BOOST_CHECK_THROW(opt.state(pr.specs[0].name, slots), std::out_of_range);

    run_output out;
    std::size_t failures = 0, compared = 0;
    double worst = 0.0;  // largest |ours - ref| / tolerance seen
    auto check = [&](double ours, double want, double atol, int step, std::size_t t,
                     std::size_t i, const char* what) {
      ++compared;
      const double err = std::abs(ours - want);
      const double tol = atol + kRtol * std::abs(want);
      const double ratio = tol > 0.0 ? err / tol : (err > 0.0 ? INFINITY : 0.0);
      if (!(ratio <= 1.0)) {
        if (++failures <= 8)
          BOOST_ERROR("step " << step << " tensor '" << pr.specs[t].name << "' [" << i << "] "
                              << what << ": ours " << ours << " reference " << want
                              << " |diff| " << err << " > tolerance " << tol);
      }
      worst = std::max(worst, ratio);
    };

    for (int step = 1; step <= kSteps; ++step) {
      const auto& gs = pr.grads[static_cast<std::size_t>(step - 1)];
      for (std::size_t t = 0; t < T; ++t) {
        auto dst = opt.grad(pr.specs[t].name);
        std::copy(gs[t].begin(), gs[t].end(), dst.begin());
      }
      const distopt::step_result r = opt.step();
      BOOST_TEST(!r.skipped);
      BOOST_TEST(r.step == step);
      out.grad_norms.push_back(r.grad_norm);

      for (std::size_t t = 0; t < T; ++t) {
        ref_tensor& rt = ref_t[t];
        const H& hg = hp[static_cast<std::size_t>(pr.specs[t].group)];
        for (std::size_t i = 0; i < rt.p.size(); ++i) {
          bool ambiguous = false;
          ref(hg, step, rt.p[i], static_cast<double>(gs[t][i]), rt.s[i].data(), ambiguous);
          if (ambiguous && !rt.skip_param[i]) {
            rt.skip_param[i] = 1;
            ++out.ambiguous;
          }
          rt.p_max = std::max(rt.p_max, std::abs(rt.p[i]));
          for (int k = 0; k < slots; ++k)
            rt.s_max[static_cast<std::size_t>(k)] =
                std::max(rt.s_max[static_cast<std::size_t>(k)], std::abs(rt.s[i][static_cast<std::size_t>(k)]));
        }
        const auto ours_p = opt.param(pr.specs[t].name);
        for (std::size_t i = 0; i < rt.p.size(); ++i)
          if (!rt.skip_param[i])
            check(ours_p[i], rt.p[i], kAtolFactor * rt.p_max, step, t, i, "param");
        for (int k = 0; k < slots; ++k) {
          const auto ours_s = opt.state(pr.specs[t].name, k);
          const double atol = kAtolFactor * rt.s_max[static_cast<std::size_t>(k)];
          const char* what = k == 0 ? "state slot 0" : (k == 1 ? "state slot 1" : "state slot 2");
          for (std::size_t i = 0; i < rt.p.size(); ++i)
            check(ours_s[i], rt.s[i][static_cast<std::size_t>(k)], atol, step, t, i, what);
        }
      }
    }
    BOOST_CHECK_MESSAGE(failures == 0, label << ": " << failures << " of " << compared
                                             << " compared values outside the tolerance");
    BOOST_TEST_MESSAGE(label << " (" << threads << " thread(s)): " << compared
                             << " values compared, worst |diff|/tolerance " << worst
                             << ", lion-ambiguous elements skipped " << out.ambiguous);

    for (std::size_t t = 0; t < T; ++t) {
      const auto p = opt.param(pr.specs[t].name);
      out.data.insert(out.data.end(), p.begin(), p.end());
    }
    for (int k = 0; k < slots; ++k)
      for (std::size_t t = 0; t < T; ++t) {
        const auto s = opt.state(pr.specs[t].name, k);
        out.data.insert(out.data.end(), s.begin(), s.end());
      }
    return out;
  }
  return {};  // not reached
}

const problem& odd_problem() {
  static const problem pr = make_problem(false);
  return pr;
}

// ---------------------------------------------------------------------------------------
// Hyper-parameter sets, one per option (group 1 of each run uses half the learning rate).
// ---------------------------------------------------------------------------------------

struct sgd_case {
  const char* label;
  distopt::sgd::hyper_params h;
};

std::vector<sgd_case> sgd_cases() {
  using H = distopt::sgd::hyper_params;
  std::vector<sgd_case> c;
  H plain;
  plain.lr = 1e-2;
  c.push_back({"sgd plain", plain});
  H momentum = plain;
  momentum.momentum = 0.9;
  c.push_back({"sgd momentum", momentum});
  H dampening = momentum;
  dampening.dampening = 0.3;
  c.push_back({"sgd dampening", dampening});
  H nesterov = momentum;
  nesterov.nesterov = true;
  c.push_back({"sgd nesterov", nesterov});
  H wd = plain;
  wd.weight_decay = 0.1;
  c.push_back({"sgd weight_decay", wd});
  H wd_momentum = momentum;
  wd_momentum.weight_decay = 0.05;
  c.push_back({"sgd weight_decay + momentum", wd_momentum});
  H maximize = plain;
  maximize.maximize = true;
  c.push_back({"sgd maximize", maximize});
  H everything = nesterov;
  everything.weight_decay = 0.05;
  everything.maximize = true;
  c.push_back({"sgd maximize + weight_decay + nesterov", everything});
  return c;
}

template <class H>
std::vector<std::pair<std::string, H>> adam_cases(const std::string& name) {
  std::vector<std::pair<std::string, H>> c;
  H def;  // the library's defaults, lr 1e-3 (checked against PyTorch's in defaults_*)
  c.push_back({name + " default", def});
  H base = def;
  base.lr = 1e-2;
  H betas = base;
  betas.betas = {0.8, 0.99};
  c.push_back({name + " betas (0.8, 0.99)", betas});
  H low_beta1 = base;  // 1 - beta1 >= 0.5: the other branch of a torch-style lerp
  low_beta1.betas = {0.3, 0.9};
  c.push_back({name + " betas (0.3, 0.9)", low_beta1});
  H eps = base;
  eps.eps = 1e-3;  // comparable to the smallest grad scale, so it matters
  c.push_back({name + " eps 1e-3", eps});
  H wd = base;
  wd.weight_decay = 0.1;
  c.push_back({name + " weight_decay 0.1", wd});
  H no_wd = base;
  no_wd.weight_decay = 0.0;
  c.push_back({name + " weight_decay 0", no_wd});
  H amsgrad = base;
  amsgrad.amsgrad = true;
  c.push_back({name + " amsgrad", amsgrad});
  H maximize = base;
  maximize.maximize = true;
  c.push_back({name + " maximize", maximize});
  H everything = wd;
  everything.amsgrad = true;
  everything.maximize = true;
  everything.betas = {0.85, 0.995};
  c.push_back({name + " maximize + amsgrad + weight_decay + betas", everything});
  return c;
}

std::vector<std::pair<std::string, distopt::lion::hyper_params>> lion_cases() {
  using H = distopt::lion::hyper_params;
  std::vector<std::pair<std::string, H>> c;
  H def;  // lr 1e-4
  c.push_back({"lion default", def});
  H base = def;
  base.lr = 1e-3;
  H wd = base;
  wd.weight_decay = 0.5;
  c.push_back({"lion weight_decay 0.5", wd});
  H betas = base;
  betas.betas = {0.95, 0.98};
  c.push_back({"lion betas (0.95, 0.98)", betas});
  H low_betas = base;
  low_betas.betas = {0.5, 0.9};
  c.push_back({"lion betas (0.5, 0.9)", low_betas});
  H everything = wd;
  everything.betas = {0.8, 0.95};
  c.push_back({"lion weight_decay + betas", everything});
  return c;
}

// Lion elements whose param stopped being compared must stay rare, or the test is vacuous.
void check_few_ambiguous(const run_output& o, const problem& pr) {
  BOOST_TEST(o.ambiguous * 1000 <= pr.lay.numel());
}

template <class E>
bool names_argument(const E& e, std::string_view policy, std::string_view arg) {
  const std::string_view what = e.what();
  const bool ok = what.find(arg) != std::string_view::npos &&
                  what.find(policy) != std::string_view::npos;
  if (!ok) BOOST_TEST_MESSAGE("message '" << what << "' should name " << policy << " and " << arg);
  return ok;
}

// The hyper-parameters are rejected by validate(), by the constructor and by set_hyper,
// each with invalid_hyper_parameter naming the policy and the argument.
template <class Policy, class Mutate>
void expect_invalid(Mutate mutate, std::string_view arg) {
  BOOST_TEST_CONTEXT(Policy::name << " " << arg) {
    using H = typename Policy::hyper_params;
    H bad;
    mutate(bad);
    const std::string_view policy = Policy::name;
    auto pred = [&](const distopt::invalid_hyper_parameter& e) {
      return names_argument(e, policy, arg);
    };
    BOOST_CHECK_EXCEPTION(bad.validate(), distopt::invalid_hyper_parameter, pred);
    distopt::layout lay;
    lay.add("w", {5});
    BOOST_CHECK_EXCEPTION(distopt::optimizer<Policy>(lay, bad), distopt::invalid_hyper_parameter,
                          pred);
    distopt::optimizer<Policy> opt(lay, H{});
    BOOST_CHECK_EXCEPTION(opt.set_hyper(0, bad), distopt::invalid_hyper_parameter, pred);
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(policies)

BOOST_AUTO_TEST_CASE(sgd_matches_float64_reference) {
  for (const auto& c : sgd_cases()) {
    const int slots = c.h.momentum != 0.0 ? 1 : 0;
    run_case<distopt::sgd>(odd_problem(), c.h, slots, ref_sgd, 2, c.label);
  }
}

BOOST_AUTO_TEST_CASE(adam_matches_float64_reference) {
  for (const auto& [label, h] : adam_cases<distopt::adam::hyper_params>("adam"))
    run_case<distopt::adam>(odd_problem(), h, h.amsgrad ? 3 : 2,
                            ref_adam<false, distopt::adam::hyper_params>, 2, label);
}

BOOST_AUTO_TEST_CASE(adamw_matches_float64_reference) {
  for (const auto& [label, h] : adam_cases<distopt::adamw::hyper_params>("adamw"))
    run_case<distopt::adamw>(odd_problem(), h, h.amsgrad ? 3 : 2,
                             ref_adam<true, distopt::adamw::hyper_params>, 2, label);
}

BOOST_AUTO_TEST_CASE(lion_matches_float64_reference) {
  for (const auto& [label, h] : lion_cases()) {
    const run_output o = run_case<distopt::lion>(odd_problem(), h, 1, ref_lion, 2, label);
    check_few_ambiguous(o, odd_problem());
  }
}

// The same layout plus a tensor of 53357 elements (4 chunks of 16384): params, every state
// slot and the reported grad norms are bit for bit the same for 1, 2 and 3 threads (and
// each run also matches the float64 reference).
BOOST_AUTO_TEST_CASE(results_do_not_depend_on_thread_count) {
  const problem pr = make_problem(true);
  BOOST_TEST_REQUIRE(pr.lay.find("big").numel > 3u * 16384u);
  auto same_bits = [](const run_output& a, const run_output& b, const std::string& label) {
    BOOST_TEST_CONTEXT(label) {
      BOOST_TEST_REQUIRE(a.data.size() == b.data.size());
      BOOST_TEST(std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0);
      BOOST_TEST_REQUIRE(a.grad_norms.size() == b.grad_norms.size());
      BOOST_TEST(std::memcmp(a.grad_norms.data(), b.grad_norms.data(),
                             a.grad_norms.size() * sizeof(double)) == 0);
    }
  };
  auto over_threads = [&](auto run, const std::string& label) {
    const run_output one = run(1);
    BOOST_TEST(!one.data.empty());
    same_bits(one, run(2), label + ": 1 vs 2 threads");
    same_bits(one, run(3), label + ": 1 vs 3 threads");
  };

  distopt::sgd::hyper_params s;
  s.lr = 1e-2;
  s.momentum = 0.9;
  s.nesterov = true;
  s.weight_decay = 0.05;
  over_threads([&](int n) { return run_case<distopt::sgd>(pr, s, 1, ref_sgd, n, "sgd"); }, "sgd");

  distopt::adam::hyper_params a;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  a.amsgrad = true;
  over_threads([&](int n) {
    return run_case<distopt::adam>(pr, a, 3, ref_adam<false, distopt::adam::hyper_params>, n, "adam");
  }, "adam");

  distopt::adamw::hyper_params w;
  w.lr = 1e-2;
  w.amsgrad = true;
  w.maximize = true;
  over_threads([&](int n) {
    return run_case<distopt::adamw>(pr, w, 3, ref_adam<true, distopt::adamw::hyper_params>, n,
                                    "adamw");
  }, "adamw");

  distopt::lion::hyper_params l;
  l.lr = 1e-3;
  l.weight_decay = 0.5;
  over_threads([&](int n) { return run_case<distopt::lion>(pr, l, 1, ref_lion, n, "lion"); },
               "lion");
}

// torch.optim.SGD keeps a momentum buffer per parameter and creates it, as a copy of the
// gradient, on the first step that parameter takes with momentum != 0, not on the
// optimizer's first step. Here group 1 starts without momentum (group 0's momentum makes the
// optimizer allocate the slot) and switches momentum on with set_hyper at step 4; torch then
// takes buf = g at step 4, with no dampening.
// (step_info::fresh_state carries this per group.)
BOOST_AUTO_TEST_CASE(sgd_momentum_switched_on_later_starts_from_the_gradient) {
  const problem& pr = odd_problem();
  distopt::sgd::hyper_params with, without;
  with.lr = without.lr = 1e-2;
  with.momentum = 0.9;
  with.dampening = 0.5;
  distopt::optimizer<distopt::sgd> opt(pr.lay, {with, without}, {}, distopt::cpu(2));
  const std::size_t T = pr.specs.size();
  std::vector<std::vector<double>> p(T), buf(T);
  std::vector<std::vector<char>> has_buf(T);  // torch: state["momentum_buffer"] exists
  for (std::size_t t = 0; t < T; ++t) {
    auto dst = opt.param(pr.specs[t].name);
    std::copy(pr.init[t].begin(), pr.init[t].end(), dst.begin());
    p[t].assign(pr.init[t].begin(), pr.init[t].end());
    buf[t].assign(p[t].size(), 0.0);
    has_buf[t].assign(p[t].size(), 0);
  }
  std::size_t failures = 0;
  for (int step = 1; step <= kSteps; ++step) {
    if (step == 4) opt.set_hyper(1, with);
    const auto& gs = pr.grads[static_cast<std::size_t>(step - 1)];
    for (std::size_t t = 0; t < T; ++t) {
      auto dst = opt.grad(pr.specs[t].name);
      std::copy(gs[t].begin(), gs[t].end(), dst.begin());
    }
    opt.step();
    for (std::size_t t = 0; t < T; ++t) {
      const bool momentum_on = pr.specs[t].group == 0 || step >= 4;
      const auto ours_p = opt.param(pr.specs[t].name);
      const auto ours_b = opt.state(pr.specs[t].name, 0);
      double p_max = 0.0, b_max = 0.0;
      for (std::size_t i = 0; i < p[t].size(); ++i) {
        double g = gs[t][i];
        if (momentum_on) {
          if (!has_buf[t][i]) {
            buf[t][i] = g;
            has_buf[t][i] = 1;
          } else {
            buf[t][i] = with.momentum * buf[t][i] + (1.0 - with.dampening) * g;
          }
          g = buf[t][i];
        }
        p[t][i] = p[t][i] - with.lr * g;
        p_max = std::max(p_max, std::abs(p[t][i]));
        b_max = std::max(b_max, std::abs(buf[t][i]));
      }
      for (std::size_t i = 0; i < p[t].size(); ++i) {
        // Same tolerance as run_case (atol 1e-6 of the tensor's largest value, rtol 1e-5).
        const bool ok_p = std::abs(ours_p[i] - p[t][i]) <= 1e-6 * p_max + kRtol * std::abs(p[t][i]);
        const bool ok_b = std::abs(ours_b[i] - buf[t][i]) <= 1e-6 * b_max + kRtol * std::abs(buf[t][i]);
        if (!(ok_p && ok_b) && ++failures <= 3)
          BOOST_TEST_MESSAGE("step " << step << " '" << pr.specs[t].name << "'[" << i
                                     << "]: param " << ours_p[i] << " vs " << p[t][i]
                                     << ", momentum_buffer " << ours_b[i] << " vs " << buf[t][i]);
      }
    }
  }
  BOOST_TEST(failures == 0u);
}

BOOST_AUTO_TEST_CASE(invalid_hyper_parameters_throw_naming_the_argument) {
  const double nan = std::numeric_limits<double>::quiet_NaN();

  expect_invalid<distopt::sgd>([](auto& h) { h.lr = -1e-3; }, "lr");
  expect_invalid<distopt::sgd>([&](auto& h) { h.lr = nan; }, "lr");
  expect_invalid<distopt::sgd>([](auto& h) { h.weight_decay = -0.1; }, "weight_decay");
  expect_invalid<distopt::sgd>([](auto& h) { h.momentum = -0.5; }, "momentum");
  expect_invalid<distopt::sgd>([](auto& h) { h.nesterov = true; }, "nesterov");  // momentum 0
  expect_invalid<distopt::sgd>(
      [](auto& h) {
        h.nesterov = true;
        h.momentum = 0.9;
        h.dampening = 0.1;
      },
      "nesterov");

  expect_invalid<distopt::adam>([](auto& h) { h.lr = -1e-3; }, "lr");
  expect_invalid<distopt::adam>([&](auto& h) { h.lr = nan; }, "lr");
  expect_invalid<distopt::adam>([](auto& h) { h.eps = -1e-8; }, "eps");
  expect_invalid<distopt::adam>([](auto& h) { h.betas[1] = 1.0; }, "betas[1]");
  expect_invalid<distopt::adam>([](auto& h) { h.betas[0] = -0.1; }, "betas[0]");
  expect_invalid<distopt::adam>([](auto& h) { h.weight_decay = -1e-2; }, "weight_decay");

  expect_invalid<distopt::adamw>([](auto& h) { h.lr = -1e-3; }, "lr");
  expect_invalid<distopt::adamw>([&](auto& h) { h.lr = nan; }, "lr");
  expect_invalid<distopt::adamw>([](auto& h) { h.eps = -1e-8; }, "eps");
  expect_invalid<distopt::adamw>([](auto& h) { h.betas[1] = 1.0; }, "betas[1]");
  expect_invalid<distopt::adamw>([](auto& h) { h.betas[0] = 1.0; }, "betas[0]");
  expect_invalid<distopt::adamw>([](auto& h) { h.weight_decay = -1e-2; }, "weight_decay");

  expect_invalid<distopt::lion>([](auto& h) { h.lr = -1e-4; }, "lr");
  expect_invalid<distopt::lion>([&](auto& h) { h.lr = nan; }, "lr");
  expect_invalid<distopt::lion>([](auto& h) { h.betas[1] = 1.0; }, "betas[1]");
  expect_invalid<distopt::lion>([](auto& h) { h.weight_decay = -0.1; }, "weight_decay");
}

// Boundary values PyTorch accepts are accepted too.
BOOST_AUTO_TEST_CASE(valid_boundary_hyper_parameters_are_accepted) {
  distopt::sgd::hyper_params s;
  s.lr = 0.0;
  s.momentum = 0.0;
  BOOST_CHECK_NO_THROW(s.validate());
  distopt::adam::hyper_params a;
  a.lr = 0.0;
  a.eps = 0.0;
  a.betas = {0.0, 0.0};
  a.weight_decay = 0.0;
  BOOST_CHECK_NO_THROW(a.validate());
  distopt::lion::hyper_params l;
  l.betas = {0.0, 0.0};
  BOOST_CHECK_NO_THROW(l.validate());
}

// torch.optim.SGD / Adam / AdamW documented defaults and lion-pytorch's.
BOOST_AUTO_TEST_CASE(defaults_match_pytorch) {
  const distopt::sgd::hyper_params s;
  BOOST_TEST(s.lr == 1e-3);
  BOOST_TEST(s.momentum == 0.0);
  BOOST_TEST(s.dampening == 0.0);
  BOOST_TEST(s.weight_decay == 0.0);
  BOOST_TEST(!s.nesterov);
  BOOST_TEST(!s.maximize);
  BOOST_CHECK_NO_THROW(s.validate());

  const distopt::adam::hyper_params a;
  BOOST_TEST(a.lr == 1e-3);
  BOOST_TEST(a.betas[0] == 0.9);
  BOOST_TEST(a.betas[1] == 0.999);
  BOOST_TEST(a.eps == 1e-8);
  BOOST_TEST(a.weight_decay == 0.0);
  BOOST_TEST(!a.amsgrad);
  BOOST_TEST(!a.maximize);
  BOOST_CHECK_NO_THROW(a.validate());

  const distopt::adamw::hyper_params w;
  BOOST_TEST(w.lr == 1e-3);
  BOOST_TEST(w.betas[0] == 0.9);
  BOOST_TEST(w.betas[1] == 0.999);
  BOOST_TEST(w.eps == 1e-8);
  BOOST_TEST(w.weight_decay == 1e-2);
  BOOST_TEST(!w.amsgrad);
  BOOST_TEST(!w.maximize);
  BOOST_CHECK_NO_THROW(w.validate());

  const distopt::lion::hyper_params l;
  BOOST_TEST(l.lr == 1e-4);
  BOOST_TEST(l.betas[0] == 0.9);
  BOOST_TEST(l.betas[1] == 0.99);
  BOOST_TEST(l.weight_decay == 0.0);
  BOOST_CHECK_NO_THROW(l.validate());
}

BOOST_AUTO_TEST_SUITE_END()
