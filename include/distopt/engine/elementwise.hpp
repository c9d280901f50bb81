// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The element-wise stages: the fused update of every element (update_phase, the
/// policy's DISTOPT_HD update on every backend) of fp32 or bf16 states, and the stages of
/// a step that updates buckets: a matrix stage (GaLore's projection, Muon's
/// orthogonalisation, or none) and an element stage (this one, or q8's) on each bucket in
/// turn, through the one bucket loop (engine/schedule.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../memory_report.hpp"
#include "../types/bf16.hpp"
#include "../types/fp16.hpp"
#include "phases.hpp"
#include "schedule.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// How an update stores params of type Param: fp32 in place, through fp32 master weights,
/// or in place rounded (bf16: stochastically, fp16: to nearest).
template <class Param>
constexpr param_mode mode_for(bool master) {
  if constexpr (std::is_same_v<Param, float>) return param_mode::fp32;
  else if (master) return param_mode::master;
  else if constexpr (std::is_same_v<Param, bf16>) return param_mode::no_master_sr;
  else return param_mode::no_master_rne;
}

/// Calls f(std::integral_constant<param_mode, M>) with the context's param mode.
template <class Ctx, class F>
void with_param_mode(const Ctx& c, F&& f) {
  using P = typename Ctx::param_type;
  if (c.uses_master()) f(std::integral_constant<param_mode, mode_for<P>(true)>{});
  else f(std::integral_constant<param_mode, mode_for<P>(false)>{});
}

/// Calls f(std::integral_constant<int, N>) for each state slot count N in use by a group
/// (`active`: per group), N = min_state_slots..max_state_slots, in increasing order (the
/// context's constructor refuses groups outside that range).
template <class Policy, class F>
void for_each_slot_count(const std::vector<int>& active, F&& f) {
  constexpr int lo = min_state_slots_of<Policy>::value;
  [&]<int... K>(std::integer_sequence<int, K...>) {
    ((std::find(active.begin(), active.end(), lo + K) != active.end() ? f(std::integral_constant<int, lo + K>{})
                                                                        : void()),
     ...);
  }(std::make_integer_sequence<int, Policy::max_state_slots - lo + 1>{});
}

/// What one step's update phases read besides the buffers: each group's scalars and slot
/// counts and each tensor's scale (percentile clipping) in the executor's memory, the
/// reduced grads, and the host's decisions (or the device's control).
template <class Policy, class G>
struct step_inputs {
  const typename Policy::scalars* scalars = nullptr;  ///< per group, in the executor's memory
  const int* slots = nullptr;                         ///< per group, in the executor's memory
  const float* tensor_scale = nullptr;                ///< per tensor, in the executor's memory, or null
  const G* grads = nullptr;                           ///< the reduced grads
  bool grads_local = false;                           ///< indexed by local index, else buffer index
  const step_control* control = nullptr;              ///< the step's decisions, in the executor's memory
  float grad_scale = 1.0f;                            ///< the host's copies of two of them, where
  std::uint64_t key = 0;                              ///< it read them (matrix stages, layer-wise)
  const std::vector<typename Policy::scalars>* host_scalars = nullptr;  ///< per group, decided on the host
  std::vector<int> active;                                            ///< per group: its slots in use
};

/// The element-wise stage of fp32 or bf16 states (Enc): every slot of a piece at the
/// piece's local index, or, with `Packed` (a matrix stage updates some tensors whole),
/// packed over the other tensors' pieces.
template <class Policy, class Enc, class Exec, bool Packed>
struct element_stage {
  template <class Ctx>
  void init(Ctx& c) {
    const auto& pieces = c.plan_.pieces();
    std::size_t size = Packed ? 0 : c.plan_.local_size();
    for (std::size_t p = 0; p < pieces.size(); ++p) {
      if (c.states_at_.whole_matrix(pieces[p].tensor)) continue;
      const std::size_t at = Packed ? size : pieces[p].local;
      for (int k = 0; k < c.slots_; ++k) c.states_at_.place(p, k, state_home::slot, at, pieces[p].count);
      if constexpr (Packed) size += pieces[p].count;
    }
    for (int k = 0; k < c.slots_; ++k) c.states_[k] = buffer<Enc, Exec>(c.exec_, size);
    if constexpr (Packed) {
      state_at_x_ = c.in_exec(c.states_at_.offsets(), state_at_dev_);
      matrix_index_x_ = c.in_exec(c.states_at_.matrix_index(), matrix_index_dev_);
    }
  }

  /// The update of bucket `b`'s pieces, one pass per slot count in use.
  template <param_mode Mode, class Ctx, class G>
  void run_bucket(Ctx& c, const step_inputs<Policy, G>& in, const shard_bucket& b) {
    for_each_slot_count<Policy>(in.active, [&]<int N>(std::integral_constant<int, N>) {
      update_phase<Policy, N, Mode, typename Ctx::param_type, G, Enc> u;
      u.pieces = c.exec_pieces() + b.first_piece;
      u.scalars = in.scalars;
      u.slots = in.slots;
      u.tensor_scale = in.tensor_scale;
      u.matrix_index = matrix_index_x_;
      if (state_at_x_) u.state_at = state_at_x_ + b.first_piece;
      u.params = c.params_.data();
      u.params_local = c.shards_params();
      u.grads = in.grads;
      u.grads_local = in.grads_local;
      u.master = c.uses_master() ? c.master_.data() : nullptr;
      for (int k = 0; k < N; ++k) u.state[k] = c.states_[k].data();
      u.control = in.control;
      u.grad_scale = in.grad_scale;
      u.key = in.key;
      launch(c.exec_, b.end_piece - b.first_piece, u);
    });
  }

  const slot_offsets* state_at_x_ = nullptr;  // packed: the layout's offsets where the executor reads them
  const int* matrix_index_x_ = nullptr;       // with a matrix stage: the matrices to skip, likewise
  buffer<slot_offsets, Exec> state_at_dev_;   // their copies in device memory
  buffer<int, Exec> matrix_index_dev_;
};

/// No matrix stage: every tensor is the element stage's.
struct no_matrix_stage {
  static constexpr bool runs_between_buckets = false;
  template <class Ctx>
  void init(Ctx&) {}
};

}  // namespace distopt::detail
