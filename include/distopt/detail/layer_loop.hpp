// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The per-element loop of one phase of a layer-wise policy: the same load / call /
/// store as update_range, plus the statistics the phase emits, summed exactly.
///
/// A piece of a tensor is walked in segments that no shard cut can split: the
/// intersection of a layout block with a row of the matrix (cuts fall on block
/// boundaries, rows are fixed by the shape). Per-tensor and per-row values are summed in
/// double along a segment, in element order, and each segment's sum is added exactly to
/// the accumulators; per-column values are added exactly one by one (a column's elements
/// lie in different segments). So every statistic is the same for every cut and thread
/// count (see fixed_sum.hpp). Along a segment the doubles are summed in four interleaved
/// lanes (element j of the segment into lane j % 4), combined in a fixed order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "../config.hpp"
#include "../layerwise.hpp"
#include "../types/rounding.hpp"
#include "fixed_sum.hpp"
#include "update_loop.hpp"

namespace distopt::detail {

/// One piece's data and statistics targets for layer_range. Pointers are at the piece's
/// first element. A state slot the tensor does not keep reads from zeros and writes to
/// scratch (never null: a null check in the loop becomes masked vector loads from the
/// null page in the AVX2 clone, each a slow microcode assist).
template <class Param, class Grad, class Enc>
struct layer_args {
  Param* param;
  const Grad* grad;
  float* master;
  const Enc* state_in[4];
  Enc* state_out[4];
  float grad_scale;
  std::uint64_t random_key;
  std::size_t random_base;  ///< layout index of the first element (stochastic rounding)
  std::size_t first;        ///< tensor index of the first element
  std::size_t cols;         ///< C of each matrix (factored tensors)
  std::size_t matrix;       ///< R * C
  std::size_t block;        ///< layout block size
  const float* tensor_values;
  const float* row_values[4];  ///< indexed by row statistic (matrix * R + row)
  const float* col_values[4];  ///< indexed by column statistic (matrix * C + col)
  fixed_sum* tensor_sums;      ///< [tensor_sums of the phase]
  fixed_sum* row_sums;         ///< [k * row_count + (row - row_first)]
  fixed_sum* col_sums;         ///< [k * col_count + (col - col_first)]
  std::size_t row_first, row_count, col_first, col_count;
};

/// Sums `n` values into four interleaved double lanes (value j into lane j % 4): four
/// independent chains instead of one, vectorisable, and a fixed function of the values.
DISTOPT_INLINE void add_to_lanes(double* DISTOPT_RESTRICT lanes, const float* DISTOPT_RESTRICT v, std::size_t n) {
  std::size_t j = 0;
  for (; j + 4 <= n; j += 4)
    for (std::size_t l = 0; l < 4; ++l) lanes[l] += static_cast<double>(v[j + l]);
  for (; j < n; ++j) lanes[j % 4] += static_cast<double>(v[j]);
}
DISTOPT_INLINE double lanes_total(const double* lanes) { return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]); }

/// Zeros to read an absent state slot from, for pieces of up to `n` elements.
template <class Enc, std::size_t N>
const Enc* zero_states() {
  static const Enc zeros[N] = {};
  return zeros;
}

template <class Policy, int Phase, bool Factored, param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_CPU_CLONES void layer_range(const typename Policy::scalars& sc, const layer_args<Param, Grad, Enc>& a,
                                    std::size_t n) {
  constexpr phase_spec spec = Policy::phases[Phase];
  constexpr int TS = spec.tensor_sums;
  constexpr int RS = Factored ? spec.row_sums : 0;
  constexpr int CS = Factored ? spec.col_sums : 0;
  constexpr int RV = Factored ? Policy::row_values : 0;
  constexpr int CV = Factored ? Policy::col_values : 0;
  constexpr int MS = Policy::max_state_slots > 0 ? Policy::max_state_slots : 1;
  constexpr int OUT = spec.tensor_sums + spec.row_sums + spec.col_sums;
  // The element pass writes each element's emitted values here (a run of at most `sub`
  // elements), and a second, short loop sums them: the element loop itself has no
  // reduction in it and vectorises like update_range.
  constexpr std::size_t sub = 256;
  float emitted[OUT > 0 ? OUT : 1][sub];
  const typename Policy::scalars s = sc;
  const float scale = a.grad_scale;
  std::size_t i = 0;
  while (i < n) {
    const std::size_t t = a.first + i;  // tensor index
    std::size_t seg = std::min(n - i, a.block - t % a.block);
    std::size_t row = 0, col = 0;
    if constexpr (Factored) {
      seg = std::min(seg, a.cols - t % a.cols);
      row = t / a.cols;
      col = (t / a.matrix) * a.cols + t % a.cols;
    }
    float rv[RV > 0 ? RV : 1] = {};
    for (int k = 0; k < RV; ++k) rv[k] = a.row_values[k][row];
    double tl[TS > 0 ? TS : 1][4] = {};
    double rl[RS > 0 ? RS : 1][4] = {};
    for (std::size_t b = i; b < i + seg; b += sub) {
      const std::size_t m = std::min(sub, i + seg - b);
      const std::size_t c0 = col + (b - i);
      for (std::size_t jj = 0; jj < m; ++jj) {
        const std::size_t j = b + jj;
        float value = 0.0f;
        if constexpr (spec.reads_param) {
          if constexpr (Mode == param_mode::master) value = a.master[j];
          else value = to_float(a.param[j]);
        }
        float st[MS] = {};
        for (int k = 0; k < Policy::max_state_slots; ++k)
          if ((spec.reads_slots >> k) & 1u) st[k] = to_float(a.state_in[k][j]);
        float cv[CV > 0 ? CV : 1] = {};
        for (int k = 0; k < CV; ++k) cv[k] = a.col_values[k][c0 + jj];
        float out[OUT > 0 ? OUT : 1] = {};
        Policy::template element<Phase, Factored>(s, element_stats{a.tensor_values, rv, cv}, value,
                                                  to_float(a.grad[j]) * scale, st, out);
        for (int k = 0; k < Policy::max_state_slots; ++k)
          if ((spec.writes_slots >> k) & 1u) a.state_out[k][j] = from_float<Enc>(st[k]);
        if constexpr (spec.writes_param) {
          if constexpr (Mode == param_mode::master) {
            a.master[j] = value;
            a.param[j] = from_float<Param>(value);
          } else if constexpr (Mode == param_mode::no_master_sr) {
            a.param[j] = stochastic_round_bf16(value, mix32(a.random_key, a.random_base + j));
          } else {
            a.param[j] = from_float<Param>(value);
          }
        }
        for (int k = 0; k < OUT; ++k) emitted[k][jj] = out[k];
      }
      // b - i is a multiple of 4, so value j of the segment always lands in lane j % 4.
      for (int k = 0; k < TS; ++k) add_to_lanes(tl[k], emitted[k], m);
      for (int k = 0; k < RS; ++k) add_to_lanes(rl[k], emitted[spec.tensor_sums + k], m);
      for (int k = 0; k < CS; ++k) {
        fixed_sum* cs = a.col_sums + k * a.col_count + (c0 - a.col_first);
        const float* e = emitted[spec.tensor_sums + spec.row_sums + k];
        for (std::size_t jj = 0; jj < m; ++jj) cs[jj].add(e[jj]);
      }
    }
    for (int k = 0; k < TS; ++k) a.tensor_sums[k].add(lanes_total(tl[k]));
    for (int k = 0; k < RS; ++k) a.row_sums[k * a.row_count + (row - a.row_first)].add(lanes_total(rl[k]));
    i += seg;
  }
}

}  // namespace distopt::detail
