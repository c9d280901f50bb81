// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ZeRO stages and the overlap hooks. sharded<E, 2> (sharded grads, full-bucket buffers
// from a pool) and grads_ready (each bucket's reduction started as soon as its tensors are
// ready) must not change a bit:
//  - for one d (1..8), every rank with its own grads: stages 1, 2 and 3, hooks on or off,
//    in a different legal order every step (the same on every rank), give the same
//    params, master weights, states, norms and skips;
//  - across d, with the rank-0 trick of sharded_harness.hpp: stages 2 and 3 equal the
//    single-rank run for d = 1..8 (5..8 in one case labelled large).
// Misuse is refused with the tensor named, and the memory report shows the sharded grads
// and the pool's peak.

#include "zero_harness.hpp"

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


/// For d = d_first..d_last (1..4 unless said) and each awkward layout: stage 1 without hooks
/// is the reference; stage 1 with hooks, stages 2 and 3 with and without hooks (one or two
/// tensors per hook call) equal it.
template <class Policy, class Enc, class Prec>
void check_stages(const std::vector<typename Policy::hyper_params>& h, hook_run hr, dtype t, int d_first = 1,
                  int d_last = 4) {
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    for (int d = d_first; d <= d_last; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        hook_run off = hr;
        off.hooks = false;
        const outcome ref = run_hooks<Policy, sharded<Enc>, Prec>(d, l, h, off);
        BOOST_TEST(std::count(ref.skipped.begin(), ref.skipped.end(), 1) == (hr.nan_step >= 0 ? 1 : 0));
        hook_run on = hr;
        on.hooks = true;
        BOOST_TEST_CONTEXT("stage 1, hooks") check_same(run_hooks<Policy, sharded<Enc>, Prec>(d, l, h, on), ref);
        BOOST_TEST_CONTEXT("stage 2, no hooks") check_same(run_hooks<Policy, sharded<Enc, 2>, Prec>(d, l, h, off), ref);
        on.layer = 2;
        on.order_seed = 7;
        BOOST_TEST_CONTEXT("stage 2, hooks by two") check_same(run_hooks<Policy, sharded<Enc, 2>, Prec>(d, l, h, on), ref);
        BOOST_TEST_CONTEXT("stage 3, hooks by two") check_same(run_hooks<Policy, sharded<Enc, 3>, Prec>(d, l, h, on), ref);
        BOOST_TEST_CONTEXT("stage 3, no hooks") check_same(run_hooks<Policy, sharded<Enc, 3>, Prec>(d, l, h, off), ref);
      }
    }
  }
}

/// Three bf16 tensors, a bucket each with buckets of 512 elements.
layout three_bf16_buckets() {
  layout l;
  l.add("w0", {1000}, dtype::bf16);
  l.add("w1", {40, 30}, dtype::bf16);
  l.add("w2", {700}, dtype::bf16);
  return l;
}

/// Across d = first..last, fp16 params with loss scaling: stage 2 equals one rank (the
/// rank-0 trick makes the reduction exact).
void stage_2_equals_one_rank(int first, int last) {
  run_options ro = cases::fp16_loss_scaling();
  for (const layout_case& c : awkward_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::f16);
    const outcome ref = run_single<adamw, float, precision<fp16>>(l, {adamw_decayed()}, ro);
    for (int d = first; d <= last; ++d)
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d)
    check_same(run_threads<adamw, sharded<float, 2>, precision<fp16>>(d, l, {adamw_decayed()}, ro), ref);
  }
}

/// Across d = first..last, with params gathered per layer and bf16 stochastic rounding:
/// stage 3 with the hooks equals one rank.
void stage_3_equals_one_rank(int first, int last) {
  hook_run hr;
  hr.rank0_only = true;
  hr.hooks = true;
  hr.layer = 2;
  hr.options.seed = 5;
  hr.options.master_weights = false;  // bf16 stochastic rounding, keyed by layout index
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::bf16);
    const outcome ref = run_hooks<adamw, sharded<float>, precision<bf16>>(1, l, {adamw_decayed()}, hr);
    for (int d = first; d <= last; ++d)
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d)
    check_same(run_hooks<adamw, sharded<float, 3>, precision<bf16>>(d, l, {adamw_decayed()}, hr), ref);
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(zero_stages)

