// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The collectives of a step on its buckets, as functions of the context
/// (engine/context.hpp): the grads' reduction (all-reduce when replicated, reduce-scatter
/// when sharded, a reduce to each owner of an owned bucket), the params' gather, ZeRO-3's
/// gathers and prefetches into pooled buffers, the hooks' order check, and the waits. How a
/// collective reaches the executor's memory is the context's comm_adapter's to decide.

#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/layout_check.hpp"
#include "../detail/shard_plan.hpp"
#include "../layout/registry.hpp"
#include "../exec/transfer.hpp"
#include "comm_adapter.hpp"
#include "overlap.hpp"
#include "phases.hpp"

namespace distopt::detail {

/// Where a reduction of bucket `k` in the grad type leaves this rank's shard: in place in
/// the full grads, or in the local grads (ZeRO-2, whose full grads are pooled).
template <class Ctx>
typename Ctx::grad_type* reduced_shard(Ctx& c, std::size_t k) {
  const shard_bucket& b = c.plan_.buckets()[k];
  if (c.shards_grads()) return c.grads_.data() + b.local_begin;
  return c.grads_.data() + b.buffer_begin + b.shard_begin(c.plan_.rank());
}

/// Gradient accumulation (reduce_each): micro-batch `m`'s reduced grads of bucket `k`, this
/// rank's shard where the reduction left it, added into the fp32 accumulator grads32_
/// (copied there for the step's first micro-batch).
template <class Ctx>
void accumulate_bucket(Ctx& c, std::size_t k, int m) {
  const shard_bucket& b = c.plan_.buckets()[k];
  const std::size_t r = c.plan_.rank();
  const auto add = [&](const auto* src) {
    accumulate_phase<std::remove_cv_t<std::remove_pointer_t<decltype(src)>>> a;
    a.n = b.shard_size(r);
    a.chunk = Ctx::chunk_elems;
    a.src = src;
    a.acc = c.grads32_.data() + b.local_begin;
    a.first = m == 0;
    launch(c.exec_, a.items(), a);
  };
  if (c.reduces_in_fp32()) add(static_cast<const float*>(c.staging_.data() + b.shard_begin(r)));
  else add(static_cast<const typename Ctx::grad_type*>(reduced_shard(c, k)));
}

/// Adds bucket `k`'s micro-batch into the accumulator if its reduction was left in flight.
template <class Ctx>
void accumulate_reduced(Ctx& c, std::size_t k) {
  if (k >= c.to_accumulate_.size() || c.to_accumulate_[k] == 0) return;
  accumulate_bucket(c, k, std::exchange(c.to_accumulate_[k], 0) - 1);
}

/// Whether bucket `k` has a collective in flight.
template <class Ctx>
bool pending(const Ctx& c, std::size_t k) noexcept {
  return k < c.pending_.size() && c.pending_[k].pending();
}

/// Waits for bucket `k`'s collective in flight, if any.
template <class Ctx>
void wait_bucket(Ctx& c, std::size_t k) {
  if (k >= c.pending_.size()) return;
  c.pending_[k].wait();
  c.in_flight_[k].reset();
  accumulate_reduced(c, k);
  if (c.shards_grads()) c.grad_pool_.finish(k);  // a reduction's source, if it was one
}

/// Waits for every collective in flight, in bucket order (the first failure is rethrown
/// after all have finished, so no buffer is left in use).
template <class Ctx>
void wait_pending(Ctx& c) {
  std::exception_ptr first;
  for (comm_request& r : c.pending_) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  for (auto& s : c.in_flight_) s.reset();
  if (first) std::fill(c.to_accumulate_.begin(), c.to_accumulate_.end(), 0);  // failed reductions: nothing to add
  for (std::size_t k = 0; k < c.to_accumulate_.size(); ++k) accumulate_reduced(c, k);
  if (c.shards_grads())
    for (std::size_t k = 0; k < c.pending_.size(); ++k) c.grad_pool_.finish(k);
  if (first) std::rethrow_exception(first);
}

/// Finishes the reductions that have completed (never blocks), so that ZeRO-2's pooled
/// buffers go back while backward goes on.
template <class Ctx>
void reap_reductions(Ctx& c) {
  for (std::size_t k = 0; k < c.pending_.size(); ++k)
    if (c.pending_[k].pending() && c.pending_[k].test()) wait_bucket(c, k);
}

/// Tells the context's listener (when set) of buckets [params_told_, upto) in bucket
/// order, each once its params are final in this step: updated and, where the update
/// started its all-gather, gathered. Without `wait` it stops at the first gather still in
/// flight, so that the update loop never blocks on one; with it, it waits for them.
template <class Ctx>
void tell_params(Ctx& c, std::size_t upto, bool wait) {
  if (!c.params_done_) return;
  for (; c.params_told_ < upto; ++c.params_told_) {
    const std::size_t k = c.params_told_;
    if (pending(c, k)) {
      if (!wait && !c.pending_[k].test()) return;
      wait_bucket(c, k);
    }
    c.params_done_(k);
  }
}

/// The collective a hook starts on a bucket (check_hook_order compares them).
enum class bucket_collective { reduce, gather };

/// The body of agree_on_bucket (below) over `d` ranks, through `all_gather`: throws the
/// same message on every rank when their collectives differ.
DISTOPT_CORE_FN void agree_on_bucket(std::size_t d, all_gather_doubles all_gather, const layout& l, const shard_plan& plan,
                                     std::size_t k, bucket_collective what, const char* who);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void agree_on_bucket(std::size_t d, all_gather_doubles all_gather, const layout& l, const shard_plan& plan,
                                     std::size_t k, bucket_collective what, const char* who) {
  static constexpr std::array<std::string_view, 5> callers{"grads_ready", "reduce_grads", "gather", "prefetch",
                                                           "end_micro_batch"};
  const auto caller = std::find(callers.begin(), callers.end(), std::string_view(who)) - callers.begin();
  const std::array<double, 3> mine{static_cast<double>(what), static_cast<double>(k), static_cast<double>(caller)};
  std::vector<double> all(3 * d);
  all_gather(std::span<const double>(mine), std::span<double>(all));
  bool same = true;
  for (std::size_t r = 1; r < d; ++r) same = same && all[3 * r] == all[0] && all[3 * r + 1] == all[1];
  if (same) return;
  std::string msg = "distopt::optimizer: the ranks called the hooks in different orders; at this collective";
  for (std::size_t r = 0; r < d; ++r) {
    const auto kind = static_cast<bucket_collective>(static_cast<int>(all[3 * r]));
    const shard_bucket& b = plan.buckets()[static_cast<std::size_t>(all[3 * r + 1])];
    const auto caller_r = static_cast<std::size_t>(all[3 * r + 2]);
    msg += (r ? ", rank " : " rank ") + std::to_string(r) + " (" +
           std::string(caller_r < callers.size() ? callers[caller_r] : std::string_view("?")) + ")" +
           (kind == bucket_collective::reduce ? " reduces the grads of " : " gathers the params of ") + "'" +
           l.tensors()[b.first_tensor].name + "'";
    if (b.end_tensor - b.first_tensor > 1)
      msg += " .. '" + l.tensors()[b.end_tensor - 1].name + "' (" + std::to_string(b.end_tensor - b.first_tensor) +
             " tensors)";
  }
  throw std::logic_error(msg + " (every rank must call grads_ready, gather and prefetch for the same tensors in "
                               "the same order)");
}
#endif  // DISTOPT_CORE_BODIES

/// options.check_hook_order: the ranks compare the collective each is about to start on
/// a bucket, and the call that starts it (`who`: grads_ready, reduce_grads (from step or
/// clip_grad_norm too), gather or prefetch), and throw the same message on every rank
/// when the collectives differ. Called before any bookkeeping of the hook, so that a
/// caught error leaves the optimizer as it was.
template <class Ctx>
void agree_on_bucket(Ctx& c, std::size_t k, bucket_collective what, const char* who) {
  const std::size_t d = static_cast<std::size_t>(c.comm_.size());
  if (!c.options_.check_hook_order || d == 1) return;
  agree_on_bucket(
      d,
      [&c](std::span<const double> in, std::span<double> out) { c.comms_.all_gather_host(c.exec_, c.comm_, in, out); },
      c.layout_, c.plan_, k, what, who);
}

/// ZeRO-2: bucket `k`'s pooled full-grads buffer, lent (and zeroed) at its first use in a step.
template <class Ctx>
typename Ctx::grad_type* bucket_grads(Ctx& c, std::size_t k) {
  bool dirty = false;
  typename Ctx::grad_type* g = c.grad_pool_.acquire(c.exec_, k, dirty);
  if (dirty) c.fill_zero(g, c.plan_.buckets()[k].padded());
  return g;
}

/// Reduces bucket `k` into `mine` over the data-parallel group: asynchronously when the
/// communicator can and `async` allows, so that later buckets' reductions overlap earlier
/// buckets' updates; an owned bucket with one (blocking) reduce to each owner of its run
/// of tensors (`mine`: this rank's run, in place in `bucket` or elsewhere).
template <class Ctx, class T>
void reduce_bucket(Ctx& c, std::span<T> bucket, std::span<T> mine, reduce_op op, std::size_t k, bool async) {
  const shard_bucket& b = c.plan_.buckets()[k];
  if constexpr (Ctx::owns_matrices) {
    if (b.owned()) {
      const std::size_t me = c.plan_.rank();
      for (std::size_t r = 0; r < b.shards; ++r)
        if (b.shard_size(r) != 0)
          c.comm_.reduce(std::span<const T>(bucket.subspan(b.shard_begin(r), b.shard_size(r))),
                         r == me ? mine : std::span<T>(), op, static_cast<int>(r));
      return;
    }
  }
  comm_request* req = nullptr;
  collective_hold<typename Ctx::executor_type>* hold = nullptr;
  if (async) {
    c.pending_.resize(c.plan_.buckets().size());
    c.in_flight_.resize(c.plan_.buckets().size());
    req = &c.pending_[k];
    hold = &c.in_flight_[k];
  }
  c.comms_.template reduce<Ctx::is_sharded>(c.exec_, c.comm_, bucket, mine, op, req, hold);
}

/// Starts bucket `k`'s reduction (nothing with one rank). The full grads are read from
/// the bucket's place in grads_, or its pooled buffer (ZeRO-2), and the reduced shard
/// written in place, into grads32_ (through the fp32 staging bucket, blocking), or into
/// the local grads_ (ZeRO-2). The pooled buffer goes back once the reduction is done.
/// Accumulating with reduce_each, the reduced shard (in place in the staging bucket, in
/// the fp32 case) is added into grads32_ once the reduction is done.
template <class Ctx>
void start_reduce(Ctx& c, std::size_t k, const char* who) {
  using grad_type = typename Ctx::grad_type;
  const bool acc = c.accumulates_each();
  if (acc && pending(c, k)) wait_bucket(c, k);  // the last micro-batch's, added first
  agree_on_bucket(c, k, bucket_collective::reduce, who);
  const int m = std::min(c.micro_batch_, c.options_.micro_batches - 1);
  if (c.comm_.size() == 1) {
    if (acc) accumulate_bucket(c, k, m);
    return;
  }
  const reduce_op op = c.options_.grad_reduce;
  const shard_bucket& b = c.plan_.buckets()[k];
  const std::size_t n = b.padded(), r = c.plan_.rank();
  grad_type* g = c.shards_grads() ? bucket_grads(c, k) : c.grads_.data() + b.buffer_begin;
  if (c.reduces_in_fp32()) {
    // One staging bucket: converted, reduced (blocking) and reused for the next.
    float* st = c.staging_.data();
    widen_phase<grad_type> widen;
    widen.n = n;
    widen.chunk = Ctx::chunk_elems;
    widen.src = g;
    widen.dst = st;
    launch(c.exec_, widen.items(), widen);
    float* mine = acc ? st + b.shard_begin(r) : c.grads32_.data() + b.local_begin;
    reduce_bucket(c, std::span<float>(st, n), std::span<float>(mine, b.shard_size(r)), op, k, false);
    if (acc) accumulate_bucket(c, k, m);
    if (c.shards_grads()) c.grad_pool_.release(k);
  } else {
    grad_type* mine = reduced_shard(c, k);
    reduce_bucket(c, std::span<grad_type>(g, n), std::span<grad_type>(mine, b.shard_size(r)), op, k, true);
    if (acc) {
      if (pending(c, k)) c.to_accumulate_[k] = m + 1;  // added when waited for
      else accumulate_bucket(c, k, m);
    }
    if (!c.shards_grads()) return;
    if (pending(c, k)) c.grad_pool_.reducing(k);  // goes back when waited for
    else c.grad_pool_.release(k);                 // a blocking reduction: done
  }
}

/// The grads are the next step's: the hooks start afresh.
template <class Ctx>
void next_step_grads(Ctx& c) {
  c.reduced_ = false;
  c.micro_batch_ = 0;
  c.hooks_.reset(c.plan_);
}

/// Gradient accumulation: the current micro-batch's backward is done
/// (optimizer::end_micro_batch). reduce_each starts the reductions no hook started; the
/// hooks start afresh for the next micro-batch (reduce_last keeps the grads' views lent:
/// they add up). After the step's last micro-batch the hooks keep their record, and the
/// step reduces what is left.
template <class Ctx>
void end_micro_batch(Ctx& c) {
  const int n = c.options_.micro_batches;
  if (c.reduced_)
    throw std::logic_error("distopt::optimizer::end_micro_batch: this step's grads were already reduced "
                           "(reduce_grads, clip_grad_norm); end each micro-batch before them");
  if (c.micro_batch_ >= n)
    throw std::logic_error("distopt::optimizer::end_micro_batch: called " + std::to_string(c.micro_batch_ + 1) +
                           " times in one step, with options.micro_batches = " + std::to_string(n) +
                           "; call step() after the last micro-batch");
  if (c.hooks_.in_use())
    if (const std::ptrdiff_t i = c.hooks_.first_missing(); i >= 0)
      throw std::logic_error("distopt::optimizer::end_micro_batch: grads_ready was called in micro-batch " +
                             std::to_string(c.micro_batch_ + 1) + " of " + std::to_string(n) + ", but not for '" +
                             c.layout_.tensors()[static_cast<std::size_t>(i)].name +
                             "'; with the overlap hooks every tensor's grads must be declared ready in every "
                             "micro-batch");
  if (c.micro_batch_ == n - 1) {
    ++c.micro_batch_;
    return;
  }
  if (c.accumulates_each())
    for (std::size_t k = 0; k < c.plan_.buckets().size(); ++k)
      if (!c.hooks_.started(k)) start_reduce(c, k, "end_micro_batch");
  ++c.micro_batch_;
  c.hooks_.next_micro_batch(c.plan_, !c.accumulates_each());
}

/// Combines the ranks' grads: every bucket whose reduction no hook started starts now
/// (optimizer::reduce_grads).
template <class Ctx>
void reduce_grads(Ctx& c) {
  if (c.reduced_) return;
  if (const int n = c.options_.micro_batches; n > 1 && c.micro_batch_ != n)
    throw std::logic_error("distopt::optimizer: options.micro_batches is " + std::to_string(n) +
                           " and end_micro_batch was called " + std::to_string(c.micro_batch_) +
                           " time(s) in this step; call it after each micro-batch's backward, then reduce or step");
  if (c.hooks_.in_use()) {
    if (const std::ptrdiff_t i = c.hooks_.first_missing(); i >= 0)
      throw std::logic_error("distopt::optimizer: grads_ready was called in this step, but not for '" +
                             c.layout_.tensors()[static_cast<std::size_t>(i)].name +
                             "'; with the overlap hooks every tensor's grads must be declared ready before the step");
  }
  c.reduced_ = true;
  for (std::size_t k = 0; k < c.plan_.buckets().size(); ++k)
    if (!c.hooks_.started(k)) start_reduce(c, k, "reduce_grads");
}

/// Sharded: all-gathers bucket `k`'s params, asynchronously when `async` and the
/// communicator can (the request is kept in pending_[k]); an owned bucket with one
/// (blocking) broadcast from each owner of its run of tensors.
template <class Ctx>
void start_gather(Ctx& c, std::size_t k, bool async) {
  using param_type = typename Ctx::param_type;
  if (!Ctx::is_sharded || c.comm_.size() == 1 || c.shards_params()) return;
  const shard_bucket& b = c.plan_.buckets()[k];
  param_type* p = c.params_.data() + b.buffer_begin;
  if constexpr (Ctx::owns_matrices) {
    if (b.owned()) {
      for (std::size_t r = 0; r < b.shards; ++r)
        if (b.shard_size(r) != 0)
          c.comm_.broadcast(std::span<param_type>(p + b.shard_begin(r), b.shard_size(r)), static_cast<int>(r));
      return;
    }
  }
  const std::span<const param_type> in(p + b.shard_begin(c.plan_.rank()), b.shard_size(c.plan_.rank()));
  if (async) {
    c.pending_.resize(c.plan_.buckets().size());
    c.in_flight_.resize(c.plan_.buckets().size());
  }
  c.comms_.all_gather(c.exec_, c.comm_, in, std::span<param_type>(p, b.padded()), async ? &c.pending_[k] : nullptr,
                      async ? &c.in_flight_[k] : nullptr);
}

/// Sharded storage: all-gathers every bucket's params (optimizer::gather_params).
template <class Ctx>
void gather_params(Ctx& c) {
  wait_pending(c);
  for (std::size_t k = 0; k < c.plan_.buckets().size(); ++k) start_gather(c, k, false);
}

/// ZeRO-3: all-gathers bucket `k`'s params from every rank's shard into its pooled
/// buffer (an owned bucket: a broadcast from the owner of each run, blocking);
/// asynchronously (a prefetch, waited for by finish_prefetch) when `async` and the
/// communicator can. With one rank, a copy.
template <class Ctx>
void gather_bucket_params(Ctx& c, std::size_t k, bool async, const char* who) {
  using param_type = typename Ctx::param_type;
  agree_on_bucket(c, k, bucket_collective::gather, who);
  const shard_bucket& b = c.plan_.buckets()[k];
  bool dirty = false;  // every element is overwritten
  param_type* full = c.param_pool_.acquire(c.exec_, k, dirty);
  const param_type* mine = c.params_.data() + b.local_begin;
  const std::size_t n = b.shard_size(c.plan_.rank());
  if (c.comm_.size() == 1) return copy_bytes(c.exec_, full, mine, n * sizeof(param_type));
  if constexpr (Ctx::owns_matrices) {
    if (b.owned()) {  // runs of uneven sizes: each broadcast (blocking) from its owner
      const std::size_t me = c.plan_.rank();
      copy_bytes(c.exec_, full + b.shard_begin(me), mine, n * sizeof(param_type));
      for (std::size_t r = 0; r < b.shards; ++r)
        if (b.shard_size(r) != 0)
          c.comm_.broadcast(std::span<param_type>(full + b.shard_begin(r), b.shard_size(r)), static_cast<int>(r));
      return;
    }
  }
  c.comms_.all_gather(c.exec_, c.comm_, std::span<const param_type>(mine, n), std::span<param_type>(full, b.padded()),
                      async ? &c.param_pending_[k] : nullptr, &c.param_scope_[k]);
}

/// ZeRO-3: waits for bucket `k`'s prefetch.
template <class Ctx>
void finish_prefetch(Ctx& c, std::size_t k) {
  c.gathers_.set_prefetched(k, false);
  c.param_pending_[k].wait();
  c.param_scope_[k].reset();
}

/// Ends the gather of tensor `i`: its bucket's pooled buffer goes back once none of its
/// tensors is gathered (ZeRO-3); with `keep`, this rank's shard of what was written into
/// the gathered params goes back into params_ first.
template <class Ctx>
void release_tensor(Ctx& c, std::size_t i, bool keep) {
  const std::size_t k = c.hooks_.bucket_of(i);
  const bool last = c.gathers_.release(i, k, c.layout_.tensors()[i].name);
  if constexpr (Ctx::zero_stage >= 3) {
    if (keep) {  // this tensor's part of this rank's shard, back into params_
      const shard_bucket& b = c.plan_.buckets()[k];
      const std::size_t s0 = b.shard_begin(c.plan_.rank()), s1 = s0 + b.shard_size(c.plan_.rank());
      const std::size_t t0 = c.plan_.tensor_buffer(i) - b.buffer_begin, t1 = t0 + c.layout_.tensors()[i].numel;
      const std::size_t a = std::max(s0, t0), e = std::min(s1, t1);
      if (a < e)
        copy_bytes(c.exec_, c.params_.data() + b.local_begin + (a - s0), c.param_pool_.of(k) + a,
                   (e - a) * sizeof(typename Ctx::param_type));
    }
    if (last) c.param_pool_.release(k);
  }
}

/// Before `what` changes the params: refuses gathered tensors (naming the first) and
/// drops ZeRO-3's prefetches in flight.
template <class Ctx>
void end_param_gathers(Ctx& c, const char* what) {
  if (const std::ptrdiff_t i = c.gathers_.first_gathered(); i >= 0)
    throw std::logic_error(std::string("distopt::optimizer::") + what + ": '" +
                           c.layout_.tensors()[static_cast<std::size_t>(i)].name +
                           "' is still gathered; release every gathered tensor before the params change");
  for (std::size_t k = 0; k < c.param_pending_.size(); ++k)
    if (c.gathers_.prefetched(k)) {
      finish_prefetch(c, k);
      c.param_pool_.release(k);
    }
}

/// The step's grads and hooks start afresh (a checkpoint was loaded): collectives in
/// flight end, ZeRO-2's lent buffers go back (zeroed when lent again), nothing is
/// declared ready or started.
template <class Ctx>
void drop_step_grads(Ctx& c) {
  wait_pending(c);
  if (c.shards_grads())
    for (std::size_t k = 0; k < c.plan_.buckets().size(); ++k) c.grad_pool_.release(k);
  next_step_grads(c);
}

}  // namespace distopt::detail
