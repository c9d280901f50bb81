// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The one bucket loop every stage's update runs through: for each bucket, wait for
/// its reduction, run the stage on it, start the all-gather of its params, and tell the
/// listener (offload's copies, a ZeRO-3 prefetch) of the buckets whose params are final.

#include <cstddef>

#include "../concepts.hpp"
#include "collectives.hpp"

namespace distopt::detail {

/// Runs `run(first, end)` over the buckets [first, end) of the context's plan, bucket by
/// bucket, each after its reduction and followed by its all-gather (gather_params on), so
/// that later buckets' reductions and earlier buckets' gathers overlap the update.
///
/// `whole` (nothing to do between buckets, on a device): a device runs a launch's items in
/// waves of the thread blocks that fit at once, and a bucket (4 Mi elements, 256 pieces by
/// default) fills two thirds of an H200's first wave for AdamW fp32 and nothing more: its
/// step ran at 0.77 of the copy bandwidth a launch per bucket, at 0.88 in one launch over
/// every bucket (bench/RESULTS.md). So it waits for every bucket's reduction, runs all
/// buckets at once (their pieces and items are consecutive), then starts the gathers. What
/// a bucket's work computes does not depend on the launch it is in: the bits are the same.
template <class Ctx, class Run>
void run_buckets(Ctx& c, bool whole, Run&& run) {
  const std::size_t n = c.plan_.buckets().size();
  if (whole && !host_memory<typename Ctx::executor_type> && n > 0) {
    for (std::size_t k = 0; k < n; ++k) wait_bucket(c, k);
    run(std::size_t{0}, n);
    if (c.options_.gather_params)
      for (std::size_t k = 0; k < n; ++k) start_gather(c, k, true);
    return;
  }
  for (std::size_t k = 0; k < n; ++k) {
    wait_bucket(c, k);
    run(k, k + 1);
    if (c.options_.gather_params) start_gather(c, k, true);
    tell_params(c, k + 1, false);
  }
}

}  // namespace distopt::detail
