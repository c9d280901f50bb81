// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/single.hpp"
#include "concepts.hpp"
#include "detail/buffer.hpp"
#include "detail/update_loop.hpp"
#include "exec/cpu.hpp"
#include "layout/registry.hpp"
#include "loss_scaler.hpp"
#include "memory_report.hpp"
#include "step_info.hpp"
#include "storage/replicated.hpp"
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
};

namespace detail {
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
  static_assert(policy_updates_elements<Policy>,
                "distopt::optimizer: the Policy needs `DISTOPT_HD static void update(const "
                "scalars&, float& param, float grad, float* state)` taking param by non-const reference");
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
}  // namespace detail

/// An optimizer assembled from a policy (the math), a state storage (placement and
/// encoding), a communicator (the data-parallel group), an executor (where and how
/// elements are visited) and the number types of params and grads.
///
/// The optimizer owns flat buffers for params, grads, fp32 master weights and states; the
/// caller writes initial params and each step's grads into the views it hands out.
template <class Policy, class Storage = replicated<fp32>, class Comm = single, class Exec = cpu,
          class Precision = precision<float>>
class optimizer {
  static_assert(detail::check_optimizer_arguments<Policy, Storage, Comm, Exec, Precision>());
  static_assert(!Storage::is_sharded,
                "distopt::optimizer: sharded storage has not landed yet; use replicated<...>");

 public:
  using policy_type = Policy;
  using hyper_params = typename Policy::hyper_params;
  using param_type = typename Precision::param_type;
  using grad_type = typename Precision::grad_type;
  using state_type = typename Storage::encoding;

  /// Creates the buffers for `tensors`; `groups[i]` holds the hyper-parameters of the tensors
  /// registered with group i. Every tensor must be registered with the param dtype.
  optimizer(layout tensors, std::vector<hyper_params> groups, optimizer_options options = {},
            Exec exec = Exec{}, Comm comm = Comm{})
      : layout_(std::move(tensors)),
        groups_(std::move(groups)),
        options_(std::move(options)),
        exec_(std::move(exec)),
        comm_(std::move(comm)) {
    if (groups_.empty())
      throw std::invalid_argument(std::string(Policy::name) +
                                  ": at least one hyper-parameter group is needed");
    for (const auto& h : groups_) h.validate();
    if (layout_.tensors().empty())
      throw std::invalid_argument(std::string(Policy::name) + ": the layout has no tensors");
    for (const auto& t : layout_.tensors()) {
      if (t.dtype != dtype_of<param_type>)
        throw std::invalid_argument("distopt::optimizer: tensor '" + t.name + "' is registered as " +
                                    std::string(dtype_name(t.dtype)) +
                                    " but this optimizer's params are " +
                                    std::string(dtype_name(dtype_of<param_type>)));
      if (static_cast<std::size_t>(t.group) >= groups_.size())
        throw std::invalid_argument("distopt::optimizer: tensor '" + t.name + "' is in group " +
                                    std::to_string(t.group) + " but only " +
                                    std::to_string(groups_.size()) + " group(s) were given");
    }
    if (options_.loss_scale) scaler_ = loss_scaler(*options_.loss_scale);
    for (const auto& h : groups_) slots_ = std::max(slots_, Policy::state_slots(h));

    const std::size_t n = layout_.size();
    params_ = detail::buffer<param_type, Exec>(exec_, n);
    grads_ = detail::buffer<grad_type, Exec>(exec_, n);
    if (uses_master()) master_ = detail::buffer<float, Exec>(exec_, n);
    for (int k = 0; k < slots_; ++k) states_[k] = detail::buffer<state_type, Exec>(exec_, n);
    make_chunks();
  }

  /// One hyper-parameter group for every tensor.
  optimizer(layout tensors, hyper_params hyper, optimizer_options options = {}, Exec exec = Exec{},
            Comm comm = Comm{})
      : optimizer(std::move(tensors), std::vector<hyper_params>{std::move(hyper)},
                  std::move(options), std::move(exec), std::move(comm)) {}

  /// The tensors and their place in the flat buffers.
  const layout& tensors() const noexcept { return layout_; }

