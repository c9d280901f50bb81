// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// ZeRO-Offload (distopt/offload.hpp): params and grads in the emulated device's memory
// (which the host cannot touch outside a launch or a copy), master weights and states on
// the host, stepped by cpu. It must not change a bit:
//  - at stages 1, 2 and 3, with the hooks in shuffled orders, d = 1..3 ranks as threads:
//    equal to stage 1 on cpu without hooks (bf16 params with clipping and a NaN step, q8
//    states, Lamb's statistics);
//  - without hooks, initial params written only into the device views, fp16 with loss
//    scaling and clip_grad_norm: equal to one rank on cpu;
//  - a checkpoint saved by offload at one stage and d resumes on cpu at another, and back.
// The copies are counted (the grads by tensor at the hooks, the params by bucket), the
// memory report shows what lives on the device, and misuse is refused naming the tensor.

#include "scratch_dir.hpp"
#include "zero_harness.hpp"

#include <distopt/checkpoint.hpp>
#include <distopt/offload.hpp>

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace distopt;
using namespace harness;
using dev = offload<emulated_device>;

/// Stage 1 without hooks on cpu is the reference; offload at stages 1, 2 and 3 with the
/// hooks (one or two tensors a call, shuffled) equals it, on each awkward layout, d = 1..3.
template <class Policy, class Enc, class Prec>
void check_offload_stages(const std::vector<typename Policy::hyper_params>& h, hook_run hr, dtype t) {
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t, static_cast<int>(h.size()));
    for (int d = 1; d <= 3; ++d) {
      BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d) {
        hook_run off = hr, on = hr;
        off.hooks = false;
        on.hooks = true;
        const outcome ref = run_hooks<Policy, sharded<Enc>, Prec>(d, l, h, off);
        BOOST_TEST_CONTEXT("stage 1, hooks") check_same(run_hooks<Policy, sharded<Enc>, Prec, dev>(d, l, h, on), ref);
        on.layer = 2;
        on.order_seed = 5;
        BOOST_TEST_CONTEXT("stage 2, hooks by two")
        check_same(run_hooks<Policy, sharded<Enc, 2>, Prec, dev>(d, l, h, on), ref);
        BOOST_TEST_CONTEXT("stage 3, hooks by two")
        check_same(run_hooks<Policy, sharded<Enc, 3>, Prec, dev>(d, l, h, on), ref);
      }
    }
  }
}

/// The rank-0 trick (sharded_harness.hpp): rank 0 writes the global grads, the others zeros,
/// for steps [first, last); initial params only when first == 0.
template <class Opt>
void train(Opt& opt, int rank, int first, int last) {
  using G = typename Opt::grad_type;
  const auto tensors = opt.tensors().tensors();
  if (first == 0) init_params(opt);
  for (int s = first; s < last; ++s) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      std::vector<G> g(tensors[t].numel);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = from_float<G>(rank == 0 ? grad_value(s, t, i) : 0.0f);
      upload(opt.executor(), g, opt.grad(tensors[t].name));
      opt.grads_ready(tensors[t].name);
    }
    opt.step();
  }
}

/// d ranks as threads with `Storage` on executor Exec: steps [0, saved) then a save into
/// `dir` when `save`; or a load from `dir` and steps [saved, last), collecting into `out`.
template <class Storage, class Exec>
void run_part(int d, const layout& l, const std::filesystem::path& dir, bool save, int saved, int last,
              outcome* out) {
  using opt_t = optimizer<adamw, Storage, threads, Exec, precision<bf16>>;
  optimizer_options o;
  o.bucket_elems = 512;
  o.grad_reduce = reduce_op::sum;
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, adamw_decayed(), o, make_executor<Exec>(1), std::move(comm));
    if (save) {
      train(opt, rank, 0, saved);
      opt.save(dir);
    } else {
      opt.load(dir);
      train(opt, rank, saved, last);
      collect_all(opt, rank, *out);
    }
  });
}

