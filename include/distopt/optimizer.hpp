// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file distopt::optimizer: the user's object. It owns one step context
/// (engine/context.hpp: the plan, the buffers, the groups) and the stages its policy and
/// storage need (engine/stages.hpp); its functions are the views, the hooks of a training
/// loop and `step()`, each a few calls into engine/.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/single.hpp"
#include "concepts.hpp"
#include "config.hpp"
#include "engine/collectives.hpp"
#include "engine/context.hpp"
#include "engine/decide.hpp"
#include "engine/hooks.hpp"
#include "engine/memory.hpp"
#include "engine/stages.hpp"
#include "exec/cpu.hpp"
#include "exec/transfer.hpp"
#include "layout/registry.hpp"
#include "memory_report.hpp"
#include "norm_part.hpp"
#include "options.hpp"
#include "shard_view.hpp"
#include "step_info.hpp"
#include "storage/replicated.hpp"
#include "storage/sharded.hpp"

namespace distopt {

namespace io {
/// Defined in <distopt/checkpoint.hpp> (needs xxHash: Debian's libxxhash-dev): opt.save
/// and opt.load need it included.
template <class Context, class Stages>
struct checkpoint_files;
}  // namespace io

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
  using context_type = detail::context<Policy, Storage, Comm, Exec, Precision>;

 public:
  using policy_type = Policy;
  using hyper_params = typename Policy::hyper_params;
  using param_type = typename context_type::param_type;
  using grad_type = typename context_type::grad_type;
  /// The state encoding: fp32 (float), bf16 or q8.
  using state_type = typename context_type::state_type;
  static constexpr bool is_sharded = context_type::is_sharded;
  /// True for 8-bit block-wise states (q8): codes plus an fp32 absmax per 256 elements.
  static constexpr bool is_quantized = context_type::is_quantized;
  /// True for policies that update some tensors as whole matrices through a projection
  /// (GaLore: include distopt/policy/galore_adamw.hpp and link distopt::galore).
  static constexpr bool projects = context_type::projects;
  /// True for policies that update some tensors as whole matrices orthogonalised by
  /// Newton–Schulz (Muon: include distopt/policy/muon.hpp and link distopt::muon).
  static constexpr bool orthogonalizes = context_type::orthogonalizes;
  /// True for policies whose step needs per-tensor, per-row or per-column statistics.
  static constexpr bool is_layerwise = context_type::is_layerwise;
  /// True for `owned` storage: each matrix of a projected or orthogonalised group lives
  /// whole on one rank.
  static constexpr bool owns_matrices = context_type::owns_matrices;
  /// The ZeRO stage: 0 replicated, 1 sharded states, 2 sharded grads too (sharded<E, 2>).
  static constexpr int zero_stage = context_type::zero_stage;
  static_assert(!owns_matrices || projects || orthogonalizes,
                "distopt::owned<...> places the matrices that GaLore projects and Muon orthogonalises, each "
                "on one rank; this policy updates no whole matrices: use distopt::sharded<...>");
  static_assert(!owns_matrices || host_memory<Exec>,
                "distopt::owned<...> runs on executors of host memory (cpu, kokkos): its buckets' reduces and "
                "broadcasts read the buffers in place");
  static_assert(!is_layerwise || detail::stage_included<Policy, detail::layer_stage_tag>::value,
                "distopt::optimizer: a layer-wise policy needs #include <distopt/engine/layerwise.hpp> "
                "(the policy headers lamb.hpp, adafactor.hpp and came.hpp include it)");
  static_assert(!is_quantized || detail::stage_included<Policy, detail::q8_stage_tag>::value,
                "distopt::optimizer: 8-bit states need #include <distopt/storage/q8.hpp>");
  static_assert(!projects || detail::stage_included<Policy, detail::projection_stage_tag>::value,
                "distopt::optimizer: a projecting policy needs #include <distopt/engine/projection.hpp> "
                "(policy/galore_adamw.hpp includes it)");
  static_assert(!orthogonalizes || detail::stage_included<Policy, detail::orthogonal_stage_tag>::value,
                "distopt::optimizer: an orthogonalising policy needs #include <distopt/engine/orthogonal.hpp> "
                "(policy/muon.hpp includes it)");
  static_assert(!orthogonalizes || (host_memory<Exec> && !is_quantized && !is_layerwise && !projects),
                "distopt::optimizer: Muon runs on executors of host memory (cpu, kokkos) with fp32 or bf16 "
                "states (replicated or sharded); 8-bit Muon states and device executors are not built yet");
  static_assert(host_memory<Exec> || !projects || !is_quantized,
                "distopt::optimizer: GaLore with 8-bit states runs on executors of host memory (cpu, kokkos); "
                "on device executors (emulated_device, cuda) its states are fp32 or bf16");
  static_assert(!requires { Exec::offloads_states; },
                "distopt::optimizer over distopt::offload<Device> is ZeRO-Offload: #include <distopt/offload.hpp> "
                "(distopt.hpp includes it)");
  static_assert(!collectives_in_device_memory<Comm> || !host_memory<Exec>,
                "distopt::optimizer: a communicator of device memory (nccl) needs an executor of device "
                "memory (distopt::cuda); on cpu and kokkos use single, threads, mpi or any_comm");
  using comm_type = Comm;
  using executor_type = Exec;
  /// The memory space the buffers live in (the executor's).
  using memory_space = typename context_type::memory_space;
  /// A view of the optimizer's memory: std::span<T> for host memory, device_span<T> for
  /// device memory (write and read it with distopt::upload / distopt::download).
  template <class T>
  using view = typename context_type::template view<T>;

