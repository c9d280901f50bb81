// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The global gradient norm and percentile clipping's per-tensor norms: squares of
/// the reduced grads summed exactly per layout block (squares_phase), the exact sums'
/// wire image all-reduced over the ranks the norm spans, as functions of the context.
/// Each layout block is summed in double and the block sums are added exactly
/// (detail::exact_sum), over threads, shards and ranks: the norm is the same for every d
/// and every thread count.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/exact_sum.hpp"
#include "../detail/function_ref.hpp"
#include "../detail/shard_plan.hpp"
#include "../layout/registry.hpp"
#include "../exec/transfer.hpp"
#include "collectives.hpp"
#include "mirror.hpp"
#include "phases.hpp"

namespace distopt::detail {

/// An all-reduce (sum) of doubles in host memory over a group of ranks.
using host_sum = function_ref<void(std::span<double>)>;

/// Percentile clipping, from each piece's exact sum of squares (`piece_sums`, one per
/// piece of `plan`, grads already divided by the loss scale): each tensor's exact squared
/// norm, all-reduced over DP for the tensors cut across ranks (`straddlers`, through
/// `dp_sum` when given) and over TP for split ones (through `tp_sum` when given); then
/// each tensor's history `history[i]` records it (scaled by coef^2) as step `step`'s (all
/// 100 on step 1), and `scale[i]` becomes min(1, the `percentile`-th smallest recorded
/// norm / this step's norm), as bitsandbytes' percentile_clipping.
DISTOPT_CORE_FN void percentile_history(const layout& tensors, const shard_plan& plan, std::span<const exact_sum> piece_sums,
                                        std::span<const std::size_t> straddlers, const host_sum* dp_sum,
                                        const host_sum* tp_sum, std::span<std::array<float, 100>> history, double coef,
                                        std::int64_t step, int percentile, std::vector<float>& scale);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void percentile_history(const layout& l, const shard_plan& plan, std::span<const exact_sum> piece_sums,
                                        std::span<const std::size_t> straddlers, const host_sum* dp_sum,
                                        const host_sum* tp_sum, std::span<std::array<float, 100>> history, double coef,
                                        std::int64_t step, int percentile, std::vector<float>& scale) {
  const auto tensors = l.tensors();
  const auto& pieces = plan.pieces();
  std::vector<exact_sum> sums(tensors.size());
  for (std::size_t p = 0; p < pieces.size(); ++p) sums[pieces[p].tensor].add(piece_sums[p]);
  const auto all_reduce = [&](const host_sum& sum, std::span<const std::size_t> which) {
    if (which.empty()) return;
    constexpr std::size_t W = exact_sum::wire_size;
    std::vector<double> wire(which.size() * W);
    for (std::size_t j = 0; j < which.size(); ++j) sums[which[j]].to_wire(std::span<double, W>(wire.data() + j * W, W));
    sum(wire);
    for (std::size_t j = 0; j < which.size(); ++j)
      sums[which[j]] = exact_sum::from_wire(std::span<const double, W>(wire.data() + j * W, W));
  };
  if (dp_sum) all_reduce(*dp_sum, straddlers);
  if (tp_sum) {
    std::vector<std::size_t> split;
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].tp != tp_split::none) split.push_back(i);
    all_reduce(*tp_sum, split);
  }
  scale.assign(history.size(), 1.0f);
  const std::size_t at = static_cast<std::size_t>(step % 100);
  for (std::size_t i = 0; i < history.size(); ++i) {
    auto& vec = history[i];
    const float now = static_cast<float>(sums[i].value() * coef * coef);
    if (step == 1) vec.fill(now);
    else vec[at] = now;
    std::array<float, 100> sorted = vec;
    std::sort(sorted.begin(), sorted.end());
    const float current = std::sqrt(vec[at]);
    const float clip = std::sqrt(sorted[static_cast<std::size_t>(percentile)]);
    if (current > clip) scale[i] = clip / current;
  }
}
#endif  // DISTOPT_CORE_BODIES

/// The squares phase of this rank's pieces of the reduced grads `grads` times `scale`, one
/// item per piece.
template <class Ctx, class G>
squares_phase<G> squares_of(const Ctx& c, const G* grads, double scale) noexcept {
  squares_phase<G> sq;
  sq.pieces = c.exec_pieces();
  sq.piece_count = c.plan_.pieces().size();
  sq.grads = grads;
  sq.grads_local = c.template grads_local<G>();
  sq.scale = scale;
  sq.block = c.layout_.block_size();
  return sq;
}

/// Runs a squares phase into step_sums_ (zeroed first, in the executor's memory) and
/// returns its number of items.
template <class Ctx, class G>
std::size_t launch_squares(Ctx& c, squares_phase<G> sq) {
  const std::size_t items = (sq.piece_count + sq.per - 1) / sq.per;
  if (c.step_sums_.size() < items) c.step_sums_ = buffer<exact_sum, typename Ctx::executor_type>(c.exec_, items);
  fill_zero(c.exec_, c.step_sums_.data(), items, 64);  // empty sums, set where they are summed
  sq.out = c.step_sums_.data();
  launch(c.exec_, items, sq);
  return items;
}

/// Runs a squares phase over its items and returns their exact sums on the host (a copy
/// out of the executor's memory when it is a device's).
template <class Ctx, class G>
std::vector<exact_sum> run_squares(Ctx& c, squares_phase<G> sq) {
  const std::size_t items = (sq.piece_count + sq.per - 1) / sq.per;
  std::vector<exact_sum> sums(items);
  if constexpr (host_memory<typename Ctx::executor_type>) {
    sq.out = sums.data();
    launch(c.exec_, items, sq);
  } else {
    launch_squares(c, sq);
    copy_bytes(c.exec_, sums.data(), c.step_sums_.data(), items * sizeof(exact_sum));
  }
  return sums;
}

