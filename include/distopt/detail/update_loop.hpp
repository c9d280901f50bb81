// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The fused per-element loop every host backend runs: load grad, param (or master)
/// and state slots, call the policy's update, store. One contiguous pass, no temporaries.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../types/rounding.hpp"
#include "exact_sum.hpp"
#include "fp16_arrays.hpp"

namespace distopt::detail {

/// How the fp32 value being updated relates to the stored params.
enum class param_mode {
  fp32,          ///< params are fp32 and updated in place
  master,        ///< an fp32 master copy is updated; params get it rounded to nearest even
  no_master_rne, ///< low-precision params updated in place, rounded to nearest even
  no_master_sr,  ///< bf16 params updated in place with stochastic rounding
};

/// Pointers to the first element of one run of elements (a piece of one tensor): the
/// params and grads in the full buffers, the master weights and states in this rank's
/// shard buffers. Slots beyond N are unused.
template <class Param, class Grad, class Enc>
struct update_args {
  Param* param;
  const Grad* grad;
  float* master;
  Enc* state[4];
  float grad_scale;          ///< multiplies every gradient (loss unscaling, clipping)
  std::uint64_t random_key;  ///< seed and step, for stochastic rounding
  std::size_t random_base;   ///< layout index of the first element: keys its random bits
};

template <int K, class Enc>
DISTOPT_HD DISTOPT_INLINE Enc* slot(Enc* DISTOPT_RESTRICT s0, Enc* DISTOPT_RESTRICT s1,
                                    Enc* DISTOPT_RESTRICT s2, Enc* DISTOPT_RESTRICT s3) {
  if constexpr (K == 0) return s0;
  else if constexpr (K == 1) return s1;
  else if constexpr (K == 2) return s2;
  else return s3;
}

/// Writes element i's updated fp32 `value` back: to the master and, rounded to nearest
/// even, the param (master); stochastically rounded to the param (no_master_sr: random bits
/// keyed by layout index `base + i`); or rounded to the param.
template <param_mode Mode, class Param>
DISTOPT_HD DISTOPT_INLINE void store_param(Param* DISTOPT_RESTRICT p, float* DISTOPT_RESTRICT m, std::size_t i,
                                           float value, std::uint64_t key, std::size_t base) {
  if constexpr (Mode == param_mode::master) {
    m[i] = value;
    p[i] = from_float<Param>(value);
  } else if constexpr (Mode == param_mode::no_master_sr) {
    p[i] = stochastic_round_bf16(value, mix32(key, base + i));
  } else {
    p[i] = from_float<Param>(value);
  }
}

/// Updates element i: loads its fp32 value (master or param), its N state slots and its
/// grad times `scale`, calls the policy's update and stores everything back. The one
/// per-element body every backend runs: the CPU loop below and the CUDA kernels
/// (exec/cuda/update.cuh) call it, on memory or on a thread's registers.
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_HD DISTOPT_INLINE void update_one(const typename Policy::scalars& s, Param* DISTOPT_RESTRICT p,
                                          const Grad* DISTOPT_RESTRICT g, float* DISTOPT_RESTRICT m,
                                          Enc* DISTOPT_RESTRICT s0, Enc* DISTOPT_RESTRICT s1, Enc* DISTOPT_RESTRICT s2,
                                          Enc* DISTOPT_RESTRICT s3, std::size_t i, float scale, std::uint64_t key,
                                          std::size_t base) {
  float value;
  if constexpr (Mode == param_mode::master) value = m[i];
  else value = to_float(p[i]);
  // Sized for every slot the policy may touch; slots past N stay zero and are not stored.
  float st[Policy::max_state_slots > 0 ? Policy::max_state_slots : 1] = {};
  [&]<int... K>(std::integer_sequence<int, K...>) {
    ((st[K] = to_float(slot<K>(s0, s1, s2, s3)[i])), ...);
  }(std::make_integer_sequence<int, N>{});
  Policy::update(s, value, to_float(g[i]) * scale, st);
  [&]<int... K>(std::integer_sequence<int, K...>) {
    ((slot<K>(s0, s1, s2, s3)[i] = from_float<Enc>(st[K])), ...);
  }(std::make_integer_sequence<int, N>{});
  store_param<Mode>(p, m, i, value, key, base);
}

/// Elements per chunk of the host loops that stage binary16 through float (fp16_arrays.hpp).
inline constexpr std::size_t fp16_chunk = 1024;

/// Whether update_range stages its binary16 params or grads through float on the host: the
/// F16C conversions of a chunk and the float loop take a fifth of the per-element
/// conversions' time. Stochastic rounding writes bf16, never fp16.
template <class Param, param_mode Mode>
inline constexpr bool stages_fp16_param = std::is_same_v<Param, fp16> && Mode != param_mode::no_master_sr;
template <class Param, class Grad, param_mode Mode>
inline constexpr bool stages_fp16 = stages_fp16_param<Param, Mode> || std::is_same_v<Grad, fp16>;

template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_HD DISTOPT_CPU_CLONES void update_range(const typename Policy::scalars& sc, const update_args<Param, Grad, Enc>& a,
                                                std::size_t n);

/// update_range over `a`, a chunk at a time: binary16 grads (and params, unless they are
/// only written from the master) are converted to float arrays first, the float loop runs
/// on them, and binary16 params are converted back. The conversions are exact or to
/// nearest even, the same as the per-element ones, so the bits are update_range's.
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
void update_range_staged(const typename Policy::scalars& sc, const update_args<Param, Grad, Enc>& a, std::size_t n) {
  constexpr bool param16 = stages_fp16_param<Param, Mode>;
  constexpr bool grad16 = std::is_same_v<Grad, fp16>;
  using P = std::conditional_t<param16, float, Param>;
  using G = std::conditional_t<grad16, float, Grad>;
  alignas(64) float pbuf[param16 ? fp16_chunk : 1];
  alignas(64) float gbuf[grad16 ? fp16_chunk : 1];
  for (std::size_t c = 0; c < n; c += fp16_chunk) {
    const std::size_t k = n - c < fp16_chunk ? n - c : fp16_chunk;
    update_args<P, G, Enc> b{};
    if constexpr (param16) {
      if constexpr (Mode != param_mode::master) fp16_to_float(a.param + c, pbuf, k);
      b.param = pbuf;
    } else {
      b.param = a.param + c;
    }
    if constexpr (grad16) {
      fp16_to_float(a.grad + c, gbuf, k);
      b.grad = gbuf;
    } else {
      b.grad = a.grad + c;
    }
    b.master = Mode == param_mode::master ? a.master + c : nullptr;
    for (int j = 0; j < N; ++j) b.state[j] = a.state[j] + c;
    b.grad_scale = a.grad_scale;
    b.random_key = a.random_key;
    b.random_base = a.random_base + c;
    update_range<Policy, N, Mode>(sc, b, k);
    if constexpr (param16) float_to_fp16(pbuf, a.param + c, k);
  }
}

/// update_range's loop, for each of its versions (DISTOPT_CPU_CLONES, DISTOPT_CPU_DISPATCH).
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_HD DISTOPT_INLINE void update_range_body(const typename Policy::scalars& sc,
                                                 const update_args<Param, Grad, Enc>& a, std::size_t n) {
#if DISTOPT_HAS_F16C_PATH
  if constexpr (stages_fp16<Param, Grad, Mode>) {
    if (f16c_path()) return update_range_staged<Policy, N, Mode>(sc, a, n);
  }
#endif
  Param* DISTOPT_RESTRICT p = a.param;
  const Grad* DISTOPT_RESTRICT g = a.grad;
  float* DISTOPT_RESTRICT m = a.master;
  Enc* DISTOPT_RESTRICT s0 = a.state[0];
  Enc* DISTOPT_RESTRICT s1 = a.state[1];
  Enc* DISTOPT_RESTRICT s2 = a.state[2];
  Enc* DISTOPT_RESTRICT s3 = a.state[3];
  const float scale = a.grad_scale;
  const std::uint64_t key = a.random_key;
  const std::size_t base = a.random_base;
  const typename Policy::scalars s = sc;
  for (std::size_t i = 0; i < n; ++i) update_one<Policy, N, Mode>(s, p, g, m, s0, s1, s2, s3, i, scale, key, base);
}

/// Updates the `n` elements `a` points to, with N state slots.
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_HD DISTOPT_CPU_CLONES void update_range(const typename Policy::scalars& sc, const update_args<Param, Grad, Enc>& a,
                                                std::size_t n) {
  DISTOPT_CPU_DISPATCH(update_range_body<Policy, N, Mode>(sc, a, n));
}

/// Lanes of the fixed-order double sums (sum_of_squares, and the layer-wise segments'
/// sums in layer_loop.hpp): element i of a run goes to lane i % sum_lanes.
inline constexpr std::size_t sum_lanes = 16;

/// Combines sum_lanes lanes in place, lanes j and j + w for w = 8, 4, 2, 1; returns lane 0,
/// which keeps the sum.
DISTOPT_HD DISTOPT_INLINE double combine_lanes(double* s) {
  for (std::size_t w = sum_lanes / 2; w > 0; w /= 2)
    for (std::size_t j = 0; j < w; ++j) s[j] += s[j + w];
  return s[0];
}

/// Sum of squares of grad * scale over g[0, n), in double, in a fixed order that any
/// backend can reproduce: lane j (j < 16) sums the squares of elements j, j + 16, j + 32, ...
/// in element order, then lanes j and j + w are added for w = 8, 4, 2, 1 (lane j keeps the
/// sum). The order depends only on n, never on the machine path or the chunking, and 16
/// independent chains let the loop run at memory speed: one chain in element order is
/// bound by the latency of a double add (4 cycles per element). NaN or Inf if any element
/// is not finite.
template <class Grad>
DISTOPT_HD DISTOPT_INLINE double sum_of_squares(const Grad* DISTOPT_RESTRICT g, double scale, std::size_t n) {
  constexpr std::size_t L = sum_lanes;
  double s[L] = {};
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    DISTOPT_UNROLL(16)  // unrolled, the lanes stay in registers at -O2 too
    for (std::size_t j = 0; j < L; ++j) {
      const double x = static_cast<double>(to_float(g[i + j])) * scale;
      s[j] += x * x;
    }
  for (std::size_t j = 0; i + j < n; ++j) {
    const double x = static_cast<double>(to_float(g[i + j])) * scale;
    s[j] += x * x;
  }
  return combine_lanes(s);
}

/// Adds the squares of g[0, n) * scale to `acc`, one exact term per `block` elements (each
/// block summed by sum_of_squares), so the total does not depend on how the elements were
/// cut into runs, as long as runs start on block boundaries. One call per run, not per
/// block: a call through the clone dispatch costs as much as summing 100 elements.
template <class Grad>
DISTOPT_HD DISTOPT_INLINE void add_block_squares_body(exact_sum& acc, const Grad* g, double scale, std::size_t n,
                                                      std::size_t block) {
#if DISTOPT_HAS_F16C_PATH
  // binary16 blocks are converted to float first (the same values), as update_range_staged does.
  constexpr bool grad16 = std::is_same_v<Grad, fp16>;
  alignas(64) float buf[grad16 ? fp16_chunk : 1];
  const bool staged = grad16 && block <= fp16_chunk && f16c_path();
#endif
#if DISTOPT_HAS_F16C_PATH
  if constexpr (grad16) {
    if (staged) {
      for (std::size_t b = 0; b < n; b += block) {
        const std::size_t m = n - b < block ? n - b : block;
        fp16_to_float(g + b, buf, m);
        acc.add(sum_of_squares(buf, scale, m));
      }
      return;
    }
  }
#endif
  // The whole blocks as four runs read side by side, block k of each in turn: one core
  // reading one stream of grads that are not in cache, with the step's dirty lines to
  // write back, summed them at 0.51-0.52 ns per float, four streams at 0.42-0.43 (16 Mi
  // floats, bench/norm_streams_probe.cpp, bench/RESULTS.md, 2026-12-04). The exact sum does
  // not depend on the order of the blocks.
  const std::size_t runs = 4, per = n / block / runs;
  for (std::size_t k = 0; k < per; ++k)
    for (std::size_t r = 0; r < runs; ++r) acc.add(sum_of_squares(g + (r * per + k) * block, scale, block));
  for (std::size_t b = runs * per * block; b < n; b += block)
    acc.add(sum_of_squares(g + b, scale, n - b < block ? n - b : block));
}

/// add_block_squares_body, in a version for this CPU (DISTOPT_CPU_CLONES, DISTOPT_CPU_DISPATCH).
template <class Grad>
DISTOPT_HD DISTOPT_CPU_CLONES void add_block_squares(exact_sum& acc, const Grad* g, double scale, std::size_t n,
                                                     std::size_t block) {
  DISTOPT_CPU_DISPATCH(add_block_squares_body(acc, g, scale, n, block));
}

}  // namespace distopt::detail
