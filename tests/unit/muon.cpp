// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Muon (with AdamW for the other tensors) inside the optimizer: Newton–Schulz against a
// float64 re-computation, whole steps against a float64 Muon + AdamW, bit-identity for
// d = 1..8 ranks and thread counts, the communication it adds, the memory report and the
// refusals.
#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>
#include <distopt/policy/muon.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "muon_cases.hpp"
#include "sharded_harness.hpp"

using namespace distopt;

namespace {

/// Matrices in the Muon group (1: tall, wide, square), a bias and a vector in the AdamW
/// group (0); tensors straddle shard cuts, and with `bucket` small there are several buckets.
/// `big` adds a 150 x 260 matrix, whose Newton-Schulz products span several 128 x 128 tiles.
layout make_layout(dtype t, bool big = false) {
  layout l = harness::matrices_and_vectors(t);
  if (big) l.add("w4", {150, 260}, t, 1);
  return l;
}

using harness::muon_groups;

// ---- float64 re-computation ----------------------------------------------------------

/// torch.optim.Muon's learning rate for a rows x cols matrix (torch/optim/_muon.py,
/// _adjust_lr), written out here in double rather than read from the library:
/// None / "original": lr * sqrt(max(1, rows / cols)); "match_rms_adamw": lr * 0.2 *
/// sqrt(max(rows, cols)); "spectral_unclamped": lr * sqrt(rows / cols).
double torch_adjusted_lr(const muon::hyper_params& h, std::int64_t rows, std::int64_t cols) {
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  switch (h.adjust_lr_fn) {
    case muon_adjust_lr::original:
      return h.lr * std::sqrt(std::max(1.0, a / b));
    case muon_adjust_lr::match_rms_adamw:
      return h.lr * 0.2 * std::sqrt(std::max(a, b));
    case muon_adjust_lr::spectral_unclamped:
      return h.lr * std::sqrt(a / b);
  }
  BOOST_FAIL("unknown adjust_lr_fn");
  return 0.0;
}

/// torch.optim.Muon's Newton–Schulz in double (row-major m x n).
std::vector<double> ns_double(std::vector<double> u, std::int64_t m, std::int64_t n, const muon::hyper_params& h) {
  const bool tall = m > n;
  const std::int64_t r = tall ? n : m, c = tall ? m : n;
  std::vector<double> x(static_cast<std::size_t>(r * c));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) x[static_cast<std::size_t>(tall ? j * m + i : i * n + j)] = u[i * n + j];
  double sq = 0;
  for (double v : x) sq += v * v;
  const double norm = std::max(std::sqrt(sq), h.eps);
  for (double& v : x) v /= norm;
  const auto [a, b, cc] = h.ns_coefficients;
  std::vector<double> A(static_cast<std::size_t>(r * r)), B(A.size()), y(x.size());
  for (int s = 0; s < h.ns_steps; ++s) {
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j) {
        double t = 0;
        for (std::int64_t k = 0; k < c; ++k) t += x[i * c + k] * x[j * c + k];
        A[i * r + j] = t;
      }
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j) {
        double t = 0;
        for (std::int64_t k = 0; k < r; ++k) t += A[i * r + k] * A[k * r + j];
        B[i * r + j] = b * A[i * r + j] + cc * t;
      }
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < c; ++j) {
        double t = 0;
        for (std::int64_t k = 0; k < r; ++k) t += B[i * r + k] * x[k * c + j];
        y[i * c + j] = a * x[i * c + j] + t;
      }
    x.swap(y);
  }
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) u[i * n + j] = x[static_cast<std::size_t>(tall ? j * m + i : i * n + j)];
  return u;
}

