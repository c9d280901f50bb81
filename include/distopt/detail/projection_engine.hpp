// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The projection engine of distopt::optimizer (GaLore): the 2-D tensors of groups
/// with a rank. policy/galore_adamw.hpp includes it; other optimizers never parse it.
///
/// Every rank holding part of such a matrix gets its whole reduced gradient (sharded
/// storage all-gathers the reduced grads of the buckets holding one: (d-1)/d of their
/// bytes more than ZeRO's step), projects it, updates the low-rank Adam states and
/// projects back the same way (so every rank computes the same bits, for any d), and
/// applies the update to its own elements of the master weights / params. With `owned`
/// storage each matrix lies whole on one rank: its grads are reduced there, nothing is
/// gathered, and one rank in the job computes its SVD and keeps its low-rank states.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../concepts.hpp"
#include "../layout/registry.hpp"
#include "../memory_report.hpp"
#include "../shard_view.hpp"
#include "../types/rounding.hpp"
#include "buffer.hpp"
#include "engines.hpp"
#include "q8_engine.hpp"
#include "q8_loop.hpp"
#include "shard_plan.hpp"
#include "update_loop.hpp"

namespace distopt::detail {

/// The projected part of an optimizer<Policy, ...> with element states of type State
/// (float, bf16, or q8: codes for the low-rank states of at least min_8bit_size elements).
/// Its functions take the optimizer (whose friend it is).
template <class Policy, class State>
struct projection_engine {
  using projector_type = typename matrix_projector<Policy>::type;
  struct projected_matrix {
    std::size_t tensor = 0;
    std::int64_t m = 0, n = 0;
    projector_type proj;
    std::array<std::vector<float>, 2> state;  // fp32 low-rank states
    std::array<std::vector<std::uint8_t>, 2> codes;  // q8 instead (at least min_8bit_size elements)
    std::array<std::vector<float>, 2> absmax;
  };

  /// Memory report: each projected matrix's low-rank states (fp32, or q8 codes and
  /// absmax), projection and one m x n work buffer (the largest) that every rank holding
  /// the matrix keeps. The element states of the other tensors are reported as usual.
  template <class Opt>
  void add_memory(const Opt&, memory_report& r) const {
    std::size_t states = 0, projections = 0, work = 0;
    for (const auto& t : matrices_) {
      if (t.state[0].empty() && t.codes[0].empty()) continue;  // another rank's matrix
      for (int k = 0; k < 2; ++k)
        states += t.state[k].size() * sizeof(float) + t.codes[k].size() + t.absmax[k].size() * sizeof(float);
      projections += (t.proj.left().size() + t.proj.right().size()) * sizeof(float);  // after the first step
      const auto low = t.proj.low_rank_shape(t.m, t.n);
      work = std::max(work, static_cast<std::size_t>(2 * t.m * t.n + low[0] * low[1]) * sizeof(float));
    }
    r.entries.push_back({"state projected", states});
    r.entries.push_back({"projections", projections});
    r.entries.push_back({"projection work", work});
  }

  template <class Opt>
  const projected_matrix& matrix_of(const Opt& o, std::string_view name) const {
    const std::size_t i = o.index_of(name);
    if (matrix_index_[i] < 0)
      throw std::out_of_range(std::string(Policy::name) + ": tensor '" + std::string(name) +
                              "' is not projected (not a matrix of a group with a rank)");
    return matrices_[static_cast<std::size_t>(matrix_index_[i])];
  }

