// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Checkpoints: train K steps on d ranks, save, load on d' ranks in a fresh optimizer and
// train N more; params, master weights, every state slot, row/column states, GaLore's
// low-rank states and projections must equal an uninterrupted K+N-step run bit for bit,
// for every d, d' in 1..8 and every policy family. Then the refusals (corrupt, truncated,
// missing, mismatched), each leaving the optimizer untouched, and the crash test: a writer
// process killed at random points never leaves a checkpoint that does not load.
#include <boost/test/unit_test.hpp>

#include <distopt/checkpoint.hpp>
#include <distopt/distopt.hpp>
#ifdef DISTOPT_TEST_GALORE
#include <distopt/policy/galore_adamw.hpp>
#include "muon_cases.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#if defined(__linux__)
#include "emulated_harness.hpp"
#endif
#include "scratch_dir.hpp"
#include "sharded_harness.hpp"

using namespace distopt;
namespace fs = std::filesystem;

namespace {

using harness::scratch_dir;

/// Everything a run leaves: the harness's params/master/states plus the whole items
/// (row and column states, projected states and projections) by name.
struct snapshot {
  harness::outcome base;
  std::map<std::string, std::vector<float>> whole;
  std::int64_t step = 0;
  bool operator==(const snapshot&) const = default;
};

/// Steps [s0, s1) with the rank-0 trick (sum reduction); clips when `clip` > 0.
template <class Opt>
void run_steps(Opt& opt, int rank, int s0, int s1, double clip) {
  using G = typename Opt::grad_type;
  const auto tensors = opt.tensors().tensors();
  for (int s = s0; s < s1; ++s) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      std::vector<G> g(tensors[t].numel);
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = from_float<G>(rank == 0 ? harness::grad_value(s, t, i) * static_cast<float>(opt.loss_scale()) : 0.0f);
      upload(opt.executor(), g, opt.grad(tensors[t].name));
    }
    if (clip > 0) opt.clip_grad_norm(clip);
    opt.step();
    opt.zero_grad();
  }
}

template <class Opt>
void collect_whole(Opt& opt, snapshot& out, std::mutex& m) {
  using Policy = typename Opt::policy_type;
  for (const auto& t : opt.tensors().tensors()) {
    const auto put = [&](std::string name, std::span<const float> v) {
      if (v.empty()) return;
      std::lock_guard<std::mutex> lock(m);
      out.whole.try_emplace(std::move(name), v.begin(), v.end());
    };
    if constexpr (Opt::is_layerwise) {
      for (int k = 0; k < Policy::row_states; ++k) put(t.name + "/row" + std::to_string(k), opt.row_state(t.name, k));
      for (int k = 0; k < Policy::col_states; ++k) put(t.name + "/col" + std::to_string(k), opt.col_state(t.name, k));
    }
    if constexpr (Opt::projects) {
      try {
        for (int k = 0; k < 2; ++k) {
          const auto v = opt.projected_state(t.name, k);
          put(t.name + "/projected" + std::to_string(k), v);
        }
        put(t.name + "/left", opt.projector(t.name).left());
        put(t.name + "/right", opt.projector(t.name).right());
      } catch (const std::out_of_range&) {  // not projected
      }
    }
  }
}

/// One run on d ranks (threads; `Comm` is made from each rank's handle): optionally load
/// `from` first (else initialise the params), steps [s0, s1), optionally save to `to`;
/// returns the state at the end.
template <class Policy, class Storage, class Prec, class Exec = cpu, class Comm = threads>
snapshot run(int d, const layout& l, const std::vector<typename Policy::hyper_params>& h, optimizer_options o,
             int s0, int s1, const fs::path* from, const fs::path* to, double clip = 0) {
  using opt_t = optimizer<Policy, Storage, Comm, Exec, Prec>;
  o.grad_reduce = reduce_op::sum;
  snapshot out;
  out.base = harness::blank<opt_t>(l, Policy::state_slots(h.front()));
  std::mutex m;
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, o, Exec(1), Comm(std::move(comm)));
    if (from) opt.load(*from);
    else harness::set_initial_params(opt);
    run_steps(opt, rank, s0, s1, clip);
    if (to) opt.save(*to);
    harness::collect(opt, rank, out.base);
    collect_whole(opt, out, m);
    if (rank == 0) out.step = opt.step_count();
  });
  return out;
}

