// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The 8-bit stage of distopt::optimizer (`replicated<q8>`, `sharded<q8>`): compact
/// code buffers, one fp32 absmax per block of 256, fp32 states for the tensors below
/// min_8bit_size, and the fused 8-bit update of a piece. storage/q8.hpp includes it, and
/// exec/cuda/phases.cuh (for the 8-bit phase's kernel); host optimizers with fp32 or bf16
/// states never parse it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../concepts.hpp"
#include "phases.hpp"
#include "../exec/transfer.hpp"
#include "../shard_view.hpp"
#include "../detail/buffer.hpp"
#include "../detail/q8_loop.hpp"
#include "../detail/q8_map.hpp"
#include "../detail/shard_plan.hpp"
#include "../detail/update_loop.hpp"
#include "elementwise.hpp"
#include "stages.hpp"

namespace distopt::detail {

/// The map of Policy's state slot k: unsigned for the slots the policy declares
/// non-negative, signed otherwise.
template <class Policy>
const q8_codebook& q8_slot_codebook(int k) {
  return state_slot_nonnegative<Policy>(k) ? unsigned_codebook() : signed_codebook();
}

/// Where a piece's states sit in the q8 buffers: in the codes (block-aligned) or in the
/// fp32 states of the tensors below min_8bit_size.
struct q8_piece {
  bool quantized = false;
  std::size_t offset = 0;
};

/// The fused 8-bit update of the pieces of one bucket whose group uses N state slots, one
/// unit per block of q8::block elements: update_range_q8 over the codes of 8-bit tensors,
/// update_range over the fp32 states of the others. Pieces start on q8 blocks.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
struct q8_update_phase : bucket_pieces {
  const q8_piece* where = nullptr;      ///< per piece of the bucket
  const typename Policy::scalars* scalars = nullptr;  ///< per group, this step's
  const float* tensor_scale = nullptr;                ///< per tensor (percentile clipping), or null
  Param* params = nullptr;
  bool params_local = false;  ///< params indexed by local index (ZeRO-3), else buffer index
  const Grad* grads = nullptr;
  bool grads_local = false;  ///< grads indexed by local index (the fp32 shard, ZeRO-2), else buffer index
  float* master = nullptr;   ///< null without master weights
  std::uint8_t* code[4] = {};
  float* absmax[4] = {};
  float* small[4] = {};
  const float* map[4] = {};          ///< each slot's 256 map values
  const std::int32_t* lut[4] = {};  ///< each slot's lookup table (q8_codebook::lookup)
  const q8_simd_tables* simd[4] = {};  ///< each slot's AVX-512 tables (host executors; else null)

  DISTOPT_HD std::size_t size(std::size_t c) const noexcept {
    return takes(c, N) ? (pieces[c].count + q8::block - 1) / q8::block : 0;
  }
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    const shard_piece& pc = pieces[c];
    const q8_piece q = where[c];
    const float scale = tensor_scale ? step_scale() * tensor_scale[pc.tensor] : step_scale();
    const std::uint64_t random_key = step_key();
    const std::size_t e0 = first * q8::block, e1 = last * q8::block < pc.count ? last * q8::block : pc.count;
    Param* p = params + (params_local ? pc.local : pc.buffer) + e0;
    const Grad* g = grads + (grads_local ? pc.local : pc.buffer) + e0;
    float* m = master ? master + pc.local + e0 : nullptr;
    if (q.quantized) {
      q8_args<Param, Grad> a{p, g, m, {}, {}, {}, {}, scale, random_key, pc.layout + e0};
      for (int k = 0; k < N; ++k) {
        a.code[k] = code[k] + q.offset + e0;
        a.absmax[k] = absmax[k] + q.offset / q8::block + first;
        a.map[k] = map[k];
        a.lut[k] = lut[k];
        a.simd[k] = simd[k];
      }
      update_range_q8<Policy, N, Mode>(scalars[pc.group], a, e1 - e0);
    } else {
      update_args<Param, Grad, float> a{p, g, m, {}, scale, random_key, pc.layout + e0};
      for (int k = 0; k < N; ++k) a.state[k] = small[k] + q.offset + e0;
      update_range<Policy, N, Mode>(scalars[pc.group], a, e1 - e0);
    }
  }
};

