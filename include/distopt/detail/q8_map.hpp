// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The maps and codebooks of the 8-bit block-wise state encoding (as in "8-bit Optimizers via Block-wise
/// Quantization", Dettmers et al. 2022): one uint8 code per element, indexing a 256-entry
/// dynamic quantization map, and one fp32 absmax per block of 256 elements of a tensor.
///
/// A value x of block b is stored as the code whose map value is nearest to x / absmax[b];
/// it reads back as map[code] * absmax[b]. First moments use the signed map, second
/// moments (which are never negative) the unsigned one, so they get twice the codes.
/// Blocks are counted from each tensor's first element, and shard cuts fall on layout
/// blocks (a multiple of 256 elements), so the codes and absmax of every element are the
/// same for every number of data-parallel ranks.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../config.hpp"
#include "../storage/q8_encoding.hpp"

namespace distopt {

namespace detail {

/// bitsandbytes' dynamic quantization map (create_dynamic_map with its defaults: 7
/// exponent bits, 8 bits in all), sorted ascending. For exponent i = 0..6 the map holds
/// the midpoints of an even split of [0.1, 1] into 2^i (signed) or 2^(i+1) (unsigned)
/// parts, scaled by 10^(i-6), and their negatives when signed; then 0 and 1.
///
/// The values are fixed data: they are computed here as bitsandbytes computes them in
/// float32 (torch.linspace's split at its halfway point with fused multiply-adds, then the
/// mean of neighbours, then the float32 product with the float32 power of ten), and the unit test `q8` checks all
/// 512 bit patterns against tests/reference/q8/, generated from bitsandbytes itself.
inline std::array<float, 256> dynamic_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    // torch.linspace(0.1, 1, items) in float32: start + step * k for the first half,
    // end - step * (items - 1 - k) for the second, step = (end - start) / (items - 1),
    // each a fused multiply-add (one rounding), as torch's CPU kernel is compiled.
    const float start = 0.1f, end = 1.0f;
    const float step = (end - start) / static_cast<float>(items - 1);
    std::vector<float> edges(static_cast<std::size_t>(items));
    for (int k = 0; k < items; ++k)
      edges[static_cast<std::size_t>(k)] = k < items / 2 ? std::fma(step, static_cast<float>(k), start)
                                                         : std::fma(-step, static_cast<float>(items - 1 - k), end);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));
    for (int k = 0; k + 1 < items; ++k) {
      const float mean = (edges[static_cast<std::size_t>(k)] + edges[static_cast<std::size_t>(k) + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-(scale * mean));
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  if (data.size() != out.size()) throw std::logic_error("distopt::q8: the dynamic map has the wrong size");
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

/// What the AVX-512 kernels of q8_loop.hpp read, built with each codebook (host memory only).
///
/// The lookups are byte shuffles: `value_planes[k][c]` is byte k (from the least
/// significant) of code c's value, `threshold_planes[k][c]` of threshold c (entry 255: +inf).
///
/// The encode first estimates the nearest code without a table per element, then settles it
/// with one exact comparison against the estimate's threshold. The map is bitsandbytes'
/// dynamic one: in each decade [10^(d-7), 10^(d-6)) its codes are evenly spaced, so the code
/// of a magnitude a in decade d is about a * slope[d] + offset[d]. The decade comes from the
/// octave of a (its exponent field, minus 96, saturated at 0, as the index j) and one
/// comparison with `bound[j]`, the one decade boundary an octave can hold. For a negative y
/// the estimate is mirror - E(|y|), the map being symmetric about its zero code.
/// `estimate` is that computation in scalar form, with the vector kernel's exact operations
/// (one fused multiply-add, a truncation); the codebook checks that it brackets every
/// threshold and sets `has_estimate` (see q8_codebook).
struct q8_simd_tables {
  alignas(64) std::uint8_t value_planes[4][256] = {};
  alignas(64) std::uint8_t threshold_planes[4][256] = {};
  alignas(64) float offset[16] = {};
  alignas(64) float slope[16] = {};
  alignas(64) float bound[32] = {};
  alignas(64) std::int32_t decade[32] = {};
  std::int32_t mirror = 0;
  bool has_estimate = false;

  /// The estimated code of y (not NaN, |y| < 2): nearest(y) - 1 or nearest(y) when
  /// has_estimate.
  int estimate(float y) const noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(y), mag = u & 0x7fffffffu;
    const float a = std::bit_cast<float>(mag);
    const std::uint32_t j = ((mag >> 23) > 96u ? (mag >> 23) - 96u : 0u) & 31u;
    const int d = decade[j] + (a >= bound[j] ? 1 : 0);
    float p = std::fma(a, slope[d], offset[d]);
    p = p < 254.0f ? p : 254.0f;
    int e = static_cast<int>(p);
    if (u >> 31) e = mirror - e;
    return e > 0 ? e : 0;
  }
};

/// A quantization map with what quantizing to it needs: the values (sorted ascending),
/// the decision thresholds between neighbours, and a lookup table that finds the nearest
/// code of a float in [-1, 1] with one load and one comparison.
///
/// The nearest code of y is the number of thresholds t[c] = (v[c] + v[c+1]) / 2 (in
/// float) with t[c] <= y: halfway values go to the larger code. The lookup table splits
/// each sign's magnitudes by their exponent and top `mant_bits` mantissa bits; the map's
/// values are at least 1.4 % apart, so each slice holds at most one threshold (the
/// constructor checks it), and the code is the slice's first code or its neighbour. One
/// 32-bit entry per slice holds both: the code in the low 8 bits, and above them the low
/// 16 bits of the threshold's pattern (its high bits are the slice's own), or 2^16 where
/// the slice has none: one gather per element.
class q8_codebook {
 public:
  explicit q8_codebook(const std::array<float, 256>& values) : value_(values) {
    for (std::size_t c = 0; c + 1 < 256; ++c) {
      if (!(values[c] < values[c + 1]))
        throw std::invalid_argument("distopt::q8_codebook: the map must be strictly ascending");
      threshold_[c] = (values[c] + values[c + 1]) * 0.5f;
    }
    lut_.resize(2 * slices);
    for (int neg = 0; neg < 2; ++neg)
      for (std::uint32_t j = 0; j < slices; ++j) build_slice(neg != 0, j);
    build_simd_tables();
  }

  /// Value of code `c`.
  DISTOPT_INLINE float value(std::uint8_t c) const noexcept { return value_[c]; }
  const std::array<float, 256>& values() const noexcept { return value_; }
  /// Threshold between codes c and c + 1.
  float threshold(std::size_t c) const noexcept { return threshold_[c]; }

  /// The nearest code of y, by binary search over the thresholds (the definition).
  std::uint8_t nearest_reference(float y) const noexcept {
    if (std::isnan(y)) return zero_code();
    return static_cast<std::uint8_t>(std::upper_bound(threshold_.begin(), threshold_.end(), y) - threshold_.begin());
  }

  /// The same as nearest_reference, through the lookup table: one load of each table.
  DISTOPT_INLINE std::uint8_t nearest(float y) const noexcept { return q8_nearest(lut_.data(), y); }

  /// The code of 0.
  std::uint8_t zero_code() const noexcept {
    return static_cast<std::uint8_t>(std::find(value_.begin(), value_.end(), 0.0f) - value_.begin());
  }

  /// The lookup table (2 * slices entries), for q8_nearest and for executors that copy it
  /// to device memory.
  const std::int32_t* lookup() const noexcept { return lut_.data(); }

  /// The tables of the AVX-512 decode and encode (q8_loop.hpp).
  const q8_simd_tables& simd() const noexcept { return simd_; }

  /// Magnitude slices: exponent and top mant_bits of the mantissa, from 2^-min_exp up;
  /// everything below falls in slice 0 and everything above 1.0 in the last.
  static constexpr int mant_bits = 7;
  static constexpr int min_exp = 24;
  static constexpr std::uint32_t first_slice = ((127u - min_exp) << 23) >> (23 - mant_bits);
  static constexpr std::uint32_t slices = ((127u << 23) >> (23 - mant_bits)) - first_slice + 2;

  DISTOPT_HD DISTOPT_INLINE static std::uint32_t slice_of(std::uint32_t mag) noexcept {
    const std::uint32_t s = mag >> (23 - mant_bits);
    const std::uint32_t j = s > first_slice ? s - first_slice : 0u;
    return j < slices - 1 ? j : slices - 1;
  }
  /// The nearest code of y from the lookup table `lut` (positive magnitudes' slices, then
  /// negative ones'). Used by every executor.
  DISTOPT_HD DISTOPT_INLINE static std::uint8_t q8_nearest(const std::int32_t* lut, float y) noexcept {
    const std::uint32_t u = __builtin_bit_cast(std::uint32_t, y);
    const std::uint32_t mag = u & 0x7fffffffu;
    const std::int32_t e = lut[slice_of(mag) + (u >> 31) * slices];
    const std::int32_t past = static_cast<std::int32_t>(mag & 0xffffu) >= (e >> 8) ? 1 : 0;
    const std::int32_t step = (u >> 31) ? -1 : 1;
    return static_cast<std::uint8_t>((e & 0xff) + past * step);
  }

 private:
  void build_slice(bool neg, std::uint32_t j) {
    // Magnitudes [a, b] of slice j (as bit patterns; slice 0 starts at +0, the last slice
    // runs to +inf).
    const std::uint32_t a = j == 0 ? 0u : (j + first_slice) << (23 - mant_bits);
    const std::uint32_t b = j == slices - 1 ? 0x7f800000u : ((j + first_slice + 1) << (23 - mant_bits)) - 1;
    const auto code = [&](std::uint32_t mag) {
      return nearest_reference(std::bit_cast<float>(mag | (neg ? 0x80000000u : 0u)));
    };
    const std::uint8_t ca = code(a), cb = code(b);
    const std::size_t k = j + (neg ? slices : 0);
    lut_[k] = static_cast<std::int32_t>(ca) | (0x10000 << 8);  // no threshold: never past it
    if (ca == cb) return;
    if (cb != (neg ? ca - 1 : ca + 1))
      throw std::logic_error("distopt::q8_codebook: a lookup slice holds more than one threshold");
    if (j == 0 || j == slices - 1)  // these span several high-bit patterns
      throw std::logic_error("distopt::q8_codebook: a threshold lies in the first or last lookup slice");
    // The smallest magnitude in [a, b] whose code is cb (codes are monotone in it).
    std::uint32_t lo = a, hi = b;
    while (lo < hi) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if (code(mid) == cb) hi = mid;
      else lo = mid + 1;
    }
    lut_[k] = static_cast<std::int32_t>(ca) | static_cast<std::int32_t>((lo & 0xffffu) << 8);
  }

  void build_simd_tables() {
    q8_simd_tables& t = simd_;
    for (std::size_t c = 0; c < 256; ++c) {
      const std::uint32_t v = std::bit_cast<std::uint32_t>(value_[c]);
      const std::uint32_t h = std::bit_cast<std::uint32_t>(c < 255 ? threshold_[c] : std::numeric_limits<float>::infinity());
      for (std::size_t k = 0; k < 4; ++k) {
        t.value_planes[k][c] = static_cast<std::uint8_t>(v >> (8 * k));
        t.threshold_planes[k][c] = static_cast<std::uint8_t>(h >> (8 * k));
      }
    }
    // The estimate's lines: through (10^(d-7), first code of decade d - 1/2) and
    // (10^(d-6), its last code + 1/2), fitted to whatever map this is; the checks below say
    // whether they serve it (a map without a code of 0, or a decade without codes, does not).
    const std::uint8_t z = zero_code();
    bool fits = value_[z] == 0.0f;
    for (int d = 0; d < 7; ++d) {
      const double lo = std::pow(10.0, d - 7), hi = std::pow(10.0, d - 6);
      int first = -1, count = 0;
      for (int c = 0; c < 256; ++c)
        if (value_[static_cast<std::size_t>(c)] >= lo && value_[static_cast<std::size_t>(c)] < hi) {
          if (first < 0) first = c;
          ++count;
        }
      fits = fits && count > 0;
      const double slope = count / (hi - lo);
      t.slope[d] = static_cast<float>(slope);
      t.offset[d] = static_cast<float>(first - 0.5 - lo * slope);
    }
    float start_of[7];  // the float where decade d starts (d >= 1)
    for (int d = 1; d < 7; ++d) start_of[d] = static_cast<float>(std::pow(10.0, d - 7));
    for (int j = 0; j < 32; ++j) {  // octave [2^(j-31), 2^(j-30)); below 2^-31, j = 0
      const float start = std::ldexp(1.0f, j - 31), end = std::ldexp(1.0f, j - 30);
      t.decade[j] = 0;
      t.bound[j] = std::numeric_limits<float>::infinity();
      for (int d = 1; d < 7; ++d) {
        if (start_of[d] <= start) t.decade[j] = d;
        else if (start_of[d] < end) t.bound[j] = start_of[d];
      }
    }
    t.mirror = 2 * static_cast<int>(z) - 1;
    // e(y) is monotone in y where the estimate is (one line per decade, switched at the
    // decade's bound, mirrored at zero), and so is nearest(y). So e(y) <= nearest(y) <=
    // e(y) + 1 for all |y| < 2 holds if it holds at each threshold (where the code steps up)
    // and at the float just below it, and the lines do not step down at a bound. (Every
    // threshold is below 2: build_slice refuses one in the last lookup slice.)
    for (std::size_t c = 0; fits && c < 255; ++c) {
      const float at = threshold_[c], below = std::nextafter(at, -std::numeric_limits<float>::infinity());
      fits = t.estimate(at) >= static_cast<int>(c) && t.estimate(below) <= static_cast<int>(c);
    }
    for (int d = 1; fits && d < 7; ++d) fits = t.estimate(std::nextafter(start_of[d], 0.0f)) <= t.estimate(start_of[d]);
    t.has_estimate = fits && t.estimate(-0.0f) <= t.estimate(0.0f);
  }

  std::array<float, 256> value_{};
  std::array<float, 255> threshold_{};
  std::vector<std::int32_t> lut_;
  q8_simd_tables simd_;
};

/// The signed map (first moments) and the unsigned map (second moments), built once.
inline const q8_codebook& signed_codebook() {
  static const q8_codebook book(dynamic_map(true));
  return book;
}
inline const q8_codebook& unsigned_codebook() {
  static const q8_codebook book(dynamic_map(false));
  return book;
}

}  // namespace detail
}  // namespace distopt