  /// The params of tensor `name`: write initial values here before the first step.
  std::span<param_type> param(std::string_view name) { return view(params_, name); }
  /// The grads of tensor `name`: write each step's gradient here before `step()`.
  std::span<grad_type> grad(std::string_view name) { return view(grads_, name); }
  /// The fp32 master weights of tensor `name` (only with master weights on bf16/fp16 params).
  std::span<const float> master(std::string_view name) const {
    if (!uses_master())
      throw std::logic_error("distopt::optimizer: no master weights are kept for '" +
                             std::string(name) + "' (fp32 params or master_weights off)");
    return view(master_, name);
  }
  /// State slot `k` of tensor `name` (slot meaning is the policy's, e.g. adam: 0 exp_avg).
  std::span<const state_type> state(std::string_view name, int k) const {
    if (k < 0 || k >= slots_)
      throw std::out_of_range(std::string(Policy::name) + ": state slot " + std::to_string(k) +
                              " does not exist (" + std::to_string(slots_) + " in use)");
    return view(states_[k], name);
  }
  /// The whole flat buffers, padding included (for bulk I/O).
  std::span<param_type> params() noexcept { return params_.span(); }
  std::span<grad_type> grads() noexcept { return grads_.span(); }

  /// Hyper-parameters of group `g`.
  const hyper_params& hyper(int g = 0) const { return groups_.at(check_group(g)); }
  /// Replaces the hyper-parameters of group `g` (for schedules); validated first.
  void set_hyper(int g, hyper_params h) {
    h.validate();
    if (Policy::state_slots(h) > slots_)
      throw std::invalid_argument(std::string(Policy::name) +
                                  ": these hyper-parameters need more state than was allocated");
    groups_.at(check_group(g)) = std::move(h);
  }
  /// Number of hyper-parameter groups.
  int group_count() const noexcept { return static_cast<int>(groups_.size()); }

  /// Steps taken so far (skipped steps do not count).
  std::int64_t step_count() const noexcept { return step_; }
  /// The factor to multiply the loss by before backward (1 without loss scaling).
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  /// The executor and communicator in use.
  Exec& executor() noexcept { return exec_; }
  Comm& communicator() noexcept { return comm_; }

  /// Sets every grad to zero.
  void zero_grad() {
    grad_type* g = grads_.data();
    const std::size_t per = chunk_elems;
    const std::size_t n = grads_.size();
    exec_.parallel_for((n + per - 1) / per, [&](std::size_t c) {
      std::fill(g + c * per, g + std::min(n, (c + 1) * per), grad_type{});
    });
  }

  /// Computes the global L2 norm of the (unscaled) gradients, as
  /// torch.nn.utils.clip_grad_norm_, and makes the next `step()` scale them by
  /// min(1, max_norm / (norm + 1e-6)) inside its fused pass. Returns the norm; a NaN or
  /// Inf norm makes the next step skip.
  double clip_grad_norm(double max_norm) {
    if (!(max_norm > 0.0) || !std::isfinite(max_norm))
      throw std::invalid_argument("clip_grad_norm: invalid max_norm " + std::to_string(max_norm) +
                                  ": must be a finite value > 0");
    const double norm = grad_norm();
    clip_ = clip_state{norm, std::min(1.0, max_norm / (norm + 1e-6))};
    return norm;
  }

  /// Takes one optimizer step over every tensor. A NaN or Inf gradient skips the step and
  /// leaves params and states bit for bit as they were.
  step_result step() {
    step_result r;
    double norm = std::numeric_limits<double>::quiet_NaN();
    double coef = 1.0;
    if (clip_) {
      norm = clip_->norm;
      coef = clip_->coef;
    } else if (options_.check_finite || scaler_) {
      norm = grad_norm();
    }
    clip_.reset();
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
    if (uses_master() && !master_ready_) load_master_from_params();
    run_update(static_cast<float>(coef / loss_scale()));
    if (scaler_) scaler_->update(false);
    r.step = step_;
    r.loss_scale = loss_scale();
    return r;
  }

  /// Copies the params into the fp32 master weights; done automatically before the first
  /// step, call it again after overwriting params by hand.
  void load_master_from_params() {
    if (!uses_master()) return;
    const param_type* p = params_.data();
    float* m = master_.data();
    exec_.parallel_for(chunks_.size(), [&](std::size_t c) {
      for (std::size_t i = chunks_[c].begin; i < chunks_[c].end; ++i) m[i] = to_float(p[i]);
    });
    master_ready_ = true;
  }

  /// Bytes this rank holds, by category, and per parameter.
  memory_report memory() const {
    memory_report r;
    r.parameters = layout_.numel();
    r.entries.push_back({"params", params_.bytes()});
    r.entries.push_back({"grads", grads_.bytes()});
    r.entries.push_back({"master", master_.bytes()});
    std::size_t s = 0;
    for (int k = 0; k < slots_; ++k) s += states_[k].bytes();
    r.entries.push_back({"states", s});
    return r;
  }

 private:
  /// Elements per work item: a multiple of every block size, large enough to amortise a
  /// dispatch, small enough to balance threads. Fixed, so reductions do not depend on threads.
  static constexpr std::size_t chunk_elems = 1u << 14;

