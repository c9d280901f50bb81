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

  /// Where a term lands (place): limb k and the next two get part[0..2] (signed, each of
  /// magnitude below 2^32); k < 0: the term is NaN or Inf (add it to the special term, as
  /// special_term gives it), or nothing at or above 2^-149.
  static constexpr int special = -1, nothing = -2;

  /// Places `mag` * 2^(pos - 149) (pos >= 0, pos / 32 + 2 < limbs or the top bits zero),
  /// negated if `negative`.
  DISTOPT_HD DISTOPT_INLINE static int place_units(std::uint64_t mag, int pos, bool negative,
                                                   std::int64_t (&part)[3]) noexcept {
    const int k = pos >> 5, s = pos & 31;
    // mag << s has at most 95 bits: three limbs.
    const std::int64_t l0 = static_cast<std::int64_t>((mag << s) & 0xffffffffu);
    const std::int64_t l1 = static_cast<std::int64_t>((s == 0 ? mag >> 32 : mag >> (32 - s)) & 0xffffffffu);
    const std::int64_t l2 = static_cast<std::int64_t>(s == 0 ? 0 : mag >> (64 - s));
    part[0] = negative ? -l0 : l0;
    part[1] = negative ? -l1 : l1;
    part[2] = negative ? -l2 : l2;
    return k;
  }

  /// Places an fp32 value exactly (any sign).
  DISTOPT_HD DISTOPT_INLINE static int place(float v, std::int64_t (&part)[3]) noexcept {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const std::uint32_t e = (u >> 23) & 0xffu;
    if (e == 0xffu) return special;
    const std::uint64_t m = (u & 0x7fffffu) | (e ? 0x800000u : 0u);
    return place_units(m, static_cast<int>(e ? e - 1 : 0), (u >> 31) != 0, part);  // value = m * 2^(pos - 149)
  }

  /// Places a double that is a multiple of 2^-149 (a sum of fp32 values) exactly; lower
  /// bits of other doubles are dropped (deterministically). Magnitudes from 2^168 up, NaN
  /// and Inf are special (special_term: +-Inf or NaN).
  DISTOPT_HD DISTOPT_INLINE static int place(double v, std::int64_t (&part)[3]) noexcept {
    std::uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    const int e = static_cast<int>((u >> 52) & 0x7ffu);
    if (e == 0x7ff || e >= 1023 + 168) return special;
    if (e == 0) return nothing;  // below 2^-1022: nothing at or above 2^-149
    std::uint64_t m = (u & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
    int pos = e - 1075 + 149;  // value = m * 2^(pos - 149)
    if (pos < 0) {
      if (pos <= -53) return nothing;
      m >>= -pos;
      pos = 0;
    }
    return place_units(m, pos, (u >> 63) != 0, part);
  }

  /// What a special term adds to the special term: NaN and Inf as they are, magnitudes
  /// from 2^168 up as Inf of their sign.
  DISTOPT_HD DISTOPT_INLINE static double special_term(double v) noexcept {
    std::uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    if (((u >> 52) & 0x7ffu) == 0x7ffu) return v;
    // +-Inf from its bits (numeric_limits is host-only code for nvcc).
    const std::uint64_t inf_bits = 0x7ff0000000000000ull | (u & 0x8000000000000000ull);
    double inf;
    std::memcpy(&inf, &inf_bits, sizeof inf);
    return inf;
  }

  /// Adds an fp32 value exactly (any sign); NaN and Inf go to the special term.
  DISTOPT_HD DISTOPT_INLINE void add(float v) noexcept {
    std::int64_t part[3];
    const int k = place(v, part);
    if (k == special) {
      special_ += v;
      return;
    }
    limb_[k] += part[0];  // an fp32 value spans two limbs (part[2] is 0)
    limb_[k + 1] += part[1];
  }

  /// Adds a double that is a multiple of 2^-149 exactly (place(double)).
  DISTOPT_HD DISTOPT_INLINE void add(double v) noexcept {
    std::int64_t part[3];
    const int k = place(v, part);
    if (k == special) special_ += special_term(v);
    if (k < 0) return;
    limb_[k] += part[0];
    limb_[k + 1] += part[1];
    if (k + 2 < limbs) limb_[k + 2] += part[2];
  }

  /// For kernels that add into a sum with atomics (exec/cuda/layer_phase.cuh): the limbs
  /// (int64, added as two's complement) and the special term.
  DISTOPT_HD std::int64_t* limb_data() noexcept { return limb_; }
  DISTOPT_HD double* special_data() noexcept { return &special_; }

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

  /// The sum rounded to double: its top 96 bits (the top three nonzero limbs) rounded once,
  /// to nearest even (deterministic, within an ulp of the sum). Host and device code: the
  /// layer-wise engine converts a device's sums where they are.
  DISTOPT_HD double value() const noexcept {
    if (special_ != 0.0 || special_ != special_) return special_;
    fixed_sum n = *this;
    n.normalise();
    const bool negative = n.limb_[limbs - 1] < 0;
    if (negative) {  // two's complement over the limbs
      std::int64_t carry = 1;
      for (int k = 0; k < limbs; ++k) {
        const std::int64_t x = (~n.limb_[k] & 0xffffffff) + carry;
        carry = x >> 32;
        n.limb_[k] = x & 0xffffffff;
      }
    }
    int top = limbs - 1;
    while (top >= 0 && n.limb_[top] == 0) --top;
    if (top < 0) return 0.0;
    double r;
    int scale;
    if (top < 2) {  // below 2^64 units: one rounding of the integer
      const std::uint64_t l0 = static_cast<std::uint64_t>(n.limb_[0]);
      r = static_cast<double>(top == 1 ? static_cast<std::uint64_t>(n.limb_[1]) << 32 | l0 : l0);
      scale = -149;
    } else {
      // l2:l1:l0 (l2 nonzero) shifted so that its top bit is bit 95; its top 64 bits with a
      // sticky bit for the other 32 round to nearest even as the 96 bits do (the rounding
      // drops 11 bits of the 64).
      const std::uint64_t l2 = static_cast<std::uint64_t>(n.limb_[top]), l1 = static_cast<std::uint64_t>(n.limb_[top - 1]),
                          l0 = static_cast<std::uint64_t>(n.limb_[top - 2]);
#if DISTOPT_DEVICE_CODE
      const int z = __clz(static_cast<int>(l2));
#else
      const int z = __builtin_clz(static_cast<unsigned>(l2));
#endif
      const std::uint64_t hi = z == 0 ? (l2 << 32 | l1) : (l2 << (32 + z) | l1 << z | l0 >> (32 - z));
      const std::uint64_t rest = (l0 << z) & 0xffffffffu;
      r = static_cast<double>(hi | (rest != 0 ? 1u : 0u));
      scale = 32 - z + 32 * (top - 2) - 149;
    }
    r = std::ldexp(r, scale);
    return negative ? -r : r;
  }

  bool is_zero() const noexcept {
    for (int k = 0; k < limbs; ++k)
      if (limb_[k] != 0) return false;
    return special_ == 0.0;
  }

 private:
  /// Carries so that limbs 0..limbs-2 lie in [0, 2^32); the top limb keeps the sign.
  DISTOPT_HD void normalise() noexcept {
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