BOOST_AUTO_TEST_CASE(adamw_fp32_with_clipping_and_a_nan_step) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.options.check_hook_order = true;  // the same orders on every rank pass the check
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

// d = 5..8 ranks: fp32 with clipping and a NaN step, bf16 params with grads reduced in fp32,
// q8 states and Lamb's statistics, at every stage with the hooks in shuffled orders.
// Labelled large: the TSan stage leaves it out (d = 1..4 run the same code concurrently).
BOOST_AUTO_TEST_CASE(five_to_eight_ranks, *boost::unit_test::label("large")) {
  hook_run clipped;
  clipped.options.max_grad_norm = 1.0;
  clipped.nan_step = 4;
  check_stages<adamw, float, precision<float>>({adamw_decayed()}, clipped, dtype::f32, 5, 8);
  hook_run fp32_reduce;
  fp32_reduce.options.grad_reduce_in_fp32 = true;
  check_stages<adam, float, precision<bf16>>({cases::adam_amsgrad()}, fp32_reduce, dtype::bf16, 5, 8);
  hook_run small_q8;
  small_q8.options.min_8bit_size = 256;
  check_stages<adamw, q8, precision<float>>({adamw_decayed()}, small_q8, dtype::f32, 5, 8);
  lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  check_stages<lamb, float, precision<float>>({h}, hook_run{}, dtype::f32, 5, 8);
  stage_2_equals_one_rank(5, 8);
  stage_3_equals_one_rank(5, 8);
}

// On the emulated device (memory the host cannot touch outside a launch or a copy), the
// step decided on the device: stages 2 and 3 with the hooks equal stage 1 on cpu.
BOOST_AUTO_TEST_CASE(stage_2_with_hooks_on_the_emulated_device_equals_cpu) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.nan_step = 3;
  hr.steps = 8;
  adamw_bf16_hook_cases(hr, [](const layout& l, int d, const hook_run& on, const outcome& ref) {
    BOOST_TEST_CONTEXT("stage 2")
    check_same(run_hooks<adamw, sharded<float, 2>, precision<bf16>, emulated_device>(d, l, {adamw_decayed()}, on), ref);
    BOOST_TEST_CONTEXT("stage 3")
    check_same(run_hooks<adamw, sharded<float, 3>, precision<bf16>, emulated_device>(d, l, {adamw_decayed()}, on), ref);
  });
}

// Replicated storage: grads_ready starts each bucket's all-reduce; the same bits as without.
BOOST_AUTO_TEST_CASE(replicated_storage_with_hooks) {
  hook_run hr;
  hr.nan_step = 2;
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::f32);
    for (int d = 1; d <= 3; ++d) {
      hook_run on = hr;
      on.hooks = true;
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d)
      check_same(run_hooks<adamw, replicated<float>, precision<float>>(d, l, {adamw_decayed()}, on),
                 run_hooks<adamw, replicated<float>, precision<float>>(d, l, {adamw_decayed()}, hr));
    }
  }
}

// Across d: the rank-0 trick makes the reduction exact, so stage 2 equals one rank.
BOOST_AUTO_TEST_CASE(stage_2_equals_one_rank_for_every_d) { stage_2_equals_one_rank(1, 4); }

// The rank-0 trick with params gathered per layer: stage 3 on d = 2..4 equals one rank.
BOOST_AUTO_TEST_CASE(stage_3_equals_one_rank_for_every_d) { stage_3_equals_one_rank(2, 4); }

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