/// Gradient accumulation: 4 steps of `o.micro_batches` micro-batches, each adding a
/// rank- and micro-batch-dependent gradient into the bf16 grad views (downloaded, added in
/// float, uploaded: the same arithmetic on every executor), the hooks per micro-batch when
/// `hooks`; what rank 0 sees and every rank's shard.
template <class Storage, class Exec, class Policy = adamw>
outcome run_accumulating(int d, const layout& l, optimizer_options o, bool hooks,
                         const typename Policy::hyper_params& h = adamw_decayed()) {
  using opt_t = optimizer<Policy, Storage, threads, Exec, precision<bf16>>;
  o.grad_reduce = reduce_op::sum;
  o.bucket_elems = 512;
  outcome out = blank<opt_t>(l, Policy::state_slots(h));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, o, make_executor<Exec>(1), std::move(comm));
    init_params(opt);
    const auto names = all_names(opt);
    for (int s = 0; s < 4; ++s) {
      for (int k = 0; k < o.micro_batches; ++k) {
        for (std::size_t t = names.size(); t-- > 0;) {  // backward: the last tensor first
          const auto view = opt.grad(names[t]);
          std::vector<bf16> v(view.size());
          download(opt.executor(), view, std::span<bf16>(v));
          const float share = (0.5f + 0.25f * static_cast<float>(rank)) * static_cast<float>(k + 1) * 0.25f;
          for (std::size_t i = 0; i < v.size(); ++i) v[i] = from_float<bf16>(to_float(v[i]) + grad_value(s, t, i) * share);
          upload(opt.executor(), v, view);
          if (hooks) opt.grads_ready(names[t]);
        }
        opt.end_micro_batch();
      }
      opt.step();
    }
    collect_all(opt, rank, out);
  });
  return out;
}

/// Three bf16 tensors of 1024 elements: a bucket each with buckets of 1024.
layout three_equal_tensors() {
  layout l;
  for (const char* n : {"w0", "w1", "w2"}) l.add(n, {32, 32}, dtype::bf16);
  return l;
}

template <class Storage>
using one_rank = optimizer<adamw, Storage, single, dev, precision<bf16>>;

optimizer_options buckets_of(std::size_t n) {
  optimizer_options o;
  o.bucket_elems = n;
  return o;
}

/// Copies through the emulated device while f runs.
template <class F>
std::size_t copies_in(F f) {
  const std::size_t before = detail::device_arenas::instance().copies();
  f();
  return detail::device_arenas::instance().copies() - before;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(offload_to_the_host)

BOOST_AUTO_TEST_CASE(adamw_bf16_with_clipping_and_a_nan_step) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.nan_step = 3;
  hr.steps = 8;
  check_offload_stages<adamw, float, precision<bf16>>({adamw_decayed()}, hr, dtype::bf16);
}

BOOST_AUTO_TEST_CASE(q8_adamw) {
  hook_run hr;
  hr.options.min_8bit_size = 256;
  hr.steps = 8;
  check_offload_stages<adamw, q8, precision<float>>({adamw_decayed()}, hr, dtype::f32);
}

BOOST_AUTO_TEST_CASE(lamb_layerwise_statistics) {
  lamb::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  hook_run hr;
  hr.steps = 8;
  check_offload_stages<lamb, float, precision<float>>({h}, hr, dtype::f32);
}

// Gradient accumulation: the device grads add up (reduce_last: copied after the last
// micro-batch) or are copied each micro-batch (reduce_each), with and without the hooks, at
// stages 1-3, d = 1..3: the bits of the same loop on cpu (which ctest `accumulate` checks
// against the schedules' global gradients).
BOOST_AUTO_TEST_CASE(gradient_accumulation_equals_cpu_at_every_stage) {
  const layout l = make_layout(awkward_layouts().front(), dtype::bf16);
  for (const accumulation sched : {accumulation::reduce_last, accumulation::reduce_each})
    for (int d = 1; d <= 3; ++d)
      for (const bool hooks : {false, true}) {
        optimizer_options o;
        o.micro_batches = 3;
        o.accumulate = sched;
        BOOST_TEST_CONTEXT((sched == accumulation::reduce_last ? "reduce_last" : "reduce_each")
                           << " d=" << d << (hooks ? " hooks" : "")) {
          BOOST_TEST_CONTEXT("stage 1")
          check_same(run_accumulating<sharded<float>, dev>(d, l, o, hooks),
                     run_accumulating<sharded<float>, cpu>(d, l, o, hooks));
          BOOST_TEST_CONTEXT("stage 2")
          check_same(run_accumulating<sharded<float, 2>, dev>(d, l, o, hooks),
                     run_accumulating<sharded<float, 2>, cpu>(d, l, o, hooks));
          BOOST_TEST_CONTEXT("stage 3")
          check_same(run_accumulating<sharded<float, 3>, dev>(d, l, o, hooks),
                     run_accumulating<sharded<float, 3>, cpu>(d, l, o, hooks));
        }
      }
  // The layer-wise statistics (Lamb at stage 3) and 8-bit states (q8 AdamW at stage 2) read
  // the accumulated grads the copies bring.
  lamb::hyper_params lh;
  lh.lr = 1e-2;
  lh.weight_decay = 0.01;
  for (const accumulation sched : {accumulation::reduce_last, accumulation::reduce_each}) {
    optimizer_options o;
    o.micro_batches = 4;
    o.accumulate = sched;
    BOOST_TEST_CONTEXT("lamb stage 3, d=2")
    check_same(run_accumulating<sharded<float, 3>, dev, lamb>(2, l, o, true, lh),
               run_accumulating<sharded<float, 3>, cpu, lamb>(2, l, o, true, lh));
    o.min_8bit_size = 256;
    BOOST_TEST_CONTEXT("q8 stage 2, d=3")
    check_same(run_accumulating<sharded<q8, 2>, dev>(3, l, o, false), run_accumulating<sharded<q8, 2>, cpu>(3, l, o, false));
  }
  // The whole device grads buffer would bypass the zeroing at a tensor's first view.
  optimizer_options o;
  o.micro_batches = 2;
  run_ranks(1, [&](threads& comm) {
    optimizer<adamw, sharded<float>, threads, dev, precision<bf16>> opt(l, adamw_decayed(), o, make_executor<dev>(1),
                                                                       std::move(comm));
    BOOST_CHECK_EXCEPTION(opt.grads(), std::logic_error, [](const std::logic_error& e) {
      return std::string(e.what()).find("each tensor's grads are zeroed at its first view") != std::string::npos;
    });
  });
}