/// Muon + AdamW in double over `steps` of the harness's gradients (one rank); params by tensor.
std::vector<std::vector<double>> reference(const layout& l, const std::vector<muon::hyper_params>& hp, int steps) {
  const auto ts = l.tensors();
  std::vector<std::vector<double>> p(ts.size()), m0(ts.size()), m1(ts.size());
  for (std::size_t t = 0; t < ts.size(); ++t) {
    p[t].resize(ts[t].numel);
    for (std::size_t i = 0; i < ts[t].numel; ++i) p[t][i] = harness::init_value(t, i);
    m0[t].assign(ts[t].numel, 0.0);
    m1[t].assign(ts[t].numel, 0.0);
  }
  for (int s = 0; s < steps; ++s) {
    for (std::size_t t = 0; t < ts.size(); ++t) {
      const auto& h = hp[static_cast<std::size_t>(ts[t].group)];
      std::vector<double> g(ts[t].numel);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = harness::grad_value(s, t, i);
      if (h.use_muon) {
        std::vector<double> u(g.size());
        for (std::size_t i = 0; i < g.size(); ++i) {
          m0[t][i] = h.momentum * m0[t][i] + (1 - h.momentum) * g[i];
          u[i] = h.nesterov ? (1 - h.momentum) * g[i] + h.momentum * m0[t][i] : m0[t][i];
        }
        const auto o = ns_double(u, ts[t].shape[0], ts[t].shape[1], h);
        const double lr = torch_adjusted_lr(h, ts[t].shape[0], ts[t].shape[1]);
        for (std::size_t i = 0; i < g.size(); ++i) p[t][i] = p[t][i] * (1 - h.lr * h.weight_decay) - lr * o[i];
      } else {  // torch.optim.AdamW
        const double bc1 = 1 - std::pow(h.betas[0], s + 1), bc2 = 1 - std::pow(h.betas[1], s + 1);
        for (std::size_t i = 0; i < g.size(); ++i) {
          p[t][i] *= 1 - h.lr * h.weight_decay;
          m0[t][i] = h.betas[0] * m0[t][i] + (1 - h.betas[0]) * g[i];
          m1[t][i] = h.betas[1] * m1[t][i] + (1 - h.betas[1]) * g[i] * g[i];
          p[t][i] -= h.lr / bc1 * m0[t][i] / (std::sqrt(m1[t][i]) / std::sqrt(bc2) + h.adamw_eps);
        }
      }
    }
  }
  return p;
}

std::vector<double> random_matrix(std::int64_t m, std::int64_t n, int seed) {
  std::vector<double> u(static_cast<std::size_t>(m * n));
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = harness::grad_value(seed, 7, i);
  return u;
}

template <class Prec, class Enc = fp32>
harness::outcome run_single(const std::vector<muon::hyper_params>& h, int threads, int steps = 20, bool big = false,
                            optimizer_options o = {}) {
  const layout l = make_layout(dtype_of<typename Prec::param_type>, big);
  optimizer<muon, replicated<Enc>, single, cpu, Prec> opt(l, h, o, cpu(threads));
  harness::outcome r = harness::blank<decltype(opt)>(l, 2);
  harness::run_options ro;
  ro.steps = steps;
  harness::drive(opt, 0, ro, &r);
  harness::collect(opt, 0, r);
  return r;
}

template <class Prec, class Enc = fp32>
harness::outcome run_ranks_(int d, const std::vector<muon::hyper_params>& h, std::size_t bucket, bool big = false,
                            optimizer_options o = {}, int threads_per_rank = 1) {
  using opt_t = optimizer<muon, sharded<Enc>, threads, cpu, Prec>;
  const layout l = make_layout(dtype_of<typename Prec::param_type>, big);
  harness::outcome r = harness::blank<opt_t>(l, 2);
  o.grad_reduce = reduce_op::sum;
  o.bucket_elems = bucket;
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, o, cpu(threads_per_rank), std::move(comm));
    harness::drive(opt, rank, {}, rank == 0 ? &r : nullptr);
    harness::collect(opt, rank, r);
  });
  return r;
}

}  // namespace

