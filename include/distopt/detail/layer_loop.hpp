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
/// the accumulators; per-column values go through a column_window (below), which adds them
/// exactly (a column's elements lie in different segments). So every statistic is the same
/// for every cut and thread count (see fixed_sum.hpp). Along a segment the doubles are
/// summed in sixteen interleaved lanes (element j of the segment into lane j % 16),
/// combined pairwise in a fixed order, as the global norm's blocks are.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../layerwise.hpp"
#include "../types/rounding.hpp"
#include "fixed_sum.hpp"
#include "update_loop.hpp"

namespace distopt::detail {

/// Per-column double accumulators in front of the exact per-column fixed_sums, so that the
/// column statistics' loop vectorises (a fixed_sum add is ~15 scalar instructions with two
/// read-modify-writes; here it is a few vector instructions per element).
///
/// Each column has a window of 22 fp32 biased exponents, lo .. lo + 21 (1 <= lo <= 233),
/// kept as the fp32 bits of 2^(lo - 127). A value whose magnitude lies in the window is
/// added to the column's double: every such value is an integer multiple of
/// 2^(lo - 150) below 2^(lo - 150 + 45), so up to 256 of them (max_rows; a column gets at
/// most one value per row of its matrix) sum to an integer below 2^53 units, exactly, in
/// any order. Other nonzero values (outside the window, subnormals, Inf, NaN) go straight
/// to the fixed_sum; zeros are dropped. Every max_rows rows, when the matrix changes and at
/// the end of a work item, the doubles are folded into the fixed_sums (exact:
/// fixed_sum::add(double) adds any multiple of 2^-149 below 2^168, and a fold is below
/// 2^136). Every value is thus added exactly either way, and the sums are the same bits as
/// adding each value to its fixed_sum: the window only decides how fast.
///
/// The window is a guess that only costs speed when wrong: an unset window takes no value,
/// and opens 14 exponents below the first nonzero normal value handed to the fixed_sum; a
/// fold re-centres it 15 exponents below |the column's double| / rows (its mean, for values
/// of one sign).
struct column_window {
  /// No magnitude m has (m - unset) mod 2^32 < span, so an unset window takes nothing.
  static constexpr std::uint32_t unset = 0xc0000000u;
  static constexpr std::uint32_t span = 22u << 23;       // 22 exponents, in fp32 bits
  static constexpr std::size_t max_rows = 256;           // 45 + 8 = 53 bits
  static constexpr std::size_t none = ~std::size_t{0};
  double* acc = nullptr;         ///< [k * col_count + (col - col_first)]
  std::uint32_t* lo = nullptr;   ///< the same indices: 2^(lo - 127) as fp32 bits, or unset
  std::size_t rows = 0;          ///< rows added since the last fold
  std::size_t last_row = none;   ///< the row (of the tensor's rows) of the last segment
  std::size_t matrix = none;     ///< the matrix whose columns hold values

