// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The context of an optimizer's step: what its stages (engine/elementwise.hpp,
/// q8.hpp, layerwise.hpp, projection.hpp, orthogonal.hpp) and the functions of the step
/// (collectives.hpp, norm.hpp, decide.hpp, schedule.hpp) read and write. It holds the
/// layout, the hyper-parameter groups and options, the executor and the groups, the shard
/// plan, the flat buffers (params, grads, master weights, state slots) and what the hooks
/// and the step's decisions keep between calls. The optimizer (optimizer.hpp) is the
/// user's view of one context; a stage never sees the optimizer.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../comm/request.hpp"
#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/buffer.hpp"
#include "../detail/exact_sum.hpp"
#include "../detail/layout_check.hpp"
#include "../detail/shard_plan.hpp"
#include "../layout/registry.hpp"
#include "../loss_scaler.hpp"
#include "../options.hpp"
#include "../shard_view.hpp"
#include "../space.hpp"
#include "../step_info.hpp"
#include "../storage/q8_encoding.hpp"
#include "comm_adapter.hpp"
#include "decisions.hpp"
#include "overlap.hpp"
#include "phases.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// Told of each bucket whose params a step has finished (ZeRO-Offload copies it to the
/// device while the host updates the next): a function and its object, empty by default.
struct params_listener {
  void* to = nullptr;
  void (*fn)(void* to, std::size_t bucket) = nullptr;
  explicit operator bool() const noexcept { return fn != nullptr; }
  void operator()(std::size_t bucket) const { fn(to, bucket); }
};

/// Throws the error of a policy whose state_slots() gave `n`, outside min..max.
[[noreturn]] DISTOPT_CORE_FN void throw_slot_count(std::string_view policy, int n, int min, int max);

#if DISTOPT_CORE_BODIES
[[noreturn]] DISTOPT_CORE_FN void throw_slot_count(std::string_view policy, int n, int min, int max) {
  throw std::logic_error(std::string(policy) + ": state_slots() gave " + std::to_string(n) +
                         ", outside the policy's min_state_slots..max_state_slots (" + std::to_string(min) + ".." +
                         std::to_string(max) + ")");
}
#endif  // DISTOPT_CORE_BODIES

/// What a context holds that depends on none of its template arguments: the layout and
/// options, the shard plan, the hooks' bookkeeping, the host's copies of the decisions.
/// Its code (constructor, plan, destructor) is compiled once, not once per optimizer type.
struct context_host {
  struct clip_state {
    double norm, coef;
  };

  context_host(layout tensors, optimizer_options options) : layout_(std::move(tensors)), options_(std::move(options)) {}

  /// The shard plan over `parts` ranks (this one `rank`), and what follows from it alone:
  /// the hooks' bookkeeping, ZeRO-3's gathers, the state table, percentile clipping's
  /// tensors cut across ranks.
  DISTOPT_CORE_FN void make_plan(int parts, int rank, std::size_t chunk_elems, const std::vector<char>& owned);

