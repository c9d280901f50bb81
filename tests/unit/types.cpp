// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// bf16/fp16 conversions, stochastic rounding and dtype names, each checked against an
// independent reference: decoding via std::ldexp, rounding by nearest-neighbour search
// over a table of every representable value, computed in double.

#include <boost/test/unit_test.hpp>

#include <distopt/detail/fp16_arrays.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/dtype.hpp>
#include <distopt/types/fp16.hpp>
#include <distopt/types/rounding.hpp>

#include "sanitizer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using distopt::bf16;
using distopt::fp16;

std::uint32_t bits_of(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float float_of(std::uint32_t u) {
  float f = 0;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The format parameters a reference needs; the encodings themselves come from IEEE rules.
struct bf16_format {
  using type = bf16;
  static constexpr int mantissa_bits = 7;
  static constexpr int exponent_bits = 8;
  static constexpr int bias = 127;
};
struct fp16_format {
  using type = fp16;
  static constexpr int mantissa_bits = 10;
  static constexpr int exponent_bits = 5;
  static constexpr int bias = 15;
};

template <class F>
constexpr std::uint16_t exp_mask = static_cast<std::uint16_t>(((1u << F::exponent_bits) - 1u) << F::mantissa_bits);
template <class F>
constexpr std::uint16_t man_mask = static_cast<std::uint16_t>((1u << F::mantissa_bits) - 1u);
template <class F>
constexpr std::uint16_t inf_bits = exp_mask<F>;

template <class F>
bool is_nan_bits(std::uint16_t b) {
  return (b & exp_mask<F>) == exp_mask<F> && (b & man_mask<F>) != 0;
}

// Decodes a pattern with std::ldexp, independently of the code under test.
template <class F>
double decode(std::uint16_t b) {
  const int e = (b & exp_mask<F>) >> F::mantissa_bits;
  const int m = b & man_mask<F>;
  const double sign = (b & 0x8000u) != 0 ? -1.0 : 1.0;
  if (e == (1 << F::exponent_bits) - 1) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) {
    return sign * std::ldexp(m, 1 - F::bias - F::mantissa_bits);
  }
  return sign * std::ldexp((1 << F::mantissa_bits) + m, e - F::bias - F::mantissa_bits);
}

// Every non-negative finite value in increasing order, indexed by its pattern, plus one
// sentinel: the value infinity stands in for when rounding (2^(emax+1)).
template <class F>
const std::vector<double>& table() {
  static const std::vector<double> t = [] {
    std::vector<double> v;
    for (std::uint32_t b = 0; b < inf_bits<F>; ++b) {
      v.push_back(decode<F>(static_cast<std::uint16_t>(b)));
    }
    v.push_back(std::ldexp(1.0, (1 << (F::exponent_bits - 1))));
    return v;
  }();
  return t;
}

// The neighbours of |x|: lo <= |x| < hi by pattern index (hi may be the infinity sentinel).
struct neighbours {
  std::uint16_t lo;
  bool exact;
};

template <class F>
neighbours find_neighbours(double ax) {
  const auto& t = table<F>();
  if (ax >= t.back()) {
    return {inf_bits<F>, true};
  }
  const auto it = std::upper_bound(t.begin(), t.end(), ax);
  const auto lo = static_cast<std::uint16_t>((it - t.begin()) - 1);
  return {lo, t[lo] == ax};
}

// Round to nearest, ties to even, by comparing 2|x| with lo + hi (all exact in double).
template <class F>
std::uint16_t reference_rne(float x) {
  const auto sign = static_cast<std::uint16_t>((bits_of(x) >> 16) & 0x8000u);
  const double ax = std::fabs(static_cast<double>(x));
  const auto [lo, exact] = find_neighbours<F>(ax);
  if (exact) {
    return static_cast<std::uint16_t>(sign | lo);
  }
  const auto& t = table<F>();
  const auto hi = static_cast<std::uint16_t>(lo + 1);
  const double twice = 2.0 * ax;
  const double sum = t[lo] + t[hi];
  std::uint16_t r = twice < sum ? lo : twice > sum ? hi : ((lo & 1u) == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | r);
}

template <class F>
std::uint16_t convert(float x) {
  return typename F::type(x).bits;
}

template <class F>
void check_rne(float x) {
  const std::uint32_t xb = bits_of(x);
  const std::uint16_t got = convert<F>(x);
  if (std::isnan(x)) {
    BOOST_TEST_INFO("x bits 0x" << std::hex << xb << " got 0x" << got);
    BOOST_TEST(is_nan_bits<F>(got));
    BOOST_TEST((got & 0x8000u) == ((xb >> 16) & 0x8000u));
    return;
  }
  const std::uint16_t want = reference_rne<F>(x);
  if (got != want) {
    BOOST_TEST_INFO("x = " << x << " bits 0x" << std::hex << xb);
    BOOST_TEST(got == want);
  }
}

// lo, the midpoint and its float neighbours, for every adjacent pair, both signs.
template <class F>
void check_rne_all_neighbourhoods() {
  const auto& t = table<F>();
  const float float_inf = std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i + 1 < t.size(); ++i) {
    const double mid = (t[i] + t[i + 1]) / 2;
    const auto fmid = static_cast<float>(mid);
    BOOST_REQUIRE(static_cast<double>(fmid) == mid);  // a midpoint needs one more bit: exact
    const auto lo = static_cast<float>(t[i]);
    for (float x : {lo, std::nextafter(lo, float_inf), fmid, std::nextafter(fmid, 0.0f),
                    std::nextafter(fmid, float_inf)}) {
      check_rne<F>(x);
      check_rne<F>(-x);
    }
  }
}

