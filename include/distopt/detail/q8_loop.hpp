// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The fused per-element loop over 8-bit block-wise states: per block of 256
/// elements, decode each state (map[code] * absmax), run the policy's update in fp32, keep
/// the new values in a block-sized buffer while their absolute maximum is found, then
/// write the new absmax and the nearest codes. One pass over memory; the only fp32 copy
/// of the state is one block's, on the stack.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "../config.hpp"
#include "../storage/q8_encoding.hpp"
#include "../types/rounding.hpp"
#include "q8_map.hpp"
#include "update_loop.hpp"

namespace distopt::detail {

/// One run of elements (a piece of one tensor, starting on a block boundary) with
/// quantized states: codes per element, absmax per block, and each slot's map.
template <class Param, class Grad>
struct q8_args {
  Param* param;
  const Grad* grad;
  float* master;
  std::uint8_t* code[4];
  float* absmax[4];
  const float* map[4];            ///< 256 values of each slot's map
  const std::int32_t* lut[4];  ///< each slot's lookup table (q8_codebook::lookup)
  float grad_scale;
  std::uint64_t random_key;
  std::size_t random_base;
};

/// The absolute maximum of x[0, m) as the bit pattern of a float: non-negative floats
/// order like their bit patterns, so an integer max reduction (which vectorises, where a
/// float max reduction needs -ffast-math) finds it. A NaN gives a NaN absmax.
DISTOPT_HD DISTOPT_INLINE float block_absmax(const float* DISTOPT_RESTRICT x, std::size_t m) {
  std::uint32_t top = 0;
  for (std::size_t i = 0; i < m; ++i) {
    const std::uint32_t mag = __builtin_bit_cast(std::uint32_t, x[i]) & 0x7fffffffu;  // device code too
    top = top > mag ? top : mag;
  }
  return __builtin_bit_cast(float, top);
}

/// Decodes one block of one slot: map[code] * absmax.
DISTOPT_HD DISTOPT_INLINE void decode_block(const float* DISTOPT_RESTRICT map, const std::uint8_t* DISTOPT_RESTRICT code,
                                 float absmax, std::size_t m, float* DISTOPT_RESTRICT out) {
  for (std::size_t i = 0; i < m; ++i) out[i] = map[code[i]] * absmax;
}

/// Decodes n codes laid out in blocks of q8::block: out[i] = map[codes[i]] * absmax[i / block].
inline void decode_blocks(const float* map, const std::uint8_t* codes, const float* absmax, std::size_t n, float* out) {
  for (std::size_t b0 = 0; b0 < n; b0 += q8::block)
    decode_block(map, codes + b0, absmax[b0 / q8::block], std::min(q8::block, n - b0), out + b0);
}

/// Writes the nearest codes of x[0, m) * inv through one slot's lookup table.
DISTOPT_HD DISTOPT_INLINE void encode_block(const float* DISTOPT_RESTRICT x, float inv, std::size_t m,
                                 const std::int32_t* DISTOPT_RESTRICT lut, std::uint8_t* DISTOPT_RESTRICT out) {
  for (std::size_t i = 0; i < m; ++i) out[i] = q8_codebook::q8_nearest(lut, x[i] * inv);
}

/// Stores one block's new values x[0, m): their absmax, then the nearest codes of x / absmax.
DISTOPT_HD DISTOPT_INLINE void requantize_block(const float* DISTOPT_RESTRICT x, std::size_t m, const std::int32_t* lut,
                                     float& absmax, std::uint8_t* DISTOPT_RESTRICT out) {
  const float amax = block_absmax(x, m);
  absmax = amax;
  encode_block(x, amax > 0.0f ? 1.0f / amax : 0.0f, m, lut, out);
}

/// Updates the `n` elements `a` points to, with N quantized state slots.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
DISTOPT_HD DISTOPT_CPU_CLONES void update_range_q8(const typename Policy::scalars& sc, const q8_args<Param, Grad>& a,
                                        std::size_t n) {
  constexpr std::size_t B = q8::block;
  constexpr int S = N > 0 ? N : 1;
  const typename Policy::scalars s = sc;
  const float scale = a.grad_scale;
  for (std::size_t b0 = 0, blk = 0; b0 < n; b0 += B, ++blk) {
    const std::size_t m = n - b0 < B ? n - b0 : B;
    Param* DISTOPT_RESTRICT p = a.param + b0;
    const Grad* DISTOPT_RESTRICT g = a.grad + b0;
    float* DISTOPT_RESTRICT mw = Mode == param_mode::master ? a.master + b0 : nullptr;
    // Decode each slot's block, update in place (fresh holds the old values, then the new).
    alignas(64) float fresh[S][B];
    for (int k = 0; k < N; ++k) decode_block(a.map[k], a.code[k] + b0, a.absmax[k][blk], m, fresh[k]);
    float* DISTOPT_RESTRICT f0 = fresh[0];
    float* DISTOPT_RESTRICT f1 = fresh[N > 1 ? 1 : 0];
    float* DISTOPT_RESTRICT f2 = fresh[N > 2 ? 2 : 0];
    float* DISTOPT_RESTRICT f3 = fresh[N > 3 ? 3 : 0];
    for (std::size_t i = 0; i < m; ++i)
      update_one<Policy, N, Mode>(s, p, g, mw, f0, f1, f2, f3, i, scale, a.random_key, a.random_base + b0);
    for (int k = 0; k < N; ++k) requantize_block(fresh[k], m, a.lut[k], a.absmax[k][blk], a.code[k] + b0);
  }
}

}  // namespace distopt::detail
