// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ZeRO stages and the overlap hooks. sharded<E, 2> (sharded grads, full-bucket buffers
// from a pool) and grads_ready (each bucket's reduction started as soon as its tensors are
// ready) must not change a bit:
//  - for one d, every rank with its own grads: stage 1 and 2, hooks on or off, in a
//    different legal order every step (the same on every rank), give the same params,
//    master weights, states, norms and skips;
//  - across d, with the rank-0 trick of sharded_harness.hpp: stage 2 equals the
//    single-rank run for d = 1..4.
// Misuse is refused with the tensor named, and the memory report shows the sharded grads
// and the pool's peak.

#include "sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

namespace {

using namespace distopt;
using namespace harness;

struct hook_run {
  bool hooks = false;
  int layer = 1;          // tensors per grads_ready call
  int steps = 12;
  int nan_step = -1;      // rank 1 (or 0 when d == 1) writes a NaN at this step
  unsigned order_seed = 1;
  distopt::optimizer_options options{};
};

/// Every rank writes its own grads (they depend on the rank) in two micro-batches, added
/// into the grad views: the first in layout order, the second tensor by tensor in an order
/// drawn for the step (backward order shuffled, the same on every rank), declaring each
/// layer ready right after its last write when `hooks`; then steps. Stage 1 zeroes the
/// grads before each step; stage 2 lends zeroed buffers, so it zeroes only every other step.
template <class Opt>
void drive_hooks(Opt& opt, int rank, int d, const hook_run& hr, outcome* out) {
  using G = typename Opt::grad_type;
  const auto tensors = opt.tensors().tensors();
  set_initial_params(opt);
  std::mt19937 order_rng(hr.order_seed);
  const auto add = [&](int s, std::size_t t, int micro) {
    const auto view = opt.grad(tensors[t].name);  // host or device memory
    std::vector<G> v(view.size());
    download(opt.executor(), view, std::span<G>(v));
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float x = grad_value(s, t, i) * (0.5f + 0.25f * static_cast<float>(rank)) * (micro == 0 ? 0.75f : 0.25f);
      v[i] = from_float<G>(to_float(v[i]) + x);
    }
    if (s == hr.nan_step && rank == std::min(1, d - 1) && micro == 1) v[v.size() / 2] = from_float<G>(std::nanf(""));
    upload(opt.executor(), v, view);
  };
  for (int s = 0; s < hr.steps; ++s) {
    if (Opt::zero_stage < 2 || s % 2 == 0) opt.zero_grad();
    for (std::size_t t = 0; t < tensors.size(); ++t) add(s, t, 0);
    std::vector<std::size_t> order(tensors.size());
    for (std::size_t t = 0; t < order.size(); ++t) order[t] = order.size() - 1 - t;  // backward
    if (s % 2 == 1) std::shuffle(order.begin(), order.end(), order_rng);
    for (std::size_t j = 0; j < order.size(); j += static_cast<std::size_t>(hr.layer)) {
      const std::size_t end = std::min(order.size(), j + static_cast<std::size_t>(hr.layer));
      std::vector<std::string> layer;
      for (std::size_t q = j; q < end; ++q) {
        add(s, order[q], 1);
        layer.push_back(tensors[order[q]].name);
      }
      if (hr.hooks) opt.grads_ready(layer);
    }
    const step_result r = opt.step();
    if (out) {
      out->norms.push_back(r.grad_norm);
      out->skipped.push_back(r.skipped);
    }
  }
}

template <class Policy, class Storage, class Prec, class Exec = cpu>
outcome run_hooks(int d, const layout& l, const std::vector<typename Policy::hyper_params>& h, hook_run hr) {
  using opt_t = optimizer<Policy, Storage, threads, Exec, Prec>;
  hr.options.grad_reduce = reduce_op::sum;
  outcome out = blank<opt_t>(l, Policy::state_slots(h.front()));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, hr.options, make_executor<Exec>(1), std::move(comm));
    drive_hooks(opt, rank, d, hr, rank == 0 ? &out : nullptr);
    collect(opt, rank, out);
  });
  return out;
}