/// Saves after K steps on every d in 1..8, loads each on every d' in 1..8, runs N more,
/// and compares with the uninterrupted run on one rank.
template <class Policy, class Storage, class Prec = precision<float>>
void check_resharding(const std::string& tag, const layout& l, const std::vector<typename Policy::hyper_params>& h,
                      optimizer_options o, int K, int N, double clip = 0) {
  const snapshot reference = run<Policy, Storage, Prec>(1, l, h, o, 0, K + N, nullptr, nullptr, clip);
  BOOST_TEST_REQUIRE(reference.step == K + N);
  int mismatches = 0;
  for (int d = 1; d <= 8; ++d) {
    scratch_dir dir(tag);
    run<Policy, Storage, Prec>(d, l, h, o, 0, K, nullptr, &dir.path, clip);
    for (int d2 = 1; d2 <= 8; ++d2) {
      const snapshot resumed = run<Policy, Storage, Prec>(d2, l, h, o, K, K + N, &dir.path, nullptr, clip);
      if (!(resumed == reference)) {
        ++mismatches;
        BOOST_TEST_MESSAGE(tag << ": saved on " << d << " ranks, resumed on " << d2 << ": differs");
        BOOST_TEST((resumed.base.params == reference.base.params));
        BOOST_TEST((resumed.base.master == reference.base.master));
        BOOST_TEST((resumed.base.states == reference.base.states));
        BOOST_TEST((resumed.whole == reference.whole));
      }
    }
  }
  BOOST_TEST(mismatches == 0, tag << ": " << mismatches << " of 64 (d, d') pairs differ");
  // And the checkpoint really matters: resuming from a checkpoint of another step differs.
  scratch_dir early(tag + "-early");
  run<Policy, Storage, Prec>(2, l, h, o, 0, K - 1, nullptr, &early.path, clip);
  const snapshot wrong = run<Policy, Storage, Prec>(3, l, h, o, K, K + N, &early.path, nullptr, clip);
  BOOST_TEST(!(wrong.base.params == reference.base.params));
}

#if defined(__linux__)
/// Checkpoints of device memory (the emulated device, its ranks' collectives by `Comm`):
/// saved there and resumed on the CPU executor, and saved on the CPU and resumed there, on
/// other numbers of ranks, give the uninterrupted CPU run.
template <class Policy, class Storage, class Prec = precision<float>, class Comm = threads>
void check_device_interchange(const std::string& tag, const layout& l,
                              const std::vector<typename Policy::hyper_params>& h, optimizer_options o, int K, int N) {
  const snapshot reference = run<Policy, Storage, Prec>(1, l, h, o, 0, K + N, nullptr, nullptr);
  for (const auto& [d, d2] : {std::pair{1, 3}, std::pair{2, 1}, std::pair{3, 2}}) {
    scratch_dir on_device(tag + "-device"), on_cpu(tag + "-cpu");
    run<Policy, Storage, Prec, emulated_device, Comm>(d, l, h, o, 0, K, nullptr, &on_device.path);
    BOOST_TEST((run<Policy, Storage, Prec>(d2, l, h, o, K, K + N, &on_device.path, nullptr) == reference),
               tag << ": saved on the device on " << d << " ranks, resumed on cpu on " << d2);
    run<Policy, Storage, Prec>(d, l, h, o, 0, K, nullptr, &on_cpu.path);
    BOOST_TEST((run<Policy, Storage, Prec, emulated_device, Comm>(d2, l, h, o, K, K + N, &on_cpu.path, nullptr) ==
                reference),
               tag << ": saved on cpu on " << d << " ranks, resumed on the device on " << d2);
  }
}
#endif

layout mixed_layout(dtype t) {
  layout l;
  l.add("emb", {40, 30}, t);
  l.add("bias", {3}, t);
  l.add("w", {17, 33}, t);
  l.add("batch", {3, 4, 5}, t);
  l.add("norm", {700}, t);
  l.add("one", {1}, t);
  l.add("big", {2000}, t);
  return l;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(resharding)

BOOST_AUTO_TEST_CASE(adamw_fp32) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  check_resharding<adamw, sharded<fp32>>("adamw", mixed_layout(dtype::f32), {h}, {}, 4, 3, 1.0);
}

BOOST_AUTO_TEST_CASE(adamw_bf16_master_loss_scale) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.amsgrad = true;
  optimizer_options o;
  o.loss_scale = dynamic_loss_scale{1024.0, 2.0, 0.5, 2};  // the scale changes during the run
  check_resharding<adamw, sharded<bf16>, precision<bf16, bf16>>("adamw-bf16", mixed_layout(dtype::bf16), {h}, o, 3, 3);
}

BOOST_AUTO_TEST_CASE(lion_bf16_stochastic_rounding) {
  lion::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.1;
  optimizer_options o;
  o.master_weights = false;  // bf16 params updated with stochastic rounding
  o.seed = 1234;
  check_resharding<lion, sharded<fp32>, precision<bf16>>("lion-sr", mixed_layout(dtype::bf16), {h}, o, 3, 3);
}