// No hooks: the initial params are written into the device views only (the first step
// copies them to the host), the grads go over in one copy (stage 1) or by tensor (stage 2),
// clip_grad_norm copies them first; fp16 params with loss scaling equal one rank on cpu.
BOOST_AUTO_TEST_CASE(without_hooks_fp16_loss_scaling_equals_one_rank) {
  run_options ro = cases::fp16_loss_scaling();
  ro.clip = 1.0;
  for (const layout_case& c : awkward_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::f16);
    const outcome ref = run_single<adamw, float, precision<fp16>>(l, {adamw_decayed()}, ro);
    for (int d = 1; d <= 3; ++d) {
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d) {
        BOOST_TEST_CONTEXT("stage 1")
        check_same(run_threads<adamw, sharded<float>, precision<fp16>, dev>(d, l, {adamw_decayed()}, ro), ref);
        BOOST_TEST_CONTEXT("stage 2")
        check_same(run_threads<adamw, sharded<float, 2>, precision<fp16>, dev>(d, l, {adamw_decayed()}, ro), ref);
      }
    }
  }
}

// Saved by offload at stage 2 on 2 ranks, resumed on cpu at stage 1 on 3 ranks; saved on
// cpu at stage 1 on 2 ranks, resumed by offload at stage 3 on 3 ranks: both equal 6 steps
// on cpu at stage 1 on 3 ranks.
BOOST_AUTO_TEST_CASE(checkpoints_move_between_offload_and_cpu_across_stages_and_d) {
  const layout l = make_layout(awkward_layouts().front(), dtype::bf16);
  using opt_t = optimizer<adamw, sharded<float>, threads, cpu, precision<bf16>>;
  outcome ref = blank<opt_t>(l, 2), a = ref, b = ref;
  {
    scratch_dir dir("offload-ref");
    run_part<sharded<float>, cpu>(3, l, dir.path, true, 0, 0, nullptr);  // an empty start
    run_part<sharded<float>, cpu>(3, l, dir.path, false, 0, 6, &ref);
  }
  {
    scratch_dir dir("offload-out");
    run_part<sharded<float, 2>, dev>(2, l, dir.path, true, 3, 6, nullptr);
    run_part<sharded<float>, cpu>(3, l, dir.path, false, 3, 6, &a);
  }
  {
    scratch_dir dir("offload-in");
    run_part<sharded<float>, cpu>(2, l, dir.path, true, 3, 6, nullptr);
    run_part<sharded<float, 3>, dev>(3, l, dir.path, false, 3, 6, &b);
  }
  BOOST_TEST_CONTEXT("offload stage 2, d=2 -> cpu stage 1, d=3") check_same(a, ref);
  BOOST_TEST_CONTEXT("cpu stage 1, d=2 -> offload stage 3, d=3") check_same(b, ref);
}

