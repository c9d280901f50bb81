// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// 8-bit block-wise states (q8): the maps against bitsandbytes' own values, the lookup
// quantizer against a brute-force search over the committed map, the round-trip error
// against the map's spacing, the fused loop against an independent float64 model
// (tests/reference/q8/*.trace.txt, make_q8_traces.py) and against the library's own
// unfused pieces, bit-identity for d = 1..8 and thread counts, the min_8bit_size rule,
// percentile clipping against bitsandbytes' own (tests/reference/q8/percentile_golden.txt,
// make_percentile_golden.py), the memory table and the refusals.
#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "sharded_harness.hpp"

using namespace distopt;

namespace {

/// A committed file of tests/reference/q8/, open for reading.
std::ifstream open_q8_reference(const std::string& file) {
  std::ifstream in(std::string(DISTOPT_REFERENCE_DIR) + "/q8/" + file);
  BOOST_REQUIRE_MESSAGE(in, "cannot open tests/reference/q8/" << file);
  return in;
}

/// The 256 values of a committed map file (tests/reference/q8/, from bitsandbytes).
std::vector<float> read_map(const std::string& file) {
  std::ifstream in = open_q8_reference(file);
  std::vector<float> v;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    int index = 0;
    std::string hex;
    ls >> index >> hex;
    BOOST_REQUIRE_EQUAL(index, static_cast<int>(v.size()));
    v.push_back(std::strtof(hex.c_str(), nullptr));
  }
  return v;
}

const detail::q8_codebook& book(bool is_signed) {
  return is_signed ? detail::signed_codebook() : detail::unsigned_codebook();
}

}  // namespace

BOOST_AUTO_TEST_CASE(maps_equal_bitsandbytes_bit_for_bit) {
  for (const bool is_signed : {true, false}) {
    const std::vector<float> want = read_map(is_signed ? "dynamic_signed.txt" : "dynamic_unsigned.txt");
    BOOST_REQUIRE_EQUAL(want.size(), 256u);
    const auto& got = book(is_signed).values();
    int differ = 0;
    for (std::size_t c = 0; c < 256; ++c)
      if (std::bit_cast<std::uint32_t>(got[c]) != std::bit_cast<std::uint32_t>(want[c])) {
        if (++differ <= 5)
          BOOST_ERROR((is_signed ? "signed" : "unsigned") << " map, code " << c << ": distopt " << got[c]
                                                           << ", bitsandbytes " << want[c]);
      }
    BOOST_TEST(differ == 0);
  }
  // The structure the lookup relies on: 0 and 1 are codes, and the signed map is
  // symmetric except for 1.
  BOOST_TEST(book(false).values()[book(false).zero_code()] == 0.0f);
  BOOST_TEST(book(true).values()[255] == 1.0f);
  BOOST_TEST(book(true).values()[0] == -book(true).values()[254]);
}

namespace {

/// The nearest code of y by brute force over the 256 values of the committed map (exact
/// distances in long double), halfway to the larger code; `tie` is set where y is within
/// one float32 rounding of halfway between two codes, where either answer is right
/// (the library's thresholds are float32 midpoints).
std::uint8_t nearest_by_search(const std::vector<float>& map, float y, bool& tie) {
  std::size_t best = 0;
  long double best_d = std::fabs(static_cast<long double>(map[0]) - y);
  for (std::size_t c = 1; c < 256; ++c) {
    const long double d = std::fabs(static_cast<long double>(map[c]) - y);
    if (d <= best_d) best = c, best_d = d;  // ascending map: ties go to the larger code
  }
  tie = false;
  for (std::size_t c : {best - 1, best + 1}) {
    if (c >= 256) continue;
    const long double other = std::fabs(static_cast<long double>(map[c]) - y);
    const long double mid = (static_cast<long double>(map[c]) + map[best]) / 2;
    if (other - best_d <= std::ldexp(std::fabs(mid), -23)) tie = true;
  }
  return static_cast<std::uint8_t>(best);
}

}  // namespace

BOOST_AUTO_TEST_CASE(lookup_equals_nearest_code_by_brute_force) {
  for (const bool is_signed : {true, false}) {
    const std::vector<float> map = read_map(is_signed ? "dynamic_signed.txt" : "dynamic_unsigned.txt");
    const detail::q8_codebook& b = book(is_signed);
    std::size_t checked = 0, ties = 0, wrong = 0;
    const auto check = [&](float y) {
      ++checked;
      bool tie = false;
      const std::uint8_t want = nearest_by_search(map, y, tie);
      const std::uint8_t got = b.nearest(y);
      ties += tie;
      // At a tie either neighbour is the nearest code to float32 rounding.
      const bool ok = got == want || (tie && (got + 1 == want || got == want + 1));
      if (!ok && ++wrong <= 5)
        BOOST_ERROR((is_signed ? "signed" : "unsigned") << " y = " << y << ": lookup " << int(got)
                                                         << ", nearest by search " << int(want));
    };
    // Every midpoint between neighbouring codes and its float neighbours (where the
    // answer changes), both signs; midpoints computed here in double from the map file.
    for (std::size_t c = 0; c < 255; ++c) {
      const float t = static_cast<float>((static_cast<double>(map[c]) + map[c + 1]) / 2);
      for (float y : {t, std::nextafter(t, -2.0f), std::nextafter(t, 2.0f),
                      std::nextafter(std::nextafter(t, -2.0f), -2.0f), std::nextafter(std::nextafter(t, 2.0f), 2.0f)}) {
        check(y);
        check(-y);
      }
    }
    // A sweep over float bit patterns in [-1.5, 1.5] (every 6007th: the search is 256
    // comparisons), and the edges.
    for (std::uint32_t u = 0; u <= std::bit_cast<std::uint32_t>(1.5f); u += 6007) {
      check(std::bit_cast<float>(u));
      check(-std::bit_cast<float>(u));
    }
    for (float y : {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, 2.0f, -2.0f, std::numeric_limits<float>::denorm_min()})
      check(y);
    BOOST_TEST_MESSAGE((is_signed ? "signed" : "unsigned") << " map: " << checked << " values, " << ties
                                                           << " within float32 rounding of a midpoint");
    BOOST_TEST(wrong == 0u);
    BOOST_TEST(checked > 300000u);
  }
}