BOOST_AUTO_TEST_CASE(sgd_nesterov) {
  sgd::hyper_params h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.nesterov = true;
  check_resharding<sgd, sharded<fp32>>("sgd", mixed_layout(dtype::f32), {h}, {}, 3, 2);
}

/// A checkpoint's hyper-parameters reach the steps after the load, also in an optimizer that
/// stepped before it loaded (its step tables of the groups were made then): built with other
/// groups (another lr, one group without momentum, so another slot count), it steps once,
/// loads, and continues as the run that saved, on the host and on the emulated device. With
/// the tables kept after the load, group "b" took no update on the host (its slot count was
/// the one it was built with) and the old lr on the device.
template <class Exec>
void check_loaded_groups(const std::string& tag) {
  layout l;
  l.add("a", {300}, dtype::f32, 0);
  l.add("b", {200}, dtype::f32, 1);
  sgd::hyper_params a;
  a.lr = 0.1;
  a.momentum = 0.9;
  sgd::hyper_params b = a;
  b.lr = 0.05;
  sgd::hyper_params other = b;
  other.lr = 0.5;
  other.momentum = 0.0;
  const std::vector<sgd::hyper_params> saved{a, b}, built{a, other};
  using opt_t = optimizer<sgd, replicated<fp32>, single, Exec>;
  const auto steps = [](opt_t& opt, int s0, int s1) {
    const auto tensors = opt.tensors().tensors();
    for (int s = s0; s < s1; ++s) {
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        std::vector<float> g(tensors[t].numel);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = harness::grad_value(s, t, i);
        upload(opt.executor(), g, opt.grad(tensors[t].name));
      }
      opt.step();
    }
  };
  const auto params = [&](opt_t& opt) {
    harness::outcome out = harness::blank<opt_t>(l, 1);
    harness::collect(opt, 0, out);
    return out;
  };
  scratch_dir dir(tag);
  opt_t reference(l, saved, {}, Exec(1));
  harness::set_initial_params(reference);
  steps(reference, 0, 3);
  reference.save(dir.path);
  steps(reference, 3, 6);
  opt_t resumed(l, built, {}, Exec(1));
  harness::set_initial_params(resumed);
  steps(resumed, 0, 1);
  resumed.load(dir.path);
  BOOST_TEST(resumed.hyper(1).momentum == 0.9);
  steps(resumed, 3, 6);
  const harness::outcome want = params(reference), got = params(resumed);
  BOOST_TEST((got.params == want.params), tag);
  BOOST_TEST((got.states == want.states), tag);
}

BOOST_AUTO_TEST_CASE(loaded_groups_reach_the_next_step) {
  check_loaded_groups<cpu>("groups-cpu");
#if defined(__linux__)
  check_loaded_groups<emulated_device>("groups-device");
#endif
}

/// A checkpoint records the step() calls, skipped ones included, so that a resumed loop
/// continues after the last call (a NaN step before the save made it repeat one), and a
/// seed of 2^63 or more (a uint64) loads.
BOOST_AUTO_TEST_CASE(calls_and_seed_survive_a_load) {
  layout l;
  l.add("w", {100}, dtype::f32);
  sgd::hyper_params h;
  h.lr = 0.1;
  optimizer_options o;
  o.seed = (std::uint64_t{1} << 63) + 12345;
  using opt_t = optimizer<sgd, replicated<fp32>, single, cpu>;
  opt_t saving(l, {h}, o, cpu(1));
  for (int s = 0; s < 3; ++s) {
    auto g = saving.grad("w");
    std::fill(g.begin(), g.end(), 0.5f);
    if (s == 1) g[7] = std::numeric_limits<float>::quiet_NaN();
    BOOST_TEST(saving.step().skipped == (s == 1));
  }
  BOOST_TEST(saving.step_calls() == 3);
  BOOST_TEST(saving.steps_skipped() == 1);
  scratch_dir dir("calls-seed");
  saving.save(dir.path);
  opt_t loaded(l, {h}, {}, cpu(1));
  loaded.load(dir.path);
  BOOST_TEST(loaded.step_count() == 2);
  BOOST_TEST(loaded.step_calls() == 3);
  BOOST_TEST(loaded.steps_skipped() == 1);
  BOOST_TEST(loaded.options().seed == o.seed);
}

