// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The 8-bit engine of distopt::optimizer (`replicated<q8>`, `sharded<q8>`): compact
/// code buffers, one fp32 absmax per block of 256, fp32 states for the tensors below
/// min_8bit_size, and the fused 8-bit update of a piece. storage/q8.hpp includes it;
/// optimizers with fp32 or bf16 states never parse it.

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

/// The 8-bit part of an optimizer<Policy, ...> on executor Exec. Its functions take the
/// optimizer (whose friend it is); the codes themselves live in the optimizer's state
/// slots.
template <class Policy, class Exec>
struct q8_engine {
  /// Where a piece's states sit: in the codes (block-aligned) or in the fp32 states.
  struct piece {
    bool quantized = false;
    std::size_t offset = 0;
  };

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
    constexpr std::size_t per = Opt::chunk_elems;
    for (int k = 0; k < o.slots_; ++k) {
      o.states_[k] = buffer<std::uint8_t, Exec>(o.exec_, codes);
      std::uint8_t* code = o.states_[k].data();
      const std::uint8_t zero = q8_slot_codebook<Policy>(k).zero_code();
      o.exec_.parallel_for((codes + per - 1) / per, [&](std::size_t c) {
        std::fill(code + c * per, code + std::min(codes, (c + 1) * per), zero);
      });
      absmax_[k] = buffer<float, Exec>(o.exec_, codes / q8::block);
      small_[k] = buffer<float, Exec>(o.exec_, small);
    }
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
    for (std::size_t c = r.first; c < r.end; ++c) q.count += pieces[c].count;
    return q;
  }

  /// q8: one piece, through the 8-bit loop or, for tensors below min_8bit_size, the
  /// plain loop over their fp32 states.
  template <param_mode Mode, int N, class Opt, class G>
  void run_piece(Opt& o, const typename Policy::scalars& sc, const G* grads, float grad_scale, std::uint64_t key,
                    std::size_t c) {
    const shard_piece& pc = o.plan_.pieces()[c];
    const piece& q = pieces_[c];
    const bool local = std::is_same_v<G, float> && o.reduces_in_fp32();
    typename Opt::param_type* p = o.params_.data() + pc.buffer;
    const G* g = grads + (local ? pc.local : pc.buffer);
    float* m = o.uses_master() ? o.master_.data() + pc.local : nullptr;
    if (q.quantized) {
      q8_args<typename Opt::param_type, G> a{p, g, m, {}, {}, {}, {}, grad_scale, key, pc.layout};
      for (int k = 0; k < N; ++k) {
        const q8_codebook& book = q8_slot_codebook<Policy>(k);
        a.code[k] = o.states_[k].data() + q.offset;
        a.absmax[k] = absmax_[k].data() + q.offset / q8::block;
        a.map[k] = book.values().data();
        a.lut[k] = book.lookup();
      }
      update_range_q8<Policy, N, Mode>(sc, a, pc.count);
    } else {
      update_args<typename Opt::param_type, G, float> a{p, g, m, {}, grad_scale, key, pc.layout};
      for (int k = 0; k < N; ++k) a.state[k] = small_[k].data() + q.offset;
      update_range<Policy, N, Mode>(sc, a, pc.count);
    }
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
};

/// Marks the 8-bit engine as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct engine_included<Policy, q8_engine_tag> : std::true_type {};

}  // namespace distopt::detail