// The AVX-512 decoder that update_range_q8 takes where the CPU has VBMI gives the portable
// loop's bits: every code, both maps, at scales from 0 to infinity and NaN, at block lengths
// with and without a tail. Reported skipped where the CPU lacks AVX-512 VBMI (Zen 3,
// Cascade Lake and older); the q8 rows of cpu_paths_agree check the same through whole steps.
BOOST_AUTO_TEST_CASE(avx512_decode_equals_the_portable_loop,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(detail::q8_avx512::available());
                     })) {
#if DISTOPT_HAS_Q8_AVX512_PATH
  std::mt19937 rng(19);
  for (const bool is_signed : {true, false}) {
    const detail::q8_codebook& b = book(is_signed);
    // Decode: every code, shuffled, at block lengths with and without a tail.
    std::vector<std::uint8_t> codes(4 * 256);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(i);
    std::shuffle(codes.begin(), codes.end(), rng);
    std::size_t decoded = 0, decode_differ = 0;
    for (const std::size_t m : {256u, 255u, 192u, 129u, 64u, 63u, 1u})
      for (const float absmax : {1.0f, 0.0f, 3.5e-7f, 0.37f, 2.5e30f, std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN()})
        for (std::size_t at = 0; at + m <= codes.size(); at += 256) {
          std::vector<float> want(m), got(m);
          detail::decode_block(b.values().data(), codes.data() + at, absmax, m, want.data());
          detail::q8_avx512::decode_block(b.values().data(), b.simd(), codes.data() + at, absmax, m, got.data());
          for (std::size_t i = 0; i < m; ++i)
            decode_differ += std::bit_cast<std::uint32_t>(want[i]) != std::bit_cast<std::uint32_t>(got[i]);
          decoded += m;
        }
    BOOST_TEST(decode_differ == 0u, (is_signed ? "signed" : "unsigned") << " decode: " << decode_differ << " of "
                                                                        << decoded << " values differ");
  }
#endif
}

