// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file ZeRO-Offload: `optimizer<Policy, Storage, Comm, offload<Device>, Precision>` keeps
/// the params and grads a training code reads and writes in a device executor's memory,
/// and the master weights and optimizer states in host memory, stepped by `cpu`.
///
/// It is the host optimizer `optimizer<Policy, Storage, Comm, cpu, Precision>` (every
/// policy, storage, ZeRO stage and encoding it runs, with its exact norm, clipping, loss
/// scaling and checkpoints) plus device views of its params and grads, and copies between
/// the two at the overlap hooks:
///  - `grads_ready(names)` copies those tensors' grads to the host and hands them to the
///    host optimizer's hook, so that a bucket's reduction (on the host communicator)
///    starts while backward goes on; `step()` copies what no hook copied. On a device that
///    copies asynchronously (copies_async: cuda, emulated_device) grads_ready only starts
///    the copies, after the kernels enqueued so far (cuda: on the device's copy stream), and
///    returns: the device runs backward's next kernels meanwhile. The next hook call (or
///    `step()`, reduce_grads, clip_grad_norm, save) waits for them and hands the tensors to
///    the host optimizer first, so the host's collectives keep the calls' order on every
///    rank; an error the host finds in a hook (a layer order that differs between ranks)
///    surfaces at that next call;
///  - stages 0-2: the host step reports each bucket whose params are final (updated, and
///    gathered where sharded), and its copy to the device starts at once, so that on a
///    device that copies asynchronously it runs while the host updates the next bucket;
///    `step()` returns once every copy is done. At ZeRO-3 `gather(names)` copies the
///    host's gathered params into a pooled device buffer per tensor and `release` hands it
///    back;
///  - at ZeRO-2 and ZeRO-3 a tensor's device grads are a pooled buffer lent at its first
///    view in a step (zeroed, as the host optimizer's buckets are) and returned once
///    copied.
/// The results are the host optimizer's, bit for bit: the device only holds copies.
///
/// Where the device can page-lock host memory (cuda), the host memory those copies read and
/// write is registered for the optimizer's life (exec/offload.hpp, host_registration).
///
/// Writes into a device param view reach the optimizer before the first `step()` or `save`
/// (the initial params: stages 0-2 copy every device param to the host then), and through
/// `release(names, keep_writes)` at any stage, followed by `load_master_from_params()` where
/// there are master weights (as on the host); any other write after the first step is
/// overwritten by the next step's params. `load` copies the loaded params to the device.
/// The device grads are this rank's own, never the reduced ones, and a view refuses once
/// they were copied (reduce_grads, clip_grad_norm): zero them each step. `step()` returns
/// the step_result itself: the host has stepped when it returns.
///
/// Gradient accumulation (options.micro_batches > 1) keeps the host optimizer's rules on
/// the device: a tensor's device grads are zero at its first view of a step
/// (accumulation::reduce_last: the micro-batches add up on the device, and only the last
/// one's are copied to the host) or of a micro-batch (reduce_each: each micro-batch's are
/// copied, by its hooks or by end_micro_batch, and the host reduces and accumulates them).
///
/// The communicator is the host optimizer's: a host one (single, threads, mpi, any_comm).
/// DeepSpeed reduces on the device first and copies 1/d of the grads; here each rank copies
/// its whole grads to the host, which a communicator of device memory would avoid (not
/// built yet).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "concepts.hpp"
#include "detail/buffer.hpp"
#include "engine/phases.hpp"
#include "exec/cpu.hpp"
#include "exec/offload.hpp"
#include "exec/transfer.hpp"
#include "optimizer.hpp"

