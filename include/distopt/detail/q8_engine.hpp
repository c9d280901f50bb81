// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The 8-bit engine of distopt::optimizer (`replicated<q8>`, `sharded<q8>`): compact
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
#include "../engine/phases.hpp"
#include "../exec/transfer.hpp"
#include "../shard_view.hpp"
#include "buffer.hpp"
#include "engines.hpp"
#include "q8_loop.hpp"
#include "q8_map.hpp"
#include "shard_plan.hpp"
#include "update_loop.hpp"

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

/// The 8-bit part of an optimizer<Policy, ...> on executor Exec. Its functions take the
/// optimizer (whose friend it is); the codes themselves live in the optimizer's state
/// slots.
template <class Policy, class Exec>
struct q8_engine {
  using piece = q8_piece;

  /// Compact buffers: the codes of the tensors with at least min_8bit_size elements (each
  /// piece padded to whole blocks, so that a piece's blocks are its tensor's blocks), and
  /// the fp32 states of the others. Codes start as the code of 0, absmax as 0.
  template <class Opt>
  void init(Opt& o) {
    if (o.layout_.block_size() % q8::block != 0)
      throw std::invalid_argument("distopt::optimizer: q8 states need a layout block size that is a multiple of " +
                                  std::to_string(q8::block) + " elements, got " +
                                  std::to_string(o.layout_.block_size()));
    const auto& pieces = o.plan_.pieces();
    pieces_.assign(pieces.size(), {});
    std::size_t codes = 0, small = 0;
    for (std::size_t c = 0; c < pieces.size(); ++c) {
      if constexpr (Opt::projects)
        if (o.proj_.matrix_index_[pieces[c].tensor] >= 0) continue;  // low-rank states: the projection engine
      const bool quantized = o.layout_.tensors()[pieces[c].tensor].numel >= o.options_.min_8bit_size;
      pieces_[c] = {quantized, quantized ? codes : small};
      if (quantized) codes += (pieces[c].count + q8::block - 1) / q8::block * q8::block;
      else small += pieces[c].count;
    }
    for (int k = 0; k < o.slots_; ++k) {
      o.states_[k] = buffer<std::uint8_t, Exec>(o.exec_, codes);
      fill_phase<std::uint8_t> fill;
      fill.n = codes;
      fill.chunk = Opt::chunk_elems;
      fill.data = o.states_[k].data();
      fill.value = q8_slot_codebook<Policy>(k).zero_code();
      launch(o.exec_, fill.items(), fill);
      absmax_[k] = buffer<float, Exec>(o.exec_, codes / q8::block);
      small_[k] = buffer<float, Exec>(o.exec_, small);
    }
    if constexpr (!host_memory<Exec>) {  // what the update phase reads, in the executor's memory
      o.in_exec(pieces_, where_dev_);
      for (int nonneg = 0; nonneg < 2; ++nonneg) {
        const q8_codebook& book = nonneg ? unsigned_codebook() : signed_codebook();
        map_dev_[nonneg] = buffer<float, Exec>(o.exec_, 256);
        copy_bytes(o.exec_, map_dev_[nonneg].data(), book.values().data(), map_dev_[nonneg].bytes());
        lut_dev_[nonneg] = buffer<std::int32_t, Exec>(o.exec_, 2 * q8_codebook::slices);
        copy_bytes(o.exec_, lut_dev_[nonneg].data(), book.lookup(), lut_dev_[nonneg].bytes());
      }
    }
  }

