// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file distopt::norm_part: one optimizer's part of a global gradient norm that spans
/// more than one optimizer (distopt::joint_step, <distopt/joint_step.hpp>).

#include <cmath>
#include <span>

#include "detail/exact_sum.hpp"

namespace distopt {

/// The exact sum of the squares of an optimizer's reduced, unscaled grads over the ranks
/// it spans (its data-parallel and tensor-parallel groups), as the wire image that ranks
/// all-reduce (a sum of integers below 2^32: exact in any order). Parts add exactly, so a
/// norm over several optimizers has the bits of one optimizer that held every tensor.
class norm_part {
 public:
  static constexpr int wire_size = detail::exact_sum::wire_size;

  /// No grads: a norm of 0. `computed` false: the optimizer needs no norm (no finite
  /// check, no clipping), and the part holds nothing.
  explicit norm_part(bool computed = true) noexcept : computed_(computed) {}

  /// Whether the optimizer computed it (it checks finiteness or clips by norm).
  bool computed() const noexcept { return computed_; }
  /// The wire image, for an all-reduce (sum) over ranks that hold other tensors.
  std::span<double, wire_size> wire() noexcept { return wire_; }
  std::span<const double, wire_size> wire() const noexcept { return wire_; }

  /// Adds another part exactly.
  norm_part& operator+=(const norm_part& o) noexcept {
    detail::exact_sum s = detail::exact_sum::from_wire(wire());
    s.add(detail::exact_sum::from_wire(o.wire()));
    s.to_wire(wire());
    computed_ = computed_ || o.computed_;
    return *this;
  }
  /// The L2 norm: the square root of the exact sum, rounded once (NaN or Inf where a grad was).
  double norm() const noexcept { return std::sqrt(detail::exact_sum::from_wire(wire()).value()); }

 private:
  double wire_[wire_size] = {};
  bool computed_ = true;
};

}  // namespace distopt