  layout layout_;
  optimizer_options options_;
  int tp_rank_ = 0;
  int slots_ = 0;
  shard_plan plan_;
  grad_hooks hooks_;       // the overlap hooks' state this step
  param_gathers gathers_;  // ZeRO-3: which tensors are gathered
  state_layout states_at_;
  std::vector<std::array<float, 100>> gnorm_vec_;  // percentile clipping: per tensor
  std::vector<std::size_t> straddlers_;             // percentile clipping: tensors cut across DP ranks
  std::vector<float> clip_scale_;                   // percentile clipping: this step's per tensor
  std::optional<clip_state> clip_;
  // The host's copy of the decisions (engine/mirror.hpp): what control_ and started_dev_
  // held when last read, and what the host sets before the next step pushes it there.
  mutable step_control control_host_;
  mutable bool master_ready_ = false;
  mutable std::int64_t step_ = 0;
  mutable std::vector<bool> state_started_;  // per group: has its state been used yet
  std::int64_t step_calls_ = 0;              // step() calls, skipped ones included
  mutable step_result last_result_;          // the last step's
  mutable bool mirror_stale_ = false;  // the device decided steps the host's copies have not read
  bool decisions_changed_ = true;      // the host's copies changed: push_decisions before the next step
  bool groups_changed_ = true;         // the hyper-parameters changed: idem
  std::vector<unsigned char> step_skip_host_;  // the norm's skipped pieces (TP ranks other than 0)
  bool reduced_ = false;                       // grads reduced since the last step
  int micro_batch_ = 0;  // gradient accumulation: end_micro_batch calls in this step
  // accumulation::reduce_each, per bucket: 1 + the micro-batch whose reduction is in flight
  // and not yet added into the accumulator (0: none).
  std::vector<int> to_accumulate_;
  params_listener params_done_;  // offload, while its step runs: told of each bucket updated
  std::size_t params_told_ = 0;  // buckets params_done_ was told of in this step
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN void context_host::make_plan(int parts, int rank, std::size_t chunk_elems, const std::vector<char>& owned) {
  plan_ = shard_plan(layout_, parts, rank, options_.bucket_elems, chunk_elems, owned);
  gathers_ = param_gathers(plan_.buckets().size(), layout_.tensors().size());
  hooks_ = grad_hooks(plan_, layout_.tensors().size());
  states_at_ = state_layout(plan_.pieces().size(), layout_.tensors().size());
  if (options_.percentile_clipping < 100) {
    gnorm_vec_.assign(layout_.tensors().size(), {});
    for (std::size_t i = 0; i < layout_.tensors().size(); ++i)
      if (plan_.straddles(i)) straddlers_.push_back(i);
  }
}
#endif  // DISTOPT_CORE_BODIES

/// The step's shared state of an optimizer<Policy, Storage, Comm, Exec, Precision>.
template <class Policy, class Storage, class Comm, class Exec, class Precision>
struct context : context_host {
  using policy_type = Policy;
  using hyper_params = typename Policy::hyper_params;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  using state_type = typename Storage::encoding;
  using comm_type = Comm;
  using executor_type = Exec;
  using memory_space = typename Exec::memory_space;
  template <class T>
  using view = span_in<T, memory_space>;
  static constexpr bool is_sharded = Storage::is_sharded;
  static constexpr bool is_quantized = quantized_encoding<state_type>;
  static constexpr bool projects = projects_matrices<Policy>;
  static constexpr bool orthogonalizes = orthogonalizes_matrices<Policy>;
  static constexpr bool is_layerwise = policy_is_layerwise<Policy>;
  static constexpr bool owns_matrices = storage_owns_matrices<Storage>();
  static constexpr int zero_stage = storage_zero_stage<Storage>();
  /// Elements per work item: a multiple of every block size, large enough to amortise a
  /// dispatch, small enough to balance threads.
  static constexpr std::size_t chunk_elems = 1u << 14;
  /// What the state slots' buffers hold: q8's codes of 8-bit tensors, else the encoding.
  using stored_state = std::conditional_t<is_quantized, std::uint8_t, state_type>;
  /// An element state's number type (q8: the fp32 states of small tensors).
  using element_state = std::conditional_t<is_quantized, float, state_type>;

  /// Checks the arguments and makes the plan and the buffers of params, grads and master
  /// weights (the stages make the states'). Collective with more than one rank: the ranks
  /// compare their layouts.
  context(layout tensors, std::vector<hyper_params> groups, optimizer_options options, Exec exec, Comm comm)
      : context_host(std::move(tensors), std::move(options)),
        groups_(std::move(groups)),
        exec_(std::move(exec)),
        comm_(std::move(comm)) {
    for (const auto& h : groups_) h.validate();  // none when there are no groups: checked next
    check_arguments(Policy::name, layout_, dtype_of<param_type>, groups_.size(), options_, is_layerwise, chunk_elems);
    check_same_stream(comm_, "the communicator");
    if (comm_.size() > 1)
      check_layout_agreement(
          static_cast<std::size_t>(comm_.size()),
          [this](std::span<const double> in, std::span<double> out) { comms_.all_gather_host(exec_, comm_, in, out); },
          layout_, "distopt::optimizer");
    if (options_.loss_scale) scaler_ = loss_scaler(*options_.loss_scale);
    for (const auto& h : groups_) {
      const int n = Policy::state_slots(h);
      if (n < min_state_slots_of<Policy>::value || n > Policy::max_state_slots)
        throw_slot_count(Policy::name, n, min_state_slots_of<Policy>::value, Policy::max_state_slots);
      slots_ = std::max(slots_, n);
    }

    const int d = comm_.size();
    make_plan(is_sharded ? d : 1, is_sharded ? comm_.rank() : 0, chunk_elems, owned_tensors());
    in_exec(plan_.pieces(), pieces_dev_);  // the piece table the phases read (device executors)
    std::vector<std::size_t> bucket_sizes;  // each bucket's elements, padded
    for (const auto& b : plan_.buckets()) bucket_sizes.push_back(b.padded());
    const std::size_t largest = bucket_sizes.empty() ? 0 : *std::max_element(bucket_sizes.begin(), bucket_sizes.end());
    params_ = buffer<param_type, Exec>(exec_, shards_params() ? plan_.local_size() : plan_.buffer_size());
    if (shards_params()) {
      param_pool_ = bucket_pool<param_type, Exec>(bucket_sizes);
      param_pending_.resize(plan_.buckets().size());
      param_scope_.resize(plan_.buckets().size());
    }
    if (!shards_grads()) grads_ = buffer<grad_type, Exec>(exec_, plan_.buffer_size());
    else if (!reduces_in_fp32()) grads_ = buffer<grad_type, Exec>(exec_, plan_.local_size());
    if (shards_grads()) grad_pool_ = bucket_pool<grad_type, Exec>(bucket_sizes);
    if (grads_in_fp32()) grads32_ = buffer<float, Exec>(exec_, plan_.local_size());
    if (reduces_in_fp32()) staging_ = buffer<float, Exec>(exec_, largest);
    if (accumulates_each()) to_accumulate_.assign(plan_.buckets().size(), 0);
    if (uses_master()) master_ = buffer<float, Exec>(exec_, plan_.local_size());
  }

