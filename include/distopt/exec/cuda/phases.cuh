// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The step's phases that get CUDA kernels of their own (distopt::cuda::launch picks
/// them by the phase's type); every other phase runs through the generic phase kernel.
///
/// The element update (detail::update_phase): the generic kernel gives a thread one element
/// at a time, one element's load per array. Here a thread takes 8 consecutive elements of
/// every array with 16-byte loads, where the piece's arrays are all 16-byte aligned together
/// (a scalar head and tail around that; vector_head, as update_plan cuts its chunks), and
/// runs the same per-element body, detail::update_one, on them in registers.
///
/// The 8-bit update (detail::q8_update_phase): the generic kernel gives a thread a whole
/// quantization block of 256 elements. Here a warp takes a block: lane l the elements l,
/// l + 32, ..., l + 224, all loaded before any is used, decoded through the slots' maps in
/// shared memory, updated by detail::update_one in registers, the block's
/// new absmax a warp max over the magnitudes' bit patterns (detail::block_absmax's order-free
/// max), the codes through the slot's lookup table (q8_codebook::q8_nearest, shared memory
/// too): the CPU's
/// update_range_q8, element for element.
///
/// The exact norm (detail::squares_phase, detail::norm_wire_phase): the generic phase
/// kernel runs a reduction item on one thread: one GPU thread then sums tens of thousands
/// of elements, and one more adds every item's exact sum. Here a thread block takes an item,
/// and a half-warp (16 lanes) sums each layout block in the CPU's order: lane j adds the
/// squares of elements j, j + 16, ... in element order, then lanes j and j + w are added
/// for w = 8, 4, 2, 1 (detail::sum_of_squares and combine_lanes, whose order a shuffle
/// reproduces). Each block sum goes into the block's exact accumulator in shared memory
/// with integer atomics (exact_sum::place), so the item's sum has the CPU's bits however
/// the half-warps interleave.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../detail/exact_sum.hpp"
#include "../../engine/q8.hpp"
#include "../../engine/decisions.hpp"
#include "../../engine/phases.hpp"
#include "error.cuh"
#include "update.cuh"

