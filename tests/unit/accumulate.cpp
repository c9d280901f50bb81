// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Gradient accumulation (optimizer_options::micro_batches, accumulation::reduce_last and
// reduce_each) at ZeRO stages 0-3, hooks on and off, d = 1..3 ranks as threads: each run
// equals one rank fed the global gradient its schedule forms (accumulate_harness.hpp), bit
// for bit; with parts that sum exactly, every stage, schedule, d and n gives the same bits.
// The layer-wise and 8-bit policies at ZeRO-2, fp16 loss scaling with an inf in one
// micro-batch, and the misuse that is refused.
#include "accumulate_harness.hpp"

#include <stdexcept>

using namespace distopt;
using namespace acc;

namespace {

template <class Storage>
using adamw_on = optimizer<adamw, Storage, threads, cpu, precision<float>>;

std::vector<adamw::hyper_params> decayed() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  return {h};
}

optimizer_options clipped() {
  optimizer_options o;
  o.max_grad_norm = 0.05;  // the accumulated grads' norm clips them
  return o;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(accumulate)

BOOST_AUTO_TEST_CASE(every_stage_equals_its_schedules_global_gradient) {
  const layout l = mixed_layout();
  for (const bool exact : {false, true}) {
    BOOST_TEST_CONTEXT("stage 0") check_schedules<adamw_on<replicated<float>>>(l, decayed(), clipped(), {1, 2, 3}, exact);
    BOOST_TEST_CONTEXT("stage 1") check_schedules<adamw_on<sharded<float>>>(l, decayed(), clipped(), {1, 2, 3}, exact);
    BOOST_TEST_CONTEXT("stage 2") check_schedules<adamw_on<sharded<float, 2>>>(l, decayed(), clipped(), {1, 2, 3}, exact);
    BOOST_TEST_CONTEXT("stage 3") check_schedules<adamw_on<sharded<float, 3>>>(l, decayed(), clipped(), {1, 2, 3}, exact);
  }
}

BOOST_AUTO_TEST_CASE(exact_parts_give_one_result_for_every_stage_schedule_and_d) {
  // The references above, for exact parts, are one run: check it against stage 1's unsplit run.
  const layout l = mixed_layout();
  parts p;
  p.exact = true;
  run_cfg one;
  one.options = clipped();
  one.options.grad_reduce = reduce_op::sum;
  one.options.bucket_elems = 512;
  const outcome unsplit = run<adamw_on<sharded<float>>>(
      l, decayed(), one, [&](int s, std::size_t t, std::size_t j, int, int) { return sum_of_parts(p, 3, 4, s, t, j); });
  for (const accumulation sched : {accumulation::reduce_last, accumulation::reduce_each}) {
    run_cfg cfg = one;
    cfg.d = 3;
    cfg.n = 4;
    cfg.hooks = true;
    cfg.options.micro_batches = 4;
    cfg.options.accumulate = sched;
    BOOST_TEST_CONTEXT("stage 2, " << schedule_name(sched))
    check_same(run<adamw_on<sharded<float, 2>>>(l, decayed(), cfg, std::cref(p)), unsplit);
  }
}

BOOST_AUTO_TEST_CASE(one_rank_schedules_agree) {
  // One rank, fp32 grads: both schedules add the micro-batches in the same order from zero.
  const layout l = mixed_layout();
  parts p;
  run_cfg cfg;
  cfg.n = 3;
  cfg.options = clipped();
  cfg.options.micro_batches = 3;
  cfg.options.bucket_elems = 512;
  const outcome last = run<adamw_on<sharded<float, 2>>>(l, decayed(), cfg, std::cref(p));
  cfg.options.accumulate = accumulation::reduce_each;
  check_same(run<adamw_on<sharded<float, 2>>>(l, decayed(), cfg, std::cref(p)), last);
}

BOOST_AUTO_TEST_CASE(layerwise_and_8bit_at_stage_2) {
  // Adafactor factors each matrix of the accumulated grads; q8 AdamW's blocks read them.
  const layout l = mixed_layout();
  using adafactor_z2 = optimizer<adafactor, sharded<float, 2>, threads, cpu, precision<float>>;
  check_schedules<adafactor_z2>(l, {adafactor::hyper_params{}}, optimizer_options{}, {2, 3}, false);
  using q8_z2 = optimizer<adamw, sharded<q8, 2>, threads, cpu, precision<float>>;
  optimizer_options small_blocks;
  small_blocks.min_8bit_size = 256;
  check_schedules<q8_z2>(l, decayed(), small_blocks, {2, 3}, false);
}

BOOST_AUTO_TEST_CASE(layerwise_and_8bit_at_stages_1_and_3) {
  // The same at stage 1 (the full grads kept) and at stage 3 (the params sharded too),
  // against the same one-rank stage-1 references: stages 1-3 of both families.
  const layout l = mixed_layout();
  using adafactor_ref = optimizer<adafactor, sharded<float>, threads, cpu, precision<float>>;
  using adafactor_z3 = optimizer<adafactor, sharded<float, 3>, threads, cpu, precision<float>>;
  BOOST_TEST_CONTEXT("adafactor stage 1")
  check_schedules<adafactor_ref>(l, {adafactor::hyper_params{}}, optimizer_options{}, {3}, false);
  BOOST_TEST_CONTEXT("adafactor stage 3")
  check_schedules<adafactor_z3, adafactor_ref>(l, {adafactor::hyper_params{}}, optimizer_options{}, {2, 3}, false);
  using q8_ref = optimizer<adamw, sharded<q8>, threads, cpu, precision<float>>;
  using q8_z3 = optimizer<adamw, sharded<q8, 3>, threads, cpu, precision<float>>;
  optimizer_options small_blocks;
  small_blocks.min_8bit_size = 256;
  BOOST_TEST_CONTEXT("q8 stage 1") check_schedules<q8_ref>(l, decayed(), small_blocks, {3}, false);
  BOOST_TEST_CONTEXT("q8 stage 3") check_schedules<q8_z3, q8_ref>(l, decayed(), small_blocks, {2, 3}, false);
}

BOOST_AUTO_TEST_CASE(an_inf_in_one_micro_batch_skips_the_step) {
  // fp16 grads with dynamic loss scaling, exact parts: a NaN in micro-batch 1 of the last
  // rank skips step 1 on every rank, halves the scale, and the run equals one rank fed the
  // unsplit grads (NaN included) at every step.
  const layout l = mixed_layout(dtype::f16);
  using z2 = optimizer<adamw, sharded<float, 2>, threads, cpu, precision<fp16>>;
  for (const accumulation sched : {accumulation::reduce_last, accumulation::reduce_each}) {
    parts p;
    p.exact = true;
    p.nan_step = 1;
    p.last_rank = 1;
    run_cfg one;
    one.steps = 4;
    one.options.loss_scale = dynamic_loss_scale{};
    one.options.grad_reduce = reduce_op::sum;
    one.options.bucket_elems = 512;
    const outcome want = run<z2>(
        l, decayed(), one, [&](int s, std::size_t t, std::size_t j, int, int) { return sum_of_parts(p, 2, 3, s, t, j); });
    BOOST_TEST(want.skipped == (std::vector<int>{0, 1, 0, 0}), boost::test_tools::per_element());
    run_cfg cfg = one;
    cfg.d = 2;
    cfg.n = 3;
    cfg.hooks = sched == accumulation::reduce_each;
    cfg.options.micro_batches = 3;
    cfg.options.accumulate = sched;
    BOOST_TEST_CONTEXT(schedule_name(sched))
    check_same(run<z2>(l, decayed(), cfg, std::cref(p)), want);
  }
}

BOOST_AUTO_TEST_CASE(misuse_is_refused) {
  const layout l = mixed_layout();
  optimizer_options o;
  o.micro_batches = 0;
  run_ranks(1, [&](threads& comm) {
    BOOST_CHECK_EXCEPTION((adamw_on<sharded<float>>(l, decayed(), o, cpu(1), std::move(comm))), std::invalid_argument,
                          [](const std::invalid_argument& e) {
                            return std::string(e.what()).find("micro_batches must be >= 1") != std::string::npos;
                          });
  });
  o.micro_batches = 2;
  const auto says = [](const char* what) {
    return [what](const std::logic_error& e) {
      BOOST_TEST_MESSAGE(e.what());
      return std::string(e.what()).find(what) != std::string::npos;
    };
  };
  run_ranks(1, [&](threads& comm) {
    adamw_on<sharded<float, 2>> opt(l, decayed(), o, cpu(1), std::move(comm));
    opt.grad("e")[0] = 1.0f;
    BOOST_CHECK_EXCEPTION(opt.step(), std::logic_error, says("end_micro_batch was called 0 time(s)"));
    BOOST_CHECK_EXCEPTION(opt.grads(), std::logic_error, says("write them through grad(name)"));
    opt.end_micro_batch();
    BOOST_TEST(opt.micro_batch() == 1);
    opt.grads_ready("e");
    BOOST_CHECK_EXCEPTION(opt.end_micro_batch(), std::logic_error, says("but not for 'w0'"));
    opt.grads_ready({"w0", "b0", "w1"});
    opt.end_micro_batch();
    BOOST_CHECK_EXCEPTION(opt.end_micro_batch(), std::logic_error, says("called 3 times in one step"));
    BOOST_CHECK_EXCEPTION(opt.grads_ready("e"), std::logic_error, says("every micro-batch of this step has ended"));
    BOOST_TEST(!opt.step().skipped);
    BOOST_TEST(opt.micro_batch() == 0);
    BOOST_TEST(opt.step_count() == 1);
  });
}

BOOST_AUTO_TEST_CASE(reduce_each_keeps_an_fp32_shard_and_reduce_last_the_full_grads) {
  // Stage 2, d = 2: reduce_each holds an fp32 accumulator of this rank's shard beside the
  // pool; reduce_last's pool holds every bucket at once (the full grads) until the step.
  const layout l = mixed_layout();
  using z2 = adamw_on<sharded<float, 2>>;
  for (const accumulation sched : {accumulation::reduce_last, accumulation::reduce_each}) {
    std::size_t acc_bytes = 0, pool_bytes = 0, local = 0, full = 0;
    run_ranks(2, [&](threads& comm) {
      optimizer_options o;
      o.bucket_elems = 512;
      o.micro_batches = 2;
      o.accumulate = sched;
      const int rank = comm.rank();
      z2 opt(l, decayed(), o, cpu(1), std::move(comm));
      run_cfg cfg;
      cfg.n = 2;
      cfg.steps = 1;
      cfg.hooks = true;
      train(opt, rank, cfg, parts{}, nullptr);
      if (rank == 0) {
        const memory_report m = opt.memory();
        acc_bytes = m.bytes("grads fp32");
        pool_bytes = m.bytes("grad buckets (peak)");
        local = m.bytes("grads") / sizeof(float);
        full = 0;
        for (const auto& t : l.tensors()) full += t.numel;
      }
    });
    BOOST_TEST_CONTEXT(schedule_name(sched)) {
      BOOST_TEST_MESSAGE("grads fp32 " << acc_bytes << " B, grad pool " << pool_bytes << " B, local " << local);
      BOOST_TEST(acc_bytes == (sched == accumulation::reduce_each ? 4 * local : 0u));
      // (reduce_each's peak depends on when the reductions finish: not asserted)
      if (sched == accumulation::reduce_last) BOOST_TEST(pool_bytes >= full * sizeof(float));
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
