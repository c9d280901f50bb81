// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The memory report of an optimizer: each allocation its context holds, by
/// category, the stages' own (factored states, projections, Newton-Schulz work), and the
/// elements that belong to no tensor (block alignment, shard padding) as "padding".

#include <cstddef>
#include <string>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../memory_report.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// An allocation of `bytes` over `elems` elements, `used` of them a tensor's: the used
/// bytes as `name`, the rest added to `padding` (nothing when `bytes` is 0).
DISTOPT_CORE_FN void add_allocation(memory_report& r, std::size_t& padding, const char* name, std::size_t bytes,
                                    std::size_t elems, std::size_t used);
/// An entry of `bytes` as `name`, unless `bytes` is 0.
DISTOPT_CORE_FN void add_entry(memory_report& r, std::string name, std::size_t bytes);
/// State slot `k`'s allocations: its buffer (`used` elements a tensor's), q8's absmax and
/// fp32 states of small tensors.
DISTOPT_CORE_FN void add_slot(memory_report& r, std::size_t& padding, int k, std::size_t bytes, std::size_t elems,
                              std::size_t used, std::size_t absmax_bytes, std::size_t small_bytes);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void add_allocation(memory_report& r, std::size_t& padding, const char* name, std::size_t bytes,
                                    std::size_t elems, std::size_t used) {
  if (bytes == 0) return;
  const std::size_t each = bytes / elems;
  r.entries.push_back({name, used * each});
  padding += (elems - used) * each;
}
DISTOPT_CORE_FN void add_entry(memory_report& r, std::string name, std::size_t bytes) {
  if (bytes) r.entries.push_back({std::move(name), bytes});
}
DISTOPT_CORE_FN void add_slot(memory_report& r, std::size_t& padding, int k, std::size_t bytes, std::size_t elems,
                              std::size_t used, std::size_t absmax_bytes, std::size_t small_bytes) {
  const std::string slot = "state " + std::to_string(k);
  add_allocation(r, padding, slot.c_str(), bytes, elems, used);
  add_entry(r, slot + " absmax", absmax_bytes);
  add_entry(r, slot + " fp32", small_bytes);
}
#endif  // DISTOPT_CORE_BODIES

template <class Ctx, class Stages>
memory_report memory_of(const Ctx& c, const Stages& stages) {
  memory_report r;
  r.parameters = c.layout_.numel();
  std::size_t padding = 0;
  const std::size_t full_used = c.layout_.numel(), local_used = c.plan_.local_numel();
  add_allocation(r, padding, "params", c.params_.bytes(), c.params_.size(), c.shards_params() ? local_used : full_used);
  // ZeRO-3: the full-bucket param buffers lent by gather and prefetch, at their peak.
  add_entry(r, "param buckets (peak)", c.param_pool_.bytes());
  add_allocation(r, padding, "grads", c.grads_.bytes(), c.grads_.size(), c.shards_grads() ? local_used : full_used);
  // ZeRO-2: the full-bucket grad buffers lent during backward, as many as were ever
  // lent at once (the pool keeps them).
  add_entry(r, "grad buckets (peak)", c.grad_pool_.bytes());
  add_allocation(r, padding, "grads fp32", c.grads32_.bytes(), c.grads32_.size(), local_used);
  add_allocation(r, padding, "master", c.master_.bytes(), c.master_.size(), local_used);
  // The state slots (q8: codes of the 8-bit tensors, their last partial blocks padded; one
  // fp32 absmax per block; the fp32 states of the tensors below min_8bit_size).
  for (int k = 0; k < c.slots_; ++k)
    add_slot(r, padding, k, c.states_[k].bytes(), c.states_[k].size(), c.states_at_.used(state_home::slot, k),
             c.absmax_[k].bytes(), c.small_[k].bytes());
  stages.add_memory(c, r);
  add_entry(r, "clip history", c.gnorm_vec_.size() * sizeof(c.gnorm_vec_[0]));
  // Device executors: the piece table and what each step's launches read and write there
  // (a host executor's, the step's decisions and 88 B of norm sums per eight pieces, are
  // not counted, as the host's temporaries were not).
  if constexpr (!host_memory<typename Ctx::executor_type>) {
    const std::size_t tables = c.pieces_dev_.bytes() + c.step_scalars_.bytes() + c.step_slots_.bytes() +
                               c.step_clip_scale_.bytes() + c.step_skip_.bytes() + c.step_sums_.bytes() +
                               c.control_.bytes() + c.groups_dev_.bytes() + c.started_dev_.bytes() + c.norm_wire_.bytes();
    add_entry(r, "step tables", tables);
  }
  r.entries.push_back({"padding", padding});
  r.entries.push_back({"comm buffers", c.staging_.bytes()});
  return r;
}

}  // namespace distopt::detail