// What crosses between host and device: without hooks one copy of the grads a step, and
// one of the params per bucket (three here; the first step also takes the device's
// initial params in one); with a hook per tensor one copy per tensor's grads.
BOOST_AUTO_TEST_CASE(copies_by_stage_and_hooks) {
  const layout l = three_equal_tensors();
  one_rank<sharded<float>> s1(l, adamw_decayed(), buckets_of(1024), dev(1));
  BOOST_TEST(copies_in([&] { s1.step(); }) == 5u);  // params in, grads in, 3 buckets of params out
  BOOST_TEST(copies_in([&] { s1.step(); }) == 4u);
  BOOST_TEST(copies_in([&] {
               for (const char* n : {"w2", "w1", "w0"}) s1.grads_ready(n);
               s1.step();
             }) == 6u);
  one_rank<sharded<float, 2>> s2(l, adamw_decayed(), buckets_of(1024), dev(1));
  s2.step();
  (void)s2.grad("w1");  // lent and zeroed: one copy; the others have none to copy
  BOOST_TEST(copies_in([&] { s2.step(); }) == 4u);
  one_rank<sharded<float>> one_bucket(l, adamw_decayed(), buckets_of(4096), dev(1));
  BOOST_TEST(copies_in([&] { one_bucket.step(); }) == 3u);  // params in, grads in, params out
}

// On a device that copies asynchronously, grads_ready only starts its copies: the next
// hook (or the step) waits for them and hands the tensors to the host optimizer. The
// emulated device makes a copy only when it is waited for, so a host that read its grads
// earlier, or a device buffer reused before, would change the results (the stage tests
// above compare them bit for bit). Moving an optimizer over one with a copy in flight
// waits for that copy and ends its registrations before its buffers go.
BOOST_AUTO_TEST_CASE(grads_ready_copies_run_beside_the_device_until_the_next_hook) {
  static_assert(copies_async<emulated_device>);
  auto& queue = detail::emulated_copies::instance();
  const layout l = three_equal_tensors();
  for (const int stage : {1, 2}) {
    BOOST_TEST_CONTEXT("stage " << stage) {
      const auto check = [&](auto& opt) {
        std::vector<bf16> g(1024);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = from_float<bf16>(0.25f + static_cast<float>(i % 7));
        upload(opt.executor(), std::span<const bf16>(g), opt.grad("w1"));
        const bf16* host_w1 = opt.host().grad("w1").data();  // the host's grads of w1 (its bucket's buffer)
        opt.grads_ready("w1");
        BOOST_TEST(opt.grads_in_flight() == 1u);
        BOOST_TEST(queue.in_flight() == 1u);  // started, not made
        BOOST_TEST(float(host_w1[5]) == 0.0f);  // not on the host yet
        upload(opt.executor(), std::span<const bf16>(g), opt.grad("w0"));
        opt.grads_ready("w0");  // w1 waited for and handed over; w0 in flight
        BOOST_TEST(opt.grads_in_flight() == 1u);
        BOOST_TEST(queue.in_flight() == 1u);
        BOOST_TEST(float(host_w1[5]) == float(g[5]));
        opt.grads_ready("w2");
        opt.step();
        BOOST_TEST(opt.grads_in_flight() == 0u);
        BOOST_TEST(queue.in_flight() == 0u);
      };
      if (stage == 1) {
        one_rank<sharded<float>> o(l, adamw_decayed(), buckets_of(1024), dev(1));
        check(o);
      } else {
        one_rank<sharded<float, 2>> o(l, adamw_decayed(), buckets_of(1024), dev(1));
        check(o);
      }
    }
  }
  auto& arenas = detail::device_arenas::instance();
  const std::size_t base = arenas.registered_bytes();
  one_rank<sharded<float>> a(l, adamw_decayed(), buckets_of(1024), dev(1));
  one_rank<sharded<float>> b(l, adamw_decayed(), buckets_of(1024), dev(1));
  const std::size_t each = arenas.registered_bytes() - base;
  a.grads_ready("w2");
  BOOST_TEST(queue.in_flight() == 1u);
  a = std::move(b);  // a's copy made, its host buffers unregistered, then freed
  BOOST_TEST(queue.in_flight() == 0u);
  BOOST_TEST(arenas.registered_bytes() - base == each / 2);
  a.grads_ready({"w0", "w1", "w2"});
  a.step();
  BOOST_TEST(a.grads_in_flight() == 0u);
}

// Stages 0-2 copy the updated params back by bucket, each as soon as the host step has
// finished it, so that on a GPU the copy of one bucket runs while the host updates the
// next. The host optimizer tells a listener (what offload's step sets) of each bucket:
// in order, once each, when its params are final (updated, and gathered with d = 2), and,
// with one rank, before the next bucket is updated. Element-wise (AdamW) and layer-wise
// (Lamb) steps; three buckets of one tensor each.
/// The host optimizer with the listener offload sets in reach (its context is protected).
template <class Optimizer>
struct listened : Optimizer {
  using Optimizer::Optimizer;
  void listen(detail::params_listener l) { this->ctx_.params_done_ = l; }
};

