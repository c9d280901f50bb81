// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ctest `experts`: joint_step over the dense and expert grids against one optimizer holding
// every expert (experts_harness.hpp), for AdamW (fp32, bf16 + master, q8 states) and
// Adafactor at ZeRO-2; Muon in experts_muon.cpp (with BLAS).

#include "experts_harness.hpp"

using namespace experts_test;

BOOST_AUTO_TEST_SUITE(experts)

BOOST_AUTO_TEST_CASE(adamw_fp32_sharded) { check_grids<distopt::adamw, distopt::sharded<distopt::fp32>>(); }

BOOST_AUTO_TEST_CASE(adamw_bf16_with_master) {
  check_grids<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::precision<distopt::bf16>>();
}

BOOST_AUTO_TEST_CASE(adamw_q8) { check_grids<distopt::adamw, distopt::sharded<distopt::q8>>(); }

BOOST_AUTO_TEST_CASE(adafactor_zero2) { check_grids<distopt::adafactor, distopt::sharded<distopt::fp32, 2>>(); }

BOOST_AUTO_TEST_CASE(joint_memory_counts_each_optimizer_over_its_own_group) {
  // 4 ranks, tp 1, ep 2: the dense states are sharded over all 4 ranks, each expert's over
  // the 2 ranks of its expert-DP group; the params are whole on every rank that holds them.
  using namespace distopt;
  using opt = optimizer<adamw, sharded<fp32>, threads>;
  struct seen_t {
    std::size_t state = 0, expert_state = 0, params = 0, expert_params = 0, parameters = 0;
    int ep = 0;
  };
  std::vector<seen_t> seen(4);
  std::size_t dense_elems = 0, expert_elems = 0;  // the whole model's
  for (const auto& x : dense_tensors()) dense_elems += numel(x);
  for (const auto& x : expert_tensors()) expert_elems += experts_total * numel(x);
  run_ranks(4, [&](threads& w) {
    mesh<threads> g = make_mesh(w, {.tp = 1, .ep = 2});
    layout ld, le;
    for (std::size_t i = 0; i < dense_tensors().size(); ++i) add_tensor<float>(ld, dense_name(i), dense_tensors()[i], 1);
    const expert_range mine = g.experts(experts_total);
    for (int e = mine.first; e < mine.first + mine.count; ++e)
      for (std::size_t j = 0; j < expert_tensors().size(); ++j) add_tensor<float>(le, expert_name(e, j), expert_tensors()[j], 1);
    const int ep = g.at.ep;
    opt d(ld, groups<adamw>(), options(), make_executor<cpu>(1), std::move(g.dp));
    opt x(le, groups<adamw>(), options(), make_executor<cpu>(1), std::move(g.edp));
    const memory_report r = joint_memory(d, x);
    seen[static_cast<std::size_t>(w.rank())] = {r.bytes("state 0"), r.bytes("experts state 0"), r.bytes("params"),
                                                r.bytes("experts params"), r.parameters, ep};
  });
  std::size_t state = 0, expert_state[2] = {0, 0};
  for (const seen_t& s : seen) {
    state += s.state;
    expert_state[s.ep] += s.expert_state;
    BOOST_TEST(s.params == 4 * dense_elems);
    BOOST_TEST(s.expert_params == 4 * expert_elems / 2);  // half the experts
    BOOST_TEST(s.parameters == dense_elems + expert_elems / 2);
  }
  BOOST_TEST(state == 4 * dense_elems);             // once over the 4 dense DP ranks
  BOOST_TEST(expert_state[0] == 4 * expert_elems / 2);  // once over each expert-DP pair
  BOOST_TEST(expert_state[1] == 4 * expert_elems / 2);
}

BOOST_AUTO_TEST_CASE(joint_step_refuses_options_that_would_decide_differently) {
  using opt = distopt::optimizer<distopt::adamw>;
  distopt::layout l;
  l.add("w", {4}, distopt::dtype::f32);
  distopt::optimizer_options a, b;
  b.max_grad_norm = 1.0;
  const distopt::adamw::hyper_params h{};
  opt x(l, h, a), y(l, h, b), z(l, h, a);
  distopt::single ep;
  BOOST_CHECK_EXCEPTION(distopt::joint_step(x, y, ep), std::invalid_argument, [](const std::invalid_argument& e) {
    return std::string(e.what()).find("max_grad_norm (0.000000 and 1.000000)") != std::string::npos;
  });
  x.clip_grad_norm(1.0);
  BOOST_CHECK_THROW(distopt::joint_step(x, z, ep), std::logic_error);
}

BOOST_AUTO_TEST_SUITE_END()
