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
#include <limits>
#include <utility>

#include "../config.hpp"
#include "../storage/q8_encoding.hpp"
#include "../types/rounding.hpp"
#include "q8_map.hpp"
#include "update_loop.hpp"

/// The AVX-512 block decoder and encoder below, chosen at run time where the CPU has AVX-512
/// BW and VBMI (GCC and Clang on x86-64, host code only; never with -DDISTOPT_NO_Q8_AVX512).
/// DISTOPT_HAS_Q8_AVX512_PATH says whether this build has it (1 or 0).
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__HIPCC__) && defined(__x86_64__) && \
    !defined(DISTOPT_NO_Q8_AVX512)
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
  /// Each slot's AVX-512 tables (q8_codebook::simd); null (the portable loops) on device
  /// executors.
  const q8_simd_tables* simd[4] = {};
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
/// decode_block and requantize_block with AVX-512 VBMI, the same bits (tests/unit/q8.cpp
/// compares them). Out of line, with their own target: the function clones' x86-64-v4 has no
/// VBMI.
namespace q8_avx512 {
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports in the caller (GCC bug 105593, fixed in GCC 13); and a caller's constant length
// propagated into the tail loop draws a false -Waggressive-loop-optimizations. Not in
// users' builds.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"
#endif

/// Byte p = 16 L + 4 q + j (lane L, quarter q, column j) of 64 bytes takes byte 16 q + 4 L + j.
/// It is its own inverse. Bytes in this order come out of the 128-bit-lane unpacks of four
/// byte planes as four registers of 16 floats in element order; and packing four registers
/// of 16 int32 (packus 32 to 16, then 16 to 8) leaves their bytes in this order.
alignas(64) inline constexpr std::uint8_t lane_order[64] = {
    0, 1, 2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
    22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
    56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

/// The 32-bit entries of a 256-entry table held as four byte planes (four registers each),
/// for 64 indices in lane_order: per plane two vpermi2b and a blend on the index's top bit,
/// then byte unpacks. out[r] holds the entries of indices 16 r to 16 r + 15 in element order.
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void lookup_planes(
    const __m512i (&plane)[4][4], __m512i idx, __m512i (&out)[4]) noexcept {
  const __mmask64 upper = _mm512_movepi8_mask(idx);  // indices 128-255
  __m512i b[4];
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(plane[k][0], idx, plane[k][1]),
                                  _mm512_permutex2var_epi8(plane[k][2], idx, plane[k][3]));
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_unpacklo_epi16(lo01, lo23);
  out[1] = _mm512_unpackhi_epi16(lo01, lo23);
  out[2] = _mm512_unpacklo_epi16(hi01, hi23);
  out[3] = _mm512_unpackhi_epi16(hi01, hi23);
}

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline void load_planes(
    const std::uint8_t (&planes)[4][256], __m512i (&plane)[4][4]) noexcept {
  for (int k = 0; k < 4; ++k)
    for (int q = 0; q < 4; ++q) plane[k][q] = _mm512_load_si512(planes[k] + 64 * q);
}

/// decode_block's bits: map[code] looked up in the value planes, 64 codes at a time, times
/// absmax. A tail of fewer than 64 codes goes through the portable decode_block and `map`.
DISTOPT_HOT_LOOP __attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) inline void decode_block(
    const float* map, const q8_simd_tables& t, const std::uint8_t* code, float absmax, std::size_t m,
    float* out) noexcept {
  const __m512i order = _mm512_load_si512(lane_order);
  const __m512 scale = _mm512_set1_ps(absmax);
  __m512i plane[4][4];
  load_planes(t.value_planes, plane);
  std::size_t i = 0;
  for (; i + 64 <= m; i += 64) {
    __m512i v[4];
    lookup_planes(plane, _mm512_permutexvar_epi8(order, _mm512_loadu_si512(code + i)), v);
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + i + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(v[r]), scale));
  }
  detail::decode_block(map, code + i, absmax, m - i, out + i);
}