// Checks that `got` is one of the two neighbours of x and returns whether it is the upper.
template <class F>
bool sr_is_up(float x, std::uint16_t got, bool& ok) {
  const auto sign = static_cast<std::uint16_t>((bits_of(x) >> 16) & 0x8000u);
  const auto [lo, exact] = find_neighbours<F>(std::fabs(static_cast<double>(x)));
  const auto hi = static_cast<std::uint16_t>(exact ? lo : lo + 1);
  ok = got == (sign | lo) || got == (sign | hi);
  return !exact && got == (sign | hi);
}

// Over n draws, the count of round-ups matches the binomial with p = (|x| - lo) / (hi - lo)
// to within 5 sigma; equivalently E[result] == x.
template <class F, class Round>
void check_sr_mean(float x, Round round, std::uint64_t key) {
  constexpr std::uint64_t n = 200000;
  const double ax = std::fabs(static_cast<double>(x));
  const auto [lo, exact] = find_neighbours<F>(ax);
  BOOST_REQUIRE(!exact);
  const auto& t = table<F>();
  const double p = (ax - t[lo]) / (t[lo + 1] - t[lo]);
  std::uint64_t ups = 0;
  bool all_ok = true;
  for (std::uint64_t i = 0; i < n; ++i) {
    bool ok = true;
    ups += sr_is_up<F>(x, round(x, distopt::detail::mix32(key, i)).bits, ok) ? 1 : 0;
    all_ok = all_ok && ok;
  }
  BOOST_TEST_INFO("x = " << x << " p = " << p << " ups = " << ups);
  BOOST_TEST(all_ok);
  const double sigma = std::sqrt(static_cast<double>(n) * p * (1 - p));
  BOOST_TEST(std::fabs(static_cast<double>(ups) - static_cast<double>(n) * p) <= 5 * sigma + 1);
}

// Uniform over all bit patterns (every exponent) and over the fp16-relevant exponents.
std::vector<float> random_floats() {
  std::mt19937_64 gen(20260301);
  std::vector<float> v;
  std::uniform_int_distribution<std::uint32_t> any;
  std::uniform_int_distribution<std::uint32_t> exponent(90, 145);
  for (int i = 0; i < 1 << 20; ++i) {
    v.push_back(float_of(any(gen)));
    const std::uint32_t u = any(gen);
    v.push_back(float_of((u & 0x807fffffu) | (exponent(gen) << 23)));
  }
  return v;
}

const float inf = std::numeric_limits<float>::infinity();

}  // namespace

BOOST_AUTO_TEST_SUITE(types)

BOOST_AUTO_TEST_SUITE(layout_and_dtype)

