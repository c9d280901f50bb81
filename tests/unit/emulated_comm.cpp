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
