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

/// The AVX-512 block decoder below, chosen at run time where the CPU has AVX-512 BW and
/// VBMI (GCC on x86-64, host code only; never with -DDISTOPT_NO_Q8_AVX512).
/// DISTOPT_HAS_Q8_AVX512_PATH says whether this build has it (1 or 0).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    defined(__x86_64__) && !defined(DISTOPT_NO_Q8_AVX512)
#define DISTOPT_HAS_Q8_AVX512_PATH 1
#include <immintrin.h>
#else
#define DISTOPT_HAS_Q8_AVX512_PATH 0
#endif

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
  /// Each slot's map as byte planes (q8_codebook::planes), for the AVX-512 decoder; null
  /// (the portable loops) on device executors.
  const std::uint8_t* planes[4] = {};
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

#if DISTOPT_HAS_Q8_AVX512_PATH
/// decode_block with AVX-512 VBMI, the same bits (tests/unit/q8.cpp compares them). Out of
/// line, with its own target: the function clones' x86-64-v4 has no VBMI. The encode has no
/// such twin: a vpgatherdd encode through q8_nearest's table was no faster than the
/// x86-64-v4 clone of encode_block on a Zen 4, and a gather-free binary search over the
/// thresholds was slower (bench/RESULTS.md, "The AVX-512 decode wired in").
namespace q8_avx512 {
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports in the caller (GCC bug 105593, fixed in GCC 13); and a caller's constant length
// propagated into the tail loop draws a false -Waggressive-loop-optimizations. Not in
// users' builds.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"

/// decode_block's bits: the map's four byte planes (q8_codebook::planes) looked up by
/// vpermi2b, 64 codes at a time. Each plane of 256 bytes is four registers; two two-source
/// byte permutes and a blend on the code's top bit give a byte of each of 64 values. The
/// codes are first reordered (vpermb) so that the unpacks of the four planes' bytes, which
/// work within 128-bit lanes, come out as 64 floats in element order. Then map[code] * absmax.
/// A tail of fewer than 64 codes goes through the portable decode_block and `map`.
__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) inline void decode_block(
    const float* map, const std::uint8_t* planes, const std::uint8_t* code, float absmax, std::size_t m,
    float* out) noexcept {
  // Byte p = 16 L + 4 q + j (lane L, quarter q, column j) takes code 16 q + 4 L + j.
  alignas(64) static constexpr std::uint8_t order[64] = {
      0, 1, 2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
      22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
      56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i reorder = _mm512_load_si512(order);
  const __m512 scale = _mm512_set1_ps(absmax);
  __m512i plane[4][4];
  for (int k = 0; k < 4; ++k)
    for (int q = 0; q < 4; ++q) plane[k][q] = _mm512_loadu_si512(planes + 256 * k + 64 * q);
  std::size_t i = 0;
  for (; i + 64 <= m; i += 64) {
    const __m512i c = _mm512_permutexvar_epi8(reorder, _mm512_loadu_si512(code + i));
    const __mmask64 upper = _mm512_movepi8_mask(c);  // codes 128-255
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
      b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(plane[k][0], c, plane[k][1]),
                                    _mm512_permutex2var_epi8(plane[k][2], c, plane[k][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i v[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + i + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(v[r]), scale));
  }
  detail::decode_block(map, code + i, absmax, m - i, out + i);
}

#pragma GCC diagnostic pop
}  // namespace q8_avx512
#endif

namespace q8_avx512 {
/// Whether update_range_q8 decodes through q8_avx512::decode_block: this build has it and
/// this CPU runs it.
inline bool available() noexcept {
#if DISTOPT_HAS_Q8_AVX512_PATH
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
#else
  return false;
#endif
}
}  // namespace q8_avx512

/// Updates the `n` elements `a` points to, with N quantized state slots.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
DISTOPT_HD DISTOPT_CPU_CLONES void update_range_q8(const typename Policy::scalars& sc, const q8_args<Param, Grad>& a,
                                        std::size_t n) {
  constexpr std::size_t B = q8::block;
  constexpr int S = N > 0 ? N : 1;
  const typename Policy::scalars s = sc;
  const float scale = a.grad_scale;
#if DISTOPT_HAS_Q8_AVX512_PATH
  const bool simd = q8_avx512::available();
#endif
  for (std::size_t b0 = 0, blk = 0; b0 < n; b0 += B, ++blk) {
    const std::size_t m = n - b0 < B ? n - b0 : B;
    Param* DISTOPT_RESTRICT p = a.param + b0;
    const Grad* DISTOPT_RESTRICT g = a.grad + b0;
    float* DISTOPT_RESTRICT mw = Mode == param_mode::master ? a.master + b0 : nullptr;
    // Decode each slot's block, update in place (fresh holds the old values, then the new).
    alignas(64) float fresh[S][B];
    for (int k = 0; k < N; ++k) {
#if DISTOPT_HAS_Q8_AVX512_PATH
      if (simd && a.planes[k]) {
        q8_avx512::decode_block(a.map[k], a.planes[k], a.code[k] + b0, a.absmax[k][blk], m, fresh[k]);
        continue;
      }
#endif
      decode_block(a.map[k], a.code[k] + b0, a.absmax[k][blk], m, fresh[k]);
    }
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