static_assert(std::is_trivially_copyable_v<bf16> && std::is_standard_layout_v<bf16> && sizeof(bf16) == 2);
static_assert(std::is_trivially_copyable_v<fp16> && std::is_standard_layout_v<fp16> && sizeof(fp16) == 2);
static_assert(!std::is_convertible_v<float, bf16> && !std::is_convertible_v<bf16, float>);
static_assert(!std::is_convertible_v<float, fp16> && !std::is_convertible_v<fp16, float>);
static_assert(distopt::number<float> && distopt::number<bf16> && distopt::number<fp16>);
static_assert(!distopt::number<double> && !distopt::number<std::uint16_t> && !distopt::number<const float>);
static_assert(distopt::dtype_of<float> == distopt::dtype::f32);
static_assert(distopt::dtype_of<bf16> == distopt::dtype::bf16);
static_assert(distopt::dtype_of<fp16> == distopt::dtype::f16);
// Conversions are usable in constant expressions.
static_assert(bf16(1.0f).bits == 0x3f80 && fp16(1.0f).bits == 0x3c00);
static_assert(distopt::to_float(fp16::from_bits(0x0001)) == 0x1p-24f);
static_assert(distopt::from_float<float>(0.1f) == 0.1f);
static_assert(distopt::from_float<bf16>(-2.0f).bits == 0xc000);

BOOST_AUTO_TEST_CASE(dtype_names_sizes_and_parsing) {
  using distopt::dtype;
  BOOST_TEST(distopt::dtype_name(dtype::f32) == "fp32");
  BOOST_TEST(distopt::dtype_name(dtype::bf16) == "bf16");
  BOOST_TEST(distopt::dtype_name(dtype::f16) == "fp16");
  BOOST_TEST(distopt::dtype_size(dtype::f32) == 4u);
  BOOST_TEST(distopt::dtype_size(dtype::bf16) == sizeof(bf16));
  BOOST_TEST(distopt::dtype_size(dtype::f16) == sizeof(fp16));
  for (std::string_view s : {"fp32", "f32", "float32"}) BOOST_TEST((distopt::parse_dtype(s) == dtype::f32));
  for (std::string_view s : {"bf16", "bfloat16"}) BOOST_TEST((distopt::parse_dtype(s) == dtype::bf16));
  for (std::string_view s : {"fp16", "f16", "float16"}) BOOST_TEST((distopt::parse_dtype(s) == dtype::f16));
  for (std::string_view s : {"", "FP32", "fp64", "half", "bf16 ", "float"}) BOOST_TEST(!distopt::parse_dtype(s));
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16}) BOOST_TEST((distopt::parse_dtype(distopt::dtype_name(t)) == t));
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(round_to_nearest)

BOOST_AUTO_TEST_CASE(bf16_every_pattern_decodes_and_round_trips) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = distopt::to_float(bf16::from_bits(h));
    BOOST_TEST_INFO("bits 0x" << std::hex << b);
    BOOST_TEST(bits_of(f) == b << 16);  // bf16 is the upper half of a float, by definition
    BOOST_TEST(bits_of(static_cast<float>(bf16::from_bits(h))) == b << 16);
    const std::uint16_t back = bf16(f).bits;
    if (is_nan_bits<bf16_format>(h)) {
      BOOST_TEST(std::isnan(f));
      BOOST_TEST(is_nan_bits<bf16_format>(back));
      BOOST_TEST((back & 0x8000u) == (h & 0x8000u));
    } else {
      BOOST_TEST(static_cast<double>(f) == decode<bf16_format>(h));
      BOOST_TEST(back == h);
    }
  }
}

BOOST_AUTO_TEST_CASE(fp16_every_pattern_decodes_and_round_trips) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = distopt::to_float(fp16::from_bits(h));
    BOOST_TEST_INFO("bits 0x" << std::hex << b);
    const std::uint16_t back = fp16(f).bits;
    if (is_nan_bits<fp16_format>(h)) {
      // Quietened (IEEE convertFormat, vcvtph2ps), sign and payload kept, both ways.
      const std::uint32_t quiet = (static_cast<std::uint32_t>(h & 0x8000u) << 16) | 0x7fc00000u |
                                  (static_cast<std::uint32_t>(h & 0x3ffu) << 13);
      BOOST_TEST(std::bit_cast<std::uint32_t>(f) == quiet);
      BOOST_TEST(back == (h | 0x0200u));
    } else {
      BOOST_TEST(static_cast<double>(f) == decode<fp16_format>(h));
      BOOST_TEST(std::signbit(f) == ((h & 0x8000u) != 0));  // -0.0 too
      BOOST_TEST(back == h);
    }
  }
}

