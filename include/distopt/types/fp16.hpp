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
DISTOPT_HD constexpr std::uint16_t float_bits_to_fp16_bits(std::uint32_t u) noexcept {
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  // 65520 = 65504 + ulp/2 is a tie whose even neighbour is 2^16, i.e. infinity.
  if (a >= 0x477ff000u) {
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) {  // normal binary16: rebias the exponent, round off 13 bits
    std::uint32_t h = a - 0x38000000u;
    h += 0xfffu + ((h >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (h >> 13));
  }
  // Subnormal binary16 (units of 2^-24): value = m * 2^(e-150) -> round(m >> (126 - e)).
  // Below 2^-25 (e < 102) everything rounds to zero; 2^-25 itself is a tie to even zero.
  const std::uint32_t e = a >> 23;
  if (e < 102u) {
    return sign;
  }
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t s = 126u - e;  // 14..24
  std::uint32_t q = m >> s;
  const std::uint32_t rem = m & ((1u << s) - 1u);
  const std::uint32_t half = 1u << (s - 1u);
  if (rem > half || (rem == half && (q & 1u) != 0u)) {
    ++q;  // may reach 0x400, the smallest normal: still the right encoding
  }
  return static_cast<std::uint16_t>(sign | q);
}

/// The binary32 bit pattern of the value encoded by binary16 bits `h` (exact).
DISTOPT_HD constexpr std::uint32_t fp16_bits_to_float_bits(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  std::uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) {
    return sign | 0x7f800000u | (m << 13);  // inf, or NaN with its payload
  }
  if (e != 0u) {
    return sign | ((e + 112u) << 23) | (m << 13);
  }
  if (m == 0u) {
    return sign;
  }
  // Subnormal m * 2^-24: normalise so the leading one becomes the implicit bit.
  std::uint32_t fe = 113u;  // float exponent field of 2^-14, decremented per shift
  while ((m & 0x400u) == 0u) {
    m <<= 1;
    --fe;
  }
  return sign | (fe << 23) | ((m & 0x3ffu) << 13);
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

  /// The exact float value (every binary16 is a float).
  DISTOPT_HD constexpr explicit operator float() const noexcept {
    return __builtin_bit_cast(float, detail::fp16_bits_to_float_bits(bits));
  }
};

static_assert(sizeof(fp16) == 2);

/// The exact float value of `x`.
DISTOPT_HD constexpr float to_float(fp16 x) noexcept { return static_cast<float>(x); }

} // namespace distopt