/// encode_block's bits for y = x[i] * inv with |y| < 2 and no NaN, where t.has_estimate:
/// per 16 elements the estimate e of q8_simd_tables::estimate (two vpermi2d by octave, one
/// compare, the decade's line by vpermps, one fused multiply-add, a truncation, the mirror
/// for negative y), then per 64 the threshold t[e] from the threshold planes and the code
/// e + (y >= t[e]). A tail of fewer than 64 goes through the portable encode_block and `lut`.
DISTOPT_HOT_LOOP __attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) inline void encode_block(
    const q8_simd_tables& t, const std::int32_t* lut, const float* x, float inv, std::size_t m,
    std::uint8_t* out) noexcept {
  const __m512i order = _mm512_load_si512(lane_order);
  const __m512 vinv = _mm512_set1_ps(inv), top = _mm512_set1_ps(254.0f);
  const __m512 bound0 = _mm512_load_ps(t.bound), bound1 = _mm512_load_ps(t.bound + 16);
  const __m512i decade0 = _mm512_load_si512(t.decade), decade1 = _mm512_load_si512(t.decade + 16);
  const __m512 offset = _mm512_load_ps(t.offset), slope = _mm512_load_ps(t.slope);
  const __m512i mirror = _mm512_set1_epi32(t.mirror), zero = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1), e96 = _mm512_set1_epi32(96), magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i plane[4][4];
  load_planes(t.threshold_planes, plane);
  std::size_t i = 0;
  for (; i + 64 <= m; i += 64) {
    __m512 y[4];
    __m512i e[4];
    for (int r = 0; r < 4; ++r) {
      y[r] = _mm512_mul_ps(_mm512_loadu_ps(x + i + 16 * r), vinv);
      const __m512i bits = _mm512_castps_si512(y[r]);
      const __m512i mag = _mm512_and_si512(bits, magnitude);
      const __m512 a = _mm512_castsi512_ps(mag);
      const __m512i j = _mm512_subs_epu16(_mm512_srli_epi32(mag, 23), e96);  // vpermi2 reads its low 5 bits
      __m512i d = _mm512_permutex2var_epi32(decade0, j, decade1);
      d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, _mm512_permutex2var_ps(bound0, j, bound1), _CMP_GE_OQ), d, one);
      const __m512 p = _mm512_min_ps(_mm512_fmadd_ps(a, _mm512_permutexvar_ps(d, slope), _mm512_permutexvar_ps(d, offset)), top);
      const __m512i est = _mm512_cvttps_epi32(p);
      e[r] = _mm512_mask_sub_epi32(est, _mm512_cmplt_epi32_mask(bits, zero), mirror, est);
    }
    // Saturating packs: a negative e (the mirror below code 0) becomes 0, as in estimate().
    const __m512i packed = _mm512_packus_epi16(_mm512_packus_epi32(e[0], e[1]), _mm512_packus_epi32(e[2], e[3]));
    __m512i th[4];
    lookup_planes(plane, packed, th);
    const __mmask64 past = _mm512_kunpackd(
        _mm512_kunpackw(_mm512_cmp_ps_mask(y[3], _mm512_castsi512_ps(th[3]), _CMP_GE_OQ),
                        _mm512_cmp_ps_mask(y[2], _mm512_castsi512_ps(th[2]), _CMP_GE_OQ)),
        _mm512_kunpackw(_mm512_cmp_ps_mask(y[1], _mm512_castsi512_ps(th[1]), _CMP_GE_OQ),
                        _mm512_cmp_ps_mask(y[0], _mm512_castsi512_ps(th[0]), _CMP_GE_OQ)));
    const __m512i codes = _mm512_permutexvar_epi8(order, packed);
    _mm512_storeu_si512(out + i, _mm512_mask_add_epi8(codes, past, codes, _mm512_set1_epi8(1)));
  }
  detail::encode_block(x + i, inv, m - i, lut, out + i);
}

/// requantize_block's bits: the AVX-512 encode where the block's absmax is a normal float
/// (then no NaN, and |x * (1 / absmax)| is 1 within a few ulps: 1 + 2^-23 at most, or
/// 1 + 2^-21 where 1 / absmax is subnormal), the portable one otherwise (zero, subnormal,
/// infinite or NaN absmax; or a map the estimate does not serve). Inlined, so that the
/// absmax loop is compiled for the caller's clone (out of line it ran the baseline's SSE2
/// code, and the step was slower than with the portable encode).
DISTOPT_INLINE void requantize_block(const q8_simd_tables& t, const std::int32_t* lut, const float* x, std::size_t m,
                             float& absmax, std::uint8_t* out) noexcept {
  const float amax = block_absmax(x, m);
  absmax = amax;
  if (t.has_estimate && amax >= std::numeric_limits<float>::min() && amax <= std::numeric_limits<float>::max())
    encode_block(t, lut, x, 1.0f / amax, m, out);
  else
    detail::encode_block(x, amax > 0.0f ? 1.0f / amax : 0.0f, m, lut, out);
}

#pragma GCC diagnostic pop
}  // namespace q8_avx512
#endif

namespace q8_avx512 {
/// Whether update_range_q8 decodes and encodes through q8_avx512: this build has it and
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

/// update_range_q8's loop, for each of its versions (DISTOPT_CPU_CLONES, DISTOPT_CPU_DISPATCH).
template <class Policy, int N, param_mode Mode, class Param, class Grad>
DISTOPT_HD DISTOPT_INLINE void update_range_q8_body(const typename Policy::scalars& sc, const q8_args<Param, Grad>& a,
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
      if (simd && a.simd[k]) {
        q8_avx512::decode_block(a.map[k], *a.simd[k], a.code[k] + b0, a.absmax[k][blk], m, fresh[k]);
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
    for (int k = 0; k < N; ++k) {
#if DISTOPT_HAS_Q8_AVX512_PATH
      if (simd && a.simd[k]) {
        q8_avx512::requantize_block(*a.simd[k], a.lut[k], fresh[k], m, a.absmax[k][blk], a.code[k] + b0);
        continue;
      }
#endif
      requantize_block(fresh[k], m, a.lut[k], a.absmax[k][blk], a.code[k] + b0);
    }
  }
}

/// Updates the `n` elements `a` points to, with N quantized state slots.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
DISTOPT_HD DISTOPT_CPU_CLONES void update_range_q8(const typename Policy::scalars& sc, const q8_args<Param, Grad>& a,
                                                   std::size_t n) {
  DISTOPT_CPU_DISPATCH(update_range_q8_body<Policy, N, Mode>(sc, a, n));
}

}  // namespace distopt::detail