BOOST_AUTO_TEST_CASE(bf16_rne_at_every_tie_and_neighbour) { check_rne_all_neighbourhoods<bf16_format>(); }

BOOST_AUTO_TEST_CASE(fp16_rne_at_every_tie_and_neighbour) { check_rne_all_neighbourhoods<fp16_format>(); }

#if DISTOPT_HAS_F16C_PATH
// The F16C array conversions (vcvtph2ps, vcvtps2ph) against the portable ones on every bit
// pattern: all 2^16 binary16 and all 2^32 binary32 (two threads, about 4 s), with the
// vector tails at odd lengths. Nothing to compare on a CPU without F16C. Under a sanitizer
// (43 s at -O1) every 17th block of 2^16 patterns (17: every tail length still occurs): the
// sanitizer checks the memory accesses, the release build all the values.
BOOST_AUTO_TEST_CASE(fp16_f16c_arrays_equal_portable_on_every_pattern) {
  if (!distopt::detail::f16c_path()) {
    BOOST_TEST_MESSAGE("this CPU has no F16C: only the portable path runs here");
    return;
  }
  namespace d = distopt::detail;
  std::vector<fp16> h(0x10000);
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) h[b] = fp16::from_bits(static_cast<std::uint16_t>(b));
  for (std::size_t n : {std::size_t{0x10000}, std::size_t{13}, std::size_t{7}}) {
    std::vector<float> hw(n), sw(n);
    d::f16c::to_float(h.data(), hw.data(), n);
    d::fp16_to_float_portable(h.data(), sw.data(), n);
    BOOST_TEST(std::memcmp(hw.data(), sw.data(), n * sizeof(float)) == 0);
  }
  std::uint64_t mismatches[2] = {};
#if DISTOPT_TEST_SANITIZED
  constexpr std::uint64_t stride = 17;
#else
  constexpr std::uint64_t stride = 1;
#endif
  auto encode_half = [&](int t) {
    constexpr std::size_t K = 1 << 16;
    std::vector<float> in(K);
    std::vector<fp16> a(K), b(K);
    for (std::uint64_t hi = t * 0x8000u; hi < (t + 1) * 0x8000u; hi += stride) {
      for (std::size_t i = 0; i < K; ++i) in[i] = std::bit_cast<float>(static_cast<std::uint32_t>((hi << 16) | i));
      const std::size_t n = K - hi % 8;  // and the last 0..7 elements alone: the tail code
      d::f16c::from_float(in.data(), a.data(), n);
      d::f16c::from_float(in.data() + n, a.data() + n, K - n);
      d::float_to_fp16_portable(in.data(), b.data(), K);
      for (std::size_t i = 0; i < K; ++i) mismatches[t] += a[i].bits != b[i].bits;
    }
  };
  std::thread other(encode_half, 1);
  encode_half(0);
  other.join();
  BOOST_TEST(mismatches[0] + mismatches[1] == 0u);
}
#endif

BOOST_AUTO_TEST_CASE(rne_random_floats) {
  for (float x : random_floats()) {
    check_rne<bf16_format>(x);
    check_rne<fp16_format>(x);
  }
}

