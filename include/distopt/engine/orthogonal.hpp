// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The orthogonalisation stage of distopt::optimizer (Muon): the matrices of the
/// groups a policy orthogonalises. policy/muon.hpp includes it; other optimizers never
/// parse it.
///
/// The momentum buffer is an element state (slot 0), sharded like any state, checkpointed
/// and resharded like one; it lives in the context's momentum buffer, packed over the
/// matrices' pieces, and the other tensors' (AdamW's) states in the element stage's packed
/// slot buffers, so that a Muon matrix costs one state, not the two slots the optimizer has. Per bucket holding such matrices, each rank
///   1. updates the momentum of its own elements and writes the matrix NS takes (the
///      Nesterov blend) into an fp32 bucket stage, at the elements' places in the bucket;
///   2. all-gathers the stage over the data-parallel ranks (sharded storage): the same
///      bytes as GaLore's gather of the reduced grads, (d-1)/d of the bucket in fp32. With
///      `owned` storage each matrix lies whole on its owner, who alone runs the next step:
///      nothing is gathered, and the other ranks get the new params by broadcast;
///   3. for every matrix it holds part of, runs Newton–Schulz on the whole matrix (every
///      holder computes the same bits, for any d and thread count) and applies the
///      orthogonalised update to its own elements. A matrix split over tensor-parallel
///      ranks is first all-gathered over the TP group (its rows, or its columns put back in
///      place), so every TP rank runs the unsplit matrix's Newton–Schulz and keeps its part:
///      the bits of the unsplit run.
/// The other tensors (a policy's AdamW groups) take the element update phase as usual.

#include <algorithm>
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
#include "../detail/buffer.hpp"
#include "../detail/shard_plan.hpp"
#include "../detail/update_loop.hpp"
#include "elementwise.hpp"
#include "stages.hpp"

namespace distopt::detail {

template <class Policy, class State>
struct orthogonal_stage {
  using orthogonalizer_type = typename matrix_orthogonalizer<Policy>::type;

  /// Refuses what the stage cannot run (a non-matrix in an orthogonalised group, as
  /// torch.optim.Muon does; a matrix too large for BLAS), marks the matrices and lays out
  /// the compact states.
  template <class Ctx>
  void init(Ctx& o) {
    const auto tensors = o.layout_.tensors();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      if (!Policy::orthogonalizes(o.groups_[static_cast<std::size_t>(t.group)])) continue;
      if (t.shape.size() != 2)
        throw std::invalid_argument(std::string(Policy::name) + ": tensor '" + t.name + "' is " +
                                    std::to_string(t.shape.size()) +
                                    "-D, in a Muon group: Muon only updates matrices (put it in a group with "
                                    "use_muon = false, which runs AdamW)");
      o.states_at_.matrix_index()[i] = 1;
      const std::int64_t m = t.shape[0], n = t.shape[1];
      orthogonalizer_type::check_shape(t.name, m, n);  // here, not mid-step on some ranks only
      // (With a TP group of size T set later, a split matrix is T times this: checked and
      // reported with the whole shape when the step gathers it.)
      if (!o.plan_.pieces_of(i).empty())
        work_bytes_ = std::max(work_bytes_, orthogonalizer_type::work_bytes(m, n) +
                                                static_cast<std::size_t>(m * n) * sizeof(float));
    }
    for (const auto& b : o.plan_.buckets())
      if (o.states_at_.any_whole_matrix(b.first_tensor, b.end_tensor))
        stage_elems_ = std::max(stage_elems_, stage_window(o, b).size);
    // The matrices' momentum (slot 0), packed; the other tensors' slots are the element stage's.
    const auto& pieces = o.plan_.pieces();
    std::size_t momentum = 0;
    for (std::size_t c = 0; c < pieces.size(); ++c) {
      if (!o.states_at_.whole_matrix(pieces[c].tensor)) continue;
      o.states_at_.place(c, 0, state_home::momentum, momentum, pieces[c].count);
      momentum += pieces[c].count;
    }
    o.momentum_ = buffer<State, typename Ctx::executor_type>(o.exec_, momentum);
  }