  /// Creates the buffers for `tensors`; `groups[i]` holds the hyper-parameters of the tensors
  /// registered with group i. Every tensor must be registered with the param dtype. With
  /// more than one rank this is collective: every rank must construct its optimizer, with
  /// the same layout (checked: a difference is reported on every rank).
  optimizer(layout tensors, std::vector<hyper_params> groups, optimizer_options options = {}, Exec exec = Exec{},
            Comm comm = Comm{})
      : ctx_(std::move(tensors), std::move(groups), std::move(options), std::move(exec), std::move(comm)) {
    stages_.init(ctx_);
  }
  /// One hyper-parameter group for every tensor.
  optimizer(layout tensors, hyper_params hyper, optimizer_options options = {}, Exec exec = Exec{}, Comm comm = Comm{})
      : optimizer(std::move(tensors), std::vector<hyper_params>{std::move(hyper)}, std::move(options), std::move(exec),
                  std::move(comm)) {}

  /// The tensors and their place in the layout.
  const layout& tensors() const noexcept { return ctx_.layout_; }

  /// The params of tensor `name`: write initial values here before the first step (the
  /// same values on every rank). In device memory, write them with distopt::upload.
  /// ZeRO-3 (sharded<E, 3>): the tensor must be gathered (`gather`), and the view is into
  /// its bucket's pooled buffer, valid until the release; initial values written there are
  /// kept by `release(name, keep_writes)`.
  view<param_type> param(std::string_view name) { return detail::param_view(ctx_, ctx_.index_of(name)); }
  /// The grads of tensor `name`: write each step's gradient here before `step()` (or
  /// before `grads_ready(name)`). ZeRO-2 (sharded<E, 2>): the grads are zero at the first
  /// view of a step (of any tensor of the bucket), and with d > 1 the view is into the
  /// bucket's pooled buffer, valid until the bucket's reduction starts: take the view
  /// again each step. Gradient accumulation (options.micro_batches > 1), at every stage:
  /// the grads are zero at the first view of a step (accumulation::reduce_last: each
  /// micro-batch's backward adds into them) or of a micro-batch (reduce_each); take the
  /// view again each micro-batch.
  view<grad_type> grad(std::string_view name) { return detail::grad_view(ctx_, ctx_.index_of(name)); }

