// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A communicator of device memory on the emulated device: device_threads
// (emulated_harness.hpp) keeps NCCL's contract and throws when it is handed host memory.
// The optimizer on the emulated device configured as distopt::cuda is hands it the
// executor's memory only: the buckets in place, and its host-side wires (the layout and
// hook-order checks, the norm and statistics wires, percentile clipping, the checkpoint's
// agreement, in checkpoint.cpp) through device scratch. The bits are the CPU executor's
// on d = 1..4 ranks: what optimizer<..., nccl, cuda> runs, short of NCCL's own sum order.

#include "emulated_harness.hpp"
#include "executor_harness.hpp"
#include "layerwise_cases.hpp"
#include "zero_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <array>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using namespace distopt;
using namespace harness;

static_assert(communicator<device_threads> && async_communicator<device_threads>);
static_assert(collectives_in_device_memory<device_threads> && !collectives_in_device_memory<threads>);

BOOST_AUTO_TEST_SUITE(device_communicator)

// The check the suites below rely on can fail: host memory, and a span that runs past the
// end of device memory, are refused on every rank; device memory is reduced.
BOOST_AUTO_TEST_CASE(device_threads_refuses_host_memory) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::array<std::string, 2> host_error, past_error;
  std::array<std::vector<double>, 2> reduced;
  run_ranks(2, [&](threads& t) {
    device_threads c(std::move(t));
    const auto r = static_cast<std::size_t>(c.rank());
    std::vector<double> host(4, 1.0 + static_cast<double>(r));
    try {
      c.all_reduce(std::span<double>(host), reduce_op::sum);
    } catch (const std::invalid_argument& e) {
      host_error[r] = e.what();
    }
    emulated_device e(1);
    auto* p = static_cast<double*>(e.allocate_bytes(4 * sizeof(double)));  // one page
    try {
      c.all_gather(std::span<const double>(p, 2), std::span<double>(p, page / sizeof(double) + 2));
    } catch (const std::invalid_argument& err) {
      past_error[r] = err.what();
    }
    upload(e, std::span<const double>(host), device_span<double>(p, 4));
    c.all_reduce(std::span<double>(p, 4), reduce_op::sum);
    reduced[r].resize(4);
    download(e, device_span<const double>(p, 4), std::span<double>(reduced[r]));
    e.deallocate_bytes(p, 4 * sizeof(double));
  });
  for (std::size_t r = 0; r < 2; ++r) {
    const std::string rank = std::to_string(r);
    BOOST_TEST(host_error[r] == "device_threads::all_reduce on rank " + rank + ": a buffer lies outside the device's memory");
    BOOST_TEST(past_error[r] == "device_threads::all_gather on rank " + rank + ": a buffer lies outside the device's memory");
    BOOST_TEST((reduced[r] == std::vector<double>(4, 3.0)));
  }
  BOOST_TEST(detail::device_arenas::instance().opened() == 0);
}

