// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The memory report of an optimizer: each allocation its context holds, by
/// category, the stages' own (factored states, projections, Newton-Schulz work), and the
/// elements that belong to no tensor (block alignment, shard padding) as "padding".

#include <cstddef>
#include <string>

#include "../concepts.hpp"
#include "../memory_report.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

template <class Ctx, class Stages>
memory_report memory_of(const Ctx& c, const Stages& stages) {
  memory_report r;
  r.parameters = c.layout_.numel();
  std::size_t padding = 0;
  // An allocation of `elems` elements, `used` of them a tensor's.
  const auto add = [&](std::string name, std::size_t bytes, std::size_t elems, std::size_t used) {
    if (bytes == 0) return;
    const std::size_t each = bytes / elems;
    r.entries.push_back({std::move(name), used * each});
    padding += (elems - used) * each;
  };
  const std::size_t full_used = c.layout_.numel(), local_used = c.plan_.local_numel();
  add("params", c.params_.bytes(), c.params_.size(), c.shards_params() ? local_used : full_used);
  // ZeRO-3: the full-bucket param buffers lent by gather and prefetch, at their peak.
  if (c.param_pool_.bytes()) r.entries.push_back({"param buckets (peak)", c.param_pool_.bytes()});
  add("grads", c.grads_.bytes(), c.grads_.size(), c.shards_grads() ? local_used : full_used);
  // ZeRO-2: the full-bucket grad buffers lent during backward, as many as were ever
  // lent at once (the pool keeps them).
  if (c.grad_pool_.bytes()) r.entries.push_back({"grad buckets (peak)", c.grad_pool_.bytes()});
  add("grads fp32", c.grads32_.bytes(), c.grads32_.size(), local_used);
  add("master", c.master_.bytes(), c.master_.size(), local_used);
  // The state slots (q8: codes of the 8-bit tensors, their last partial blocks padded; one
  // fp32 absmax per block; the fp32 states of the tensors below min_8bit_size).
  for (int k = 0; k < c.slots_; ++k) {
    const std::string slot = "state " + std::to_string(k);
    add(slot, c.states_[k].bytes(), c.states_[k].size(), c.states_at_.used(state_home::slot, k));
    if (c.absmax_[k].bytes()) r.entries.push_back({slot + " absmax", c.absmax_[k].bytes()});
    if (c.small_[k].bytes()) r.entries.push_back({slot + " fp32", c.small_[k].bytes()});
  }
  stages.add_memory(c, r);
  if (!c.gnorm_vec_.empty()) r.entries.push_back({"clip history", c.gnorm_vec_.size() * sizeof(c.gnorm_vec_[0])});
  // Device executors: the piece table and what each step's launches read and write there
  // (a host executor's, the step's decisions and 88 B of norm sums per eight pieces, are
  // not counted, as the host's temporaries were not).
  if constexpr (!host_memory<typename Ctx::executor_type>) {
    const std::size_t tables = c.pieces_dev_.bytes() + c.step_scalars_.bytes() + c.step_slots_.bytes() +
                               c.step_clip_scale_.bytes() + c.step_skip_.bytes() + c.step_sums_.bytes() +
                               c.control_.bytes() + c.groups_dev_.bytes() + c.started_dev_.bytes() + c.norm_wire_.bytes();
    if (tables) r.entries.push_back({"step tables", tables});
  }
  r.entries.push_back({"padding", padding});
  r.entries.push_back({"comm buffers", c.staging_.bytes()});
  return r;
}

}  // namespace distopt::detail
