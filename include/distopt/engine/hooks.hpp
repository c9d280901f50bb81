// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the training loop calls between steps, as functions of the context: the
/// views of params and grads (ZeRO-2's and ZeRO-3's pooled buckets), the overlap hooks
/// (grads_ready, gather, prefetch, release) and the views of master weights and states
/// (engine/state_layout.hpp says where a piece's state lies).

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "../shard_view.hpp"
#include "collectives.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// The params of tensor `i` (ZeRO-3: in its bucket's pooled buffer, while gathered).
template <class Ctx>
typename Ctx::template view<typename Ctx::param_type> param_view(Ctx& c, std::size_t i) {
  const std::size_t numel = c.layout_.tensors()[i].numel;
  if constexpr (Ctx::zero_stage >= 3) {
    if (!c.gathers_.gathered(i))
      throw std::logic_error("distopt::optimizer::param('" + c.layout_.tensors()[i].name +
                             "'): with ZeRO-3 a tensor's params exist in full only between gather and release; "
                             "gather it first");
    const std::size_t k = c.hooks_.bucket_of(i);
    return {c.param_pool_.of(k) + (c.plan_.tensor_buffer(i) - c.plan_.buckets()[k].buffer_begin), numel};
  } else {
    return {c.params_.data() + c.plan_.tensor_buffer(i), numel};
  }
}

/// The grads of tensor `i` (ZeRO-2: zeroed at the first view of a step; with d > 1 in its
/// bucket's pooled buffer, until the bucket's reduction starts). Gradient accumulation:
/// zeroed at the first view of a step (reduce_last) or of a micro-batch (reduce_each, after
/// the last micro-batch's reduction of the bucket was added up), at every stage.
template <class Ctx>
typename Ctx::template view<typename Ctx::grad_type> grad_view(Ctx& c, std::size_t i) {
  const std::string& name = c.layout_.tensors()[i].name;
  const std::size_t numel = c.layout_.tensors()[i].numel;
  const std::size_t k = c.hooks_.bucket_of(i);
  const shard_bucket& b = c.plan_.buckets()[k];
  if (c.hooks_.started(k))
    throw std::logic_error("distopt::optimizer::grad('" + name +
                           "'): its bucket's reduction has started in this step (grads_ready was called for all "
                           "its tensors); write a tensor's grads before its grads_ready");
  if constexpr (Ctx::zero_stage >= 2)
    if (c.reduced_)
      throw std::logic_error("distopt::optimizer::grad('" + name +
                             "'): this step's grads were reduced (reduce_grads, clip_grad_norm); with ZeRO-2 the "
                             "next step's grads are written after step()");
  if (c.accumulates_each() && pending(c, k)) wait_bucket(c, k);  // its last micro-batch, added up first
  // Unpooled grads (one rank at ZeRO-2, or accumulating at any stage) are zeroed at their
  // first view of a step (of a micro-batch with reduce_each), as the pool's buffers are.
  if ((Ctx::zero_stage >= 2 || c.options_.micro_batches > 1) && !c.shards_grads() && c.hooks_.lend(k))
    c.fill_zero(c.grads_.data() + b.buffer_begin, b.padded());
  if (!c.shards_grads()) return {c.grads_.data() + c.plan_.tensor_buffer(i), numel};
  return {bucket_grads(c, k) + (c.plan_.tensor_buffer(i) - b.buffer_begin), numel};
}

/// The buffer that holds tensor `i`'s full grads (ZeRO-2 and 3), whole, as {data, bytes}:
/// its bucket's pooled buffer ({nullptr, 0} when the bucket holds none), or with one rank
/// the one grads buffer (the grads are pooled only when they are sharded). What a wrapper
/// that copies them (offload) registers with its device.
template <class Ctx>
std::pair<void*, std::size_t> grad_buffer_of(Ctx& c, std::size_t i) {
  if (!c.shards_grads()) return {c.grads_.data(), c.grads_.bytes()};
  const std::size_t k = c.hooks_.bucket_of(i);
  return {c.grad_pool_.of(k), c.grad_pool_.bytes_of(k)};
}
/// The pooled buffer that holds tensor `i`'s gathered params (ZeRO-3), as grad_buffer_of.
template <class Ctx>
std::pair<void*, std::size_t> param_buffer_of(Ctx& c, std::size_t i) {
  const std::size_t k = c.hooks_.bucket_of(i);
  return {c.param_pool_.of(k), c.param_pool_.bytes_of(k)};
}

