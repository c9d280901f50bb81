// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Arrays of binary16 converted to and from float: by the F16C instructions where the
/// CPU has them (eight per instruction), by the portable per-element conversions elsewhere.
/// Both give the same bits: vcvtps2ph with an immediate round-to-nearest-even is IEEE's
/// conversion, whatever the MXCSR says, and vcvtph2ps is exact and quietens NaNs as
/// fp16_bits_to_float_bits does. The host loops that read or write fp16 stage a chunk
/// through these (update_loop.hpp): the portable conversions are 20 to 30 integer
/// instructions per element, which no vector unit makes cheap.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../config.hpp"
#include "../types/fp16.hpp"

namespace distopt::detail {

/// out[i] = float(in[i]) for i < n, one element at a time (the portable path).
inline void fp16_to_float_portable(const fp16* in, float* out, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

/// out[i] = fp16(in[i]) for i < n, rounded to nearest even (the portable path).
inline void float_to_fp16_portable(const float* in, fp16* out, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = fp16(in[i]);
}

#if DISTOPT_HAS_F16C_PATH
namespace f16c {
using v8sf = float __attribute__((vector_size(32)));
using v8hi = short __attribute__((vector_size(16)));

/// fp16_to_float_portable's bits, eight elements per vcvtph2ps.
__attribute__((target("avx,f16c"))) inline void to_float(const fp16* in, float* out, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8hi h;
    std::memcpy(&h, in + i, sizeof h);
    const v8sf f = __builtin_ia32_vcvtph2ps256(h);
    std::memcpy(out + i, &f, sizeof f);
  }
  fp16_to_float_portable(in + i, out + i, n - i);
}

/// float_to_fp16_portable's bits, eight elements per vcvtps2ph (immediate 0: round to
/// nearest even, not the MXCSR's mode).
__attribute__((target("avx,f16c"))) inline void from_float(const float* in, fp16* out, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8sf f;
    std::memcpy(&f, in + i, sizeof f);
    const v8hi h = __builtin_ia32_vcvtps2ph256(f, 0);
    std::memcpy(out + i, &h, sizeof h);
  }
  float_to_fp16_portable(in + i, out + i, n - i);
}
}  // namespace f16c
#endif

/// Whether fp16_to_float and float_to_fp16 below take the F16C path on this CPU. Asked of
/// the CPU even where the compiler targets F16C: an inline function must do the same in
/// every translation unit, whatever its flags, or the linker's pick could run F16C code on a
/// CPU without it.
inline bool f16c_path() noexcept {
#if DISTOPT_HAS_F16C_PATH
  static const bool has = [] {
    __builtin_cpu_init();
#if defined(__clang__)
    // Clang's __builtin_cpu_supports has no "f16c": CPUID leaf 1, ECX bit 29.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    return __builtin_cpu_supports("avx") && ((ecx >> 29) & 1u) != 0;
#else
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#endif
  }();
  return has;
#else
  return false;
#endif
}

/// out[i] = float(in[i]) for i < n: F16C where the CPU has it, the same bits either way.
inline void fp16_to_float(const fp16* in, float* out, std::size_t n) noexcept {
#if DISTOPT_HAS_F16C_PATH
  if (f16c_path()) return f16c::to_float(in, out, n);
#endif
  fp16_to_float_portable(in, out, n);
}

/// out[i] = fp16(in[i]) for i < n, to nearest even: F16C where the CPU has it, the same
/// bits either way.
inline void float_to_fp16(const float* in, fp16* out, std::size_t n) noexcept {
#if DISTOPT_HAS_F16C_PATH
  if (f16c_path()) return f16c::from_float(in, out, n);
#endif
  float_to_fp16_portable(in, out, n);
}

}  // namespace distopt::detail