/// The squares phase of the global norm over this rank's pieces of `base` (reduced grads,
/// buffer or local index), times `inv`, or divided by `*divide_by` (the loss scale in the
/// executor's memory) when given; pieces in items of `per`.
template <class Ctx, class G>
squares_phase<G> norm_squares(Ctx& c, const G* base, double inv, const double* divide_by = nullptr) {
  const auto& pieces = c.plan_.pieces();
  squares_phase<G> sq = squares_of(c, base, inv);
  sq.divide_by = divide_by;
  // Host executors: 8 items a thread, to balance. Device executors: an item a work unit
  // (cuda: a thread block of 16 half-warps), and fewer exact sums for norm_wire_phase to add.
  const std::size_t items = (host_memory<typename Ctx::executor_type> ? 8 : 1) * static_cast<std::size_t>(c.exec_.concurrency());
  sq.per = std::max<std::size_t>(1, pieces.size() / items);
  if ((c.model_parallel_ || c.tp_) && c.tp_rank_ != 0) {  // tensors every TP rank holds count on TP rank 0
    if (c.step_skip_host_.empty()) {  // made once (the groups' setters clear it)
      c.step_skip_host_.resize(pieces.size());
      for (std::size_t p = 0; p < pieces.size(); ++p)
        c.step_skip_host_[p] = c.layout_.tensors()[pieces[p].tensor].tp == tp_split::none;
      c.in_exec(c.step_skip_host_, c.step_skip_);
    }
    if constexpr (host_memory<typename Ctx::executor_type>) sq.skip = c.step_skip_host_.data();
    else sq.skip = c.step_skip_.data();
  }
  return sq;
}

/// Global L2 norm of the reduced grads / loss scale, on the host (optimizer::clip_grad_norm).
template <class Ctx>
double grad_norm(Ctx& c) {
  reduce_grads(c);
  wait_pending(c);
  const double inv = 1.0 / loss_scale_of(c);
  exact_sum total;
  c.with_reduced_grads([&](const auto* grads) {
    for (const auto& a : run_squares(c, norm_squares(c, grads, inv))) total.add(a);
  });
  std::array<double, exact_sum::wire_size> wire{};
  total.to_wire(wire);
  if (Ctx::is_sharded && c.comm_.size() > 1) c.comms_.all_reduce_host(c.exec_, c.comm_, wire, reduce_op::sum);
  if (c.model_parallel_) c.comms_.all_reduce_host(c.exec_, *c.model_parallel_, wire, reduce_op::sum);
  else if (c.tp_) c.comms_.all_reduce_host(c.exec_, *c.tp_, wire, reduce_op::sum);
  return std::sqrt(exact_sum::from_wire(wire).value());
}

/// The global squared norm's exact sum as an all-reduced wire image in the executor's
/// memory, for the step's decision: the squares phase (grads / the loss scale in the
/// step's control), their sum, and the all-reduce over ranks where the norm spans them.
template <class Ctx>
const double* norm_wire(Ctx& c) {
  wait_pending(c);
  const double* loss_scale = &c.control_.data()->loss_scale;
  norm_wire_phase sum;
  sum.items = c.with_reduced_grads([&](const auto* grads) { return launch_squares(c, norm_squares(c, grads, 1.0, loss_scale)); });
  sum.sums = c.step_sums_.data();
  sum.wire = c.norm_wire_.data();
  launch(c.exec_, 1, sum);
  if (Ctx::is_sharded && c.comm_.size() > 1) c.comms_.all_reduce_exec(c.exec_, c.comm_, c.norm_wire_.data(), exact_sum::wire_size);
  if (c.model_parallel_) c.comms_.all_reduce_exec(c.exec_, *c.model_parallel_, c.norm_wire_.data(), exact_sum::wire_size);
  else if (c.tp_) c.comms_.all_reduce_exec(c.exec_, *c.tp_, c.norm_wire_.data(), exact_sum::wire_size);
  return c.norm_wire_.data();
}

/// Percentile clipping: the exact squared norm of each tensor's (unscaled, clipped)
/// gradient, all-reduced over DP for the tensors cut across ranks and over TP for split
/// ones; then each tensor's history and scale, as bitsandbytes' percentile_clipping.
/// `coef`: the step's clip coefficient; `loss_scale`: what its grads were scaled by.
template <class Ctx>
void percentile_scales(Ctx& c, double coef, double loss_scale) {
  wait_pending(c);  // the reductions reduce_grads left in flight write the grads read here
  const double inv = 1.0 / loss_scale;
  const std::vector<exact_sum> piece_sums = c.with_reduced_grads(  // one sum per piece
      [&](const auto* grads) { return run_squares(c, squares_of(c, grads, inv)); });
  const auto dp = [&](std::span<double> wire) { c.comms_.all_reduce_host(c.exec_, c.comm_, wire, reduce_op::sum); };
  const auto tp = [&](std::span<double> wire) { c.comms_.all_reduce_host(c.exec_, *c.tp_, wire, reduce_op::sum); };
  const host_sum dp_sum(dp), tp_sum(tp);
  percentile_history(c.layout_, c.plan_, piece_sums, c.straddlers_, Ctx::is_sharded && c.comm_.size() > 1 ? &dp_sum : nullptr,
                     c.tp_ ? &tp_sum : nullptr, c.gnorm_vec_, coef, c.step_, c.options_.percentile_clipping,
                     c.clip_scale_);
}

}  // namespace distopt::detail
