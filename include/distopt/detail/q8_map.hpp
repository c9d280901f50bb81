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
    for (std::size_t c = 0; c < 256; ++c)
      for (std::size_t k = 0; k < 4; ++k)
        planes_[256 * k + c] = static_cast<std::uint8_t>(std::bit_cast<std::uint32_t>(values[c]) >> (8 * k));
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

  /// The values as four planes of 256 bytes: plane k holds byte k (from the least
  /// significant) of each value's bit pattern, for byte-shuffle decoders (q8_loop.hpp).
  const std::uint8_t* planes() const noexcept { return planes_.data(); }

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

  std::array<float, 256> value_{};
  std::array<float, 255> threshold_{};
  std::vector<std::int32_t> lut_;
  std::array<std::uint8_t, 1024> planes_{};
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