namespace distopt::cuda_exec {
inline namespace abi_v0_1 {

using detail::exact_sum;
/// An exact sum's parts: the limbs, the NaN count, the Inf count.
inline constexpr int sum_parts = exact_sum::limbs + 2;

/// Adds `v` (a block's sum of squares) to the shared accumulator `acc[sum_parts]`.
__device__ inline void add_exact(unsigned long long* acc, double v) {
  std::uint64_t lo = 0, mid = 0, hi = 0;
  const int k = exact_sum::place(v, lo, mid, hi);
  if (k >= 0) {
    atomicAdd(acc + k, static_cast<unsigned long long>(lo));
    atomicAdd(acc + k + 1, static_cast<unsigned long long>(mid));
    if (hi) atomicAdd(acc + k + 2, static_cast<unsigned long long>(hi));
  } else if (k == -2) {
    atomicAdd(acc + exact_sum::limbs, 1ull);
  } else if (k == -3) {
    atomicAdd(acc + exact_sum::limbs + 1, 1ull);
  }
}

/// The squares of the `m` elements of g times `factor`, summed as detail::sum_of_squares
/// sums them, by the 16 lanes of a half-warp (`mask`: its lanes); lane 0 returns the sum.
/// A block of exactly per_lane * 16 elements has its loads issued before the sums, so a
/// lane has per_lane loads in flight; any other length takes the strided loop.
template <int per_lane, class G>
__device__ inline double block_squares(const G* g, std::size_t m, double factor, unsigned lane, unsigned mask) {
  double s = 0.0;
  if (m == per_lane * 16u) {
    float x[per_lane];
#pragma unroll
    for (int i = 0; i < per_lane; ++i) x[i] = to_float(g[lane + 16u * i]);
#pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      const double v = static_cast<double>(x[i]) * factor;
      s += v * v;
    }
  } else {
    for (std::size_t i = lane; i < m; i += 16) {
      const double v = static_cast<double>(to_float(g[i])) * factor;
      s += v * v;
    }
  }
  for (int w = 8; w > 0; w /= 2) s += __shfl_down_sync(mask, s, w, 16);
  return s;
}

/// detail::squares_phase: a thread block per item (grid-stride), the item's layout blocks
/// dealt to its 16 half-warps in turn across pieces; the item's exact sum is added to
/// out[item], as the phase's body adds it on a host.
template <class G>
DISTOPT_KERNEL void __launch_bounds__(256) squares_kernel(const detail::squares_phase<G> p, std::size_t items) {
  __shared__ unsigned long long acc[sum_parts];
  const unsigned lane = threadIdx.x % 16u, half = threadIdx.x / 16u, halves = blockDim.x / 16u;
  const unsigned mask = 0xffffu << (16u * (half % 2u));
  const double factor = p.divide_by ? 1.0 / *p.divide_by : p.scale;
  for (std::size_t w = blockIdx.x; w < items; w += gridDim.x) {
    for (unsigned i = threadIdx.x; i < sum_parts; i += blockDim.x) acc[i] = 0;
    __syncthreads();
    const std::size_t end = (w + 1) * p.per < p.piece_count ? (w + 1) * p.per : p.piece_count;
    std::size_t before = 0;  // blocks of the item in the pieces before this one
    for (std::size_t c = w * p.per; c < end; ++c) {
      if (p.skip && p.skip[c]) continue;
      const detail::shard_piece& pc = p.pieces[c];
      const G* g = p.grads + (p.grads_local ? pc.local : pc.buffer);
      const std::size_t blocks = (pc.count + p.block - 1) / p.block;
      for (std::size_t b = (half + halves - before % halves) % halves; b < blocks; b += halves) {
        const std::size_t first = b * p.block, left = pc.count - first;
        const std::size_t m = left < p.block ? left : p.block;
        const double s = p.block == 256 ? block_squares<16>(g + first, m, factor, lane, mask)
                                        : block_squares<1>(g + first, m, factor, lane, mask);
        if (lane == 0) add_exact(acc, s);
      }
      before += blocks;
    }
    __syncthreads();
    if (threadIdx.x == 0)
      p.out[w].add(exact_sum::from_parts(acc, acc[exact_sum::limbs], acc[exact_sum::limbs + 1]));
    __syncthreads();
  }
}

/// detail::norm_wire_phase: one thread block of 1,024; thread t adds part t % sum_parts of
/// the items i with i % groups == t / sum_parts (each part below 2^32: exact_sum::add
/// leaves the items normalised), the groups are added in shared memory, and thread 0
/// writes the wire image. A template, as every kernel here: a kernel that is not would be
/// defined in each translation unit that includes this header, and two such units would
/// not link.
template <int = 0>
DISTOPT_KERNEL void __launch_bounds__(1024) norm_wire_kernel(const detail::norm_wire_phase p) {
  __shared__ unsigned long long acc[sum_parts];
  constexpr unsigned groups = 1024u / sum_parts;
  for (unsigned i = threadIdx.x; i < sum_parts; i += blockDim.x) acc[i] = 0;
  __syncthreads();
  const unsigned part = threadIdx.x % sum_parts, group = threadIdx.x / sum_parts;
  if (group < groups) {
    unsigned long long s = 0;
    for (std::size_t i = group; i < p.items; i += groups) s += p.sums[i].part(static_cast<int>(part));
    if (s) atomicAdd(acc + part, s);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    exact_sum total = exact_sum::from_parts(acc, acc[exact_sum::limbs], acc[exact_sum::limbs + 1]);
    total.to_wire(p.wire);
  }
}

/// detail::update_phase: a thread block per item (a piece), grid-stride; 8 elements a
/// thread in 16-byte words where every array the update touches is aligned, one element a
/// thread in the piece's head and tail.
template <class Policy, int N, distopt::detail::param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_KERNEL void __launch_bounds__(256)
    update_phase_kernel(const distopt::detail::update_phase<Policy, N, Mode, Param, Grad, Enc> p, std::size_t items) {
  using distopt::detail::param_mode;
  using distopt::detail::update_one;
  constexpr std::size_t V = vector_width;
  constexpr bool uses_master = Mode == param_mode::master;
  for (std::size_t c = blockIdx.x; c < items; c += gridDim.x) {
    const std::size_t n = p.size(c);
    if (n == 0) continue;
    const distopt::detail::update_args<Param, Grad, Enc> a = p.args(c, 0);
    const typename Policy::scalars s = p.scalars[p.pieces[c].group];
    // The vector body is [head, end); a piece whose arrays are never aligned together is all head.
    const std::size_t head = vector_head(a.param, a.grad, uses_master ? a.master : nullptr, a.state, N, n);
    const std::size_t end = head + (n - head) / V * V;
    for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) {
      const std::size_t e = i < head ? i : end + (i - head);  // the head, then the tail
      if (e >= n) break;
      update_one<Policy, N, Mode>(s, a.param, a.grad, a.master, a.state[0], a.state[1], a.state[2], a.state[3], e,
                                  a.grad_scale, a.random_key, a.random_base);
    }
    for (std::size_t i0 = head + static_cast<std::size_t>(threadIdx.x) * V; i0 < end;
         i0 += static_cast<std::size_t>(blockDim.x) * V)
      vector_step<Policy, N, Mode>(s, a.param, a.grad, a.master, a.state, i0, a.grad_scale, a.random_key,
                                   a.random_base);
  }
}