  /// Gradient accumulation (options.micro_batches = n > 1): the backward of one
  /// micro-batch has finished adding its grads. Call it after each of the n backward
  /// passes of a step, then step() (or reduce_grads, clip_grad_norm). With the overlap
  /// hooks, every tensor must be declared ready in every micro-batch; reduce_each reduces
  /// each micro-batch (a bucket's reduction starts at its hooks, or here for the buckets
  /// no hook started) and adds this rank's shard into its fp32 accumulator, reduce_last
  /// reduces the sums once, from the hooks of the last micro-batch or in the step.
  /// Collective with reduce_each (it may start reductions). Calling it more than n times
  /// in a step, or after the grads were reduced, throws.
  void end_micro_batch() { detail::end_micro_batch(ctx_); }
  /// Micro-batches ended in this step (0 after each step).
  int micro_batch() const noexcept { return ctx_.micro_batch_; }

  /// Overlap hook: backward has finished writing the grads of `names` (a tensor or a
  /// layer's tensors) for this step. Once every tensor of a bucket is ready, the bucket's
  /// reduction starts at once (asynchronously where the communicator can), while backward
  /// goes on; `step()` then waits only for what is still in flight. Once a hook is called
  /// in a step, every tensor must be declared ready before the step reduces. Collective in
  /// the order of buckets: every rank must complete the buckets in the same order. Naming
  /// a tensor twice in one step (in one micro-batch, with gradient accumulation: see
  /// end_micro_batch), or after the step's grads were reduced, throws, naming it.
  void grads_ready(const tensor_names& names) {
    for (std::string_view name : names) detail::mark_ready(ctx_, ctx_.index_of(name));
    detail::reap_reductions(ctx_);
  }
  /// Forward and backward hook: the full params of `names` (a tensor or a layer's
  /// tensors), readable through param(name) until `release`. ZeRO-3: each bucket holding
  /// them is all-gathered into a pooled buffer (waiting for its prefetch, if one was
  /// started), unless a gather holds it already. Other stages: bookkeeping only, so that
  /// one training loop serves every stage. Collective: every rank gathers and releases
  /// the same tensors in the same order. Gathering a tensor twice throws, naming it.
  void gather(const tensor_names& names) {
    for (std::string_view name : names) detail::gather_tensor(ctx_, ctx_.index_of(name));
  }
  /// Starts the gathers of `names` early (ZeRO-3, asynchronously where the communicator
  /// can), so that the next layer's params arrive while this one computes; `gather` then
  /// waits for them. Nothing for buckets gathered or prefetched already, nor at other stages.
  void prefetch(const tensor_names& names) {
    if constexpr (zero_stage >= 3)
      for (std::string_view name : names) detail::prefetch_tensor(ctx_, ctx_.index_of(name));
  }
  /// Ends the gathers of `names`: a bucket's pooled buffer goes back once none of its
  /// tensors is gathered, and what was written into it is dropped (ZeRO-3).
  void release(const tensor_names& names) {
    for (std::string_view name : names) detail::release_tensor(ctx_, ctx_.index_of(name), false);
  }
  /// As release, but this rank keeps its shard of what was written into the gathered
  /// params (ZeRO-3): how initial values get in. At other stages params are written in place.
  void release(const tensor_names& names, keep_writes_t) {
    for (std::string_view name : names) detail::release_tensor(ctx_, ctx_.index_of(name), true);
  }

