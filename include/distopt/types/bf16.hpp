// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file bfloat16: the upper half of an IEEE binary32, converted with pure integer bit
/// manipulation so host and device round identically.

#include <cstdint>

#include <distopt/config.hpp>

namespace distopt {

namespace detail {

/// Rounds a binary32 bit pattern to bfloat16 bits, to nearest with ties to even.
/// NaNs stay NaN (quietened, sign and upper payload kept); values at or above
/// max_bf16 + ulp/2 round to infinity, as IEEE requires.
DISTOPT_HD constexpr std::uint16_t float_bits_to_bf16_bits(std::uint32_t u) noexcept {
  // Adding 0x7fff (+1 when the kept lsb is odd) carries exactly when the dropped half
  // exceeds one half-ulp, or equals it with an odd lsb; the carry may ripple into the
  // exponent, which is the correct rounding up to the next binade or to infinity.
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // Truncating a NaN could drop every payload bit and turn it into an infinity.
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  // A select rather than an early return keeps conversion loops free of control flow.
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

} // namespace detail

/// A bfloat16 number: 1 sign, 8 exponent and 7 mantissa bits. Trivially copyable,
/// standard layout, two bytes; `bits` is the raw encoding.
struct bf16 {
  /// The raw encoding.
  std::uint16_t bits;

  /// Leaves `bits` uninitialised, like a built-in number type.
  bf16() = default;

  /// Rounds `f` to the nearest bfloat16, ties to even.
  DISTOPT_HD constexpr explicit bf16(float f) noexcept
      : bits(detail::float_bits_to_bf16_bits(__builtin_bit_cast(std::uint32_t, f))) {}

  /// The bfloat16 with encoding `b`.
  DISTOPT_HD static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 r{};
    r.bits = b;
    return r;
  }

  /// The exact float value (every bfloat16 is a float).
  DISTOPT_HD constexpr explicit operator float() const noexcept {
    return __builtin_bit_cast(float, static_cast<std::uint32_t>(bits) << 16);
  }
};

static_assert(sizeof(bf16) == 2);

/// The exact float value of `x`.
DISTOPT_HD constexpr float to_float(bf16 x) noexcept { return static_cast<float>(x); }

} // namespace distopt