/// Dynamic shared memory of q8_update_phase_kernel with N quantized slots: each slot's map
/// (256 floats) and lookup table (2 * q8_codebook::slices int32).
template <int N>
inline constexpr std::size_t q8_shared_bytes =
    static_cast<std::size_t>(N) * (256 * sizeof(float) + 2 * detail::q8_codebook::slices * sizeof(std::int32_t));

/// detail::q8_update_phase: a thread block per item (a piece), grid-stride; a warp per
/// quantization block of an 8-bit piece; a thread per element of a piece with fp32 states
/// (a tensor below min_8bit_size).
template <class Policy, int N, distopt::detail::param_mode Mode, class Param, class Grad>
DISTOPT_KERNEL void __launch_bounds__(256)
    q8_update_phase_kernel(const distopt::detail::q8_update_phase<Policy, N, Mode, Param, Grad> p, std::size_t items) {
  using distopt::detail::param_mode;
  using distopt::detail::q8_codebook;
  using distopt::detail::shard_piece;
  using distopt::detail::update_one;
  constexpr std::size_t B = distopt::q8::block, per_lane = B / 32;
  static_assert(B % 32 == 0, "a warp per quantization block");
  constexpr bool uses_master = Mode == param_mode::master;
  constexpr int S = N > 0 ? N : 1;
  const unsigned lane = threadIdx.x % 32u, warp = threadIdx.x / 32u, warps = blockDim.x / 32u;
  // Each slot's map and lookup table copied into shared memory once per thread block
  // (q8_shared_bytes<N>: 25,616 B a slot): a warp's 32 lookups at scattered codes and
  // slices then cost a few bank conflicts instead of a cache line each.
  extern __shared__ __align__(16) unsigned char q8_tables_shared[];
  constexpr std::size_t lut_size = 2 * q8_codebook::slices;
  float* const map = reinterpret_cast<float*>(q8_tables_shared);
  std::int32_t* const lut = reinterpret_cast<std::int32_t*>(map + S * 256);
  if constexpr (N > 0) {
    for (std::size_t i = threadIdx.x; i < N * 256; i += blockDim.x) map[i] = p.map[i / 256][i % 256];
    for (std::size_t i = threadIdx.x; i < N * lut_size; i += blockDim.x) lut[i] = p.lut[i / lut_size][i % lut_size];
    __syncthreads();
  }
  for (std::size_t c = blockIdx.x; c < items; c += gridDim.x) {
    const std::size_t blocks = p.size(c);
    if (blocks == 0) continue;
    const shard_piece& pc = p.pieces[c];
    const distopt::detail::q8_piece q = p.where[c];
    const float scale = p.tensor_scale ? p.step_scale() * p.tensor_scale[pc.tensor] : p.step_scale();
    const std::uint64_t key = p.step_key();
    const typename Policy::scalars s = p.scalars[pc.group];
    Param* const params = p.params + (p.params_local ? pc.local : pc.buffer);
    const Grad* const grads = p.grads + (p.grads_local ? pc.local : pc.buffer);
    float* const master = uses_master ? p.master + pc.local : nullptr;
    if (!q.quantized) {  // fp32 states, element by element as update_range
      for (std::size_t i = threadIdx.x; i < pc.count; i += blockDim.x) {
        float* st[4] = {};
        for (int k = 0; k < N; ++k) st[k] = p.small[k] + q.offset + i;
        update_one<Policy, N, Mode>(s, params + i, grads + i, uses_master ? master + i : nullptr, st[0], st[1], st[2],
                                    st[3], 0, scale, key, pc.layout + i);
      }
      continue;
    }
    for (std::size_t blk = warp; blk < blocks; blk += warps) {
      const std::size_t b0 = blk * B;
      // Every load of the lane's elements first (params only without master weights: with
      // them the params are only written), so that a lane has them all in flight; then the
      // decode and detail::update_one on them in registers.
      const bool full = pc.count - b0 >= B;
      Param rp[per_lane];
      Grad rg[per_lane];
      float rm[uses_master ? per_lane : 1];
      std::uint8_t rc[S][per_lane];
      float fresh[S][per_lane] = {};
      float old_absmax[S];
DISTOPT_CUDA_UNROLL
      for (int k = 0; k < N; ++k) old_absmax[k] = p.absmax[k][q.offset / B + blk];
DISTOPT_CUDA_UNROLL
      for (std::size_t j = 0; j < per_lane; ++j) {
        const std::size_t i = b0 + lane + 32 * j;
        if (!full && i >= pc.count) continue;
        if constexpr (!uses_master) rp[j] = params[i];
        rg[j] = grads[i];
        if constexpr (uses_master) rm[j] = master[i];
DISTOPT_CUDA_UNROLL
        for (int k = 0; k < N; ++k) rc[k][j] = p.code[k][q.offset + i];
      }
DISTOPT_CUDA_UNROLL
      for (std::size_t j = 0; j < per_lane; ++j) {
        const std::size_t i = b0 + lane + 32 * j;
        if (!full && i >= pc.count) continue;
DISTOPT_CUDA_UNROLL
        for (int k = 0; k < N; ++k) fresh[k][j] = map[k * 256 + rc[k][j]] * old_absmax[k];
        float* f[4] = {&fresh[0][j], &fresh[N > 1 ? 1 : 0][j], &fresh[N > 2 ? 2 : 0][j], &fresh[N > 3 ? 3 : 0][j]};
        update_one<Policy, N, Mode>(s, &rp[j], &rg[j], uses_master ? &rm[j] : nullptr, f[0], f[1], f[2], f[3], 0, scale,
                                    key, pc.layout + i);
        params[i] = rp[j];
        if constexpr (uses_master) master[i] = rm[j];
      }
DISTOPT_CUDA_UNROLL
      for (int k = 0; k < N; ++k) {
        std::uint32_t mag = 0;
DISTOPT_CUDA_UNROLL
        for (std::size_t j = 0; j < per_lane; ++j) {
          const std::uint32_t m = __float_as_uint(fresh[k][j]) & 0x7fffffffu;
          if (b0 + lane + 32 * j < pc.count && m > mag) mag = m;
        }
        const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, mag));
        const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
DISTOPT_CUDA_UNROLL
        for (std::size_t j = 0; j < per_lane; ++j) {
          const std::size_t i = b0 + lane + 32 * j;
          if (i < pc.count) p.code[k][q.offset + i] = q8_codebook::q8_nearest(lut + k * lut_size, fresh[k][j] * inv);
        }
        if (lane == 0) p.absmax[k][q.offset / B + blk] = amax;
      }
    }
  }
}

}  // namespace abi_v0_1
}  // namespace distopt::cuda_exec