void expect_same(const outcome& got, const outcome& ref) {
  BOOST_TEST((got.params == ref.params));
  BOOST_TEST((got.master == ref.master));
  BOOST_TEST((got.states == ref.states));
  BOOST_TEST((got.absmax == ref.absmax));
  BOOST_TEST((got.skipped == ref.skipped));
  BOOST_TEST(std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0);
}

/// For d = 1..4 and each awkward layout: stage 1 without hooks is the reference; stage 1
/// with hooks, stage 2 with and without hooks (one or two tensors per hook call) equal it.
template <class Policy, class Enc, class Prec>
void check_stages(const std::vector<typename Policy::hyper_params>& h, hook_run hr, dtype t) {
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    for (int d = 1; d <= 4; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        hook_run off = hr;
        off.hooks = false;
        const outcome ref = run_hooks<Policy, sharded<Enc>, Prec>(d, l, h, off);
        BOOST_TEST(std::count(ref.skipped.begin(), ref.skipped.end(), 1) == (hr.nan_step >= 0 ? 1 : 0));
        hook_run on = hr;
        on.hooks = true;
        BOOST_TEST_CONTEXT("stage 1, hooks") expect_same(run_hooks<Policy, sharded<Enc>, Prec>(d, l, h, on), ref);
        BOOST_TEST_CONTEXT("stage 2, no hooks") expect_same(run_hooks<Policy, sharded<Enc, 2>, Prec>(d, l, h, off), ref);
        on.layer = 2;
        on.order_seed = 7;
        BOOST_TEST_CONTEXT("stage 2, hooks by two") expect_same(run_hooks<Policy, sharded<Enc, 2>, Prec>(d, l, h, on), ref);
      }
    }
  }
}

adamw::hyper_params adamw_decayed() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  return h;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(zero_stages)

BOOST_AUTO_TEST_CASE(adamw_fp32_with_clipping_and_a_nan_step) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.nan_step = 4;
  check_stages<adamw, float, precision<float>>({adamw_decayed()}, hr, dtype::f32);
}

BOOST_AUTO_TEST_CASE(adam_bf16_params_and_grads_reduced_in_fp32) {
  hook_run hr;
  hr.options.grad_reduce_in_fp32 = true;
  check_stages<adam, float, precision<bf16>>({cases::adam_amsgrad()}, hr, dtype::bf16);
}

BOOST_AUTO_TEST_CASE(sgd_bf16_stochastic_rounding_bf16_grads) {
  hook_run hr;
  hr.options.master_weights = false;
  hr.options.seed = 11;
  check_stages<sgd, bf16, precision<bf16>>(cases::sgd_momentum_and_nesterov(), hr, dtype::bf16);
}

BOOST_AUTO_TEST_CASE(q8_adamw) {
  hook_run hr;
  hr.options.min_8bit_size = 256;
  check_stages<adamw, q8, precision<float>>({adamw_decayed()}, hr, dtype::f32);
}

BOOST_AUTO_TEST_CASE(lamb_layerwise_statistics) {
  lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  check_stages<lamb, float, precision<float>>({h}, hook_run{}, dtype::f32);
}

// On the emulated device (memory the host cannot touch outside a launch or a copy), the
// step decided on the device: stage 2 with the hooks equals stage 1 on cpu.
BOOST_AUTO_TEST_CASE(stage_2_with_hooks_on_the_emulated_device_equals_cpu) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.nan_step = 3;
  hr.steps = 8;
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::bf16);
    for (int d = 1; d <= 3; ++d) {
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d) {
        hook_run off = hr, on = hr;
        off.hooks = false;
        on.hooks = true;
        const outcome ref = run_hooks<adamw, sharded<float>, precision<bf16>>(d, l, {adamw_decayed()}, off);
        expect_same(run_hooks<adamw, sharded<float, 2>, precision<bf16>, emulated_device>(d, l, {adamw_decayed()}, on),
                    ref);
      }
    }
  }
}