/// A save into a directory that holds another optimizer's checkpoint (another policy, or
/// another model) refuses, naming both, and leaves it loadable; checkpoint_replace::anything
/// replaces it; a checkpoint of the same optimizer is replaced as before.
BOOST_AUTO_TEST_CASE(save_refuses_another_optimizers_checkpoint) {
  layout l;
  l.add("w", {300}, dtype::f32);
  layout other_model;
  other_model.add("v", {300}, dtype::f32);
  scratch_dir dir("other-optimizer");
  optimizer<adamw, replicated<fp32>, single, cpu> a(l, {adamw::hyper_params{}}, {}, cpu(1));
  a.save(dir.path);
  optimizer<adamw, replicated<fp32>, single, cpu> again(l, {adamw::hyper_params{}}, {}, cpu(1));
  again.save(dir.path);  // the same optimizer: replaced
  optimizer<lion, replicated<fp32>, single, cpu> b(l, {lion::hyper_params{}}, {}, cpu(1));
  const auto names = [](const char* want) {
    return [want](const io::checkpoint_error& e) {
      BOOST_TEST_MESSAGE(e.what());
      return std::string(e.what()).find(want) != std::string::npos;
    };
  };
  BOOST_CHECK_EXCEPTION(b.save(dir.path), io::checkpoint_error, names("a checkpoint of adamw (this optimizer is lion)"));
  optimizer<adamw, replicated<fp32>, single, cpu> c(other_model, {adamw::hyper_params{}}, {}, cpu(1));
  BOOST_CHECK_EXCEPTION(c.save(dir.path), io::checkpoint_error, names("a checkpoint of another model (no tensor v)"));
  a.load(dir.path);  // still adamw's
  b.save(dir.path, checkpoint_replace::anything);
  b.load(dir.path);
  BOOST_CHECK_THROW(a.load(dir.path), io::checkpoint_error);
}

/// Crafted but self-consistent rank files: rank 1's file replaced by a copy of rank 0's,
/// and the index's record of it (size, header checksum, the index's own checksum) made to
/// match, so the slices of rank 0's half appear twice and rank 1's nowhere. The elements
/// read add up to the elements needed; the load must still refuse (it installed
/// uninitialised bytes for the hole before it checked coverage per element).
BOOST_AUTO_TEST_CASE(duplicate_slices_leave_no_hole) {
  layout l;
  l.add("w", {1024}, dtype::f32);  // 512 elements on each rank: rank 0's twice add up to 1,024
  adamw::hyper_params h;
  scratch_dir dir("duplicate-slices");
  run_ranks(2, [&](threads& comm) {
    optimizer<adamw, sharded<fp32>, threads, cpu> opt(l, {h}, {}, cpu(1), std::move(comm));
    auto p = opt.param("w");
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = 1.0f + static_cast<float>(i);
    opt.save(dir.path);
  });
  const auto text = io::detail::read_whole_file(dir.path / "index.json");
  auto index = io::detail::parse_index(std::string(reinterpret_cast<const char*>(text.data()), text.size()), "index.json");
  BOOST_TEST_REQUIRE(index.files.size() == 1u);
  auto& files = index.files[0];
  BOOST_TEST_REQUIRE(files.size() == 2u);
  fs::copy_file(dir.path / files[0].name, dir.path / files[1].name, fs::copy_options::overwrite_existing);
  files[1].bytes = files[0].bytes;
  files[1].header_hash = files[0].header_hash;
  {
    std::ofstream out(dir.path / "index.json", std::ios::binary | std::ios::trunc);
    out << io::detail::index_text(index);
  }
  optimizer<adamw, replicated<fp32>, single, cpu> one(l, {h}, {}, cpu(1));
  BOOST_CHECK_EXCEPTION(one.load(dir.path), io::checkpoint_error, [](const io::checkpoint_error& e) {
    BOOST_TEST_MESSAGE(e.what());
    return std::string(e.what()).find("the rank files hold no element") != std::string::npos;
  });
}

BOOST_AUTO_TEST_CASE(adamw_q8_percentile) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  optimizer_options o;
  o.min_8bit_size = 600;  // emb, w, norm and big quantized; the rest fp32
  o.percentile_clipping = 50;
  check_resharding<adamw, sharded<q8>>("adamw-q8", mixed_layout(dtype::f32), {h}, o, 4, 3);
}

BOOST_AUTO_TEST_CASE(lamb_fp32) {
  lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  check_resharding<lamb, sharded<fp32>>("lamb", mixed_layout(dtype::f32), {h}, {}, 3, 3);
}

BOOST_AUTO_TEST_CASE(adafactor_beta1_bf16) {
  adafactor::hyper_params h;
  h.beta1 = 0.9;
  check_resharding<adafactor, sharded<fp32>, precision<bf16>>("adafactor", mixed_layout(dtype::bf16), {h}, {}, 3, 3);
}