BOOST_AUTO_TEST_CASE(newton_schulz_against_float64) {
  // fp32 NS: the output's entries are O(1 / sqrt(max(m, n))); fp32 products over k <= 300
  // terms, 3 per iteration, 5 iterations whose slope at 0 is a = 3.4445: each rounding
  // (2^-24 relative) can grow a^5 ~ 490 times. That worst case (2^-24 * 490 * k ~ 9e-3 of
  // the largest entry for k = 300) would let a real mistake through, so the tolerances sit near
  // what is observed (OpenBLAS sgemm, one thread; the worst of the shapes below, relative to
  // the largest entry): fp32 3.5e-6 (tolerance 1e-5), bf16 0.036 (tolerance 0.08, and more
  // than 1e-5: bf16 must round).
  constexpr double tol32 = 1e-5, tol16 = 0.08;
  muon::hyper_params h;
  double worst32 = 0, worst16 = 0;
  // The last four span several 128 x 128 tiles (and one tile row or column).
  for (auto [m, n] : {std::pair<std::int64_t, std::int64_t>{40, 30}, {17, 33}, {9, 9}, {1, 64}, {64, 1}, {300, 200},
                      {129, 257}, {1, 300}, {300, 1}}) {
    const auto u = random_matrix(m, n, static_cast<int>(m * n));
    const auto want = ns_double(u, m, n, h);
    std::vector<float> uf(u.begin(), u.end()), got(u.size());
    muon_newton_schulz ns;
    ns.run(h, uf.data(), m, n, got.data());
    double big = 0, err = 0;
    for (std::size_t i = 0; i < u.size(); ++i) {
      big = std::max(big, std::abs(want[i]));
      err = std::max(err, std::abs(want[i] - got[i]));
    }
    worst32 = std::max(worst32, err / big);
    const double err32 = err;
    BOOST_TEST(err <= tol32 * big, m << " x " << n << ": fp32 error " << err << " of " << big);
    // bf16: each product rounded to 8 bits (2^-9 relative) grows the same way.
    auto h16 = h;
    h16.ns_dtype = muon_ns_dtype::bf16;
    ns.run(h16, uf.data(), m, n, got.data());
    err = 0;
    for (std::size_t i = 0; i < u.size(); ++i) err = std::max(err, std::abs(want[i] - got[i]));
    worst16 = std::max(worst16, err / big);
    BOOST_TEST_MESSAGE(m << " x " << n << ": NS error / largest entry: fp32 " << err32 / big << ", bf16 " << err / big);
    BOOST_TEST(err <= tol16 * big, m << " x " << n << ": bf16 error " << err << " of " << big);
    BOOST_TEST(err > 1e-5 * big, "bf16 NS must round (" << err << ")");
  }
  BOOST_TEST_MESSAGE("NS relative error: fp32 " << worst32 << ", bf16 " << worst16);
  // The tiles may run on any threads: the bits are those of one thread, tile after tile.
  cpu four(4);
  for (auto [m, n] : {std::pair<std::int64_t, std::int64_t>{300, 200}, {129, 257}, {260, 150}}) {
    const auto u = random_matrix(m, n, 5);
    std::vector<float> uf(u.begin(), u.end()), one(u.size()), par(u.size());
    for (auto ns : {muon_ns_dtype::fp32, muon_ns_dtype::bf16}) {
      auto hh = h;
      hh.ns_dtype = ns;
      muon_newton_schulz().run(hh, uf.data(), m, n, one.data());
      muon_newton_schulz().run(hh, uf.data(), m, n, par.data(),
                               [&](std::size_t count, const auto& f) { four.parallel_for(count, f); });
      BOOST_TEST(std::memcmp(one.data(), par.data(), one.size() * sizeof(float)) == 0,
                 m << " x " << n << ", " << muon_ns_dtype_name(ns) << ": 4 threads");
    }
  }
  // Orthogonalisation: a 1 x n matrix maps to about u / |u| times NS's scalar polynomial.
  const auto u = random_matrix(1, 64, 3);
  std::vector<float> uf(u.begin(), u.end()), got(u.size());
  muon_newton_schulz().run(h, uf.data(), 1, 64, got.data());
  double len = 0;
  for (float v : got) len += double(v) * v;
  BOOST_TEST(std::sqrt(len) > 0.5);
  BOOST_TEST(std::sqrt(len) < 1.5);
}

