// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The layer-wise stage's work items (engine/layerwise.hpp) and what their element
/// passes and merges read and write, on every executor: the item table (runs of one
/// tensor's pieces, engine/layer_phases.hpp), each item's exact sums, column windows and
/// scratch, the statistics the element functions read, and each tensor's merged sums. On a
/// host executor they are host memory, the element pass runs layer_phase_body on its
/// threads and the merge layer_merge_phase; a device runs the same phases (cuda: kernels of
/// their own), and the host copies what it reads.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../concepts.hpp"
#include "../detail/buffer.hpp"
#include "../detail/fixed_sum.hpp"
#include "../detail/layer_loop.hpp"
#include "../detail/shard_plan.hpp"
#include "../exec/transfer.hpp"
#include "../layerwise.hpp"
#include "layer_phases.hpp"
#include "phases.hpp"
#include "state_layout.hpp"

namespace distopt::detail {

/// One tensor of the layout as the layer-wise step sees it.
struct layer_tensor {
  bool local = false;       // this rank holds part of it
  bool factored = false;
  bool straddles = false;   // its elements lie in more than one DP rank's shard
  bool tp_split = false;    // split over the TP group (any axis)
  bool tp_rows = false;     // its matrices' rows are split over TP (column sums need TP)
  bool tp_cols = false;     // its matrices' columns are split over TP (row sums need TP)
  unsigned slot_mask = 0;   // state slots kept for it
  std::size_t matrices = 1, rows = 0, cols = 0;  // local geometry of a factored tensor
  std::size_t first_piece = 0, end_piece = 0;
  std::vector<float> row_state, col_state;
  std::span<float> row_values, col_values, values;  // in the items' statistics (layer_items::stats_)
  std::vector<fixed_sum> tsum, rsum, csum;          // this phase, merged over items, where a wire carries them
  std::vector<double> tsum_d, rsum_d, csum_d, totals;
  tensor_stats view;
};

/// The work items of a layer-wise step, and their buffers.
template <class Policy, class State, class Exec>
struct layer_items {
  static constexpr bool on_device = !host_memory<Exec>;
  static constexpr int phases = static_cast<int>(Policy::phases.size());
  /// Device executors: the fewest matrix rows of a factored tensor in one work item. The
  /// CUDA kernel runs a thread block per item: 256 rows left most of an H200 idle (ncu,
  /// 2026-11-28: 192 blocks for 60 M params, 17 % of the warps active); each item keeps exact
  /// column sums of 88 B, about 1.4 B per element at 64 rows.
  static constexpr std::size_t device_item_rows = 64;
  /// Host executors: the same floor, higher. Items are 2 per thread per tensor for balance,
  /// but each keeps exact sums of its matrices' columns, merged per tensor after the pass:
  /// at 16 threads on a 1024-row matrix that was 32 items of 32 rows, 2.75 B of sums per
  /// element and column statistic, zeroed and merged every phase. At 256 rows, 0.34 B.
  static constexpr std::size_t host_item_rows = 256;
  /// Host executors: the fewest of a phase's merged sums that are merged on the executor's
  /// threads; fewer (Lamb's two per tensor: a few microseconds on one thread) are not worth
  /// waking the pool for.
  static constexpr std::size_t parallel_merge_sums = 16384;
  static_assert(phases <= 4, "distopt: the layer-wise items keep sums for up to 4 phases");

