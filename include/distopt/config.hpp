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

/// Host loops that benefit from wider vectors are compiled twice, for the x86-64 baseline
/// and for AVX2, and the loader picks one per machine (GCC function multi-versioning).
/// AVX2 brings 256-bit vectors and a cheap 32-to-16-bit pack for bf16, but no FMA, so
/// both versions compute the same bits. Off where the compiler already targets AVX2, off
/// for Clang and device code, off under ThreadSanitizer (its instrumented ifunc resolver
/// runs before the TSan runtime starts and crashes), and off with -DDISTOPT_NO_TARGET_CLONES.
/// DISTOPT_HAS_CPU_CLONES says which (1 or 0).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__) && \
    defined(__linux__) && !defined(__AVX2__) && !defined(__SANITIZE_THREAD__) &&          \
    !defined(DISTOPT_NO_TARGET_CLONES)
#define DISTOPT_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#define DISTOPT_HAS_CPU_CLONES 1
#else
#define DISTOPT_CPU_CLONES
#define DISTOPT_HAS_CPU_CLONES 0
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