  bool uses_master() const noexcept { return !std::is_same_v<param_type, float> && options_.master_weights; }
  bool reduces_in_fp32() const noexcept {
    return !std::is_same_v<grad_type, float> && options_.grad_reduce_in_fp32 && comm_.size() > 1;
  }
  /// Gradient accumulation over micro-batches, reduced after each (accumulation::reduce_each):
  /// the step reads the fp32 accumulator grads32_.
  bool accumulates_each() const noexcept {
    return options_.micro_batches > 1 && options_.accumulate == accumulation::reduce_each;
  }
  /// Whether a bucket's reduction starts in the current micro-batch: always without
  /// accumulation or with reduce_each, with reduce_last only in the step's last one.
  bool reduces_now() const noexcept {
    return options_.micro_batches == 1 || options_.accumulate == accumulation::reduce_each ||
           micro_batch_ >= options_.micro_batches - 1;
  }
  /// True when the step reads its reduced grads from grads32_ (fp32, local index): reduced
  /// in fp32, or accumulated there.
  bool grads_in_fp32() const noexcept { return reduces_in_fp32() || accumulates_each(); }
  /// True when the grads live sharded (ZeRO-2 with more than one rank): the full grads of
  /// a bucket exist only in its pooled buffer, and grads_ holds this rank's shard.
  bool shards_grads() const noexcept { return zero_stage >= 2 && comm_.size() > 1; }
  /// True for ZeRO-3: params_ holds this rank's shard (local index), and a bucket's full
  /// params exist only in its pooled buffer, between gather and release. With one rank
  /// too (the gather is then a copy), so that views behave alike for every d.
  bool shards_params() const noexcept { return zero_stage >= 3; }
  /// Where piece `pc`'s params start in params_.
  std::size_t param_at(const shard_piece& pc) const noexcept { return shards_params() ? pc.local : pc.buffer; }

  /// The reduced grads a step reads, as a pointer to type G (the fp32 shard of
  /// grad_reduce_in_fp32, else the grads) and whether they are indexed by local index
  /// (that shard, ZeRO-2's grads) or by buffer index.
  template <class G>
  bool grads_local() const noexcept {
    return shards_grads() || (std::is_same_v<G, float> && grads_in_fp32());
  }
  /// Calls f(reduced grads) with the pointer type the step reads: the fp32 shard when the
  /// grads were reduced or accumulated in fp32, else the grads themselves.
  template <class F>
  decltype(auto) with_reduced_grads(F&& f) {
    if (grads_in_fp32()) return f(static_cast<const float*>(grads32_.data()));
    return f(static_cast<const grad_type*>(grads_.data()));
  }

  /// `owned` storage: which tensors are placed whole on one rank (the matrices of the
  /// groups the policy projects or orthogonalises; the stages refuse other shapes there).
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

  std::size_t index_of(std::string_view name) const {
    const tensor_slot& t = layout_.find(name);
    return static_cast<std::size_t>(&t - layout_.tensors().data());
  }
  int check_slot(int k) const {
    if (k < 0 || k >= slots_)
      throw std::out_of_range(std::string(Policy::name) + ": state slot " + std::to_string(k) + " does not exist (" +
                              std::to_string(slots_) + " in use)");
    return k;
  }
  /// Each group's state slots in use.
  std::vector<int> group_slots() const {
    std::vector<int> active;
    for (const auto& h : groups_) active.push_back(Policy::state_slots(h));
    return active;
  }