  /// Cuts each tensor this rank holds part of into items, and lays out their sums, column
  /// windows, scratch and statistics. `lt`: the tensors, their geometry and slots set.
  template <class Ctx>
  void init(Ctx& o, std::vector<layer_tensor>& lt) {
    const auto tensors = o.layout_.tensors();
    const auto& pieces = o.plan_.pieces();
    int max_cs = 0;
    unsigned touched = 0;  // the slots any phase reads or writes
    for (const phase_spec& ph : Policy::phases) {
      max_cs = std::max(max_cs, ph.col_sums);
      touched |= ph.reads_slots | ph.writes_slots;
    }
    // The statistics the element functions read: each tensor's values, row values and
    // column values, one array that the hooks write and a device reads a copy of.
    stat_at_.assign(lt.size(), 0);
    std::size_t stats = 0;
    for (std::size_t i = 0; i < lt.size(); ++i) {
      const layer_tensor& t = lt[i];
      stat_at_[i] = stats;
      if (t.local)
        stats += static_cast<std::size_t>(Policy::tensor_values) +
                 (static_cast<std::size_t>(Policy::row_values) * t.rows + static_cast<std::size_t>(Policy::col_values) * t.cols) * t.matrices;
    }
    stats_.assign(stats, 0.0f);
    for (std::size_t i = 0; i < lt.size(); ++i) {
      layer_tensor& t = lt[i];
      if (!t.local) continue;
      const std::size_t r = static_cast<std::size_t>(Policy::row_values) * t.matrices * t.rows;
      const std::size_t c = static_cast<std::size_t>(Policy::col_values) * t.matrices * t.cols;
      float* at = stats_.data() + stat_at_[i];
      t.values = std::span<float>(at, static_cast<std::size_t>(Policy::tensor_values));
      t.row_values = std::span<float>(at + Policy::tensor_values, r);
      t.col_values = std::span<float>(at + Policy::tensor_values + r, c);
    }
    // The items: at most 2 per thread per tensor, so that column accumulators stay small.
    const std::size_t threads = static_cast<std::size_t>(o.exec_.concurrency());
    std::size_t cols = 0, scratch = 0;
    phase_sums_.assign(static_cast<std::size_t>(phases), 0);
    for (std::size_t i = 0; i < lt.size(); ++i) {
      const layer_tensor& t = lt[i];
      if (!t.local) continue;
      const std::size_t n = t.end_piece - t.first_piece;
      std::size_t per_item = std::max<std::size_t>(1, (n + 2 * threads - 1) / (2 * threads));
      if (t.factored) {
        // Each item keeps exact sums of its matrices' columns (88 B each): items of at
        // least item_rows rows keep them near 88 * col_sums / item_rows B per element (more
        // when a matrix has fewer rows).
        std::size_t local = 0;
        for (std::size_t c = t.first_piece; c < t.end_piece; ++c) local += pieces[c].count;
        const std::size_t want = (on_device ? device_item_rows : host_item_rows) * t.cols;
        per_item = std::max(per_item, local ? (n * want + local - 1) / local : n);
      }
      // Host executors: a slot the tensor does not keep and its loop touches is written to
      // the item's scratch (factored tensors' loops leave out the slots outside their set).
      const unsigned loop_slots = t.factored ? factored_slot_sets<Policy>()[static_cast<std::size_t>(
                                                   std::max(0, factored_set_of<Policy>(t.slot_mask)))]
                                             : ~0u;
      const unsigned all_slots = (1u << Policy::max_state_slots) - 1;
      const bool needs_scratch = !on_device && (loop_slots & touched & all_slots & ~t.slot_mask) != 0;
      for (std::size_t a = t.first_piece; a < t.end_piece; a += per_item) {
        layer_item_desc d;
        d.piece_begin = a;
        d.piece_end = std::min(t.end_piece, a + per_item);
        if (t.factored) {
          const std::size_t first = pieces[a].layout - tensors[i].offset;
          const auto& last_piece = pieces[d.piece_end - 1];
          const std::size_t last = last_piece.layout + last_piece.count - 1 - tensors[i].offset;
          d.row_first = first / t.cols;
          d.row_count = last / t.cols - d.row_first + 1;
          d.col_first = first / (t.rows * t.cols) * t.cols;
          d.col_count = (last / (t.rows * t.cols) + 1) * t.cols - d.col_first;
        }
        d.tensor_offset = tensors[i].offset;
        d.cols = t.cols;
        d.matrix = t.rows * t.cols;
        d.rows_total = t.matrices * t.rows;
        d.cols_total = t.matrices * t.cols;
        d.values_at = stat_at_[i];
        d.slot_mask = t.slot_mask;
        d.factored = t.factored;
        d.cols_at = cols;
        cols += t.factored ? static_cast<std::size_t>(max_cs) * d.col_count : 0;
        if (t.factored) max_item_cols_ = std::max(max_item_cols_, d.col_count);
        for (int p = 0; p < phases; ++p) {
          const phase_spec& ph = Policy::phases[static_cast<std::size_t>(p)];
          std::size_t& at = phase_sums_[static_cast<std::size_t>(p)];
          d.sums_at[p] = at;
          at += static_cast<std::size_t>(ph.tensor_sums) +
                (t.factored ? static_cast<std::size_t>(ph.row_sums) * d.row_count + static_cast<std::size_t>(ph.col_sums) * d.col_count
                            : 0);
        }
        d.scratch_at = scratch;
        if (needs_scratch) {
          std::size_t most = 0;
          for (std::size_t c = d.piece_begin; c < d.piece_end; ++c) most = std::max(most, pieces[c].count);
          scratch += most;
        }
        descs_.push_back(d);
        item_tensor_.push_back(i);
      }
    }
    // Each tensor's items (consecutive: made tensor by tensor), and each bucket's (a bucket
    // is a run of whole tensors, so its items start at its first tensor's).
    tensor_items_.assign(lt.size() + 1, descs_.size());
    for (std::size_t j = descs_.size(); j-- > 0;) tensor_items_[item_tensor_[j]] = j;
    for (std::size_t i = lt.size(); i-- > 0;) tensor_items_[i] = std::min(tensor_items_[i], tensor_items_[i + 1]);
    bucket_items_.assign(o.plan_.buckets().size() + 1, descs_.size());
    for (std::size_t k = 0; k < o.plan_.buckets().size(); ++k)
      bucket_items_[k] = tensor_items_[o.plan_.buckets()[k].first_tensor];
    // Each tensor's merged sums, per phase.
    tdescs_.assign(lt.size(), {});
    for (std::size_t i = 0; i < lt.size(); ++i) {
      layer_tensor_desc& d = tdescs_[i];
      d.first_item = tensor_items_[i];
      d.end_item = tensor_items_[i + 1];
      d.rows = lt[i].factored && lt[i].local ? lt[i].matrices * lt[i].rows : 0;
      d.cols = lt[i].factored && lt[i].local ? lt[i].matrices * lt[i].cols : 0;
    }
    merged_count_.assign(static_cast<std::size_t>(phases), 0);
    for (layer_tensor_desc& d : tdescs_)
      for (int p = 0; p < phases; ++p) {
        const phase_spec& ph = Policy::phases[static_cast<std::size_t>(p)];
        std::size_t& at = merged_count_[static_cast<std::size_t>(p)];
        d.out_at[p] = at;
        at += static_cast<std::size_t>(ph.tensor_sums) + static_cast<std::size_t>(ph.row_sums) * d.rows +
              static_cast<std::size_t>(ph.col_sums) * d.cols;
      }
    // What the phases read and write, in the executor's memory.
    items_x_ = o.in_exec(descs_, items_dev_);
    slots_x_ = o.in_exec(o.states_at_.offsets(), slots_dev_);
    std::vector<std::size_t> piece_item(pieces.size(), 0);
    for (std::size_t j = 0; j < descs_.size(); ++j)
      for (std::size_t c = descs_[j].piece_begin; c < descs_[j].piece_end; ++c) piece_item[c] = j;
    piece_item_ = std::move(piece_item);
    piece_item_x_ = o.in_exec(piece_item_, piece_item_dev_);
    tensors_x_ = o.in_exec(tdescs_, tensors_dev_);
    const std::size_t sums = *std::max_element(phase_sums_.begin(), phase_sums_.end());
    const std::size_t merged = *std::max_element(merged_count_.begin(), merged_count_.end());
    sums_ = buffer<fixed_sum, Exec>(o.exec_, sums);
    merged_ = buffer<fixed_sum, Exec>(o.exec_, merged);
    values_ = buffer<double, Exec>(o.exec_, merged);
    col_acc_ = buffer<double, Exec>(o.exec_, cols);
    col_count_ = cols;
    o.to_exec(std::vector<std::uint32_t>(cols * static_cast<std::size_t>(phases), column_window::unset), col_lo_);
    scratch_ = buffer<State, Exec>(o.exec_, scratch);
    if constexpr (on_device) {
      stats_dev_ = buffer<float, Exec>(o.exec_, stats);
      merged_host_.assign(merged, fixed_sum{});
      values_host_.assign(merged, 0.0);
    }
  }

