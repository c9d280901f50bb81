// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A probe for issue 19's q8 target, not part of the build and not used by the library:
// an AVX-512 VBMI decode (the 256-entry map as four byte planes, two vpermi2b and a blend
// per byte plane per 64 codes) and an AVX-512 gather encode (q8_codebook::q8_nearest's own
// slice table through vpgatherdd), each against the portable loop of q8_loop.hpp: bits
// (the encode over all 2^32 float patterns, both maps) and ns per element, out of cache
// (no arguments: 16 Mi elements) or in L1 (`4096 2000`: 4,096 elements 2,000 times).
//   g++ -std=c++20 -O2 -march=native -Iinclude bench/q8_avx512_probe.cpp -o /tmp/q8probe
//   /tmp/q8probe; /tmp/q8probe 4096 2000
// Results: bench/RESULTS.md, "8-bit states (q8)", "A probe of AVX-512 paths".
#include <distopt/detail/q8_map.hpp>
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace distopt::detail;
using clk = std::chrono::steady_clock;

__attribute__((noinline)) void decode_scalar(const float* map, const std::uint8_t* code, float amax, std::size_t n, float* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = map[code[i]] * amax;
}
__attribute__((noinline)) void encode_scalar(const std::int32_t* lut, const float* x, float inv, std::size_t n, std::uint8_t* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = q8_codebook::q8_nearest(lut, x[i] * inv);
}

struct planes { alignas(64) std::uint8_t b[4][256]; };  // byte k of each code's float
planes make_planes(const float* map) {
  planes P;
  for (int c = 0; c < 256; ++c) { std::uint32_t u; std::memcpy(&u, &map[c], 4); for (int k = 0; k < 4; ++k) P.b[k][c] = (u >> (8 * k)) & 0xff; }
  return P;
}
__attribute__((noinline, target("avx512f,avx512bw,avx512vbmi"))) void decode_vbmi(const planes& P, const std::uint8_t* code, float amax, std::size_t n, float* out) {
  alignas(64) std::uint8_t idx[64];
  for (int p = 0; p < 64; ++p) { int L = p / 16, q = (p % 16) / 4, j = p % 4; idx[p] = 16 * q + 4 * L + j; }
  const __m512i order = _mm512_load_si512(idx);
  const __m512 a = _mm512_set1_ps(amax);
  __m512i pl[4][4];
  for (int k = 0; k < 4; ++k) for (int q = 0; q < 4; ++q) pl[k][q] = _mm512_load_si512(P.b[k] + 64 * q);
  for (std::size_t i = 0; i < n; i += 64) {
    __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(code + i));
    const __mmask64 hi = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i lo = _mm512_permutex2var_epi8(pl[k][0], c, pl[k][1]);
      const __m512i up = _mm512_permutex2var_epi8(pl[k][2], c, pl[k][3]);
      b[k] = _mm512_mask_blend_epi8(hi, lo, up);
    }
    const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i r0 = _mm512_unpacklo_epi16(w01l, w23l), r1 = _mm512_unpackhi_epi16(w01l, w23l);
    const __m512i r2 = _mm512_unpacklo_epi16(w01h, w23h), r3 = _mm512_unpackhi_epi16(w01h, w23h);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(r0), a));
    _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(r1), a));
    _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(r2), a));
    _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(r3), a));
  }
}
__attribute__((noinline, target("avx512f,avx512bw"))) void encode_gather(const std::int32_t* lut, const float* x, float inv, std::size_t n, std::uint8_t* out) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff), first = _mm512_set1_epi32(q8_codebook::first_slice),
                last = _mm512_set1_epi32(q8_codebook::slices - 1), nsl = _mm512_set1_epi32(q8_codebook::slices),
                lo16 = _mm512_set1_epi32(0xffff), ff = _mm512_set1_epi32(0xff), zero = _mm512_setzero_si512();
  for (std::size_t i = 0; i < n; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
    const __m512i mag = _mm512_and_si512(u, absmask);
    const __m512i s = _mm512_srli_epi32(mag, 23 - q8_codebook::mant_bits);
    __m512i j = _mm512_max_epi32(_mm512_sub_epi32(s, first), zero);  // s > first ? s - first : 0 (s < 2^24)
    j = _mm512_min_epu32(j, last);
    const __mmask16 neg = _mm512_movepi32_mask(u);
    j = _mm512_mask_add_epi32(j, neg, j, nsl);
    const __m512i e = _mm512_i32gather_epi32(j, lut, 4);
    const __mmask16 past = _mm512_cmpge_epi32_mask(_mm512_and_si512(mag, lo16), _mm512_srai_epi32(e, 8));
    __m512i c = _mm512_and_si512(e, ff);
    c = _mm512_mask_add_epi32(c, past & ~neg, c, _mm512_set1_epi32(1));
    c = _mm512_mask_sub_epi32(c, past & neg, c, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(c));
  }
}

