// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What an optimizer is built with besides its four concepts: the number types of
/// params and grads (`precision`) and the run-time options that are not hyper-parameters
/// of the math (`optimizer_options`), with the constructor's checks of both against the
/// layout.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "concepts.hpp"
#include "config.hpp"
#include "layout/registry.hpp"
#include "loss_scaler.hpp"
#include "types/dtype.hpp"

namespace distopt {

/// The number types of params and grads: fp32, bf16 or fp16 each.
template <class Param = float, class Grad = Param>
struct precision {
  using param_type = Param;
  using grad_type = Grad;
  static_assert(number<Param> && number<Grad>,
                "distopt::precision<Param, Grad>: each must be float, distopt::bf16 or distopt::fp16");
};

/// What `save(dir, ...)` may replace in `dir`: a checkpoint of the same optimizer (the same
/// policy and model; any ranks, encodings and hyper-parameters), as each save of a run
/// replaces the last; or anything, another optimizer's checkpoint included.
enum class checkpoint_replace { same_optimizer, anything };

/// How a step's micro-batches are combined (optimizer_options::micro_batches > 1):
/// - reduce_last (Megatron's no_sync, PyTorch DDP's no_sync): each rank's micro-batch grads
///   add up in the full grad views, and the ranks' sums are reduced once, after the last
///   micro-batch. At ZeRO-2 and 3 a bucket's full grads then live from the step's first
///   micro-batch to its reduction, as at ZeRO-1: the memory of full grads, the bytes of
///   one reduction per step.
/// - reduce_each (DeepSpeed's ZeRO-2): each micro-batch's grads are reduced as soon as
///   they are ready, and this rank's reduced shard is added into an fp32 accumulator of
///   its shard, so that a bucket's full grads live only during one backward. One
///   reduction per micro-batch, and an fp32 shard (4 B per local element) besides.
/// The two add in different orders (micro-batches then ranks, ranks then micro-batches):
/// with more than one rank their sums may differ in the last bits.
enum class accumulation { reduce_last, reduce_each };

/// Run-time options of an optimizer that are not hyper-parameters of the math.
struct optimizer_options {
  /// Keep an fp32 master copy of bf16/fp16 params (ignored for fp32 params). Without one,
  /// bf16 params are updated with stochastic rounding and fp16 params rounded to nearest.
  bool master_weights = true;
  /// Scan gradients for NaN/Inf before each step and skip the step if one is found.
  bool check_finite = true;
  /// Seed of the stochastic rounding; the random bits depend only on (seed, step, element).
  std::uint64_t seed = 0;
  /// Dynamic loss scaling (for fp16 gradients); off when empty.
  std::optional<dynamic_loss_scale> loss_scale{};
  /// How the ranks' grads are combined: avg (each rank's grad is the mean over its share
  /// of the batch, as torch DDP and Megatron) or sum.
  reduce_op grad_reduce = reduce_op::avg;
  /// Reduce bf16/fp16 grads in fp32 (through an fp32 staging bucket) and keep the reduced
  /// grads in fp32. Without it they are reduced, and kept, in their own type.
  bool grad_reduce_in_fp32 = false;
  /// Sharded storage: all-gather the updated params after each step. Turn off when the
  /// caller keeps params sharded; each rank's params then hold only its own shard fresh.
  bool gather_params = true;
  /// Elements per communication bucket: whole tensors are grouped until a bucket reaches it.
  std::size_t bucket_elems = std::size_t{1} << 22;
  /// q8 storage: tensors with fewer elements (counted over the whole tensor, never a
  /// shard) keep fp32 states, as bitsandbytes' min_8bit_size.
  std::size_t min_8bit_size = 4096;
  /// Percentile clipping (bitsandbytes' percentile_clipping; 100 = off): each tensor keeps
  /// the squared norms of its last 100 gradients (all 100 set on the first step), and a
  /// gradient whose norm exceeds the `percentile_clipping`-th smallest of them is scaled
  /// down to it. Norms are of the whole tensor, summed exactly over shards and TP ranks.
  /// Element-wise policies only.
  int percentile_clipping = 100;
  /// Clip the global grad norm to this inside each step (0 = off): the gradients are scaled
  /// by min(1, max_grad_norm / (norm + 1e-6)), as clip_grad_norm(max_grad_norm) called
  /// before the step, with the same bits. The norm is the finite check's; on a device
  /// executor it never reaches the host. An explicit clip_grad_norm call overrides it for
  /// the step that follows.
  double max_grad_norm = 0.0;
  /// Before each collective on a bucket (a grads' reduction, started by grads_ready or by
  /// the step; a ZeRO-3 gather or prefetch), the ranks compare which collective on which
  /// bucket they are starting, and a difference throws the same std::logic_error on every
  /// rank, naming each rank's tensors, before the hook changes anything. It costs one small
  /// blocking all-gather per bucket collective, a meeting point that holds back the overlap:
  /// for debugging a training loop's hook calls (as PyTorch's
  /// TORCH_DISTRIBUTED_DEBUG=DETAIL checks collectives). It compares the sequences of
  /// bucket collectives: hooks that start none (a gather of a bucket held already) are not
  /// compared, and ranks that start different numbers of them before another collective
  /// still mismatch that one. Off, hooks called in different orders show as a collective's
  /// size mismatch, a hang, or wrong sums when the sizes agree.
  bool check_hook_order = false;
  /// ZeRO-Offload (offload<Device>) on a device executor that can page-lock host memory
  /// (registers_host_memory: cuda): register the host params (ZeRO-1 and 2) and grads
  /// (ZeRO-1) that every step copies, for as long as the optimizer lives, and at ZeRO-2 and
  /// 3 each buffer of the host's bucket pools (grads; ZeRO-3's gathered params) at the first
  /// copy into or out of it (the pools keep their buffers), so that the copies run at the
  /// link's speed. Those bytes are then locked host memory (at stage 1, 2 + 2 B/param for
  /// bf16; at stages 2 and 3 the pools' peaks, as memory() reports them). Off, the copies go
  /// through the driver's staging buffer.
  bool pin_host_buffers = true;
  /// Gradient accumulation: micro-batches per step (1 = none). After each micro-batch's
  /// backward (grads added into grad(name), zero at a bucket's first view of the step, or
  /// with reduce_each of the micro-batch; grads_ready per tensor as usual) call
  /// end_micro_batch(); step() follows the n-th. The grads are summed, not averaged, over
  /// micro-batches: scale the loss by 1/n for their mean, as PyTorch users do.
  int micro_batches = 1;
  /// How the micro-batches are combined (see `accumulation`).
  accumulation accumulate = accumulation::reduce_last;
  // New options go last: code that initialises this struct positionally keeps compiling.
};

}  // namespace distopt