  /// The fp32 master weights of tensor `name` (only with master weights on bf16/fp16 params;
  /// replicated storage only: with sharded storage use local_master).
  view<const float> master(std::string_view name) const {
    const auto part = local_master(name);  // throws without master weights
    return require_whole(name, "master"), part.values;
  }
  /// State slot `k` of tensor `name` (slot meaning is the policy's, e.g. adam: 0 exp_avg);
  /// replicated storage only: with sharded storage use local_state.
  view<const state_type> state(std::string_view name, int k) const
    requires(!is_quantized)
  {
    ctx_.check_slot(k);
    return require_whole(name, "state"), local_state(name, k).values;
  }
  /// This rank's part of the master weights of tensor `name` (all of it when replicated).
  shard_view<const float, memory_space> local_master(std::string_view name) const {
    if (!ctx_.uses_master())
      throw std::logic_error("distopt::optimizer: no master weights are kept for '" + std::string(name) +
                             "' (fp32 params or master_weights off)");
    return detail::master_part(ctx_, ctx_.index_of(name));
  }
  /// This rank's part of state slot `k` of tensor `name` (all of it when replicated).
  shard_view<const state_type, memory_space> local_state(std::string_view name, int k) const
    requires(!is_quantized)
  {
    return detail::state_part(ctx_, ctx_.index_of(name), ctx_.check_slot(k));
  }
  /// GaLore: state slot `k` of the projected gradient of tensor `name` (a matrix of a group
  /// with a rank), low_rank_shape(m, n) elements row-major, decoded to fp32 (q8 storage
  /// keeps it in 8 bits when it has at least min_8bit_size elements); every rank holding
  /// part of the matrix keeps all of it, other ranks none.
  std::vector<float> projected_state(std::string_view name, int k) const
    requires projects
  {
    return stages_.matrix.state_values(ctx_, name, ctx_.check_slot(k));
  }
  /// GaLore: the projector of tensor `name` (its rank, side and current projection).
  const auto& projector(std::string_view name) const
    requires projects
  {
    return stages_.matrix.projector_of(ctx_, name);
  }
  /// This rank's part of state slot `k` of tensor `name`, decoded to fp32 (any encoding;
  /// q8 codes read back as map[code] * absmax).
  shard_values local_state_values(std::string_view name, int k) const {
    return stages_.local_values(ctx_, ctx_.index_of(name), ctx_.check_slot(k));
  }
  /// State slot `k` of tensor `name`, decoded to fp32; replicated storage only.
  std::vector<float> state_values(std::string_view name, int k) const {
    return require_whole(name, "state"), local_state_values(name, k).values;
  }
  /// q8: whether tensor `name` keeps 8-bit states (false below min_8bit_size: fp32).
  bool state_is_quantized(std::string_view name) const
    requires is_quantized
  {
    return detail::quantized_tensor(ctx_, ctx_.index_of(name));
  }
  /// q8: this rank's codes of state slot `k` of tensor `name` (`first`: the index of the
  /// first element in the tensor); empty for tensors that keep fp32 states.
  shard_view<const std::uint8_t, memory_space> local_state_codes(std::string_view name, int k) const
    requires is_quantized
  {
    ctx_.check_slot(k);
    const std::size_t i = ctx_.index_of(name);
    if (!detail::quantized_tensor(ctx_, i)) return {};
    return detail::state_part(ctx_, i, k);
  }
  /// q8: the absmax of each block of this rank's part (`first`: the index of the first
  /// block in the tensor, blocks of q8::block elements counted from the tensor's start).
  shard_view<const float, memory_space> local_state_absmax(std::string_view name, int k) const
    requires is_quantized
  {
    const auto codes = local_state_codes(name, k);
    if (codes.values.empty()) return {};
    const auto at = static_cast<std::size_t>(codes.values.data() - ctx_.states_[k].data());
    return {view<const float>(ctx_.absmax_[k].data() + at / q8::block, (codes.values.size() + q8::block - 1) / q8::block),
            codes.first / q8::block};
  }
  /// Layer-wise policies: row state `k` of a factored tensor (e.g. Adafactor's
  /// exp_avg_sq_row), indexed [matrix * rows + row] over this TP rank's rows. Every DP
  /// rank that holds part of the tensor keeps all of it; empty elsewhere and for
  /// unfactored tensors.
  std::span<const float> row_state(std::string_view name, int k) const
    requires is_layerwise
  {
    return stages_.factor_state(ctx_, name, k, Policy::row_states, true);
  }
  /// Layer-wise policies: column state `k` (e.g. exp_avg_sq_col), [matrix * cols + col].
  std::span<const float> col_state(std::string_view name, int k) const
    requires is_layerwise
  {
    return stages_.factor_state(ctx_, name, k, Policy::col_states, false);
  }
  /// The whole flat buffers, padding included (for bulk I/O); not with ZeRO-3 (params) or
  /// ZeRO-2 (grads), where the full buffers exist per bucket only.
  view<param_type> params() {
    if constexpr (zero_stage >= 3)
      throw std::logic_error("distopt::optimizer::params(): with ZeRO-3 the full params exist per bucket only; "
                             "read and write them through gather(names), param(name) and release");
    return {ctx_.params_.data(), ctx_.params_.size()};
  }
  /// The whole grads buffer; not with ZeRO-2 (d > 1), where the grads live per bucket,
  /// nor with gradient accumulation, whose views are zeroed per bucket at their first use.
  view<grad_type> grads() {
    if (zero_stage >= 2)
      throw std::logic_error("distopt::optimizer::grads(): with ZeRO-2 the full grads exist per bucket only; "
                             "write them through grad(name)");
    if (ctx_.options_.micro_batches > 1)
      throw std::logic_error("distopt::optimizer::grads(): with gradient accumulation (micro_batches > 1) each "
                             "bucket's grads are zeroed at their first view of a step or micro-batch; write them "
                             "through grad(name)");
    return {ctx_.grads_.data(), ctx_.grads_.size()};
  }