// The AVX-512 encode that update_range_q8 takes where the CPU has VBMI gives the portable
// loop's codes:
// - its estimate is the nearest code or the one below it, at every threshold and its float
//   neighbours and at random floats below 2 in magnitude, both maps;
// - the kernel over every float y with |y| < 2 (a normal absmax keeps |x / absmax| within
//   2^-21 of 1), both signs, at lengths with a tail (6 s on two threads); under a sanitizer
//   (the suites build at -O0 there) every 97th run of 2^16 patterns: the sanitizer checks
//   the accesses, the release build every value;
// - requantize_block (absmax and codes) for blocks whose absmax is normal (near FLT_MAX too,
//   where 1 / absmax is subnormal), subnormal, zero, infinite or NaN, the last four through
//   its portable fallback.
// Reported skipped where the CPU lacks AVX-512 VBMI; cpu_paths_agree checks whole steps.
BOOST_AUTO_TEST_CASE(avx512_encode_equals_the_portable_loop,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(detail::q8_avx512::available());
                     })) {
#if DISTOPT_HAS_Q8_AVX512_PATH
  std::mt19937 rng(23);
  for (const bool is_signed : {true, false}) {
    const char* name = is_signed ? "signed" : "unsigned";
    const detail::q8_codebook& b = book(is_signed);
    const detail::q8_simd_tables& t = b.simd();
    BOOST_TEST_REQUIRE(t.has_estimate, name << ": the estimate does not serve the dynamic map");
    std::size_t off = 0;
    const auto bracket = [&](float y) {
      const int want = b.nearest(y), e = t.estimate(y);
      if ((e != want && e + 1 != want) && ++off <= 5)
        BOOST_ERROR(name << " y = " << y << ": estimate " << e << ", nearest " << want);
    };
    for (std::size_t c = 0; c < 255; ++c) {
      float y = b.threshold(c);
      for (int k = 0; k < 4; ++k) y = std::nextafter(y, -2.0f);
      for (int k = 0; k < 9; ++k, y = std::nextafter(y, 2.0f)) bracket(y);
    }
    std::uniform_int_distribution<std::uint32_t> below2(0, 0x3fffffffu);
    for (int k = 0; k < 1000000; ++k) bracket(std::bit_cast<float>(below2(rng) | (static_cast<std::uint32_t>(rng()) & 0x80000000u)));
    BOOST_TEST(off == 0u, name << ": the estimate is off at " << off << " values");

#if DISTOPT_TEST_SANITIZED
    constexpr std::uint32_t stride = 97;
#else
    constexpr std::uint32_t stride = 1;
#endif
    constexpr std::uint32_t K = 1u << 16, last = 0x3fffffffu;  // the float below 2
    std::size_t encoded[2] = {}, differ[2] = {};
    const auto sweep = [&](int half) {  // one sign each, on two threads
      const std::uint32_t sign = half ? 0x80000000u : 0u;
      std::vector<float> in(K);
      std::vector<std::uint8_t> want(K), got(K);
      for (std::uint32_t hi = 0; hi <= last / K; hi += stride) {
        const std::uint32_t n = std::min(K, last - hi * K + 1);
        for (std::uint32_t i = 0; i < n; ++i) in[i] = std::bit_cast<float>((hi * K + i) | sign);
        const std::uint32_t cut = n - hi % 64;  // and the last 0..63 alone: the tail code
        detail::encode_block(in.data(), 1.0f, n, b.lookup(), want.data());
        detail::q8_avx512::encode_block(t, b.lookup(), in.data(), 1.0f, cut, got.data());
        detail::q8_avx512::encode_block(t, b.lookup(), in.data() + cut, 1.0f, n - cut, got.data() + cut);
        if (std::memcmp(want.data(), got.data(), n) != 0)
          for (std::uint32_t i = 0; i < n; ++i) differ[half] += want[i] != got[i];
        encoded[half] += n;
      }
    };
    std::thread other(sweep, 1);
    sweep(0);
    other.join();
    BOOST_TEST(differ[0] + differ[1] == 0u, name << " encode: " << differ[0] + differ[1] << " of "
                                                 << encoded[0] + encoded[1] << " codes differ");
    const std::size_t all = 2 * std::size_t{last + 1};
    BOOST_TEST(encoded[0] + encoded[1] >= all / stride);

    std::normal_distribution<float> normal;
    std::size_t blocks_differ = 0;
    const float tiny = std::numeric_limits<float>::denorm_min(), inf = std::numeric_limits<float>::infinity();
    for (const float scale : {1.0f, 3e-4f, 2e30f, 1e-39f, 0.0f})
      for (const float odd : {0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), tiny,
                              std::bit_cast<float>(0x7f61988bu)})  // 3.0e38: x / absmax up to 1 + 2^-22
        for (const std::size_t m : {256u, 255u, 200u, 64u, 63u, 1u}) {
          std::vector<float> x(m);
          for (float& v : x) v = (is_signed ? normal(rng) : std::fabs(normal(rng))) * scale;
          if (odd != 0.0f) x[m / 2] = is_signed || !(odd < 0.0f) ? odd : 0.0f;
          float amax_want = -1.0f, amax_got = -2.0f;
          std::vector<std::uint8_t> cw(m), cg(m);
          detail::requantize_block(x.data(), m, b.lookup(), amax_want, cw.data());
          detail::q8_avx512::requantize_block(t, b.lookup(), x.data(), m, amax_got, cg.data());
          blocks_differ += std::bit_cast<std::uint32_t>(amax_want) != std::bit_cast<std::uint32_t>(amax_got) ||
                           cw != cg;
        }
    BOOST_TEST(blocks_differ == 0u, name << " requantize: " << blocks_differ << " blocks differ");
  }
#endif
}

BOOST_AUTO_TEST_CASE(round_trip_error_within_half_the_map_spacing) {
  // Blocks of 256 values at scales from 1e-8 to 1e3, with zeros and a lone outlier: each
  // value reads back within absmax * (half the gap to the neighbouring code on its side),
  // and no other code is nearer (in double).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const bool is_signed : {true, false}) {
    const detail::q8_codebook& b = book(is_signed);
    const auto& v = b.values();
    double worst = 0.0;
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<float> x(256);
      const float scale = std::pow(10.0f, static_cast<float>(trial % 12) - 8.0f);
      for (float& e : x) e = normal(rng) * scale;
      if (!is_signed)
        for (float& e : x) e = e * e / scale;
      if (trial % 5 == 0) x[trial % 256] *= 1000.0f;  // one outlier squeezes the rest
      if (trial % 7 == 0) std::fill(x.begin(), x.begin() + 100, 0.0f);
      float amax = 0.0f;
      for (float e : x) amax = std::max(amax, std::fabs(e));
      const float inv = 1.0f / amax;
      for (float e : x) {
        const float y = e * inv;
        const std::uint8_t c = b.nearest(y);
        const double back = static_cast<double>(v[c]) * amax;
        // The half-gap on the side y lies; the outermost codes' cells reach to -1 (or 0)
        // and 1, the range of y.
        const double lowest = is_signed ? -1.0 : 0.0;
        const double gap = y >= v[c] ? (c < 255 ? (static_cast<double>(v[c + 1]) - v[c]) / 2 : 1.0 - v[c])
                                     : (c > 0 ? (static_cast<double>(v[c]) - v[c - 1]) / 2 : v[c] - lowest);
        const double err = std::fabs(back - e);
        BOOST_TEST_REQUIRE(err <= (gap + 1e-7) * amax, "value " << e << " code " << int(c) << " error " << err);
        for (int o : {-1, 1}) {
          const int n = static_cast<int>(c) + o;
          if (n < 0 || n > 255) continue;
          BOOST_TEST_REQUIRE(std::fabs(static_cast<double>(v[n]) - y) >= std::fabs(static_cast<double>(v[c]) - y) - 1e-7);
        }
        if (gap > 0) worst = std::max(worst, err / (gap * amax));
      }
    }
    BOOST_TEST(worst > 0.5);  // the bound is approached, so it is the right bound
  }
}