namespace distopt::detail {

/// The constructor's checks that depend on no template argument, compiled once per file
/// (once per program with distopt::core) rather than once per optimizer type: the number
/// of groups, the layout against the param dtype and the groups, and the options.
DISTOPT_CORE_FN void check_arguments(std::string_view policy, const layout& l, dtype param, std::size_t groups,
                                     const optimizer_options& o, bool layerwise, std::size_t chunk_elems);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void check_arguments(std::string_view policy, const layout& l, dtype param, std::size_t groups,
                                     const optimizer_options& o, bool layerwise, std::size_t chunk_elems) {
  if (groups == 0) throw std::invalid_argument(std::string(policy) + ": at least one hyper-parameter group is needed");
  if (l.tensors().empty()) throw std::invalid_argument(std::string(policy) + ": the layout has no tensors");
  for (const auto& t : l.tensors()) {
    if (t.dtype != param)
      throw std::invalid_argument("distopt::optimizer: tensor '" + t.name + "' is registered as " +
                                  std::string(dtype_name(t.dtype)) + " but this optimizer's params are " +
                                  std::string(dtype_name(param)));
    if (static_cast<std::size_t>(t.group) >= groups)
      throw std::invalid_argument("distopt::optimizer: tensor '" + t.name + "' is in group " +
                                  std::to_string(t.group) + " but only " + std::to_string(groups) +
                                  " group(s) were given");
  }
  if (o.grad_reduce == reduce_op::max)
    throw std::invalid_argument("distopt::optimizer: grad_reduce must be sum or avg, not max");
  if (o.percentile_clipping < 0 || o.percentile_clipping > 100)
    throw std::invalid_argument("distopt::optimizer: percentile_clipping must be in [0, 100] (100 = off), got " +
                                std::to_string(o.percentile_clipping));
  if (layerwise && o.percentile_clipping < 100)
    throw std::invalid_argument(std::string(policy) +
                                ": percentile_clipping is for element-wise policies (set it to 100)");
  if (!(o.max_grad_norm >= 0.0) || !std::isfinite(o.max_grad_norm))
    throw std::invalid_argument("distopt::optimizer: max_grad_norm must be a finite value >= 0 (0 = off), got " +
                                std::to_string(o.max_grad_norm));
  if (o.bucket_elems == 0) throw std::invalid_argument("distopt::optimizer: bucket_elems must be > 0");
  if (o.micro_batches < 1)
    throw std::invalid_argument("distopt::optimizer: micro_batches must be >= 1 (1 = no gradient accumulation), got " +
                                std::to_string(o.micro_batches));
  if (o.accumulate != accumulation::reduce_last && o.accumulate != accumulation::reduce_each)
    throw std::invalid_argument("distopt::optimizer: accumulate must be accumulation::reduce_last or reduce_each");
  if (chunk_elems % l.block_size() != 0)
    throw std::invalid_argument("distopt::optimizer: the layout's block size " + std::to_string(l.block_size()) +
                                " is larger than " + std::to_string(chunk_elems) + " elements");
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt::detail