/// The 8-bit stage (`replicated<q8>`, `sharded<q8>`): the state slots hold the codes of
/// the tensors with at least min_8bit_size elements (each piece padded to whole blocks, so
/// that a piece's blocks are its tensor's blocks), with one fp32 absmax per block, and the
/// fp32 states of the others (the context's small_). Codes start as the code of 0, absmax
/// as 0. A matrix GaLore projects keeps its (low-rank) states in the projection stage.
template <class Policy, class Exec>
struct q8_stage {
  template <class Ctx>
  void init(Ctx& c) {
    if (c.layout_.block_size() % q8::block != 0)
      throw std::invalid_argument("distopt::optimizer: q8 states need a layout block size that is a multiple of " +
                                  std::to_string(q8::block) + " elements, got " +
                                  std::to_string(c.layout_.block_size()));
    const auto& pieces = c.plan_.pieces();
    where_.assign(pieces.size(), {});
    std::size_t codes = 0, small = 0;
    for (std::size_t p = 0; p < pieces.size(); ++p) {
      if (c.states_at_.whole_matrix(pieces[p].tensor)) continue;  // low-rank states: the projection stage
      const bool quantized = c.layout_.tensors()[pieces[p].tensor].numel >= c.options_.min_8bit_size;
      where_[p] = {quantized, quantized ? codes : small};
      for (int k = 0; k < c.slots_; ++k)
        c.states_at_.place(p, k, quantized ? state_home::slot : state_home::small, where_[p].offset, pieces[p].count);
      if (quantized) codes += (pieces[p].count + q8::block - 1) / q8::block * q8::block;
      else small += pieces[p].count;
    }
    for (int k = 0; k < c.slots_; ++k) {
      c.states_[k] = buffer<std::uint8_t, Exec>(c.exec_, codes);
      fill_phase<std::uint8_t> fill;
      fill.n = codes;
      fill.chunk = Ctx::chunk_elems;
      fill.data = c.states_[k].data();
      fill.value = q8_slot_codebook<Policy>(k).zero_code();
      launch(c.exec_, fill.items(), fill);
      c.absmax_[k] = buffer<float, Exec>(c.exec_, codes / q8::block);
      c.small_[k] = buffer<float, Exec>(c.exec_, small);
    }
    where_x_ = c.in_exec(where_, where_dev_);
    if constexpr (Ctx::projects) matrix_index_x_ = c.in_exec(c.states_at_.matrix_index(), matrix_index_dev_);
    if constexpr (!host_memory<Exec>) {  // the maps and lookup tables, in the executor's memory
      for (int nonneg = 0; nonneg < 2; ++nonneg) {
        const q8_codebook& book = nonneg ? unsigned_codebook() : signed_codebook();
        map_dev_[nonneg] = buffer<float, Exec>(c.exec_, 256);
        copy_bytes(c.exec_, map_dev_[nonneg].data(), book.values().data(), map_dev_[nonneg].bytes());
        lut_dev_[nonneg] = buffer<std::int32_t, Exec>(c.exec_, 2 * q8_codebook::slices);
        copy_bytes(c.exec_, lut_dev_[nonneg].data(), book.lookup(), lut_dev_[nonneg].bytes());
      }
    }
  }

  /// The update of bucket `b`'s pieces, one pass per slot count in use.
  template <param_mode Mode, class Ctx, class G>
  void run_bucket(Ctx& c, const step_inputs<Policy, G>& in, const shard_bucket& b) {
    for_each_slot_count<Policy>(in.active, [&]<int N>(std::integral_constant<int, N>) {
      q8_update_phase<Policy, N, Mode, typename Ctx::param_type, G> u;
      u.pieces = c.exec_pieces() + b.first_piece;
      u.where = where_x_ + b.first_piece;
      u.scalars = in.scalars;
      u.slots = in.slots;
      u.tensor_scale = in.tensor_scale;
      u.matrix_index = matrix_index_x_;
      u.params = c.params_.data();
      u.params_local = c.shards_params();
      u.grads = in.grads;
      u.grads_local = in.grads_local;
      u.master = c.uses_master() ? c.master_.data() : nullptr;
      for (int k = 0; k < N; ++k) {
        u.code[k] = c.states_[k].data();
        u.absmax[k] = c.absmax_[k].data();
        u.small[k] = c.small_[k].data();
        const bool nonneg = state_slot_nonnegative<Policy>(k);
        const q8_codebook& book = q8_slot_codebook<Policy>(k);
        u.map[k] = host_memory<Exec> ? book.values().data() : map_dev_[nonneg ? 1 : 0].data();
        u.lut[k] = host_memory<Exec> ? book.lookup() : lut_dev_[nonneg ? 1 : 0].data();
        u.simd[k] = host_memory<Exec> ? &book.simd() : nullptr;
      }
      u.control = in.control;
      u.grad_scale = in.grad_scale;
      u.key = in.key;
      launch(c.exec_, b.end_piece - b.first_piece, u);
    });
  }

  /// This rank's part of state slot `k` of tensor `i` decoded to fp32: copied out of the
  /// executor's memory, then decoded on the host.
  template <class Ctx>
  shard_values local_values(const Ctx& c, std::size_t i, int k) const {
    const piece_range r = c.plan_.pieces_of(i);
    if (r.empty() || c.states_at_.whole_matrix(i)) return {};
    const std::size_t count = c.plan_.local_count(i), at = c.states_at_.offset(r.first, k);
    shard_values out{std::vector<float>(count), c.plan_.pieces()[r.first].layout - c.layout_.tensors()[i].offset};
    using floats = typename Ctx::template view<const float>;
    if (c.states_at_.home(r.first, k) == state_home::small) {
      download(c.exec_, floats(c.small_[k].data() + at, count), std::span<float>(out.values));
      return out;
    }
    std::vector<std::uint8_t> codes(count);
    std::vector<float> absmax((count + q8::block - 1) / q8::block);
    download(c.exec_, typename Ctx::template view<const std::uint8_t>(c.states_[k].data() + at, count),
             std::span<std::uint8_t>(codes));
    download(c.exec_, floats(c.absmax_[k].data() + at / q8::block, absmax.size()), std::span<float>(absmax));
    decode_blocks(q8_slot_codebook<Policy>(k).values().data(), codes.data(), absmax.data(), count, out.values.data());
    return out;
  }

  std::vector<q8_piece> where_;  // per piece: codes or fp32 states (the layout's homes, as the phase reads them)
  const q8_piece* where_x_ = nullptr;  // where the executor reads it
  const int* matrix_index_x_ = nullptr;  // with GaLore: the projected matrices, skipped
  buffer<q8_piece, Exec> where_dev_;
  buffer<int, Exec> matrix_index_dev_;
  // Device executors only: the signed [0] and unsigned [1] maps and lookup tables.
  std::array<buffer<float, Exec>, 2> map_dev_;
  std::array<buffer<std::int32_t, Exec>, 2> lut_dev_;
};

/// Marks the 8-bit stage as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct stage_included<Policy, q8_stage_tag> : std::true_type {};

}  // namespace distopt::detail