  /// The lowest exponent of a window for a column whose values are about 2^(e - 127).
  DISTOPT_HD static DISTOPT_INLINE std::uint32_t window_at(std::int32_t e) noexcept {
    e = e < 1 ? 1 : e;
    e = e > 233 ? 233 : e;  // the top exponent lo + 21 <= 254: Inf and NaN (255) never fit
    return static_cast<std::uint32_t>(e) << 23;
  }
};

/// Adds `m` column values to their windows; a value that does not fit is written to `rest`
/// (every other entry of `rest` is +0, a zero value may leave -0). Returns nonzero if a
/// nonzero value did not fit: then add_misses takes the rest. One unsigned subtract and
/// compare per value, branch-free, so that GCC vectorises it in every clone (with the
/// window's two bounds, its opening and a zero test in the loop, the AVX-512 clone took 28
/// instructions per 16 values; this takes 18).
DISTOPT_HD DISTOPT_INLINE std::uint32_t add_to_windows(double* DISTOPT_RESTRICT acc,
                                                       const std::uint32_t* DISTOPT_RESTRICT lo,
                                                       const float* DISTOPT_RESTRICT v, float* DISTOPT_RESTRICT rest,
                                                       std::size_t m) {
  std::uint32_t miss = 0;
  for (std::size_t j = 0; j < m; ++j) {
    const std::uint32_t u = __builtin_bit_cast(std::uint32_t, v[j]);
    const std::uint32_t fits = ((u & 0x7fffffffu) - lo[j]) < column_window::span ? 0xffffffffu : 0u;
    acc[j] += static_cast<double>(__builtin_bit_cast(float, u & fits));
    const std::uint32_t r = u & ~fits;
    rest[j] = __builtin_bit_cast(float, r);
    miss |= r & 0x7fffffffu;
  }
  return miss;
}

/// The values add_to_windows left in `rest`: each nonzero one is added to its column's
/// fixed_sum, and opens its column's window if that is unset and the value normal.
DISTOPT_HD inline void add_misses(fixed_sum* sums, std::uint32_t* lo, const float* rest, std::size_t m) {
  for (std::size_t j = 0; j < m; ++j) {
    const std::uint32_t mag = __builtin_bit_cast(std::uint32_t, rest[j]) & 0x7fffffffu;
    if (mag == 0) continue;
    sums[j].add(rest[j]);
    const std::int32_t e = static_cast<std::int32_t>(mag >> 23);
    if (lo[j] == column_window::unset && e >= 1 && e <= 254) lo[j] = column_window::window_at(e - 14);
  }
}

/// Folds `n` columns' doubles into their fixed_sums and re-centres their windows.
DISTOPT_HD inline void fold_windows(double* acc, std::uint32_t* lo, fixed_sum* sums, std::size_t n, std::size_t rows) {
  for (std::size_t j = 0; j < n; ++j) {
    const double x = acc[j];
    std::uint32_t l = column_window::unset;
    if (x != 0.0) {
      sums[j].add(x);
      const float mean = static_cast<float>((x < 0 ? -x : x) / static_cast<double>(rows > 0 ? rows : 1));
      const std::int32_t e = static_cast<std::int32_t>((__builtin_bit_cast(std::uint32_t, mean) >> 23) & 0xffu);
      if (e >= 1 && e <= 254) l = column_window::window_at(e - 15);
    }
    acc[j] = 0.0;
    lo[j] = l;
  }
}

/// Folds the windows of the matrix whose columns hold values (all `col_stats` statistics).
DISTOPT_HD inline void fold_matrix(column_window& w, fixed_sum* col_sums, std::size_t col_stats, std::size_t cols,
                        std::size_t col_first, std::size_t col_count) {
  if (w.matrix != column_window::none)
    for (std::size_t k = 0; k < col_stats; ++k) {
      const std::size_t at = k * col_count + (w.matrix * cols - col_first);
      fold_windows(w.acc + at, w.lo + at, col_sums + at, cols, w.rows);
    }
  w.matrix = column_window::none;
  w.rows = 0;
}

/// One piece's data and statistics targets for layer_range. Pointers are at the piece's
/// first element. On the host, a state slot the tensor does not keep reads from zeros and
/// writes to scratch where the loop touches it (a factored tensor's loop leaves out the
/// slots outside its set). These pointers are never null on the host: a null check in the
/// loop becomes masked vector loads from the null page in the AVX2 clone, each a slow
/// microcode assist. On a device (layer_range's `Absent`) the pointers of a slot not kept
/// are null, and it is neither read nor written.
template <class Param, class Grad, class Enc>
struct layer_args {
  using param_type = Param;
  using grad_type = Grad;
  using state_type = Enc;
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
  column_window* window;       ///< in front of col_sums (factored tensors with column sums)
  std::size_t row_first, row_count, col_first, col_count;
};

/// Sums `n` values into sum_lanes interleaved double lanes (value j into lane j % 16), a
/// fixed function of the values; vectorisable. Sixteen independent add chains run at the
/// vector units' throughput rather than at one add's latency (four lanes ran at 0.22 ns per
/// value here, sixteen at 0.09). combine_lanes (update_loop.hpp) gives the total.
DISTOPT_HD DISTOPT_INLINE void add_to_lanes(double* DISTOPT_RESTRICT lanes, const float* DISTOPT_RESTRICT v, std::size_t n) {
  std::size_t j = 0;
  for (; j + sum_lanes <= n; j += sum_lanes)
    for (std::size_t l = 0; l < sum_lanes; ++l) lanes[l] += static_cast<double>(v[j + l]);
  for (; j < n; ++j) lanes[j % sum_lanes] += static_cast<double>(v[j]);
}

/// Zeros to read an absent state slot from, for pieces of up to `n` elements.
template <class Enc, std::size_t N>
const Enc* zero_states() {
  static const Enc zeros[N] = {};
  return zeros;
}

/// The sets of state slots a factored tensor of `Policy` may keep (bit k: slot k): its
/// optional `factored_slots`, one mask or an array of masks, smallest first (Adafactor:
/// none, or exp_avg with beta1), else one set of all. A factored tensor's element pass is
/// compiled for the first set that holds the slots it keeps (factored_set_of; the engine
/// refuses a tensor that no set holds), and the slots outside that set are neither read
/// nor written. That keeps the zeros and scratch of slots a tensor does not keep out of the
/// loop: in Adafactor's and CAME's phase 1 they were two streams beside the one of the
/// grads, in Adafactor's phase 2 without beta1 two beside five.
template <class Policy>
constexpr auto factored_slot_sets() {
  if constexpr (!requires { Policy::factored_slots; }) return std::array<unsigned, 1>{~0u};
  else if constexpr (std::is_integral_v<std::remove_cvref_t<decltype(Policy::factored_slots)>>)
    return std::array<unsigned, 1>{Policy::factored_slots};
  else return Policy::factored_slots;
}

/// Every slot a factored tensor of `Policy` may keep: the union of its factored_slot_sets.
template <class Policy>
constexpr unsigned factored_slots() {
  unsigned u = 0;
  for (unsigned m : factored_slot_sets<Policy>()) u |= m;
  return u;
}

/// The index of the first of Policy's factored_slot_sets that holds every slot in
/// `slot_mask`, or -1.
template <class Policy>
constexpr int factored_set_of(unsigned slot_mask) {
  constexpr auto sets = factored_slot_sets<Policy>();
  for (std::size_t k = 0; k < sets.size(); ++k)
    if ((slot_mask & ~sets[k]) == 0) return static_cast<int>(k);
  return -1;
}

/// Element j of the piece `a` in phase `Phase`: loads what the phase reads, calls the
/// policy's element function, stores what it writes, and leaves the values it emits in
/// `out` (tensor sums, then row sums, then column sums). `c`: the element's column among its
/// tensor's columns (matrix * C + column; factored tensors), `rv`: its row's values. The one
/// body of the host loop (layer_range) and of the device kernel (exec/cuda/layer_phase.cuh).
/// `Kept`: a factored tensor's set of slots, where the caller knows it (else all it may keep).
template <class Policy, int Phase, bool Factored, param_mode Mode, class Param, class Grad, class Enc, bool Absent,
          unsigned Kept = ~0u>
DISTOPT_HD DISTOPT_INLINE void layer_element(const typename Policy::scalars& s, const layer_args<Param, Grad, Enc>& a,
                                             std::size_t j, std::size_t c, const float* rv, float scale, float* out) {
  constexpr phase_spec spec = Policy::phases[Phase];
  constexpr int CV = Factored ? Policy::col_values : 0;
  constexpr int MS = Policy::max_state_slots > 0 ? Policy::max_state_slots : 1;
  constexpr unsigned kept = Factored ? factored_slots<Policy>() & Kept : ~0u;
  constexpr unsigned reads = spec.reads_slots & kept, writes = spec.writes_slots & kept;
  float value = 0.0f;
  if constexpr (spec.reads_param) {
    if constexpr (Mode == param_mode::master) value = a.master[j];
    else value = to_float(a.param[j]);
  }
  float st[MS] = {};
  for (int k = 0; k < Policy::max_state_slots; ++k)
    if ((reads >> k) & 1u && (!Absent || a.state_in[k])) st[k] = to_float(a.state_in[k][j]);
  float cv[CV > 0 ? CV : 1] = {};
  for (int k = 0; k < CV; ++k) cv[k] = a.col_values[k][c];
  Policy::template element<Phase, Factored>(s, element_stats{a.tensor_values, rv, cv}, value,
                                            to_float(a.grad[j]) * scale, st, out);
  for (int k = 0; k < Policy::max_state_slots; ++k)
    if ((writes >> k) & 1u && (!Absent || a.state_out[k])) a.state_out[k][j] = from_float<Enc>(st[k]);
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
}

/// One phase's element pass over `n` elements of a piece, and the statistics it emits.
/// With `Absent` (device executors), a slot the tensor does not keep has null pointers: it
/// reads zeros and is not written (a device has no thread-local scratch to write it to).
/// With `Kept` (host executors), a factored tensor's slots outside it are left out at
/// compile time.
template <class Policy, int Phase, bool Factored, param_mode Mode, class Param, class Grad, class Enc,
          bool Absent = false, unsigned Kept = ~0u>
DISTOPT_HD DISTOPT_INLINE void layer_range_body(const typename Policy::scalars& sc,
                                                const layer_args<Param, Grad, Enc>& a, std::size_t n) {
  constexpr phase_spec spec = Policy::phases[Phase];
  constexpr int TS = spec.tensor_sums;
  constexpr int RS = Factored ? spec.row_sums : 0;
  constexpr int CS = Factored ? spec.col_sums : 0;
  constexpr int RV = Factored ? Policy::row_values : 0;
  constexpr int OUT = spec.tensor_sums + spec.row_sums + spec.col_sums;
  // The element pass writes each element's emitted values here (a run of at most `sub`
  // elements), and a second, short loop sums them: the element loop itself has no
  // reduction in it and vectorises like update_range.
  // On a device, where every thread's arrays are local memory reserved for every resident
  // thread, 32 (the same bits: lanes and column sums do not depend on it, only sub % 16 == 0).
  constexpr std::size_t sub = DISTOPT_DEVICE_CODE ? 32 : 256;
  float emitted[OUT > 0 ? OUT : 1][sub];
  const typename Policy::scalars s = sc;
  const float scale = a.grad_scale;
  std::size_t i = 0;
  while (i < n) {
    const std::size_t t = a.first + i;  // tensor index
    const std::size_t to_block = a.block - t % a.block;
    std::size_t seg = n - i < to_block ? n - i : to_block;
    std::size_t row = 0, col = 0;
    if constexpr (Factored) {
      const std::size_t to_row = a.cols - t % a.cols;
      seg = seg < to_row ? seg : to_row;
      row = t / a.cols;
      col = (t / a.matrix) * a.cols + t % a.cols;
      if constexpr (CS > 0) {
        // A row may come in several segments (block cuts, pieces): count each row once.
        column_window& w = *a.window;
        if (w.last_row != row) {  // a new matrix starts a new row
          if (w.matrix != t / a.matrix || w.rows == column_window::max_rows) {
            fold_matrix(w, a.col_sums, CS, a.cols, a.col_first, a.col_count);
            w.matrix = t / a.matrix;
          }
          w.last_row = row;
          ++w.rows;
        }
      }
    }
    float rv[RV > 0 ? RV : 1] = {};
    for (int k = 0; k < RV; ++k) rv[k] = a.row_values[k][row];
    double tl[TS > 0 ? TS : 1][sum_lanes] = {};
    double rl[RS > 0 ? RS : 1][sum_lanes] = {};
    for (std::size_t b = i; b < i + seg; b += sub) {
      const std::size_t m = i + seg - b < sub ? i + seg - b : sub;
      const std::size_t c0 = col + (b - i);
      for (std::size_t jj = 0; jj < m; ++jj) {
        float out[OUT > 0 ? OUT : 1] = {};
        layer_element<Policy, Phase, Factored, Mode, Param, Grad, Enc, Absent, Kept>(s, a, b + jj, c0 + jj, rv, scale, out);
        for (int k = 0; k < OUT; ++k) emitted[k][jj] = out[k];
      }
      // b - i is a multiple of 16 (sub is), so value j of the segment lands in lane j % 16.
      static_assert(sub % sum_lanes == 0);
      for (int k = 0; k < TS; ++k) add_to_lanes(tl[k], emitted[k], m);
      for (int k = 0; k < RS; ++k) add_to_lanes(rl[k], emitted[spec.tensor_sums + k], m);
      for (int k = 0; k < CS; ++k) {
        const std::size_t at = k * a.col_count + (c0 - a.col_first);
        float rest[sub];
        if (add_to_windows(a.window->acc + at, a.window->lo + at, emitted[spec.tensor_sums + spec.row_sums + k], rest, m))
          add_misses(a.col_sums + at, a.window->lo + at, rest, m);
      }
    }
    for (int k = 0; k < TS; ++k) a.tensor_sums[k].add(combine_lanes(tl[k]));
    for (int k = 0; k < RS; ++k) a.row_sums[k * a.row_count + (row - a.row_first)].add(combine_lanes(rl[k]));
    i += seg;
  }
}

/// layer_range_body, in a version for this CPU (DISTOPT_CPU_CLONES, DISTOPT_CPU_DISPATCH).
template <class Policy, int Phase, bool Factored, param_mode Mode, class Param, class Grad, class Enc,
          bool Absent = false, unsigned Kept = ~0u>
DISTOPT_HD DISTOPT_CPU_CLONES void layer_range(const typename Policy::scalars& sc, const layer_args<Param, Grad, Enc>& a,
                                               std::size_t n) {
  DISTOPT_CPU_DISPATCH(layer_range_body<Policy, Phase, Factored, Mode, Param, Grad, Enc, Absent, Kept>(sc, a, n));
}

}  // namespace distopt::detail