BOOST_AUTO_TEST_CASE(came_fp32) {
  came::hyper_params h;
  h.lr = 1e-3;
  check_resharding<came, sharded<fp32>>("came", mixed_layout(dtype::f32), {h}, {}, 3, 3);
}

#ifdef DISTOPT_TEST_GALORE
namespace {
layout galore_layout() {
  layout l;
  l.add("w0", {40, 30}, dtype::f32, 1);
  l.add("b0", {30}, dtype::f32, 0);
  l.add("w1", {17, 33}, dtype::f32, 1);
  l.add("norm", {700}, dtype::f32, 0);
  l.add("w2", {64, 40}, dtype::f32, 1);
  return l;
}
std::vector<galore_adamw::hyper_params> galore_groups() {
  galore_adamw::hyper_params plain;
  plain.lr = 1e-2;
  galore_adamw::hyper_params g = plain;
  g.rank = 4;
  g.update_proj_gap = 3;  // refreshes at steps 0, 3 (before the save) and 6 (after)
  g.scale = 0.5;
  return {plain, g};
}
}  // namespace

BOOST_AUTO_TEST_CASE(galore_adamw_fp32) {
  check_resharding<galore_adamw, sharded<fp32>>("galore", galore_layout(), galore_groups(), {}, 4, 4);
}

BOOST_AUTO_TEST_CASE(galore_adamw_q8) {
  optimizer_options o;
  o.min_8bit_size = 256;  // w2's 64 x 4 low-rank states are 8-bit
  check_resharding<galore_adamw, sharded<q8>>("galore-q8", galore_layout(), galore_groups(), o, 4, 4);
}

// Muon on the matrices of group 1 (its momentum, sharded like an element state), AdamW on
// group 0 (two slots over the other tensors).
BOOST_AUTO_TEST_CASE(muon_with_adamw_fp32) {
  check_resharding<muon, sharded<fp32>>("muon", galore_layout(), harness::muon_groups(), {}, 4, 4);
}

// Owned placement: each matrix's states on its owner, who changes with d.
BOOST_AUTO_TEST_CASE(muon_owned) {
  check_resharding<muon, owned<fp32>>("muon-owned", galore_layout(), harness::muon_groups(), {}, 4, 4);
}

BOOST_AUTO_TEST_CASE(galore_adamw_owned) {
  check_resharding<galore_adamw, owned<fp32>>("galore-owned", galore_layout(), galore_groups(), {}, 4, 4);
}

// The same states in the same items: a sharded checkpoint resumes on owned storage, and
// the reverse, on other numbers of ranks.
BOOST_AUTO_TEST_CASE(owned_and_sharded_checkpoints_interchange) {
  const layout l = galore_layout();
  const auto check = [&]<class Policy>(const std::vector<typename Policy::hyper_params>& h, const char* tag) {
    const snapshot reference = run<Policy, sharded<fp32>, precision<float>>(1, l, h, {}, 0, 8, nullptr, nullptr);
    for (const auto& [d, d2] : {std::pair{3, 2}, std::pair{1, 4}, std::pair{5, 3}}) {
      scratch_dir a(std::string(tag) + "-sharded"), b(std::string(tag) + "-owned");
      run<Policy, sharded<fp32>, precision<float>>(d, l, h, {}, 0, 4, nullptr, &a.path);
      BOOST_TEST((run<Policy, owned<fp32>, precision<float>>(d2, l, h, {}, 4, 8, &a.path, nullptr) == reference),
                 tag << ": saved sharded on " << d << " ranks, resumed owned on " << d2);
      run<Policy, owned<fp32>, precision<float>>(d, l, h, {}, 0, 4, nullptr, &b.path);
      BOOST_TEST((run<Policy, sharded<fp32>, precision<float>>(d2, l, h, {}, 4, 8, &b.path, nullptr) == reference),
                 tag << ": saved owned on " << d << " ranks, resumed sharded on " << d2);
    }
  };
  check.template operator()<muon>(harness::muon_groups(), "muon");
  check.template operator()<galore_adamw>(galore_groups(), "galore");
}
#endif

#if defined(__linux__)  // the emulated device (mmap)
BOOST_AUTO_TEST_CASE(device_memory_adamw_bf16_master_loss_scale) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  optimizer_options o;
  o.loss_scale = dynamic_loss_scale{1024.0, 2.0, 0.5, 2};
  check_device_interchange<adamw, sharded<bf16>, precision<bf16, bf16>>("device-adamw-bf16", mixed_layout(dtype::bf16),
                                                                        {h}, o, 3, 3);
}

