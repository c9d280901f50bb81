// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file One phase's element pass of a layer-wise policy over the stage's work items, on
/// every executor (engine/layerwise.hpp builds it): the item table, and the phase whose
/// body runs the element loop (layer_range) over one item, and the merge of the items' sums
/// per tensor. A host executor calls the body once per item on its threads; the CUDA
/// executor runs it with a kernel of its own (exec/cuda/layer_phase.cuh).

#include <cstddef>
#include <cstdint>
#include <utility>

#include "../config.hpp"
#include "../detail/fixed_sum.hpp"
#include "../detail/layer_loop.hpp"
#include "../detail/shard_plan.hpp"
#include "../layerwise.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// A work item of the layer-wise element pass as a device reads it: its pieces, the
/// geometry of its tensor, and where its statistics live in the engine's device buffers.
struct layer_item_desc {
  std::size_t piece_begin = 0, piece_end = 0;
  std::size_t row_first = 0, row_count = 0, col_first = 0, col_count = 0;
  std::size_t tensor_offset = 0;  ///< layout index of the tensor's first element
  std::size_t cols = 0, matrix = 0;  ///< C and R * C of each matrix (factored tensors)
  std::size_t rows_total = 0, cols_total = 0;  ///< matrices * R and matrices * C
  std::size_t values_at = 0;  ///< the tensor's values in the statistics mirror; then its row and column values
  std::size_t sums_at[4] = {};  ///< per phase: the item's first fixed_sum (each phase's sums packed)
  std::size_t cols_at = 0;      ///< the item's first column double and window exponent
  std::size_t scratch_at = 0;   ///< host executors: where the slots it does not keep write
  unsigned slot_mask = 0;
  bool factored = false;
};

/// Phase P's element pass over work items [first_item, first_item + items) of the stage's
/// table: a phase of one call per item (a reduction: its body adds the item's statistics in
/// a fixed order, through layer_range). The item's exact sums are zeroed by the pass, and
/// layer_merge_phase merges them after it. The CUDA kernel (exec/cuda/layer_phase.cuh)
/// shares `args` and the element body (layer_element) with it, and gives the same bits.
///
/// A state slot a tensor does not keep: with `Absent` (device executors) its pointers are
/// null and the loop tests them; on a host (STYLE.md: no null test in a loop of a header
/// with AVX2 clones) it reads `zeros` and writes the item's `scratch`, and a factored
/// tensor's loop is compiled for its set of slots (the policy's factored_slots), so that
/// the slots outside it are left out.
template <class Policy, int P, param_mode Mode, class Param, class Grad, class State, bool Absent = true>
struct layer_phase_body {
  using policy = Policy;
  static constexpr int phase = P;
  static constexpr param_mode mode = Mode;
  using param_type = Param;
  using grad_type = Grad;
  using state_type = State;

  const layer_item_desc* items = nullptr;
  std::size_t first_item = 0;
  const shard_piece* pieces = nullptr;
  const slot_offsets* slots = nullptr;  ///< per piece
  const typename Policy::scalars* scalars = nullptr;  ///< per group
  Param* params = nullptr;
  bool params_local = false;
  const Grad* grads = nullptr;
  bool grads_local = false;
  float* master = nullptr;
  State* state[4] = {};
  float grad_scale = 1.0f;
  std::uint64_t key = 0;
  std::size_t block = 1;
  const float* stats = nullptr;  ///< the statistics mirror: each tensor's values, row and column values
  fixed_sum* sums = nullptr;
  double* col_acc = nullptr;
  std::uint32_t* col_lo = nullptr;  ///< this phase's window exponents (kept from step to step)
  std::size_t max_cols = 0;         ///< the most column sums of one item in this phase
  /// The pieces of these items, and each piece's item (a phase that sums nothing runs on
  /// the CUDA executor a thread block per piece).
  std::size_t piece_first = 0, piece_count = 0;
  const std::size_t* piece_item = nullptr;
  const State* zeros = nullptr;  ///< host executors (not Absent): at least a piece's elements of zeros
  State* scratch = nullptr;      ///< host executors: the items' scratch, at each item's scratch_at

  DISTOPT_HD std::size_t size(std::size_t) const noexcept { return 1; }