template <class Policy>
void check_params_told(const typename Policy::hyper_params& h) {
  const layout l = three_equal_tensors();
  constexpr std::size_t bucket = 1024;
  struct told {
    std::vector<std::size_t> order;
    std::vector<std::vector<bf16>> at;  // the whole params buffer at each tell
    std::vector<bf16> before, after;
  };
  std::vector<told> ranks(2);
  const auto run = [&](auto& opt, told& t) {
    const auto params = [&] {
      const auto p = opt.params();
      return std::vector<bf16>(p.data(), p.data() + p.size());
    };
    for (int s = 0; s < 2; ++s) {  // the first step starts the states; the second is told
      for (const char* n : {"w0", "w1", "w2"}) {
        const auto g = opt.grad(n);
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = from_float<bf16>(0.01f * static_cast<float>((i * 7 + static_cast<std::size_t>(s)) % 13) - 0.05f);
      }
      // The listener records the order and the whole params buffer at each tell.
      struct both {
        told* t;
        decltype(&opt) o;
      } b{&t, &opt};
      if (s == 1) {
        t.before = params();
        opt.listen(detail::params_listener{&b, [](void* to, std::size_t k) {
          auto& me = *static_cast<both*>(to);
          me.t->order.push_back(k);
          const auto p = me.o->params();
          me.t->at.emplace_back(p.data(), p.data() + p.size());
        }});
      }
      opt.step();
    }
    opt.listen({});
    t.after = params();
  };
  const auto same = [](const std::vector<bf16>& a, const std::vector<bf16>& b, std::size_t k) {
    return std::memcmp(a.data() + k * bucket, b.data() + k * bucket, bucket * sizeof(bf16)) == 0;
  };
  {
    listened<optimizer<Policy, sharded<float>, single, cpu, precision<bf16>>> opt(l, h, buckets_of(bucket), cpu(2));
    init_params(opt);
    run(opt, ranks[0]);
    const told& t = ranks[0];
    BOOST_TEST(t.order == (std::vector<std::size_t>{0, 1, 2}), boost::test_tools::per_element());
    for (std::size_t j = 0; j < t.at.size(); ++j) {
      BOOST_TEST_CONTEXT("one rank, bucket " << j) {
        BOOST_TEST(same(t.at[j], t.after, j));  // final when told
        BOOST_TEST(!same(t.before, t.after, j));  // and changed by the step
        if (j + 1 < 3) BOOST_TEST(same(t.at[j], t.before, j + 1));  // the next one not yet updated
      }
    }
  }
  ranks.assign(2, told{});
  run_ranks(2, [&](threads& comm) {
    const int r = comm.rank();
    listened<optimizer<Policy, sharded<float>, threads, cpu, precision<bf16>>> opt(l, h, buckets_of(bucket), cpu(1),
                                                                         std::move(comm));
    init_params(opt);
    run(opt, ranks[static_cast<std::size_t>(r)]);
  });
  for (std::size_t r = 0; r < 2; ++r) {
    const told& t = ranks[r];
    BOOST_TEST(t.order == (std::vector<std::size_t>{0, 1, 2}), boost::test_tools::per_element());
    for (std::size_t j = 0; j < t.at.size(); ++j)
      BOOST_TEST_CONTEXT("two ranks, rank " << r << ", bucket " << j) BOOST_TEST(same(t.at[j], t.after, j));
  }
}

BOOST_AUTO_TEST_CASE(params_are_told_bucket_by_bucket_as_the_host_finishes_them) {
  BOOST_TEST_CONTEXT("adamw") check_params_told<adamw>(adamw_decayed());
  lamb::hyper_params h;
  h.lr = 1e-2;
  BOOST_TEST_CONTEXT("lamb") check_params_told<lamb>(h);
}

// The emulated device makes an asynchronous copy at its wait, and throws there if the
// copy's source was written meanwhile: the check behind the stage tests above, which
// would catch a bucket's params copied before its update was done.
BOOST_AUTO_TEST_CASE(the_emulated_device_refuses_a_source_written_during_its_copy) {
  emulated_device d(1);
  detail::buffer<float, emulated_device> on_device(d, 256);
  std::vector<float> host(256, 1.0f), back(256, 0.0f);
  std::uint64_t t = d.copy_async(on_device.data(), host.data(), host.size() * sizeof(float));
  d.copy_wait(t);
  d.copy_bytes(back.data(), on_device.data(), back.size() * sizeof(float));
  BOOST_TEST(back == host, boost::test_tools::per_element());
  t = d.copy_async(on_device.data(), host.data(), host.size() * sizeof(float));
  host[7] = 2.0f;
  BOOST_CHECK_EXCEPTION(d.copy_wait(t), std::logic_error, [](const std::logic_error& e) {
    return std::string(e.what()).find("written while the copy was in flight") != std::string::npos;
  });
  BOOST_TEST(detail::emulated_copies::instance().in_flight() == 0u);  // made all the same
}