  template <class Opt>
  void init(Opt& o) {
    const auto tensors = o.layout_.tensors();
    matrix_index_.assign(tensors.size(), -1);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const typename Policy::hyper_params& h = o.groups_[static_cast<std::size_t>(tensors[i].group)];
      if (!Policy::projects(h)) continue;
      const auto& t = tensors[i];
      if (t.shape.size() != 2)
        throw std::invalid_argument(std::string(Policy::name) + ": tensor '" + t.name + "' is " +
                                    std::to_string(t.shape.size()) +
                                    "-D, in a group with a rank: projected tensors must be matrices (put "
                                    "it in a group without a rank, as galore-torch users do)");
      if (t.tp != tp_split::none)
        throw std::invalid_argument(std::string(Policy::name) + ": tensor '" + t.name +
                                    "' is split over tensor-parallel ranks; projecting it needs the whole matrix");
      projected_matrix pm{i, t.shape[0], t.shape[1], projector_type(h), {}, {}, {}};
      const auto low = pm.proj.low_rank_shape(pm.m, pm.n);  // checks the rank against the shape
      // Its low-rank states live on the ranks that hold part of it.
      const bool held = !o.plan_.pieces_of(i).empty();
      const std::size_t ln = static_cast<std::size_t>(low[0] * low[1]);
      if (held && Opt::is_quantized && ln >= o.options_.min_8bit_size) {
        for (int k = 0; k < 2; ++k) {  // the low-rank matrix in blocks of 256, as a tensor's
          pm.codes[k].assign(ln, q8_slot_codebook<Policy>(k).zero_code());
          pm.absmax[k].assign((ln + q8::block - 1) / q8::block, 0.0f);
        }
      } else if (held) {
        for (auto& st : pm.state) st.assign(ln, 0.0f);
      }
      matrix_index_[i] = static_cast<int>(matrices_.size());
      matrices_.push_back(std::move(pm));
    }
    ortho_staging_.resize(matrices_.size());
    if (!matrices_.empty() && o.reduces_in_fp32())
      throw std::invalid_argument(std::string(Policy::name) +
                                  ": grad_reduce_in_fp32 is not supported with projected matrices");
    const auto& pieces = o.plan_.pieces();
    state_offset_.assign(pieces.size(), 0);
    std::size_t size = 0;
    for (std::size_t c = 0; c < pieces.size(); ++c)
      if (matrix_index_[pieces[c].tensor] < 0) {
        state_offset_[c] = size;
        size += pieces[c].count;
      }
    if constexpr (!Opt::is_quantized)  // q8: q8_engine::init allocates the element states
      for (int k = 0; k < o.slots_; ++k) o.states_[k] = detail::buffer<State, typename Opt::executor_type>(o.exec_, size);
  }

  /// State slot `k` of matrix `name`'s low-rank states, decoded to fp32.
  template <class Opt>
  std::vector<float> state_values(const Opt& o, std::string_view name, int k) const {
    const projected_matrix& pm = matrix_of(o, name);
    const std::size_t slot = static_cast<std::size_t>(k);
    if (pm.codes[slot].empty()) return pm.state[slot];
    std::vector<float> out(pm.codes[slot].size());
    decode_blocks(q8_slot_codebook<Policy>(k).values().data(), pm.codes[slot].data(), pm.absmax[slot].data(), out.size(),
                  out.data());
    return out;
  }

  template <class Opt>
  shard_view<const State> local_state(const Opt& o, std::string_view name, int k) const {
    const std::size_t i = o.index_of(name);
    const detail::piece_range r = o.plan_.pieces_of(i);
    if (matrix_index_[i] >= 0 || r.empty()) return {};
    return {std::span<const State>(o.states_[k].data() + state_offset_[r.first], o.plan_.local_count(i)),
            o.plan_.pieces()[r.first].layout - o.layout_.tensors()[i].offset};
  }

