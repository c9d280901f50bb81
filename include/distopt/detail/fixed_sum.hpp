// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file An exact, order-independent sum of fp32-derived values: the accumulator behind
/// the layer-wise statistics (per-tensor, per-row and per-column sums).
///
/// Every value it adds is an fp32 number, or a double sum of fp32 numbers; both are
/// integer multiples of 2^-149 (the smallest fp32 subnormal), and a double sum of up to
/// 2^40 fp32 values stays below 2^168. So the sum is kept exactly as an integer number of
/// 2^-149 units in ten 32-bit limbs. The limbs are int64 ("carry-save"): an add touches two
/// or three limbs with plain integer adds and no carry chain, and ~2^31 adds fit before a
/// limb could overflow. Integer addition is associative, so the sum does not depend on the
/// order of the terms, on how a tensor is cut over ranks and threads, or on which rank
/// added what: DP shards, TP splits and thread counts all give the same bits.
///
/// Compared with detail::exact_sum (the whole double range, 68 limbs, for the global
/// norm), this one covers only the fp32 range and travels as 11 doubles instead of 70.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../config.hpp"

namespace distopt::detail {

class fixed_sum {
 public:
  static constexpr int limbs = 10;
  /// Doubles on the wire: the limbs, then a term that carries NaN and Inf (0 otherwise).
  static constexpr int wire_size = limbs + 1;

  /// Adds an fp32 value exactly (any sign); NaN and Inf go to the special term.
  DISTOPT_HD DISTOPT_INLINE void add(float v) noexcept {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const std::uint32_t e = (u >> 23) & 0xffu;
    if (e == 0xffu) {
      special_ += v;
      return;
    }
    const std::uint64_t m = (u & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int pos = static_cast<int>(e ? e - 1 : 0);  // value = m * 2^(pos - 149)
    const std::uint64_t shifted = m << (pos & 31);    // < 2^55
    const std::int64_t lo = static_cast<std::int64_t>(shifted & 0xffffffffu);
    const std::int64_t hi = static_cast<std::int64_t>(shifted >> 32);
    const int k = pos >> 5;
    if (u >> 31) {
      limb_[k] -= lo;
      limb_[k + 1] -= hi;
    } else {
      limb_[k] += lo;
      limb_[k + 1] += hi;
    }
  }

  /// Adds a double that is a multiple of 2^-149 (a sum of fp32 values) exactly; lower bits
  /// of other doubles are dropped (deterministically). Magnitudes from 2^168 up, NaN and
  /// Inf go to the special term (as +-Inf or NaN).
  DISTOPT_HD DISTOPT_INLINE void add(double v) noexcept {
    std::uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    const int e = static_cast<int>((u >> 52) & 0x7ffu);
    if (e == 0x7ff || e >= 1023 + 168) {
      // +-Inf from its bits (numeric_limits is host-only code for nvcc).
      const std::uint64_t inf_bits = 0x7ff0000000000000ull | (u & 0x8000000000000000ull);
      double inf;
      std::memcpy(&inf, &inf_bits, sizeof inf);
      special_ += e == 0x7ff ? v : inf;
      return;
    }
    if (e == 0) return;  // below 2^-1022: nothing at or above 2^-149
    std::uint64_t m = (u & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
    int pos = e - 1075 + 149;  // value = m * 2^(pos - 149)
    if (pos < 0) {
      if (pos <= -53) return;
      m >>= -pos;
      pos = 0;
    }
    const int k = pos >> 5, s = pos & 31;
    // m << s has at most 85 bits: three limbs.
    const std::int64_t l0 = static_cast<std::int64_t>((m << s) & 0xffffffffu);
    const std::int64_t l1 = static_cast<std::int64_t>((s == 0 ? m >> 32 : m >> (32 - s)) & 0xffffffffu);
    const std::int64_t l2 = static_cast<std::int64_t>(s == 0 ? 0 : m >> (64 - s));
    if (u >> 63) {
      limb_[k] -= l0;
      limb_[k + 1] -= l1;
      if (k + 2 < limbs) limb_[k + 2] -= l2;
    } else {
      limb_[k] += l0;
      limb_[k + 1] += l1;
      if (k + 2 < limbs) limb_[k + 2] += l2;
    }
  }

  /// Adds another sum exactly.
  DISTOPT_HD void add(const fixed_sum& o) noexcept {
    for (int k = 0; k < limbs; ++k) limb_[k] += o.limb_[k];
    special_ += o.special_;
  }

  /// Writes the sum as wire_size doubles whose element-wise sum over ranks (exact for up
  /// to 2^20 ranks: every limb is first brought into [0, 2^32)) is the wire of the total.
  void to_wire(double* out) const noexcept {
    fixed_sum n = *this;
    n.normalise();
    for (int k = 0; k < limbs; ++k) out[k] = static_cast<double>(n.limb_[k]);
    out[limbs] = special_;
  }
  static fixed_sum from_wire(const double* in) noexcept {
    fixed_sum s;
    for (int k = 0; k < limbs; ++k) s.limb_[k] = static_cast<std::int64_t>(in[k]);
    s.special_ = in[limbs];
    return s;
  }

  /// The sum rounded to double (from its top 96 bits: deterministic, within an ulp).
  double value() const noexcept {
    if (special_ != 0.0 || special_ != special_) return special_;
    fixed_sum n = *this;
    n.normalise();
    bool negative = n.limb_[limbs - 1] < 0;
    if (negative) {  // two's complement over the limbs
      std::int64_t carry = 1;
      for (int k = 0; k < limbs; ++k) {
        std::int64_t x = (~n.limb_[k] & 0xffffffff) + carry;
        carry = x >> 32;
        n.limb_[k] = x & 0xffffffff;
      }
    }
    int top = limbs - 1;
    while (top >= 0 && n.limb_[top] == 0) --top;
    if (top < 0) return 0.0;
    const int low = top >= 2 ? top - 2 : 0;
    __extension__ typedef unsigned __int128 u128;  // GCC and Clang; quiet under -Wpedantic
    u128 m = 0;
    for (int k = top; k >= low; --k) m = (m << 32) | static_cast<std::uint64_t>(n.limb_[k]);
    const double r = std::ldexp(static_cast<double>(m), 32 * low - 149);
    return negative ? -r : r;
  }

  bool is_zero() const noexcept {
    for (int k = 0; k < limbs; ++k)
      if (limb_[k] != 0) return false;
    return special_ == 0.0;
  }

 private:
  /// Carries so that limbs 0..limbs-2 lie in [0, 2^32); the top limb keeps the sign.
  void normalise() noexcept {
    for (int k = 0; k + 1 < limbs; ++k) {
      const std::int64_t carry = limb_[k] >> 32;  // arithmetic shift: floor division
      limb_[k] -= carry * (std::int64_t{1} << 32);
      limb_[k + 1] += carry;
    }
  }

  std::int64_t limb_[limbs] = {};
  double special_ = 0.0;
};

}  // namespace distopt::detail
