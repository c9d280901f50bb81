// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ctest `experts`: joint_step over the dense and expert grids against one optimizer holding
// every expert (experts_harness.hpp), for AdamW (fp32, bf16 + master, q8 states, and under
// ZeRO-Offload), Lamb, and Adafactor at ZeRO-2; Muon in experts_muon.cpp (with BLAS).
// Checkpoints saved on one grid and resumed on another (with xxHash:
// DISTOPT_EXPERTS_CHECKPOINT).

#include "experts_harness.hpp"

#if defined(__linux__)
#include <distopt/exec/emulated.hpp>
#endif

#if DISTOPT_EXPERTS_CHECKPOINT
#include <distopt/checkpoint.hpp>

#include <atomic>
#include <filesystem>

#include <unistd.h>
#endif

using namespace experts_test;

BOOST_AUTO_TEST_SUITE(experts)

BOOST_AUTO_TEST_CASE(adamw_fp32_sharded) { check_grids<distopt::adamw, distopt::sharded<distopt::fp32>>(); }

BOOST_AUTO_TEST_CASE(adamw_bf16_with_master) {
  check_grids<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::precision<distopt::bf16>>();
}

BOOST_AUTO_TEST_CASE(adamw_q8) { check_grids<distopt::adamw, distopt::sharded<distopt::q8>>(); }

BOOST_AUTO_TEST_CASE(adafactor_zero2) { check_grids<distopt::adafactor, distopt::sharded<distopt::fp32, 2>>(); }

// Lamb's trust ratio per expert (each expert is a tensor): as when experts are separate
// parameters, and the same on any EP without a norm over it.
BOOST_AUTO_TEST_CASE(lamb_per_expert) { check_grids<distopt::lamb, distopt::sharded<distopt::fp32>>(); }

#if defined(__linux__)
// ZeRO-Offload (the emulated device): both optimizers' halves of the joint step on the host.
BOOST_AUTO_TEST_CASE(adamw_offload) {
  check_grids<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::precision<float>,
              distopt::offload<distopt::emulated_device>>();
}
#endif

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
      for (std::size_t j = 0; j < expert_tensors().size(); ++j) add_tensor<float>(le, expert_logical(j), expert_tensors()[j], 1, e);
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

BOOST_AUTO_TEST_CASE(add_experts_refuses_what_is_not_one_expert_tensor) {
  using namespace distopt;
  const auto refused = [](auto add, const std::string& says) {
    layout l;
    l.add_experts("w", 8, {0, 2}, {4, 3});
    const std::size_t before = l.tensors().size();
    bool thrown = false;
    try {
      add(l);
    } catch (const std::invalid_argument& e) {
      thrown = std::string(e.what()).find(says) != std::string::npos;
      if (!thrown) BOOST_TEST_MESSAGE(e.what());
    }
    BOOST_TEST(thrown, says);
    BOOST_TEST(l.tensors().size() == before);  // nothing registered
  };
  refused([](layout& l) { l.add_experts("v", 8, {6, 3}, {4}); }, "experts 6 to 8 are not a non-empty range of its 8");
  refused([](layout& l) { l.add_experts("v", 0, {0, 1}, {4}); }, "'v' has 0 experts");
  refused([](layout& l) { l.add_experts("w", 8, {2, 2}, {4, 4}); }, "expert 2 differs from expert 0");
  refused([](layout& l) { l.add_experts("w", 4, {2, 2}, {4, 3}); }, "differs from expert 0");
  refused([](layout& l) { l.add_experts("w", 8, {1, 2}, {4, 3}); }, "tensor 'w[1]' is already registered");
  layout l;
  l.add_experts("w", 8, {2, 2}, {4, 3}, dtype::bf16, 1, tp_split::rows);
  BOOST_TEST(l.tensors().size() == 2u);
  BOOST_TEST(l.find("w[3]").expert == 3);
  BOOST_TEST(l.find("w[3]").experts == 8);
  BOOST_TEST(l.find("w[3]").experts_of == "w");
  BOOST_TEST(l.find("w[2]").group == 1);
}