  std::size_t size() const noexcept { return descs_.size(); }

  /// Phase P's element pass over items [begin, end): a launch of layer_phase_body (on cuda
  /// its own kernel, a thread block per item; on a host one call per item on its threads).
  template <int P, param_mode Mode, class Ctx, class G>
  void run(Ctx& o, const typename Policy::scalars* sc, const G* grads, float grad_scale, std::uint64_t key,
           std::size_t begin, std::size_t end) {
    layer_phase_body<Policy, P, Mode, typename Ctx::param_type, G, State, on_device> body;
    body.items = items_x_;
    body.first_item = begin;
    body.pieces = o.exec_pieces();
    body.slots = slots_x_;
    body.scalars = sc;
    body.params = o.params_.data();
    body.params_local = o.shards_params();
    body.grads = grads;
    body.grads_local = o.template grads_local<G>();
    body.master = o.uses_master() ? o.master_.data() : nullptr;
    for (int k = 0; k < o.slots_; ++k) body.state[k] = o.states_[k].data();
    body.grad_scale = grad_scale;
    body.key = key;
    body.block = o.layout_.block_size();
    body.stats = on_device ? stats_dev_.data() : stats_.data();
    body.sums = sums_.data();
    body.col_acc = col_acc_.data();
    body.col_lo = col_lo_.data() + static_cast<std::size_t>(P) * col_count_;
    body.max_cols = static_cast<std::size_t>(Policy::phases[P].col_sums) * max_item_cols_;
    body.piece_first = begin < end ? descs_[begin].piece_begin : 0;
    body.piece_count = begin < end ? descs_[end - 1].piece_end - body.piece_first : 0;
    body.piece_item = piece_item_x_;
    if constexpr (!on_device) {
      body.zeros = zero_states<State, Ctx::chunk_elems>();
      body.scratch = scratch_.data();
    }
    launch(o.exec_, end - begin, body);
  }

