// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The element pass of a layer-wise phase (detail::layer_phase_body: Lamb, Adafactor,
/// CAME) as CUDA kernels: a thread block per work item for a phase that sums
/// (layer_phase_kernel), a thread block per piece for one that sums nothing
/// (layer_pass_kernel), grid-stride. The items' sums are then merged and converted on the
/// device by detail::layer_merge_phase (layer_merge_kernel: a grid row of blocks a tensor).
///
/// The host loop (detail::layer_range) walks an item in segments, the intersections of a
/// layout block with a matrix row, and sums each segment's tensor and row values in double
/// in sixteen lanes (value j into lane j % 16, in element order), combined pairwise; each
/// segment's double is added exactly to a fixed_sum. Here the item's layout blocks are dealt
/// to the block's half-warps in turn, a half-warp walks its layout block's segments, and
/// lane j of the half-warp takes elements j, j + 16, ... of a segment in element order
/// through the same element body (detail::layer_element), so each lane's double is the host
/// loop's lane; shuffles for w = 8, 4, 2, 1 combine them in combine_lanes' order. The
/// segment's sums go into the item's exact sums with integer atomics: tensor sums in shared
/// memory, row sums in the item's global fixed_sums.
///
/// Column sums need no order at all (the host sums them exactly too, through its column
/// windows): a column value whose magnitude lies in its column's window (the exponents the
/// last step left, detail::column_window) is added as an integer number of 2^(lo - 150)
/// units, below 2^45, to a 64-bit counter of the column (in shared memory where the item's
/// columns fit, else in the engine's global column buffer); any other nonzero value goes to
/// the column's fixed_sum with atomics. After the item the counters are added exactly to
/// the fixed_sums, and each window is re-centred 15 exponents below the column's mean. So
/// every sum has the host loop's bits, whatever order the warps run in.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../engine/layer_phases.hpp"
#include "error.cuh"

