// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file IEEE binary16, converted with pure integer bit manipulation (no _Float16, no
/// __half) so host and device give bit-identical results.

#include <cstdint>

#include <distopt/config.hpp>

namespace distopt {

namespace detail {

/// Rounds a binary32 bit pattern to binary16 bits, to nearest with ties to even,
/// including binary16 subnormals. NaNs stay NaN (quietened, sign and upper payload kept).
/// Every case is computed and the result selected, with no branches, so that loops of
/// conversions (and the fused optimizer loops that store fp16) vectorise.
DISTOPT_HD constexpr std::uint16_t float_bits_to_fp16_bits(std::uint32_t u) noexcept {
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  // Normal binary16: rebias the exponent, round off 13 bits (the carry may reach infinity).
  const std::uint32_t rebased = a - 0x38000000u;
  const std::uint32_t normal = (rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13;
  // Subnormal binary16 (units of 2^-24): value = m * 2^(e-150) -> round(m >> (126 - e)),
  // ties to even; a shift of 25 or more leaves zero. The shift is clamped to [1, 31] so
  // that it is defined for every input, including those the select below discards.
  const std::uint32_t e = a >> 23;
  const std::uint32_t shift = e >= 125u ? 1u : (e <= 95u ? 31u : 126u - e);
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  // Comparisons as 0/1 integers: GCC does not vectorise bool arithmetic mixed with uint32.
  const std::uint32_t above = static_cast<std::uint32_t>(rem > half);
  const std::uint32_t tie = static_cast<std::uint32_t>(rem == half);
  const std::uint32_t sub = q + (above | (tie & q & 1u));  // may reach 0x400, still right
  // 65520 = 65504 + ulp/2 is a tie whose even neighbour is 2^16, i.e. infinity.
  const std::uint32_t bits = a > 0x7f800000u   ? nan
                             : a >= 0x477ff000u ? 0x7c00u
                             : a >= 0x38800000u ? normal
                                                : sub;
  return static_cast<std::uint16_t>(sign | bits);
}

/// The binary32 bit pattern of the value encoded by binary16 bits `h` (exact), branch-free.
/// A NaN stays NaN with its sign and payload, quietened, as IEEE 754's convertFormat and the
/// F16C instruction vcvtph2ps do (the array path of detail/fp16_arrays.hpp).
DISTOPT_HD constexpr std::uint32_t fp16_bits_to_float_bits(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  // inf, or a NaN with its payload and the quiet bit
  const std::uint32_t special = 0x7f800000u | (m << 13) | (m != 0u ? 0x400000u : 0u);
  const std::uint32_t normal = ((e + 112u) << 23) | (m << 13);
  // Subnormal m * 2^-24, normalised with integer operations only (no float arithmetic,
  // which GCC will not if-convert under -ftrapping-math): shift = 10 - floor(log2 m).
  std::uint32_t shift = 1u;
  for (std::uint32_t k = 1u; k < 10u; ++k) shift += static_cast<std::uint32_t>(m < (1u << k));
  const std::uint32_t sub =
      m == 0u ? 0u : ((113u - shift) << 23) | (((m << shift) & 0x3ffu) << 13);
  return sign | (e == 0x1fu ? special : e != 0u ? normal : sub);
}

} // namespace detail

/// An IEEE binary16 number: 1 sign, 5 exponent and 10 mantissa bits. Trivially
/// copyable, standard layout, two bytes; `bits` is the raw encoding.
struct fp16 {
  /// The raw encoding.
  std::uint16_t bits;

  /// Leaves `bits` uninitialised, like a built-in number type.
  fp16() = default;

  /// Rounds `f` to the nearest binary16, ties to even; overflow gives infinity.
  DISTOPT_HD constexpr explicit fp16(float f) noexcept
      : bits(detail::float_bits_to_fp16_bits(__builtin_bit_cast(std::uint32_t, f))) {}

  /// The binary16 with encoding `b`.
  DISTOPT_HD static constexpr fp16 from_bits(std::uint16_t b) noexcept {
    fp16 r{};
    r.bits = b;
    return r;
  }

  /// The exact float value (every binary16 is a float; a NaN comes back quietened).
  DISTOPT_HD constexpr explicit operator float() const noexcept {
    return __builtin_bit_cast(float, detail::fp16_bits_to_float_bits(bits));
  }
};

static_assert(sizeof(fp16) == 2);

/// The exact float value of `x`.
DISTOPT_HD constexpr float to_float(fp16 x) noexcept { return static_cast<float>(x); }

} // namespace distopt
