// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Conversions between float and the storage types that the update engine uses:
/// round-to-nearest-even, and stochastic rounding driven by a stateless counter hash.

#include <cstdint>
#include <type_traits>

#include <distopt/config.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/dtype.hpp>
#include <distopt/types/fp16.hpp>

namespace distopt {

/// Rounds `x` to the nearest `T`, ties to even; the identity for float.
template <number T>
DISTOPT_HD constexpr T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

/// The identity, so generic code can call `to_float` on every `number`.
DISTOPT_HD constexpr float to_float(float x) noexcept { return x; }

namespace detail {

/// The splitmix64 finaliser: a bijection on 64 bits with full avalanche.
DISTOPT_HD constexpr std::uint64_t splitmix64_finalise(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The stochastic-rounding key of step `step` (counting from 1) under `seed`: the same on
/// the host and on the device, for every way of deciding the step.
DISTOPT_HD constexpr std::uint64_t step_key(std::uint64_t seed, std::int64_t step) noexcept {
  return splitmix64_finalise(seed ^ splitmix64_finalise(static_cast<std::uint64_t>(step)));
}

/// 32 well-mixed random bits for element `counter` of stream `key`. Stateless, so a
/// value depends only on (key, counter), never on how the work was split across threads.
/// The per-element work is 32-bit only (an odd multiply, then a 32-bit avalanche hash), so
/// that loops calling it vectorise; the 64-bit key mixing is loop-invariant.
DISTOPT_HD constexpr std::uint32_t mix32(std::uint64_t key, std::uint64_t counter) noexcept {
  const std::uint64_t k = splitmix64_finalise(key ^ 0x6a09e667f3bcc909ull);
  // Distinct counters below 2^32 stay distinct within one key: odd multiply and xor are
  // bijections on 32 bits; the high half of the counter is folded in through the key word.
  std::uint32_t x = static_cast<std::uint32_t>(counter) * 0x9e3779b9u;
  x ^= static_cast<std::uint32_t>(k) ^ (static_cast<std::uint32_t>(counter >> 32) * 0x85ebca6bu);
  x += static_cast<std::uint32_t>(k >> 32);
  // A 32-bit avalanche (xorshift-multiply rounds).
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

} // namespace detail

/// Rounds `x` to one of its two bfloat16 neighbours, away from zero with probability
/// equal to the distance from the one nearer zero in ulps, using the low 16 bits of
/// `random_bits`; so E[result] == x. Exact bfloat16 values never change.
/// NaN stays NaN (quietened) and infinities pass through. A finite `x` reaches infinity
/// only when |x| exceeds the largest finite bfloat16: infinity is then treated as the
/// next value up (2^128), as round-to-nearest also does.
DISTOPT_HD constexpr bf16 stochastic_round_bf16(float x, std::uint32_t random_bits) noexcept {
  const auto u = __builtin_bit_cast(std::uint32_t, x);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    return bf16::from_bits(detail::float_bits_to_bf16_bits(u));
  }
  // Sign-magnitude: adding to the pattern grows |x|, and the carry into bit 16 happens
  // with probability (low 16 bits) / 2^16, uniformly across binade and subnormal edges.
  return bf16::from_bits(static_cast<std::uint16_t>((u + (random_bits & 0xffffu)) >> 16));
}

/// Rounds `x` to one of its two binary16 neighbours, away from zero with probability
/// equal to the distance from the one nearer zero in ulps, so E[result] == x; exact
/// binary16 values never change. NaN stays NaN (quietened) and infinities pass through.
/// Values between 65504 and 2^16 reach infinity with probability (|x| - 65504) / 32, and
/// |x| >= 2^16 overflows to infinity, as round-to-nearest does. Uses the low 13 bits of
/// `random_bits` in the normal range, up to all 32 for subnormals; below |x| < 2^-32 the
/// round-up probability (< 2^-8) is truncated to a multiple of 2^-32.
DISTOPT_HD constexpr fp16 stochastic_round_fp16(float x, std::uint32_t random_bits) noexcept {
  const auto u = __builtin_bit_cast(std::uint32_t, x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {
    return fp16::from_bits(detail::float_bits_to_fp16_bits(u));
  }
  if (a >= 0x38800000u) {  // normal binary16 range: drop 13 bits stochastically
    std::uint32_t h = (a - 0x38000000u + (random_bits & 0x1fffu)) >> 13;
    h = h < 0x7c00u ? h : 0x7c00u;
    return fp16::from_bits(static_cast<std::uint16_t>(sign | h));
  }
  // Subnormal binary16: |x| = m * 2^(e-150); the result is in units of 2^-24.
  const std::uint32_t e_field = a >> 23;
  const std::uint32_t e = e_field == 0u ? 1u : e_field;
  const std::uint32_t m = e_field == 0u ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
  const std::uint32_t s = 126u - e;  // 14..125
  std::uint32_t q = 0;
  if (s < 32u) {
    const std::uint64_t mask = (std::uint64_t{1} << s) - 1u;
    q = static_cast<std::uint32_t>((m >> s) + (((m & mask) + (random_bits & mask)) >> s));
  } else {
    // Round-up probability m * 2^-s, truncated to p * 2^-32; like the branch above,
    // large random bits round up, so all-ones always rounds up when p > 0.
    const std::uint32_t p = (s - 32u) < 32u ? (m >> (s - 32u)) : 0u;
    q = (p != 0u && random_bits >= 0u - p) ? 1u : 0u;
  }
  return fp16::from_bits(static_cast<std::uint16_t>(sign | q));
}

} // namespace distopt
