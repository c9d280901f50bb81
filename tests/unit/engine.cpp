// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The step engine: layout, mixed precision, stochastic rounding, clipping, NaN/Inf skips,
// loss scaling, hyper-parameter groups, memory report and hyper-parameters as text.
// The per-policy math is checked against float64 in policies.cpp; here each feature is
// checked against an exact relation with the plain fp32 path or an independent computation.

#include <distopt/distopt.hpp>

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace distopt;

bool message_contains(const std::exception& e, const std::string& what) {
  return std::string(e.what()).find(what) != std::string::npos;
}
#define CHECK_THROWS_WITH(expr, type, text) \
  BOOST_CHECK_EXCEPTION(expr, type, [](const type& e) { return message_contains(e, text); })

layout make_layout(dtype t = dtype::f32) {
  layout l;
  l.add("a", {1}, t);
  l.add("b", {3}, t);
  l.add("c", {257}, t);
  l.add("d", {17, 33}, t);
  l.add("e", {3, 4, 5}, t, 1);
  return l;
}

std::vector<float> random_vector(std::mt19937& rng, std::size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <class Span>
std::vector<unsigned char> bytes_of(Span s) {
  std::vector<unsigned char> b(s.size_bytes());
  std::memcpy(b.data(), s.data(), b.size());
  return b;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(layout_registry)

BOOST_AUTO_TEST_CASE(tensors_start_on_block_boundaries) {
  layout l(256);
  l.add("x", {1});
  l.add("y", {257});
  l.add("z", {3, 5});
  for (const auto& t : l.tensors()) BOOST_TEST(t.offset % 256 == 0);
  BOOST_TEST(l.find("x").offset == 0u);
  BOOST_TEST(l.find("y").offset == 256u);
  BOOST_TEST(l.find("z").offset == 768u);
  BOOST_TEST(l.find("z").numel == 15u);
  BOOST_TEST(l.size() == 1024u);
  BOOST_TEST(l.numel() == 273u);
}

BOOST_AUTO_TEST_CASE(bad_registrations_are_refused_with_the_name) {
  layout l;
  l.add("w", {4});
  CHECK_THROWS_WITH(l.add("w", {4}), std::invalid_argument, "'w' is already registered");
  CHECK_THROWS_WITH(l.add("e", {}), std::invalid_argument, "'e' has an empty shape");
  CHECK_THROWS_WITH(l.add("z", {3, 0}), std::invalid_argument, "'z' has shape [3, 0]");
  CHECK_THROWS_WITH(l.add("n", {-1}), std::invalid_argument, "'n' has shape [-1]");
  CHECK_THROWS_WITH(l.add("", {1}), std::invalid_argument, "name is empty");
  CHECK_THROWS_WITH(l.find("nope"), std::out_of_range, "no tensor named 'nope'");
  CHECK_THROWS_WITH(layout(100), std::invalid_argument, "power of two");
}

BOOST_AUTO_TEST_CASE(optimizer_refuses_wrong_dtype_and_missing_group) {
  layout l;
  l.add("w", {4}, dtype::bf16);
  CHECK_THROWS_WITH(optimizer<adamw>(l, adamw::hyper_params{}), std::invalid_argument,
                    "'w' is registered as bf16 but this optimizer's params are fp32");
  layout g;
  g.add("w", {4}, dtype::f32, 2);
  CHECK_THROWS_WITH(optimizer<adamw>(g, adamw::hyper_params{}), std::invalid_argument,
                    "'w' is in group 2 but only 1 group(s)");
  optimizer<adamw> opt(make_layout(), {adamw::hyper_params{}, adamw::hyper_params{}});
  CHECK_THROWS_WITH(opt.param("missing"), std::out_of_range, "'missing'");
  BOOST_TEST(opt.param("d").size() == 17u * 33u);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(mixed_precision)

// With master weights, bf16 params follow the fp32 path exactly: the master equals the
// params of an fp32 optimizer started from the same (bf16-rounded) values, and the bf16
// params are the master rounded to nearest even.
BOOST_AUTO_TEST_CASE(bf16_params_with_master_follow_the_fp32_path) {
  using bf16_opt = optimizer<adamw, replicated<fp32>, single, cpu, precision<bf16, float>>;
  adamw::hyper_params h;
  h.lr = 1e-2;
  bf16_opt low(make_layout(dtype::bf16), {h, h});
  optimizer<adamw> ref(make_layout(), {h, h});
  std::mt19937 rng(1);
  for (const auto& t : ref.tensors().tensors()) {
    auto init = random_vector(rng, t.numel, 1.0f);
    for (std::size_t i = 0; i < t.numel; ++i) {
      low.param(t.name)[i] = bf16(init[i]);
      ref.param(t.name)[i] = to_float(bf16(init[i]));
    }
  }
  for (int s = 0; s < 20; ++s) {
    for (const auto& t : ref.tensors().tensors()) {
      auto g = random_vector(rng, t.numel, 0.1f);
      std::copy(g.begin(), g.end(), low.grad(t.name).begin());
      std::copy(g.begin(), g.end(), ref.grad(t.name).begin());
    }
    low.step();
    ref.step();
  }
  for (const auto& t : ref.tensors().tensors()) {
    auto m = low.master(t.name);
    auto p = low.param(t.name);
    auto r = ref.param(t.name);
    for (std::size_t i = 0; i < t.numel; ++i) {
      BOOST_TEST(m[i] == r[i]);
      BOOST_TEST(p[i].bits == bf16(r[i]).bits);
    }
  }
  BOOST_TEST(low.memory().bytes("master") == low.tensors().numel() * 4);
  BOOST_TEST(low.memory().total_bytes() == low.memory().bytes("padding") + low.tensors().numel() * (2 + 4 + 4 + 8));
}

// Without master weights, bf16 params are stochastically rounded: each result is one of
// the two neighbours of the exact value, and the mean follows the exact value even when
// every update is far below one bf16 ulp (round-to-nearest would never move).
BOOST_AUTO_TEST_CASE(bf16_without_master_rounds_stochastically_and_unbiased) {
  using opt_t = optimizer<sgd, replicated<fp32>, single, cpu, precision<bf16, float>>;
  constexpr std::size_t n = 1 << 16;
  layout l;
  l.add("w", {static_cast<std::int64_t>(n)}, dtype::bf16);
  sgd::hyper_params h;
  h.lr = 1.0;
  optimizer_options o;
  o.master_weights = false;
  opt_t opt(l, h, o, cpu(2));
  BOOST_TEST(opt.memory().bytes("master") == 0u);
  for (auto& p : opt.param("w")) p = bf16(1.0f);
  // bf16 ulp just below 1.0 is 2^-8; each step moves the exact value by 2^-8 / 16.
  const float delta = std::ldexp(1.0f, -12);
  for (auto& g : opt.grad("w")) g = delta;
  opt.step();
  const float below = to_float(bf16::from_bits(static_cast<std::uint16_t>(bf16(1.0f).bits - 1)));
  std::size_t down = 0;
  for (auto p : opt.param("w")) {
    const float v = to_float(p);
    BOOST_TEST((v == 1.0f || v == below));
    down += v == below;
  }
  // P(down) = delta / ulp = 1/16; binomial sigma over n draws.
  const double expected = n / 16.0, sigma = std::sqrt(n * (1.0 / 16) * (15.0 / 16));
  BOOST_TEST(std::fabs(down - expected) < 5 * sigma);
  for (int s = 1; s < 40; ++s) opt.step();
  double mean = 0;
  for (auto p : opt.param("w")) mean += to_float(p);
  mean /= n;
  // exact: 1 - 40 * 2^-12 = 0.990234375; the mean of n unbiased roundings is within a few 1e-5.
  BOOST_TEST(std::fabs(mean - (1.0 - 40.0 * delta)) < 1e-4);
}

BOOST_AUTO_TEST_CASE(stochastic_rounding_does_not_depend_on_threads) {
  using opt_t = optimizer<adamw, replicated<bf16>, single, cpu, precision<bf16, bf16>>;
  optimizer_options o;
  o.master_weights = false;
  o.seed = 42;
  layout l;
  l.add("w", {70000}, dtype::bf16);
  l.add("b", {5}, dtype::bf16);
  std::vector<std::vector<unsigned char>> results;
  for (int threads : {1, 2, 3}) {
    opt_t opt(l, adamw::hyper_params{}, o, cpu(threads));
    std::mt19937 rng(5);
    for (const char* name : {"w", "b"}) {
      auto init = random_vector(rng, opt.param(name).size(), 1.0f);
      for (std::size_t i = 0; i < init.size(); ++i) opt.param(name)[i] = bf16(init[i]);
    }
    for (int s = 0; s < 5; ++s) {
      for (const char* name : {"w", "b"}) {
        auto g = random_vector(rng, opt.grad(name).size(), 1.0f);
        for (std::size_t i = 0; i < g.size(); ++i) opt.grad(name)[i] = bf16(g[i]);
      }
      opt.step();
    }
    auto r = bytes_of(opt.params());
    auto s0 = bytes_of(opt.state("w", 1));
    r.insert(r.end(), s0.begin(), s0.end());
    results.push_back(r);
  }
  BOOST_TEST((results[0] == results[1]));
  BOOST_TEST((results[0] == results[2]));
}

BOOST_AUTO_TEST_CASE(fp16_without_master_rounds_to_nearest) {
  using opt_t = optimizer<sgd, replicated<fp32>, single, cpu, precision<fp16, fp16>>;
  layout l;
  l.add("w", {1000}, dtype::f16);
  sgd::hyper_params h;
  h.lr = 0.37;
  optimizer_options o;
  o.master_weights = false;
  opt_t opt(l, h, o);
  std::mt19937 rng(3);
  auto p0 = random_vector(rng, 1000, 2.0f);
  auto g0 = random_vector(rng, 1000, 1.0f);
  for (std::size_t i = 0; i < 1000; ++i) {
    opt.param("w")[i] = fp16(p0[i]);
    opt.grad("w")[i] = fp16(g0[i]);
  }
  opt.step();
  for (std::size_t i = 0; i < 1000; ++i) {
    const double exact = double(to_float(fp16(p0[i]))) - 0.37 * double(to_float(fp16(g0[i])));
    // the fp32 result rounded to nearest fp16: within half an fp16 ulp (+ fp32 rounding)
    const double ulp = std::ldexp(1.0, std::ilogb(exact) - 10);
    BOOST_TEST(std::fabs(double(to_float(opt.param("w")[i])) - exact) <= 0.5 * ulp * (1 + 1e-6));
  }
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(clipping_and_skips)

BOOST_AUTO_TEST_CASE(clip_grad_norm_returns_the_norm_and_scales_the_next_step) {
  sgd::hyper_params h;
  h.lr = 0.5;
  h.momentum = 0.9;
  optimizer<sgd> opt(make_layout(), {h, h});
  optimizer<sgd> ref(make_layout(), {h, h});
  std::mt19937 rng(7);
  double sum = 0;
  for (const auto& t : opt.tensors().tensors()) {
    auto p = random_vector(rng, t.numel, 1.0f);
    auto g = random_vector(rng, t.numel, 3.0f);
    std::copy(p.begin(), p.end(), opt.param(t.name).begin());
    std::copy(p.begin(), p.end(), ref.param(t.name).begin());
    std::copy(g.begin(), g.end(), opt.grad(t.name).begin());
    for (float x : g) sum += double(x) * x;
  }
  const double norm = opt.clip_grad_norm(1.0);
  BOOST_TEST(norm == std::sqrt(sum), boost::test_tools::tolerance(1e-12));
  const float coef = static_cast<float>(1.0 / (norm + 1e-6));
  for (const auto& t : opt.tensors().tensors())
    for (std::size_t i = 0; i < t.numel; ++i) ref.grad(t.name)[i] = opt.grad(t.name)[i] * coef;
  const auto r = opt.step();
  ref.step();
  BOOST_TEST(!r.skipped);
  BOOST_TEST(r.grad_norm == norm);
  BOOST_TEST((bytes_of(opt.params()) == bytes_of(ref.params())));
  // A max_norm above the norm leaves the gradients as they are.
  BOOST_TEST(opt.clip_grad_norm(1e9) == norm, boost::test_tools::tolerance(1e-12));
  opt.step();
  ref.step();
  BOOST_TEST((bytes_of(opt.params()) != bytes_of(ref.params())));  // ref's grads were scaled
  CHECK_THROWS_WITH(opt.clip_grad_norm(-1.0), std::invalid_argument, "max_norm");
}

BOOST_AUTO_TEST_CASE(non_finite_gradients_skip_the_step_and_touch_nothing) {
  using opt_t = optimizer<adamw, replicated<fp32>, single, cpu, precision<bf16, float>>;
  adamw::hyper_params h;
  h.amsgrad = true;
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    opt_t opt(make_layout(dtype::bf16), {h, h});
    std::mt19937 rng(11);
    for (const auto& t : opt.tensors().tensors()) {
      auto p = random_vector(rng, t.numel, 1.0f);
      for (std::size_t i = 0; i < t.numel; ++i) opt.param(t.name)[i] = bf16(p[i]);
      auto g = random_vector(rng, t.numel, 1.0f);
      std::copy(g.begin(), g.end(), opt.grad(t.name).begin());
    }
    opt.step();
    const auto params = bytes_of(opt.params());
    const auto master = bytes_of(opt.master("d"));
    std::vector<std::vector<unsigned char>> states;
    for (int k = 0; k < 3; ++k) states.push_back(bytes_of(opt.state("d", k)));
    opt.grad("d")[100] = bad;
    const auto r = opt.step();
    BOOST_TEST(r.skipped);
    BOOST_TEST(r.found_inf);
    BOOST_TEST(r.step == 1);
    BOOST_TEST(opt.step_count() == 1);
    BOOST_TEST((bytes_of(opt.params()) == params));
    BOOST_TEST((bytes_of(opt.master("d")) == master));
    for (int k = 0; k < 3; ++k) BOOST_TEST((bytes_of(opt.state("d", k)) == states[k]));
    // clip_grad_norm sees it too and the next step skips
    opt.grad("d")[100] = bad;
    BOOST_TEST(!std::isfinite(opt.clip_grad_norm(1.0)));
    BOOST_TEST(opt.step().skipped);
    opt.grad("d")[100] = 0.5f;
    BOOST_TEST(!opt.step().skipped);
    BOOST_TEST(opt.step_count() == 2);
  }
}

BOOST_AUTO_TEST_CASE(dynamic_loss_scale_unscales_backs_off_and_grows) {
  using opt_t = optimizer<adam, replicated<fp32>, single, cpu, precision<float, fp16>>;
  layout l;
  l.add("w", {300});
  optimizer_options o;
  o.loss_scale = dynamic_loss_scale{1024.0, 2.0, 0.5, 3};
  adam::hyper_params h;
  h.lr = 1e-2;
  opt_t opt(l, h, o);
  optimizer<adam> ref(l, h);
  std::mt19937 rng(13);
  auto p = random_vector(rng, 300, 1.0f);
  std::copy(p.begin(), p.end(), opt.param("w").begin());
  std::copy(p.begin(), p.end(), ref.param("w").begin());
  BOOST_TEST(opt.loss_scale() == 1024.0);
  for (int s = 0; s < 3; ++s) {
    const double scale = opt.loss_scale();
    auto g = random_vector(rng, 300, 1.0f);
    for (std::size_t i = 0; i < 300; ++i) {
      const fp16 scaled(g[i] * static_cast<float>(scale));
      opt.grad("w")[i] = scaled;
      ref.grad("w")[i] = to_float(scaled) / static_cast<float>(scale);  // exact: power of two
    }
    BOOST_TEST(!opt.step().skipped);
    ref.step();
  }
  BOOST_TEST((bytes_of(opt.params()) == bytes_of(ref.params())));
  BOOST_TEST(opt.loss_scale() == 2048.0);  // grew after growth_interval = 3 clean steps
  opt.grad("w")[7] = fp16(INFINITY);       // overflow in fp16
  const auto r = opt.step();
  BOOST_TEST(r.skipped);
  BOOST_TEST(r.loss_scale == 1024.0);
  BOOST_TEST((bytes_of(opt.params()) == bytes_of(ref.params())));
  CHECK_THROWS_WITH((opt_t(l, h, optimizer_options{true, true, 0, dynamic_loss_scale{0.0}})),
                    std::invalid_argument, "init_scale");
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(groups_and_hyper_params)

// Two groups in one optimizer equal two optimizers with one group each, bit for bit.
BOOST_AUTO_TEST_CASE(groups_apply_their_own_hyper_parameters) {
  adamw::hyper_params decay, no_decay;
  decay.weight_decay = 0.1;
  no_decay.weight_decay = 0.0;
  no_decay.lr = 3e-3;
  layout both;
  both.add("w", {40, 7});
  both.add("b", {7}, dtype::f32, 1);
  layout lw, lb;
  lw.add("w", {40, 7});
  lb.add("b", {7});
  optimizer<adamw> opt(both, {decay, no_decay});
  optimizer<adamw> ow(lw, decay), ob(lb, no_decay);
  std::mt19937 rng(17);
  for (auto [name, other] : {std::pair{"w", &ow}, std::pair{"b", &ob}}) {
    auto p = random_vector(rng, opt.param(name).size(), 1.0f);
    std::copy(p.begin(), p.end(), opt.param(name).begin());
    std::copy(p.begin(), p.end(), other->param(name).begin());
  }
  for (int s = 0; s < 10; ++s) {
    for (auto [name, other] : {std::pair{"w", &ow}, std::pair{"b", &ob}}) {
      auto g = random_vector(rng, opt.grad(name).size(), 1.0f);
      std::copy(g.begin(), g.end(), opt.grad(name).begin());
      std::copy(g.begin(), g.end(), other->grad(name).begin());
    }
    opt.step();
    ow.step();
    ob.step();
  }
  BOOST_TEST((bytes_of(opt.param("w")) == bytes_of(ow.param("w"))));
  BOOST_TEST((bytes_of(opt.param("b")) == bytes_of(ob.param("b"))));
  // set_hyper changes one group (an lr schedule)
  auto h = opt.hyper(1);
  h.lr = 0.0;
  opt.set_hyper(1, h);
  const auto before = bytes_of(opt.param("b"));
  opt.grad("b")[0] = 1.0f;
  opt.step();
  BOOST_TEST((bytes_of(opt.param("b")) == before));  // lr 0 and no decay: unchanged
  h.lr = -1.0;
  CHECK_THROWS_WITH(opt.set_hyper(1, h), invalid_hyper_parameter, "lr");
  CHECK_THROWS_WITH(opt.hyper(2), std::out_of_range, "group 2");
}

BOOST_AUTO_TEST_CASE(hyper_parameters_as_text) {
  adam::hyper_params h;
  set_hyper_param<adam>(h, "betas", "0.8,0.95");
  set_hyper_param<adam>(h, "amsgrad", "true");
  set_hyper_param<adam>(h, "lr", "3e-4");
  BOOST_TEST(h.betas[0] == 0.8);
  BOOST_TEST(h.betas[1] == 0.95);
  BOOST_TEST(h.amsgrad);
  BOOST_TEST(h.lr == 3e-4);
  CHECK_THROWS_WITH(set_hyper_param<adam>(h, "momentum", "0.9"), std::invalid_argument,
                    "unknown hyper-parameter 'momentum' (known: lr, betas, eps");
  CHECK_THROWS_WITH(set_hyper_param<adam>(h, "betas", "0.9"), std::invalid_argument,
                    "expects 2 comma-separated numbers");
  CHECK_THROWS_WITH(set_hyper_param<adam>(h, "lr", "fast"), std::invalid_argument, "expects a number");
  CHECK_THROWS_WITH(set_hyper_param<adam>(h, "amsgrad", "yes"), std::invalid_argument,
                    "expects true or false");
  adam::hyper_params back;
  const std::string text = hyper_params_string<adam>(h);
  BOOST_TEST(text == "lr=3e-04 betas=0.8,0.95 eps=1e-08 weight_decay=0 amsgrad=true maximize=false");
  for (std::size_t pos = 0; pos < text.size();) {
    const auto end = std::min(text.find(' ', pos), text.size());
    const auto item = text.substr(pos, end - pos);
    const auto eq = item.find('=');
    set_hyper_param<adam>(back, item.substr(0, eq), item.substr(eq + 1));
    pos = end + 1;
  }
  BOOST_TEST(hyper_params_string<adam>(back) == text);

  // apply_hyper_params: settings in order, then validation; the base values are kept
  const std::vector<std::pair<std::string, std::string>> sets{{"lr", "0.5"}, {"lr", "0.25"}};
  const auto applied = apply_hyper_params<adam>(back, sets);
  BOOST_TEST(applied.lr == 0.25);
  BOOST_TEST(applied.amsgrad);
  CHECK_THROWS_WITH(apply_hyper_params<adam>(back, std::vector<std::pair<std::string, std::string>>{
                        {"eps", "x"}}),
                    std::invalid_argument, "eps=x: adam: hyper-parameter 'eps' expects a number");
  CHECK_THROWS_WITH(apply_hyper_params<adam>(back, std::vector<std::pair<std::string, std::string>>{
                        {"eps", "-1"}}),
                    invalid_hyper_parameter, "adam: invalid eps -1");
}

BOOST_AUTO_TEST_CASE(memory_report_counts_bytes_per_parameter) {
  layout l;
  l.add("w", {1024});
  l.add("v", {512});
  optimizer<adamw> plain(l, adamw::hyper_params{});
  const auto r = plain.memory();
  BOOST_TEST(r.parameters == 1536u);
  BOOST_TEST(r.bytes_per_param("params") == 4.0);
  BOOST_TEST(r.bytes_per_param("grads") == 4.0);
  BOOST_TEST(r.bytes_per_param("master") == 0.0);
  BOOST_TEST(r.bytes_per_param("state") == 8.0);  // exp_avg, exp_avg_sq
  BOOST_TEST(r.bytes("padding") == 0u);           // 1024 and 512 are whole blocks
  BOOST_TEST(r.total_bytes_per_param() == 16.0);
  layout lb;
  lb.add("w", {1024}, dtype::bf16);
  optimizer<adamw, replicated<fp32>, single, cpu, precision<bf16, bf16>> mixed(lb, adamw::hyper_params{});
  // Megatron's table without sharding: 2 + 2 + 4 (master) + 8 (states) = 16 bytes/param
  BOOST_TEST(mixed.memory().total_bytes_per_param() == 16.0);
  optimizer<adamw, replicated<bf16>, single, cpu, precision<bf16, bf16>> small(lb, adamw::hyper_params{});
  BOOST_TEST(small.memory().total_bytes_per_param() == 12.0);
}

BOOST_AUTO_TEST_CASE(a_moved_optimizer_keeps_working) {
  layout l;
  l.add("w", {100});
  sgd::hyper_params h;
  h.lr = 0.5;
  optimizer<sgd> first(l, h, {}, cpu(2));
  first.param("w")[3] = 1.0f;
  optimizer<sgd> second(std::move(first));
  second.grad("w")[3] = 1.0f;
  second.step();
  BOOST_TEST(second.param("w")[3] == 0.5f);
  optimizer<sgd> third(l, h);
  third = std::move(second);
  third.step();
  BOOST_TEST(third.param("w")[3] == 0.0f);
}

BOOST_AUTO_TEST_CASE(zero_grad_clears_every_gradient) {
  optimizer<sgd> opt(make_layout(), {sgd::hyper_params{}, sgd::hyper_params{}});
  for (auto& g : opt.grads()) g = 3.0f;
  opt.zero_grad();
  for (auto g : opt.grads()) BOOST_TEST(g == 0.0f);
}

BOOST_AUTO_TEST_SUITE_END()