  /// Device executors: the statistics the hooks wrote, copied to the executor's memory
  /// before an element pass reads them (a host's element pass reads them in place).
  template <class Ctx>
  void push_values(Ctx& o) {
    if constexpr (on_device) copy_bytes(o.exec_, stats_dev_.data(), stats_.data(), stats_.size() * sizeof(float));
  }

  /// Merges phase P's item sums per tensor (layer_merge_phase), into their exact sums and
  /// their values; returns where the host reads them (`exact`: the sums, for a wire; else
  /// the values), at each tensor's tdescs_[i].out_at[P]. A device's are copied to the host.
  template <int P, class Ctx>
  const void* merge(Ctx& o, bool exact) {
    layer_merge_phase<Policy, P> m;
    m.tensors = tensors_x_;
    m.items = items_x_;
    m.item_sums = sums_.data();
    m.sums = merged_.data();
    m.values = values_.data();
    const std::size_t n = merged_count_[static_cast<std::size_t>(P)];
    if (on_device || n >= parallel_merge_sums) {
      launch(o.exec_, tdescs_.size(), m);
    } else {  // few sums: on this thread (the same sums: they are exact)
      for (std::size_t i = 0; i < tdescs_.size(); ++i) m(i, 0, m.size(i));
    }
    if constexpr (on_device) {
      if (exact) copy_bytes(o.exec_, merged_host_.data(), merged_.data(), n * sizeof(fixed_sum));
      else copy_bytes(o.exec_, values_host_.data(), values_.data(), n * sizeof(double));
      return exact ? static_cast<const void*>(merged_host_.data()) : static_cast<const void*>(values_host_.data());
    } else {
      return exact ? static_cast<const void*>(merged_.data()) : static_cast<const void*>(values_.data());
    }
  }