  /// The number of this phase's sums of item `it`: tensor sums, then its rows', then its columns'.
  DISTOPT_HD std::size_t sum_count(const layer_item_desc& it) const noexcept {
    constexpr phase_spec spec = Policy::phases[P];
    return spec.tensor_sums + (it.factored ? static_cast<std::size_t>(spec.row_sums) * it.row_count +
                                                 static_cast<std::size_t>(spec.col_sums) * it.col_count
                                           : 0);
  }

  /// Piece c of item `it` as layer_range reads it: its arrays, the tensor's statistics, the
  /// item's sums (no column window: the caller's).
  DISTOPT_HD layer_args<Param, Grad, State> args(const layer_item_desc& it, std::size_t c) const {
    constexpr phase_spec spec = Policy::phases[P];
    layer_args<Param, Grad, State> a{};
    a.grad_scale = grad_scale;
    a.random_key = key;
    a.cols = it.cols;
    a.matrix = it.matrix;
    a.block = block;
    a.tensor_values = stats + it.values_at;
    const float* rv = a.tensor_values + Policy::tensor_values;
    const float* cv = rv + static_cast<std::size_t>(Policy::row_values) * it.rows_total;
    for (int k = 0; k < Policy::row_values; ++k) a.row_values[k] = rv + static_cast<std::size_t>(k) * it.rows_total;
    for (int k = 0; k < Policy::col_values; ++k) a.col_values[k] = cv + static_cast<std::size_t>(k) * it.cols_total;
    a.tensor_sums = sums + it.sums_at[P];
    a.row_sums = a.tensor_sums + spec.tensor_sums;
    a.col_sums = a.row_sums + (it.factored ? static_cast<std::size_t>(spec.row_sums) * it.row_count : 0);
    a.row_first = it.row_first;
    a.row_count = it.row_count;
    a.col_first = it.col_first;
    a.col_count = it.col_count;
    const shard_piece& pc = pieces[c];
    a.param = params + (params_local ? pc.local : pc.buffer);
    a.grad = grads + (grads_local ? pc.local : pc.buffer);
    a.master = master ? master + pc.local : nullptr;
    for (int k = 0; k < Policy::max_state_slots; ++k) {
      const bool kept = (it.slot_mask >> k) & 1u;
      State* s = kept ? state[k] + slots[c].at[k] : nullptr;
      a.state_out[k] = s || Absent ? s : scratch + it.scratch_at;
      a.state_in[k] = s || Absent ? s : zeros;
    }
    a.random_base = pc.layout;
    a.first = pc.layout - it.tensor_offset;
    return a;
  }

  DISTOPT_HD void operator()(std::size_t j, std::size_t, std::size_t) const {
    constexpr phase_spec spec = Policy::phases[P];
    const layer_item_desc& it = items[first_item + j];
    const bool f = it.factored;
    fixed_sum* ts = sums + it.sums_at[P];
    for (std::size_t k = 0, n = sum_count(it); k < n; ++k) ts[k] = fixed_sum{};
    const std::size_t n_cols = f ? static_cast<std::size_t>(spec.col_sums) * it.col_count : 0;
    for (std::size_t k = 0; k < n_cols; ++k) col_acc[it.cols_at + k] = 0.0;
    column_window w{col_acc + it.cols_at, col_lo + it.cols_at, 0, column_window::none, column_window::none};
    layer_args<Param, Grad, State> a{};
    for (std::size_t c = it.piece_begin; c < it.piece_end; ++c) {
      a = args(it, c);
      a.window = &w;
      const typename Policy::scalars& sc = scalars[pieces[c].group];
      if (f) factored_range(it.slot_mask, sc, a, pieces[c].count);
      else layer_range<Policy, P, false, Mode, Param, Grad, State, Absent>(sc, a, pieces[c].count);
    }
    if constexpr (spec.col_sums > 0)
      if (f) fold_matrix(w, a.col_sums, static_cast<std::size_t>(spec.col_sums), it.cols, it.col_first, it.col_count);
  }