BOOST_AUTO_TEST_CASE(rne_edge_cases) {
  const float fmax = std::numeric_limits<float>::max();
  const float edge[] = {0.0f, -0.0f, inf, -inf, fmax, -fmax, std::numeric_limits<float>::min(),
                        std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                        float_of(0x007fffffu), 1.0f, -1.0f, 0x1p-24f, 0x1p-25f, 0x1.000002p-25f,
                        0x1.8p-24f, 0x1p-14f, 0x1.ff8p-15f, 0x1.ffcp-15f, 65504.0f, 65519.996f, 65520.0f, 65536.0f,
                        -65520.0f, 1e10f, 0x1.fep127f, 0x1.ffp127f, std::nextafter(0x1.ffp127f, 0.0f)};
  for (float x : edge) {
    check_rne<bf16_format>(x);
    check_rne<fp16_format>(x);
  }
  // Spelled-out expectations, as a readable cross-check of the table reference.
  BOOST_TEST(bf16(-0.0f).bits == 0x8000);
  BOOST_TEST(fp16(-0.0f).bits == 0x8000);
  BOOST_TEST(bf16(fmax).bits == 0x7f80);               // above max + ulp/2: infinity
  BOOST_TEST(bf16(0x1.ffp127f).bits == 0x7f80);        // exactly max + ulp/2, odd max: infinity
  BOOST_TEST(bf16(std::nextafter(0x1.ffp127f, 0.0f)).bits == 0x7f7f);
  BOOST_TEST(fp16(65519.996f).bits == 0x7bff);
  BOOST_TEST(fp16(65520.0f).bits == 0x7c00);
  BOOST_TEST(fp16(0x1p-25f).bits == 0x0000);           // halfway to the smallest subnormal: even zero
  BOOST_TEST(fp16(0x1.000002p-25f).bits == 0x0001);
  BOOST_TEST(fp16(0x1.8p-24f).bits == 0x0002);         // 1.5 units: tie to even 2
  BOOST_TEST(fp16(0x1.ffcp-15f).bits == 0x0400);       // tie, odd lsb: up into the smallest normal
  BOOST_TEST(bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  BOOST_TEST(bf16(float_of(0x00008000u)).bits == 0x0000);  // fp32 subnormal tie, even
  BOOST_TEST(bf16(float_of(0x00018000u)).bits == 0x0002);  // fp32 subnormal tie, odd lsb: up
  BOOST_TEST(bf16(1.0f + 0x1p-8f).bits == 0x3f80);     // tie, even: down
  BOOST_TEST(bf16(1.0f + 0x3p-8f).bits == 0x3f82);     // tie, odd: up
}

BOOST_AUTO_TEST_CASE(nan_stays_nan) {
  for (std::uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7f80ffffu,
                          0x7f801fffu, 0x7fffffffu, 0xffffffffu}) {
    const float x = float_of(u);
    BOOST_TEST_INFO("x bits 0x" << std::hex << u);
    BOOST_TEST(std::isnan(distopt::to_float(bf16(x))));
    BOOST_TEST(std::isnan(distopt::to_float(fp16(x))));
    BOOST_TEST(std::isnan(distopt::to_float(distopt::stochastic_round_bf16(x, 0xffffffffu))));
    BOOST_TEST(std::isnan(distopt::to_float(distopt::stochastic_round_fp16(x, 0xffffffffu))));
    check_rne<bf16_format>(x);
    check_rne<fp16_format>(x);
  }
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(stochastic)

BOOST_AUTO_TEST_CASE(mix32_bits_are_balanced) {
  constexpr std::uint64_t n = 100000;
  for (std::uint64_t key : {0ull, 1ull, 0xdeadbeefull}) {
    std::uint64_t count[32] = {};
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint32_t r = distopt::detail::mix32(key, i);
      for (int b = 0; b < 32; ++b) count[b] += (r >> b) & 1u;
    }
    const double five_sigma = 5 * std::sqrt(static_cast<double>(n)) / 2;
    for (int b = 0; b < 32; ++b) {
      BOOST_TEST_INFO("key " << key << " bit " << b << " count " << count[b]);
      BOOST_TEST(std::fabs(static_cast<double>(count[b]) - n / 2.0) <= five_sigma);
    }
  }
  // Stateless: the same (key, counter) gives the same bits; other keys give other bits.
  int same = 0;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    BOOST_TEST(distopt::detail::mix32(7, i) == distopt::detail::mix32(7, i));
    same += distopt::detail::mix32(7, i) == distopt::detail::mix32(8, i) ? 1 : 0;
  }
  BOOST_TEST(same <= 1);
}

BOOST_AUTO_TEST_CASE(bf16_result_is_a_neighbour) {
  int bad = 0;
  std::uint64_t i = 0;
  for (float x : random_floats()) {
    if (std::isnan(x)) continue;
    for (std::uint32_t r : {0u, 0xffffu, 0xffffffffu, distopt::detail::mix32(3, i++)}) {
      bool ok = true;
      const auto got = distopt::stochastic_round_bf16(x, r).bits;
      const bool up = sr_is_up<bf16_format>(x, got, ok);
      bad += ok ? 0 : 1;
      // Zero random bits truncate; all-ones round up whenever x is not exact.
      if (r == 0u) bad += up ? 1 : 0;
      if ((r & 0xffffu) == 0xffffu && (bits_of(x) & 0xffffu) != 0 && std::isfinite(x)) bad += up ? 0 : 1;
    }
  }
  BOOST_TEST(bad == 0);
}