  /// Bytes of the items' work (sums, column windows, scratch, the tables) in the
  /// executor's memory, and of their host copies on a device.
  std::size_t work_bytes() const noexcept {
    return sums_.bytes() + merged_.bytes() + values_.bytes() + col_acc_.bytes() + col_lo_.bytes() + scratch_.bytes() +
           stats_dev_.bytes() + items_dev_.bytes() + slots_dev_.bytes() + tensors_dev_.bytes() + piece_item_dev_.bytes();
  }
  std::size_t host_bytes() const noexcept {
    return merged_host_.size() * sizeof(fixed_sum) + values_host_.size() * sizeof(double) +
           descs_.size() * sizeof(layer_item_desc) + tdescs_.size() * sizeof(layer_tensor_desc) +
           piece_item_.size() * sizeof(std::size_t);
  }

  std::vector<layer_item_desc> descs_;     // the items, tensor by tensor
  std::vector<std::size_t> item_tensor_;   // per item: its tensor
  std::vector<std::size_t> tensor_items_;  // items of tensor i: [i], [i + 1])
  std::vector<std::size_t> bucket_items_;  // items of bucket k: [k], [k + 1])
  std::vector<layer_tensor_desc> tdescs_;  // per tensor: its items and merged sums
  std::vector<std::size_t> piece_item_;    // per piece: its item
  std::vector<std::size_t> stat_at_;       // per tensor: its values in stats_
  std::vector<float> stats_;               // every tensor's values, row and column values (host)
  std::vector<std::size_t> phase_sums_;    // per phase: the fixed_sums of all items
  std::vector<std::size_t> merged_count_;  // per phase: the merged sums of all tensors
  std::size_t col_count_ = 0;              // column doubles of all items (one phase's window exponents)
  std::size_t max_item_cols_ = 0;          // the most columns of one factored item
  // In the executor's memory (the tables: host vectors on a host, their copies on a device).
  const layer_item_desc* items_x_ = nullptr;
  const slot_offsets* slots_x_ = nullptr;
  const std::size_t* piece_item_x_ = nullptr;
  const layer_tensor_desc* tensors_x_ = nullptr;
  buffer<layer_item_desc, Exec> items_dev_;
  buffer<slot_offsets, Exec> slots_dev_;
  buffer<std::size_t, Exec> piece_item_dev_;
  buffer<layer_tensor_desc, Exec> tensors_dev_;
  buffer<fixed_sum, Exec> sums_;      // each item's sums of a phase
  buffer<fixed_sum, Exec> merged_;    // each tensor's, merged
  buffer<double, Exec> values_;       // their values
  buffer<double, Exec> col_acc_;      // the items' column windows
  buffer<std::uint32_t, Exec> col_lo_;  // their exponents, per phase (kept from step to step)
  buffer<State, Exec> scratch_;       // host executors: what the slots a tensor does not keep write
  buffer<float, Exec> stats_dev_;     // device executors: stats_' copy
  std::vector<fixed_sum> merged_host_;  // device executors: the merged sums' host copy, where a wire needs them
  std::vector<double> values_host_;     // else their values'
};

}  // namespace distopt::detail