BOOST_AUTO_TEST_CASE(steps_match_float64_muon_and_adamw) {
  const layout l = make_layout(dtype::f32);
  for (bool nesterov : {true, false})
    for (auto adjust : {muon_adjust_lr::original, muon_adjust_lr::match_rms_adamw, muon_adjust_lr::spectral_unclamped}) {
      const auto h = muon_groups(nesterov, adjust);
      const int steps = 30;
      const auto want = reference(l, h, steps);
      const harness::outcome got = run_single<precision<float>>(h, 2, steps);
      double worst = 0;
      for (std::size_t t = 0; t < want.size(); ++t) {
        std::vector<float> p(want[t].size());
        std::memcpy(p.data(), got.params[t].data(), p.size() * sizeof(float));
        for (std::size_t i = 0; i < p.size(); ++i) {
          const double e = std::abs(p[i] - want[t][i]);
          worst = std::max(worst, e / (1e-6 + 1e-5 * std::abs(want[t][i])));
        }
      }
      BOOST_TEST_MESSAGE("nesterov " << nesterov << ", " << muon_adjust_lr_name(adjust) << ": " << worst);
      BOOST_TEST(worst <= 1.0, "nesterov " << nesterov << ", " << muon_adjust_lr_name(adjust)
                                           << ": worst error / (1e-6 + 1e-5 |p|) = " << worst);
    }
}

BOOST_AUTO_TEST_CASE(bit_identical_for_d_1_to_8_and_threads) {
  for (auto ns : {muon_ns_dtype::fp32, muon_ns_dtype::bf16}) {
    const auto h = muon_groups(true, muon_adjust_lr::original, ns);
    const harness::outcome one = run_single<precision<float>>(h, 1);
    BOOST_TEST((run_single<precision<float>>(h, 3) == one), "3 threads");
    for (int d = 1; d <= 8; ++d)
      BOOST_TEST((run_ranks_<precision<float>>(d, h, std::size_t{1} << 22) == one), "d = " << d);
    BOOST_TEST((run_ranks_<precision<float>>(3, h, 512) == one), "buckets of 512");
  }
  // A matrix of several tiles, its Newton-Schulz over 1 or 3 threads, on 1 to 3 ranks.
  {
    const auto h = muon_groups();
    const harness::outcome one = run_single<precision<float>>(h, 1, 20, true);
    BOOST_TEST((run_single<precision<float>>(h, 3, 20, true) == one), "big, 3 threads");
    for (int d : {2, 3})
      BOOST_TEST((run_ranks_<precision<float>>(d, h, 4096, true, {}, 2) == one), "big, d = " << d << ", 2 threads each");
  }
  // bf16 grads reduced in fp32 (the momentum reads the fp32 shard, by local index), and
  // percentile clipping (each tensor's scale).
  {
    const auto h = muon_groups();
    optimizer_options o;
    o.grad_reduce_in_fp32 = true;
    const harness::outcome one = run_single<precision<bf16, bf16>>(h, 1, 20, false, o);
    for (int d : {2, 5}) BOOST_TEST((run_ranks_<precision<bf16, bf16>>(d, h, 512, false, o) == one), "fp32 reduce, d = " << d);
    optimizer_options p;
    p.percentile_clipping = 50;
    const harness::outcome clipped = run_single<precision<float>>(h, 1, 20, false, p);
    BOOST_TEST(!(clipped == run_single<precision<float>>(h, 1)), "clipping changes the run");
    for (int d : {3, 8}) BOOST_TEST((run_ranks_<precision<float>>(d, h, 512, false, p) == clipped), "percentile, d = " << d);
  }
  // bf16 params with fp32 master weights, and bf16 states.
  const auto h = muon_groups();
  const harness::outcome one = run_single<precision<bf16>>(h, 1);
  for (int d : {2, 5, 8})
    BOOST_TEST((run_ranks_<precision<bf16>>(d, h, 512) == one), "bf16 params, d = " << d);
  const harness::outcome s16 = run_single<precision<float>, bf16>(h, 1);
  for (int d : {3, 7}) BOOST_TEST((run_ranks_<precision<float>, bf16>(d, h, 512) == s16), "bf16 states, d = " << d);
}