// Across d: the rank-0 trick makes the reduction exact, so stage 2 equals one rank.
BOOST_AUTO_TEST_CASE(stage_2_equals_one_rank_for_every_d) {
  run_options ro = cases::fp16_loss_scaling();
  for (const layout_case& c : awkward_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::f16);
    const outcome ref = run_single<adamw, float, precision<fp16>>(l, {adamw_decayed()}, ro);
    for (int d = 1; d <= 4; ++d)
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d)
    expect_same(run_threads<adamw, sharded<float, 2>, precision<fp16>>(d, l, {adamw_decayed()}, ro), ref);
  }
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(zero_misuse)

namespace {
layout two_buckets() {
  layout l;
  l.add("w0", {300}, dtype::f32);
  l.add("w1", {40, 30}, dtype::f32);
  l.add("w2", {513}, dtype::f32);
  return l;
}
template <class Storage>
using opt2 = optimizer<adamw, Storage, threads, cpu, precision<float>>;

/// What one rank saw go wrong; Boost.Test is told on the main thread (it is not
/// thread-safe), after the ranks have finished.
struct rank_checks {
  std::vector<std::string> failures;
  template <class E, class F>
  void throws_naming(F f, const std::string& what) {
    try {
      f();
      failures.push_back("no exception; expected one naming " + what);
    } catch (const E& e) {
      if (std::string(e.what()).find(what) == std::string::npos)
        failures.push_back("the message does not name " + what + ": " + e.what());
    }
  }
  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  }
};

/// Runs f(opt, checks) on two ranks as threads, three buckets (w0 | w1 | w2).
template <class Storage, class F>
void on_two_ranks(F f) {
  optimizer_options o;
  o.bucket_elems = 512;
  std::array<rank_checks, 2> checks;
  run_ranks(2, [&](threads& comm) {
    const int rank = comm.rank();
    opt2<Storage> opt(two_buckets(), adamw_decayed(), o, cpu(1), std::move(comm));
    f(opt, checks[static_cast<std::size_t>(rank)]);
  });
  for (std::size_t r = 0; r < checks.size(); ++r)
    for (const std::string& m : checks[r].failures) BOOST_ERROR("rank " << r << ": " << m);
}
}  // namespace

BOOST_AUTO_TEST_CASE(grads_ready_twice_and_a_missing_tensor_are_refused) {
  on_two_ranks<sharded<float, 2>>([](auto& opt, rank_checks& c) {
    opt.grad("w0")[0] = 1.0f;
    opt.grads_ready("w0");
    c.throws_naming<std::logic_error>([&] { opt.grads_ready("w0"); }, "'w0'");
    opt.grads_ready("w2");
    c.throws_naming<std::logic_error>([&] { opt.step(); }, "'w1'");  // w1 never declared ready
    c.throws_naming<std::logic_error>([&] { opt.grad("w2"); }, "'w2'");  // its bucket is reducing
    c.throws_naming<std::out_of_range>([&] { opt.grads_ready("nope"); }, "nope");
    opt.grads_ready("w1");
    const step_result r = opt.step();  // now complete: the step goes on
    c.expect(!r.skipped, "the step was skipped");
    c.expect(opt.step_count() == 1, "step_count() != 1");
    // A new step: nothing is ready yet, and the grads may be written again.
    opt.grad("w2")[0] = 1.0f;
    opt.grads_ready("w2");
    c.throws_naming<std::logic_error>([&] { opt.grads(); }, "ZeRO-2");
  });
}