  /// Hyper-parameters of group `g`.
  const hyper_params& hyper(int g = 0) const { return ctx_.groups_.at(check_group(g)); }
  /// Replaces the hyper-parameters of group `g` (for schedules); validated first.
  void set_hyper(int g, hyper_params h) {
    h.validate();
    if (Policy::state_slots(h) > ctx_.slots_)
      throw std::invalid_argument(std::string(Policy::name) + ": these hyper-parameters need more state than was allocated");
    stages_.check_hyper(ctx_, check_group(g), h);
    ctx_.groups_.at(check_group(g)) = std::move(h);
    ctx_.groups_changed_ = true;  // a device executor copies the groups before the next step
  }
  /// The options in use (a loaded checkpoint's seed among them).
  const optimizer_options& options() const noexcept { return ctx_.options_; }
  /// Number of hyper-parameter groups.
  int group_count() const noexcept { return static_cast<int>(ctx_.groups_.size()); }

  /// Steps taken so far (skipped steps do not count). On a device executor this reads the
  /// device's counter (a synchronisation, when steps were taken since the last read).
  std::int64_t step_count() const { return detail::sync_decisions(ctx_), ctx_.step_; }
  /// step() calls so far, skipped steps included (a checkpoint records it): the loop index
  /// a resumed training loop continues from. No synchronisation.
  std::int64_t step_calls() const noexcept { return ctx_.step_calls_; }
  /// Steps skipped for NaN/Inf grads so far: step_calls() - step_count().
  std::int64_t steps_skipped() const { return step_calls() - step_count(); }
  /// The factor to multiply the loss by before backward (1 without loss scaling). On a
  /// device executor this reads the device's (a synchronisation, as step_count); a kernel
  /// can read it where it lives instead: loss_scale_on_device().
  double loss_scale() const { return detail::loss_scale_of(ctx_); }
  /// The executor and the data-parallel communicator in use.
  Exec& executor() noexcept { return ctx_.exec_; }
  Comm& communicator() noexcept { return ctx_.comm_; }

