// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <optional>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/axis.hpp"
#include "comm/single.hpp"
#include "config.hpp"
#include "concepts.hpp"
#include "detail/buffer.hpp"
#include "detail/exact_sum.hpp"
#include "detail/engines.hpp"
#include "detail/layout_check.hpp"
#include "detail/shard_plan.hpp"
#include "detail/update_loop.hpp"
#include "engine/decisions.hpp"
#include "engine/overlap.hpp"
#include "engine/phases.hpp"
#include "exec/cpu.hpp"
#include "exec/transfer.hpp"
#include "layerwise.hpp"
#include "layout/registry.hpp"
#include "loss_scaler.hpp"
#include "memory_report.hpp"
#include "shard_view.hpp"
#include "space.hpp"
#include "step_info.hpp"
#include "storage/q8_encoding.hpp"
#include "storage/replicated.hpp"
#include "storage/sharded.hpp"
#include "types/dtype.hpp"
#include "types/rounding.hpp"

namespace distopt {

/// The number types of params and grads: fp32, bf16 or fp16 each.
template <class Param = float, class Grad = Param>
struct precision {
  using param_type = Param;
  using grad_type = Grad;
  static_assert(number<Param> && number<Grad>,
                "distopt::precision<Param, Grad>: each must be float, distopt::bf16 or distopt::fp16");
};

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
  // New options go last: code that initialises this struct positionally keeps compiling.
};

namespace io {
struct checkpoint_access;
/// Defined in <distopt/checkpoint.hpp> (needs xxHash: Debian's libxxhash-dev): opt.save
/// and opt.load need it included.
template <class Optimizer>
struct checkpoint_files;
}  // namespace io

namespace detail {
struct offload_access;  // <distopt/exec/offload.hpp>: the host optimizer's pooled buckets

/// Told of each bucket whose params a step has finished (ZeRO-Offload copies it to the
/// device while the host updates the next): a function and its object, empty by default.
struct params_listener {
  void* to = nullptr;
  void (*fn)(void* to, std::size_t bucket) = nullptr;
  explicit operator bool() const noexcept { return fn != nullptr; }
  void operator()(std::size_t bucket) const { fn(to, bucket); }
};

template <class Policy, class Storage, class Comm, class Exec, class Precision>
consteval bool check_optimizer_arguments() {
  static_assert(policy_declares_state<Policy>,
                "distopt::optimizer: the Policy must declare `static constexpr std::string_view "
                "name` and `static constexpr int max_state_slots` (0..4)");
  static_assert(policy_has_hyper_params<Policy>,
                "distopt::optimizer: the Policy needs a default-constructible `hyper_params` with "
                "`void validate() const` and `static int state_slots(const hyper_params&)`");
  static_assert(policy_prepares_scalars<Policy>,
                "distopt::optimizer: the Policy needs a trivially copyable `scalars` and `static "
                "scalars prepare(const hyper_params&, const step_info&)`");
  static_assert(policy_updates_elements<Policy> || policy_is_layerwise<Policy>,
                "distopt::optimizer: the Policy needs `DISTOPT_HD static void update(const "
                "scalars&, float& param, float grad, float* state)` taking param by non-const "
                "reference, or the phases of a layer-wise policy (see distopt/layerwise.hpp)");
  static_assert(!(policy_is_layerwise<Policy> && quantized_encoding<typename Storage::encoding>),
                "distopt::optimizer: 8-bit (q8) states are for element-wise policies (sgd, adam, "
                "adamw, lion, custom ones); the layer-wise policies keep fp32 or bf16 states");
  static_assert(state_storage<Storage>,
                "distopt::optimizer: Storage must model distopt::state_storage, e.g. "
                "distopt::replicated<distopt::fp32>");
  static_assert(communicator<Comm>,
                "distopt::optimizer: Comm must model distopt::communicator, e.g. distopt::single");
  static_assert(executor<Exec>,
                "distopt::optimizer: Exec must model distopt::executor, e.g. distopt::cpu");
  static_assert(number<typename Precision::param_type> && number<typename Precision::grad_type>,
                "distopt::optimizer: Precision must be distopt::precision<Param, Grad>");
  return true;
}

/// The constructor's checks that depend on no template argument, compiled once per file
/// (once per program with distopt::core) rather than once per optimizer type: the number
/// of groups, the layout against the param dtype and the groups, and the options.
DISTOPT_CORE_FN void check_arguments(std::string_view policy, const layout& l, dtype param, std::size_t groups,
                                     const optimizer_options& o, bool layerwise, std::size_t chunk_elems);

/// Percentile clipping's history: records each tensor's squared norm `sq[i]` (scaled by
/// coef^2) of step `step` into `history[i]` (all 100 on step 1) and sets `scale[i]` to
/// min(1, the `percentile`-th smallest recorded norm / this step's norm).
DISTOPT_CORE_FN void percentile_history(std::span<std::array<float, 100>> history, std::span<const double> sq,
                                        double coef, std::int64_t step, int percentile, std::vector<float>& scale);

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
  if (chunk_elems % l.block_size() != 0)
    throw std::invalid_argument("distopt::optimizer: the layout's block size " + std::to_string(l.block_size()) +
                                " is larger than " + std::to_string(chunk_elems) + " elements");
}

