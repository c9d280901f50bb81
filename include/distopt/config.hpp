// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Compiler and platform macros; the only place distopt defines macros.

#if defined(__CUDACC__) || defined(__HIPCC__)
/// Marks a function callable from host and device code.
#define DISTOPT_HD __host__ __device__
/// A kernel with hidden visibility, so header kernels do not collide across shared libraries.
#define DISTOPT_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#define DISTOPT_HD
#define DISTOPT_KERNEL
#endif

/// Before a DISTOPT_HD function template that some instantiations call only on the host,
/// with a function that runs on the host only (a policy's host-only `prepare`): nvcc then
/// checks the call where the device calls it, not where it is instantiated (#20011-D).
#if defined(__CUDACC__)
#define DISTOPT_HD_CALLS_HOST _Pragma("nv_exec_check_disable")
#else
#define DISTOPT_HD_CALLS_HOST
#endif

/// Forces inlining of the small per-element functions the hot loops are made of.
#if defined(__GNUC__) || defined(__clang__)
#define DISTOPT_INLINE inline __attribute__((always_inline))
#define DISTOPT_RESTRICT __restrict__
#else
#define DISTOPT_INLINE inline
#define DISTOPT_RESTRICT
#endif

/// Asks GCC to unroll the next loop n times (GCC and Clang host code; nothing elsewhere).
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && !defined(__HIPCC__)
#define DISTOPT_UNROLL_PRAGMA(x) _Pragma(#x)
#define DISTOPT_UNROLL(n) DISTOPT_UNROLL_PRAGMA(GCC unroll n)
#else
#define DISTOPT_UNROLL(n)
#endif

/// True while compiling device code.
#if defined(__CUDA_ARCH__)
#define DISTOPT_DEVICE_CODE 1
#else
#define DISTOPT_DEVICE_CODE 0
#endif

/// Host loops that benefit from wider vectors are compiled three times, for the x86-64
/// baseline, for AVX2 and for x86-64-v4 (AVX-512), and the loader picks one per machine
/// (GCC function multi-versioning). AVX2 brings 256-bit vectors and a 32-to-16-bit pack for
/// bf16; AVX-512 brings masks, 512-bit vectors and a one-instruction 32-to-16-bit narrowing,
/// which put the bf16 paths at memory speed. x86-64-v4 also has FMA: each version is compiled
/// with -ffp-contract=off (the optimize attribute, whatever the user's flags), so that no
/// multiply-add is contracted and every version computes the same bits. Off for Clang and
/// device code, off under ThreadSanitizer (its instrumented ifunc resolver runs before the
/// TSan runtime starts and crashes), off where the compiler already targets AVX-512, and off
/// with -DDISTOPT_NO_TARGET_CLONES. DISTOPT_HAS_CPU_CLONES says which (1 or 0). Every
/// declaration of such a function carries the macro: GCC takes the optimize attribute from
/// the first one (a forward declaration without it let the AVX-512 clone contract, and
/// cpu_paths_agree failed).
///
/// The same attribute makes the hot loops' speed independent of the user's -O level (GCC
/// only: Clang vectorises at -O2 with its full cost model). GCC 12 at -O2 vectorises with
/// the "very cheap" cost model, which leaves the update loops scalar (AdamW 2.6 ns/param
/// against 0.46 at -O3, bench/flags/run.sh), and q8's block loops ran 1.35x their -O3 time
/// with the dynamic cost model alone; these functions are compiled as at -O3 with the
/// dynamic cost model and no errno from sqrt (a user without the CMake target's
/// -fno-math-errno), whatever the command line says. None of it changes a bit: no
/// reassociation, no contraction.
/// They are also flattened (every call inlined): a caller compiled at -O1 would otherwise
/// call the policy's update and the bf16 conversions per element, out of line (AdamW 5.5
/// ns/param at -O1 against 0.88 at -O2, 7-13 for bf16 and q8; with flatten every case at -O1
/// runs as at -O2, the same bits; bench/flags_step.cpp, 2026-12-03).
/// Not at -O0, under the sanitizers, nor with -DDISTOPT_NO_HOT_LOOP_OPTIONS, where the user's
/// level stands (for the debugger, and for builds that choose -O1 for its compile time: the
/// tests and distopt-replay; an -O3 loop costs about twice an -O1 one to compile).
#if defined(__OPTIMIZE__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && \
    !defined(DISTOPT_NO_HOT_LOOP_OPTIONS)
#define DISTOPT_HOT_LOOP_OPTIONS "O3", "fp-contract=off", "tree-loop-vectorize", "vect-cost-model=dynamic", "no-math-errno"
#define DISTOPT_HOT_LOOP_INLINE , flatten
#else
#define DISTOPT_HOT_LOOP_OPTIONS "fp-contract=off"
#define DISTOPT_HOT_LOOP_INLINE
#endif
/// The same options on a host loop that has a target of its own (q8's AVX-512 blocks); GCC only.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define DISTOPT_HOT_LOOP __attribute__((optimize(DISTOPT_HOT_LOOP_OPTIONS) DISTOPT_HOT_LOOP_INLINE))
#else
#define DISTOPT_HOT_LOOP
#endif
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && \
    defined(__linux__) && !defined(__AVX512F__) && !defined(__SANITIZE_THREAD__) &&       \
    !defined(DISTOPT_NO_TARGET_CLONES)