  /// Adds a model-parallel group (tensor and pipeline parallel ranks that hold different
  /// parts of the model): the global grad norm is then also all-reduced over it, counting
  /// tensors registered with tp_split::none only on TP rank `tp_rank` == 0, so that
  /// tensors every TP rank holds a copy of are counted once. Collective over `group`.
  void set_model_parallel_group(Comm group, int tp_rank) {
    if (tp_rank < 0) throw std::invalid_argument("distopt::optimizer: tp_rank must be >= 0, got " + std::to_string(tp_rank));
    ctx_.check_same_stream(group, "the model-parallel group");
    ctx_.model_parallel_.emplace(std::move(group));
    ctx_.tp_rank_ = tp_rank;
    ctx_.step_skip_host_.clear();
  }
  /// Sets the tensor-parallel group: the ranks holding the other rows or columns of the
  /// tensors registered with tp_split::rows (dim 0 split) or tp_split::cols (last dim
  /// split). Layer-wise statistics of split tensors are summed over it, and so is the
  /// global grad norm unless a model-parallel group was set (then that one counts; it must
  /// contain this group). Every rank of the group must hold the same layout, with its own
  /// part's shapes. Collective over `group`.
  void set_tensor_parallel_group(Comm group) {
    ctx_.check_same_stream(group, "the tensor-parallel group");
    ctx_.tp_.emplace(std::move(group));
    if (!ctx_.model_parallel_) ctx_.tp_rank_ = ctx_.tp_->rank();
    ctx_.step_skip_host_.clear();
    stages_.init_geometry(ctx_);
  }

  /// Sets the expert-parallel group of an optimizer of expert tensors (layout::add_experts):
  /// the ranks that hold the other experts, each as many as this one, the rank of index k
  /// the k-th run of them (mesh::ep and mesh::experts). A joint step then sums the experts'
  /// norm over it (joint_step(dense, experts)), and a checkpoint holds every expert: each
  /// rank's experts are boxes of the logical tensors, which reload on another
  /// expert-parallel size. Over more than one rank the optimizer holds expert tensors only
  /// (a dense tensor would count once per rank). Its own step() then needs no norm (the
  /// norm spans the model: step it by joint_step), and clip_grad_norm is refused.
  void set_expert_parallel_group(Comm group) {
    ctx_.check_same_stream(group, "the expert-parallel group");
    detail::check_experts_held(ctx_.layout_, group.size(), "distopt::optimizer::set_expert_parallel_group",
                               group.rank());
    ctx_.ep_.emplace(std::move(group));
  }

  /// Sets every grad to zero.
  /// ZeRO-2: the buckets' pooled buffers that hold grads are zeroed too, and the
  /// overlap hooks start the step afresh.
  void zero_grad() {
    detail::wait_pending(ctx_);  // a reduction still reading the grads
    ctx_.fill_zero(ctx_.grads_.data(), ctx_.grads_.size());
    if (ctx_.shards_grads())
      for (std::size_t k = 0; k < ctx_.plan_.buckets().size(); ++k)
        if (grad_type* g = ctx_.grad_pool_.of(k)) ctx_.fill_zero(g, ctx_.plan_.buckets()[k].padded());
    detail::next_step_grads(ctx_);
  }
  /// Combines the ranks' grads (all-reduce when replicated, reduce-scatter into the local
  /// shard when sharded; owned buckets: a reduce to each owner of its matrices, blocking).
  /// `clip_grad_norm` and `step` call it when it has not been called
  /// since the last step; call it yourself to control when communication happens. After
  /// it, the grads outside this rank's shard are no longer meaningful (sharded).
  /// With the overlap hooks in use this step, every tensor must have been declared ready:
  /// the buckets they completed are reducing already, and only those are waited for.
  void reduce_grads() { detail::reduce_grads(ctx_); }
  /// Computes the global L2 norm of the (unscaled, reduced) gradients, as
  /// torch.nn.utils.clip_grad_norm_, and makes the next `step()` scale them by
  /// min(1, max_norm / (norm + 1e-6)) inside its fused pass. Returns the norm; a NaN or
  /// Inf norm makes the next step skip. Collective (it reduces the grads first).
  double clip_grad_norm(double max_norm) {
    if (!(max_norm > 0.0) || !std::isfinite(max_norm))
      throw std::invalid_argument("clip_grad_norm: invalid max_norm " + std::to_string(max_norm) +
                                  ": must be a finite value > 0");
    refuse_norm_of_experts("clip_grad_norm");
    const double norm = detail::grad_norm(ctx_);
    ctx_.clip_ = typename context_type::clip_state{norm, detail::clip_coefficient(max_norm, norm)};
    return norm;
  }