// The hooks start the reductions before step(): once every tensor is declared ready, the
// threads communicator completes every reduce-scatter on its worker while this rank waits
// for nothing (bytes_sent counts a collective when it completes). Without the hooks,
// nothing is sent before step().
BOOST_AUTO_TEST_CASE(hooks_reduce_before_the_step) {
  const auto plan = detail::shard_plan(two_buckets(), 2, 0, 512, 1u << 14);
  std::size_t reduce_scatters = 0;  // rank 0's bytes for the three buckets, d = 2
  for (const auto& b : plan.buckets()) reduce_scatters += b.shard_elems * sizeof(float);
  BOOST_TEST(plan.buckets().size() == 3u);
  for (const int stage : {1, 2}) {
    for (const bool hooks : {true, false}) {
      std::size_t before_step = 0;
      const auto run = [&](auto& opt, rank_checks&) {
        const std::size_t base = opt.communicator().bytes_sent();  // the layout check's
        for (const char* n : {"w2", "w1", "w0"}) {
          for (auto& g : opt.grad(n)) g = 0.5f;
          if (hooks) opt.grads_ready(n);
        }
        const auto start = std::chrono::steady_clock::now();
        const auto limit = std::chrono::milliseconds(hooks ? 20000 : 200);
        while (opt.communicator().bytes_sent() - base < reduce_scatters && std::chrono::steady_clock::now() - start < limit)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (opt.communicator().rank() == 0) before_step = opt.communicator().bytes_sent() - base;
        opt.step();
      };
      if (stage == 1) on_two_ranks<sharded<float>>(run);
      else on_two_ranks<sharded<float, 2>>(run);
      BOOST_TEST_CONTEXT("stage " << stage << " hooks " << hooks)
      BOOST_TEST(before_step == (hooks ? reduce_scatters : 0u));
    }
  }
}

BOOST_AUTO_TEST_CASE(after_reduce_grads_stage_2_refuses_grad_views) {
  on_two_ranks<sharded<float, 2>>([](auto& opt, rank_checks& c) {
    opt.clip_grad_norm(1.0);  // reduces
    c.throws_naming<std::logic_error>([&] { opt.grad("w1"); }, "'w1'");
    c.throws_naming<std::logic_error>([&] { opt.grads_ready("w1"); }, "'w1'");
    opt.step();
    opt.grad("w1")[0] = 2.0f;  // the next step's
  });
}

// Stage 2 keeps only this rank's shard of the grads, and lends full-bucket buffers while
// backward writes them: with the hooks after each bucket, one at a time when reductions
// are blocking (fp32 reduction of bf16 grads); all at once without hooks.
BOOST_AUTO_TEST_CASE(memory_report_shows_sharded_grads_and_the_pool_peak) {
  layout l;
  l.add("w0", {1000}, dtype::bf16);
  l.add("w1", {40, 30}, dtype::bf16);
  l.add("w2", {700}, dtype::bf16);
  optimizer_options o;
  o.bucket_elems = 512;
  o.grad_reduce_in_fp32 = true;
  using z2 = optimizer<adamw, sharded<float, 2>, threads, cpu, precision<bf16>>;
  const auto plan = detail::shard_plan(l, 3, 0, 512, 1u << 14);
  std::size_t largest = 0;
  for (const auto& b : plan.buckets()) largest = std::max(largest, b.padded());
  BOOST_TEST(plan.buckets().size() == 3u);
  for (const bool hooks : {false, true}) {
    distopt::memory_report m;
    run_ranks(3, [&](threads& comm) {
      const int rank = comm.rank();
      z2 opt(l, adamw_decayed(), o, cpu(1), std::move(comm));
      for (int s = 0; s < 3; ++s) {
        for (const char* n : {"w2", "w1", "w0"}) {
          for (auto& g : opt.grad(n)) g = bf16(0.01f);
          if (hooks) opt.grads_ready(n);
        }
        opt.step();
      }
      if (rank == 0) m = opt.memory();
    });
    BOOST_TEST_CONTEXT("hooks " << hooks) {
      BOOST_TEST(m.bytes("grad buckets (peak)") == (hooks ? 1 : 3) * largest * sizeof(bf16));
      BOOST_TEST(m.bytes("grads") == 0u);  // reduced into fp32: "grads fp32" holds them
      BOOST_TEST(m.bytes("grads fp32") == plan.local_numel() * sizeof(float));
      BOOST_TEST(m.bytes("params") == 2900u * sizeof(bf16));
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
