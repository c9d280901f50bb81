// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The layer-wise stage of distopt::optimizer (Lamb, Adafactor, CAME and any policy
/// that declares phases): statistics per tensor, row and column, summed exactly over
/// threads, DP shards and TP ranks. The policy headers that need it include it; an
/// element-wise optimizer never parses it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../comm/axis.hpp"
#include "../detail/buffer.hpp"
#include "../detail/fixed_sum.hpp"
#include "../detail/layer_loop.hpp"
#include "../detail/shard_plan.hpp"
#include "../detail/update_loop.hpp"
#include "../exec/transfer.hpp"
#include "../layerwise.hpp"
#include "../layout/registry.hpp"
#include "../memory_report.hpp"
#include "../shard_view.hpp"
#include "../step_info.hpp"
#include "../types/rounding.hpp"
#include "collectives.hpp"
#include "elementwise.hpp"
#include "layer_phases.hpp"
#include "layerwise_items.hpp"
#include "phases.hpp"
#include "schedule.hpp"
#include "stages.hpp"

namespace distopt::detail {

/// The layer-wise stage of an optimizer<Policy, ...> with states of type State on executor
/// Exec; its functions take the step's context. Each phase is one element pass over the
/// work items (engine/layerwise_items.hpp: layer_phase_body, on every executor), the
/// items' exact sums merged per tensor (layer_merge_phase), reduced over the DP ranks a
/// tensor is cut across and over the TP group, then the policy's hooks on the host, per
/// tensor, on the row and column states and the values the next pass reads.
template <class Policy, class State, class Exec>
struct layer_stage {
  static constexpr bool on_device = !host_memory<Exec>;
  /// (engine/layerwise_items.hpp)
  static constexpr std::size_t parallel_merge_sums = layer_items<Policy, State, Exec>::parallel_merge_sums;

  /// How the statistics wires (host memory) are summed over a group: the context's
  /// comm_adapter, which stages them through device memory for a device communicator.
  template <class Ctx>
  static auto host_reduce(Ctx& o) {
    return [&o](typename Ctx::comm_type& c, std::span<double> v) { o.comms_.all_reduce_host(o.exec_, c, v, reduce_op::sum); };
  }

  static constexpr int layer_phases() { return static_cast<int>(Policy::phases.size()); }

  /// The tensors' slots (packed: slot k holds the pieces of the tensors that keep it),
  /// factored states and work items.
  template <class Ctx>
  void init(Ctx& o) {
    const auto tensors = o.layout_.tensors();
    lt_.assign(tensors.size(), layer_tensor{});
    const auto& pieces = o.plan_.pieces();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const piece_range r = o.plan_.pieces_of(i);
      layer_tensor& t = lt_[i];
      t.local = !r.empty();
      t.first_piece = r.first;
      t.end_piece = r.end;
      t.straddles = o.plan_.straddles(i);
      const typename Policy::hyper_params& h = o.groups_[static_cast<std::size_t>(tensors[i].group)];
      t.factored = Policy::factored(h, tensors[i].shape);
      for (int k = 0; k < Policy::max_state_slots; ++k)
        if (k < o.slots_ && Policy::uses_slot(h, k, t.factored)) t.slot_mask |= 1u << k;
      if (t.factored && factored_set_of<Policy>(t.slot_mask) < 0) {
        std::string kept;
        for (int k = 0; k < Policy::max_state_slots; ++k)
          if ((t.slot_mask >> k) & 1u) kept += (kept.empty() ? "" : ", ") + std::to_string(k);
        throw std::logic_error(std::string(Policy::name) + ": tensor '" + tensors[i].name +
                               "' is factored and keeps the state slots {" + kept +
                               "}, which no set of the policy's factored_slots holds");
      }
      if (t.local && t.factored) {
        const auto& shape = tensors[i].shape;
        t.cols = static_cast<std::size_t>(shape.back());
        t.rows = static_cast<std::size_t>(shape[shape.size() - 2]);
        t.matrices = tensors[i].numel / (t.rows * t.cols);
      }
      if (!t.local) continue;
      const std::size_t rows = t.matrices * t.rows, cols = t.matrices * t.cols;
      t.row_state.assign(static_cast<std::size_t>(Policy::row_states) * rows, 0.0f);
      t.col_state.assign(static_cast<std::size_t>(Policy::col_states) * cols, 0.0f);
      t.totals.assign(t.matrices * static_cast<std::size_t>(Policy::row_states), 0.0);
    }
    std::array<std::size_t, 4> size{};
    for (std::size_t c = 0; c < pieces.size(); ++c)
      for (int k = 0; k < Policy::max_state_slots; ++k)
        if ((lt_[pieces[c].tensor].slot_mask >> k) & 1u) {
          o.states_at_.place(c, k, state_home::slot, size[static_cast<std::size_t>(k)], pieces[c].count);
          size[static_cast<std::size_t>(k)] += pieces[c].count;
        }
    for (int k = 0; k < o.slots_; ++k)
      o.states_[k] = buffer<State, typename Ctx::executor_type>(o.exec_, size[static_cast<std::size_t>(k)]);
    items_.init(o, lt_);
    init_geometry(o);
  }