namespace distopt {

/// ZeRO-Offload (see the file comment): the host optimizer on `cpu`, with the params and
/// grads a training code sees in `Device` memory. Everything that reads or writes only
/// the master weights and states (state views, hyper-parameters, save, step_count) is the
/// host optimizer's, and `host()` gives it whole.
template <class Policy, class Storage, class Comm, class Device, class Precision>
class optimizer<Policy, Storage, Comm, offload<Device>, Precision>
    : private optimizer<Policy, Storage, Comm, cpu, Precision> {
  static_assert(!collectives_in_device_memory<Comm>,
                "distopt::offload: the grads are reduced on the host, by the host optimizer's communicator: use "
                "single, threads, mpi or any_comm (not nccl)");

 public:
  using host_optimizer = optimizer<Policy, Storage, Comm, cpu, Precision>;
  using typename host_optimizer::policy_type;
  using typename host_optimizer::hyper_params;
  using typename host_optimizer::param_type;
  using typename host_optimizer::grad_type;
  using typename host_optimizer::state_type;
  using host_optimizer::is_sharded;
  using host_optimizer::is_quantized;
  using host_optimizer::is_layerwise;
  using host_optimizer::projects;
  using host_optimizer::orthogonalizes;
  using host_optimizer::owns_matrices;
  using host_optimizer::zero_stage;
  using comm_type = Comm;
  using executor_type = offload<Device>;
  /// The memory of the params and grads (the device's); the states' views are host spans.
  using memory_space = typename Device::memory_space;
  template <class T>
  using view = span_in<T, memory_space>;

  /// As the host optimizer's constructors; `exec` holds the cpu and the device. Collective
  /// with more than one rank.
  optimizer(layout tensors, std::vector<hyper_params> groups, optimizer_options options = {},
            offload<Device> exec = offload<Device>{}, Comm comm = Comm{})
      : host_optimizer(std::move(tensors), std::move(groups), options, exec.host(), std::move(comm)),
        exec_(std::move(exec)) {
    const auto& ts = host().tensors().tensors();
    lent_grads_.assign(ts.size(), nullptr);
    lent_params_.assign(ts.size(), nullptr);
    ready_.assign(ts.size(), false);
    viewed_.assign(ts.size(), false);
    if constexpr (zero_stage < 3) {
      const auto all = host().params();
      params_ = detail::buffer<param_type, Device>(exec_.device(), all.size());
      for (const auto& t : ts) param_at_.push_back(static_cast<std::size_t>(host().param(t.name).data() - all.data()));
    }
    if constexpr (zero_stage < 2) {  // laid out as the host's grads (not through its views, which zero)
      grads_ = detail::buffer<grad_type, Device>(exec_.device(), this->ctx_.grads_.size());
      for (std::size_t i = 0; i < ts.size(); ++i) grad_at_.push_back(this->ctx_.plan_.tensor_buffer(i));
    }
    if (options.pin_host_buffers) {  // the buffers every step copies whole; the pools' at their first copy
      pinned_ = detail::host_registration<Device>(exec_.device());
      if constexpr (zero_stage < 3) pinned_.add(host().params().data(), host().params().size_bytes(), "params");
      if constexpr (zero_stage < 2) pinned_.add(this->ctx_.grads_.data(), this->ctx_.grads_.bytes(), "grads");
    }
  }
  /// One hyper-parameter group for every tensor.
  optimizer(layout tensors, hyper_params hyper, optimizer_options options = {},
            offload<Device> exec = offload<Device>{}, Comm comm = Comm{})
      : optimizer(std::move(tensors), std::vector<hyper_params>{std::move(hyper)}, std::move(options),
                  std::move(exec), std::move(comm)) {}
  optimizer(optimizer&&) = default;
  /// Takes `o`'s place. What this optimizer held goes first, in the destructor's order:
  /// its copies in flight waited for, then its host registrations ended, then its buffers
  /// freed (a member-wise assignment would free the host's buffers first, its base).
  optimizer& operator=(optimizer&& o) {
    if (this == &o) return *this;
    { const optimizer gone(std::move(*this)); }
    host() = std::move(o.host());
    exec_ = std::move(o.exec_);
    params_ = std::move(o.params_);
    grads_ = std::move(o.grads_);
    param_at_ = std::move(o.param_at_);
    grad_at_ = std::move(o.grad_at_);
    grad_pool_ = std::move(o.grad_pool_);
    param_pool_ = std::move(o.param_pool_);
    lent_grads_ = std::move(o.lent_grads_);
    lent_params_ = std::move(o.lent_params_);
    ready_ = std::move(o.ready_);
    viewed_ = std::move(o.viewed_);
    any_ready_ = o.any_ready_;
    pushed_ = o.pushed_;
    params_on_host_ = o.params_on_host_;
    in_flight_ = std::move(o.in_flight_);
    pinned_ = std::move(o.pinned_);
    fence_ = std::move(o.fence_);
    return *this;
  }

  /// The host optimizer: its params, grads, master weights and states in host memory. For
  /// reading; stepping it, or writing its params or grads, bypasses the copies to and from
  /// the device (the device views then differ from it until the next step or load).
  host_optimizer& host() noexcept { return *this; }
  const host_optimizer& host() const noexcept { return *this; }
  offload<Device>& executor() noexcept { return exec_; }

  using host_optimizer::tensors;
  using host_optimizer::master;
  using host_optimizer::local_master;
  using host_optimizer::local_state_values;
  using host_optimizer::state_values;
  using host_optimizer::hyper;
  using host_optimizer::set_hyper;
  using host_optimizer::group_count;
  using host_optimizer::options;
  using host_optimizer::step_count;
  using host_optimizer::step_calls;
  using host_optimizer::steps_skipped;
  using host_optimizer::loss_scale;
  using host_optimizer::statistics_bytes;
  using host_optimizer::set_model_parallel_group;
  using host_optimizer::set_tensor_parallel_group;
  using host_optimizer::set_expert_parallel_group;
  using host_optimizer::communicator;
  using host_optimizer::state;
  using host_optimizer::local_state;
  using host_optimizer::local_state_codes;
  using host_optimizer::local_state_absmax;
  using host_optimizer::state_is_quantized;
  using host_optimizer::row_state;
  using host_optimizer::col_state;
  using host_optimizer::projected_state;
  using host_optimizer::projector;

  /// The device params of tensor `name`. ZeRO-3: between gather and release only.
  view<param_type> param(std::string_view name) {
    const std::size_t i = index_of(name);
    if constexpr (zero_stage >= 3) {
      if (!lent_params_[i])
        throw std::logic_error("distopt::optimizer<offload>::param('" + std::string(name) +
                               "'): with ZeRO-3 a tensor's params exist in full only between gather and release; "
                               "gather it first");
      return {lent_params_[i], numel(i)};
    } else {
      return {params_.data() + param_at_[i], numel(i)};
    }
  }
  /// The device grads of tensor `name`: write each step's gradient here before `step()` or
  /// `grads_ready(name)`. ZeRO-2 and ZeRO-3: zero at the first view of a step, and valid
  /// until the tensor's grads_ready (or the step). Gradient accumulation, at every stage:
  /// zero at the first view of a step (reduce_last) or of a micro-batch (reduce_each).
  view<grad_type> grad(std::string_view name) {
    const std::size_t i = index_of(name);
    if (ready_[i])
      throw std::logic_error("distopt::optimizer<offload>::grad('" + std::string(name) +
                             "'): its grads were declared ready in this step and copied to the host; write a "
                             "tensor's grads before its grads_ready");
    if (pushed_)
      throw std::logic_error("distopt::optimizer<offload>::grad('" + std::string(name) +
                             "'): this step's grads were copied to the host (reduce_grads, clip_grad_norm); the "
                             "next step's grads are written after step()");
    if constexpr (zero_stage >= 2) {
      if (!lent_grads_[i]) {
        bool fresh = false;
        lent_grads_[i] = grad_pool_.lend(exec_.device(), numel(i), fresh);
        detail::fill_zero(exec_.device(), lent_grads_[i], numel(i));
      }
      return {lent_grads_[i], numel(i)};
    } else {
      if (accumulating() && !viewed_[i]) detail::fill_zero(exec_.device(), grads_.data() + grad_at_[i], numel(i));
      viewed_[i] = true;
      return {grads_.data() + grad_at_[i], numel(i)};
    }
  }
  /// The whole device params buffer, laid out as the host optimizer's params(); not at ZeRO-3.
  view<param_type> params() {
    if constexpr (zero_stage >= 3)
      throw std::logic_error("distopt::optimizer<offload>::params(): with ZeRO-3 the device holds gathered "
                             "tensors only; read and write them through gather(names), param(name) and release");
    return {params_.data(), params_.size()};
  }
  /// The whole device grads buffer; not at ZeRO-2 and ZeRO-3 (pooled per tensor), nor with
  /// gradient accumulation (a tensor's grads are zeroed at its first view).
  view<grad_type> grads() {
    if constexpr (zero_stage >= 2)
      throw std::logic_error("distopt::optimizer<offload>::grads(): with ZeRO-2 and ZeRO-3 the device grads are "
                             "lent per tensor; write them through grad(name)");
    if (accumulating())
      throw std::logic_error("distopt::optimizer<offload>::grads(): with gradient accumulation (micro_batches > 1) "
                             "each tensor's grads are zeroed at its first view; write them through grad(name)");
    return {grads_.data(), grads_.size()};
  }

  /// Overlap hook: copies the grads of `names` to the host and declares them ready there
  /// (the host optimizer's grads_ready: complete buckets start reducing). Naming a tensor
  /// twice in one step (micro-batch) throws, naming it. Accumulating with reduce_last,
  /// before the last micro-batch: declares them ready there only (nothing is copied).
  void grads_ready(const tensor_names& names) {
    if (pushed_)
      throw std::logic_error("distopt::optimizer<offload>::grads_ready: this step's grads were already copied to "
                             "the host and reduced (reduce_grads, clip_grad_norm)");
    std::vector<std::size_t> is;  // every name checked before anything is copied or marked
    for (std::string_view name : names) {
      const std::size_t i = index_of(name);
      if (ready_[i] || std::find(is.begin(), is.end(), i) != is.end())
        throw std::logic_error("distopt::optimizer<offload>::grads_ready('" + std::string(name) +
                               "'): declared ready twice in one step");
      is.push_back(i);
    }
    if (!copies_now()) {  // they add up on the device until the last micro-batch
      hand_over();
      host().grads_ready(names);
    } else if constexpr (copies_async<Device>) {
      hand_over();
      in_flight entry;
      entry.tensors = is;
      for (const std::size_t i : is) {
        entry.names.push_back(name_of(i));
        entry.ticket = std::max(entry.ticket, push_grad(i, true));
      }
      in_flight_.push_back(std::move(entry));
    } else {
      for (const std::size_t i : is) push_grad(i, false);
      host().grads_ready(names);
      if constexpr (zero_stage >= 2)
        for (const std::size_t i : is) return_grad(i);
    }
    for (const std::size_t i : is) ready_[i] = true;
    any_ready_ = any_ready_ || !is.empty();
  }
  /// grads_ready calls whose copies to the host were started and not yet handed to the host
  /// optimizer (at most the last one, on a device that copies asynchronously; else 0).
  std::size_t grads_in_flight() const noexcept { return in_flight_.size(); }
  /// The full params of `names` until `release`. ZeRO-3: the host optimizer's gather, then
  /// a copy into a pooled device buffer per tensor. Other stages: bookkeeping.
  void gather(const tensor_names& names) {
    hand_over();
    for (std::string_view name : names) {
      host().gather(name);
      if constexpr (zero_stage >= 3) {
        const std::size_t i = index_of(name);
        const auto from = host().param(name);
        pin_pooled(detail::param_buffer_of(this->ctx_, i), "param bucket buffer");
        bool fresh = false;
        lent_params_[i] = param_pool_.lend(exec_.device(), from.size(), fresh);
        detail::copy_bytes(exec_, lent_params_[i], from.data(), from.size_bytes());
      }
    }
  }
  /// Starts the host optimizer's gathers of `names` early (ZeRO-3).
  void prefetch(const tensor_names& names) {
    hand_over();
    host().prefetch(names);
  }
  /// Ends the gathers of `names`; what was written into the device params is dropped at ZeRO-3.
  void release(const tensor_names& names) { release_names(names, false); }
  /// As release, but what was written into the device params of `names` is copied to the
  /// host optimizer, which keeps it (this rank's shard at ZeRO-3).
  void release(const tensor_names& names, keep_writes_t) { release_names(names, true); }

  /// Gradient accumulation: this micro-batch's backward is done (the host optimizer's
  /// end_micro_batch). With reduce_each, and after the last micro-batch, first copies the
  /// grads no hook copied to the host.
  void end_micro_batch() {
    hand_over();
    const bool copy = copies_now(), last = host().micro_batch() + 1 >= host().options().micro_batches;
    if (copy && !pushed_)
      for (std::size_t i = 0; i < ready_.size(); ++i)
        if (!ready_[i]) push_grad(i, false);
    host().end_micro_batch();
    if (last) {
      pushed_ = pushed_ || copy;  // the step's grads are on the host
      return;
    }
    ready_.assign(ready_.size(), false);
    if (copy) {  // reduce_each: the next micro-batch's grads start from zero
      return_grads();
      viewed_.assign(viewed_.size(), false);
    }
  }
  /// Micro-batches ended in this step (the host optimizer's).
  int micro_batch() const noexcept { return host().micro_batch(); }

  /// Zeroes the device grads (the lent ones at ZeRO-2 and ZeRO-3) and the host optimizer's.
  void zero_grad() {
    drop_in_flight();
    host().zero_grad();
    if constexpr (zero_stage < 2) detail::fill_zero(exec_.device(), grads_.data(), grads_.size());
    else
      for (std::size_t i = 0; i < lent_grads_.size(); ++i)
        if (lent_grads_[i]) detail::fill_zero(exec_.device(), lent_grads_[i], numel(i));
    next_step();
  }
  /// Copies the grads that no hook copied to the host and reduces them there.
  void reduce_grads() {
    on_host([&] { host().reduce_grads(); });
  }
  /// As the host optimizer's, after copying the grads that no hook copied.
  double clip_grad_norm(double max_norm) {
    double norm = 0;
    on_host([&] { norm = host().clip_grad_norm(max_norm); });
    return norm;
  }
  /// Copies the grads that no hook copied to the host (before the first step, the device
  /// params too) and steps the host optimizer; stages 0-2 copy each bucket of updated
  /// params to the device as the host finishes it, and return when all are there.
  step_result step() {
    return step_by([this] { return host().step(); });
  }
  /// What step() returns (the host has stepped when it returns).
  using step_return = step_result;
  /// The halves of a step decided on a norm over more optimizers (distopt::joint_step), as
  /// the host optimizer's: the first copies the grads that no hook copied to the host and
  /// returns the host's part of the norm; the second steps as step() does.
  norm_part begin_joint_step(Comm* across = nullptr) {
    norm_part part;
    on_host([&] { part = host().begin_joint_step(across); });
    return part;
  }
  step_result end_joint_step(const norm_part& total) {
    return step_by([&] { return host().end_joint_step(total); });
  }

  /// Loads a checkpoint into the host optimizer (as its load) and copies its params to the device.
  template <class Dir>
  void load(const Dir& dir) {
    drop_in_flight();
    host().load(dir);  // drops the host's step grads and hooks: so do the device's
    params_on_host_ = true;
    if constexpr (zero_stage < 3) copy_params(false);
    return_grads();
    next_step();
  }
  /// Writes a checkpoint (the host optimizer's save); before the first step, stages 0-2
  /// copy the device params to the host first, so that the initial params are saved.
  template <class Dir>
  void save(const Dir& dir, checkpoint_replace replace = checkpoint_replace::same_optimizer) {
    hand_over();
    if constexpr (zero_stage < 3)
      if (!params_on_host_) copy_params(true);
    host().save(dir, replace);
  }
  /// Copies the params to the host (stages 0-2: all of them; ZeRO-3: release(names,
  /// keep_writes) did) and into the master weights: after params were overwritten by hand.
  void load_master_from_params() {
    if constexpr (zero_stage < 3) copy_params(true);
    host().load_master_from_params();
  }
  /// Sharded storage with options.gather_params off: the host's all-gather of the params
  /// (as its gather_params), then the params to the device.
  void gather_params() {
    host().gather_params();
    if constexpr (zero_stage < 3) copy_params(false);
  }

  /// The host optimizer's report, plus the device's bytes: "device params" (stages 0-2),
  /// "device grads" (stages 0-1), and the pools, "device grad buffers (pool)" and "device
  /// param buffers (pool)". Entries not named "device ..." are host memory.
  distopt::memory_report memory() const {
    distopt::memory_report r = host().memory();
    if (params_.bytes()) r.entries.push_back({"device params", params_.bytes()});
    if (grads_.bytes()) r.entries.push_back({"device grads", grads_.bytes()});
    if (grad_pool_.bytes()) r.entries.push_back({"device grad buffers (pool)", grad_pool_.bytes()});
    if (param_pool_.bytes()) r.entries.push_back({"device param buffers (pool)", param_pool_.bytes()});
    return r;
  }
  distopt::memory_report memory_report() const { return memory(); }

 private:
  std::size_t index_of(std::string_view name) const { return this->ctx_.index_of(name); }
  bool accumulating() const noexcept { return host().options().micro_batches > 1; }
  /// Whether this micro-batch's grads go to the host: always, but with reduce_last only in
  /// the step's last micro-batch (the earlier ones add up on the device).
  bool copies_now() const noexcept {
    return !accumulating() || host().options().accumulate == accumulation::reduce_each ||
           host().micro_batch() + 1 >= host().options().micro_batches;
  }
  std::size_t numel(std::size_t i) const { return host().tensors().tensors()[i].numel; }
  const std::string& name_of(std::size_t i) const { return host().tensors().tensors()[i].name; }

  /// Tensor i's device grads into the host optimizer's (at ZeRO-2 and ZeRO-3, a tensor
  /// never viewed in this step has zero grads: the host's view of it is zero already).
  /// `async` (devices that copy asynchronously): the copy is started and its ticket
  /// returned (0: nothing to copy), for hand_over.
  std::uint64_t push_grad(std::size_t i, bool async) {
    const auto to = host().grad(name_of(i));
    const grad_type* from = zero_stage >= 2 ? lent_grads_[i] : grads_.data() + grad_at_[i];
    if (!from) return 0;
    if (zero_stage < 2 && accumulating() && !viewed_[i]) return 0;  // not viewed: zero, as the host's view
    if constexpr (zero_stage >= 2) pin_pooled(detail::grad_buffer_of(this->ctx_, i), "grad bucket buffer");
    return start_copy(to.data(), from, to.size_bytes(), async);
  }
  /// Copies `bytes` between host and device memory: with `async`, on a device that copies
  /// asynchronously, started beside its work (the fence records it) and its ticket
  /// returned; else made before it returns (0).
  std::uint64_t start_copy(void* to, const void* from, std::size_t bytes, bool async) {
    if constexpr (copies_async<Device>) {
      if (async && bytes > 0) {
        const std::uint64_t t = exec_.device().copy_async(to, from, bytes);
        fence_.started(exec_.device(), t);
        return t;
      }
    }
    detail::copy_bytes(exec_, to, from, bytes);
    return 0;
  }
  /// Stages 0-2, for one step(): copies each bucket of params to the device when the host
  /// step reports it final (detail::params_listener), asynchronously where the device can,
  /// so that the copy of one bucket runs while the host updates the next. `rest` copies
  /// the buckets not reported (every one in a skipped step: the device keeps the host's
  /// params) and waits for all. Gone without it (the step threw), it stops listening and
  /// waits for the copies started.
  class param_sender {
   public:
    explicit param_sender(optimizer& o) : o_(o) {
      o_.ctx_.params_done_ = {this, &param_sender::told};
    }
    param_sender(const param_sender&) = delete;
    param_sender& operator=(const param_sender&) = delete;
    ~param_sender() {
      o_.ctx_.params_done_ = {};
      o_.fence_.wait();
    }
    void rest() {
      for (std::size_t k = sent_, n = o_.ctx_.plan_.buckets().size(); k < n; ++k) send(k);
      if (last_ != 0) o_.exec_.device().copy_wait(std::exchange(last_, 0));  // may throw, unlike the fence
    }

   private:
    static void told(void* self, std::size_t k) { static_cast<param_sender*>(self)->send(k); }
    void send(std::size_t k) {  // the host tells buckets 0, 1, ... in order: [0, sent_) are sent
      const auto& b = o_.ctx_.plan_.buckets()[k];  // its params in the full buffer, padding included
      const std::size_t at = b.buffer_begin, n = b.padded();
      sent_ = k + 1;
      if (n == 0) return;
      if (const std::uint64_t t = o_.start_copy(o_.params_.data() + at, o_.host().params().data() + at,
                                                n * sizeof(param_type), true))
        last_ = t;
    }
    optimizer& o_;
    std::size_t sent_ = 0;
    std::uint64_t last_ = 0;  // the last copy started (0: none)
  };

  /// Waits for the copies the last grads_ready started and hands its tensors to the host
  /// optimizer (its grads_ready): at the next hook, or at step, reduce_grads,
  /// clip_grad_norm or save. So every rank's host optimizer sees its hooks, and issues its
  /// collectives, in the order of the calls, whatever the copies' timing, and an error it
  /// finds in a hook (a layer order that differs between ranks) surfaces one call later.
  void hand_over() {
    while (!in_flight_.empty()) {
      const in_flight done = std::move(in_flight_.front());
      in_flight_.pop_front();
      if (done.ticket != 0) exec_.device().copy_wait(done.ticket);
      if constexpr (zero_stage >= 2)
        for (const std::size_t i : done.tensors) return_grad(i);  // read by its copy: free again
      host().grads_ready(tensor_names(done.names));
    }
  }
  /// Waits for the copies in flight and forgets them (zero_grad, load: the host drops the
  /// step's hooks too).
  void drop_in_flight() {
    fence_.wait();
    in_flight_.clear();
  }
  /// ZeRO-2 and 3: registers a host pool buffer that a copy is about to read or write,
  /// unless it is registered already (nothing with pin_host_buffers off). The pool keeps it
  /// for the optimizer's life, and `pinned_` is destroyed first.
  void pin_pooled(std::pair<void*, std::size_t> buffer, const char* what) {
    if (!pinned_.holds(buffer.first)) pinned_.add(buffer.first, buffer.second, what);
  }
  /// Copies the grads no hook copied, then runs f (the host's reduce, clip or step); if f
  /// throws, they count as not copied, so that the step can go on once the cause is mended
  /// (a grads_ready missing, a tensor still gathered).
  template <class F>
  void on_host(F&& f) {
    hand_over();
    const bool pushing = !pushed_;
    push_grads();
    try {
      f();
    } catch (...) {
      if (pushing) pushed_ = false;
      throw;
    }
  }
  /// step() with `host_step` as the host optimizer's step: stages 0-2 copy each bucket of
  /// updated params to the device as the host finishes it, and return when all are there.
  template <class HostStep>
  step_result step_by(HostStep&& host_step) {
    step_result r;
    if constexpr (zero_stage < 3) {
      if (!params_on_host_) copy_params(true);
      param_sender send(*this);
      on_host([&] { r = host_step(); });
      send.rest();
    } else {
      on_host([&] { r = host_step(); });
    }
    params_on_host_ = true;
    return_grads();
    next_step();
    return r;
  }
  /// Every grad no hook copied, in one copy at stages 0-1 when no hook ran.
  void push_grads() {
    if (pushed_) return;
    if (zero_stage < 2 && !any_ready_ && !accumulating()) {  // host().grads(): not accumulating
      const auto to = host().grads();
      detail::copy_bytes(exec_, to.data(), grads_.data(), to.size_bytes());
    } else {
      for (std::size_t i = 0; i < ready_.size(); ++i)
        if (!ready_[i]) push_grad(i, false);
    }
    pushed_ = true;
  }
  void return_grad(std::size_t i) {
    if (!lent_grads_[i]) return;
    grad_pool_.give_back(lent_grads_[i]);
    lent_grads_[i] = nullptr;
  }
  /// Stages 2-3: every lent grad buffer back to the pool (after a step or a load).
  void return_grads() {
    if constexpr (zero_stage >= 2)
      for (std::size_t i = 0; i < lent_grads_.size(); ++i) return_grad(i);
  }
  /// Stages 0-2: every param, device to host (`to_host`) or back, in one copy.
  void copy_params(bool to_host) {
    const auto h = host().params();
    if (to_host) detail::copy_bytes(exec_, h.data(), params_.data(), h.size_bytes());
    else detail::copy_bytes(exec_, params_.data(), h.data(), h.size_bytes());
  }
  void release_names(const tensor_names& names, bool keep) {
    hand_over();
    for (std::string_view name : names) {
      const std::size_t i = index_of(name);
      if constexpr (zero_stage >= 3) {
        if (keep) {  // into the host's gathered view (which throws unless gathered), then its shard
          const auto to = host().param(name);
          detail::copy_bytes(exec_, to.data(), lent_params_[i], to.size_bytes());
          host().release(name, keep_writes);
        } else {
          host().release(name);
        }
        param_pool_.give_back(lent_params_[i]);
        lent_params_[i] = nullptr;
      } else {  // the host's bookkeeping first (it throws unless gathered), then the copy
        if (keep) {
          host().release(name, keep_writes);
          const auto to = host().param(name);
          detail::copy_bytes(exec_, to.data(), params_.data() + param_at_[i], to.size_bytes());
        } else {
          host().release(name);
        }
      }
    }
  }
  void next_step() {
    ready_.assign(ready_.size(), false);
    viewed_.assign(viewed_.size(), false);
    any_ready_ = false;
    pushed_ = false;
  }

  // Every member is assigned by hand in the move assignment: add new ones there too.
  offload<Device> exec_;
  detail::buffer<param_type, Device> params_;  // stages 0-2: laid out as host().params()
  detail::buffer<grad_type, Device> grads_;    // stages 0-1: laid out as host().grads()
  std::vector<std::size_t> param_at_, grad_at_;
  detail::buffer_pool<grad_type, Device> grad_pool_;  // stages 2-3: each tensor's device grads, lent per step
  detail::buffer_pool<param_type, Device> param_pool_;  // stage 3: each gathered tensor's device params
  std::vector<grad_type*> lent_grads_;
  std::vector<param_type*> lent_params_;
  std::vector<bool> ready_;
  std::vector<bool> viewed_;  // stages 0-1, accumulating: the device grads viewed (zeroed) in this step (micro-batch)
  bool any_ready_ = false;  // a grads_ready ran in this step
  bool pushed_ = false;          // this step's grads are on the host (reduce_grads, clip_grad_norm)
  bool params_on_host_ = false;  // the device params were copied to the host (the first step) or loaded
  /// A grads_ready whose copies to the host have not been handed to the host optimizer.
  struct in_flight {
    std::vector<std::string> names;
    std::vector<std::size_t> tensors;
    std::uint64_t ticket = 0;  // its last copy (0: none)
  };
  std::deque<in_flight> in_flight_;
  detail::host_registration<Device> pinned_;  // unregistered before the buffers go
  detail::copy_fence<Device> fence_;          // last: the copies into them waited for first
};

}  // namespace distopt