int g_reps = 1;
template <class F> double best(F f) { double b = 1e9; for (int r = 0; r < 7; ++r) { auto t = clk::now(); for (int k = 0; k < g_reps; ++k) f(); b = std::min(b, std::chrono::duration<double>(clk::now() - t).count() / g_reps); } return b; }

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::stoull(argv[1]) : std::size_t{1} << 24;  // default 16 M: out of cache
  const int reps = argc > 2 ? std::stoi(argv[2]) : 1;
  const bool exhaustive = argc <= 1;
  g_reps = reps;
  std::vector<std::uint8_t> code(n), c1(n), c2(n);
  std::vector<float> x(n), o1(n), o2(n);
  std::mt19937 rng(1);
  for (auto& c : code) c = rng() & 0xff;
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& v : x) v = nd(rng);
  for (const q8_codebook* book : {&signed_codebook(), &unsigned_codebook()}) {
    const float* map = book->values().data();
    const planes P = make_planes(map);
    decode_scalar(map, code.data(), 0.37f, n, o1.data());
    decode_vbmi(P, code.data(), 0.37f, n, o2.data());
    std::printf("decode equal: %d\n", std::memcmp(o1.data(), o2.data(), n * 4) == 0);
    const double ds = best([&] { decode_scalar(map, code.data(), 0.37f, n, o1.data()); });
    const double dv = best([&] { decode_vbmi(P, code.data(), 0.37f, n, o2.data()); });
    std::printf("decode ns/elem: scalar %.3f vbmi %.3f (%.1f GB/s at 5 B/elem)\n", ds / n * 1e9, dv / n * 1e9, 5.0 * n / dv * 1e-9);
    encode_scalar(book->lookup(), x.data(), 1.7f, n, c1.data());
    encode_gather(book->lookup(), x.data(), 1.7f, n, c2.data());
    std::printf("encode equal: %d\n", std::memcmp(c1.data(), c2.data(), n) == 0);
    const double es = best([&] { encode_scalar(book->lookup(), x.data(), 1.7f, n, c1.data()); });
    const double eg = best([&] { encode_gather(book->lookup(), x.data(), 1.7f, n, c2.data()); });
    std::printf("encode ns/elem: scalar %.3f gather %.3f (%.1f GB/s at 5 B/elem)\n", es / n * 1e9, eg / n * 1e9, 5.0 * n / eg * 1e-9);
    if (!exhaustive) continue;
    // Every float pattern, inv = 1 (in chunks).
    std::size_t bad = 0;
    std::vector<float> all(1 << 20);
    std::vector<std::uint8_t> a1(1 << 20), a2(1 << 20);
    for (std::uint64_t base = 0; base < (std::uint64_t{1} << 32); base += all.size()) {
      for (std::size_t k = 0; k < all.size(); ++k) { const std::uint32_t u = static_cast<std::uint32_t>(base + k); std::memcpy(&all[k], &u, 4); }
      encode_scalar(book->lookup(), all.data(), 1.0f, all.size(), a1.data());
      encode_gather(book->lookup(), all.data(), 1.0f, all.size(), a2.data());
      for (std::size_t k = 0; k < all.size(); ++k) bad += a1[k] != a2[k];
    }
    std::printf("encode over all 2^32 floats: %zu differ\n", bad);
  }
}