#if defined(__AVX2__)
#define DISTOPT_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "default"), optimize(DISTOPT_HOT_LOOP_OPTIONS) DISTOPT_HOT_LOOP_INLINE))
#else
#define DISTOPT_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), optimize(DISTOPT_HOT_LOOP_OPTIONS) DISTOPT_HOT_LOOP_INLINE))
#endif
#define DISTOPT_HAS_CPU_CLONES 1
#elif defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
// One version, still without contraction: a GCC build for AVX-512 (-march=native) has FMA.
#define DISTOPT_CPU_CLONES __attribute__((optimize(DISTOPT_HOT_LOOP_OPTIONS) DISTOPT_HOT_LOOP_INLINE))
#define DISTOPT_HAS_CPU_CLONES 0
#else
#define DISTOPT_CPU_CLONES
#define DISTOPT_HAS_CPU_CLONES 0
#endif

/// Clang has no target_clones on function templates, so there the same three versions are
/// made by hand: each DISTOPT_CPU_CLONES function's body is DISTOPT_CPU_DISPATCH(body call),
/// which calls it from a lambda compiled for x86-64-v4, one for AVX2 and the baseline,
/// chosen once per process by what the CPU has (cpu_dispatch below). The body is inlined
/// into each (always_inline), so each version is the whole loop for its instruction set.
/// The x86-64-v4 version is tuned as generic x86-64 (tune=x86-64), as GCC's clone is:
/// Clang's own tuning for x86-64-v4 prefers 256-bit vectors, and q8's block loop (update,
/// absmax) then ran 1.16x GCC's 512-bit one (bench/flags/run.sh, q8 AdamW bf16 + master,
/// bench/RESULTS.md, 2026-12-04).
/// Clang takes -ffp-contract from the command line only: distopt::distopt's usage
/// requirements give -ffp-contract=off, a build without them must add it. Off as the
/// clones are (device code, not x86-64 Linux, AVX-512 targeted already,
/// -DDISTOPT_NO_TARGET_CLONES). DISTOPT_HAS_CPU_DISPATCH says which (1 or 0). Elsewhere
/// DISTOPT_CPU_DISPATCH(call) is the call.
#if defined(__clang__) && !defined(__CUDACC__) && !defined(__HIPCC__) && defined(__x86_64__) && \
    defined(__linux__) && !defined(__AVX512F__) && !defined(DISTOPT_NO_TARGET_CLONES)
#define DISTOPT_HAS_CPU_DISPATCH 1
namespace distopt::detail {
/// The widest of the three versions this CPU runs: 2 (x86-64-v4: AVX-512 F, BW, CD, DQ, VL), 1 (AVX2), 0.
inline int host_cpu_level() noexcept {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
      return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
  }();
  return level;
}
/// Runs f compiled for the widest instruction set host_cpu_level() allows.
template <class F>
inline __attribute__((always_inline)) void cpu_dispatch(const F& f) {
  const int level = host_cpu_level();
  if (level == 2) [&]() __attribute__((target("arch=x86-64-v4,tune=x86-64"), noinline)) { f(); }();
  else if (level == 1) [&]() __attribute__((target("avx2"), noinline)) { f(); }();
  else f();
}
}  // namespace distopt::detail
#define DISTOPT_CPU_DISPATCH(...) ::distopt::detail::cpu_dispatch([&]() __attribute__((always_inline)) { __VA_ARGS__; })
#else
#define DISTOPT_HAS_CPU_DISPATCH 0
#define DISTOPT_CPU_DISPATCH(...) __VA_ARGS__
#endif

/// Arrays of binary16 are converted by the F16C instructions (vcvtph2ps, vcvtps2ph with
/// round-to-nearest-even: the portable conversions' bits) where the CPU has them, chosen at
/// run time (GCC and Clang on x86-64); never with
/// -DDISTOPT_NO_F16C. DISTOPT_HAS_F16C_PATH says whether this build has that path (1 or 0).
#if defined(__GNUC__) && !defined(__CUDACC__) && defined(__x86_64__) && !defined(DISTOPT_NO_F16C)
#define DISTOPT_HAS_F16C_PATH 1
#else
#define DISTOPT_HAS_F16C_PATH 0
#endif

/// Code that depends on no template argument (the layout, the shard plan, the CPU thread
/// pool, the constructor's argument checks, the hyper-parameter checks) is compiled once
/// per program when DISTOPT_COMPILED_CORE is defined, and once per translation unit
/// otherwise:
///   - by default it is defined inline in the headers, and distopt is header-only;
///   - with DISTOPT_COMPILED_CORE (the CMake target distopt::core defines it and links
///     src/core.cpp) the headers only declare it, and each user file compiles less.
/// Every translation unit of a program must make the same choice. DISTOPT_CORE_FN marks
/// those functions; DISTOPT_CORE_BODIES says whether this translation unit defines them
/// (src/core.cpp defines DISTOPT_BUILDING_CORE).
#if !defined(DISTOPT_COMPILED_CORE)
#define DISTOPT_CORE_FN inline
#define DISTOPT_CORE_BODIES 1
#elif defined(DISTOPT_BUILDING_CORE)
#define DISTOPT_CORE_FN
#define DISTOPT_CORE_BODIES 1
#else
#define DISTOPT_CORE_FN
#define DISTOPT_CORE_BODIES 0
#endif
