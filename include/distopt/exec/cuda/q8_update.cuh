// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The CUDA kernel of the update phase over 8-bit block-wise states: one thread block
/// of 256 threads per quantization block of 256 elements. Each thread decodes its
/// element's states (map[code] * absmax), runs the CPU loop's per-element body
/// (detail::update_one) on them in registers, and the block finds each slot's new absmax
/// with a CUB block reduction (a max over the magnitudes' bit patterns, as the CPU's
/// block_absmax) before any code is written; then each thread writes its nearest codes
/// through the slot's lookup table (q8_codebook::q8_nearest, the CPU's function).
///
/// Status: run on an H200 (2026-11-27): bit-identical to the CPU (tests/cuda), clean under
/// compute-sanitizer, 0.25 of its bytes model (bench/RESULTS.md). The optimizer's own 8-bit
/// phase on cuda (exec/cuda/phases.cuh: a warp per quantization block, no block barrier)
/// reaches 0.42 on the same machine; this family has not been moved to that shape yet.

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../detail/q8_map.hpp"
#include "update.cuh"

namespace distopt::cuda_exec {
inline namespace abi_v0_1 {

/// One run of elements with quantized states, starting on a quantization block: device
/// pointers to its params, grads, master weights (or null), each slot's codes and absmax
/// values (one per block), and the layout index of its first element.
template <class Param, class Grad>
struct q8_piece {
  Param* param;
  const Grad* grad;
  float* master;
  std::uint8_t* code[4];
  float* absmax[4];
  std::size_t count;
  std::size_t random_base;
};

/// Each slot's map (256 values) and lookup table (q8_codebook::lookup) in device memory.
struct q8_tables {
  const float* map[4];
  const std::int32_t* lut[4];
};

/// Quantization block `block` of piece `piece`.
struct q8_block_ref {
  std::uint32_t piece;
  std::uint32_t block;
};

/// The larger of two magnitudes' bit patterns (a named type: CUB checks its operator).
struct max_bits {
  DISTOPT_HD std::uint32_t operator()(std::uint32_t x, std::uint32_t y) const { return x > y ? x : y; }
};

template <class Policy, int N, distopt::detail::param_mode Mode, class Param, class Grad>
DISTOPT_KERNEL void __launch_bounds__(256)
    q8_update_kernel(const typename Policy::scalars s, const q8_piece<Param, Grad>* __restrict__ pieces,
                     const q8_block_ref* __restrict__ blocks, std::size_t block_count, q8_tables tables, float scale,
                     std::uint64_t key) {
  static_assert(distopt::q8::block == 256, "one thread per element of a quantization block");
  using reduce = cub::BlockReduce<std::uint32_t, 256>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ std::uint32_t top_shared;
  constexpr bool uses_master = Mode == distopt::detail::param_mode::master;
  for (std::size_t b = blockIdx.x; b < block_count; b += gridDim.x) {
    const q8_block_ref ref = blocks[b];
    const q8_piece<Param, Grad> pc = pieces[ref.piece];
    const std::size_t b0 = static_cast<std::size_t>(ref.block) * distopt::q8::block;
    const std::size_t i = b0 + threadIdx.x;
    const bool mine = i < pc.count;
    float fresh[N > 0 ? N : 1] = {};
    if (mine) {
      float old_absmax[N > 0 ? N : 1];
      DISTOPT_CUDA_UNROLL
      for (int k = 0; k < N; ++k) {
        old_absmax[k] = pc.absmax[k][ref.block];
        fresh[k] = tables.map[k][pc.code[k][i]] * old_absmax[k];
      }
      float* f[4] = {&fresh[0], &fresh[N > 1 ? 1 : 0], &fresh[N > 2 ? 2 : 0], &fresh[N > 3 ? 3 : 0]};
      float* master = uses_master ? pc.master + i : nullptr;
      distopt::detail::update_one<Policy, N, Mode>(s, pc.param + i, pc.grad + i, master, f[0], f[1], f[2], f[3], 0,
                                                   scale, key, pc.random_base + i);
    }
    DISTOPT_CUDA_UNROLL
    for (int k = 0; k < N; ++k) {
      const std::uint32_t mag = mine ? __float_as_uint(fresh[k]) & 0x7fffffffu : 0u;
      const std::uint32_t top = reduce(temp).Reduce(mag, max_bits{});
      if (threadIdx.x == 0) top_shared = top;
      __syncthreads();
      const float amax = __uint_as_float(top_shared);
      const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
      if (mine) pc.code[k][i] = distopt::detail::q8_codebook::q8_nearest(tables.lut[k], fresh[k] * inv);
      if (threadIdx.x == 0) pc.absmax[k][ref.block] = amax;
      __syncthreads();  // temp and top_shared are reused by the next slot and block
    }
  }
}

/// The quantization blocks of `pieces` in device memory, and the slots' tables, reused
/// every step.
template <class Param, class Grad>
class q8_update_plan {
 public:
  q8_update_plan() = default;
  /// `books[k]`: slot k's codebook (host), copied to the device with the block list.
  q8_update_plan(const std::vector<q8_piece<Param, Grad>>& pieces,
                 const std::vector<const distopt::detail::q8_codebook*>& books) {
    if (books.size() > 4) throw std::invalid_argument("distopt cuda: at most 4 quantized slots");
    std::vector<q8_block_ref> blocks;
    for (std::size_t k = 0; k < pieces.size(); ++k)
      for (std::size_t b = 0; b * distopt::q8::block < pieces[k].count; ++b)
        blocks.push_back({static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(b)});
    block_count_ = blocks.size();
    pieces_ = detail_::upload(pieces, "q8 plan");
    blocks_ = detail_::upload(blocks, "q8 plan");
    for (std::size_t k = 0; k < books.size(); ++k) {
      const auto& v = books[k]->values();
      maps_[k] = detail_::upload(std::vector<float>(v.begin(), v.end()), "q8 plan");
      const std::int32_t* lut = books[k]->lookup();
      luts_[k] = detail_::upload(std::vector<std::int32_t>(lut, lut + 2 * distopt::detail::q8_codebook::slices),
                                 "q8 plan");
    }
    sms_ = detail_::multiprocessors();
  }
  q8_update_plan(const q8_update_plan&) = delete;
  q8_update_plan& operator=(const q8_update_plan&) = delete;
  ~q8_update_plan() {
    cudaFree(pieces_);
    cudaFree(blocks_);
    for (int k = 0; k < 4; ++k) {
      cudaFree(maps_[k]);
      cudaFree(luts_[k]);
    }
  }

  std::size_t blocks() const noexcept { return block_count_; }

  /// Enqueues one update of every element on `stream`: `Policy` with N quantized slots.
  template <class Policy, int N, distopt::detail::param_mode Mode>
  void run(const typename Policy::scalars& s, float grad_scale, std::uint64_t random_key,
           cudaStream_t stream = nullptr) const {
    if (block_count_ == 0) return;
    q8_tables t{};
    for (int k = 0; k < 4; ++k) {
      t.map[k] = static_cast<const float*>(maps_[k]);
      t.lut[k] = static_cast<const std::int32_t*>(luts_[k]);
    }
    constexpr auto kernel = q8_update_kernel<Policy, N, Mode, Param, Grad>;
    kernel<<<resident_grid<kernel>(block_count_, sms_), 256, 0, stream>>>(
        s, static_cast<const q8_piece<Param, Grad>*>(pieces_), static_cast<const q8_block_ref*>(blocks_), block_count_,
        t, grad_scale, random_key);
    check(cudaGetLastError(), "q8_update_kernel launch");
  }

 private:
  void* pieces_ = nullptr;
  void* blocks_ = nullptr;
  void* maps_[4] = {};
  void* luts_[4] = {};
  std::size_t block_count_ = 0;
  int sms_ = 1;
};

}  // namespace abi_v0_1
}  // namespace distopt::cuda_exec