  struct chunk {
    std::size_t begin, end;
    int group;
  };
  struct clip_state {
    double norm, coef;
  };

  bool uses_master() const noexcept {
    return !std::is_same_v<param_type, float> && options_.master_weights;
  }

  int check_group(int g) const {
    if (g < 0 || g >= group_count())
      throw std::out_of_range(std::string(Policy::name) + ": no hyper-parameter group " +
                              std::to_string(g) + " (there are " + std::to_string(group_count()) +
                              ")");
    return g;
  }

  template <class T>
  std::span<T> view(const detail::buffer<T, Exec>& b, std::string_view name) const {
    const tensor_slot& t = layout_.find(name);
    return b.span().subspan(t.offset, t.numel);
  }

  void make_chunks() {
    for (const auto& t : layout_.tensors())
      for (std::size_t b = 0; b < t.numel; b += chunk_elems)
        chunks_.push_back({t.offset + b, t.offset + std::min(t.numel, b + chunk_elems), t.group});
  }

  /// Global L2 norm of grads / loss_scale: per-chunk partial sums in a fixed order, so the
  /// result is the same for every thread count.
  double grad_norm() {
    std::vector<double> partial(chunks_.size());
    const grad_type* g = grads_.data();
    const double inv = 1.0 / loss_scale();
    exec_.parallel_for(chunks_.size(), [&](std::size_t c) {
      partial[c] = detail::sum_of_squares(g, inv, chunks_[c].begin, chunks_[c].end);
    });
    double total = 0.0;
    for (double p : partial) total += p;
    std::array<double, 1> t{total};
    comm_.all_reduce(std::span<double>(t), reduce_op::sum);
    return std::sqrt(t[0]);
  }

  static constexpr detail::param_mode mode_for(bool master) {
    if constexpr (std::is_same_v<param_type, float>) return detail::param_mode::fp32;
    else if (master) return detail::param_mode::master;
    else if constexpr (std::is_same_v<param_type, bf16>) return detail::param_mode::no_master_sr;
    else return detail::param_mode::no_master_rne;
  }

  template <detail::param_mode Mode, int N>
  void run_with(const std::vector<typename Policy::scalars>& sc,
                const detail::update_args<param_type, grad_type, state_type>& a,
                const std::vector<int>& active) {
    exec_.parallel_for(chunks_.size(), [&](std::size_t c) {
      const chunk& ch = chunks_[c];
      if (active[ch.group] != N) return;
      detail::update_range<Policy, N, Mode>(sc[ch.group], a, ch.begin, ch.end);
    });
  }

  template <detail::param_mode Mode>
  void run_mode(const std::vector<typename Policy::scalars>& sc,
                const detail::update_args<param_type, grad_type, state_type>& a,
                const std::vector<int>& active) {
    [&]<int... N>(std::integer_sequence<int, N...>) {
      // One pass per distinct slot count in use (usually exactly one).
      ((std::find(active.begin(), active.end(), N) != active.end() ? run_with<Mode, N>(sc, a, active)
                                                                   : void()),
       ...);
    }(std::make_integer_sequence<int, Policy::max_state_slots + 1>{});
  }

  void run_update(float grad_scale) {
    std::vector<typename Policy::scalars> sc;
    std::vector<int> active;
    state_started_.resize(groups_.size(), false);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const int slots = Policy::state_slots(groups_[g]);
      sc.push_back(Policy::prepare(groups_[g], step_info{step_, slots > 0 && !state_started_[g]}));
      active.push_back(slots);
      if (slots > 0) state_started_[g] = true;
    }
    detail::update_args<param_type, grad_type, state_type> a{
        params_.data(), grads_.data(), master_.data(), {}, grad_scale,
        detail::splitmix64_finalise(options_.seed ^ detail::splitmix64_finalise(static_cast<std::uint64_t>(step_)))};
    for (int k = 0; k < slots_; ++k) a.state[k] = states_[k].data();
    if (uses_master()) run_mode<mode_for(true)>(sc, a, active);
    else run_mode<mode_for(false)>(sc, a, active);
  }

  layout layout_;
  std::vector<hyper_params> groups_;
  optimizer_options options_;
  Exec exec_;
  Comm comm_;
  std::optional<loss_scaler> scaler_;
  int slots_ = 0;
  detail::buffer<param_type, Exec> params_;
  detail::buffer<grad_type, Exec> grads_;
  detail::buffer<float, Exec> master_;
  std::array<detail::buffer<state_type, Exec>, 4> states_;
  std::vector<chunk> chunks_;
  std::optional<clip_state> clip_;
  std::int64_t step_ = 0;
  std::vector<bool> state_started_;  // per group: has its state been used yet
  bool master_ready_ = false;
};

}  // namespace distopt
