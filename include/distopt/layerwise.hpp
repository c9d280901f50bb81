// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What a layer-wise policy (Lamb, Adafactor, CAME) declares and sees: the phases of
/// its step, the statistics each phase needs, and the per-tensor view its host hooks get.
///
/// A layer-wise step runs the policy's phases in order. Each phase is one pass over the
/// elements (the policy's `DISTOPT_HD element<Phase, Factored>` function), which may emit
/// values to be summed per tensor, per row or per column of a factored matrix. The engine
/// sums them exactly (detail::fixed_sum) over the local shard, all-reduces them over the
/// data-parallel ranks that share the tensor and over the tensor-parallel group where the
/// tensor is split along the summed axis, and then calls the policy's host hooks for each
/// tensor: `update_factors<Phase>` (optional: update persistent row/column states from the
/// sums) and `finish<Phase>` (compute the values the next phases read). The next phase's
/// element function reads those values through `element_stats`.

#include <array>
#include <cstddef>
#include <span>

namespace distopt {

/// One pass over the elements of a layer-wise policy.
struct phase_spec {
  int tensor_sums = 0;  ///< values summed over the whole tensor
  int row_sums = 0;     ///< values summed over each row of a factored matrix (over its columns)
  int col_sums = 0;     ///< values summed over each column (over its rows)
  bool reads_param = true;    ///< the element function reads the param (else it sees 0)
  bool writes_param = false;  ///< the element function's param is stored (the last phase)
  unsigned reads_slots = 0;   ///< bit k: state slot k is loaded (else it reads as 0)
  unsigned writes_slots = 0;  ///< bit k: state slot k is stored
  /// After update_factors: the exact sum over the rows of each matrix of every row state,
  /// available to finish as `row_state_total`.
  bool row_state_totals = false;
};

/// What an element function sees of the statistics: the values the host hooks computed
/// for its tensor, its row and its column (row and col only for factored tensors).
struct element_stats {
  const float* tensor;
  const float* row;
  const float* col;
};

/// The host hooks' view of one tensor in one phase. Counts are of the whole logical
/// tensor (all tensor-parallel ranks); the spans hold this rank's rows and columns.
/// A tensor of shape [..., R, C] is `matrices` = prod(leading dims) matrices of R x C;
/// its row statistics are indexed [matrix * local_rows + row], its columns likewise.
struct tensor_stats {
  bool factored = false;
  std::size_t numel = 0;
  std::size_t matrices = 1, rows = 0, cols = 0;
  std::size_t local_rows = 0, local_cols = 0;
  int group = 0;
  std::span<const double> sums;                          ///< this phase's tensor sums
  std::array<std::span<const double>, 4> row_sums{}, col_sums{};
  std::array<std::span<float>, 4> row_state{}, col_state{};  ///< persistent between steps
  std::array<std::span<const double>, 4> row_state_total{};  ///< per matrix (row_state_totals)
  std::span<float> values;                               ///< read by element functions as `tensor`
  std::array<std::span<float>, 4> row_values{}, col_values{};
};

}  // namespace distopt