// The executor and the device communicator share a device and a stream, as cuda and nccl
// must: another stream or another device is refused at construction, on every rank; the
// same ones run, and the step hands the communicator its collectives (none skipped).
BOOST_AUTO_TEST_CASE(the_communicator_shares_the_executors_stream_and_device) {
  layout l;
  l.add("w", {300, 40}, dtype::f32);
  l.add("b", {40}, dtype::f32);
  optimizer_options o;
  o.bucket_elems = 4096;  // buckets close at a tensor's end: "w", then "b"
  o.max_grad_norm = 1.0;
  using opt_t = optimizer<adamw, sharded<fp32>, device_threads, streamed_device>;
  std::array<std::string, 4> refused;  // [rank * 2 + case]
  std::array<std::size_t, 2> at_construction{}, in_step{};
  std::array<bool, 2> skipped{true, true};  // checked after the ranks: Boost.Test is not thread-safe
  run_ranks(2, [&](threads& t) {
    const int r = t.rank();
    threads a = t.split(0, r), b = t.split(0, r);
    const auto refusal = [&](threads&& c, int comm_stream, int comm_device) {
      try {
        opt_t(l, {adamw::hyper_params{}}, o, streamed_device(7, 0), device_threads(std::move(c), comm_stream, comm_device));
      } catch (const std::invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string("none");
    };
    refused[static_cast<std::size_t>(2 * r)] = refusal(std::move(a), 8, 0);
    refused[static_cast<std::size_t>(2 * r + 1)] = refusal(std::move(b), 7, 1);
    opt_t opt(l, {adamw::hyper_params{}}, o, streamed_device(7, 0), device_threads(std::move(t), 7, 0));
    at_construction[static_cast<std::size_t>(r)] = opt.communicator().collectives();
    for (const auto& ts : l.tensors()) {
      const std::vector<float> g(ts.numel, 0.5f);
      upload(opt.executor(), g, opt.grad(ts.name));
    }
    skipped[static_cast<std::size_t>(r)] = opt.step().get().skipped;
    in_step[static_cast<std::size_t>(r)] = opt.communicator().collectives() - at_construction[static_cast<std::size_t>(r)];
  });
  BOOST_TEST_REQUIRE(!skipped[0]);
  BOOST_TEST_REQUIRE(!skipped[1]);
  for (const std::string& e : refused)
    BOOST_TEST(e == "distopt::optimizer: the communicator enqueues its collectives on another stream or device than "
                    "the executor's kernels; give both the same device and stream");
  const std::size_t buckets = detail::shard_plan(l, 2, 0, o.bucket_elems, std::size_t{1} << 14).buckets().size();
  BOOST_TEST(buckets == 2u);
  for (std::size_t r = 0; r < 2; ++r) {
    BOOST_TEST(at_construction[r] == 1u);           // the layout check
    BOOST_TEST(in_step[r] == 2 * buckets + 1);     // a reduce-scatter and an all-gather each, the norm wire
  }
}

// Clipping (grad_norm's wire) and percentile clipping (each tensor's norm over the ranks)
// with sharded fp32 states: the buckets' reduce-scatters and all-gathers in place.
BOOST_AUTO_TEST_CASE(adamw_clipped_with_percentile_clipping) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.clip = 1.0;
  ro.options.percentile_clipping = 5;
  check_executor<device_code_only, adamw, fp32, precision<float>, device_threads>({h}, ro);
}

// Clipped inside the step, which is decided on the device: the norm wire is all-reduced
// in place in device memory.
BOOST_AUTO_TEST_CASE(adamw_clipped_inside_the_step) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.options.max_grad_norm = 1.0;
  check_executor<device_code_only, adamw, fp32, precision<float>, device_threads>({h}, ro);
}

// 8-bit states with clipping and percentile clipping.
BOOST_AUTO_TEST_CASE(q8_adamw_with_percentile_clipping) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  check_executor<device_code_only, adamw, q8, precision<float>, device_threads>({h}, cases::q8_percentile_clipping());
}

// Replicated states, bf16 grads all-reduced in fp32 (the i-forms, on the fp32 staging
// bucket), on 2 and 3 ranks.
BOOST_AUTO_TEST_CASE(replicated_bf16_grads_reduced_in_fp32) {
  run_options ro;
  ro.options.max_grad_norm = 1.0;
  check_replicated_bf16_reduced_in_fp32<device_code_only, device_threads>(ro);
}

// CAME's row, column and tensor statistics, summed over the ranks whose shards a matrix
// straddles, with bf16 params and fp32 master weights.
BOOST_AUTO_TEST_CASE(came_statistics_bf16_params_with_master) {
  check_executor<device_code_only, distopt::came, fp32, precision<bf16, bf16>, device_threads>(
      {came_case()}, run_options{}, dtype::bf16, layerwise_layouts());
}

// ZeRO-3 with the hooks and check_hook_order (the ranks compare each bucket's collective
// before starting it), the step clipped inside and one NaN step skipped: stage 1 without
// hooks on cpu and `threads` is the reference.
BOOST_AUTO_TEST_CASE(zero_3_hooks_with_the_order_checked) {
  hook_run hr;
  hr.options.max_grad_norm = 1.0;
  hr.options.check_hook_order = true;
  hr.nan_step = 3;
  hr.steps = 6;
  adamw_bf16_hook_cases(hr, [](const layout& l, int d, const hook_run& on, const outcome& ref) {
    check_same(
        run_hooks<adamw, sharded<float, 3>, precision<bf16>, device_code_only, device_threads>(d, l, {adamw_decayed()}, on),
        ref);
  });
}

BOOST_AUTO_TEST_SUITE_END()