  /// The global counts and TP axes of each tensor (again when a TP group is set).
  template <class Ctx>
  void init_geometry(Ctx& o) {
    const auto tensors = o.layout_.tensors();
    const std::size_t tp = o.tp_ ? static_cast<std::size_t>(o.tp_->size()) : 1;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      layer_tensor& t = lt_[i];
      const tp_split split = tensors[i].tp;
      t.tp_split = tp > 1 && split != tp_split::none;
      t.tp_rows = t.tp_split && t.factored && split == tp_split::rows && tensors[i].shape.size() == 2;
      t.tp_cols = t.tp_split && t.factored && split == tp_split::cols;
      tensor_stats& v = t.view;
      v.factored = t.factored;
      v.numel = tensors[i].numel * (t.tp_split ? tp : 1);
      v.matrices = t.matrices;
      v.local_rows = t.rows;
      v.local_cols = t.cols;
      v.rows = t.rows * (t.tp_rows ? tp : 1);
      v.cols = t.cols * (t.tp_cols ? tp : 1);
      v.group = tensors[i].group;
      const std::size_t r = t.matrices * t.rows, c = t.matrices * t.cols;
      for (int k = 0; k < Policy::row_states; ++k)
        v.row_state[k] = std::span<float>(t.row_state).subspan(static_cast<std::size_t>(k) * r, r);
      for (int k = 0; k < Policy::col_states; ++k)
        v.col_state[k] = std::span<float>(t.col_state).subspan(static_cast<std::size_t>(k) * c, c);
      for (int k = 0; k < Policy::row_values; ++k)
        v.row_values[k] = std::span<float>(t.row_values).subspan(static_cast<std::size_t>(k) * r, r);
      for (int k = 0; k < Policy::col_values; ++k)
        v.col_values[k] = std::span<float>(t.col_values).subspan(static_cast<std::size_t>(k) * c, c);
      for (int k = 0; k < Policy::row_states; ++k)
        v.row_state_total[k] = std::span<const double>(t.totals).subspan(static_cast<std::size_t>(k) * t.matrices, t.matrices);
      v.values = t.values;
    }
  }

  template <class Ctx>
  std::span<const float> factor_state(const Ctx& o, std::string_view name, int k, int count, bool rows) const {
    if (k < 0 || k >= count)
      throw std::out_of_range(std::string(Policy::name) + ": " + (rows ? "row" : "column") + " state " +
                              std::to_string(k) + " does not exist (" + std::to_string(count) + ")");
    const layer_tensor& t = lt_[o.index_of(name)];
    return rows ? std::span<const float>(t.view.row_state[k]) : std::span<const float>(t.view.col_state[k]);
  }

  /// A layer-wise policy's prepare runs on the host (engine/decide.hpp).
  static constexpr bool prepares_on_executor = false;
  /// Bytes of statistics this rank has put into all-reduces so far.
  std::size_t statistics_bytes() const noexcept { return stat_bytes_; }

  /// This rank's part of state slot `k` of tensor `i`, decoded to fp32.
  template <class Ctx>
  shard_values local_values(const Ctx& o, std::size_t i, int k) const {
    return element_values(o, i, k);
  }

  /// The step as decided (engine/decide.hpp): every phase in turn, with the host's copies
  /// of the decision and the group scalars (the hooks run on the host).
  template <class Ctx>
  void run(Ctx& o) {
    o.with_reduced_grads([&](const auto* grads) {
      step_inputs<Policy, std::remove_cvref_t<decltype(*grads)>> in;
      std::vector<typename Policy::scalars> sc;
      if (!step_inputs_of(o, grads, true, in, sc)) return;
      wait_pending(o);  // every bucket's reduction: phase 0 reads all of them
      [&]<int... P>(std::integer_sequence<int, P...>) {
        ((o.uses_master() ? layer_phase<P, mode_for<typename Ctx::param_type>(true)>(o, sc, grads, in.grad_scale, in.key)
                          : layer_phase<P, mode_for<typename Ctx::param_type>(false)>(o, sc, grads, in.grad_scale, in.key)),
         ...);
      }(std::make_integer_sequence<int, layer_phases()>{});
    });
  }

  /// One phase: the element pass over this rank's items, the exact sums merged per tensor,
  /// reduced over the DP ranks sharing each tensor and over the TP group, then the
  /// policy's host hooks for every tensor this rank holds part of.
  template <int P, param_mode Mode, class Ctx, class G>
  void layer_phase(Ctx& o, const std::vector<typename Policy::scalars>& sc, const G* grads, float grad_scale,
                   std::uint64_t key) {
    constexpr phase_spec spec = Policy::phases[P];
    items_.push_values(o);
    const typename Policy::scalars* sc_exec = o.step_scalars_.data();  // prepared there (engine/decide.hpp)
    const auto run = [&](std::size_t begin, std::size_t end) {
      items_.template run<P, Mode>(o, sc_exec, grads, grad_scale, key, begin, end);
    };
    if constexpr (P + 1 == layer_phases()) {
      // Bucket by bucket, each bucket's gather started after its items (a device runs every
      // bucket's items in one launch: a launch per bucket ran 13 grids of about 257 blocks
      // for 60 M params on an H200, each at 17 % of its DRAM bandwidth, ncu, 2026-11-28).
      run_buckets(o, true, [&](std::size_t first, std::size_t end) {
        run(items_.bucket_items_[first], items_.bucket_items_[end]);
      });
    } else {
      run(0, items_.size());
    }
    if constexpr (spec.tensor_sums + spec.row_sums + spec.col_sums > 0) reduce_layer_sums<P>(o);
    // The policy's hooks: on one thread, in tensor order (a policy may keep a record).
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor& t = lt_[i];
      if (!t.local) continue;
      const auto& h = o.groups_[static_cast<std::size_t>(o.layout_.tensors()[i].group)];
      const auto& s = sc[static_cast<std::size_t>(o.layout_.tensors()[i].group)];
      if constexpr (requires { Policy::template update_factors<P>(h, s, t.view); })
        Policy::template update_factors<P>(h, s, t.view);
    }
    if constexpr (spec.row_state_totals && Policy::row_states > 0) row_state_totals(o);
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor& t = lt_[i];
      if (!t.local) continue;
      const std::size_t g = static_cast<std::size_t>(o.layout_.tensors()[i].group);
      Policy::template finish<P>(o.groups_[g], sc[g], t.view);
    }
  }

  /// Merges the items' sums per tensor (layer_items::merge), all-reduces them (DP: the
  /// tensors cut over ranks; TP: the split tensors, along the split axis only) and
  /// converts them to double. Without a wire the merge's doubles are the values.
  template <int P, class Ctx>
  void reduce_layer_sums(Ctx& o) {
    constexpr phase_spec spec = Policy::phases[P];
    constexpr std::size_t W = fixed_sum::wire_size;
    const bool dp_wire = Ctx::is_sharded && o.comm_.size() > 1, tp_wire = o.tp_ && o.tp_->size() > 1;
    const bool exact = dp_wire || tp_wire;  // a wire carries the exact sums
    // This phase's sums of tensor t: tensor sums, row sums, column sums.
    const auto counts = [&](const layer_tensor& t) {
      return std::array<std::size_t, 3>{static_cast<std::size_t>(spec.tensor_sums),
                                        t.factored ? static_cast<std::size_t>(spec.row_sums) * t.matrices * t.rows : 0,
                                        t.factored ? static_cast<std::size_t>(spec.col_sums) * t.matrices * t.cols : 0};
    };
    const void* merged = items_.template merge<P>(o, exact);
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor& t = lt_[i];
      const std::size_t at = items_.tdescs_[i].out_at[P];
      const auto [nt, nr, nc] = counts(t);
      if (exact) {
        const fixed_sum* from = static_cast<const fixed_sum*>(merged) + at;
        t.tsum.assign(from, from + nt);
        t.rsum.assign(from + nt, from + nt + nr);
        t.csum.assign(from + nt + nr, from + nt + nr + nc);
      } else {
        const double* from = static_cast<const double*>(merged) + at;
        t.tsum_d.assign(from, from + nt);
        t.rsum_d.assign(from + nt, from + nt + nr);
        t.csum_d.assign(from + nt + nr, from + nt + nr + nc);
      }
    }
    // Which sums travel where: the same list, in layout order, on every rank of the group.
    const auto for_each_sum = [&](auto&& select, auto&& f) {
      for (layer_tensor& t : lt_) {
        bool tensor = false, rows = false, cols = false;
        select(t, tensor, rows, cols);
        if (tensor) for (detail::fixed_sum& x : t.tsum) f(x);
        if (rows) for (detail::fixed_sum& x : t.rsum) f(x);
        if (cols) for (detail::fixed_sum& x : t.csum) f(x);
      }
    };
    const auto pack = [&](auto& wire, auto&& select) {
      std::size_t n = 0;
      for_each_sum(select, [&](detail::fixed_sum&) { ++n; });
      wire.values.assign(n * W, 0.0);
      n = 0;
      for_each_sum(select, [&](detail::fixed_sum& f) { f.to_wire(wire.values.data() + W * n++); });
    };
    const auto unpack = [&](auto& wire, auto&& select) {
      std::size_t n = 0;
      for_each_sum(select, [&](detail::fixed_sum& f) { f = detail::fixed_sum::from_wire(wire.values.data() + W * n++); });
    };
    // DP: tensors whose elements several ranks hold. Every rank packs every such tensor
    // (zeros where it holds none), so the lists agree; sizes come from the layout.
    if (dp_wire) {
      const auto dp_select = [&](const layer_tensor& t, bool& tensor, bool& rows, bool& cols) {
        tensor = rows = cols = t.straddles;
      };
      ensure_sizes_for_wire<P>(o);
      stat_wire<dp_axis> wire;
      pack(wire, dp_select);
      axis_group<typename Ctx::comm_type, dp_axis> dp{&o.comm_};
      stat_bytes_ += wire.values.size() * sizeof(double);
      all_reduce_stats(dp, wire, host_reduce(o));
      unpack(wire, dp_select);
    }
    if (tp_wire) {
      const auto tp_select = [&](const layer_tensor& t, bool& tensor, bool& rows, bool& cols) {
        tensor = t.tp_split;
        rows = t.tp_cols;  // a row sums over columns, which the TP ranks split
        cols = t.tp_rows;
      };
      stat_wire<tp_axis> wire;
      pack(wire, tp_select);
      axis_group<typename Ctx::comm_type, tp_axis> tp{&*o.tp_};
      stat_bytes_ += wire.values.size() * sizeof(double);
      all_reduce_stats(tp, wire, host_reduce(o));
      unpack(wire, tp_select);
    }
    const auto finish = [&](std::size_t i) {
      layer_tensor& t = lt_[i];
      if (!t.local) return;
      const auto convert = [](const std::vector<fixed_sum>& from, std::vector<double>& out) {
        out.resize(from.size());
        for (std::size_t k = 0; k < from.size(); ++k) out[k] = from[k].value();
      };
      if (exact) {
        convert(t.tsum, t.tsum_d);
        convert(t.rsum, t.rsum_d);
        convert(t.csum, t.csum_d);
      }
      const std::size_t r = t.matrices * t.rows, c = t.matrices * t.cols;
      t.view.sums = t.tsum_d;
      for (int k = 0; k < 4; ++k) {
        t.view.row_sums[k] = k < spec.row_sums && t.factored ? std::span<const double>(t.rsum_d).subspan(k * r, r) : std::span<const double>();
        t.view.col_sums[k] = k < spec.col_sums && t.factored ? std::span<const double>(t.csum_d).subspan(k * c, c) : std::span<const double>();
      }
    };
    // The conversions on the executor's threads where there are many (host executors).
    if constexpr (!on_device)
      if (exact && items_.merged_count_[static_cast<std::size_t>(P)] >= parallel_merge_sums)
        return o.exec_.parallel_for(lt_.size(), finish);
    for (std::size_t i = 0; i < lt_.size(); ++i) finish(i);
  }

  /// Non-local tensors still take part in the DP wire with zeros: give them the right
  /// number of (empty) sums. Their geometry comes from the layout alone.
  template <int P, class Ctx>
  void ensure_sizes_for_wire(Ctx& o) {
    constexpr phase_spec spec = Policy::phases[P];
    const auto tensors = o.layout_.tensors();
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor& t = lt_[i];
      if (t.local || !t.straddles) continue;
      std::size_t matrices = 1, rows = 0, cols = 0;
      if (t.factored) {
        const auto& shape = tensors[i].shape;
        cols = static_cast<std::size_t>(shape.back());
        rows = static_cast<std::size_t>(shape[shape.size() - 2]);
        matrices = tensors[i].numel / (rows * cols);
      }
      t.tsum.assign(static_cast<std::size_t>(spec.tensor_sums), {});
      t.rsum.assign(static_cast<std::size_t>(spec.row_sums) * matrices * rows, {});
      t.csum.assign(static_cast<std::size_t>(spec.col_sums) * matrices * cols, {});
    }
  }

  /// Per matrix, the exact sum over its rows of every row state, over the TP group when
  /// the rows are split.
  template <class Ctx>
  void row_state_totals(Ctx& o) {
    constexpr std::size_t W = detail::fixed_sum::wire_size;
    std::vector<std::vector<detail::fixed_sum>> sums(lt_.size());
    stat_wire<tp_axis> wire;
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor& t = lt_[i];
      if (!t.local || !t.factored) continue;
      sums[i].assign(static_cast<std::size_t>(Policy::row_states) * t.matrices, {});
      for (int k = 0; k < Policy::row_states; ++k)
        for (std::size_t b = 0; b < t.matrices; ++b)
          for (std::size_t r = 0; r < t.rows; ++r)
            sums[i][static_cast<std::size_t>(k) * t.matrices + b].add(t.view.row_state[k][b * t.rows + r]);
      if (t.tp_rows)
        for (const detail::fixed_sum& f : sums[i]) {
          wire.values.resize(wire.values.size() + W);
          f.to_wire(wire.values.data() + wire.values.size() - W);
        }
    }
    if (o.tp_ && !wire.values.empty()) {
      axis_group<typename Ctx::comm_type, tp_axis> tp{&*o.tp_};
      stat_bytes_ += wire.values.size() * sizeof(double);
      all_reduce_stats(tp, wire, host_reduce(o));
      std::size_t n = 0;
      for (std::size_t i = 0; i < lt_.size(); ++i)
        if (lt_[i].local && lt_[i].tp_rows)
          for (detail::fixed_sum& f : sums[i]) f = detail::fixed_sum::from_wire(wire.values.data() + W * n++);
    }
    for (std::size_t i = 0; i < lt_.size(); ++i)
      for (std::size_t k = 0; k < sums[i].size(); ++k) lt_[i].totals[k] = sums[i][k].value();
  }

  /// set_hyper: the new hyper-parameters of group `g` must not need a slot a tensor lacks.
  template <class Ctx>
  void check_hyper(const Ctx& o, int g, const typename Policy::hyper_params& h) const {
    const auto tensors = o.layout_.tensors();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].group != g) continue;
      for (int k = 0; k < Policy::max_state_slots; ++k)
        if (k < Policy::state_slots(h) && Policy::uses_slot(h, k, lt_[i].factored) && !((lt_[i].slot_mask >> k) & 1u))
          throw std::invalid_argument(std::string(Policy::name) + ": these hyper-parameters need state slot " +
                                      std::to_string(k) + " for '" + tensors[i].name + "', which was not allocated");
    }
  }

  /// Memory report (besides the state slots, engine/memory.hpp): the factored row and
  /// column states every rank holding part of a factored tensor keeps whole, the
  /// statistics, and the items' work.
  template <class Ctx>
  void add_memory(const Ctx&, memory_report& r) const {
    std::size_t rows = 0, cols = 0, stats = 0;
    for (const auto& t : lt_) {
      rows += t.row_state.size() * sizeof(float);
      cols += t.col_state.size() * sizeof(float);
      stats += (t.row_values.size() + t.col_values.size() + t.values.size()) * sizeof(float);
    }
    if (rows) r.entries.push_back({"state rows", rows});
    if (cols) r.entries.push_back({"state cols", cols});
    r.entries.push_back({"statistics", stats});
    // The items' sums and column windows, the tables (and on a device the statistics' copy).
    r.entries.push_back({"statistics (work)", items_.work_bytes()});
    if constexpr (on_device)  // their host copies
      r.entries.push_back({"statistics (host staging)", items_.host_bytes()});
  }

  std::vector<layer_tensor> lt_;
  layer_items<Policy, State, Exec> items_;
  std::size_t stat_bytes_ = 0;  // statistics put on the wire so far
};

/// Marks the layer-wise stage as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct stage_included<Policy, layer_stage_tag> : std::true_type {};

}  // namespace distopt::detail