// The host buffers that the copies read and write are page-locked (registered with the
// device) for the optimizer's life: params and grads at stage 1 and params at stage 2 from
// the start, and at stages 2 and 3 each buffer of the host's bucket pools (grads, and the
// gathered params of stage 3) at its first copy. The emulated device records the
// registrations and counts the copies a GPU would stage through pageable memory.
BOOST_AUTO_TEST_CASE(host_buffers_copied_whole_are_page_locked) {
  auto& arenas = detail::device_arenas::instance();
  const std::size_t tensor_bytes = 1024 * sizeof(bf16), base = arenas.registered_bytes();
  const auto pageable_in = [&](auto f) {
    const std::size_t before = arenas.pageable_copies();
    f();
    return arenas.pageable_copies() - before;
  };
  const layout l = three_equal_tensors();
  {
    one_rank<sharded<float>> s1(l, adamw_decayed(), buckets_of(1024), dev(1));
    BOOST_TEST(arenas.registered_bytes() - base == 2 * 3 * tensor_bytes);  // params and grads
    BOOST_TEST(pageable_in([&] { s1.step(); }) == 0u);
    BOOST_TEST(pageable_in([&] {
                 for (const char* n : {"w2", "w1", "w0"}) s1.grads_ready(n);
                 s1.step();
               }) == 0u);
    one_rank<sharded<float>> moved(std::move(s1));  // the registrations move with it
    BOOST_TEST(arenas.registered_bytes() - base == 2 * 3 * tensor_bytes);
    BOOST_TEST(pageable_in([&] { moved.step(); }) == 0u);

    one_rank<sharded<float, 2>> s2(l, adamw_decayed(), buckets_of(1024), dev(1));
    const std::size_t stage2_base = 2 * 3 * tensor_bytes + 3 * tensor_bytes;
    BOOST_TEST(arenas.registered_bytes() - base == stage2_base);
    s2.step();
    (void)s2.grad("w1");
    BOOST_TEST(pageable_in([&] { s2.step(); }) == 0u);  // w1's grads in (registered at this first copy), params out
    // One rank: the grads are not sharded, so not pooled; the one grads buffer is registered.
    const std::size_t host_grads = s2.host().memory().bytes("grads");
    BOOST_TEST(host_grads >= 3 * tensor_bytes);
    BOOST_TEST(arenas.registered_bytes() - base == stage2_base + host_grads);
    BOOST_TEST(pageable_in([&] {
                 for (const char* n : {"w0", "w1", "w2"}) (void)s2.grad(n);
                 s2.step();
               }) == 0u);
    BOOST_TEST(arenas.registered_bytes() - base == stage2_base + host_grads);  // once

    // Stage 3, layer by layer: every gather copies out of the host's gathered bucket, every
    // grads_ready into its grad bucket; nothing is registered before the first copy.
    one_rank<sharded<float, 3>> s3(l, adamw_decayed(), buckets_of(1024), dev(1));
    const std::size_t stage3_base = arenas.registered_bytes();
    const auto layer_step = [&] {
      for (const char* n : {"w0", "w1", "w2"}) {
        s3.gather(n);
        s3.release(n);
      }
      for (const char* n : {"w2", "w1", "w0"}) {
        (void)s3.grad(n);
        s3.grads_ready(n);
      }
      s3.step();
    };
    BOOST_TEST(pageable_in(layer_step) == 0u);
    BOOST_TEST(pageable_in(layer_step) == 0u);
    const memory_report host3 = s3.host().memory();
    BOOST_TEST(host3.bytes("param buckets (peak)") >= tensor_bytes);  // pooled with one rank too
    BOOST_TEST(arenas.registered_bytes() - stage3_base == host3.bytes("param buckets (peak)") + host3.bytes("grads"));
  }
  BOOST_TEST(arenas.registered_bytes() == base);  // unregistered with their optimizers

  // Three ranks at stages 2 and 3: the grads live in the pools' bucket buffers. Every copy,
  // the first step's too, goes to or from registered memory, each buffer registered once.
  for (const int stage : {2, 3}) {
    BOOST_TEST_CONTEXT("stage " << stage) {
      const std::size_t before = arenas.pageable_copies();
      std::vector<std::size_t> pools(3);
      const auto ranks = [&]<int S>() {
        run_ranks(3, [&](threads& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          optimizer<adamw, sharded<float, S>, threads, dev, precision<bf16>> o(l, adamw_decayed(), buckets_of(1024),
                                                                               dev(1), std::move(comm));
          for (int step = 0; step < 3; ++step) {
            for (const char* n : {"w0", "w1", "w2"}) {
              o.gather(n);
              o.release(n);
            }
            for (const char* n : {"w2", "w1", "w0"}) {
              (void)o.grad(n);  // lent and zeroed on the device (an upload here would be a pageable copy of its own)
              o.grads_ready(n);
            }
            o.step();
          }
          const memory_report m = o.host().memory();
          pools[r] = m.bytes("grad buckets (peak)") + m.bytes("param buckets (peak)");
        });
      };
      if (stage == 2) ranks.template operator()<2>();
      else ranks.template operator()<3>();
      BOOST_TEST(arenas.pageable_copies() == before);
      for (const std::size_t p : pools) BOOST_TEST(p >= tensor_bytes);
    }
  }
  BOOST_TEST(arenas.registered_bytes() == base);
  optimizer_options unpinned = buckets_of(1024);
  unpinned.pin_host_buffers = false;
  one_rank<sharded<float>> plain(l, adamw_decayed(), unpinned, dev(1));
  BOOST_TEST(arenas.registered_bytes() == base);
  BOOST_TEST(pageable_in([&] { plain.step(); }) == 5u);  // params in, grads in, 3 buckets of params out
  one_rank<sharded<float, 2>> plain2(l, adamw_decayed(), unpinned, dev(1));
  plain2.step();
  (void)plain2.grad("w1");
  BOOST_TEST(pageable_in([&] { plain2.step(); }) == 4u);  // w1's grads in, params out
  BOOST_TEST(arenas.registered_bytes() == base);

  // As cudaHostRegister, the emulated device refuses a range that overlaps a registered one.
  std::vector<float> host(64);
  emulated_device d(1);
  d.register_host(host.data(), 32 * sizeof(float));
  BOOST_CHECK_THROW(d.register_host(host.data() + 16, 32 * sizeof(float)), std::invalid_argument);
  d.register_host(host.data() + 32, 32 * sizeof(float));  // adjacent: accepted
  d.unregister_host(host.data());
  d.unregister_host(host.data() + 32);
  BOOST_TEST(arenas.registered_bytes() == base);
}