BOOST_AUTO_TEST_CASE(momentum_and_adamw_states_are_element_states) {
  // Two steps, torch's operation order in float: buf = lerp(buf, g, 0.05) (w < 0.5: buf +
  // w (g - buf)); AdamW's exp_avg = m + 0.1 (g - m), exp_avg_sq = v * 0.999 + (0.001 g) g.
  const auto h = muon_groups();
  const harness::outcome two = run_single<precision<float>>(h, 1, 2);
  const auto values = [&](std::size_t k, std::size_t t) {
    std::vector<float> v(two.states[k][t].size() / sizeof(float));
    std::memcpy(v.data(), two.states[k][t].data(), v.size() * sizeof(float));
    return v;
  };
  const float w = static_cast<float>(1.0 - 0.95), w1 = static_cast<float>(1.0 - 0.9);
  const float b2 = 0.999f, one_minus_b2 = static_cast<float>(1.0 - 0.999);
  const auto buf = values(0, 0);  // w0, Muon
  for (std::size_t i = 0; i < buf.size(); i += 37) {
    float b = 0.0f;
    for (int s = 0; s < 2; ++s) b = b + w * (harness::grad_value(s, 0, i) - b);
    BOOST_TEST(buf[i] == b, "w0[" << i << "]");
  }
  BOOST_TEST(two.states[1][0] == std::vector<unsigned char>(buf.size() * sizeof(float), 0),
             "no second slot for a Muon matrix (nothing collected)");
  const auto m = values(0, 1), v = values(1, 1);  // b0, AdamW
  for (std::size_t i = 0; i < m.size(); ++i) {
    float em = 0.0f, ev = 0.0f;
    for (int s = 0; s < 2; ++s) {
      const float g = harness::grad_value(s, 1, i);
      em = em + w1 * (g - em);
      ev = ev * b2 + (one_minus_b2 * g) * g;
    }
    BOOST_TEST(m[i] == em, "b0 exp_avg[" << i << "]");
    BOOST_TEST(v[i] == ev, "b0 exp_avg_sq[" << i << "]");
  }
}

BOOST_AUTO_TEST_CASE(communication_adds_the_gathered_stage_of_muon_buckets) {
  // AdamW everywhere vs Muon on the matrices: each bucket holding a matrix also all-gathers
  // its fp32 stage, (d - 1) shards of 4 bytes.
  for (int d : {2, 3, 4}) {
    const layout l = make_layout(dtype::f32);
    using opt_t = optimizer<muon, sharded<fp32>, threads>;
    auto adamw = muon_groups();
    adamw[1].use_muon = false;
    const std::size_t sent = harness::three_steps_sent<opt_t>(l, muon_groups(), d);
    const std::size_t expected = harness::gathered_bucket_bytes(l, d, [](const auto& t) { return t.group == 1; });
    BOOST_TEST(expected > 0u);
    BOOST_TEST(sent - harness::three_steps_sent<opt_t>(l, adamw, d) == 3 * expected, "d = " << d);
  }
}