namespace distopt::cuda_exec {
inline namespace abi_v0_1 {

using detail::fixed_sum;

/// Adds a term placed by fixed_sum::place (limb k, three parts) to limbs `limb` with atomics.
__device__ inline void atomic_add_placed(unsigned long long* limb, int k, const std::int64_t (&part)[3]) {
#pragma unroll
  for (int i = 0; i < 3; ++i)
    if (part[i] != 0 && k + i < fixed_sum::limbs) atomicAdd(limb + k + i, static_cast<unsigned long long>(part[i]));
}

/// fixed_sum::add(v) with atomics, into limbs `limb` and special term `special`.
template <class T>
__device__ inline void atomic_add_exact(unsigned long long* limb, double* special, T v) {
  std::int64_t part[3];
  const int k = fixed_sum::place(v, part);
  if (k == fixed_sum::special) atomicAdd(special, fixed_sum::special_term(static_cast<double>(v)));
  else if (k >= 0) atomic_add_placed(limb, k, part);
}
template <class T>
__device__ inline void atomic_add_exact(fixed_sum* s, T v) {
  atomic_add_exact(reinterpret_cast<unsigned long long*>(s->limb_data()), s->special_data(), v);
}

/// Items whose columns get more rows than this add every column value to the fixed_sums
/// (a counter holds 2^18 values below 2^45).
inline constexpr std::size_t max_counter_rows = std::size_t{1} << 17;

/// One segment of `m` elements (from element i0 of the piece `a`) by a half-warp: lane
/// `lane` takes elements lane, lane + 16, ... The tensor sums go to `tacc` / `tspecial`
/// (shared), the row sums to the item's fixed_sums, the column values to `counter` or the
/// column fixed_sums.
template <class Body, bool Factored>
__device__ void layer_segment(const Body& p, const detail::layer_item_desc& it,
                              const typename Body::policy::scalars& s,
                              const detail::layer_args<typename Body::param_type, typename Body::grad_type,
                                                       typename Body::state_type>& a,
                              std::size_t i0, std::size_t m, unsigned lane, unsigned mask, unsigned long long* tacc,
                              double* tspecial, unsigned long long* counter, bool counters) {
  using Policy = typename Body::policy;
  constexpr distopt::phase_spec spec = Policy::phases[Body::phase];
  constexpr int TS = spec.tensor_sums;
  constexpr int RS = Factored ? spec.row_sums : 0;
  constexpr int CS = Factored ? spec.col_sums : 0;
  constexpr int RV = Factored ? Policy::row_values : 0;
  constexpr int OUT = spec.tensor_sums + spec.row_sums + spec.col_sums;
  const std::size_t t = a.first + i0;  // tensor index
  std::size_t row = 0, col = 0;
  if constexpr (Factored) {
    row = t / a.cols;
    col = (t / a.matrix) * a.cols + t % a.cols;
  }
  float rv[RV > 0 ? RV : 1] = {};
  for (int k = 0; k < RV; ++k) rv[k] = a.row_values[k][row];
  double tl[TS > 0 ? TS : 1] = {};
  double rl[RS > 0 ? RS : 1] = {};
  for (std::size_t e = lane; e < m; e += 16) {
    float out[OUT > 0 ? OUT : 1] = {};
    detail::layer_element<Policy, Body::phase, Factored, Body::mode, typename Body::param_type,
                          typename Body::grad_type, typename Body::state_type, true>(s, a, i0 + e, col + e, rv,
                                                                                      a.grad_scale, out);
    for (int k = 0; k < TS; ++k) tl[k] += static_cast<double>(out[k]);
    for (int k = 0; k < RS; ++k) rl[k] += static_cast<double>(out[spec.tensor_sums + k]);
    for (int k = 0; k < CS; ++k) {
      const float v = out[spec.tensor_sums + spec.row_sums + k];
      const std::uint32_t u = __float_as_uint(v), mag = u & 0x7fffffffu;
      if (mag == 0) continue;
      const std::size_t at = static_cast<std::size_t>(k) * a.col_count + (col + e - a.col_first);
      const std::uint32_t lo = p.col_lo[it.cols_at + at];
      if (counters && mag - lo < detail::column_window::span) {
        // An integer number of 2^(lo - 150) units: the significand shifted by e - lo < 22.
        const std::uint64_t x = static_cast<std::uint64_t>((mag & 0x7fffffu) | 0x800000u) << ((mag >> 23) - (lo >> 23));
        atomicAdd(counter + at, (u >> 31) ? 0ull - x : x);
      } else {
        atomic_add_exact(a.col_sums + at, v);
      }
    }
  }
  // combine_lanes' order: lane j += lane j + w for w = 8, 4, 2, 1.
  for (int w = 8; w > 0; w /= 2) {
    for (int k = 0; k < TS; ++k) tl[k] += __shfl_down_sync(mask, tl[k], w, 16);
    for (int k = 0; k < RS; ++k) rl[k] += __shfl_down_sync(mask, rl[k], w, 16);
  }
  if (lane == 0) {
    for (int k = 0; k < TS; ++k) atomic_add_exact(tacc + k * fixed_sum::limbs, tspecial + k, tl[k]);
    for (int k = 0; k < RS; ++k) atomic_add_exact(a.row_sums + (k * a.row_count + (row - a.row_first)), rl[k]);
  }
}

/// Piece c of item `it` by the block's half-warps: its layout blocks dealt to them in
/// turn (the first to half-warp `before` mod 16), each walked in segments. Returns its
/// number of layout blocks.
template <class Body>
__device__ std::size_t layer_piece(const Body& p, const detail::layer_item_desc& it, std::size_t c, std::size_t before,
                                   unsigned lane, unsigned mask, unsigned long long* tacc, double* tspecial,
                                   unsigned long long* counter, bool counters) {
  const unsigned half = threadIdx.x / 16u, halves = blockDim.x / 16u;
  const detail::shard_piece& pc = p.pieces[c];
  if (pc.count == 0) return 0;
  const bool f = it.factored;
  const auto a = p.args(it, c);
  const typename Body::policy::scalars s = p.scalars[pc.group];
  const std::size_t first = a.first, b0 = first / p.block;
  const std::size_t blocks = (first + pc.count - 1) / p.block - b0 + 1;
  for (std::size_t q = (half + halves - before % halves) % halves; q < blocks; q += halves) {
    const std::size_t lo = (b0 + q) * p.block > first ? (b0 + q) * p.block : first;
    const std::size_t end = (b0 + q + 1) * p.block, hi = end < first + pc.count ? end : first + pc.count;
    for (std::size_t t0 = lo; t0 < hi;) {  // the layout block's segments: cut at rows
      const std::size_t row_end = (t0 / it.cols + 1) * it.cols;
      const std::size_t t1 = f && row_end < hi ? row_end : hi;
      if (f)
        layer_segment<Body, true>(p, it, s, a, t0 - first, t1 - t0, lane, mask, tacc, tspecial, counter, counters);
      else
        layer_segment<Body, false>(p, it, s, a, t0 - first, t1 - t0, lane, mask, tacc, tspecial, counter, counters);
      t0 = t1;
    }
  }
  return blocks;
}

/// A phase that sums nothing (the last one of Adafactor, CAME, Lamb: the update): no order
/// to keep, so a thread block per piece rather than per item, grid-stride over pieces
/// [p.piece_first, p.piece_first + pieces) (an item of a factored tensor is 64 rows or
/// more: a block per item left most of the device idle).
template <class Body>
DISTOPT_KERNEL void __launch_bounds__(256) layer_pass_kernel(const Body p, std::size_t pieces) {
  const unsigned lane = threadIdx.x % 16u, mask = 0xffffu << (16u * ((threadIdx.x / 16u) % 2u));
  for (std::size_t w = blockIdx.x; w < pieces; w += gridDim.x) {
    const std::size_t c = p.piece_first + w;
    layer_piece(p, p.items[p.piece_item[c]], c, 0, lane, mask, nullptr, nullptr, nullptr, false);
  }
}

/// detail::layer_phase_body: a thread block per item (grid-stride); the item's layout
/// blocks dealt to its 16 half-warps in turn across its pieces. `SharedCols`: the column
/// counters in dynamic shared memory (body.max_cols of them), else in body.col_acc.
template <bool SharedCols, class Body>
DISTOPT_KERNEL void __launch_bounds__(256) layer_phase_kernel(const Body p, std::size_t items) {
  using Policy = typename Body::policy;
  constexpr distopt::phase_spec spec = Policy::phases[Body::phase];
  constexpr int TS = spec.tensor_sums > 0 ? spec.tensor_sums : 1;
  constexpr int CS = spec.col_sums;
  constexpr std::size_t words = sizeof(fixed_sum) / sizeof(unsigned long long);
  static_assert(sizeof(fixed_sum) == (fixed_sum::limbs + 1) * sizeof(unsigned long long), "fixed_sum: limbs, special");
  extern __shared__ unsigned long long shared_counters[];
  __shared__ unsigned long long tacc[TS * fixed_sum::limbs];
  __shared__ double tspecial[TS];
  const unsigned lane = threadIdx.x % 16u, mask = 0xffffu << (16u * ((threadIdx.x / 16u) % 2u));
  for (std::size_t w = blockIdx.x; w < items; w += gridDim.x) {
    const detail::layer_item_desc& it = p.items[p.first_item + w];
    const bool f = it.factored;
    const std::size_t n_cols = f ? static_cast<std::size_t>(CS) * it.col_count : 0;
    unsigned long long* const counter =
        SharedCols ? shared_counters : reinterpret_cast<unsigned long long*>(p.col_acc + it.cols_at);
    const bool counters = it.row_count <= max_counter_rows;
    unsigned long long* const sums = reinterpret_cast<unsigned long long*>(p.sums + it.sums_at[Body::phase]);
    for (std::size_t i = threadIdx.x, n = p.sum_count(it) * words; i < n; i += blockDim.x) sums[i] = 0;
    for (std::size_t i = threadIdx.x; i < n_cols; i += blockDim.x) counter[i] = 0;
    for (unsigned i = threadIdx.x; i < TS * fixed_sum::limbs; i += blockDim.x) tacc[i] = 0;
    if (threadIdx.x < TS) tspecial[threadIdx.x] = 0.0;
    __syncthreads();
    std::size_t before = 0;  // layout blocks of the item in the pieces before this one
    for (std::size_t c = it.piece_begin; c < it.piece_end; ++c)
      before += layer_piece(p, it, c, before, lane, mask, tacc, tspecial, counter, counters);
    __syncthreads();
    fixed_sum* const ts = p.sums + it.sums_at[Body::phase];
    if constexpr (spec.tensor_sums > 0) {
      for (unsigned i = threadIdx.x; i < spec.tensor_sums * fixed_sum::limbs; i += blockDim.x)
        ts[i / fixed_sum::limbs].limb_data()[i % fixed_sum::limbs] = static_cast<std::int64_t>(tacc[i]);
      if (threadIdx.x < spec.tensor_sums) *ts[threadIdx.x].special_data() = tspecial[threadIdx.x];
    }
    if constexpr (CS > 0) {
      // The counters into the column sums, and each window re-centred for the next step.
      fixed_sum* const cs = ts + spec.tensor_sums + (f ? static_cast<std::size_t>(spec.row_sums) * it.row_count : 0);
      const std::size_t matrix_rows = it.matrix / (it.cols ? it.cols : 1);
      const std::size_t rows = it.row_count < matrix_rows ? it.row_count : matrix_rows;
      for (std::size_t i = threadIdx.x; i < n_cols; i += blockDim.x) {
        std::uint32_t& lo = p.col_lo[it.cols_at + i];
        const long long x = static_cast<long long>(counter[i]);
        auto* limb = reinterpret_cast<unsigned long long*>(cs[i].limb_data());
        if (x != 0) {
          std::int64_t part[3];
          const int k = fixed_sum::place_units(static_cast<std::uint64_t>(x < 0 ? -x : x),
                                               static_cast<int>(lo >> 23) - 1, x < 0, part);
          atomic_add_placed(limb, k, part);
        }
        double total = 0.0;  // the column's sum, roughly (the limbs read where the atomics went)
        for (int k = fixed_sum::limbs; k-- > 0;)
          total += static_cast<double>(static_cast<long long>(atomicAdd(limb + k, 0ull))) * ldexp(1.0, 32 * k - 149);
        const float mean = static_cast<float>(fabs(total) / static_cast<double>(rows > 0 ? rows : 1));
        const std::int32_t e = static_cast<std::int32_t>((__float_as_uint(mean) >> 23) & 0xffu);
        lo = e >= 1 && e <= 254 ? detail::column_window::window_at(e - 15) : detail::column_window::unset;
      }
    }
    __syncthreads();
  }
}

/// Launches layer_phase_kernel over `items` items on `stream`: the column counters in
/// shared memory where body.max_cols of them fit in `shared_limit` bytes, the grid of the
/// blocks that fit on the device at once with that much shared memory.
template <class Body>
void launch_layer_phase(const Body& p, std::size_t items, int sms, cudaStream_t stream) {
  if (items == 0) return;
  constexpr distopt::phase_spec spec = Body::policy::phases[Body::phase];
  constexpr std::size_t shared_limit = 96 * 1024;
  const std::size_t bytes = p.max_cols * sizeof(unsigned long long);
  const auto grid = [&](auto kernel, std::size_t dynamic) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, dynamic) != cudaSuccess || per_sm < 1) {
      static_cast<void>(cudaGetLastError());
      per_sm = 1;
    }
    return static_cast<unsigned>(std::min<std::size_t>(items, static_cast<std::size_t>(sms) * per_sm));
  };
  if constexpr (spec.tensor_sums + spec.row_sums + spec.col_sums == 0) {
    constexpr auto kernel = layer_pass_kernel<Body>;
    items = p.piece_count;
    if (items == 0) return;
    kernel<<<grid(kernel, 0), 256, 0, stream>>>(p, items);
  } else if (bytes <= shared_limit) {
    constexpr auto kernel = layer_phase_kernel<true, Body>;
    if (bytes > 48 * 1024)
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
            "cudaFuncSetAttribute (layer-wise phase)");
    kernel<<<grid(kernel, bytes), 256, bytes, stream>>>(p, items);
  } else {
    constexpr auto kernel = layer_phase_kernel<false, Body>;
    kernel<<<grid(kernel, 0), 256, 0, stream>>>(p, items);
  }
  check(cudaGetLastError(), "distopt::cuda layer-wise phase launch");
}