// Params written into the device views arrive: as the first step's initial params, and
// through release(keep_writes) later; load brings the checkpoint's params to the device.
BOOST_AUTO_TEST_CASE(device_writes_reach_the_host_as_documented) {
  const layout l = three_equal_tensors();
  adamw::hyper_params h = adamw_decayed();
  h.lr = 0.1;
  h.weight_decay = 0.5;  // a zero-grad step scales the params by 0.95
  one_rank<sharded<float>> opt(l, h, buckets_of(1024), dev(1));
  const std::vector<bf16> ones(1024, bf16(1.0f)), twos(1024, bf16(2.0f));
  upload(opt.executor(), ones, opt.param("w1"));
  opt.step();
  const auto host_w1 = opt.host().param("w1");
  std::vector<bf16> dev_w1(1024);
  download(opt.executor(), opt.param("w1"), std::span<bf16>(dev_w1));
  BOOST_TEST(to_float(host_w1[0]) == to_float(bf16(0.95f)));
  BOOST_TEST(std::memcmp(host_w1.data(), dev_w1.data(), host_w1.size_bytes()) == 0);
  opt.gather("w0");
  upload(opt.executor(), twos, opt.param("w0"));
  opt.release("w0", keep_writes);
  BOOST_TEST(to_float(opt.host().param("w0")[7]) == 2.0f);
  opt.load_master_from_params();  // the master weights take the write too
  opt.step();
  std::vector<bf16> w0(1024);
  download(opt.executor(), opt.param("w0"), std::span<bf16>(w0));
  BOOST_TEST(to_float(w0[7]) == to_float(bf16(1.9f)));
}