BOOST_AUTO_TEST_CASE(an_expert_optimizer_needs_the_ranks_of_the_other_experts) {
  // Two of four experts on one rank: without an expert-parallel group of 2 ranks, a joint
  // step would leave half the experts out of the norm, and a checkpoint half the experts.
  using namespace distopt;
  using opt = optimizer<adamw>;
  layout ld, le;
  ld.add("d", {4});
  le.add_experts("w", 4, {0, 2}, {4});
  opt d(ld, adamw::hyper_params{}), x(le, adamw::hyper_params{});
  const auto names = [](const char* says) {
    return [says](const std::logic_error& e) { return std::string(e.what()).find(says) != std::string::npos; };
  };
  BOOST_CHECK_EXCEPTION(joint_step(d, x), std::logic_error, names("holds 2 of the 4 experts of 'w' over an expert-parallel group of 1 rank"));
  BOOST_CHECK_EXCEPTION(x.set_expert_parallel_group(single{}), std::logic_error, names("set_expert_parallel_group(m.ep)"));
}

BOOST_AUTO_TEST_CASE(an_expert_group_holds_each_rank_its_own_experts_and_nothing_else) {
  // Two ranks, 4 experts: each must hold its run of experts (mesh::experts), and no dense
  // tensor (it would count twice in the norm). Its own step may not need the global norm.
  using namespace distopt;
  using opt = optimizer<adamw, sharded<fp32>, threads>;
  std::vector<std::string> said(8);
  const auto says = [&](int k, auto&& f) {
    try {
      f();
    } catch (const std::logic_error& e) {
      said[static_cast<std::size_t>(k)] = e.what();
    }
  };
  run_ranks(2, [&](threads& w) {
    const int me = w.rank();
    layout mixed, swapped, mine;
    mixed.add_experts("w", 4, {2 * me, 2}, {8});
    mixed.add("dense", {8});
    swapped.add_experts("w", 4, {2 - 2 * me, 2}, {8});  // rank 0 holds experts 2-3
    mine.add_experts("w", 4, {2 * me, 2}, {8});
    threads a = w.split(0, me), b = w.split(0, me), c = w.split(0, me), ep = w.split(0, me);
    opt x(mixed, adamw::hyper_params{}, optimizer_options{}, cpu{}, w.split(me, 0));
    opt y(swapped, adamw::hyper_params{}, optimizer_options{}, cpu{}, w.split(me, 0));
    optimizer_options clipped;
    clipped.max_grad_norm = 1.0;
    opt z(mine, adamw::hyper_params{}, clipped, cpu{}, w.split(me, 0));
    optimizer_options unchecked;
    unchecked.check_finite = false;
    opt u(mine, adamw::hyper_params{}, unchecked, cpu{}, w.split(me, 0));
    says(4 * me + 0, [&] { x.set_expert_parallel_group(std::move(a)); });
    says(4 * me + 1, [&] { y.set_expert_parallel_group(std::move(b)); });
    z.set_expert_parallel_group(std::move(c));
    says(4 * me + 2, [&] { z.step(); });
    says(4 * me + 3, [&] { z.clip_grad_norm(1.0); });
    u.set_expert_parallel_group(std::move(ep));
    u.step();  // no norm needed (no clipping, no finite check): each rank's experts step alone
  });
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(said[4 * r + 0].find("tensor 'dense' is not an expert tensor") != std::string::npos);
      BOOST_TEST(said[4 * r + 1].find("holds experts " + std::to_string(2 * r) + " to " + std::to_string(2 * r + 1)) !=
                 std::string::npos);
      BOOST_TEST(said[4 * r + 2].find("step: this optimizer's experts are spread") != std::string::npos);
      BOOST_TEST(said[4 * r + 3].find("clip_grad_norm: this optimizer's experts are spread") != std::string::npos);
    }
  }
}