/// detail::layer_merge_phase: tensor t by the blocks of grid row t (grid-stride in y), its
/// merged sums dealt one to a thread across the row's blocks; each thread merges its sum
/// over the tensor's items as the phase's body does. (The generic phase kernel ran a block
/// per tensor: a column sum adds 88 B from each of the tensor's items, and 33 blocks took
/// 1.7 ms for a 60 M-param model on an H200, 1 % of its DRAM bandwidth; ncu, 2026-11-28.)
template <class Merge>
DISTOPT_KERNEL void __launch_bounds__(256) layer_merge_kernel(const Merge p, std::size_t tensors) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t t = blockIdx.y; t < tensors; t += gridDim.y)
    for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x, n = p.size(t); j < n;
         j += stride)
      p(t, j, j + 1);
}

/// Launches layer_merge_kernel over `tensors` tensors on `stream`: about 8 blocks a
/// multiprocessor in all, at least one per tensor.
template <class Merge>
void launch_layer_merge(const Merge& p, std::size_t tensors, int sms, cudaStream_t stream) {
  if (tensors == 0) return;
  const unsigned rows = static_cast<unsigned>(std::min<std::size_t>(tensors, 65535));
  const unsigned per_row = static_cast<unsigned>(std::max<std::size_t>(1, static_cast<std::size_t>(sms) * 8 / rows));
  layer_merge_kernel<Merge><<<dim3(per_row, rows), 256, 0, stream>>>(p, tensors);
  check(cudaGetLastError(), "distopt::cuda layer-wise merge launch");
}

}  // namespace abi_v0_1
}  // namespace distopt::cuda_exec