// A checkpoint saved before the first step holds the initial params written on the device;
// load drops a step in progress (hooks, lent grads) as the host optimizer's load does.
BOOST_AUTO_TEST_CASE(save_before_the_first_step_and_load_in_mid_step) {
  const layout l = three_equal_tensors();
  scratch_dir dir("offload-initial");
  const std::vector<bf16> ones(1024, bf16(1.0f));
  {
    one_rank<sharded<float, 2>> opt(l, adamw_decayed(), buckets_of(1024), dev(1));
    for (const char* n : {"w0", "w1", "w2"}) upload(opt.executor(), ones, opt.param(n));
    opt.save(dir.path);
  }
  one_rank<sharded<float, 2>> opt(l, adamw_decayed(), buckets_of(1024), dev(1));
  (void)opt.grad("w0");
  opt.grads_ready("w0");
  opt.load(dir.path);
  std::vector<bf16> w2(1024);
  download(opt.executor(), opt.param("w2"), std::span<bf16>(w2));
  BOOST_TEST(std::memcmp(w2.data(), ones.data(), w2.size() * sizeof(bf16)) == 0);
  (void)opt.grad("w0");  // a new step: w0 may be written and declared ready again
  opt.grads_ready({"w0", "w1", "w2"});
  BOOST_TEST(!opt.step().skipped);
}

BOOST_AUTO_TEST_CASE(misuse_is_refused_naming_the_tensor) {
  const layout l = three_equal_tensors();
  const auto throws_naming = [](auto f, const std::string& what) {
    try {
      f();
      BOOST_ERROR("no exception; expected one naming " << what);
    } catch (const std::exception& e) {
      BOOST_TEST_CONTEXT(e.what()) BOOST_TEST(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  one_rank<sharded<float, 3>> opt(l, adamw_decayed(), buckets_of(1024), dev(1));
  throws_naming([&] { (void)opt.param("w1"); }, "'w1'");  // not gathered
  opt.gather("w1");
  throws_naming([&] { opt.gather("w1"); }, "'w1'");
  throws_naming([&] { opt.step(); }, "'w1'");  // still gathered
  opt.release("w1");
  throws_naming([&] { opt.release("w1"); }, "'w1'");
  (void)opt.grad("w0");
  opt.grads_ready("w0");
  throws_naming([&] { opt.grads_ready("w0"); }, "'w0'");
  throws_naming([&] { (void)opt.grad("w0"); }, "'w0'");
  throws_naming([&] { opt.step(); }, "'w1'");  // w1 never declared ready
  throws_naming([&] { opt.grads_ready("nope"); }, "nope");
  // A refused call marks nothing: a repeated name, an unknown one, a clip before w1 and w2
  // are ready; then the step goes on.
  throws_naming([&] { opt.grads_ready({"w1", "w1"}); }, "'w1'");
  throws_naming([&] { opt.grads_ready({"w1", "nope"}); }, "nope");
  throws_naming([&] { opt.clip_grad_norm(1.0); }, "'w1'");
  opt.grads_ready({"w1", "w2"});
  BOOST_TEST(!opt.step().skipped);
  throws_naming([&] { (void)opt.params(); }, "ZeRO-3");
  throws_naming([&] { (void)opt.grads(); }, "ZeRO-2");
}

// The device holds the params and grads (stage 1), or pooled buffers reused layer after
// layer (stage 3: one tensor's bytes when one tensor is gathered at a time); the master
// weights and states stay in the host report, equal to the host optimizer's alone.
BOOST_AUTO_TEST_CASE(memory_report_splits_host_and_device) {
  const layout l = three_equal_tensors();
  one_rank<sharded<float>> s1(l, adamw_decayed(), buckets_of(1024), dev(1));
  optimizer<adamw, sharded<float>, single, cpu, precision<bf16>> plain(l, adamw_decayed(), buckets_of(1024));
  const memory_report r1 = s1.memory(), p = plain.memory();
  BOOST_TEST(r1.bytes("device params") == 3 * 1024 * sizeof(bf16));
  BOOST_TEST(r1.bytes("device grads") == 3 * 1024 * sizeof(bf16));
  for (const auto& e : p.entries) BOOST_TEST_CONTEXT(e.category) BOOST_TEST(r1.bytes(e.category) == e.bytes);
  BOOST_TEST(r1.total_bytes() == p.total_bytes() + 2 * 3 * 1024 * sizeof(bf16));

  one_rank<sharded<float, 3>> s3(l, adamw_decayed(), buckets_of(1024), dev(1));
  for (const char* n : {"w0", "w1", "w2"}) {
    s3.gather(n);
    (void)s3.grad(n);
    s3.grads_ready(n);
    s3.release(n);
  }
  s3.step();
  const memory_report r3 = s3.memory();
  BOOST_TEST(r3.bytes("device params") == 0u);
  BOOST_TEST(r3.bytes("device param buffers (pool)") == 1024 * sizeof(bf16));
  BOOST_TEST(r3.bytes("device grad buffers (pool)") == 1024 * sizeof(bf16));
}

BOOST_AUTO_TEST_SUITE_END()