/// Runs f(opt, checks) on two ranks as threads, on layout `l` (three buckets, w0 | w1 | w2, by default).
template <class Storage, class F>
void on_two_ranks(F f, const layout& l = two_buckets(), bool check_hook_order = false) {
  optimizer_options o;
  o.bucket_elems = 512;
  o.check_hook_order = check_hook_order;
  std::array<rank_checks, 2> checks;
  run_ranks(2, [&](threads& comm) {
    const int rank = comm.rank();
    opt2<Storage> opt(l, adamw_decayed(), o, cpu(1), std::move(comm));
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

// options.check_hook_order: ranks that start their buckets' collectives in different
// orders are stopped before the first mismatched one, on every rank with the same message,
// each rank's tensors and call named; the failed hook changed nothing, so a caught error
// leaves an optimizer that trains on. (The stage tests above run
// adamw_fp32_with_clipping_and_a_nan_step with the check on: the same orders pass it.)
BOOST_AUTO_TEST_CASE(hooks_called_in_different_orders_are_named) {
  const auto both = [](const std::string& r0, const std::string& r1) { return "rank 0 " + r0 + ", rank 1 " + r1; };
  on_two_ranks<sharded<float, 2>>(
      [&](auto& opt, rank_checks& c) {
        const bool r0 = opt.communicator().rank() == 0;
        opt.grads_ready("w2");  // the same on both ranks
        c.throws_naming<std::logic_error>([&] { opt.grads_ready(r0 ? "w1" : "w0"); },
                                          both("(grads_ready) reduces the grads of 'w1'",
                                               "(grads_ready) reduces the grads of 'w0'"));
        // Caught: the step starts afresh and trains as an optimizer that never saw the error.
        opt.zero_grad();
        for (const char* n : {"w2", "w1", "w0"}) {
          for (auto& g : opt.grad(n)) g = 0.5f;
          opt.grads_ready(n);
        }
        opt.step();
        optimizer<adamw, replicated<float>, single, cpu, precision<float>> ref(two_buckets(), adamw_decayed());
        for (const char* n : {"w0", "w1", "w2"})
          for (auto& g : ref.grad(n)) g = 0.5f;  // the ranks' average
        ref.step();
        for (const char* n : {"w0", "w1", "w2"}) {
          const auto got = opt.param(n), want = ref.param(n);
          c.expect(std::equal(got.begin(), got.end(), want.begin(), want.end()),
                   std::string("after the caught error, ") + n + " differs from one rank's step");
        }
      },
      two_buckets(), true);
  on_two_ranks<sharded<float, 3>>(
      [&](auto& opt, rank_checks& c) {
        const bool r0 = opt.communicator().rank() == 0;
        opt.gather({"w0", "w1", "w2"});
        for (const char* n : {"w0", "w1", "w2"}) {
          auto p = opt.param(n);
          for (std::size_t j = 0; j < p.size(); ++j) p[j] = static_cast<float>(j % 7) + (n[1] - '0');
        }
        opt.release({"w0", "w1", "w2"}, keep_writes);
        c.throws_naming<std::logic_error>([&] { opt.prefetch(r0 ? "w1" : "w2"); },
                                          both("(prefetch) gathers the params of 'w1'", "(prefetch) gathers the params of 'w2'"));
        // Caught: no prefetch is recorded, and a gather brings the params.
        opt.gather("w1");
        const auto p = opt.param("w1");
        bool same = true;
        for (std::size_t j = 0; j < p.size(); ++j) same = same && p[j] == static_cast<float>(j % 7) + 1.0f;
        c.expect(same, "after the caught error, the gathered w1 is not its params");
        opt.release("w1");
      },
      two_buckets(), true);
  on_two_ranks<sharded<float, 3>>(  // one rank's backward reduces where the other's forward gathers
      [&](auto& opt, rank_checks& c) {
        const bool r0 = opt.communicator().rank() == 0;
        c.throws_naming<std::logic_error>([&] { r0 ? opt.grads_ready("w1") : opt.gather("w1"); },
                                          both("(grads_ready) reduces the grads of 'w1'", "(gather) gathers the params of 'w1'"));
        c.throws_naming<std::logic_error>([&] { opt.param("w1"); }, "'w1'");  // the failed gather marked nothing
      },
      two_buckets(), true);
  on_two_ranks<sharded<float, 2>>(  // buckets of several tensors are named by their first and last
      [&](auto& opt, rank_checks& c) {
        const bool r0 = opt.communicator().rank() == 0;
        c.throws_naming<std::logic_error>([&] { opt.grads_ready(r0 ? tensor_names{"w2"} : tensor_names{"w0", "w1"}); },
                                          both("(grads_ready) reduces the grads of 'w2'",
                                               "(grads_ready) reduces the grads of 'w0' .. 'w1' (2 tensors)"));
      },
      [] {
        layout l;
        l.add("w0", {100}, dtype::f32);
        l.add("w1", {200}, dtype::f32);
        l.add("w2", {600}, dtype::f32);
        return l;
      }(),
      true);
}

BOOST_AUTO_TEST_CASE(stage_3_gathers_are_checked) {
  on_two_ranks<sharded<float, 3>>([](auto& opt, rank_checks& c) {
    c.throws_naming<std::logic_error>([&] { opt.param("w1"); }, "'w1'");  // not gathered
    c.throws_naming<std::logic_error>([&] { opt.release("w1"); }, "'w1'");
    c.throws_naming<std::logic_error>([&] { opt.params(); }, "ZeRO-3");
    opt.gather({"w0", "w1"});
    c.throws_naming<std::logic_error>([&] { opt.gather("w1"); }, "'w1'");  // twice
    for (auto& p : opt.param("w1")) p = 0.25f;
    opt.release("w0");
    c.throws_naming<std::logic_error>([&] { opt.step(); }, "'w1'");  // still gathered
    opt.release("w1", keep_writes);
    opt.gather("w1");  // the writes were kept: every rank wrote the same values
    for (float p : opt.param("w1")) c.expect(p == 0.25f, "a kept write was lost");
    for (auto& p : opt.param("w1")) p = 9.0f;
    opt.release("w1");  // dropped
    opt.gather("w1");
    c.expect(opt.param("w1")[7] == 0.25f, "a dropped write was kept");
    opt.release("w1");
    opt.prefetch({"w0", "w2"});  // dropped by the step
    opt.step();
  });
}

// keep_writes keeps the released tensor's writes, whatever else of its bucket is gathered:
// a and b share one bucket (a block each, one on each rank's shard).
BOOST_AUTO_TEST_CASE(keep_writes_is_per_tensor) {
  layout l;
  l.add("a", {100}, dtype::f32);
  l.add("b", {100}, dtype::f32);
  on_two_ranks<sharded<float, 3>>(
      [](auto& opt, rank_checks& c) {
        for (const bool keep_a : {true, false}) {
          opt.gather({"a", "b"});
          for (auto& p : opt.param("a")) p = keep_a ? 1.0f : 3.0f;
          for (auto& p : opt.param("b")) p = keep_a ? 2.0f : 4.0f;
          if (keep_a) {
            opt.release("a", keep_writes);
            opt.release("b");
          } else {
            opt.release("a");
            opt.release("b", keep_writes);
          }
          opt.gather({"a", "b"});
          c.expect(opt.param("a")[99] == 1.0f, "a: the kept write is " + std::to_string(opt.param("a")[99]));
          c.expect(opt.param("b")[0] == (keep_a ? 0.0f : 4.0f), "b: " + std::to_string(opt.param("b")[0]));
          opt.release({"a", "b"});
        }
      },
      l);
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
// are blocking (fp32 reduction of bf16 grads): w2's (768 elements, padded for 3 ranks),
// then w1's (1536: a second buffer), then w0's (1536) in w1's; all at once without hooks.
BOOST_AUTO_TEST_CASE(memory_report_shows_sharded_grads_and_the_pool_peak) {
  const layout l = three_bf16_buckets();
  optimizer_options o;
  o.bucket_elems = 512;
  o.grad_reduce_in_fp32 = true;
  using z2 = optimizer<adamw, sharded<float, 2>, threads, cpu, precision<bf16>>;
  const auto plan = detail::shard_plan(l, 3, 0, 512, 1u << 14);
  std::size_t all = 0;
  for (const auto& b : plan.buckets()) all += b.padded();
  BOOST_TEST(plan.buckets().size() == 3u);
  const std::size_t w0 = plan.buckets()[0].padded(), w1 = plan.buckets()[1].padded(), w2 = plan.buckets()[2].padded();
  BOOST_TEST((w2 < w1 && w0 <= w1 && w1 <= 2 * w0));
  const std::size_t w2_and_w1 = w2 + w1;
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
      BOOST_TEST(m.bytes("grad buckets (peak)") == (hooks ? w2_and_w1 : all) * sizeof(bf16));
      BOOST_TEST(m.bytes("grads") == 0u);  // reduced into fp32: "grads fp32" holds them
      BOOST_TEST(m.bytes("grads fp32") == plan.local_numel() * sizeof(float));
      BOOST_TEST(m.bytes("params") == 2900u * sizeof(bf16));
    }
  }
}

// README's table: the persistent bytes of each category follow the stage, for d = 4
// (bf16 params and grads, fp32 master weights, AdamW's two fp32 states).
BOOST_AUTO_TEST_CASE(persistent_bytes_follow_the_stage_model) {
  const layout l = three_bf16_buckets();
  optimizer_options o;
  o.bucket_elems = 512;
  const std::size_t numel = 2900, local = detail::shard_plan(l, 4, 0, 512, 1u << 14).local_numel();
  std::array<distopt::memory_report, 3> m;
  const auto report = [&]<int Stage>(std::integral_constant<int, Stage>) {
    run_ranks(4, [&](threads& comm) {
      const int rank = comm.rank();
      optimizer<adamw, sharded<float, Stage>, threads, cpu, precision<bf16>> opt(l, adamw_decayed(), o, cpu(1),
                                                                                 std::move(comm));
      if (rank == 0) m[Stage - 1] = opt.memory();
    });
  };
  report(std::integral_constant<int, 1>{});
  report(std::integral_constant<int, 2>{});
  report(std::integral_constant<int, 3>{});
  for (int stage = 1; stage <= 3; ++stage) {
    const distopt::memory_report& r = m[static_cast<std::size_t>(stage - 1)];
    BOOST_TEST_CONTEXT("stage " << stage) {
      BOOST_TEST(r.bytes("params") == (stage >= 3 ? local : numel) * 2);
      BOOST_TEST(r.bytes("grads") == (stage >= 2 ? local : numel) * 2);
      BOOST_TEST(r.bytes("master") == local * 4);
      BOOST_TEST(r.bytes("state 0") + r.bytes("state 1") == local * 8);
    }
  }
}

// Stage 3 keeps only this rank's shard of the params, and lends full-bucket buffers from
// gather to release (padded for 3 ranks, w0 and w1 have 1536 elements, w2 768). One at a
// time, without prefetching, every bucket fits in w0's buffer; with the next layer
// prefetched, w1's is lent while w0's is, then w2 takes w0's returned buffer (it holds
// w2, at most twice its size), and backward's fit in those two.
BOOST_AUTO_TEST_CASE(memory_report_shows_sharded_params_and_the_pool_peak) {
  const layout l = three_bf16_buckets();
  optimizer_options o;
  o.bucket_elems = 512;
  using z3 = optimizer<adamw, sharded<float, 3>, threads, cpu, precision<bf16>>;
  const auto plan = detail::shard_plan(l, 3, 0, 512, 1u << 14);
  BOOST_TEST(plan.buckets().size() == 3u);
  const std::size_t w0 = plan.buckets()[0].padded(), w1 = plan.buckets()[1].padded(), w2 = plan.buckets()[2].padded();
  BOOST_TEST((w1 == w0 && w2 <= w0 && w0 <= 2 * w2));
  for (const bool prefetch : {false, true}) {
    distopt::memory_report m;
    run_ranks(3, [&](threads& comm) {
      const int rank = comm.rank();
      z3 opt(l, adamw_decayed(), o, cpu(1), std::move(comm));
      const std::vector<std::string> names{"w0", "w1", "w2"};
      for (int s = 0; s < 2; ++s) {
        for (std::size_t j = 0; j < names.size(); ++j) {  // forward
          if (prefetch && j + 1 < names.size()) opt.prefetch(names[j + 1]);
          opt.gather(names[j]);
          opt.release(names[j]);
        }
        for (std::size_t j = names.size(); j-- > 0;) {  // backward
          opt.gather(names[j]);
          for (auto& g : opt.grad(names[j])) g = bf16(0.01f);
          opt.grads_ready(names[j]);
          opt.release(names[j]);
        }
        opt.step();
      }
      if (rank == 0) m = opt.memory();
    });
    BOOST_TEST_CONTEXT("prefetch " << prefetch) {
      BOOST_TEST(m.bytes("param buckets (peak)") == (prefetch ? w0 + w1 : w0) * sizeof(bf16));
      BOOST_TEST(m.bytes("params") == plan.local_numel() * sizeof(bf16));
      BOOST_TEST(m.bytes("grads") == plan.local_numel() * sizeof(bf16));
      BOOST_TEST(m.bytes("master") == plan.local_numel() * sizeof(float));
    }
  }
}

// The pool on its own: a bucket gets the smallest free buffer that holds it and is at most
// twice its size, or a new one of its own size; buckets of one size share buffers; and a
// step that repeats the order of lending makes none.
BOOST_AUTO_TEST_CASE(bucket_pool_lends_buffers_sized_per_bucket) {
  using pool = detail::bucket_pool<float, cpu>;
  cpu exec(1);
  // One step: the groups of buckets held at once, each group returned before the next.
  const auto step = [&](pool& p, const std::vector<std::size_t>& sizes, std::vector<std::vector<std::size_t>> groups) {
    for (const auto& g : groups) {
      for (std::size_t k : g) {
        bool dirty = true;
        float* b = p.acquire(exec, k, dirty);
        BOOST_TEST(b == p.of(k));
        if (!dirty)  // a new buffer is zero-filled
          BOOST_TEST(std::all_of(b, b + sizes[k], [](float x) { return x == 0.0f; }));
        std::fill(b, b + sizes[k], 1.0f);
      }
      for (std::size_t k : g) p.release(k);
      for (std::size_t k : g) BOOST_TEST(p.of(k) == nullptr);
    }
  };
  const auto run = [&](const std::vector<std::size_t>& sizes, std::vector<std::vector<std::size_t>> groups,
                       std::size_t buffers, std::size_t elems) {
    pool p(sizes);
    for (int s = 0; s < 3; ++s) {
      step(p, sizes, groups);
      BOOST_TEST(p.buffers() == buffers);
      BOOST_TEST(p.bytes() == elems * sizeof(float));
    }
  };
  // A transformer's layers, two at a time: two buffers.
  run({500, 500, 500, 500}, {{0, 1}, {2, 3}}, 2, 1000);
  // 500 fits in 1000 (twice its size), 499 does not.
  run({1000, 500, 499}, {{0}, {1}, {2}}, 2, 1499);
  // Unequal sizes one at a time: 1000 fits in 1200; 300 in neither 700 nor 1200.
  run({700, 1200, 300, 1000}, {{0}, {1}, {2}, {3}}, 3, 2200);
  // A large bucket after small ones: nothing it fits in is free, so it gets its own.
  run({700, 1200, 300, 1000}, {{0, 2}, {1, 3}}, 4, 3200);
  {  // a held bucket gets its own buffer back; a returned one is dirty
    pool p({1200, 700, 1000});
    bool dirty = true;
    float* a = p.acquire(exec, 0, dirty);
    BOOST_TEST(!dirty);
    BOOST_TEST(p.acquire(exec, 0, dirty) == a);
    BOOST_TEST(!dirty);
    p.release(0);
    BOOST_TEST(p.acquire(exec, 2, dirty) == a);
    BOOST_TEST(dirty);
    float* b = p.acquire(exec, 1, dirty);  // 1200 is lent: a new one
    BOOST_TEST(!dirty);
    BOOST_TEST(b != a);
  }
}

BOOST_AUTO_TEST_SUITE_END()