/// grads_ready for tensor `i`: its bucket's reduction starts once all its tensors are ready.
template <class Ctx>
void mark_ready(Ctx& c, std::size_t i) {
  if (c.reduced_)
    throw std::logic_error("distopt::optimizer::grads_ready('" + c.layout_.tensors()[i].name +
                           "'): this step's grads were already reduced (reduce_grads, clip_grad_norm)");
  if (c.options_.micro_batches > 1 && c.micro_batch_ >= c.options_.micro_batches)
    throw std::logic_error("distopt::optimizer::grads_ready('" + c.layout_.tensors()[i].name +
                           "'): every micro-batch of this step has ended (end_micro_batch was called " +
                           std::to_string(c.micro_batch_) + " times); call step()");
  if (c.hooks_.mark(i, c.layout_.tensors()[i].name) && c.reduces_now()) {
    const std::size_t k = c.hooks_.bucket_of(i);
    start_reduce(c, k, "grads_ready");  // first: a failed check_hook_order leaves the bucket to the step
    c.hooks_.start(k);
  }
}

/// gather for tensor `i`. The collective first, the bookkeeping after: a failed
/// check_hook_order marks nothing (a tensor gathered already has its bucket held: no
/// collective, and the bookkeeping throws).
template <class Ctx>
void gather_tensor(Ctx& c, std::size_t i) {
  const std::size_t k = c.hooks_.bucket_of(i);
  if (Ctx::zero_stage >= 3 && !c.gathers_.holds(k)) {
    if (c.gathers_.prefetched(k)) finish_prefetch(c, k);
    else gather_bucket_params(c, k, false, "gather");
  }
  c.gathers_.gather(i, k, c.layout_.tensors()[i].name);
}

/// prefetch for tensor `i` (ZeRO-3): its bucket's gather starts, unless held or started.
template <class Ctx>
void prefetch_tensor(Ctx& c, std::size_t i) {
  const std::size_t k = c.hooks_.bucket_of(i);
  if (c.gathers_.holds(k) || c.gathers_.prefetched(k)) return;
  gather_bucket_params(c, k, true, "prefetch");
  c.gathers_.set_prefetched(k, true);
}

/// This rank's part of tensor `i` in a buffer of its local elements at `base`, its first
/// piece at `offset`: the view and the index of its first element in the tensor (nothing
/// where the rank holds none of it).
template <class Ctx, class T>
shard_view<const T, typename Ctx::memory_space> local_part(const Ctx& c, const T* base, std::size_t i,
                                                          std::size_t offset) {
  const piece_range r = c.plan_.pieces_of(i);
  if (r.empty()) return {};
  return {typename Ctx::template view<const T>(base + offset, c.plan_.local_count(i)),
          c.plan_.pieces()[r.first].layout - c.layout_.tensors()[i].offset};
}

/// This rank's part of the master weights of tensor `i`.
template <class Ctx>
shard_view<const float, typename Ctx::memory_space> master_part(const Ctx& c, std::size_t i) {
  const piece_range r = c.plan_.pieces_of(i);
  return local_part(c, c.master_.data(), i, r.empty() ? 0 : c.plan_.pieces()[r.first].local);
}

/// This rank's part of state slot `k` of tensor `i` where the state layout puts it (q8:
/// the codes of an 8-bit tensor); nothing where the tensor keeps no such slot.
template <class Ctx>
shard_view<const typename Ctx::stored_state, typename Ctx::memory_space> state_part(const Ctx& c, std::size_t i, int k) {
  const piece_range r = c.plan_.pieces_of(i);
  if (r.empty()) return {};
  const state_home home = c.states_at_.home(r.first, k);
  const std::size_t at = c.states_at_.offset(r.first, k);
  if constexpr (!Ctx::is_quantized)
    if (home == state_home::momentum) return local_part(c, c.momentum_.data(), i, at);
  if (home != state_home::slot) return {};
  return local_part(c, c.states_[k].data(), i, at);
}

/// q8: whether tensor `i` keeps 8-bit states (false below min_8bit_size, and for a
/// matrix GaLore projects).
template <class Ctx>
bool quantized_tensor(const Ctx& c, std::size_t i) {
  return !c.states_at_.whole_matrix(i) && c.layout_.tensors()[i].numel >= c.options_.min_8bit_size;
}

}  // namespace distopt::detail