#if DISTOPT_EXPERTS_CHECKPOINT
namespace {
/// A fresh directory, removed at the end of the test.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    static std::atomic<int> n{0};
    path = std::filesystem::temp_directory_path() / ("distopt-experts-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    std::filesystem::remove_all(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
};
/// A run's hook: saves (`save`) or loads the two optimizers' checkpoints, in dir/dense and
/// dir/experts.
struct checkpoints {
  std::filesystem::path dir;
  bool save = false;
  template <class Opt>
  void operator()(Opt& d, Opt& x) const {
    for (const auto& [o, sub] : {std::pair{&d, "dense"}, std::pair{&x, "experts"}})
      save ? o->save(dir / sub) : o->load(dir / sub);
  }
};

/// The expert optimizer's checkpoint in `dir` records each expert tensor as its logical
/// [experts, ...] tensor: one identity key per expert tensor, and every expert's items a box
/// at its own index along the experts axis; the rank files hold every expert once.
void check_logical_experts(const std::filesystem::path& dir) {
  namespace io = distopt::io;
  const auto bytes = io::detail::read_whole_file(dir / "index.json");
  const io::detail::checkpoint_index index =
      io::detail::parse_index(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), "index.json");
  for (std::size_t j = 0; j < expert_tensors().size(); ++j) BOOST_TEST(index.identity.contains("experts " + expert_logical(j)));
  BOOST_TEST(std::none_of(index.identity.begin(), index.identity.end(), [](const auto& kv) { return kv.first.starts_with("tensor "); }));
  std::vector<int> params_saved(experts_total, 0);  // "w0[e]/param" slices, by expert
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".safetensors") continue;
    const auto header = io::safetensors_reader::open_header(f.path());
    for (const auto& [name, rec] : io::detail::parse_items(header.metadata().at("distopt.items"), f.path().string())) {
      const int e = std::stoi(name.substr(name.find('[') + 1));
      BOOST_TEST_CONTEXT(name) {
        BOOST_TEST(rec.tp.whole.size() >= 2u);
        if (rec.tp.whole.empty()) continue;
        BOOST_TEST(rec.tp.whole.front() == experts_total);
        BOOST_TEST(rec.tp.box.front() == 1);
        BOOST_TEST(rec.tp.offset.front() == e);
      }
      if (name.starts_with("w0[") && name.ends_with("]/param") && rec.count > 0) ++params_saved[static_cast<std::size_t>(e)];
    }
  }
  for (int e = 0; e < experts_total; ++e) BOOST_TEST(params_saved[static_cast<std::size_t>(e)] >= 1, "expert " << e);
}

/// Steps 0-2 on grid `a`, saved; loaded on grid `b` (another TP, EP or DP size), steps 3-5
/// (a NaN at step 3: skipped), against the reference's six steps on b's TP, bit for bit.
template <class Policy, class Storage>
void check_resume(grid a, grid b) {
  using P = distopt::precision<float>;
  const moe_result ref = run<Policy, Storage, P>(b.tp, b.tp, std::nullopt);
  temp_dir dir;
  run<Policy, Storage, P>(a.tp, a.world, a.ep, run_span<no_hook, checkpoints>{0, nan_step, {}, {dir.path, true}});
  check_logical_experts(dir.path / "experts");
  const moe_result r = run<Policy, Storage, P>(b.tp, b.world, b.ep, run_span<checkpoints>{nan_step, steps, {dir.path, false}, {}});
  BOOST_TEST_CONTEXT("saved at tp " << a.tp << ", ep " << a.ep << ", world " << a.world << "; resumed at tp " << b.tp
                                    << ", ep " << b.ep << ", world " << b.world) {
    BOOST_TEST(r.ranks_agree);
    const std::size_t n = steps - nan_step;  // the norms (bits: exact sums) and skips of the steps resumed
    BOOST_TEST(std::memcmp(r.norms.data() + nan_step, ref.norms.data() + nan_step, n * sizeof(double)) == 0);
    BOOST_TEST(std::equal(r.skipped.begin() + nan_step, r.skipped.end(), ref.skipped.begin() + nan_step));
    BOOST_TEST(same_bits(r.params, ref.params));
    BOOST_TEST(same_bits(r.states, ref.states));
  }
}
}  // namespace