  /// What step() returns: a step_result on an executor of host memory; on a device
  /// executor a step_ticket, which reads the step's outcome from the device when asked.
  using step_return = std::conditional_t<host_memory<Exec>, step_result, step_ticket<optimizer>>;

  /// Takes one optimizer step over every tensor. A NaN or Inf gradient on any rank skips
  /// the step on every rank and leaves params and states bit for bit as they were.
  /// Collective. The step is decided in the executor's memory (engine/decide.hpp); on a
  /// device executor nothing is copied between host and device for an element-wise policy,
  /// unless percentile clipping is on, the communicator stages its collectives through host
  /// memory, or (with a communicator of device memory) check_hook_order compares each
  /// bucket's collective through a copy; a layer-wise policy, GaLore and Muon read the
  /// decision on the host (one copy).
  /// No tensor may be gathered (at ZeRO-3 a gathered view would go stale; the check runs
  /// at every stage, so that a loop written for stage 1 works at 3); prefetches still in
  /// flight are dropped.
  step_return step() {
    if (detail::needs_norm(detail::rules_of(ctx_))) refuse_norm_of_experts("step");
    detail::end_param_gathers(ctx_, "step()");
    ++ctx_.step_calls_;
    detail::decide<stages_type::prepares_on_executor>(ctx_);
    return run_decided();
  }
  /// The first half of a step decided on a norm that spans more optimizers than this one
  /// (distopt::joint_step, <distopt/joint_step.hpp>, calls it): reduces the grads and
  /// returns the exact sum of their squares over this optimizer's ranks (DP and TP), summed
  /// over `across` too when given (ranks of the same kind of optimizer that hold other
  /// tensors; by default, the expert-parallel group when one is set). Collective. A part
  /// that is not `computed()` when this optimizer needs no norm.
  norm_part begin_joint_step(Comm* across = nullptr) { return detail::norm_part_of(ctx_, across); }
  /// The second half: the step decided on `total`, every optimizer's part added (the same
  /// on every rank of every optimizer of the joint step). Collective.
  step_return end_joint_step(const norm_part& total) {
    ++ctx_.step_calls_;
    detail::decide_on<stages_type::prepares_on_executor>(ctx_, total);
    return run_decided();
  }
  /// The outcome of step() call `call` (counting from 1): what a step_ticket reads.
  /// Throws std::logic_error when another step has been taken since.
  step_result step_outcome(std::int64_t call) const {
    if (call != ctx_.step_calls_)
      throw std::logic_error("distopt::optimizer: the result of step() call " + std::to_string(call) +
                             " was read after call " + std::to_string(ctx_.step_calls_) +
                             "; read a step's result before the next step()");
    return detail::sync_decisions(ctx_), ctx_.last_result_;
  }
  /// Device executors: the loss scale where it lives, in device memory (one double, updated
  /// by each step), for a kernel that scales the loss without a synchronisation.
  device_span<const double> loss_scale_on_device() {
    static_assert(!host_memory<Exec>, "distopt::optimizer::loss_scale_on_device: for device executors");
    detail::push_decisions(ctx_);
    return {&ctx_.control_.data()->loss_scale, 1};
  }

  /// Sharded storage: all-gathers every rank's shard of the params into every rank's full
  /// params (`step` does it unless gather_params is off). Collective. ZeRO-3: nothing (the
  /// params are gathered per layer by `gather`).
  void gather_params() { detail::gather_params(ctx_); }
  /// Copies this rank's params into its fp32 master weights; done automatically before
  /// the first step, call it again after overwriting params by hand.
  void load_master_from_params() { detail::load_master(ctx_); }