namespace {

/// One q8 step for one tensor from the library's unfused pieces (the map, the policy's
/// update, absmax of the block, nearest code by binary search over the thresholds): checks
/// the fused, vectorised loop bit for bit against them. Not an independent reference;
/// fused_loop_matches_an_independent_float64_model is.
template <class Policy>
void reference_q8_step(const typename Policy::scalars& sc, std::vector<float>& param, const std::vector<float>& grad,
                       std::vector<std::vector<std::uint8_t>>& codes, std::vector<std::vector<float>>& absmax) {
  const int slots = static_cast<int>(codes.size());
  const std::size_t n = param.size();
  for (std::size_t b0 = 0; b0 < n; b0 += 256) {
    const std::size_t m = std::min<std::size_t>(256, n - b0);
    std::vector<std::vector<float>> fresh(static_cast<std::size_t>(slots), std::vector<float>(m));
    for (std::size_t i = 0; i < m; ++i) {
      float st[4] = {};
      for (int k = 0; k < slots; ++k) {
        const auto& bk = state_slot_nonnegative<Policy>(k) ? detail::unsigned_codebook() : detail::signed_codebook();
        st[k] = bk.value(codes[k][b0 + i]) * absmax[k][b0 / 256];
      }
      Policy::update(sc, param[b0 + i], grad[b0 + i], st);
      for (int k = 0; k < slots; ++k) fresh[k][i] = st[k];
    }
    for (int k = 0; k < slots; ++k) {
      const auto& bk = state_slot_nonnegative<Policy>(k) ? detail::unsigned_codebook() : detail::signed_codebook();
      float amax = 0.0f;
      for (float e : fresh[k]) amax = std::max(amax, std::fabs(e));
      absmax[k][b0 / 256] = amax;
      for (std::size_t i = 0; i < m; ++i)
        codes[k][b0 + i] = bk.nearest_reference(amax > 0 ? fresh[k][i] * (1.0f / amax) : 0.0f);
    }
  }
}

template <class Policy>
void check_against_reference(const typename Policy::hyper_params& h) {
  const std::vector<std::size_t> sizes = {5000, 4096, 300, 9000};  // 300 < min_8bit_size
  layout l;
  for (std::size_t t = 0; t < sizes.size(); ++t) l.add(std::string("t").append(std::to_string(t)), {static_cast<std::int64_t>(sizes[t])}, dtype::f32);
  optimizer<Policy, replicated<q8>> opt(l, h, {}, cpu(2));
  const int slots = Policy::state_slots(h);
  std::vector<std::vector<float>> p(sizes.size());
  std::vector<std::vector<std::vector<std::uint8_t>>> codes(sizes.size());
  std::vector<std::vector<std::vector<float>>> amax(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    p[t].resize(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) p[t][i] = harness::init_value(t, i);
    std::copy(p[t].begin(), p[t].end(), opt.param(std::string("t").append(std::to_string(t))).begin());
    for (int k = 0; k < slots; ++k) {
      const auto& bk = state_slot_nonnegative<Policy>(k) ? detail::unsigned_codebook() : detail::signed_codebook();
      codes[t].emplace_back(sizes[t], bk.zero_code());
      amax[t].emplace_back((sizes[t] + 255) / 256, 0.0f);
    }
  }
  // The small tensor keeps fp32 states: its reference is the plain fp32 optimizer.
  optimizer<Policy> small(l, h);
  std::copy(p[2].begin(), p[2].end(), small.param("t2").begin());
  for (int s = 0; s < 12; ++s) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      auto g = opt.grad(std::string("t").append(std::to_string(t)));
      std::vector<float> grad(sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) grad[i] = harness::grad_value(s, t, i) * (t == 3 ? 1e-4f : 1.0f);
      std::copy(grad.begin(), grad.end(), g.begin());
      if (t == 2) std::copy(grad.begin(), grad.end(), small.grad("t2").begin());
      if (t != 2) reference_q8_step<Policy>(Policy::prepare(h, step_info{s + 1, s == 0}), p[t], grad, codes[t], amax[t]);
    }
    opt.step();
    small.step();
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::string name = std::string("t").append(std::to_string(t));
    const auto got = opt.param(name);
    if (t == 2) {
      BOOST_TEST(!opt.state_is_quantized(name));
      BOOST_TEST(std::equal(got.begin(), got.end(), small.param(name).begin()));
      continue;
    }
    BOOST_TEST(opt.state_is_quantized(name));
    BOOST_TEST(std::equal(got.begin(), got.end(), p[t].begin()), name << ": params differ from the reference");
    for (int k = 0; k < slots; ++k) {
      const auto c = opt.local_state_codes(name, k).values;
      const auto a = opt.local_state_absmax(name, k).values;
      BOOST_TEST(std::equal(c.begin(), c.end(), codes[t][k].begin(), codes[t][k].end()), name << " slot " << k << " codes");
      BOOST_TEST(std::equal(a.begin(), a.end(), amax[t][k].begin(), amax[t][k].end()), name << " slot " << k << " absmax");
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(fused_loop_equals_its_unfused_pieces) {
  check_against_reference<adamw>(adamw::hyper_params{});
  adam::hyper_params ams;
  ams.amsgrad = true;
  ams.lr = 1e-2;
  check_against_reference<adam>(ams);
  sgd::hyper_params mom;
  mom.lr = 0.05;
  mom.momentum = 0.9;
  mom.nesterov = true;
  check_against_reference<sgd>(mom);
  check_against_reference<lion>(lion::hyper_params{});
}

namespace {

/// One golden trace of tests/reference/q8/ (make_q8_traces.py: a float64 model of the
/// block-wise 8-bit states written apart from the library, from PyTorch's updates and
/// bitsandbytes' maps). Per step and tensor: absmax per slot and block, codes per slot,
/// params.
struct q8_trace {
  std::string policy;
  std::vector<std::pair<std::string, std::string>> hyper;
  int offset = 0;
  struct tensor {
    std::string name;
    std::size_t n = 0;
    float scale = 1.0f;
  };
  std::vector<tensor> tensors;
  struct tensor_step {
    std::vector<std::vector<double>> absmax;       // [slot][block]
    std::vector<std::vector<std::uint8_t>> codes;  // [slot][element]
    std::vector<double> params;
  };
  std::vector<std::vector<tensor_step>> steps;  // [step][tensor]
};

q8_trace read_trace(const std::string& file) {
  std::ifstream in = open_q8_reference(file);
  q8_trace tr;
  const auto tensor_index = [&](const std::string& name) {
    for (std::size_t t = 0; t < tr.tensors.size(); ++t)
      if (tr.tensors[t].name == name) return t;
    BOOST_FAIL(file << ": unknown tensor " << name);
    return std::size_t{0};
  };
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "policy") {
      ls >> tr.policy;
    } else if (key == "hyper") {
      for (std::string kv; ls >> kv;) {
        const auto eq = kv.find('=');
        tr.hyper.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      }
    } else if (key == "offset") {
      ls >> tr.offset;
    } else if (key == "tensor") {
      q8_trace::tensor t;
      double scale = 0;
      ls >> t.name >> t.n >> scale;
      t.scale = static_cast<float>(scale);
      tr.tensors.push_back(t);
    } else if (key == "step") {
      tr.steps.emplace_back(tr.tensors.size());
    } else {
      std::string name;
      ls >> name;
      BOOST_REQUIRE_MESSAGE(!tr.steps.empty(), file << ": '" << key << "' before the first step");
      auto& ts = tr.steps.back()[tensor_index(name)];
      if (key == "params") {
        for (double v; ls >> v;) ts.params.push_back(v);
        continue;
      }
      std::size_t slot = 0;
      ls >> slot;
      if (key == "absmax") {
        ts.absmax.resize(std::max(ts.absmax.size(), slot + 1));
        for (double v; ls >> v;) ts.absmax[slot].push_back(v);
      } else if (key == "codes") {
        ts.codes.resize(std::max(ts.codes.size(), slot + 1));
        std::string hex;
        ls >> hex;
        for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
          ts.codes[slot].push_back(static_cast<std::uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
      } else {
        BOOST_FAIL(file << ": unknown line '" << key << "'");
      }
    }
  }
  BOOST_REQUIRE_MESSAGE(!tr.steps.empty() && !tr.tensors.empty(), file << ": no steps or no tensors");
  return tr;
}

/// distopt's fused 8-bit loop against the float64 model, step by step: the codes equal
/// (the generator kept every value clear of a decision by more than float32 rounding),
/// absmax within float32 rounding of the model's, params within float32 rounding plus a
/// small fraction of how far they moved.
template <class Policy>
void check_against_model(const std::string& file) {
  const q8_trace tr = read_trace(file);
  BOOST_REQUIRE_EQUAL(tr.policy, std::string(Policy::name));
  const auto h = apply_hyper_params<Policy>(typename Policy::hyper_params{}, tr.hyper);
  layout l;
  for (const auto& t : tr.tensors) l.add(t.name, {static_cast<std::int64_t>(t.n)}, dtype::f32);
  optimizer_options o;
  o.min_8bit_size = 256;
  optimizer<Policy, replicated<q8>> opt(l, h, o, cpu(2));
  const int slots = Policy::state_slots(h);
  std::vector<std::vector<double>> p0(tr.tensors.size());
  for (std::size_t t = 0; t < tr.tensors.size(); ++t) {
    auto p = opt.param(tr.tensors[t].name);
    for (std::size_t i = 0; i < p.size(); ++i) p0[t].push_back(p[i] = harness::init_value(t, i));
  }
  double worst_param = 0.0, worst_absmax = 0.0;
  std::size_t codes_compared = 0;
  for (std::size_t s = 0; s < tr.steps.size(); ++s) {
    for (std::size_t t = 0; t < tr.tensors.size(); ++t) {
      auto g = opt.grad(tr.tensors[t].name);
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = harness::grad_value(tr.offset + static_cast<int>(s), t, i) * tr.tensors[t].scale;
    }
    opt.step();
    for (std::size_t t = 0; t < tr.tensors.size(); ++t) {
      const std::string& name = tr.tensors[t].name;
      const auto& want = tr.steps[s][t];
      BOOST_TEST_CONTEXT(file << " step " << s + 1 << " tensor " << name) {
        BOOST_TEST_REQUIRE(opt.state_is_quantized(name));
        BOOST_TEST_REQUIRE(want.codes.size() == static_cast<std::size_t>(slots));
        for (int k = 0; k < slots; ++k) {
          const auto c = opt.local_state_codes(name, k).values;
          const auto a = opt.local_state_absmax(name, k).values;
          BOOST_TEST_REQUIRE(c.size() == want.codes[k].size());
          BOOST_TEST_REQUIRE(a.size() == want.absmax[k].size());
          std::size_t differ = 0;
          for (std::size_t i = 0; i < c.size(); ++i, ++codes_compared)
            if (c[i] != want.codes[k][i] && ++differ <= 3)
              BOOST_ERROR("slot " << k << " element " << i << ": code " << int(c[i]) << ", the model's "
                                  << int(want.codes[k][i]));
          BOOST_TEST(differ == 0u, "slot " << k << ": " << differ << " codes differ");
          for (std::size_t b = 0; b < a.size(); ++b) {
            const double rel = std::fabs(a[b] - want.absmax[k][b]) / want.absmax[k][b];
            worst_absmax = std::max(worst_absmax, rel);
            BOOST_TEST(rel <= 2e-6, "slot " << k << " block " << b << ": absmax " << a[b] << ", the model's "
                                            << want.absmax[k][b]);
          }
        }
        const auto p = opt.param(name);
        BOOST_TEST_REQUIRE(p.size() == want.params.size());
        for (std::size_t i = 0; i < p.size(); ++i) {
          const double tol = 4e-7 * std::fabs(want.params[i]) + 1e-5 * std::fabs(want.params[i] - p0[t][i]) + 1e-12;
          const double err = std::fabs(p[i] - want.params[i]);
          worst_param = std::max(worst_param, err / tol);
          if (!(err <= tol)) {
            BOOST_ERROR("element " << i << ": param " << p[i] << ", the model's " << want.params[i]);
            break;
          }
        }
      }
    }
  }
  BOOST_TEST(codes_compared > 4000u);
  BOOST_TEST_MESSAGE(file << ": " << codes_compared << " codes equal; worst absmax error " << worst_absmax
                          << " (relative), worst param error " << worst_param << " of the tolerance");
}

}  // namespace

BOOST_AUTO_TEST_CASE(fused_loop_matches_an_independent_float64_model) {
  check_against_model<adamw>("adamw.trace.txt");
  check_against_model<adam>("adam_amsgrad.trace.txt");
  check_against_model<sgd>("sgd_nesterov.trace.txt");
  check_against_model<lion>("lion.trace.txt");
}

BOOST_AUTO_TEST_CASE(q8_adamw_tracks_fp32_adamw) {
  // 8-bit states change the trajectory only by the quantization error: after 50 steps
  // the params stay within a small fraction of how far fp32 AdamW moved them.
  layout l;
  l.add("w", {64, 128}, dtype::f32);
  adamw::hyper_params h;
  h.lr = 1e-3;
  optimizer<adamw, replicated<q8>> q(l, h);
  optimizer<adamw> f(l, h);
  std::vector<float> p0(64 * 128);
  for (std::size_t i = 0; i < p0.size(); ++i) p0[i] = harness::init_value(0, i);
  std::copy(p0.begin(), p0.end(), q.param("w").begin());
  std::copy(p0.begin(), p0.end(), f.param("w").begin());
  for (int s = 0; s < 50; ++s) {
    for (std::size_t i = 0; i < p0.size(); ++i) q.grad("w")[i] = f.grad("w")[i] = harness::grad_value(s % 7, 0, i) + 0.3f;
    q.step();
    f.step();
  }
  double moved = 0, diff = 0;
  for (std::size_t i = 0; i < p0.size(); ++i) {
    moved += std::pow(double(f.param("w")[i]) - p0[i], 2);
    diff += std::pow(double(f.param("w")[i]) - q.param("w")[i], 2);
  }
  BOOST_TEST_MESSAGE("q8 vs fp32 AdamW: relative difference " << std::sqrt(diff / moved));
  BOOST_TEST(std::sqrt(diff / moved) < 0.05);
  BOOST_TEST(diff > 0.0);  // the states really are 8-bit
}

namespace {
template <class Policy, class Prec>
void check_ranks(const std::vector<typename Policy::hyper_params>& h, std::size_t min_8bit_size, int percentile = 100) {
  for (const auto& lc : harness::awkward_layouts()) {
    const layout l = harness::make_layout(lc, dtype_of<typename Prec::param_type>, static_cast<int>(h.size()));
    harness::run_options ro;
    ro.options.bucket_elems = lc.bucket;
    ro.options.min_8bit_size = min_8bit_size;
    ro.options.percentile_clipping = percentile;
    ro.steps = percentile < 100 ? 30 : 20;
    ro.clip = 1.0;
    const harness::outcome one = harness::run_single<Policy, q8, Prec>(l, h, ro);
    ro.threads = 3;
    BOOST_TEST((harness::run_single<Policy, q8, Prec>(l, h, ro) == one), lc.name << ": 3 threads differ from 1");
    ro.threads = 1;
    for (int d = 1; d <= 8; ++d)
      BOOST_TEST((harness::run_threads<Policy, sharded<q8>, Prec>(d, l, h, ro) == one), lc.name << ": d = " << d);
  }
}
}  // namespace

BOOST_AUTO_TEST_CASE(bit_identical_for_d_1_to_8_and_thread_counts) {
  // min_8bit_size 256 quantizes the awkward layouts' larger tensors, whose shard cuts
  // then fall inside them; the smaller ones keep fp32 states.
  adamw::hyper_params w;
  w.lr = 1e-2;
  check_ranks<adamw, precision<float>>({w}, 256);
  check_ranks<adamw, precision<bf16>>({w}, 1);
  sgd::hyper_params m;
  m.momentum = 0.9;
  lion::hyper_params li;
  check_ranks<sgd, precision<float>>({m}, 256);
  check_ranks<lion, precision<bf16, float>>({li}, 256);
  // Percentile clipping: per-tensor norms of tensors cut across ranks, summed exactly.
  check_ranks<adamw, precision<float>>({w}, 256, 5);
}

namespace {
/// tests/reference/q8/percentile_golden.txt (make_percentile_golden.py): per step, the
/// gradient factors and, per percentile and tensor, bitsandbytes' percentile_clipping
/// results.
struct percentile_golden {
  struct result {
    double sq = 0, current = 0, clip = 0, scale = 0;
  };
  std::vector<std::pair<std::string, std::size_t>> tensors;  // name, elements
  std::vector<int> percentiles;
  std::vector<std::vector<float>> factors;              // [step - 1][tensor]
  std::vector<std::vector<std::vector<result>>> steps;  // [step - 1][percentile][tensor]
};

percentile_golden read_percentile_golden() {
  std::ifstream in = open_q8_reference("percentile_golden.txt");
  percentile_golden g;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "tensor") {
      std::string name;
      std::size_t n = 0;
      ls >> name >> n;
      g.tensors.emplace_back(name, n);
    } else if (key == "percentiles") {
      for (int p; ls >> p;) g.percentiles.push_back(p);
    } else if (key == "step") {
      int s = 0;
      ls >> s;
      BOOST_REQUIRE_EQUAL(s, static_cast<int>(g.steps.size()) + 1);
      std::vector<float> f;
      for (std::string v; ls >> v;) f.push_back(std::strtof(v.c_str(), nullptr));  // exact float32
      BOOST_REQUIRE_EQUAL(f.size(), g.tensors.size());
      g.factors.push_back(f);
      g.steps.emplace_back(g.percentiles.size(), std::vector<percentile_golden::result>(g.tensors.size()));
    } else if (key == "clip") {
      int p = 0;
      std::string name;
      percentile_golden::result r;
      ls >> p >> name >> r.sq >> r.current >> r.clip >> r.scale;
      BOOST_REQUIRE(ls && !g.steps.empty());
      const auto pi = std::find(g.percentiles.begin(), g.percentiles.end(), p) - g.percentiles.begin();
      const auto ti = std::find_if(g.tensors.begin(), g.tensors.end(), [&](const auto& t) { return t.first == name; }) -
                      g.tensors.begin();
      BOOST_REQUIRE(pi < static_cast<std::ptrdiff_t>(g.percentiles.size()) &&
                    ti < static_cast<std::ptrdiff_t>(g.tensors.size()));
      g.steps.back()[static_cast<std::size_t>(pi)][static_cast<std::size_t>(ti)] = r;
    } else {
      BOOST_FAIL("percentile_golden.txt: unknown line '" << line << "'");
    }
  }
  return g;
}