BOOST_AUTO_TEST_CASE(checkpoint_resumes_on_another_ep_dp_and_tp) {
  using distopt::adamw;
  using distopt::sharded;
  using distopt::fp32;
  check_resume<adamw, sharded<fp32>>({1, 2, 4}, {2, 4, 8});  // EP 2 -> 4, TP 1 -> 2, expert-DP 2 -> 1
  check_resume<adamw, sharded<fp32>>({2, 1, 4}, {1, 4, 4});  // EP 1 -> 4, TP 2 -> 1
  check_resume<adamw, sharded<fp32>>({2, 4, 8}, {1, 1, 1});  // every expert back on one rank
  check_resume<adamw, sharded<fp32>>({2, 1, 4}, {1, 2, 4});  // as many parts (2), other experts in each
  check_resume<adamw, sharded<distopt::q8>>({1, 2, 4}, {1, 4, 8});  // 8-bit blocks within one expert
  check_resume<adamw, sharded<distopt::q8>>({1, 4, 4}, {1, 1, 2});
  check_resume<distopt::adafactor, sharded<fp32, 2>>({2, 2, 8}, {2, 1, 4});  // factored states per expert
  check_resume<distopt::adafactor, sharded<fp32, 2>>({1, 1, 2}, {1, 4, 8});
}

BOOST_AUTO_TEST_CASE(checkpoint_moves_experts_between_parts_of_one_count) {
  // Experts replicated over ETP (tp none): saved on ETP 1 x EP 2, loaded on ETP 2 x EP 1.
  // Both have two parts and the same identity, but the first part now holds experts 2-3
  // too, which the second part saved: each expert's params come back whole.
  using namespace distopt;
  using opt = optimizer<adamw, sharded<fp32>, threads>;
  temp_dir dir;
  const auto value = [](int e, std::size_t i) { return static_cast<float>(100 * e) + static_cast<float>(i); };
  std::vector<int> wrong(2, -1);
  for (const int ep : {2, 1})
    run_ranks(2, [&](threads& w) {
      mesh<threads> g = make_mesh(w, {.tp = 1, .ep = ep, .etp = 2 / ep});
      const expert_range mine = g.experts(4);
      layout l;
      l.add_experts("b", 4, mine, {300});
      opt x(l, adamw::hyper_params{}, optimizer_options{}, cpu{}, std::move(g.edp));
      if (g.etp.size() > 1) x.set_tensor_parallel_group(std::move(g.etp));
      x.set_expert_parallel_group(std::move(g.ep));
      if (ep == 2) {
        for (int e = mine.first; e < mine.first + mine.count; ++e) {
          const auto p = x.param(expert_tensor_name("b", e));
          for (std::size_t i = 0; i < p.size(); ++i) p[i] = value(e, i);
        }
        x.save(dir.path);
      } else {
        x.load(dir.path);
        int bad = 0;
        for (int e = mine.first; e < mine.first + mine.count; ++e) {
          const auto p = x.param(expert_tensor_name("b", e));
          for (std::size_t i = 0; i < p.size(); ++i) bad += p[i] != value(e, i);
        }
        wrong[static_cast<std::size_t>(w.rank())] = bad;
      }
    });
  BOOST_TEST(wrong == std::vector<int>({0, 0}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(checkpoint_of_other_experts_is_refused) {
  // A checkpoint of 4 experts does not load into an optimizer of 8 (nor of other shapes).
  using namespace distopt;
  using opt = optimizer<adamw>;
  temp_dir dir;
  layout a, b;
  a.add_experts("w", 4, {0, 4}, {4, 3});
  b.add_experts("w", 8, {0, 8}, {4, 3});
  opt x(a, adamw::hyper_params{}), y(b, adamw::hyper_params{});
  x.save(dir.path);
  BOOST_CHECK_EXCEPTION(y.load(dir.path), io::checkpoint_error, [](const io::checkpoint_error& e) {
    const std::string w = e.what();
    return w.find("whole experts w 'w' [4, 4, 3]") != std::string::npos && w.find("'w' [8, 4, 3]") != std::string::npos;
  });
}
#endif

BOOST_AUTO_TEST_SUITE_END()
