// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The factored second-moment bookkeeping Adafactor and CAME share: moving averages
/// of row and column means, and the rank-1 approximation's row and column factors.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "../config.hpp"
#include "../layerwise.hpp"

namespace distopt::detail {

/// Factored when the tensor has two or more dimensions (transformers' and came-pytorch's rule).
inline bool has_matrix_shape(std::span<const std::int64_t> shape) { return shape.size() >= 2; }

/// state = state * beta + mean * (1 - beta), mean = sum / count (torch: mul_(beta).add_(mean, alpha)).
inline void moving_average_of_means(std::span<float> state, std::span<const double> sums, double count,
                                    float beta, float one_minus_beta) {
  for (std::size_t i = 0; i < state.size(); ++i) {
    const float mean = static_cast<float>(sums[i] / count);
    state[i] = state[i] * beta + one_minus_beta * mean;
  }
}

/// Updates row state `k` from row sums `k` (over columns) and col state `k` from col sums
/// `k` (over rows), each a moving average of means with `beta`.
inline void update_factor_states(tensor_stats& t, int k, int sums, float beta, float one_minus_beta) {
  moving_average_of_means(t.row_state[k], t.row_sums[sums], static_cast<double>(t.cols), beta, one_minus_beta);
  moving_average_of_means(t.col_state[k], t.col_sums[sums], static_cast<double>(t.rows), beta, one_minus_beta);
}

/// The factors of the rank-1 approximation of 1 / sqrt(second moment): per row
/// rsqrt(row / mean(rows of its matrix)) and per column rsqrt(col), as
/// transformers' and came-pytorch's _approx_sq_grad.
inline void approx_factors(tensor_stats& t, int k, int out) {
  const std::size_t rows = t.local_rows, cols = t.local_cols;
  for (std::size_t b = 0; b < t.matrices; ++b) {
    const float mean = static_cast<float>(t.row_state_total[k][b] / static_cast<double>(t.rows));
    for (std::size_t i = 0; i < rows; ++i)
      t.row_values[out][b * rows + i] = 1.0f / std::sqrt(t.row_state[k][b * rows + i] / mean);
    for (std::size_t j = 0; j < cols; ++j)
      t.col_values[out][b * cols + j] = 1.0f / std::sqrt(t.col_state[k][b * cols + j]);
  }
}

/// The unclipped update of Adafactor and CAME: (row factor * column factor) * grad for a
/// factored tensor (factors in row[0] and col[0]), rsqrt(second moment v) * grad otherwise.
template <bool Factored>
DISTOPT_HD float factored_update(const element_stats& e, float g, float v) {
  if constexpr (Factored) return (e.row[0] * e.col[0]) * g;
  else return (1.0f / std::sqrt(v)) * g;
}

/// RMS of a tensor from its sum of squares, as torch's `norm(2) / numel ** 0.5` in fp32.
inline float rms_from_sum(double sum_of_squares, std::size_t numel) {
  return static_cast<float>(std::sqrt(sum_of_squares)) / static_cast<float>(std::sqrt(static_cast<double>(numel)));
}

}  // namespace distopt::detail