  /// Refuses hyper-parameters for group `g` that would turn its Muon matrices into AdamW
  /// tensors or the reverse (set_hyper, a checkpoint's groups): which tensors are matrices
  /// of the stage is fixed at construction, and so are their state slots.
  template <class Ctx>
  void check_hyper(const Ctx& o, int g, const typename Policy::hyper_params& h) const {
    const bool was = Policy::orthogonalizes(o.groups_[static_cast<std::size_t>(g)]);
    if (Policy::orthogonalizes(h) != was)
      throw std::invalid_argument(std::string(Policy::name) + ": group " + std::to_string(g) +
                                  (was ? " is a Muon group" : " is not a Muon group") +
                                  "; use_muon cannot change after construction");
  }

  /// Memory report: the matrices' momentum, the fp32 bucket stage and the largest
  /// matrix's NS work and update.
  template <class Ctx>
  void add_memory(const Ctx& o, memory_report& r) const {
    r.entries.push_back({"state momentum", o.momentum_.bytes()});
    r.entries.push_back({"orthogonalization stage", stage_elems_ * sizeof(float)});
    r.entries.push_back({"orthogonalization work", work_bytes_});
  }

  /// The part of bucket `b` this rank's stage holds, from its first element: all of it
  /// (gathered over the ranks), or on an owned bucket this rank's own run of matrices.
  struct window {
    std::size_t first, size;
  };
  template <class Ctx>
  static window stage_window(const Ctx& o, const shard_bucket& b) {
    if (b.owned()) return {b.shard_begin(o.plan_.rank()), b.shard_size(o.plan_.rank())};
    return {0, b.padded()};
  }

  /// Newton-Schulz runs on each bucket before its element update.
  static constexpr bool runs_between_buckets = true;
  template <param_mode Mode, class Ctx, class G>
  void run_bucket(Ctx& o, const step_inputs<Policy, G>& in, const shard_bucket& b) {
    orthogonalize_bucket<Mode>(o, *in.host_scalars, in.grads, in.grads_local, in.grad_scale, in.key, b);
  }