  /// The projected matrices of bucket `b`: gather their reduced grads (sharded), then per
  /// matrix: project, update the low-rank states, project back, apply to this rank's part.
  template <detail::param_mode Mode, class Opt>
  void project_bucket(Opt& o, const std::vector<typename Policy::scalars>& sc, float grad_scale, std::uint64_t key,
                      const detail::shard_bucket& b) {
    bool any = false;
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) any = any || matrix_index_[i] >= 0;
    if (!any) return;
    if (Opt::is_sharded && o.comm_.size() > 1 && !b.owned()) {  // owned: each matrix is its owner's alone
      typename Opt::grad_type* g = o.grads_.data() + b.buffer_begin;
      o.comm_.all_gather(std::span<const typename Opt::grad_type>(g + b.shard_begin(o.plan_.rank()), b.shard_elems),
                       std::span<typename Opt::grad_type>(g, b.padded()));
    }
    const auto& pieces = o.plan_.pieces();
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      const detail::piece_range mine = o.plan_.pieces_of(i);
      if (matrix_index_[i] < 0 || mine.empty()) continue;  // not projected, or another rank's
      projected_matrix& pm = matrices_[static_cast<std::size_t>(matrix_index_[i])];
      const tensor_slot& t = o.layout_.tensors()[i];
      const auto& s = sc[static_cast<std::size_t>(t.group)];
      const float scale = o.clip_scale_.empty() ? grad_scale : grad_scale * o.clip_scale_[i];
      const std::size_t mn = t.numel;
      const auto low_shape = pm.proj.low_rank_shape(pm.m, pm.n);
      const std::size_t ln = static_cast<std::size_t>(low_shape[0] * low_shape[1]);
      work_.resize(2 * mn + ln);
      float* full = work_.data();
      float* low = full + mn;
      float* back = low + ln;
      const typename Opt::grad_type* g = o.grads_.data() + o.plan_.tensor_buffer(i);
      for (std::size_t e = 0; e < mn; ++e) full[e] = to_float(g[e]) * scale;
      if (pm.proj.refresh_due(o.step_ - 1)) pm.proj.refresh(full, pm.m, pm.n);
      pm.proj.project(full, low);
      if (!pm.codes[0].empty()) {
        // 8-bit low-rank states: per block of 256, decode, update, new absmax, encode.
        alignas(64) float st2[2][q8::block];
        for (std::size_t b0 = 0; b0 < ln; b0 += q8::block) {
          const std::size_t n = std::min(q8::block, ln - b0), blk = b0 / q8::block;
          for (int k = 0; k < 2; ++k)
            detail::decode_block(q8_slot_codebook<Policy>(k).values().data(), pm.codes[k].data() + b0, pm.absmax[k][blk], n, st2[k]);
          for (std::size_t e = 0; e < n; ++e) {
            float st[2] = {st2[0][e], st2[1][e]};
            low[b0 + e] = Policy::moments(s, low[b0 + e], st);
            st2[0][e] = st[0];
            st2[1][e] = st[1];
          }
          for (int k = 0; k < 2; ++k)
            detail::requantize_block(st2[k], n, q8_slot_codebook<Policy>(k).lookup(), pm.absmax[k][blk], pm.codes[k].data() + b0);
        }
      } else {
        for (std::size_t e = 0; e < ln; ++e) {
          float st[2] = {pm.state[0][e], pm.state[1][e]};
          low[e] = Policy::moments(s, low[e], st);
          pm.state[0][e] = st[0];
          pm.state[1][e] = st[1];
        }
      }
      pm.proj.project_back(low, back);
      for (std::size_t c = mine.first; c < mine.end; ++c) {
        const detail::shard_piece& pc = pieces[c];
        const std::size_t first = pc.layout - t.offset;
        typename Opt::param_type* p = o.params_.data() + pc.buffer;
        float* m = o.uses_master() ? o.master_.data() + pc.local : nullptr;
        for (std::size_t e = 0; e < pc.count; ++e) {
          float value = Mode == detail::param_mode::master ? m[e] : to_float(p[e]);
          Policy::apply(s, value, back[first + e]);
          detail::store_param<Mode>(p, m, e, value, key, pc.layout);
        }
      }
    }
  }

  std::vector<projected_matrix> matrices_;  // the projected matrices
  std::vector<int> matrix_index_;           // per tensor, its index in matrices_ or -1
  std::vector<std::size_t> state_offset_;   // per piece, offset in the compact states
  std::vector<float> work_;                 // gradient, low-rank and update of one matrix
  std::vector<std::array<std::vector<float>, 3>> ortho_staging_;  // projections being loaded
};

/// Marks the projection engine as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct engine_included<Policy, projection_engine_tag> : std::true_type {};

}  // namespace distopt::detail