  /// The piece table as the phases read it: in the executor's memory.
  const shard_piece* exec_pieces() const noexcept {
    if constexpr (host_memory<Exec>) return plan_.pieces().data();
    else return pieces_dev_.data();
  }
  /// `v` where a launch can read it: its own data in host memory, else a copy in `dev`
  /// (grown as needed).
  template <class T>
  const T* in_exec(const std::vector<T>& v, buffer<T, Exec>& dev) {
    static_assert(std::is_trivially_copyable_v<T>, "distopt: what a launch reads is copied byte for byte");
    if constexpr (host_memory<Exec>) {
      return v.data();
    } else {
      if (dev.size() < v.size()) dev = buffer<T, Exec>(exec_, v.size());
      copy_bytes(exec_, dev.data(), v.data(), v.size() * sizeof(T));
      return dev.data();
    }
  }

  /// (A host would keep a pointer into a temporary.)
  template <class T>
  const T* in_exec(std::vector<T>&&, buffer<T, Exec>&) = delete;
  /// `v` copied into `b` in the executor's memory (grown as needed), on every executor:
  /// what a later launch reads, or writes for the host to read back.
  template <class T>
  T* to_exec(const std::vector<T>& v, buffer<T, Exec>& b) {
    static_assert(std::is_trivially_copyable_v<T>, "distopt: what a launch reads is copied byte for byte");
    if (b.size() < v.size()) b = buffer<T, Exec>(exec_, v.size());
    copy_bytes(exec_, b.data(), v.data(), v.size() * sizeof(T));
    return b.data();
  }

  template <class T>
  void fill_zero(T* p, std::size_t n) {
    detail::fill_zero(exec_, p, n, chunk_elems);
  }

  std::vector<hyper_params> groups_;
  mutable Exec exec_;  // a handle: const reads of device memory copy through it
  // The communicators before every buffer: a stream one owns (nccl) outlives the buffers
  // freed on it.
  Comm comm_;
  std::optional<Comm> model_parallel_;
  std::optional<Comm> tp_;  // the tensor-parallel group (set_tensor_parallel_group)
  std::optional<Comm> ep_;  // the expert-parallel group (set_expert_parallel_group)
  comm_adapter<Comm, Exec> comms_;  // how collectives reach host and executor memory
  mutable std::optional<loss_scaler> scaler_;  // on a device executor, a copy of the device's (sync_decisions)
  buffer<param_type, Exec> params_;
  buffer<grad_type, Exec> grads_;
  buffer<float, Exec> grads32_;  // reduced fp32 grads of this rank's shard (grad_reduce_in_fp32)
  bucket_pool<grad_type, Exec> grad_pool_;  // ZeRO-2: the buckets' full grads during backward
  bucket_pool<param_type, Exec> param_pool_;  // ZeRO-3: the buckets' full params while gathered
  buffer<float, Exec> staging_;  // one bucket of grads converted to fp32 for the reduction
  buffer<float, Exec> master_;
  // The states (engine/state_layout.hpp says which piece's slot lies where, the stages lay
  // them out): each slot's buffer (q8: the codes of 8-bit tensors), q8's absmax per block
  // and fp32 states of small tensors, Muon's momentum of its matrices.
  std::array<buffer<stored_state, Exec>, 4> states_;
  std::array<buffer<float, Exec>, 4> absmax_, small_;
  buffer<element_state, Exec> momentum_;
  // The piece table (device executors; a host's read plan_'s) and the per-step inputs the
  // phases read, in the executor's memory.
  buffer<shard_piece, Exec> pieces_dev_;
  buffer<typename Policy::scalars, Exec> step_scalars_;
  buffer<int, Exec> step_slots_;
  buffer<float, Exec> step_clip_scale_;
  buffer<unsigned char, Exec> step_skip_;
  buffer<exact_sum, Exec> step_sums_;
  // The step's decisions (engine/decisions.hpp): its control, each group's hyper-parameters,
  // slot count, started flag and scalars, the norm's wire image, in the executor's memory.
  buffer<step_control, Exec> control_;
  buffer<hyper_params, Exec> groups_dev_;
  buffer<unsigned char, Exec> started_dev_;
  buffer<double, Exec> norm_wire_;
  // Per bucket: what its collective in flight holds open (the emulated device's memory)
  // until it is waited for. Declared before pending_, so that it is destroyed after the
  // requests, which wait for their collectives.
  std::vector<collective_hold<Exec>> in_flight_;
  std::vector<comm_request> pending_;  // per bucket: its collective in flight (async communicators)
  std::vector<collective_hold<Exec>> param_scope_;  // ZeRO-3, per bucket: what its prefetch holds open
  std::vector<comm_request> param_pending_;         // ZeRO-3, per bucket: its prefetch in flight
};

}  // namespace distopt::detail