  /// The orthogonalised matrices of bucket `b`; `grads` as the element phase reads them
  /// (buffer index, or local index when `grads_local`).
  template <param_mode Mode, class Ctx, class G>
  void orthogonalize_bucket(Ctx& o, const std::vector<typename Policy::scalars>& sc, const G* grads, bool grads_local,
                            float grad_scale, std::uint64_t key, const shard_bucket& b) {
    // The same answer on every rank: the collective below matches.
    if (!o.states_at_.any_whole_matrix(b.first_tensor, b.end_tensor)) return;
    const auto tensors = o.layout_.tensors();
    const auto& pieces = o.plan_.pieces();
    const window sw = stage_window(o, b);
    stage_.resize(std::max(stage_.size(), sw.size));  // only the matrices' places are read
    // 1. Momentum of this rank's elements, and the matrix NS takes, into the stage.
    for (std::size_t c = b.first_piece; c < b.end_piece; ++c) {
      const shard_piece& pc = pieces[c];
      if (!o.states_at_.whole_matrix(pc.tensor)) continue;
      const auto& s = sc[static_cast<std::size_t>(pc.group)];
      const float scale = o.clip_scale_.empty() ? grad_scale : grad_scale * o.clip_scale_[pc.tensor];
      const G* g = grads + (grads_local ? pc.local : pc.buffer);
      State* st = o.momentum_.data() + o.states_at_.offset(c, 0);
      float* out = stage_.data() + (pc.buffer - b.buffer_begin - sw.first);
      for (std::size_t e = 0; e < pc.count; ++e) {
        const float grad = to_float(g[e]) * scale;
        st[e] = from_float<State>(Policy::momentum_buffer(s, grad, to_float(st[e])));
        out[e] = Policy::blend(s, grad, to_float(st[e]));  // the stored momentum, as torch reads its buffer
      }
    }
    // 2. Every rank's part of the bucket (owned buckets: each matrix is its owner's alone).
    if (Ctx::is_sharded && o.comm_.size() > 1 && !b.owned())
      o.comm_.all_gather(std::span<const float>(stage_.data() + b.shard_begin(o.plan_.rank()), b.shard_elems),
                         std::span<float>(stage_.data(), b.padded()));
    // 3. NS of each matrix this rank holds part of, applied to its elements.
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      const piece_range mine = o.plan_.pieces_of(i);
      if (!o.states_at_.whole_matrix(i) || mine.empty()) continue;
      const tensor_slot& t = tensors[i];
      const auto& h = o.groups_[static_cast<std::size_t>(t.group)];
      const auto& s = sc[static_cast<std::size_t>(t.group)];
      const whole_matrix w = gather_tp(o, t, stage_.data() + (o.plan_.tensor_buffer(i) - b.buffer_begin - sw.first));
      update_.resize(static_cast<std::size_t>(w.m * w.n));
      ortho_.run(h, w.values, w.m, w.n, update_.data(),
                 [&o](std::size_t count, const auto& f) { o.exec_.parallel_for(count, f); });
      const float neg_lr = static_cast<float>(-Policy::adjusted_lr(h, w.m, w.n));
      for (std::size_t c = mine.first; c < mine.end; ++c) {
        const shard_piece& pc = pieces[c];
        const std::size_t first = pc.layout - t.offset;  // in this TP rank's part
        typename Ctx::param_type* p = o.params_.data() + o.param_at(pc);
        float* m = o.uses_master() ? o.master_.data() + pc.local : nullptr;
        for (std::size_t e = 0; e < pc.count; ++e) {
          float value = Mode == param_mode::master ? m[e] : to_float(p[e]);
          Policy::apply(s, value, update_[w.index_of(first + e)], neg_lr);
          store_param<Mode>(p, m, e, value, key, pc.layout);
        }
      }
    }
  }

  /// A whole matrix (m x n, row-major) and where element l of this TP rank's part is in it.
  struct whole_matrix {
    const float* values;
    std::int64_t m, n;
    tp_split split;
    std::int64_t part_rows, part_cols, part;  // this rank's part: its shape and TP index
    std::size_t index_of(std::size_t l) const {
      const auto li = static_cast<std::int64_t>(l);
      if (split == tp_split::rows) return static_cast<std::size_t>(part * part_rows * n + li);
      if (split == tp_split::cols)
        return static_cast<std::size_t>((li / part_cols) * n + part * part_cols + li % part_cols);
      return l;
    }
  };

  /// Tensor `t`'s matrix: `local` (this TP rank's part) itself, or, for a matrix split over
  /// a TP group of T > 1 ranks, the T parts all-gathered and put in place.
  template <class Ctx>
  whole_matrix gather_tp(Ctx& o, const tensor_slot& t, const float* local) {
    const std::int64_t pm = t.shape[0], pn = t.shape[1];
    const int tp = t.tp != tp_split::none && o.tp_ ? o.tp_->size() : 1;
    if (tp == 1) return {local, pm, pn, tp_split::none, pm, pn, 0};
    const std::int64_t m = t.tp == tp_split::rows ? pm * tp : pm, n = t.tp == tp_split::cols ? pn * tp : pn;
    orthogonalizer_type::check_shape(t.name, m, n);
    parts_.resize(t.numel * static_cast<std::size_t>(tp));
    o.tp_->all_gather(std::span<const float>(local, t.numel), std::span<float>(parts_));
    whole_matrix w{parts_.data(), m, n, t.tp, pm, pn, o.tp_->rank()};
    if (t.tp == tp_split::cols) {  // part p holds columns [p pn, (p + 1) pn) of every row
      whole_.resize(parts_.size());
      for (int p = 0; p < tp; ++p)
        for (std::int64_t r = 0; r < pm; ++r)
          std::copy_n(parts_.data() + static_cast<std::size_t>(p) * t.numel + static_cast<std::size_t>(r * pn), pn,
                      whole_.data() + r * n + p * pn);
      w.values = whole_.data();
    }
    return w;
  }

  std::size_t stage_elems_ = 0, work_bytes_ = 0;  // for the memory report
  std::vector<float> stage_;   // one bucket: the matrices NS takes
  std::vector<float> update_;  // one matrix's orthogonalised update
  std::vector<float> parts_, whole_;  // a TP-split matrix's parts, gathered; its columns in place
  orthogonalizer_type ortho_;
};

/// Marks the orthogonalisation stage as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct stage_included<Policy, orthogonal_stage_tag> : std::true_type {};

}  // namespace distopt::detail
