// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file An exact, order-independent sum of non-negative doubles (a fixed-point
/// "superaccumulator" over the whole double range), used for the global gradient norm.
///
/// Why: the squared norm is a sum over every element of every rank. Summed in floating
/// point, its bits depend on the order, and so on where the shard cuts fall and on d.
/// Here each block of the layout (a fixed run of elements of one tensor, never cut) is
/// summed in double in a fixed order (sixteen lanes, detail::sum_of_squares), and the
/// block sums are added exactly, as integers.
/// Integer addition is associative, so the total is the same for every d, every thread
/// count and every chunking, and it is rounded to double once, at the end.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

#include "../config.hpp"

namespace distopt::detail {

/// The double with bits `u` (host and device code).
DISTOPT_HD inline double bits_to_double(std::uint64_t u) noexcept {
#if DISTOPT_DEVICE_CODE
  return __longlong_as_double(static_cast<long long>(u));
#else
  double v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

/// The exact sum of non-negative doubles, plus counts of NaN and Inf terms. Trivially
/// copyable, all zero when empty; adding runs in host and device code.
class exact_sum {
 public:
  /// 32-bit limbs from 2^-1074 (the smallest subnormal) up, with room for 2^64 terms of
  /// the largest double: 1074 + 1024 + 64 bits.
  static constexpr int limbs = 68;
  /// What travels between ranks: the limbs, then the NaN and Inf counts, all as doubles.
  static constexpr int wire_size = limbs + 2;

  /// Where a non-negative finite double lands in the limbs: v = lo * 2^(32k) + mid *
  /// 2^(32(k+1)) + hi * 2^(32(k+2)), in units of 2^-1074, each part below 2^32. Returns k,
  /// or -1 for zero, -2 for NaN and -3 for +Inf. Reads the mantissa and exponent from the
  /// bits (frexp and ldexp cost as much as a block of 256 squares). The one decomposition
  /// that add() and the device's shared-memory accumulators (exec/cuda/phases.cuh) use.
  DISTOPT_HD static int place(double v, std::uint64_t& lo, std::uint64_t& mid, std::uint64_t& hi) noexcept {
#if DISTOPT_DEVICE_CODE
    const auto u = static_cast<std::uint64_t>(__double_as_longlong(v));
#else
    std::uint64_t u;
    std::memcpy(&u, &v, sizeof u);
#endif
    const int e = static_cast<int>((u >> 52) & 0x7ffu);
    const std::uint64_t frac = u & ((std::uint64_t{1} << 52) - 1);
    if (e == 0x7ff) return frac ? -2 : -3;
    if (v == 0.0) return -1;
    // v = m * 2^(pos - 1074): a subnormal has m = frac at pos 0; a normal number has the
    // implicit bit and pos = e - 1.
    const std::uint64_t m = e ? frac | (std::uint64_t{1} << 52) : frac;
    const int pos = e ? e - 1 : 0;
    const int s = pos % 32;
    // m << s has at most 85 bits: spread it over three limbs of 32 bits.
    lo = (m << s) & 0xffffffffu;
    mid = (s == 0 ? m >> 32 : (m >> (32 - s))) & 0xffffffffu;
    hi = s == 0 ? 0 : m >> (64 - s);
    return pos / 32;
  }

  /// Adds a non-negative double exactly; NaN and +Inf are counted instead.
  DISTOPT_HD void add(double v) noexcept {
    std::uint64_t lo = 0, mid = 0, hi = 0;
    const int k = place(v, lo, mid, hi);
    if (k < 0) {
      if (k == -2) ++nans_;
      else if (k == -3) ++infs_;
      return;
    }
    limb_[k] += lo;
    limb_[k + 1] += mid;
    limb_[k + 2] += hi;
    if (++pending_ == (1u << 30)) normalize();
  }

  /// An accumulator from raw parts: `limbs[0, limbs)` (any values whose carries fit in 64
  /// bits), the NaN and the Inf count. Normalised.
  template <class U>
  DISTOPT_HD static exact_sum from_parts(const U* l, std::uint64_t nans, std::uint64_t infs) noexcept {
    exact_sum r;
    for (int i = 0; i < limbs; ++i) r.limb_[i] = static_cast<std::uint64_t>(l[i]);
    r.nans_ = nans;
    r.infs_ = infs;
    r.normalize();
    return r;
  }
  /// Part i of a normalised accumulator (from_parts or to_wire left it so): limb i (below
  /// 2^32) for i < limbs, then the NaN and the Inf count. Summing part i over accumulators
  /// and passing the sums to from_parts adds them exactly.
  DISTOPT_HD std::uint64_t part(int i) const noexcept {
    return i < limbs ? limb_[i] : i == limbs ? nans_ : infs_;
  }

  /// Adds another accumulator exactly.
  DISTOPT_HD void add(const exact_sum& o) noexcept {
    exact_sum t = o;
    t.normalize();
    normalize();
    for (int i = 0; i < limbs; ++i) limb_[i] += t.limb_[i];
    nans_ += t.nans_;
    infs_ += t.infs_;
    normalize();
  }

  /// Writes the accumulator as doubles for an all-reduce (sum): every value is an integer
  /// below 2^32, so a sum over fewer than 2^21 ranks is exact in any order.
  void to_wire(std::span<double, wire_size> w) noexcept { to_wire(w.data()); }
  /// The same into `w[0, wire_size)` (device code has no std::span).
  DISTOPT_HD void to_wire(double* w) noexcept {
    normalize();
    for (int i = 0; i < limbs; ++i) w[i] = static_cast<double>(limb_[i]);
    w[limbs] = static_cast<double>(nans_);
    w[limbs + 1] = static_cast<double>(infs_);
  }
  /// Reads an all-reduced wire image back.
  static exact_sum from_wire(std::span<const double, wire_size> w) noexcept { return from_wire(w.data()); }
  DISTOPT_HD static exact_sum from_wire(const double* w) noexcept {
    exact_sum r;
    for (int i = 0; i < limbs; ++i) r.limb_[i] = static_cast<std::uint64_t>(w[i]);
    r.nans_ = static_cast<std::uint64_t>(w[limbs]);
    r.infs_ = static_cast<std::uint64_t>(w[limbs + 1]);
    r.normalize();
    return r;
  }

  /// The sum as a double: NaN if a NaN was added, +Inf if an Inf was, otherwise the exact
  /// integer rounded from its top three nonzero limbs (a deterministic function of the
  /// exact sum, within 2 ulp of it).
  DISTOPT_HD double value() noexcept {
    if (nans_) return bits_to_double(0x7ff8000000000000ull);  // quiet NaN
    if (infs_) return bits_to_double(0x7ff0000000000000ull);  // +Inf
    normalize();
    int top = limbs - 1;
    while (top >= 0 && limb_[top] == 0) --top;
    if (top < 0) return 0.0;
    double r = 0.0;
    for (int i = top; i >= 0 && i >= top - 2; --i)
      r += std::ldexp(static_cast<double>(limb_[i]), 32 * i - 1074);
    return r;
  }

 private:
  /// Carries so that every limb is below 2^32.
  DISTOPT_HD void normalize() noexcept {
    std::uint64_t carry = 0;
    for (int i = 0; i < limbs; ++i) {
      const std::uint64_t v = limb_[i] + carry;
      limb_[i] = v & 0xffffffffu;
      carry = v >> 32;
    }
    pending_ = 0;
  }

  std::uint64_t limb_[limbs] = {};  // a plain array: device code calls no std::array members
  std::uint64_t nans_ = 0, infs_ = 0;
  std::uint32_t pending_ = 0;
};

}  // namespace distopt::detail