BOOST_AUTO_TEST_CASE(device_memory_adamw_q8_percentile) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  optimizer_options o;
  o.min_8bit_size = 600;
  o.percentile_clipping = 50;
  check_device_interchange<adamw, sharded<q8>>("device-adamw-q8", mixed_layout(dtype::f32), {h}, o, 4, 3);
}

BOOST_AUTO_TEST_CASE(device_memory_adafactor_beta1_bf16) {
  adafactor::hyper_params h;
  h.beta1 = 0.9;
  check_device_interchange<adafactor, sharded<fp32>, precision<bf16>>("device-adafactor", mixed_layout(dtype::bf16),
                                                                      {h}, {}, 3, 3);
}

#ifdef DISTOPT_TEST_GALORE
// GaLore's low-rank states and projections live in device buffers; the checkpoint copies
// them through the host mirror (saved after step 4, between the refreshes at 3 and 6).
BOOST_AUTO_TEST_CASE(device_memory_galore_adamw) {
  check_device_interchange<galore_adamw, sharded<fp32>>("device-galore", galore_layout(), galore_groups(), {}, 4, 4);
}

// The checkpoint's hyper-parameters replace the optimizer's: a square matrix projects on the
// right with std and on the left with reverse_std, its low-rank states of one size either
// way, so an optimizer made with reverse_std takes a std checkpoint and then projects as std
// does. (Its projection is not taken: the optimizer looks for the side it was made with, and
// refreshes at its first step.) On the device its projection's buffers follow the side, and
// it continues as the CPU does.
BOOST_AUTO_TEST_CASE(device_memory_galore_side_from_the_checkpoint) {
  layout l;
  l.add("w", {24, 24}, dtype::f32, 1);
  l.add("b", {24}, dtype::f32, 0);
  const auto saved = galore_groups();
  auto other = saved;
  other[1].proj_type = galore_proj::reverse_std;
  using prec = precision<float>;
  scratch_dir dir("device-galore-side");
  run<galore_adamw, sharded<fp32>, prec, emulated_device>(2, l, saved, {}, 0, 4, nullptr, &dir.path);
  const snapshot on_cpu = run<galore_adamw, sharded<fp32>, prec>(1, l, other, {}, 4, 8, &dir.path, nullptr);
  BOOST_TEST(on_cpu.step == 8);
  BOOST_TEST((run<galore_adamw, sharded<fp32>, prec, emulated_device>(1, l, other, {}, 4, 8, &dir.path, nullptr) ==
              on_cpu));
}
#endif

// A communicator of device memory (device_threads, as nccl): the checkpoint's agreement
// (the ranks' maxima and all-gathers) reaches it through device scratch, as the layout
// check and the statistics wires do.
BOOST_AUTO_TEST_CASE(device_memory_device_communicator_adafactor) {
  adafactor::hyper_params h;
  h.beta1 = 0.9;
  check_device_interchange<adafactor, sharded<fp32>, precision<bf16>, harness::device_threads>(
      "device-comm-adafactor", mixed_layout(dtype::bf16), {h}, {}, 3, 3);
}
#endif

BOOST_AUTO_TEST_CASE(replicated_and_sharded_interchange) {
  // A sharded checkpoint loads into replicated storage and back.
  adamw::hyper_params h;
  h.lr = 1e-2;
  const layout l = mixed_layout(dtype::f32);
  const snapshot reference = run<adamw, replicated<fp32>, precision<float>>(1, l, {h}, {}, 0, 6, nullptr, nullptr);
  scratch_dir a("sharded"), b("replicated");
  run<adamw, sharded<fp32>, precision<float>>(4, l, {h}, {}, 0, 3, nullptr, &a.path);
  const snapshot r1 = run<adamw, replicated<fp32>, precision<float>>(3, l, {h}, {}, 3, 6, &a.path, nullptr);
  BOOST_TEST((r1.base.params == reference.base.params));
  run<adamw, replicated<fp32>, precision<float>>(2, l, {h}, {}, 0, 3, nullptr, &b.path);
  const snapshot r2 = run<adamw, sharded<fp32>, precision<float>>(5, l, {h}, {}, 3, 6, &b.path, nullptr);
  BOOST_TEST((r2 == reference));
}

BOOST_AUTO_TEST_SUITE_END()

// ------------------------------------------------------------------------------------
// Refusals: each leaves the optimizer exactly as it was.
// ------------------------------------------------------------------------------------
namespace {

using ref_opt = optimizer<adamw, sharded<fp32>, threads>;

adamw::hyper_params ref_hyper() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  return h;
}

/// Saves a 3-step AdamW run on `d` ranks into `dir`.
void save_reference(const fs::path& dir, int d, const layout& l = mixed_layout(dtype::f32)) {
  run<adamw, sharded<fp32>, precision<float>>(d, l, {ref_hyper()}, {}, 0, 3, nullptr, &dir);
}