  /// The update phase of bucket `b`'s pieces whose group uses N state slots; `sc`, `slots`
  /// and `tensor_scale` are in the executor's memory.
  template <param_mode Mode, int N, class Opt, class G>
  void launch_update(Opt& o, const typename Policy::scalars* sc, const int* slots, const float* tensor_scale,
                     const G* grads, float grad_scale, std::uint64_t key, const shard_bucket& b) {
    q8_update_phase<Policy, N, Mode, typename Opt::param_type, G> u;
    u.pieces = o.exec_pieces() + b.first_piece;
    if constexpr (host_memory<Exec>) u.where = pieces_.data() + b.first_piece;
    else u.where = where_dev_.data() + b.first_piece;
    u.scalars = sc;
    u.slots = slots;
    u.tensor_scale = tensor_scale;
    if constexpr (Opt::projects) u.matrix_index = o.proj_.matrix_index_.data();
    u.params = o.params_.data();
    u.params_local = o.shards_params();
    u.grads = grads;
    u.grads_local = o.template grads_local<G>();
    u.master = o.uses_master() ? o.master_.data() : nullptr;
    for (int k = 0; k < N; ++k) {
      u.code[k] = o.states_[k].data();
      u.absmax[k] = absmax_[k].data();
      u.small[k] = small_[k].data();
      const bool nonneg = state_slot_nonnegative<Policy>(k);
      const q8_codebook& book = q8_slot_codebook<Policy>(k);
      u.map[k] = host_memory<Exec> ? book.values().data() : map_dev_[nonneg ? 1 : 0].data();
      u.lut[k] = host_memory<Exec> ? book.lookup() : lut_dev_[nonneg ? 1 : 0].data();
      u.simd[k] = host_memory<Exec> ? &book.simd() : nullptr;
    }
    u.control = o.decision_control();
    u.grad_scale = grad_scale;
    u.key = key;
    launch(o.exec_, b.end_piece - b.first_piece, u);
  }

  /// Where this rank's part of a tensor sits in the q8 buffers.
  struct part {
    bool quantized = false;
    std::size_t offset = 0, count = 0, first = 0;
  };
  template <class Opt>
  part part_of(const Opt& o, std::string_view name) const {
    const std::size_t i = o.index_of(name);
    const auto& pieces = o.plan_.pieces();
    part q;
    if constexpr (Opt::projects)
      if (o.proj_.matrix_index_[i] >= 0) return q;  // a projected matrix: no element states
    q.quantized = o.layout_.tensors()[i].numel >= o.options_.min_8bit_size;
    const piece_range r = o.plan_.pieces_of(i);
    if (r.empty()) return q;
    q.offset = pieces_[r.first].offset;
    q.first = pieces[r.first].layout - o.layout_.tensors()[i].offset;
    q.count = o.plan_.local_count(i);
    return q;
  }

  /// This rank's part of state slot `k` of tensor `name`, decoded to fp32.
  template <class Opt>
  shard_values local_values(const Opt& o, std::string_view name, int k) const {
    const part q = part_of(o, name);
    shard_values out{std::vector<float>(q.count), q.first};
    using floats = typename Opt::template view<const float>;
    if (!q.quantized) {
      download(o.exec_, floats(small_[k].data() + q.offset, q.count), std::span<float>(out.values));
      return out;
    }
    // Copied out of the executor's memory, then decoded on the host.
    std::vector<std::uint8_t> codes(q.count);
    std::vector<float> absmax((q.count + q8::block - 1) / q8::block);
    download(o.exec_, typename Opt::template view<const std::uint8_t>(o.states_[k].data() + q.offset, q.count),
             std::span<std::uint8_t>(codes));
    download(o.exec_, floats(absmax_[k].data() + q.offset / q8::block, absmax.size()), std::span<float>(absmax));
    decode_blocks(q8_slot_codebook<Policy>(k).values().data(), codes.data(), absmax.data(), q.count, out.values.data());
    return out;
  }

  std::vector<piece> pieces_;                   // per piece of the plan
  std::array<buffer<float, Exec>, 4> absmax_;  // one per block of codes
  std::array<buffer<float, Exec>, 4> small_;   // states of the tensors below min_8bit_size
  // Device executors only: pieces_, and the signed [0] and unsigned [1] maps and lookup
  // tables, in the executor's memory.
  buffer<q8_piece, Exec> where_dev_;
  std::array<buffer<float, Exec>, 2> map_dev_;
  std::array<buffer<std::int32_t, Exec>, 2> lut_dev_;
};

/// Marks the 8-bit engine as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct engine_included<Policy, q8_engine_tag> : std::true_type {};

}  // namespace distopt::detail