  /// A factored tensor's element pass: on a host, compiled for the first set of slots that
  /// holds the ones it keeps (sets that touch the same slots in this phase share one
  /// instantiation; a slot of the set it does not keep reads zeros and writes scratch).
  DISTOPT_HD void factored_range(unsigned slot_mask, const typename Policy::scalars& sc,
                                 const layer_args<Param, Grad, State>& a, std::size_t n) const {
    if constexpr (Absent) {
      layer_range<Policy, P, true, Mode, Param, Grad, State, true>(sc, a, n);
    } else {
      constexpr auto sets = factored_slot_sets<Policy>();
      constexpr unsigned touched = Policy::phases[P].reads_slots | Policy::phases[P].writes_slots;
      const int set = factored_set_of<Policy>(slot_mask);  // the stage refuses a tensor no set holds
      [&]<std::size_t... S>(std::index_sequence<S...>) {
        ((set == static_cast<int>(S) ? layer_range<Policy, P, true, Mode, Param, Grad, State, false, sets[S] & touched>(sc, a, n)
                                     : void()),
         ...);
      }(std::make_index_sequence<sets.size()>{});
    }
  }
};

/// A tensor of the layer-wise engine as the merge of its items' sums reads it: its items
/// (consecutive in the item table), its sums' place in the merged arrays (per phase) and
/// its rows and columns (matrices * R and matrices * C; 0 for a tensor not factored).
struct layer_tensor_desc {
  std::size_t first_item = 0, end_item = 0;
  std::size_t out_at[4] = {};
  std::size_t rows = 0, cols = 0;
};

/// After phase P's element pass: each tensor's sums of the phase (its tensor
/// sums, then each row's, then each column's, the layer stage's per-tensor order), the
/// exact sum of its items' sums, and their values in double, so that the host copies one
/// sum per row and column instead of one per item, or only the doubles. A phase of one
/// item per tensor, one element per sum.
template <class Policy, int P>
struct layer_merge_phase {
  const layer_tensor_desc* tensors = nullptr;
  const layer_item_desc* items = nullptr;
  const fixed_sum* item_sums = nullptr;  ///< phase P's sums of every item (layer_phase_body)
  fixed_sum* sums = nullptr;             ///< merged, at tensors[i].out_at[P]
  double* values = nullptr;              ///< their values, at the same indices

  DISTOPT_HD std::size_t size(std::size_t i) const noexcept {
    constexpr phase_spec spec = Policy::phases[P];
    const layer_tensor_desc& t = tensors[i];
    return spec.tensor_sums + static_cast<std::size_t>(spec.row_sums) * t.rows +
           static_cast<std::size_t>(spec.col_sums) * t.cols;
  }
  DISTOPT_HD void operator()(std::size_t i, std::size_t first, std::size_t last) const {
    constexpr phase_spec spec = Policy::phases[P];
    const layer_tensor_desc& t = tensors[i];
    std::size_t tensor_end = spec.tensor_sums;  // not constexpr: nvcc warns on j < 0
    const std::size_t row_end = tensor_end + static_cast<std::size_t>(spec.row_sums) * t.rows;
    for (std::size_t j = first; j < last; ++j) {
      fixed_sum s{};
      for (std::size_t w = t.first_item; w < t.end_item; ++w) {
        const layer_item_desc& it = items[w];
        const fixed_sum* from = item_sums + it.sums_at[P];
        if (j < tensor_end) {
          s.add(from[j]);
        } else if (j < row_end) {  // statistic k of row r: the item holding r, if any
          const std::size_t k = (j - spec.tensor_sums) / t.rows, r = (j - spec.tensor_sums) % t.rows;
          if (r >= it.row_first && r < it.row_first + it.row_count)
            s.add(from[spec.tensor_sums + k * it.row_count + (r - it.row_first)]);
        } else {
          const std::size_t k = (j - row_end) / t.cols, c = (j - row_end) % t.cols;
          if (c >= it.col_first && c < it.col_first + it.col_count)
            s.add(from[spec.tensor_sums + static_cast<std::size_t>(spec.row_sums) * it.row_count + k * it.col_count +
                       (c - it.col_first)]);
        }
      }
      sums[t.out_at[P] + j] = s;
      values[t.out_at[P] + j] = s.value();
    }
  }
};

}  // namespace distopt::detail