/// The generator's gradient patterns: base_w[i] = ((37 i) mod 101 - 50) / 64, base_b[i] =
/// ((11 i) mod 13 - 6) / 8 (exact in float32).
float percentile_base(std::size_t tensor, std::size_t i) {
  return tensor == 0 ? static_cast<float>(static_cast<int>((37 * i) % 101) - 50) / 64.0f
                     : static_cast<float>(static_cast<int>((11 * i) % 13) - 6) / 8.0f;
}
}  // namespace

BOOST_AUTO_TEST_CASE(percentile_clipping_as_bitsandbytes) {
  // Against bitsandbytes' own percentile_clipping (make_percentile_golden.py, 0.49.2: the
  // history index step % 100, the ascending sort, the percentile's entry, gnorm_scale),
  // 130 steps (the 100-entry history wraps) for percentiles 0, 5, 50, 95, 99 and 100
  // (off). SGD with lr 1 from zero params writes -scale * grad, so each step's scale per
  // tensor is read back: 1 exactly where bitsandbytes does not clip, its gnorm_scale to
  // float32 rounding where it does.
  const percentile_golden gold = read_percentile_golden();
  BOOST_REQUIRE_EQUAL(gold.steps.size(), 130u);
  BOOST_REQUIRE_EQUAL(gold.tensors.size(), 2u);
  layout l;
  for (const auto& [name, n] : gold.tensors) l.add(name, {static_cast<std::int64_t>(n)}, dtype::f32);
  sgd::hyper_params h;
  h.lr = 1.0;
  for (std::size_t pi = 0; pi < gold.percentiles.size(); ++pi) {
    const int percentile = gold.percentiles[pi];
    optimizer_options o;
    o.percentile_clipping = percentile;
    optimizer<sgd> opt(l, h, o);
    int clipped = 0;
    double worst = 0;  // relative, where bitsandbytes clips
    for (std::size_t s = 0; s < gold.steps.size(); ++s) {
      for (std::size_t t = 0; t < gold.tensors.size(); ++t) {
        const std::string& name = gold.tensors[t].first;
        auto g = opt.grad(name);
        double sq = 0;
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = percentile_base(t, i) * gold.factors[s][t];
          sq += double(g[i]) * g[i];
        }
        // The same gradient as the generator's: the squared norm bitsandbytes recorded.
        const double want_sq = gold.steps[s][pi][t].sq;
        BOOST_REQUIRE_MESSAGE(std::fabs(sq - want_sq) <= 1e-6 * want_sq,
                              "step " << s + 1 << " '" << name << "': squared norm " << sq << ", golden " << want_sq);
        std::fill(opt.param(name).begin(), opt.param(name).end(), 0.0f);
      }
      opt.step();
      for (std::size_t t = 0; t < gold.tensors.size(); ++t) {
        const std::string& name = gold.tensors[t].first;
        const percentile_golden::result& want = gold.steps[s][pi][t];
        const auto g = opt.grad(name);
        const auto p = opt.param(name);
        bool unscaled = true;
        double lo = std::numeric_limits<double>::infinity(), hi = 0;
        for (std::size_t i = 0; i < g.size(); ++i) {
          unscaled = unscaled && -p[i] == g[i];
          if (g[i] == 0.0f) continue;
          const double scale = -double(p[i]) / g[i];
          lo = std::min(lo, scale);
          hi = std::max(hi, scale);
        }
        const std::string where = "percentile " + std::to_string(percentile) + " step " + std::to_string(s + 1) +
                                  " '" + name + "'";
        if (want.scale == 1.0) {
          BOOST_TEST_REQUIRE(unscaled, where << ": clipped (scale " << lo << ".." << hi
                                             << "), bitsandbytes does not (current norm " << want.current
                                             << ", clip value " << want.clip << ")");
        } else {
          ++clipped;
          const double err = std::max(std::fabs(lo - want.scale), std::fabs(hi - want.scale)) / want.scale;
          worst = std::max(worst, err);
          BOOST_TEST_REQUIRE(err < 1e-6, where << ": scale " << lo << ".." << hi << ", bitsandbytes' gnorm_scale "
                                               << want.scale << " (current norm " << want.current << ", clip value "
                                               << want.clip << ")");
        }
      }
      opt.zero_grad();
    }
    BOOST_TEST_MESSAGE("percentile " << percentile << ": " << clipped << " clipped tensor steps, worst scale error "
                                     << worst);
  }
  optimizer_options bad;
  bad.percentile_clipping = 101;
  BOOST_CHECK_THROW((optimizer<sgd>(l, h, bad)), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(min_8bit_size_counts_the_whole_tensor) {
  // A 4096-element tensor is quantized on every d (each rank holds 512 of it at d = 8),
  // a 4095-element one never: precision does not change with the number of ranks.
  layout l;
  l.add("big", {4096}, dtype::f32);
  l.add("small", {4095}, dtype::f32);
  for (int d : {1, 8}) {
    std::vector<std::size_t> codes(static_cast<std::size_t>(d));
    run_ranks(d, [&](threads& comm) {
      const int r = comm.rank();
      optimizer<adamw, sharded<q8>, threads> opt(l, adamw::hyper_params{}, {}, cpu(1), std::move(comm));
      if (!opt.state_is_quantized("big") || opt.state_is_quantized("small"))
        throw std::runtime_error("wrong quantization choice at d = " + std::to_string(d));
      codes[static_cast<std::size_t>(r)] = opt.local_state_codes("big", 0).values.size();
    });
    BOOST_TEST(std::accumulate(codes.begin(), codes.end(), std::size_t{0}) == 4096u);
    BOOST_TEST(std::count(codes.begin(), codes.end(), std::size_t{0}) == (d == 1 ? 0 : 4), "d = " << d);
  }
}

BOOST_AUTO_TEST_CASE(memory_bf16_master_q8_adam_is_4_plus_6_03_over_d) {
  // bf16 params and grads (2 + 2), fp32 master (4/d), two 8-bit moments (2/d) and their
  // absmax (2 * 4 / 256 per param, /d): 4 + 6.03125/d, against Megatron's 4 + 16/d.
  layout l;
  for (int i = 0; i < 8; ++i) l.add(std::string("w").append(std::to_string(i)), {512, 512}, dtype::bf16);
  for (int d = 1; d <= 8; ++d) {
    std::vector<double> per(static_cast<std::size_t>(d));
    run_ranks(d, [&](threads& comm) {
      const int r = comm.rank();
      optimizer<adamw, sharded<q8>, threads, cpu, precision<bf16>> opt(l, adamw::hyper_params{}, {}, cpu(1), std::move(comm));
      const memory_report m = opt.memory();
      per[static_cast<std::size_t>(r)] = m.total_bytes_per_param() - m.bytes_per_param("padding");
    });
    for (double b : per) BOOST_TEST(b == 4.0 + 6.03125 / d, boost::test_tools::tolerance(1e-3));
  }
  // fp32 params and grads: 8 + 2.03125/d; bf16 params with stochastic rounding (no
  // master): 4 + 2.03125/d.
  for (int d : {1, 3, 8}) {
    std::vector<double> f32(static_cast<std::size_t>(d)), sr(static_cast<std::size_t>(d));
    layout l32;
    for (int i = 0; i < 8; ++i) l32.add(std::string("w").append(std::to_string(i)), {512, 512}, dtype::f32);
    run_ranks(d, [&](threads& comm) {
      const std::size_t r = static_cast<std::size_t>(comm.rank());
      threads other = comm.split(0, comm.rank());
      optimizer<adamw, sharded<q8>, threads> a(l32, adamw::hyper_params{}, {}, cpu(1), std::move(comm));
      f32[r] = a.memory().total_bytes_per_param() - a.memory().bytes_per_param("padding");
      optimizer_options o;
      o.master_weights = false;
      optimizer<adamw, sharded<q8>, threads, cpu, precision<bf16>> b(l, adamw::hyper_params{}, o, cpu(1), std::move(other));
      sr[r] = b.memory().total_bytes_per_param() - b.memory().bytes_per_param("padding");
    });
    for (double b : f32) BOOST_TEST(b == 8.0 + 2.03125 / d, boost::test_tools::tolerance(1e-3));
    for (double b : sr) BOOST_TEST(b == 4.0 + 2.03125 / d, boost::test_tools::tolerance(1e-3));
  }
}

BOOST_AUTO_TEST_CASE(refusals) {
  layout small_blocks(128);
  small_blocks.add("w", {1000}, dtype::f32);
  BOOST_CHECK_EXCEPTION((optimizer<adamw, replicated<q8>>(small_blocks, adamw::hyper_params{})), std::invalid_argument,
                        [](const std::invalid_argument& e) {
                          return std::string(e.what()).find("multiple of 256") != std::string::npos;
                        });
}