/// Loads `dir` on `d` ranks after 2 steps of training; returns the error every rank saw
/// (all must agree that it failed) and checks that no rank's state changed.
std::vector<std::string> refused_load(const fs::path& dir, int d, const layout& l = mixed_layout(dtype::f32)) {
  std::vector<std::string> errors(static_cast<std::size_t>(d));
  std::vector<char> unchanged(static_cast<std::size_t>(d), 0);
  optimizer_options o;
  o.grad_reduce = reduce_op::sum;
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    ref_opt opt(l, {ref_hyper()}, o, cpu(1), std::move(comm));
    harness::set_initial_params(opt);
    run_steps(opt, rank, 0, 2, 0);
    harness::outcome before = harness::blank<ref_opt>(l, 2), after = before;
    harness::collect(opt, 0, before);  // every rank its own part, as rank 0 would
    const auto step_before = opt.step_count();
    try {
      opt.load(dir);
    } catch (const io::checkpoint_error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    harness::collect(opt, 0, after);
    unchanged[static_cast<std::size_t>(rank)] = before == after && opt.step_count() == step_before;
  });
  for (int r = 0; r < d; ++r) {
    BOOST_TEST(!errors[static_cast<std::size_t>(r)].empty(), "rank " << r << " accepted the checkpoint");
    BOOST_TEST(unchanged[static_cast<std::size_t>(r)], "rank " << r << "'s state changed");
  }
  return errors;
}

bool mentions(const std::vector<std::string>& errors, const std::string& what) {
  for (const auto& e : errors)
    if (e.find(what) != std::string::npos) return true;
  return false;
}

fs::path rank_file(const fs::path& dir, int r) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find("-rank" + std::to_string(r) + "-of-") != std::string::npos) return e.path();
  }
  throw std::runtime_error("no file of rank " + std::to_string(r));
}

void flip_byte(const fs::path& p, std::uint64_t offset_from_end) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  c = static_cast<char>(c ^ 0x10);
  f.write(&c, 1);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(refusals)

BOOST_AUTO_TEST_CASE(missing_directory_and_index) {
  scratch_dir dir("missing");
  const auto errors = refused_load(dir.path, 2);
  BOOST_TEST(mentions(errors, "index.json"));
}

BOOST_AUTO_TEST_CASE(corrupt_data_byte_names_file_and_tensor) {
  scratch_dir dir("corrupt");
  save_reference(dir.path, 3);
  const fs::path victim = rank_file(dir.path, 1);
  flip_byte(victim, 5);  // inside the last tensor's data
  const auto errors = refused_load(dir.path, 3);
  BOOST_TEST(mentions(errors, victim.filename().string()));
  BOOST_TEST(mentions(errors, "checksum mismatch"));
  // Loaded on one rank, which reads every slice: the same refusal.
  const auto one = refused_load(dir.path, 1);
  BOOST_TEST(mentions(one, "checksum mismatch"));
}

BOOST_AUTO_TEST_CASE(corrupt_header_and_index) {
  scratch_dir dir("header");
  save_reference(dir.path, 2);
  const fs::path victim = rank_file(dir.path, 0);
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.write("X", 1);  // inside the JSON header
  }
  BOOST_TEST(mentions(refused_load(dir.path, 2), "header checksum mismatch"));
  scratch_dir dir2("index");
  save_reference(dir2.path, 2);
  {
    std::string text;
    {
      std::ifstream in(dir2.path / "index.json");
      text.assign(std::istreambuf_iterator<char>(in), {});
    }
    const auto at = text.find("\"step\": \"3\"");
    BOOST_TEST_REQUIRE(at != std::string::npos);
    text[at + 9] = '4';  // still valid JSON, but not what was saved
    std::ofstream(dir2.path / "index.json") << text;
  }
  BOOST_TEST(mentions(refused_load(dir2.path, 2), "checksum mismatch: the index is corrupt"));
}

BOOST_AUTO_TEST_CASE(truncated_and_missing_rank_file) {
  scratch_dir dir("truncated");
  save_reference(dir.path, 4);
  const fs::path victim = rank_file(dir.path, 2);
  fs::resize_file(victim, fs::file_size(victim) - 100);
  const auto errors = refused_load(dir.path, 2);
  BOOST_TEST(mentions(errors, victim.filename().string()));
  BOOST_TEST(mentions(errors, "(truncated)"));
  fs::remove(victim);
  BOOST_TEST(mentions(refused_load(dir.path, 5), "missing"));
}