BOOST_AUTO_TEST_CASE(memory_report_and_refusals) {
  const layout l = make_layout(dtype::f32);
  optimizer<muon> opt(l, muon_groups());
  // AdamW's two slots for b0 and norm only, one momentum for the matrices; the stage holds the
  // one bucket, the work the largest matrix's NS buffers (w0: two 30 x 40, two 30 x 30) and
  // its update.
  BOOST_TEST(opt.memory().bytes("state 0") == 730u * 4u);
  BOOST_TEST(opt.memory().bytes("state 1") == 730u * 4u);
  BOOST_TEST(opt.memory().bytes("state momentum") == (1200u + 561u + 1024u + 81u) * 4u);
  BOOST_TEST(opt.local_state("w0", 1).values.empty());
  BOOST_TEST(opt.local_state("w0", 0).values.size() == 1200u);
  BOOST_TEST(opt.local_state("norm", 1).values.size() == 700u);
  const auto plan = detail::shard_plan(l, 1, 0, std::size_t{1} << 22, 1u << 14);
  BOOST_TEST(plan.buckets().size() == 1u);
  BOOST_TEST(opt.memory().bytes("orthogonalization stage") == plan.buckets()[0].padded() * sizeof(float));
  BOOST_TEST(opt.memory().bytes("orthogonalization work") == (2 * 30 * 40 + 2 * 30 * 30 + 40 * 30) * sizeof(float));
  // A vector in a Muon group, as torch.optim.Muon refuses it.
  layout bad;
  bad.add("w", {4, 4}, dtype::f32, 0);
  bad.add("v", {4}, dtype::f32, 0);
  BOOST_CHECK_EXCEPTION((optimizer<muon>(bad, muon::hyper_params{})), std::invalid_argument, [](const auto& e) {
    return std::string(e.what()).find("tensor 'v' is 1-D, in a Muon group") != std::string::npos;
  });
  auto h = muon::hyper_params{};
  BOOST_CHECK_THROW(set_hyper_param<muon>(h, "adjust_lr_fn", "rms"), std::invalid_argument);
  BOOST_CHECK_THROW(set_hyper_param<muon>(h, "ns_dtype", "fp16"), std::invalid_argument);
  BOOST_CHECK_THROW(set_hyper_param<muon>(h, "ns_step", "5"), std::invalid_argument);
  set_hyper_param<muon>(h, "adjust_lr_fn", "None");
  BOOST_TEST((h.adjust_lr_fn == muon_adjust_lr::original));
  h.ns_steps = 100;
  BOOST_CHECK_THROW(h.validate(), invalid_hyper_parameter);
  h.ns_steps = 5;
  h.momentum = 1.0;
  BOOST_CHECK_THROW(h.validate(), invalid_hyper_parameter);
  // set_hyper cannot move a group into or out of Muon (its tensors' slots are fixed).
  optimizer<muon> two(l, muon_groups());
  auto g0 = two.hyper(0);
  g0.use_muon = true;
  BOOST_CHECK_EXCEPTION(two.set_hyper(0, g0), std::invalid_argument, [](const auto& e) {
    return std::string(e.what()).find("group 0 is not a Muon group; use_muon cannot change") != std::string::npos;
  });
  auto g1 = two.hyper(1);
  g1.lr = 0.5;
  two.set_hyper(1, g1);  // other keys may change
  BOOST_TEST(two.hyper(1).lr == 0.5);
  // The text form reads back.
  auto g = muon_groups(false, muon_adjust_lr::match_rms_adamw, muon_ns_dtype::bf16)[1];
  muon::hyper_params back;
  const std::string text = hyper_params_string<muon>(g);
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t sp = std::min(text.find(' ', at), text.size()), eq = text.find('=', at);
    set_hyper_param<muon>(back, text.substr(at, eq - at), text.substr(eq + 1, sp - eq - 1));
    at = sp + 1;
  }
  BOOST_TEST(hyper_params_string<muon>(back) == text);
}