BOOST_AUTO_TEST_CASE(fp16_result_is_a_neighbour) {
  int bad = 0;
  std::uint64_t i = 0;
  for (float x : random_floats()) {
    if (std::isnan(x)) continue;
    for (std::uint32_t r : {0u, 0x1fffu, 0xffffffffu, distopt::detail::mix32(4, i++)}) {
      bool ok = true;
      const auto got = distopt::stochastic_round_fp16(x, r).bits;
      const bool up = sr_is_up<fp16_format>(x, got, ok);
      bad += ok ? 0 : 1;
      if (r == 0u) bad += up ? 1 : 0;
    }
  }
  BOOST_TEST(bad == 0);
}

BOOST_AUTO_TEST_CASE(exact_values_never_change) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    for (std::uint32_t r : {0u, 0x1fffu, 0xffffu, 0xffffffffu, distopt::detail::mix32(5, b)}) {
      if (!is_nan_bits<bf16_format>(h)) {
        const float x = distopt::to_float(bf16::from_bits(h));
        BOOST_TEST_INFO("bf16 0x" << std::hex << b << " r 0x" << r);
        BOOST_TEST(distopt::stochastic_round_bf16(x, r).bits == h);  // including +-inf
      }
      if (!is_nan_bits<fp16_format>(h)) {
        const float x = distopt::to_float(fp16::from_bits(h));
        BOOST_TEST_INFO("fp16 0x" << std::hex << b << " r 0x" << r);
        BOOST_TEST(distopt::stochastic_round_fp16(x, r).bits == h);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(infinity_boundary) {
  const float fmax = std::numeric_limits<float>::max();
  // The largest finite bf16 never becomes inf; above it, infinity plays the next value 2^128.
  BOOST_TEST(distopt::stochastic_round_bf16(0x1.fep127f, 0xffffffffu).bits == 0x7f7f);
  BOOST_TEST(distopt::stochastic_round_bf16(fmax, 0).bits == 0x7f7f);
  BOOST_TEST(distopt::stochastic_round_bf16(fmax, 0xffffu).bits == 0x7f80);
  BOOST_TEST(distopt::stochastic_round_bf16(-inf, 0xffffffffu).bits == 0xff80);
  BOOST_TEST(distopt::stochastic_round_fp16(65504.0f, 0xffffffffu).bits == 0x7bff);
  BOOST_TEST(distopt::stochastic_round_fp16(65505.0f, 0).bits == 0x7bff);
  BOOST_TEST(distopt::stochastic_round_fp16(65505.0f, 0x1fffu).bits == 0x7c00);
  BOOST_TEST(distopt::stochastic_round_fp16(1e6f, 0).bits == 0x7c00);  // overflow, as in RNE
  BOOST_TEST(distopt::stochastic_round_fp16(-inf, 0).bits == 0xfc00);
  BOOST_TEST(distopt::stochastic_round_bf16(-0.0f, 0xffffffffu).bits == 0x8000);
  BOOST_TEST(distopt::stochastic_round_fp16(-0.0f, 0xffffffffu).bits == 0x8000);
}

BOOST_AUTO_TEST_CASE(bf16_mean_is_unbiased) {
  const auto round = [](float x, std::uint32_t r) { return distopt::stochastic_round_bf16(x, r); };
  const float cases[] = {1.0f + 0x1p-10f, -3.14159265f, 0.1f, -0.1f, std::nextafter(2.0f, 0.0f),
                         std::nextafter(2.0f, 4.0f), -std::nextafter(0.5f, 0.0f), 1.2345e-40f,
                         1e30f, std::numeric_limits<float>::max(), 3.3e38f};
  std::uint64_t key = 100;
  for (float x : cases) check_sr_mean<bf16_format>(x, round, key++);
}

BOOST_AUTO_TEST_CASE(fp16_mean_is_unbiased) {
  const auto round = [](float x, std::uint32_t r) { return distopt::stochastic_round_fp16(x, r); };
  const float cases[] = {0.1f, -1.33333f, 1000.7f, 0x1.8p-34f, std::nextafter(1024.0f, 0.0f), 65519.0f, -65530.0f,
                         3e-6f, -6e-8f, 1e-9f, -0x1.8p-30f, std::nextafter(0x1p-14f, 0.0f), 1.2345e-40f};
  std::uint64_t key = 200;
  for (float x : cases) check_sr_mean<fp16_format>(x, round, key++);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE_END()