  /// Bytes this rank allocates, by category, and per parameter of the model. Each figure
  /// is the size of an allocation this optimizer holds; the elements that belong to no
  /// tensor (block alignment, shard padding) are counted under "padding".
  distopt::memory_report memory() const { return detail::memory_of(ctx_, stages_); }
  /// The same as memory().
  distopt::memory_report memory_report() const { return memory(); }

  /// Writes a checkpoint into directory `dir` (created if needed): one safetensors file
  /// per rank and index.json, written last; the previous checkpoint there stays loadable
  /// until the new index replaces it. A checkpoint of another optimizer (another policy or
  /// model) there is refused with io::checkpoint_error naming both, unless `replace` is
  /// checkpoint_replace::anything. Collective over the data-parallel group and the
  /// tensor-parallel group. Needs `#include <distopt/checkpoint.hpp>` (xxHash).
  /// `dir`: a std::filesystem::path or anything that converts to one.
  template <class Dir>
  void save(const Dir& dir, checkpoint_replace replace = checkpoint_replace::same_optimizer) {
    if (ctx_.micro_batch_ != 0)
      throw std::logic_error("distopt::optimizer::save: " + std::to_string(ctx_.micro_batch_) + " of " +
                             std::to_string(ctx_.options_.micro_batches) +
                             " micro-batches of this step have been accumulated, and a checkpoint holds no grads; "
                             "save between steps");
    io::checkpoint_files<context_type, stages_type>::save(ctx_, stages_, dir, replace);
  }
  /// Loads the checkpoint in `dir`, written with any number of data-parallel ranks and the
  /// same tensor-parallel size; afterwards steps continue bit for bit as the run that saved
  /// it would have. A missing, corrupt or mismatched checkpoint throws io::checkpoint_error
  /// on every rank and leaves this optimizer as it was. Collective, as save.
  template <class Dir>
  void load(const Dir& dir) {
    io::checkpoint_files<context_type, stages_type>::load(ctx_, stages_, dir);
  }

  /// Layer-wise policies: bytes of statistics this rank has put into all-reduces so far
  /// (over DP and TP; what each collective then sends is the communicator's bytes_sent).
  std::size_t statistics_bytes() const noexcept { return stages_.statistics_bytes(); }

 protected:
  using stages_type = typename detail::stages_of<Policy, Storage, Exec>::type;

  int check_group(int g) const {
    if (g < 0 || g >= group_count())
      throw std::out_of_range(std::string(Policy::name) + ": no hyper-parameter group " + std::to_string(g) +
                              " (there are " + std::to_string(group_count()) + ")");
    return g;
  }
  void require_whole(std::string_view name, const char* what) const {
    if (is_sharded && ctx_.comm_.size() > 1)
      throw std::logic_error("distopt::optimizer: with sharded storage each rank holds part of the " + std::string(what) +
                             " of '" + std::string(name) + "'; use local_" + what);
  }

  /// Throws when this optimizer's experts are spread over an expert-parallel group: its
  /// own norm would leave out the other ranks' experts and the dense tensors.
  void refuse_norm_of_experts(const char* what) const {
    if (ctx_.ep_ && ctx_.ep_->size() > 1)
      throw std::logic_error(std::string("distopt::optimizer::") + what + ": this optimizer's experts are spread over " +
                             "an expert-parallel group, and the global norm (max_grad_norm, check_finite, loss " +
                             "scaling) spans the whole model: step it with the dense one by joint_step(dense, experts)");
  }

  /// The stages of a step just decided, then what every step ends with; its result.
  step_return run_decided() {
    stages_.run(ctx_);
    detail::finish_step(ctx_);
    if constexpr (host_memory<Exec>) return step_outcome(ctx_.step_calls_);
    else return step_ticket<optimizer>(*this, ctx_.step_calls_);
  }

  // What a wrapping optimizer (offload.hpp) reaches: the step's context and stages.
  context_type ctx_;
  stages_type stages_;
};

}  // namespace distopt