DISTOPT_CORE_FN void percentile_history(std::span<std::array<float, 100>> history, std::span<const double> sq,
                                        double coef, std::int64_t step, int percentile, std::vector<float>& scale) {
  scale.assign(history.size(), 1.0f);
  const std::size_t at = static_cast<std::size_t>(step % 100);
  for (std::size_t i = 0; i < history.size(); ++i) {
    auto& vec = history[i];
    const float now = static_cast<float>(sq[i] * coef * coef);
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
}  // namespace detail

/// An optimizer assembled from a policy (the math), a state storage (placement and
/// encoding), a communicator (the data-parallel group), an executor (where and how
/// elements are visited) and the number types of params and grads.
///
/// The optimizer owns flat buffers for params, grads, fp32 master weights and states; the
/// caller writes initial params and each step's grads into the views it hands out. Every
/// rank holds the full params and grads. With `replicated` storage every rank also holds
/// all master weights and states, and the grads are all-reduced; with `sharded` storage
/// each rank holds 1/d of them, the grads are reduce-scattered, and the updated params
/// all-gathered; with `owned` storage the matrices GaLore or Muon update whole belong to
/// one rank each (their grads reduced to it, their params broadcast from it) and the other
/// tensors are sharded. The result does not depend on d or on the thread count, bit for bit.
template <class Policy, class Storage = replicated<fp32>, class Comm = single, class Exec = cpu,
          class Precision = precision<float>>
class optimizer {
  static_assert(detail::check_optimizer_arguments<Policy, Storage, Comm, Exec, Precision>());

 public:
  using policy_type = Policy;
  using hyper_params = typename Policy::hyper_params;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  /// The state encoding: fp32 (float), bf16 or q8.
  using state_type = typename Storage::encoding;
  static constexpr bool is_sharded = Storage::is_sharded;
  /// True for 8-bit block-wise states (q8): codes plus an fp32 absmax per 256 elements.
  static constexpr bool is_quantized = quantized_encoding<state_type>;
  /// True for policies that update some tensors as whole matrices through a projection
  /// (GaLore: include distopt/policy/galore_adamw.hpp and link distopt::galore).
  static constexpr bool projects = projects_matrices<Policy>;
  /// True for policies that update some tensors as whole matrices orthogonalised by
  /// Newton–Schulz (Muon: include distopt/policy/muon.hpp and link distopt::muon).
  static constexpr bool orthogonalizes = orthogonalizes_matrices<Policy>;
  /// True for policies whose step needs per-tensor, per-row or per-column statistics.
  static constexpr bool is_layerwise = policy_is_layerwise<Policy>;
  /// True for `owned` storage: each matrix of a projected or orthogonalised group lives
  /// whole on one rank.
  static constexpr bool owns_matrices = storage_owns_matrices<Storage>();
  /// The ZeRO stage: 0 replicated, 1 sharded states, 2 sharded grads too (sharded<E, 2>).
  static constexpr int zero_stage = storage_zero_stage<Storage>();
  static_assert(zero_stage < 2 || (!projects && !orthogonalizes),
                "distopt::sharded<Encoding, 2>: ZeRO-2 runs the element-wise and layer-wise policies; GaLore and "
                "Muon read whole matrices of the full grads: use stage 1 (sharded<Encoding>) or owned<Encoding>");
  static_assert(!owns_matrices || projects || orthogonalizes,
                "distopt::owned<...> places the matrices that GaLore projects and Muon orthogonalises, each "
                "on one rank; this policy updates no whole matrices: use distopt::sharded<...>");
  // (GaLore and Muon run on executors of host memory: owned buckets' collectives read the
  // buffers in place.)
  static_assert(!owns_matrices || host_memory<Exec>);
  static_assert(!is_layerwise || detail::engine_included<Policy, detail::layer_engine_tag>::value,
                "distopt::optimizer: a layer-wise policy needs #include <distopt/detail/layer_engine.hpp> "
                "(the policy headers lamb.hpp, adafactor.hpp and came.hpp include it)");
  static_assert(!is_quantized || detail::engine_included<Policy, detail::q8_engine_tag>::value,
                "distopt::optimizer: 8-bit states need #include <distopt/storage/q8.hpp>");
  static_assert(!projects || detail::engine_included<Policy, detail::projection_engine_tag>::value,
                "distopt::optimizer: a projecting policy needs #include <distopt/detail/projection_engine.hpp> "
                "(policy/galore_adamw.hpp includes it)");
  static_assert(!orthogonalizes || detail::engine_included<Policy, detail::muon_engine_tag>::value,
                "distopt::optimizer: an orthogonalising policy needs #include <distopt/detail/muon_engine.hpp> "
                "(policy/muon.hpp includes it)");
  static_assert(!orthogonalizes || (host_memory<Exec> && !is_quantized && !is_layerwise && !projects),
                "distopt::optimizer: Muon runs on executors of host memory (cpu, kokkos) with fp32 or bf16 "
                "states (replicated or sharded); 8-bit Muon states and device executors are not built yet");
  static_assert(host_memory<Exec> || !projects || !is_quantized,
                "distopt::optimizer: GaLore with 8-bit states runs on executors of host memory (cpu, kokkos); "
                "on device executors (emulated_device, cuda) its states are fp32 or bf16");
  static_assert(!collectives_in_device_memory<Comm> || !host_memory<Exec>,
                "distopt::optimizer: a communicator of device memory (nccl) needs an executor of device "
                "memory (distopt::cuda); on cpu and kokkos use single, threads, mpi or any_comm");
  using comm_type = Comm;
  using executor_type = Exec;
  /// The memory space the buffers live in (the executor's).
  using memory_space = typename Exec::memory_space;
  /// A view of the optimizer's memory: std::span<T> for host memory, device_span<T> for
  /// device memory (write and read it with distopt::upload / distopt::download).
  template <class T>
  using view = span_in<T, memory_space>;

  /// Creates the buffers for `tensors`; `groups[i]` holds the hyper-parameters of the tensors
  /// registered with group i. Every tensor must be registered with the param dtype. With
  /// more than one rank this is collective: every rank must construct its optimizer, with
  /// the same layout (checked: a difference is reported on every rank).
  optimizer(layout tensors, std::vector<hyper_params> groups, optimizer_options options = {},
            Exec exec = Exec{}, Comm comm = Comm{})
      : layout_(std::move(tensors)),
        groups_(std::move(groups)),
        options_(std::move(options)),
        exec_(std::move(exec)),
        comm_(std::move(comm)) {
    for (const auto& h : groups_) h.validate();  // none when there are no groups: checked next
    detail::check_arguments(Policy::name, layout_, dtype_of<param_type>, groups_.size(), options_, is_layerwise,
                            chunk_elems);
    check_same_stream(comm_, "the communicator");
    if (comm_.size() > 1)
      detail::check_layout_agreement(
          static_cast<std::size_t>(comm_.size()),
          [this](std::span<const double> in, std::span<double> out) { all_gather_host(comm_, in, out); }, layout_,
          "distopt::optimizer");
    if (options_.loss_scale) scaler_ = loss_scaler(*options_.loss_scale);
    for (const auto& h : groups_) slots_ = std::max(slots_, Policy::state_slots(h));

    const int d = comm_.size();
    plan_ = detail::shard_plan(layout_, is_sharded ? d : 1, is_sharded ? comm_.rank() : 0,
                               options_.bucket_elems, chunk_elems, owned_tensors());
    in_exec(plan_.pieces(), pieces_dev_);  // the piece table the phases read (device executors)
    std::vector<std::size_t> bucket_sizes;  // each bucket's elements, padded
    for (const auto& b : plan_.buckets()) bucket_sizes.push_back(b.padded());
    const std::size_t largest = bucket_sizes.empty() ? 0 : std::ranges::max(bucket_sizes);
    params_ = detail::buffer<param_type, Exec>(exec_, shards_params() ? plan_.local_size() : plan_.buffer_size());
    gathers_ = detail::param_gathers(plan_.buckets().size(), layout_.tensors().size());
    if (shards_params()) {
      param_pool_ = detail::bucket_pool<param_type, Exec>(bucket_sizes);
      param_pending_.resize(plan_.buckets().size());
      param_scope_.resize(plan_.buckets().size());
    }
    if (!shards_grads()) grads_ = detail::buffer<grad_type, Exec>(exec_, plan_.buffer_size());
    else if (!reduces_in_fp32()) grads_ = detail::buffer<grad_type, Exec>(exec_, plan_.local_size());
    if (shards_grads()) grad_pool_ = detail::bucket_pool<grad_type, Exec>(bucket_sizes);
    hooks_ = detail::grad_hooks(plan_, layout_.tensors().size());
    if (reduces_in_fp32()) {
      grads32_ = detail::buffer<float, Exec>(exec_, plan_.local_size());
      staging_ = detail::buffer<float, Exec>(exec_, largest);
    }
    if (uses_master()) master_ = detail::buffer<float, Exec>(exec_, plan_.local_size());
    if (options_.percentile_clipping < 100) {
      gnorm_vec_.assign(layout_.tensors().size(), {});
      for (std::size_t i = 0; i < layout_.tensors().size(); ++i)
        if (plan_.straddles(i)) straddlers_.push_back(i);
    }
    if constexpr (is_layerwise) {
      layer_.init(*this);
    } else if constexpr (is_quantized) {
      if constexpr (projects) proj_.init(*this);  // the projected matrices first: q8_.init skips them
      q8_.init(*this);
    } else if constexpr (projects) {
      proj_.init(*this);
    } else if constexpr (orthogonalizes) {
      ortho_.init(*this);
    } else {
      for (int k = 0; k < slots_; ++k) states_[k] = detail::buffer<state_type, Exec>(exec_, plan_.local_size());
    }
  }

  /// One hyper-parameter group for every tensor.
  optimizer(layout tensors, hyper_params hyper, optimizer_options options = {}, Exec exec = Exec{},
            Comm comm = Comm{})
      : optimizer(std::move(tensors), std::vector<hyper_params>{std::move(hyper)},
                  std::move(options), std::move(exec), std::move(comm)) {}

  /// The tensors and their place in the layout.
  const layout& tensors() const noexcept { return layout_; }

  /// The params of tensor `name`: write initial values here before the first step (the
  /// same values on every rank). In device memory, write them with distopt::upload.
  /// ZeRO-3 (sharded<E, 3>): the tensor must be gathered (`gather`), and the view is into
  /// its bucket's pooled buffer, valid until the release; initial values written there are
  /// kept by `release(name, keep_writes)`.
  view<param_type> param(std::string_view name) {
    if constexpr (zero_stage >= 3) {
      const std::size_t i = index_of(name);
      if (!gathers_.gathered(i))
        throw std::logic_error("distopt::optimizer::param('" + std::string(name) +
                               "'): with ZeRO-3 a tensor's params exist in full only between gather and release; "
                               "gather it first");
      const std::size_t k = hooks_.bucket_of(i);
      return {param_pool_.of(k) + (plan_.tensor_buffer(i) - plan_.buckets()[k].buffer_begin), layout_.tensors()[i].numel};
    } else {
      return full_view(params_, name);
    }
  }
  /// The grads of tensor `name`: write each step's gradient here before `step()` (or
  /// before `grads_ready(name)`). ZeRO-2 (sharded<E, 2>): the grads are zero at the first
  /// view of a step (of any tensor of the bucket), and with d > 1 the view is into the
  /// bucket's pooled buffer, valid until the bucket's reduction starts: take the view
  /// again each step.
  view<grad_type> grad(std::string_view name) {
    const std::size_t i = index_of(name);
    const std::size_t k = hooks_.bucket_of(i);
    if (hooks_.started(k))
      throw std::logic_error("distopt::optimizer::grad('" + std::string(name) +
                             "'): its bucket's reduction has started in this step (grads_ready was called for all "
                             "its tensors); write a tensor's grads before its grads_ready");
    if constexpr (zero_stage >= 2) {
      if (reduced_)
        throw std::logic_error("distopt::optimizer::grad('" + std::string(name) +
                               "'): this step's grads were reduced (reduce_grads, clip_grad_norm); with ZeRO-2 the "
                               "next step's grads are written after step()");
      // One rank: the grads stay in place, zeroed at their first view of a step as the
      // pool's buffers are.
      if (!shards_grads() && hooks_.lend(k))
        fill_zero(grads_.data() + plan_.buckets()[k].buffer_begin, plan_.buckets()[k].padded());
    }
    if (!shards_grads()) return full_view(grads_, name);
    if (reduced_)
      throw std::logic_error("distopt::optimizer::grad('" + std::string(name) +
                             "'): this step's grads were reduced (reduce_grads, clip_grad_norm); with ZeRO-2 the "
                             "next step's grads are written after step()");
    const detail::shard_bucket& b = plan_.buckets()[k];
    return {bucket_grads(k) + (plan_.tensor_buffer(i) - b.buffer_begin), layout_.tensors()[i].numel};
  }

  /// Overlap hook: backward has finished writing the grads of `names` (a tensor or a
  /// layer's tensors) for this step. Once every tensor of a bucket is ready, the bucket's
  /// reduction starts at once (asynchronously where the communicator can), while backward
  /// goes on; `step()` then waits only for what is still in flight. Once a hook is called
  /// in a step, every tensor must be declared ready before the step reduces. Collective in
  /// the order of buckets: every rank must complete the buckets in the same order. Naming
  /// a tensor twice in one step, or after the step's grads were reduced, throws, naming it.
  void grads_ready(const tensor_names& names) {
    for (std::string_view name : names) {
      const std::size_t i = index_of(name);
      if (reduced_)
        throw std::logic_error("distopt::optimizer::grads_ready('" + std::string(name) +
                               "'): this step's grads were already reduced (reduce_grads, clip_grad_norm)");
      if (hooks_.mark(i, layout_.tensors()[i].name)) {
        const std::size_t k = hooks_.bucket_of(i);
        start_reduce(k, "grads_ready");  // first: a failed check_hook_order leaves the bucket to the step
        hooks_.start(k);
      }
    }
    reap_reductions();
  }

  /// Forward and backward hook: the full params of `names` (a tensor or a layer's
  /// tensors), readable through param(name) until `release`. ZeRO-3: each bucket holding
  /// them is all-gathered into a pooled buffer (waiting for its prefetch, if one was
  /// started), unless a gather holds it already. Other stages: bookkeeping only, so that
  /// one training loop serves every stage. Collective: every rank gathers and releases
  /// the same tensors in the same order. Gathering a tensor twice throws, naming it.
  void gather(const tensor_names& names) {
    for (std::string_view name : names) {
      const std::size_t i = index_of(name), k = hooks_.bucket_of(i);
      // The collective first, the bookkeeping after: a failed check_hook_order marks nothing
      // (a tensor gathered already has its bucket held: no collective, and gather() throws).
      if (zero_stage >= 3 && !gathers_.holds(k)) {
        if (gathers_.prefetched(k)) finish_prefetch(k);
        else gather_bucket_params(k, false, "gather");
      }
      gathers_.gather(i, k, layout_.tensors()[i].name);
    }
  }
  /// Starts the gathers of `names` early (ZeRO-3, asynchronously where the communicator
  /// can), so that the next layer's params arrive while this one computes; `gather` then
  /// waits for them. Nothing for buckets gathered or prefetched already, nor at other stages.
  void prefetch(const tensor_names& names) {
    if constexpr (zero_stage >= 3) {
      for (std::string_view name : names) {
        const std::size_t k = hooks_.bucket_of(index_of(name));
        if (gathers_.holds(k) || gathers_.prefetched(k)) continue;
        gather_bucket_params(k, true, "prefetch");
        gathers_.set_prefetched(k, true);
      }
    }
  }
  /// Ends the gathers of `names`: a bucket's pooled buffer goes back once none of its
  /// tensors is gathered, and what was written into it is dropped (ZeRO-3).
  void release(const tensor_names& names) { release_names(names, false); }
  /// As release, but this rank keeps its shard of what was written into the gathered
  /// params (ZeRO-3): how initial values get in. At other stages params are written in place.
  void release(const tensor_names& names, keep_writes_t) { release_names(names, true); }
  /// The fp32 master weights of tensor `name` (only with master weights on bf16/fp16 params;
  /// replicated storage only: with sharded storage use local_master).
  view<const float> master(std::string_view name) const {
    require_master(name);
    return whole_local(master_, name, "master");
  }
  /// State slot `k` of tensor `name` (slot meaning is the policy's, e.g. adam: 0 exp_avg);
  /// replicated storage only: with sharded storage use local_state.
  view<const state_type> state(std::string_view name, int k) const
    requires(!is_quantized)
  {
    if constexpr (is_layerwise || projects || orthogonalizes) {  // compact slot buffers
      check_slot(k);
      require_whole(name, "state");
      return local_state(name, k).values;
    } else {
      return whole_local(states_[check_slot(k)], name, "state");
    }
  }
  /// This rank's part of the master weights of tensor `name` (all of it when replicated).
  shard_view<const float, memory_space> local_master(std::string_view name) const {
    require_master(name);
    return local_view(master_, name);
  }
  /// This rank's part of state slot `k` of tensor `name` (all of it when replicated).
  shard_view<const state_type, memory_space> local_state(std::string_view name, int k) const
    requires(!is_quantized)
  {
    if constexpr (is_layerwise) return layer_.local_state(*this, name, check_slot(k));
    else if constexpr (projects) return proj_.local_state(*this, name, check_slot(k));
    else if constexpr (orthogonalizes) return ortho_.local_state(*this, name, check_slot(k));
    else return local_view(states_[check_slot(k)], name);
  }
  /// GaLore: state slot `k` of the projected gradient of tensor `name` (a matrix of a group
  /// with a rank), low_rank_shape(m, n) elements row-major, decoded to fp32 (q8 storage
  /// keeps it in 8 bits when it has at least min_8bit_size elements); every rank holding
  /// part of the matrix keeps all of it, other ranks none.
  std::vector<float> projected_state(std::string_view name, int k) const
    requires projects
  {
    return proj_.state_values(*this, name, check_slot(k));
  }
  /// GaLore: the projector of tensor `name` (its rank, side and current projection).
  const auto& projector(std::string_view name) const
    requires projects
  {
    return proj_.projector_of(*this, name);
  }
  /// This rank's part of state slot `k` of tensor `name`, decoded to fp32 (any encoding;
  /// q8 codes read back as map[code] * absmax).
  shard_values local_state_values(std::string_view name, int k) const {
    check_slot(k);
    if constexpr (is_quantized) {
      return q8_.local_values(*this, name, k);
    } else {
      const auto v = local_state(name, k);
      std::vector<state_type> raw(v.values.size());
      download(exec_, v.values, std::span<state_type>(raw));
      shard_values out{std::vector<float>(raw.size()), v.first};
      for (std::size_t i = 0; i < raw.size(); ++i) out.values[i] = to_float(raw[i]);
      return out;
    }
  }
  /// State slot `k` of tensor `name`, decoded to fp32; replicated storage only.
  std::vector<float> state_values(std::string_view name, int k) const {
    require_whole(name, "state");
    return local_state_values(name, k).values;
  }
  /// q8: whether tensor `name` keeps 8-bit states (false below min_8bit_size: fp32).
  bool state_is_quantized(std::string_view name) const
    requires is_quantized
  {
    return q8_.part_of(*this, name).quantized;
  }
  /// q8: this rank's codes of state slot `k` of tensor `name` (`first`: the index of the
  /// first element in the tensor); empty for tensors that keep fp32 states.
  shard_view<const std::uint8_t, memory_space> local_state_codes(std::string_view name, int k) const
    requires is_quantized
  {
    check_slot(k);
    const auto q = q8_.part_of(*this, name);
    if (!q.quantized) return {};
    return {view<const std::uint8_t>(states_[k].data() + q.offset, q.count), q.first};
  }
  /// q8: the absmax of each block of this rank's part (`first`: the index of the first
  /// block in the tensor, blocks of q8::block elements counted from the tensor's start).
  shard_view<const float, memory_space> local_state_absmax(std::string_view name, int k) const
    requires is_quantized
  {
    check_slot(k);
    const auto q = q8_.part_of(*this, name);
    if (!q.quantized) return {};
    return {view<const float>(q8_.absmax_[k].data() + q.offset / q8::block, (q.count + q8::block - 1) / q8::block),
            q.first / q8::block};
  }
  /// Layer-wise policies: row state `k` of a factored tensor (e.g. Adafactor's
  /// exp_avg_sq_row), indexed [matrix * rows + row] over this TP rank's rows. Every DP
  /// rank that holds part of the tensor keeps all of it; empty elsewhere and for
  /// unfactored tensors.
  std::span<const float> row_state(std::string_view name, int k) const
    requires is_layerwise
  {
    return layer_.factor_state(*this, name, k, Policy::row_states, true);
  }
  /// Layer-wise policies: column state `k` (e.g. exp_avg_sq_col), [matrix * cols + col].
  std::span<const float> col_state(std::string_view name, int k) const
    requires is_layerwise
  {
    return layer_.factor_state(*this, name, k, Policy::col_states, false);
  }
  /// The whole flat buffers, padding included (for bulk I/O); not with ZeRO-3 (params) or
  /// ZeRO-2 (grads), where the full buffers exist per bucket only.
  view<param_type> params() {
    if constexpr (zero_stage >= 3)
      throw std::logic_error("distopt::optimizer::params(): with ZeRO-3 the full params exist per bucket only; "
                             "read and write them through gather(names), param(name) and release");
    return {params_.data(), params_.size()};
  }
  /// The whole grads buffer; not with ZeRO-2 (d > 1), where the grads live per bucket.
  view<grad_type> grads() {
    if (zero_stage >= 2)
      throw std::logic_error("distopt::optimizer::grads(): with ZeRO-2 the full grads exist per bucket only; "
                             "write them through grad(name)");
    return {grads_.data(), grads_.size()};
  }

  /// Hyper-parameters of group `g`.
  const hyper_params& hyper(int g = 0) const { return groups_.at(check_group(g)); }
  /// Replaces the hyper-parameters of group `g` (for schedules); validated first.
  void set_hyper(int g, hyper_params h) {
    h.validate();
    if (Policy::state_slots(h) > slots_)
      throw std::invalid_argument(std::string(Policy::name) +
                                  ": these hyper-parameters need more state than was allocated");
    if constexpr (is_layerwise) layer_.check_hyper(*this, check_group(g), h);
    if constexpr (orthogonalizes) ortho_.check_hyper(*this, check_group(g), h);
    groups_.at(check_group(g)) = std::move(h);
    groups_changed_ = true;  // a device executor copies the groups before the next step
  }
  /// Number of hyper-parameter groups.
  int group_count() const noexcept { return static_cast<int>(groups_.size()); }

  /// Steps taken so far (skipped steps do not count). On a device executor this reads the
  /// device's counter (a synchronisation, when steps were taken since the last read).
  std::int64_t step_count() const {
    sync_decisions();
    return step_;
  }
  /// The factor to multiply the loss by before backward (1 without loss scaling). On a
  /// device executor this reads the device's (a synchronisation, as step_count); a kernel
  /// can read it where it lives instead: loss_scale_on_device().
  double loss_scale() const {
    sync_decisions();
    return scaler_ ? scaler_->scale() : 1.0;
  }
  /// The executor and the data-parallel communicator in use.
  Exec& executor() noexcept { return exec_; }
  Comm& communicator() noexcept { return comm_; }

  /// Adds a model-parallel group (tensor and pipeline parallel ranks that hold different
  /// parts of the model): the global grad norm is then also all-reduced over it, counting
  /// tensors registered with tp_split::none only on TP rank `tp_rank` == 0, so that
  /// tensors every TP rank holds a copy of are counted once. Collective over `group`.
  void set_model_parallel_group(Comm group, int tp_rank) {
    if (tp_rank < 0)
      throw std::invalid_argument("distopt::optimizer: tp_rank must be >= 0, got " + std::to_string(tp_rank));
    check_same_stream(group, "the model-parallel group");
    model_parallel_.emplace(std::move(group));
    tp_rank_ = tp_rank;
    step_skip_host_.clear();
  }

  /// Sets the tensor-parallel group: the ranks holding the other rows or columns of the
  /// tensors registered with tp_split::rows (dim 0 split) or tp_split::cols (last dim
  /// split). Layer-wise statistics of split tensors are summed over it, and so is the
  /// global grad norm unless a model-parallel group was set (then that one counts; it must
  /// contain this group). Every rank of the group must hold the same layout, with its own
  /// part's shapes. Collective over `group`.
  void set_tensor_parallel_group(Comm group) {
    check_same_stream(group, "the tensor-parallel group");
    tp_.emplace(std::move(group));
    if (!model_parallel_) tp_rank_ = tp_->rank();
    step_skip_host_.clear();
    if constexpr (is_layerwise) layer_.init_geometry(*this);
  }

  /// Sets every grad to zero.
  /// ZeRO-2: the buckets' pooled buffers that hold grads are zeroed too, and the
  /// overlap hooks start the step afresh.
  void zero_grad() {
    wait_pending();  // a reduction still reading the grads
    fill_zero(grads_.data(), grads_.size());
    if (shards_grads())
      for (std::size_t k = 0; k < plan_.buckets().size(); ++k)
        if (grad_type* g = grad_pool_.of(k)) fill_zero(g, plan_.buckets()[k].padded());
    next_step_grads();
  }

  /// Combines the ranks' grads (all-reduce when replicated, reduce-scatter into the local
  /// shard when sharded; owned buckets: a reduce to each owner of its matrices, blocking).
  /// `clip_grad_norm` and `step` call it when it has not been called
  /// since the last step; call it yourself to control when communication happens. After
  /// it, the grads outside this rank's shard are no longer meaningful (sharded).
  /// With the overlap hooks in use this step, every tensor must have been declared ready:
  /// the buckets they completed are reducing already, and only those are waited for.
  void reduce_grads() {
    if (reduced_) return;
    if (hooks_.in_use()) {
      if (const std::ptrdiff_t i = hooks_.first_missing(); i >= 0)
        throw std::logic_error("distopt::optimizer: grads_ready was called in this step, but not for '" +
                               layout_.tensors()[static_cast<std::size_t>(i)].name +
                               "'; with the overlap hooks every tensor's grads must be declared ready before the step");
    }
    reduced_ = true;
    for (std::size_t k = 0; k < plan_.buckets().size(); ++k)
      if (!hooks_.started(k)) start_reduce(k, "reduce_grads");
  }

  /// Computes the global L2 norm of the (unscaled, reduced) gradients, as
  /// torch.nn.utils.clip_grad_norm_, and makes the next `step()` scale them by
  /// min(1, max_norm / (norm + 1e-6)) inside its fused pass. Returns the norm; a NaN or
  /// Inf norm makes the next step skip. Collective (it reduces the grads first).
  double clip_grad_norm(double max_norm) {
    if (!(max_norm > 0.0) || !std::isfinite(max_norm))
      throw std::invalid_argument("clip_grad_norm: invalid max_norm " + std::to_string(max_norm) +
                                  ": must be a finite value > 0");
    const double norm = grad_norm();
    clip_ = clip_state{norm, detail::clip_coefficient(max_norm, norm)};
    return norm;
  }

  /// What step() returns: a step_result on an executor of host memory; on a device
  /// executor a step_ticket, which reads the step's outcome from the device when asked.
  using step_return = std::conditional_t<host_memory<Exec>, step_result, step_ticket<optimizer>>;

  /// Takes one optimizer step over every tensor. A NaN or Inf gradient on any rank skips
  /// the step on every rank and leaves params and states bit for bit as they were.
  /// Collective. On a device executor the step is decided on the device (engine/decisions.hpp)
  /// and nothing is copied between host and device, unless percentile clipping is on, the
  /// communicator stages its collectives through host memory, or (with a communicator of
  /// device memory) check_hook_order compares each bucket's collective through a copy.
  /// No tensor may be gathered (at ZeRO-3 a gathered view would go stale; the check runs
  /// at every stage, so that a loop written for stage 1 works at 3); prefetches still in
  /// flight are dropped.
  step_return step() {
    end_param_gathers("step()");
    ++step_calls_;
    if (decides_on_device()) {
      device_step();
    } else {
      sync_decisions();
      last_result_ = host_step();
      if constexpr (!host_memory<Exec>) {  // the device's copy of the decisions follows
        decisions_changed_ = true;
        push_decisions();
      }
    }
    if constexpr (host_memory<Exec>) return last_result_;
    else return step_ticket<optimizer>(*this, step_calls_);
  }

  /// The outcome of step() call `call` (counting from 1): what a step_ticket reads.
  /// Throws std::logic_error when another step has been taken since.
  step_result step_outcome(std::int64_t call) const {
    if (call != step_calls_)
      throw std::logic_error("distopt::optimizer: the result of step() call " + std::to_string(call) +
                             " was read after call " + std::to_string(step_calls_) +
                             "; read a step's result before the next step()");
    sync_decisions();
    return last_result_;
  }

  /// Device executors: the loss scale where it lives, in device memory (one double, updated
  /// by each step), for a kernel that scales the loss without a synchronisation.
  device_span<const double> loss_scale_on_device() {
    static_assert(!host_memory<Exec>, "distopt::optimizer::loss_scale_on_device: for device executors");
    push_decisions();
    return {&control_.data()->loss_scale, 1};
  }

  /// Sharded storage: all-gathers every rank's shard of the params into every rank's full
  /// params (`step` does it unless gather_params is off). Collective. ZeRO-3: nothing (the
  /// params are gathered per layer by `gather`).
  void gather_params() {
    wait_pending();
    for (std::size_t k = 0; k < plan_.buckets().size(); ++k) start_gather(k, false);
  }

  /// Copies this rank's params into its fp32 master weights; done automatically before
  /// the first step, call it again after overwriting params by hand.
  void load_master_from_params() {
    if (!uses_master()) return;
    launch_master_load(nullptr);
    sync_decisions();
    master_ready_ = true;
    decisions_changed_ = true;  // a device executor's control learns it before the next step
  }

  /// Bytes this rank allocates, by category, and per parameter of the model. Each figure
  /// is the size of an allocation this optimizer holds; the elements that belong to no
  /// tensor (block alignment, shard padding) are counted under "padding".
  distopt::memory_report memory() const {
    distopt::memory_report r;
    r.parameters = layout_.numel();
    std::size_t padding = 0;
    const auto add = [&](std::string name, std::size_t bytes, std::size_t elems, std::size_t used) {
      if (bytes == 0) return;
      const std::size_t each = bytes / elems;
      r.entries.push_back({std::move(name), used * each});
      padding += (elems - used) * each;
    };
    const std::size_t full_used = layout_.numel(), local_used = plan_.local_numel();
    add("params", params_.bytes(), params_.size(), shards_params() ? local_used : full_used);
    // ZeRO-3: the full-bucket param buffers lent by gather and prefetch, at their peak.
    if (param_pool_.bytes()) r.entries.push_back({"param buckets (peak)", param_pool_.bytes()});
    add("grads", grads_.bytes(), grads_.size(), shards_grads() ? local_used : full_used);
    // ZeRO-2: the full-bucket grad buffers lent during backward, as many as were ever
    // lent at once (the pool keeps them).
    if (grad_pool_.bytes()) r.entries.push_back({"grad buckets (peak)", grad_pool_.bytes()});
    add("grads fp32", grads32_.bytes(), grads32_.size(), local_used);
    add("master", master_.bytes(), master_.size(), local_used);
    if constexpr (is_layerwise) {
      layer_.add_memory(*this, r);
    } else if constexpr (is_quantized) {
      // Codes of the 8-bit tensors (their last partial blocks padded), one fp32 absmax
      // per block, and the fp32 states of the tensors below min_8bit_size.
      std::size_t quantized = 0;
      for (std::size_t c = 0; c < plan_.pieces().size(); ++c)
        if (q8_.pieces_[c].quantized) quantized += plan_.pieces()[c].count;
      for (int k = 0; k < slots_; ++k) {
        add("state " + std::to_string(k), states_[k].bytes(), states_[k].size(), quantized);
        if (q8_.absmax_[k].bytes()) r.entries.push_back({"state " + std::to_string(k) + " absmax", q8_.absmax_[k].bytes()});
        if (q8_.small_[k].bytes()) r.entries.push_back({"state " + std::to_string(k) + " fp32", q8_.small_[k].bytes()});
      }
      if constexpr (projects) proj_.add_memory(*this, r);
    } else if constexpr (projects) {
      for (int k = 0; k < slots_; ++k)
        if (states_[k].bytes()) r.entries.push_back({"state " + std::to_string(k), states_[k].bytes()});
      proj_.add_memory(*this, r);
    } else if constexpr (orthogonalizes) {
      for (int k = 0; k < slots_; ++k)  // the other tensors' states; the matrices' momentum below
        if (states_[k].bytes()) r.entries.push_back({"state " + std::to_string(k), states_[k].bytes()});
      ortho_.add_memory(*this, r);
    } else {
      for (int k = 0; k < slots_; ++k)
        add("state " + std::to_string(k), states_[k].bytes(), states_[k].size(), local_used);
    }
    if (!gnorm_vec_.empty()) r.entries.push_back({"clip history", gnorm_vec_.size() * sizeof(gnorm_vec_[0])});
    // Device executors: the piece table and what each step's launches read and write there.
    const std::size_t tables = pieces_dev_.bytes() + step_scalars_.bytes() + step_slots_.bytes() +
                               step_clip_scale_.bytes() + step_skip_.bytes() + step_sums_.bytes() + control_.bytes() +
                               groups_dev_.bytes() + started_dev_.bytes() + norm_wire_.bytes();
    if (tables) r.entries.push_back({"step tables", tables});
    r.entries.push_back({"padding", padding});
    r.entries.push_back({"comm buffers", staging_.bytes()});
    return r;
  }
  /// The same as memory().
  distopt::memory_report memory_report() const { return memory(); }

  /// Writes a checkpoint into directory `dir` (created if needed): one safetensors file
  /// per rank and index.json, written last; the previous checkpoint there stays loadable
  /// until the new index replaces it. Collective over the data-parallel group and the
  /// tensor-parallel group. Needs `#include <distopt/checkpoint.hpp>` (xxHash).
  /// `dir`: a std::filesystem::path or anything that converts to one.
  template <class Dir>
  void save(const Dir& dir) {
    io::checkpoint_files<optimizer>::save(*this, dir);
  }
  /// Loads the checkpoint in `dir`, written with any number of data-parallel ranks and the
  /// same tensor-parallel size; afterwards steps continue bit for bit as the run that saved
  /// it would have. A missing, corrupt or mismatched checkpoint throws io::checkpoint_error
  /// on every rank and leaves this optimizer as it was. Collective, as save.
  template <class Dir>
  void load(const Dir& dir) {
    io::checkpoint_files<optimizer>::load(*this, dir);
  }

  /// Layer-wise policies: bytes of statistics this rank has put into all-reduces so far
  /// (over DP and TP; what each collective then sends is the communicator's bytes_sent).
  std::size_t statistics_bytes() const noexcept {
    if constexpr (is_layerwise) return layer_.stat_bytes_;
    else return 0;
  }

 private:
  friend struct io::checkpoint_access;
  template <class, class, class>
  friend struct detail::layer_engine;
  template <class, class, class>
  friend struct detail::projection_engine;
  template <class, class>
  friend struct detail::muon_engine;
  template <class, class>
  friend struct detail::q8_engine;
  friend struct detail::offload_access;

  /// Tells params_done_ (when set) of buckets [params_told_, upto) in bucket order, each
  /// once its params are final in this step: updated and, where the update started its
  /// all-gather, gathered. Without `wait` it stops at the first gather still in flight, so
  /// that the update loop never blocks on one; with it, it waits for them.
  void tell_params(std::size_t upto, bool wait) {
    if (!params_done_) return;
    for (; params_told_ < upto; ++params_told_) {
      const std::size_t k = params_told_;
      if (pending(k)) {
        if (!wait && !pending_[k].test()) return;
        wait_bucket(k);
      }
      params_done_(k);
    }
  }

  /// The step decided on the host: the norm's exact sums are copied to the host, which
  /// decides, prepares the group scalars and launches the update with them.
  step_result host_step() {
    step_result r;
    double norm = std::numeric_limits<double>::quiet_NaN();
    double coef = 1.0;
    if (clip_) {
      norm = clip_->norm;
      coef = clip_->coef;
    } else if (options_.check_finite || scaler_ || options_.max_grad_norm > 0.0) {
      norm = grad_norm();
      if (options_.max_grad_norm > 0.0) coef = detail::clip_coefficient(options_.max_grad_norm, norm);
    }
    reduce_grads();
    clip_.reset();
    next_step_grads();
    r.grad_norm = norm;
    r.found_inf = (options_.check_finite || scaler_) && !std::isfinite(norm);
    if (r.found_inf) {
      if (scaler_) scaler_->update(true);
      r.skipped = true;
      r.step = step_;
      r.loss_scale = loss_scale();
      return r;
    }
    ++step_;
    params_told_ = 0;
    if (uses_master() && !master_ready_) load_master_from_params();
    const float grad_scale = static_cast<float>(coef / loss_scale());
    if (options_.percentile_clipping < 100) percentile_scales(coef);
    if constexpr (is_layerwise) {
      if (reduces_in_fp32()) layer_.step(*this, grads32_.data(), grad_scale);
      else layer_.step(*this, grads_.data(), grad_scale);
    } else {
      if (reduces_in_fp32()) run_update<float>(grads32_.data(), grad_scale);
      else run_update<grad_type>(grads_.data(), grad_scale);
    }
    if (scaler_) scaler_->update(false);
    wait_pending();  // the all-gathers the update started, bucket by bucket
    tell_params(plan_.buckets().size(), true);
    r.step = step_;
    r.loss_scale = loss_scale();
    return r;
  }

  /// True when step() decides on the device (engine/decisions.hpp): a device executor,
  /// an element-wise policy, no percentile clipping (its history is kept on the host).
  bool decides_on_device() const noexcept {
    if constexpr (host_memory<Exec> || is_layerwise || projects || orthogonalizes) return false;
    else return options_.percentile_clipping == 100;
  }

  /// The control of the device's decisions, or null when the host decides.
  const detail::step_control* decision_control() const noexcept {
    return decides_on_device() ? control_.data() : nullptr;
  }

  /// Refreshes the host's copy of the device's decisions (step counter, loss scaler,
  /// started groups, the last step's result) when the device has decided steps since:
  /// one copy from the device, a synchronisation.
  void sync_decisions() const {
    if (!mirror_stale_) return;
    detail::step_control c;
    detail::copy_bytes(exec_, &c, control_.data(), sizeof c);
    std::vector<unsigned char> started(groups_.size());
    detail::copy_bytes(exec_, started.data(), started_dev_.data(), started.size());
    step_ = c.step;
    if (scaler_) scaler_->restore(c.loss_scale, c.growth_tracker);
    state_started_.assign(started.begin(), started.end());
    master_ready_ = c.master_ready != 0;
    last_result_ = step_result{c.skipped != 0, c.skipped != 0, c.grad_norm, c.step, scaler_ ? c.loss_scale : 1.0};
    mirror_stale_ = false;
  }

  /// Copies the host's decisions state (after construction, set_hyper, a checkpoint load
  /// or a step decided on the host) to the device, where the next step reads it.
  void push_decisions() {
    if constexpr (!host_memory<Exec>) {
      static_assert(std::is_trivially_copyable_v<hyper_params>,
                    "distopt: a device executor reads the hyper-parameters in its memory: they must be trivially copyable");
      if (control_.size() == 0) {
        control_ = detail::buffer<detail::step_control, Exec>(exec_, 1);
        norm_wire_ = detail::buffer<double, Exec>(exec_, detail::exact_sum::wire_size);
        step_scalars_ = detail::buffer<typename Policy::scalars, Exec>(exec_, groups_.size());
      }
      if (decisions_changed_) {
        sync_decisions();
        detail::step_control c;
        c.step = step_;
        c.loss_scale = scaler_ ? scaler_->scale() : 1.0;
        c.growth_tracker = scaler_ ? scaler_->growth_tracker() : 0;
        c.master_ready = master_ready_;
        detail::copy_bytes(exec_, control_.data(), &c, sizeof c);
        std::vector<unsigned char> started(groups_.size());
        for (std::size_t g = 0; g < groups_.size(); ++g) started[g] = g < state_started_.size() && state_started_[g];
        in_exec(started, started_dev_);
        decisions_changed_ = false;
      }
      if (groups_changed_) {  // set_hyper: the hyper-parameters and slot counts only
        in_exec(groups_, groups_dev_);
        in_exec(group_slots(), step_slots_);
        groups_changed_ = false;
      }
    }
  }

  /// The master load phase over this rank's pieces; with `control`, as the device decided.
  void launch_master_load(const detail::step_control* control) {
    detail::master_load_phase<param_type> load;
    load.pieces = exec_pieces();
    load.params = params_.data();
    load.params_local = shards_params();
    load.master = master_.data();
    load.control = control;
    detail::launch(exec_, plan_.pieces().size(), load);
  }

  /// Each group's state slots in use.
  std::vector<int> group_slots() const {
    std::vector<int> active;
    for (const auto& h : groups_) active.push_back(Policy::state_slots(h));
    return active;
  }

  /// A step decided on the device: the norm's exact sums, the decision, each group's
  /// scalars and the update are launches that read and write the executor's memory only.
  void device_step() {
    if constexpr (!host_memory<Exec> && !is_layerwise && !projects && !orthogonalizes) device_step_phases();
  }
  void device_step_phases() {
    push_decisions();
    reduce_grads();
    detail::step_rules rules;
    rules.check = options_.check_finite || scaler_;
    rules.scaler = scaler_.has_value();
    if (options_.loss_scale) {
      rules.growth_factor = options_.loss_scale->growth_factor;
      rules.backoff_factor = options_.loss_scale->backoff_factor;
      rules.growth_interval = options_.loss_scale->growth_interval;
    }
    rules.seed = options_.seed;
    rules.max_norm = options_.max_grad_norm;
    if (clip_) {
      rules.clip = true;
      rules.clip_norm = clip_->norm;
      rules.clip_coef = clip_->coef;
    }
    rules.master = uses_master();
    const double* wire = !clip_ && (rules.check || rules.max_norm > 0.0) ? device_norm_wire() : nullptr;
    clip_.reset();
    next_step_grads();
    detail::decide_phase decide;
    decide.wire = wire;
    decide.rules = rules;
    decide.control = control_.data();
    detail::launch(exec_, 1, decide);
    if (uses_master()) launch_master_load(control_.data());  // loads at the first step taken
    detail::prepare_phase<Policy> prepare;
    prepare.groups = groups_dev_.data();
    prepare.slots = step_slots_.data();
    prepare.started = started_dev_.data();
    prepare.out = step_scalars_.data();
    prepare.control = control_.data();
    detail::launch(exec_, groups_.size(), prepare);
    const std::vector<int> active = group_slots();
    const std::vector<typename Policy::scalars> none;  // prepared on the device
    if (uses_master()) {
      if (reduces_in_fp32()) run_mode<mode_for(true)>(none, grads32_.data(), 1.0f, 0, active);
      else run_mode<mode_for(true)>(none, grads_.data(), 1.0f, 0, active);
    } else {
      if (reduces_in_fp32()) run_mode<mode_for(false)>(none, grads32_.data(), 1.0f, 0, active);
      else run_mode<mode_for(false)>(none, grads_.data(), 1.0f, 0, active);
    }
    wait_pending();
    mirror_stale_ = true;
  }

  /// The global squared norm's exact sum as an all-reduced wire image in the executor's
  /// memory: the squares phase (grads / the device's loss scale), their sum, and the
  /// all-reduce over ranks where the norm spans them.
  const double* device_norm_wire() {
    wait_pending();
    const double* loss_scale = &control_.data()->loss_scale;
    detail::norm_wire_phase sum;
    sum.items = reduces_in_fp32() ? launch_squares(norm_squares(grads32_.data(), 1.0, loss_scale))
                                  : launch_squares(norm_squares(grads_.data(), 1.0, loss_scale));
    sum.sums = step_sums_.data();
    sum.wire = norm_wire_.data();
    detail::launch(exec_, 1, sum);
    const bool across_dp = is_sharded && comm_.size() > 1;
    if (across_dp) all_reduce_exec(comm_, norm_wire_.data(), detail::exact_sum::wire_size);
    if (model_parallel_) all_reduce_exec(*model_parallel_, norm_wire_.data(), detail::exact_sum::wire_size);
    else if (tp_) all_reduce_exec(*tp_, norm_wire_.data(), detail::exact_sum::wire_size);
    return norm_wire_.data();
  }

  /// Sums `n` doubles in the executor's memory over group `c`: through host memory when
  /// the communicator cannot reach it, in place otherwise.
  void all_reduce_exec(Comm& c, double* p, std::size_t n) {
    if constexpr (stages_collectives) {
      std::vector<double> host(n);
      detail::copy_bytes(exec_, host.data(), p, n * sizeof(double));
      c.all_reduce(std::span<double>(host), reduce_op::sum);
      detail::copy_bytes(exec_, p, host.data(), n * sizeof(double));
    } else {
      [[maybe_unused]] const auto open = detail::collective_scope(exec_);
      c.all_reduce(std::span<double>(p, n), reduce_op::sum);
    }
  }

  /// Collectives on host memory over group `c` (the layout and hook-order checks, the
  /// norm and statistics wires, percentile clipping, the checkpoint's agreement): in place
  /// with a communicator of host memory; through device scratch (wire_scratch_) with one
  /// of device memory (nccl), which is handed nothing else.
  void all_reduce_host(Comm& c, std::span<double> v, reduce_op op) {
    if constexpr (collectives_in_device_memory<Comm>) {
      const std::span<double> dev = wire_scratch(v.size());
      detail::copy_bytes(exec_, dev.data(), v.data(), v.size_bytes());
      {
        [[maybe_unused]] const auto open = detail::collective_scope(exec_);
        c.all_reduce(dev, op);
      }
      detail::copy_bytes(exec_, v.data(), dev.data(), v.size_bytes());
    } else {
      c.all_reduce(v, op);
    }
  }
  void all_gather_host(Comm& c, std::span<const double> in, std::span<double> out) {
    if constexpr (collectives_in_device_memory<Comm>) {
      const std::span<double> dev = wire_scratch(in.size() + out.size());
      detail::copy_bytes(exec_, dev.data(), in.data(), in.size_bytes());
      {
        [[maybe_unused]] const auto open = detail::collective_scope(exec_);
        c.all_gather(std::span<const double>(dev.first(in.size())), dev.subspan(in.size()));
      }
      detail::copy_bytes(exec_, out.data(), dev.data() + in.size(), out.size_bytes());
    } else {
      c.all_gather(in, out);
    }
  }
  /// `n` doubles of device scratch for all_reduce_host and all_gather_host (grown as needed).
  std::span<double> wire_scratch(std::size_t n) {
    if (wire_scratch_.size() < n) wire_scratch_ = detail::buffer<double, Exec>(exec_, n);
    return wire_scratch_.span().first(n);
  }

  /// A communicator and an executor that each enqueue on a stream of a device (nccl, cuda)
  /// must share both: a collective then reads what the kernels before it wrote, in stream
  /// order, in the memory it can reach.
  void check_same_stream(const Comm& c, const char* which) const {
    if constexpr (requires { { c.runs_on(exec_.stream(), exec_.device()) } -> std::convertible_to<bool>; })
      if (!c.runs_on(exec_.stream(), exec_.device()))
        throw std::invalid_argument(std::string("distopt::optimizer: ") + which +
                                    " enqueues its collectives on another stream or device than the executor's "
                                    "kernels; give both the same device and stream");
  }

  /// Elements per work item: a multiple of every block size, large enough to amortise a
  /// dispatch, small enough to balance threads.
  static constexpr std::size_t chunk_elems = 1u << 14;

  struct clip_state {
    double norm, coef;
  };

  /// `owned` storage: which tensors are placed whole on one rank (the matrices of the
  /// groups the policy projects or orthogonalises; the engines refuse other shapes there).
  std::vector<char> owned_tensors() const {
    std::vector<char> owned;
    if constexpr (owns_matrices) {
      const auto tensors = layout_.tensors();
      owned.assign(tensors.size(), 0);
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        const hyper_params& h = groups_[static_cast<std::size_t>(tensors[i].group)];
        bool whole = false;
        if constexpr (projects) whole = Policy::projects(h);
        else whole = Policy::orthogonalizes(h);
        owned[i] = whole && tensors[i].shape.size() == 2;
      }
    }
    return owned;
  }

  bool uses_master() const noexcept {
    return !std::is_same_v<param_type, float> && options_.master_weights;
  }
  bool reduces_in_fp32() const noexcept {
    return !std::is_same_v<grad_type, float> && options_.grad_reduce_in_fp32 && comm_.size() > 1;
  }

  /// What a collective in flight holds open until it is waited for (the emulated device's memory).
  using collective_hold = std::optional<decltype(detail::collective_scope(std::declval<Exec&>()))>;

  /// True when the grads live sharded (ZeRO-2 with more than one rank): the full grads of
  /// a bucket exist only in its pooled buffer, and grads_ holds this rank's shard.
  bool shards_grads() const noexcept { return zero_stage >= 2 && comm_.size() > 1; }

  /// True for ZeRO-3: params_ holds this rank's shard (local index), and a bucket's full
  /// params exist only in its pooled buffer, between gather and release. With one rank
  /// too (the gather is then a copy), so that views behave alike for every d.
  bool shards_params() const noexcept { return zero_stage >= 3; }
  /// Where piece `pc`'s params start in params_.
  std::size_t param_at(const detail::shard_piece& pc) const noexcept { return shards_params() ? pc.local : pc.buffer; }

  enum class bucket_collective { reduce, gather };
  /// options.check_hook_order: the ranks compare the collective each is about to start on
  /// a bucket, and the call that starts it (`who`: grads_ready, reduce_grads (from step or
  /// clip_grad_norm too), gather or prefetch), and throw the same message on every rank
  /// when the collectives differ. Called before any bookkeeping of the hook, so that a
  /// caught error leaves the optimizer as it was.
  void agree_on_bucket(std::size_t k, bucket_collective what, const char* who) {
    const std::size_t d = static_cast<std::size_t>(comm_.size());
    if (!options_.check_hook_order || d == 1) return;
    static constexpr std::array<std::string_view, 4> callers{"grads_ready", "reduce_grads", "gather", "prefetch"};
    const auto caller = std::ranges::find(callers, std::string_view(who)) - callers.begin();
    const std::array<double, 3> mine{static_cast<double>(what), static_cast<double>(k), static_cast<double>(caller)};
    std::vector<double> all(3 * d);
    all_gather_host(comm_, std::span<const double>(mine), std::span<double>(all));
    bool same = true;
    for (std::size_t r = 1; r < d; ++r) same = same && all[3 * r] == all[0] && all[3 * r + 1] == all[1];
    if (same) return;
    std::string msg = "distopt::optimizer: the ranks called the hooks in different orders; at this collective";
    for (std::size_t r = 0; r < d; ++r) {
      const auto kind = static_cast<bucket_collective>(static_cast<int>(all[3 * r]));
      const detail::shard_bucket& b = plan_.buckets()[static_cast<std::size_t>(all[3 * r + 1])];
      const auto c = static_cast<std::size_t>(all[3 * r + 2]);
      msg += (r ? ", rank " : " rank ") + std::to_string(r) + " (" +
             std::string(c < callers.size() ? callers[c] : std::string_view("?")) + ")" +
             (kind == bucket_collective::reduce ? " reduces the grads of " : " gathers the params of ") + "'" +
             layout_.tensors()[b.first_tensor].name + "'";
      if (b.end_tensor - b.first_tensor > 1)
        msg += " .. '" + layout_.tensors()[b.end_tensor - 1].name + "' (" +
               std::to_string(b.end_tensor - b.first_tensor) + " tensors)";
    }
    throw std::logic_error(msg + " (every rank must call grads_ready, gather and prefetch for the same tensors in "
                                 "the same order)");
  }

  /// ZeRO-3: all-gathers bucket `k`'s params from every rank's shard into its pooled
  /// buffer; asynchronously (a prefetch, waited for by finish_prefetch) when `async` and
  /// the communicator can. With one rank, a copy.
  void gather_bucket_params(std::size_t k, bool async, const char* who) {
    agree_on_bucket(k, bucket_collective::gather, who);
    const detail::shard_bucket& b = plan_.buckets()[k];
    bool dirty = false;  // every element is overwritten
    param_type* full = param_pool_.acquire(exec_, k, dirty);
    const param_type* mine = params_.data() + b.local_begin;
    const std::size_t n = b.shard_size(plan_.rank());
    if (comm_.size() == 1) return detail::copy_bytes(exec_, full, mine, n * sizeof(param_type));
    all_gather_exec(std::span<const param_type>(mine, n), std::span<param_type>(full, b.padded()),
                    async ? &param_pending_[k] : nullptr, &param_scope_[k]);
  }
  /// ZeRO-3: waits for bucket `k`'s prefetch.
  void finish_prefetch(std::size_t k) {
    gathers_.set_prefetched(k, false);
    param_pending_[k].wait();
    param_scope_[k].reset();
  }
  void release_names(const tensor_names& names, bool keep) {
    for (std::string_view name : names) {
      const std::size_t i = index_of(name), k = hooks_.bucket_of(i);
      const bool last = gathers_.release(i, k, layout_.tensors()[i].name);
      if constexpr (zero_stage >= 3) {
        if (keep) {  // this tensor's part of this rank's shard, back into params_
          const detail::shard_bucket& b = plan_.buckets()[k];
          const std::size_t s0 = b.shard_begin(plan_.rank()), s1 = s0 + b.shard_size(plan_.rank());
          const std::size_t t0 = plan_.tensor_buffer(i) - b.buffer_begin, t1 = t0 + layout_.tensors()[i].numel;
          const std::size_t a = std::max(s0, t0), e = std::min(s1, t1);
          if (a < e)
            detail::copy_bytes(exec_, params_.data() + b.local_begin + (a - s0), param_pool_.of(k) + a,
                               (e - a) * sizeof(param_type));
        }
        if (last) param_pool_.release(k);
      }
    }
  }

  /// The step's grads and hooks start afresh (a checkpoint was loaded): collectives in
  /// flight end, ZeRO-2's lent buffers go back (zeroed when lent again), nothing is
  /// declared ready or started.
  void drop_step_grads() {
    wait_pending();
    if (shards_grads())
      for (std::size_t k = 0; k < plan_.buckets().size(); ++k) grad_pool_.release(k);
    next_step_grads();
  }
  /// Before `what` changes the params: refuses gathered tensors (naming the first) and
  /// drops ZeRO-3's prefetches in flight.
  void end_param_gathers(const char* what) {
    if (const std::ptrdiff_t i = gathers_.first_gathered(); i >= 0)
      throw std::logic_error(std::string("distopt::optimizer::") + what + ": '" +
                             layout_.tensors()[static_cast<std::size_t>(i)].name +
                             "' is still gathered; release every gathered tensor before the params change");
    for (std::size_t k = 0; k < param_pending_.size(); ++k)
      if (gathers_.prefetched(k)) {
        finish_prefetch(k);
        param_pool_.release(k);
      }
  }

  /// Whether the reduced grads a step reads through a `const G*` are indexed by local
  /// index (the fp32 shard of grad_reduce_in_fp32, ZeRO-2's grads) or by buffer index.
  template <class G>
  bool grads_local() const noexcept {
    return shards_grads() || (std::is_same_v<G, float> && reduces_in_fp32());
  }

  /// Starts bucket `k`'s reduction (nothing with one rank). The full grads are read from
  /// the bucket's place in grads_, or its pooled buffer (ZeRO-2), and the reduced shard
  /// written in place, into grads32_ (through the fp32 staging bucket, blocking), or into
  /// the local grads_ (ZeRO-2). The pooled buffer goes back once the reduction is done.
  void start_reduce(std::size_t k, const char* who) {
    agree_on_bucket(k, bucket_collective::reduce, who);
    if (comm_.size() == 1) return;
    const reduce_op op = options_.grad_reduce;
    const detail::shard_bucket& b = plan_.buckets()[k];
    const std::size_t n = b.padded(), r = plan_.rank();
    grad_type* g = shards_grads() ? bucket_grads(k) : grads_.data() + b.buffer_begin;
    if (reduces_in_fp32()) {
      // One staging bucket: converted, reduced (blocking) and reused for the next.
      float* st = staging_.data();
      detail::widen_phase<grad_type> widen;
      widen.n = n;
      widen.chunk = chunk_elems;
      widen.src = g;
      widen.dst = st;
      detail::launch(exec_, widen.items(), widen);
      reduce_bucket<float>(std::span<float>(st, n), std::span<float>(grads32_.data() + b.local_begin, b.shard_size(r)),
                           op, k, false);
      if (shards_grads()) grad_pool_.release(k);
    } else {
      grad_type* mine = shards_grads() ? grads_.data() + b.local_begin : g + b.shard_begin(r);
      reduce_bucket<grad_type>(std::span<grad_type>(g, n), std::span<grad_type>(mine, b.shard_size(r)), op, k, true);
      if (!shards_grads()) return;
      if (pending(k)) grad_pool_.reducing(k);  // goes back when waited for
      else grad_pool_.release(k);            // a blocking reduction: done
    }
  }

  /// ZeRO-2: bucket `k`'s pooled full-grads buffer, lent (and zeroed) at its first use in a step.
  grad_type* bucket_grads(std::size_t k) {
    bool dirty = false;
    grad_type* g = grad_pool_.acquire(exec_, k, dirty);
    if (dirty) fill_zero(g, plan_.buckets()[k].padded());
    return g;
  }

  /// Whether bucket `k` has a collective in flight.
  bool pending(std::size_t k) const noexcept { return k < pending_.size() && pending_[k].pending(); }

  /// Finishes the reductions that have completed (never blocks), so that ZeRO-2's pooled
  /// buffers go back while backward goes on.
  void reap_reductions() {
    for (std::size_t k = 0; k < pending_.size(); ++k)
      if (pending_[k].pending() && pending_[k].test()) wait_bucket(k);
  }

  /// The grads are the next step's: the hooks start afresh.
  void next_step_grads() {
    reduced_ = false;
    hooks_.reset(plan_);
  }

  template <class T>
  void fill_zero(T* p, std::size_t n) {
    detail::fill_phase<T> zero;
    zero.n = n;
    zero.chunk = chunk_elems;
    zero.data = p;
    detail::launch(exec_, zero.items(), zero);
  }

  /// Reduces bucket `k`: asynchronously when the communicator can and `async` allows,
  /// so that later buckets' reductions overlap earlier buckets' updates.
  template <class T>
  void reduce_bucket(std::span<T> bucket, std::span<T> mine, reduce_op op, std::size_t k, bool async) {
    if constexpr (owns_matrices)
      if (plan_.buckets()[k].owned()) return reduce_owned(bucket, mine, op, plan_.buckets()[k]);
    if constexpr (stages_collectives) {
      const std::span<T> in = staged<T>(stage_in_, bucket.size());
      detail::copy_bytes(exec_, in.data(), bucket.data(), bucket.size_bytes());
      if constexpr (is_sharded) {
        const std::span<T> out = staged<T>(stage_out_, mine.size());
        comm_.reduce_scatter(std::span<const T>(in), out, op);
        detail::copy_bytes(exec_, mine.data(), out.data(), mine.size_bytes());
      } else {  // one shard: `mine` is the whole bucket, where the step reads it
        comm_.all_reduce(in, op);
        detail::copy_bytes(exec_, mine.data(), in.data(), mine.size_bytes());
      }
      return;
    }
    if constexpr (async_communicator<Comm>) {
      if (async) {
        hold_bucket(k);
        if constexpr (is_sharded) pending_[k] = comm_.ireduce_scatter(std::span<const T>(bucket), mine, op);
        else pending_[k] = comm_.iall_reduce(bucket, op);
        return;
      }
    }
    [[maybe_unused]] const auto open = detail::collective_scope(exec_);
    if constexpr (is_sharded) {
      comm_.reduce_scatter(std::span<const T>(bucket), mine, op);
    } else {
      comm_.all_reduce(bucket, op);
      // One shard: `mine` is the whole bucket. When it is elsewhere (the fp32 grads, reduced
      // from the staging bucket), the reduced values are copied there.
      if (mine.data() != bucket.data()) detail::copy_bytes(exec_, mine.data(), bucket.data(), mine.size_bytes());
    }
  }

  // Owned buckets exist only with `owned` storage, on executors of host memory.

  /// An owned bucket's reduction: one reduce to each owner of its run of tensors
  /// (blocking). `mine` is this rank's run, in place in `bucket` or elsewhere.
  template <class T>
  void reduce_owned(std::span<T> bucket, std::span<T> mine, reduce_op op, const detail::shard_bucket& b) {
    const std::size_t me = plan_.rank();
    for (std::size_t r = 0; r < b.shards; ++r)
      if (b.shard_size(r) != 0)
        comm_.reduce(std::span<const T>(bucket.subspan(b.shard_begin(r), b.shard_size(r))),
                     r == me ? mine : std::span<T>(), op, static_cast<int>(r));
  }

  /// An owned bucket's params: each owner broadcasts its run of tensors (blocking).
  void gather_owned(const detail::shard_bucket& b) {
    param_type* p = params_.data() + b.buffer_begin;
    for (std::size_t r = 0; r < b.shards; ++r)
      if (b.shard_size(r) != 0)
        comm_.broadcast(std::span<param_type>(p + b.shard_begin(r), b.shard_size(r)), static_cast<int>(r));
  }

  /// Sharded: all-gathers bucket `k`'s params, asynchronously when `async` and the
  /// communicator can (the request is kept in pending_[k]).
  void start_gather(std::size_t k, bool async) {
    if (!is_sharded || comm_.size() == 1 || shards_params()) return;
    const detail::shard_bucket& b = plan_.buckets()[k];
    if constexpr (owns_matrices)
      if (b.owned()) return gather_owned(b);
    param_type* p = params_.data() + b.buffer_begin;
    const std::span<const param_type> in(p + b.shard_begin(plan_.rank()), b.shard_size(plan_.rank()));
    if (async) {
      pending_.resize(plan_.buckets().size());
      in_flight_.resize(plan_.buckets().size());
    }
    all_gather_exec(in, std::span<param_type>(p, b.padded()), async ? &pending_[k] : nullptr,
                    async ? &in_flight_[k] : nullptr);
  }

  /// All-gathers `in` (this rank's shard, in the executor's memory) into `out`: into
  /// `*req` when given and the communicator can, with `*scope` holding the executor's
  /// memory open until it is waited for; else blocking (staged through host memory where
  /// the communicator cannot reach the executor's).
  template <class T>
  void all_gather_exec(std::span<const T> in, std::span<T> out, comm_request* req, collective_hold* scope) {
    if constexpr (stages_collectives) {
      const std::span<T> host_in = staged<T>(stage_in_, in.size());
      const std::span<T> host_out = staged<T>(stage_out_, out.size());
      detail::copy_bytes(exec_, host_in.data(), in.data(), in.size_bytes());
      comm_.all_gather(std::span<const T>(host_in), host_out);
      detail::copy_bytes(exec_, out.data(), host_out.data(), out.size_bytes());
      return;
    }
    if constexpr (async_communicator<Comm>) {
      if (req) {
        scope->emplace(detail::collective_scope(exec_));
        *req = comm_.iall_gather(in, out);
        return;
      }
    }
    [[maybe_unused]] const auto open = detail::collective_scope(exec_);
    comm_.all_gather(in, out);
  }

  /// Collectives on the memory of an executor that runs device code only (cuda), with a
  /// communicator of host memory: each bucket is copied to host memory, reduced or
  /// gathered there (blocking, in the communicator's own order: the same bits), and copied
  /// back. The emulated device's collectives read its memory directly, inside a scope, and
  /// a communicator of device memory (nccl) is handed the executor's memory in place.
  static constexpr bool stages_collectives =
      !runs_host_functions<Exec> && !host_memory<Exec> && !collectives_in_device_memory<Comm>;
  /// `n` elements of T in host staging buffer `b` (grown as needed).
  template <class T>
  static std::span<T> staged(std::vector<std::byte>& b, std::size_t n) {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
    if (b.size() < n * sizeof(T)) b.resize(n * sizeof(T));
    return {reinterpret_cast<T*>(b.data()), n};
  }

  /// Keeps the executor's memory open for bucket `k`'s collective until it is waited for.
  void hold_bucket(std::size_t k) {
    pending_.resize(plan_.buckets().size());
    in_flight_.resize(plan_.buckets().size());
    in_flight_[k].emplace(detail::collective_scope(exec_));
  }
  /// Waits for bucket `k`'s collective in flight, if any.
  void wait_bucket(std::size_t k) {
    if (k >= pending_.size()) return;
    pending_[k].wait();
    in_flight_[k].reset();
    if (shards_grads()) grad_pool_.finish(k);  // a reduction's source, if it was one
  }
  /// Waits for every collective in flight, in bucket order (the first failure is rethrown
  /// after all have finished, so no buffer is left in use).
  void wait_pending() {
    std::exception_ptr first;
    for (comm_request& r : pending_) {
      try {
        r.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    for (auto& s : in_flight_) s.reset();
    if (shards_grads())
      for (std::size_t k = 0; k < pending_.size(); ++k) grad_pool_.finish(k);
    if (first) std::rethrow_exception(first);
  }

  int check_group(int g) const {
    if (g < 0 || g >= group_count())
      throw std::out_of_range(std::string(Policy::name) + ": no hyper-parameter group " +
                              std::to_string(g) + " (there are " + std::to_string(group_count()) +
                              ")");
    return g;
  }
  int check_slot(int k) const {
    if (k < 0 || k >= slots_)
      throw std::out_of_range(std::string(Policy::name) + ": state slot " + std::to_string(k) +
                              " does not exist (" + std::to_string(slots_) + " in use)");
    return k;
  }
  void require_master(std::string_view name) const {
    if (!uses_master())
      throw std::logic_error("distopt::optimizer: no master weights are kept for '" +
                             std::string(name) + "' (fp32 params or master_weights off)");
  }

  std::size_t index_of(std::string_view name) const {
    const tensor_slot& t = layout_.find(name);
    return static_cast<std::size_t>(&t - layout_.tensors().data());
  }

  template <class T>
  view<T> full_view(const detail::buffer<T, Exec>& b, std::string_view name) const {
    const std::size_t i = index_of(name);
    return {b.data() + plan_.tensor_buffer(i), layout_.tensors()[i].numel};
  }

  template <class T>
  shard_view<const T, memory_space> local_view(const detail::buffer<T, Exec>& b, std::string_view name) const {
    const std::size_t i = index_of(name);
    const tensor_slot& t = layout_.tensors()[i];
    for (const detail::shard_bucket& bk : plan_.buckets()) {
      if (i < bk.first_tensor || i >= bk.end_tensor) continue;
      const std::size_t lo = bk.layout_begin + bk.shard_begin(plan_.rank()), hi = lo + bk.shard_size(plan_.rank());
      const std::size_t a = std::max(lo, t.offset), e = std::min(hi, t.offset + t.numel);
      if (a >= e) return {view<const T>(), 0};
      return {view<const T>(b.data() + bk.local_begin + (a - lo), e - a), a - t.offset};
    }
    return {};
  }

  template <class T>
  view<const T> whole_local(const detail::buffer<T, Exec>& b, std::string_view name, const char* what) const {
    require_whole(name, what);
    return local_view(b, name).values;
  }

  /// Global L2 norm of the reduced grads / loss_scale. Each layout block is summed in
  /// double, and the block sums are added exactly (detail::exact_sum), over threads,
  /// shards and ranks: the result is the same for every d and every thread count.
  double grad_norm() {
    reduce_grads();
    wait_pending();
    const double inv = 1.0 / loss_scale();
    detail::exact_sum total =
        reduces_in_fp32() ? local_squares<float>(grads32_.data(), inv) : local_squares<grad_type>(grads_.data(), inv);
    std::array<double, detail::exact_sum::wire_size> wire{};
    total.to_wire(wire);
    if (is_sharded && comm_.size() > 1) all_reduce_host(comm_, wire, reduce_op::sum);
    if (model_parallel_) all_reduce_host(*model_parallel_, wire, reduce_op::sum);
    else if (tp_) all_reduce_host(*tp_, wire, reduce_op::sum);
    return std::sqrt(detail::exact_sum::from_wire(wire).value());
  }

  /// This rank's exact sum of squares over its pieces. Reads reduced grads through
  /// `base`, indexed like the grads (buffer index) or the fp32 shard (local index).
  template <class G>
  detail::exact_sum local_squares(const G* base, double inv) {
    detail::exact_sum total;
    for (const auto& a : run_squares(norm_squares(base, inv))) total.add(a);
    return total;
  }

  /// The squares phase of the global norm over this rank's pieces of `base` (reduced grads,
  /// buffer or local index), times `inv`, or divided by `*divide_by` (the loss scale in the
  /// executor's memory) when given; pieces in items of `per`.
  template <class G>
  detail::squares_phase<G> norm_squares(const G* base, double inv, const double* divide_by = nullptr) {
    const auto& pieces = plan_.pieces();
    detail::squares_phase<G> sq = squares_of(base, grads_local<G>(), inv);
    sq.divide_by = divide_by;
    // Host executors: 8 items a thread, to balance. Device executors: an item a work unit
    // (cuda: a thread block of 16 half-warps), and fewer exact sums for norm_wire_phase to add.
    const std::size_t items = (host_memory<Exec> ? 8 : 1) * static_cast<std::size_t>(exec_.concurrency());
    sq.per = std::max<std::size_t>(1, pieces.size() / items);
    if ((model_parallel_ || tp_) && tp_rank_ != 0) {  // tensors every TP rank holds count on TP rank 0
      if (step_skip_host_.empty()) {  // made once (the groups' setters clear it)
        step_skip_host_.resize(pieces.size());
        for (std::size_t c = 0; c < pieces.size(); ++c)
          step_skip_host_[c] = layout_.tensors()[pieces[c].tensor].tp == tp_split::none;
        in_exec(step_skip_host_, step_skip_);
      }
      if constexpr (host_memory<Exec>) sq.skip = step_skip_host_.data();
      else sq.skip = step_skip_.data();
    }
    return sq;
  }

  static constexpr detail::param_mode mode_for(bool master) {
    if constexpr (std::is_same_v<param_type, float>) return detail::param_mode::fp32;
    else if (master) return detail::param_mode::master;
    else if constexpr (std::is_same_v<param_type, bf16>) return detail::param_mode::no_master_sr;
    else return detail::param_mode::no_master_rne;
  }

  /// The element update phase of bucket `b`'s pieces whose group uses N state slots;
  /// `sc`, `slots` and `tensor_scale` are in the executor's memory.
  template <detail::param_mode Mode, int N, class G>
  void launch_update(const typename Policy::scalars* sc, const int* slots, const float* tensor_scale,
                     const G* grads, float grad_scale, std::uint64_t key, const detail::shard_bucket& b) {
    detail::update_phase<Policy, N, Mode, param_type, G, state_type> u;
    u.pieces = exec_pieces() + b.first_piece;
    u.scalars = sc;
    u.slots = slots;
    u.tensor_scale = tensor_scale;
    if constexpr (projects) {
      u.matrix_index = proj_.matrix_index_x_;
      u.state_at = proj_.state_offset_x_ + b.first_piece;
    } else if constexpr (orthogonalizes) {
      u.matrix_index = ortho_.matrix_index_.data();
      u.state_at = ortho_.state_offset_.data() + b.first_piece;
    }
    u.params = params_.data();
    u.params_local = shards_params();
    u.grads = grads;
    u.grads_local = grads_local<G>();
    u.master = uses_master() ? master_.data() : nullptr;
    for (int k = 0; k < N; ++k) u.state[k] = states_[k].data();
    u.control = decision_control();
    u.grad_scale = grad_scale;
    u.key = key;
    detail::launch(exec_, b.end_piece - b.first_piece, u);
  }

  /// The squares phase of this rank's pieces of `grads` (local or buffer index) times
  /// `scale`, one item per piece.
  template <class G>
  detail::squares_phase<G> squares_of(const G* grads, bool local, double scale) const noexcept {
    detail::squares_phase<G> sq;
    sq.pieces = exec_pieces();
    sq.piece_count = plan_.pieces().size();
    sq.grads = grads;
    sq.grads_local = local;
    sq.scale = scale;
    sq.block = layout_.block_size();
    return sq;
  }

  /// Runs a squares phase over its items and returns their exact sums on the host (a copy
  /// out of the executor's memory when it is a device's).
  template <class G>
  std::vector<detail::exact_sum> run_squares(detail::squares_phase<G> sq) {
    const std::size_t items = (sq.piece_count + sq.per - 1) / sq.per;
    std::vector<detail::exact_sum> sums(items);
    if constexpr (host_memory<Exec>) {
      sq.out = sums.data();
      detail::launch(exec_, items, sq);
    } else {
      launch_squares(sq);
      detail::copy_bytes(exec_, sums.data(), step_sums_.data(), items * sizeof(detail::exact_sum));
    }
    return sums;
  }

  /// Device executors: runs a squares phase into step_sums_ (zeroed first, on the device)
  /// and returns its number of items.
  template <class G>
  std::size_t launch_squares(detail::squares_phase<G> sq) {
    const std::size_t items = (sq.piece_count + sq.per - 1) / sq.per;
    if (step_sums_.size() < items) step_sums_ = detail::buffer<detail::exact_sum, Exec>(exec_, items);
    detail::fill_phase<detail::exact_sum> zero;  // empty sums, set on the device
    zero.n = items;
    zero.chunk = 64;
    zero.data = step_sums_.data();
    detail::launch(exec_, zero.items(), zero);
    sq.out = step_sums_.data();
    detail::launch(exec_, items, sq);
    return items;
  }

  /// The piece table as the phases read it: in the executor's memory.
  const detail::shard_piece* exec_pieces() const noexcept {
    if constexpr (host_memory<Exec>) return plan_.pieces().data();
    else return pieces_dev_.data();
  }
  /// `v` where a launch can read it: its own data in host memory, else a copy in `dev`
  /// (grown as needed).
  template <class T>
  const T* in_exec(const std::vector<T>& v, detail::buffer<T, Exec>& dev) {
    static_assert(std::is_trivially_copyable_v<T>, "distopt: what a launch reads is copied byte for byte");
    if constexpr (host_memory<Exec>) {
      return v.data();
    } else {
      if (dev.size() < v.size()) dev = detail::buffer<T, Exec>(exec_, v.size());
      detail::copy_bytes(exec_, dev.data(), v.data(), v.size() * sizeof(T));
      return dev.data();
    }
  }

  /// Updates bucket by bucket: waits for a bucket's reduction, updates its pieces (one
  /// pass per distinct slot count in use, usually exactly one), then starts its all-gather
  /// while the next bucket is updated.
  template <detail::param_mode Mode, class G>
  void run_mode(const std::vector<typename Policy::scalars>& sc, const G* grads, float grad_scale,
                std::uint64_t key, const std::vector<int>& active) {
    const auto& buckets = plan_.buckets();
    // This step's per-group scalars and slot counts, and per-tensor scales, where the
    // update phase reads them (copied once per step into device memory).
    // Decided on the device: the scalars and slot counts are there already.
    const bool device = decides_on_device();
    const typename Policy::scalars* sc_x = device ? step_scalars_.data() : in_exec(sc, step_scalars_);
    const int* slots_x = device ? step_slots_.data() : in_exec(active, step_slots_);
    const float* tensor_scale_x = clip_scale_.empty() ? nullptr : in_exec(clip_scale_, step_clip_scale_);
    const auto update = [&](const detail::shard_bucket& b) {  // one pass per slot count in use
      [&]<int... N>(std::integer_sequence<int, N...>) {
        const auto run = [&]<int M>(std::integral_constant<int, M>) {
          if (std::find(active.begin(), active.end(), M) == active.end()) return;
          if constexpr (is_quantized)
            q8_.template launch_update<Mode, M>(*this, sc_x, slots_x, tensor_scale_x, grads, grad_scale, key, b);
          else
            launch_update<Mode, M>(sc_x, slots_x, tensor_scale_x, grads, grad_scale, key, b);
        };
        (run(std::integral_constant<int, N>{}), ...);
      }(std::make_integer_sequence<int, Policy::max_state_slots + 1>{});
    };
    // A device runs a launch's items in waves of the thread blocks that fit at once, and a
    // bucket (4 Mi elements, 256 pieces by default) fills two thirds of an H200's first
    // wave for AdamW fp32 and nothing more: its step ran at 0.77 of the copy bandwidth a
    // launch per bucket, at 0.88 in one launch over every bucket (bench/RESULTS.md). With
    // nothing to do between buckets (no projection or orthogonalisation), a device waits
    // for every bucket's reduction and updates them all in one launch (the pieces of
    // consecutive buckets are consecutive); the gathers follow.
    if constexpr (!host_memory<Exec> && !projects && !orthogonalizes) {
      if (!buckets.empty()) {
        for (std::size_t k = 0; k < buckets.size(); ++k) wait_bucket(k);
        detail::shard_bucket all;
        all.first_piece = buckets.front().first_piece;
        all.end_piece = buckets.back().end_piece;
        update(all);
        if (options_.gather_params)
          for (std::size_t k = 0; k < buckets.size(); ++k) start_gather(k, true);
        return;
      }
    }
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      wait_bucket(k);
      if constexpr (projects) proj_.template project_bucket<Mode>(*this, sc, grad_scale, key, buckets[k]);
      if constexpr (orthogonalizes)
        ortho_.template orthogonalize_bucket<Mode>(*this, sc, grads, grads_local<G>(),
                                                   grad_scale, key, buckets[k]);
      update(buckets[k]);
      if (options_.gather_params) start_gather(k, true);
      tell_params(k + 1, false);
    }
  }

  template <class G>
  void run_update(const G* grads, float grad_scale) {
    std::vector<typename Policy::scalars> sc;
    std::vector<int> active;
    state_started_.resize(groups_.size(), false);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const int slots = Policy::state_slots(groups_[g]);
      sc.push_back(Policy::prepare(groups_[g], step_info{step_, slots > 0 && !state_started_[g]}));
      active.push_back(slots);
      if (slots > 0) state_started_[g] = true;
    }
    const std::uint64_t key = detail::step_key(options_.seed, step_);
    if (uses_master()) run_mode<mode_for(true)>(sc, grads, grad_scale, key, active);
    else run_mode<mode_for(false)>(sc, grads, grad_scale, key, active);
  }

  /// Percentile clipping: the exact squared norm of each tensor's (unscaled, clipped)
  /// gradient, all-reduced over DP for the tensors cut across ranks and over TP for split
  /// ones; then each tensor's history and scale, as bitsandbytes' percentile_clipping.
  void percentile_scales(double coef) {
    wait_pending();  // the reductions reduce_grads left in flight write the grads read here
    const auto tensors = layout_.tensors();
    const auto& pieces = plan_.pieces();
    const bool local = reduces_in_fp32();
    const double inv = 1.0 / loss_scale();
    const std::vector<detail::exact_sum> piece_sums =  // one sum per piece
        local ? run_squares(squares_of(grads32_.data(), true, inv))
              : run_squares(squares_of(grads_.data(), grads_local<grad_type>(), inv));
    std::vector<detail::exact_sum> sums(tensors.size());
    for (std::size_t c = 0; c < pieces.size(); ++c) sums[pieces[c].tensor].add(piece_sums[c]);
    const auto all_reduce = [&](auto& group, const std::vector<std::size_t>& which) {
      if (which.empty()) return;
      constexpr std::size_t W = detail::exact_sum::wire_size;
      std::vector<double> wire(which.size() * W);
      for (std::size_t j = 0; j < which.size(); ++j)
        sums[which[j]].to_wire(std::span<double, W>(wire.data() + j * W, W));
      all_reduce_host(group, wire, reduce_op::sum);
      for (std::size_t j = 0; j < which.size(); ++j)
        sums[which[j]] = detail::exact_sum::from_wire(std::span<const double, W>(wire.data() + j * W, W));
    };
    if (is_sharded && comm_.size() > 1) all_reduce(comm_, straddlers_);
    if (tp_) {
      std::vector<std::size_t> split;
      for (std::size_t i = 0; i < tensors.size(); ++i)
        if (tensors[i].tp != tp_split::none) split.push_back(i);
      all_reduce(*tp_, split);
    }
    std::vector<double> sq(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) sq[i] = sums[i].value();
    detail::percentile_history(gnorm_vec_, sq, coef, step_, options_.percentile_clipping, clip_scale_);
  }

  void require_whole(std::string_view name, const char* what) const {
    if (is_sharded && comm_.size() > 1)
      throw std::logic_error("distopt::optimizer: with sharded storage each rank holds part of the " +
                             std::string(what) + " of '" + std::string(name) + "'; use local_" + what);
  }


  layout layout_;
  std::vector<hyper_params> groups_;
  optimizer_options options_;
  mutable Exec exec_;  // a handle: const reads of device memory copy through it
  // The communicators before every buffer: a stream one owns (nccl) outlives the buffers
  // freed on it.
  Comm comm_;
  std::optional<Comm> model_parallel_;
  std::optional<Comm> tp_;  // the tensor-parallel group (set_tensor_parallel_group)
  int tp_rank_ = 0;
  mutable std::optional<loss_scaler> scaler_;  // on a device executor, a copy of the device's (sync_decisions)
  int slots_ = 0;
  detail::shard_plan plan_;
  detail::buffer<param_type, Exec> params_;
  detail::buffer<grad_type, Exec> grads_;
  detail::buffer<float, Exec> grads32_;  // reduced fp32 grads of this rank's shard (grad_reduce_in_fp32)
  detail::bucket_pool<grad_type, Exec> grad_pool_;  // ZeRO-2: the buckets' full grads during backward
  detail::grad_hooks hooks_;                        // the overlap hooks' state this step
  detail::bucket_pool<param_type, Exec> param_pool_;  // ZeRO-3: the buckets' full params while gathered
  detail::param_gathers gathers_;                     // ZeRO-3: which tensors are gathered
  detail::buffer<float, Exec> staging_;  // one bucket of grads converted to fp32 for the reduction
  detail::buffer<float, Exec> master_;
  // Device executors only: the piece table, and the per-step inputs the phases read, in
  // the executor's memory (host executors read plan_ and the host vectors directly).
  detail::buffer<detail::shard_piece, Exec> pieces_dev_;
  detail::buffer<typename Policy::scalars, Exec> step_scalars_;
  detail::buffer<int, Exec> step_slots_;
  detail::buffer<float, Exec> step_clip_scale_;
  detail::buffer<unsigned char, Exec> step_skip_;
  detail::buffer<detail::exact_sum, Exec> step_sums_;
  std::vector<std::byte> stage_in_, stage_out_;  // host copies of a bucket (stages_collectives)
  detail::buffer<double, Exec> wire_scratch_;    // host-memory collectives on a device communicator
  using stored_state = std::conditional_t<is_quantized, std::uint8_t, state_type>;
  std::array<detail::buffer<stored_state, Exec>, 4> states_;  // q8: the codes of 8-bit tensors
  // q8 only (detail/q8_engine.hpp): absmax, the fp32 states of small tensors, piece offsets.
  std::conditional_t<is_quantized, detail::q8_engine<Policy, Exec>, detail::no_engine> q8_;
  std::vector<std::array<float, 100>> gnorm_vec_;  // percentile clipping: per tensor
  std::vector<std::size_t> straddlers_;             // percentile clipping: tensors cut across DP ranks
  std::vector<float> clip_scale_;                   // percentile clipping: this step's per tensor
  std::optional<clip_state> clip_;
  mutable bool master_ready_ = false;           // idem
  mutable std::int64_t step_ = 0;               // on a device executor, a copy of the device's
  mutable std::vector<bool> state_started_;  // per group: has its state been used yet (idem)
  std::int64_t step_calls_ = 0;                // step() calls, skipped ones included
  mutable step_result last_result_;            // the last step's (decided on the device: its copy)
  // The step decided on the device (engine/decisions.hpp): its control, each group's
  // hyper-parameters and started flag, the norm's wire image, in the executor's memory.
  detail::buffer<detail::step_control, Exec> control_;
  detail::buffer<hyper_params, Exec> groups_dev_;
  detail::buffer<unsigned char, Exec> started_dev_;
  detail::buffer<double, Exec> norm_wire_;
  mutable bool mirror_stale_ = false;  // the device decided steps the host's copies have not read
  bool decisions_changed_ = true;      // the host's copies changed: push_decisions before the next step
  bool groups_changed_ = true;         // the hyper-parameters changed: idem
  std::vector<unsigned char> step_skip_host_;  // the norm's skipped pieces (TP ranks other than 0)
  bool reduced_ = false;  // grads reduced since the last step
  // Per bucket: what its collective in flight holds open (the emulated device's memory)
  // until it is waited for. Declared before pending_, so that it is destroyed after the
  // requests, which wait for their collectives.
  std::vector<collective_hold> in_flight_;
  std::vector<comm_request> pending_;  // per bucket: its collective in flight (async communicators)
  std::vector<collective_hold> param_scope_;    // ZeRO-3, per bucket: what its prefetch holds open
  std::vector<comm_request> param_pending_;     // ZeRO-3, per bucket: its prefetch in flight
  detail::params_listener params_done_;  // offload, while its step runs: told of each bucket updated
  std::size_t params_told_ = 0;          // buckets params_done_ was told of in this step
  // GaLore only (detail/projection_engine.hpp).
  std::conditional_t<projects, detail::projection_engine<Policy, state_type, Exec>, detail::no_engine> proj_;
  // Muon only (detail/muon_engine.hpp).
  std::conditional_t<orthogonalizes, detail::muon_engine<Policy, state_type>, detail::no_engine> ortho_;
  // Layer-wise policies only (detail/layer_engine.hpp).
  std::conditional_t<is_layerwise, detail::layer_engine<Policy, state_type, Exec>, detail::no_engine> layer_;
};

}  // namespace distopt