BOOST_AUTO_TEST_CASE(mismatched_policy_layout_dtype) {
  scratch_dir dir("mismatch");
  save_reference(dir.path, 2);
  {  // another policy
    std::string error;
    optimizer<lion, sharded<fp32>, single> opt(mixed_layout(dtype::f32), lion::hyper_params{});
    try {
      opt.load(dir.path);
    } catch (const io::checkpoint_error& e) {
      error = e.what();
    }
    BOOST_TEST(error.find("policy adamw, this optimizer has lion") != std::string::npos, error);
  }
  {  // another shape
    layout l = mixed_layout(dtype::f32);
    layout other;
    for (const auto& t : l.tensors()) other.add(t.name, t.name == "w" ? std::vector<std::int64_t>{17, 34} : t.shape, t.dtype);
    const auto errors = refused_load(dir.path, 2, other);
    BOOST_TEST(mentions(errors, "tensor w"));
  }
  {  // bf16 params where the checkpoint has fp32
    std::string error;
    optimizer<adamw, sharded<fp32>, single, cpu, precision<bf16>> opt(mixed_layout(dtype::bf16), ref_hyper());
    try {
      opt.load(dir.path);
    } catch (const io::checkpoint_error& e) {
      error = e.what();
    }
    BOOST_TEST(error.find("param_dtype fp32, this optimizer has bf16") != std::string::npos, error);
  }
  {  // a file from another save put in place of one of this save's
    scratch_dir other("other");
    save_reference(other.path, 2);
    const fs::path mine = rank_file(dir.path, 1);
    fs::copy_file(rank_file(other.path, 1), mine, fs::copy_options::overwrite_existing);
    BOOST_TEST(mentions(refused_load(dir.path, 2), mine.filename().string()));
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ------------------------------------------------------------------------------------
// Crash safety: a writer killed with SIGKILL at random points.
// ------------------------------------------------------------------------------------
BOOST_AUTO_TEST_CASE(killed_writer_leaves_a_loadable_checkpoint) {
  using opt_t = optimizer<adamw, sharded<fp32>, single>;
  layout l;
  l.add("w", {1024, 1024}, dtype::f32);  // 12 MiB of params and states per save
  l.add("b", {1024}, dtype::f32);
  const adamw::hyper_params h = ref_hyper();
  scratch_dir dir("crash");
  // The uninterrupted run's params after each step, to compare what loads with.
  std::vector<std::vector<float>> after(12);
  {
    opt_t opt(l, h);
    harness::set_initial_params(opt);
    for (int s = 1; s < 12; ++s) {
      run_steps(opt, 0, s - 1, s, 0);
      auto p = opt.param("w");
      after[static_cast<std::size_t>(s)].assign(p.begin(), p.end());
    }
  }
  {
    opt_t opt(l, h);
    harness::set_initial_params(opt);
    run_steps(opt, 0, 0, 1, 0);
    opt.save(dir.path);
  }
  std::mt19937 rng(7);
  std::int64_t last = 1;
  int loads_new = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const pid_t child = ::fork();
    BOOST_TEST_REQUIRE(child >= 0);
    if (child == 0) {
      // The writer: resume from the checkpoint, step and save until killed.
      try {
        opt_t opt(l, h);
        opt.load(dir.path);
        for (std::int64_t s = opt.step_count(); s < 11; ++s) {
          run_steps(opt, 0, static_cast<int>(s), static_cast<int>(s) + 1, 0);
          opt.save(dir.path);
        }
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 250000)(rng)));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    BOOST_TEST(!(WIFEXITED(status) && WEXITSTATUS(status) == 3), "the writer failed by itself");
    opt_t opt(l, h);
    try {
      opt.load(dir.path);
    } catch (const std::exception& e) {
      BOOST_FAIL("trial " << trial << ": the checkpoint does not load after the kill: " << e.what());
    }
    const std::int64_t step = opt.step_count();
    BOOST_TEST(step >= last);
    if (step > last) ++loads_new;
    last = step;
    auto p = opt.param("w");
    BOOST_TEST((std::vector<float>(p.begin(), p.end()) == after[static_cast<std::size_t>(step)]),
               "trial " << trial << ": step " << step << " loads other params than the run had");
    if (step >= 10) break;
  }
  BOOST_TEST_MESSAGE("crash test: " << loads_new << " trials moved the checkpoint on");
  // A clean save afterwards leaves only its own files.
  {
    opt_t opt(l, h);
    opt.load(dir.path);
    opt.save(dir.path);
  }
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    ++files;
    BOOST_TEST(e.path().filename().string().front() != '.', "left behind: " << e.path());
  }
  BOOST_TEST(files == 2);  // index.json and one rank file
}
