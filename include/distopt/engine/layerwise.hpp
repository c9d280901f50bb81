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
#include "../detail/layer_phase.hpp"
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
#include "phases.hpp"
#include "schedule.hpp"
#include "stages.hpp"

namespace distopt::detail {

/// The layer-wise stage of an optimizer<Policy, ...> with states of type State on executor
/// Exec. Its functions take the step's context for the buffers, plan and groups. On a host executor the element pass is a host loop per work item, and the host
/// merges the items' sums. On a device executor it is a launch of layer_phase_body (on cuda
/// a kernel of its own), and a launch of layer_merge_phase merges the items' sums there and
/// converts them to double; the host copies the doubles, or the merged sums where a DP or TP
/// wire needs them. Either way the host reduces the sums over ranks and runs the policy's
/// hooks on the row and column states (host vectors), and on a device the values the
/// element functions read are copied back before the next launch.
template <class Policy, class State, class Exec>
struct layer_stage {
  static constexpr bool on_device = !host_memory<Exec>;
  /// Device executors: the fewest matrix rows of a factored tensor in one work item. The
  /// CUDA kernel runs a thread block per item: 256 rows left most of an H200 idle (ncu,
  /// 2026-11-28: 192 blocks for 60 M params, 17 % of the warps active); each item keeps exact
  /// column sums of 88 B, about 1.4 B per element at 64 rows.
  static constexpr std::size_t device_item_rows = 64;
  /// Host executors: the same floor, higher. Items are 2 per thread per tensor for balance,
  /// but each keeps exact sums of its matrices' columns and the host merges them: at 16
  /// threads on a 1024-row matrix that was 32 items of 32 rows, 2.75 B of sums per element
  /// and column statistic, zeroed and merged every phase. At 256 rows, 0.34 B.
  static constexpr std::size_t host_item_rows = 256;
  /// Host executors: the fewest of a phase's item sums (88 B each) that are merged per tensor
  /// on the executor's threads; fewer (Lamb's two per item: a few microseconds on one
  /// thread) are not worth waking the pool for.
  static constexpr std::size_t parallel_merge_sums = 16384;

  /// How the statistics wires (host memory) are summed over a group: the context's
  /// comm_adapter, which stages them through device memory for a device communicator.
  template <class Ctx>
  static auto host_reduce(Ctx& o) {
    return [&o](typename Ctx::comm_type& c, std::span<double> v) { o.comms_.all_reduce_host(o.exec_, c, v, reduce_op::sum); };
  }

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
    std::vector<float> row_state, col_state, row_values, col_values, values;
    std::vector<detail::fixed_sum> tsum, rsum, csum;  // this phase, merged over items
    std::vector<double> tsum_d, rsum_d, csum_d, totals;
    tensor_stats view;
  };
  /// A run of one tensor's pieces, with its own accumulators (merged exactly afterwards).
  struct layer_item {
    std::size_t tensor = 0, piece_begin = 0, piece_end = 0;
    std::size_t row_first = 0, row_count = 0, col_first = 0, col_count = 0;
    std::vector<detail::fixed_sum> tsum, rsum, csum;
    // The column windows in front of csum (layer_loop.hpp). Their exponents are kept per
    // phase from step to step: only a guess of where the next values lie.
    std::vector<double> cacc;
    std::array<std::vector<std::uint32_t>, static_cast<std::size_t>(Policy::phases.size())> clo;
    detail::column_window window;
  };

  static constexpr int layer_phases() { return static_cast<int>(Policy::phases.size()); }

  /// Allocates the compact state slots, the factored states and the work items.
  template <class Ctx>
  void init(Ctx& o) {
    const auto tensors = o.layout_.tensors();
    lt_.assign(tensors.size(), layer_tensor{});
    const auto& pieces = o.plan_.pieces();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const detail::piece_range r = o.plan_.pieces_of(i);
      lt_[i].local = !r.empty();
      lt_[i].first_piece = r.first;
      lt_[i].end_piece = r.end;
      lt_[i].straddles = o.plan_.straddles(i);
    }
    // Packed slot buffers: slot k holds the pieces of the tensors that keep it.
    std::array<std::size_t, 4> size{};
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const typename Policy::hyper_params& h = o.groups_[static_cast<std::size_t>(tensors[i].group)];
      lt_[i].factored = Policy::factored(h, tensors[i].shape);
      for (int k = 0; k < Policy::max_state_slots; ++k)
        if (k < o.slots_ && Policy::uses_slot(h, k, lt_[i].factored)) lt_[i].slot_mask |= 1u << k;
      if (lt_[i].factored && detail::factored_set_of<Policy>(lt_[i].slot_mask) < 0) {
        std::string kept;
        for (int k = 0; k < Policy::max_state_slots; ++k)
          if ((lt_[i].slot_mask >> k) & 1u) kept += (kept.empty() ? "" : ", ") + std::to_string(k);
        throw std::logic_error(std::string(Policy::name) + ": tensor '" + tensors[i].name +
                               "' is factored and keeps the state slots {" + kept +
                               "}, which no set of the policy's factored_slots holds");
      }
    }
    for (std::size_t c = 0; c < pieces.size(); ++c)
      for (int k = 0; k < Policy::max_state_slots; ++k)
        if ((lt_[pieces[c].tensor].slot_mask >> k) & 1u) {
          o.states_at_.place(c, k, state_home::slot, size[static_cast<std::size_t>(k)], pieces[c].count);
          size[static_cast<std::size_t>(k)] += pieces[c].count;
        }
    for (int k = 0; k < o.slots_; ++k)
      o.states_[k] = detail::buffer<State, typename Ctx::executor_type>(o.exec_, size[static_cast<std::size_t>(k)]);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      layer_tensor& t = lt_[i];
      if (!t.local) continue;
      const auto& shape = tensors[i].shape;
      if (t.factored) {
        t.cols = static_cast<std::size_t>(shape.back());
        t.rows = static_cast<std::size_t>(shape[shape.size() - 2]);
        t.matrices = tensors[i].numel / (t.rows * t.cols);
      }
      const std::size_t r = t.matrices * t.rows, c = t.matrices * t.cols;
      t.row_state.assign(static_cast<std::size_t>(Policy::row_states) * r, 0.0f);
      t.col_state.assign(static_cast<std::size_t>(Policy::col_states) * c, 0.0f);
      t.row_values.assign(static_cast<std::size_t>(Policy::row_values) * r, 0.0f);
      t.col_values.assign(static_cast<std::size_t>(Policy::col_values) * c, 0.0f);
      t.values.assign(static_cast<std::size_t>(Policy::tensor_values), 0.0f);
      t.totals.assign(t.matrices * static_cast<std::size_t>(Policy::row_states), 0.0);
      // Work items: at most 2 per thread per tensor, so that column accumulators stay small.
      const std::size_t n = t.end_piece - t.first_piece;
      std::size_t per_item = std::max<std::size_t>(1, (n + 2 * o.exec_.concurrency() - 1) / (2 * o.exec_.concurrency()));
      if (t.factored) {
        // Each item keeps exact sums of its matrices' columns (88 B each): items of at
        // least item_rows rows keep them near 88 * col_sums / item_rows B per element (more
        // when a matrix has fewer rows).
        std::size_t local = 0;
        for (std::size_t c = t.first_piece; c < t.end_piece; ++c) local += pieces[c].count;
        const std::size_t want = (on_device ? device_item_rows : host_item_rows) * t.cols;
        per_item = std::max(per_item, local ? (n * want + local - 1) / local : n);
      }
      for (std::size_t a = t.first_piece; a < t.end_piece; a += per_item) {
        layer_item it;
        it.tensor = i;
        it.piece_begin = a;
        it.piece_end = std::min(t.end_piece, a + per_item);
        if (t.factored) {
          const std::size_t first = pieces[a].layout - tensors[i].offset;
          const auto& last_piece = pieces[it.piece_end - 1];
          const std::size_t last = last_piece.layout + last_piece.count - 1 - tensors[i].offset;
          it.row_first = first / t.cols;
          it.row_count = last / t.cols - it.row_first + 1;
          it.col_first = first / (t.rows * t.cols) * t.cols;
          it.col_count = (last / (t.rows * t.cols) + 1) * t.cols - it.col_first;
        }
        items_.push_back(std::move(it));
      }
    }
    tensor_items_.assign(lt_.size() + 1, items_.size());
    for (std::size_t j = items_.size(); j-- > 0;) tensor_items_[items_[j].tensor] = j;
    for (std::size_t i = lt_.size(); i-- > 0;) tensor_items_[i] = std::min(tensor_items_[i], tensor_items_[i + 1]);
    if constexpr (on_device) init_device(o);
    // Items of each bucket, for the last phase's bucket-by-bucket all-gathers: a bucket is a
    // run of whole tensors, so its items start at its first tensor's.
    bucket_items_.assign(o.plan_.buckets().size() + 1, items_.size());
    for (std::size_t k = 0; k < o.plan_.buckets().size(); ++k)
      bucket_items_[k] = tensor_items_[o.plan_.buckets()[k].first_tensor];
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

  template <int P, detail::param_mode Mode, class Ctx, class G>
  void run_item(Ctx& o, const typename Policy::scalars& sc, const G* grads, float grad_scale, std::uint64_t key,
                layer_item& it) {
    const layer_tensor& t = lt_[it.tensor];
    const tensor_slot& ts = o.layout_.tensors()[it.tensor];
    const bool local = o.template grads_local<G>();
    {  // this phase's sums of the item, zeroed by the thread that fills them
      constexpr phase_spec spec = Policy::phases[P];
      it.tsum.assign(static_cast<std::size_t>(spec.tensor_sums), {});
      it.rsum.assign(t.factored ? static_cast<std::size_t>(spec.row_sums) * it.row_count : 0, {});
      it.csum.assign(t.factored ? static_cast<std::size_t>(spec.col_sums) * it.col_count : 0, {});
      it.cacc.assign(it.csum.size(), 0.0);
      std::vector<std::uint32_t>& lo = it.clo[static_cast<std::size_t>(P)];
      if (lo.size() != it.csum.size()) lo.assign(it.csum.size(), detail::column_window::unset);
      it.window = {it.cacc.data(), lo.data(), 0, detail::column_window::none, detail::column_window::none};
    }
    const auto& pieces = o.plan_.pieces();
    for (std::size_t c = it.piece_begin; c < it.piece_end; ++c) {
      const detail::shard_piece& pc = pieces[c];
      detail::layer_args<typename Ctx::param_type, G, State> a{};
      a.param = o.params_.data() + o.param_at(pc);
      a.grad = grads + (local ? pc.local : pc.buffer);
      a.master = o.uses_master() ? o.master_.data() + pc.local : nullptr;
      // Slots this tensor does not keep: read zeros, write to this thread's scratch (unless
      // the loop leaves them out: a factored tensor's slots outside its set).
      thread_local std::vector<State> scratch;
      if (t.slot_mask != (1u << Policy::max_state_slots) - 1 && scratch.size() < pc.count) scratch.resize(pc.count);
      for (int k = 0; k < Policy::max_state_slots; ++k) {
        const bool kept = (t.slot_mask >> k) & 1u;
        a.state_out[k] = kept ? o.states_[k].data() + o.states_at_.offset(c, k) : scratch.data();
        a.state_in[k] = kept ? a.state_out[k] : detail::zero_states<State, Ctx::chunk_elems>();
      }
      a.grad_scale = grad_scale;
      a.random_key = key;
      a.random_base = pc.layout;
      a.first = pc.layout - ts.offset;
      a.cols = t.cols;
      a.matrix = t.rows * t.cols;
      a.block = o.layout_.block_size();
      a.tensor_values = t.values.data();
      for (int k = 0; k < Policy::row_values; ++k) a.row_values[k] = t.view.row_values[k].data();
      for (int k = 0; k < Policy::col_values; ++k) a.col_values[k] = t.view.col_values[k].data();
      a.tensor_sums = it.tsum.data();
      a.row_sums = it.rsum.data();
      a.col_sums = it.csum.data();
      a.window = &it.window;
      a.row_first = it.row_first;
      a.row_count = it.row_count;
      a.col_first = it.col_first;
      a.col_count = it.col_count;
      if (t.factored) factored_range<P, Mode>(t.slot_mask, sc, a, pc.count);
      else detail::layer_range<Policy, P, false, Mode>(sc, a, pc.count);
    }
    if constexpr (Policy::phases[P].col_sums > 0)
      if (t.factored)
        detail::fold_matrix(it.window, it.csum.data(), static_cast<std::size_t>(Policy::phases[P].col_sums), t.cols,
                            it.col_first, it.col_count);
  }

  /// A factored tensor's element pass, compiled for the first set of slots that holds the
  /// ones it keeps (sets that touch the same slots in this phase share one instantiation;
  /// a slot of the set it does not keep reads zeros and writes scratch, see run_item).
  template <int P, detail::param_mode Mode, class Args>
  static void factored_range(unsigned slot_mask, const typename Policy::scalars& sc, const Args& a, std::size_t n) {
    constexpr unsigned touched = Policy::phases[P].reads_slots | Policy::phases[P].writes_slots;
    const int set = detail::factored_set_of<Policy>(slot_mask);
    const bool ran = [&]<std::size_t... S>(std::index_sequence<S...>) {
      return ((set == static_cast<int>(S)
                   ? (detail::layer_range<Policy, P, true, Mode, typename Args::param_type, typename Args::grad_type,
                                          typename Args::state_type, false, factored_sets_[S] & touched>(sc, a, n),
                      true)
                   : false) ||
              ...);
    }(std::make_index_sequence<factored_sets_.size()>{});
    if (!ran)  // init refuses such a tensor; never reached
      throw std::logic_error(std::string(Policy::name) + ": a factored tensor keeps slots no set holds");
  }
  static constexpr auto factored_sets_ = detail::factored_slot_sets<Policy>();

  /// One phase: the element pass over this rank's pieces, the exact sums merged over
  /// items, reduced over the DP ranks sharing each tensor and over the TP group, then
  /// the policy's host hooks for every tensor this rank holds part of.
  template <int P, detail::param_mode Mode, class Ctx, class G>
  void layer_phase(Ctx& o, const std::vector<typename Policy::scalars>& sc, const G* grads, float grad_scale,
                   std::uint64_t key) {
    constexpr phase_spec spec = Policy::phases[P];
    constexpr bool last = P + 1 == layer_phases();
    const typename Policy::scalars* sc_exec = nullptr;
    if constexpr (on_device) {
      push_values(o);
      sc_exec = o.in_exec(sc, scalars_dev_);
    }
    const auto run = [&](std::size_t begin, std::size_t end) {
      if constexpr (on_device) {
        launch_items<P, Mode>(o, sc_exec, grads, grad_scale, key, begin, end);
      } else {
        o.exec_.parallel_for(end - begin, [&](std::size_t j) {
          layer_item& it = items_[begin + j];
          run_item<P, Mode>(o, sc[static_cast<std::size_t>(o.layout_.tensors()[it.tensor].group)], grads, grad_scale,
                            key, it);
        });
      }
    };
    if constexpr (last) {
      // Bucket by bucket, each bucket's gather started after its items (a device runs every
      // bucket's items in one launch: a launch per bucket ran 13 grids of about 257 blocks
      // for 60 M params on an H200, each at 17 % of its DRAM bandwidth, ncu, 2026-11-28).
      run_buckets(o, true, [&](std::size_t first, std::size_t end) { run(bucket_items_[first], bucket_items_[end]); });
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

  /// Merges the items' sums per tensor, all-reduces them (DP: the tensors cut over ranks;
  /// TP: the split tensors, along the split axis only) and converts them to double. On a
  /// device the merge and the conversion run there (layer_merge_phase), and the host copies
  /// the merged sums where a wire needs them, else only their doubles.
  template <int P, class Ctx>
  void reduce_layer_sums(Ctx& o) {
    constexpr phase_spec spec = Policy::phases[P];
    constexpr std::size_t W = detail::fixed_sum::wire_size;
    const bool dp_wire = Ctx::is_sharded && o.comm_.size() > 1, tp_wire = o.tp_ && o.tp_->size() > 1;
    // The exact sums are needed where the host merges the items' sums or a wire carries
    // them; a device without a wire hands over their values only (tsum_d, rsum_d, csum_d).
    const bool converted = on_device && !dp_wire && !tp_wire;
    // This phase's sums of tensor t: tensor sums, row sums, column sums.
    const auto counts = [&](const layer_tensor& t) {
      return std::array<std::size_t, 3>{static_cast<std::size_t>(spec.tensor_sums),
                                        t.factored ? static_cast<std::size_t>(spec.row_sums) * t.matrices * t.rows : 0,
                                        t.factored ? static_cast<std::size_t>(spec.col_sums) * t.matrices * t.cols : 0};
    };
    bool parallel = false;  // the host's merges and conversions on the executor's threads
    const auto zero = [&](layer_tensor& t) {
      const auto [nt, nr, nc] = counts(t);
      t.tsum.assign(nt, {});
      t.rsum.assign(nr, {});
      t.csum.assign(nc, {});
    };
    if constexpr (on_device) {
      if (!converted)
        for (layer_tensor& t : lt_) zero(t);
      layer_merge_phase<Policy, P> merge;
      merge.tensors = tensors_dev_.data();
      merge.items = items_dev_.data();
      merge.item_sums = sums_dev_.data();
      merge.sums = merged_dev_.data();
      merge.values = values_dev_.data();
      detail::launch(o.exec_, lt_.size(), merge);
      const std::size_t n = merged_count_[static_cast<std::size_t>(P)];
      if (converted) detail::copy_bytes(o.exec_, values_host_.data(), values_dev_.data(), n * sizeof(double));
      else detail::copy_bytes(o.exec_, merged_host_.data(), merged_dev_.data(), n * sizeof(fixed_sum));
      for (std::size_t i = 0; i < lt_.size(); ++i) {
        layer_tensor& t = lt_[i];
        const std::size_t at = tdescs_[i].out_at[P];
        const auto [nt, nr, nc] = counts(t);
        if (!converted) {
          const fixed_sum* from = merged_host_.data() + at;
          std::copy(from, from + nt, t.tsum.begin());
          std::copy(from + nt, from + nt + nr, t.rsum.begin());
          std::copy(from + nt + nr, from + nt + nr + nc, t.csum.begin());
        } else {
          const double* from = values_host_.data() + at;
          t.tsum_d.assign(from, from + nt);
          t.rsum_d.assign(from + nt, from + nt + nr);
          t.csum_d.assign(from + nt + nr, from + nt + nr + nc);
        }
      }
    } else {
      // Per tensor, on the executor's threads where there are enough sums: the sums are
      // exact, so neither the thread nor the order of the items changes them.
      std::size_t sums = 0;
      for (const layer_item& it : items_) sums += it.tsum.size() + it.rsum.size() + it.csum.size();
      parallel = sums >= parallel_merge_sums;
      for_each_tensor(o, [&](std::size_t i) {
        layer_tensor& t = lt_[i];
        zero(t);
        const std::size_t r = t.matrices * t.rows, c = t.matrices * t.cols;
        for (std::size_t j = tensor_items_[i]; j < tensor_items_[i + 1]; ++j) {
          const layer_item& it = items_[j];
          for (std::size_t k = 0; k < it.tsum.size(); ++k) t.tsum[k].add(it.tsum[k]);
          for (std::size_t k = 0; k < (it.row_count ? it.rsum.size() / it.row_count : 0); ++k)
            for (std::size_t m = 0; m < it.row_count; ++m) t.rsum[k * r + it.row_first + m].add(it.rsum[k * it.row_count + m]);
          for (std::size_t k = 0; k < (it.col_count ? it.csum.size() / it.col_count : 0); ++k)
            for (std::size_t m = 0; m < it.col_count; ++m) t.csum[k * c + it.col_first + m].add(it.csum[k * it.col_count + m]);
        }
      }, parallel);
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
      const auto convert = [](const std::vector<detail::fixed_sum>& in, std::vector<double>& out) {
        out.resize(in.size());
        for (std::size_t k = 0; k < in.size(); ++k) out[k] = in[k].value();
      };
      if (!converted) {
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
    for_each_tensor(o, finish, parallel);
  }

  /// Calls f(i) for every tensor: on a host executor's threads if `parallel` (each tensor's
  /// statistics are its own), else in order on the calling thread.
  template <class Ctx, class F>
  void for_each_tensor(Ctx& o, F&& f, bool parallel) {
    if constexpr (!on_device)
      if (parallel) return o.exec_.parallel_for(lt_.size(), f);
    for (std::size_t i = 0; i < lt_.size(); ++i) f(i);
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

  /// Device executors: the item table, the slot offsets and room for every item's sums,
  /// column doubles and window exponents, in the executor's memory.
  template <class Ctx>
  void init_device(Ctx& o) {
    const auto tensors = o.layout_.tensors();
    static_assert(layer_phases() <= 4, "distopt: the device's layer-wise items keep sums for up to 4 phases");
    int max_cs = 0;
    for (const phase_spec& ph : Policy::phases) max_cs = std::max(max_cs, ph.col_sums);
    stat_at_.assign(lt_.size(), 0);
    std::size_t stats = 0;
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      stat_at_[i] = stats;
      stats += lt_[i].values.size() + lt_[i].row_values.size() + lt_[i].col_values.size();
    }
    stats_host_.assign(stats, 0.0f);
    descs_.clear();
    max_item_cols_ = 0;
    std::size_t cols = 0;
    phase_sums_.assign(static_cast<std::size_t>(layer_phases()), 0);
    for (const layer_item& it : items_) {
      const layer_tensor& t = lt_[it.tensor];
      layer_item_desc d;
      d.piece_begin = it.piece_begin;
      d.piece_end = it.piece_end;
      d.row_first = it.row_first;
      d.row_count = it.row_count;
      d.col_first = it.col_first;
      d.col_count = it.col_count;
      d.tensor_offset = tensors[it.tensor].offset;
      d.cols = t.cols;
      d.matrix = t.rows * t.cols;
      d.rows_total = t.matrices * t.rows;
      d.cols_total = t.matrices * t.cols;
      d.values_at = stat_at_[it.tensor];
      d.slot_mask = t.slot_mask;
      d.factored = t.factored;
      d.cols_at = cols;
      for (int p = 0; p < layer_phases(); ++p) {
        const phase_spec& ph = Policy::phases[static_cast<std::size_t>(p)];
        std::size_t& at = phase_sums_[static_cast<std::size_t>(p)];
        d.sums_at[p] = at;
        at += static_cast<std::size_t>(ph.tensor_sums) +
              (t.factored ? static_cast<std::size_t>(ph.row_sums) * it.row_count + static_cast<std::size_t>(ph.col_sums) * it.col_count
                          : 0);
      }
      cols += t.factored ? static_cast<std::size_t>(max_cs) * it.col_count : 0;
      if (t.factored) max_item_cols_ = std::max(max_item_cols_, it.col_count);
      descs_.push_back(d);
    }
    o.in_exec(descs_, items_dev_);
    o.in_exec(o.states_at_.offsets(), slots_dev_);
    std::vector<std::size_t> piece_item(o.plan_.pieces().size(), 0);
    for (std::size_t j = 0; j < items_.size(); ++j)
      for (std::size_t c = items_[j].piece_begin; c < items_[j].piece_end; ++c) piece_item[c] = j;
    o.in_exec(piece_item, piece_item_dev_);
    const std::size_t sums = phase_sums_.empty() ? 0 : *std::max_element(phase_sums_.begin(), phase_sums_.end());
    sums_dev_ = detail::buffer<fixed_sum, Exec>(o.exec_, sums);
    // Each tensor's items (consecutive: init makes them tensor by tensor) and merged sums.
    tdescs_.assign(lt_.size(), {});
    for (std::size_t j = 0; j < items_.size(); ++j) {
      layer_tensor_desc& d = tdescs_[items_[j].tensor];
      if (d.end_item == 0) d.first_item = j;
      d.end_item = j + 1;
    }
    merged_count_.assign(static_cast<std::size_t>(layer_phases()), 0);
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      layer_tensor_desc& d = tdescs_[i];
      d.rows = lt_[i].factored && lt_[i].local ? lt_[i].matrices * lt_[i].rows : 0;
      d.cols = lt_[i].factored && lt_[i].local ? lt_[i].matrices * lt_[i].cols : 0;
      for (int p = 0; p < layer_phases(); ++p) {
        const phase_spec& ph = Policy::phases[static_cast<std::size_t>(p)];
        std::size_t& at = merged_count_[static_cast<std::size_t>(p)];
        d.out_at[p] = at;
        at += static_cast<std::size_t>(ph.tensor_sums) + static_cast<std::size_t>(ph.row_sums) * d.rows +
              static_cast<std::size_t>(ph.col_sums) * d.cols;
      }
    }
    o.in_exec(tdescs_, tensors_dev_);
    const std::size_t merged = *std::max_element(merged_count_.begin(), merged_count_.end());
    merged_dev_ = detail::buffer<fixed_sum, Exec>(o.exec_, merged);
    values_dev_ = detail::buffer<double, Exec>(o.exec_, merged);
    merged_host_.assign(merged, fixed_sum{});
    values_host_.assign(merged, 0.0);
    scalars_dev_ = detail::buffer<typename Policy::scalars, Exec>(o.exec_, o.groups_.size());
    col_acc_dev_ = detail::buffer<double, Exec>(o.exec_, cols);
    col_count_ = cols;
    o.in_exec(std::vector<std::uint32_t>(cols * static_cast<std::size_t>(layer_phases()), column_window::unset), col_lo_dev_);
    stats_dev_ = detail::buffer<float, Exec>(o.exec_, stats);
  }

  /// Device executors: phase P's element pass over items [begin, end), a launch of
  /// layer_phase_body (on cuda its own kernel: a thread block per item).
  template <int P, detail::param_mode Mode, class Ctx, class G>
  void launch_items(Ctx& o, const typename Policy::scalars* sc, const G* grads, float grad_scale, std::uint64_t key,
                    std::size_t begin, std::size_t end) {
    layer_phase_body<Policy, P, Mode, typename Ctx::param_type, G, State> body;
    body.items = items_dev_.data();
    body.first_item = begin;
    body.pieces = o.exec_pieces();
    body.slots = slots_dev_.data();
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
    body.stats = stats_dev_.data();
    body.sums = sums_dev_.data();
    body.col_acc = col_acc_dev_.data();
    body.col_lo = col_lo_dev_.data() + static_cast<std::size_t>(P) * col_count_;
    body.max_cols = static_cast<std::size_t>(Policy::phases[P].col_sums) * max_item_cols_;
    body.piece_first = begin < end ? items_[begin].piece_begin : 0;
    body.piece_count = begin < end ? items_[end - 1].piece_end - body.piece_first : 0;
    body.piece_item = piece_item_dev_.data();
    detail::launch(o.exec_, end - begin, body);
  }

  /// Device executors: the values the element functions read (host vectors the hooks
  /// wrote), copied to the statistics mirror.
  template <class Ctx>
  void push_values(Ctx& o) {
    for (std::size_t i = 0; i < lt_.size(); ++i) {
      const layer_tensor& t = lt_[i];
      float* out = stats_host_.data() + stat_at_[i];
      out = std::copy(t.values.begin(), t.values.end(), out);
      out = std::copy(t.row_values.begin(), t.row_values.end(), out);
      std::copy(t.col_values.begin(), t.col_values.end(), out);
    }
    detail::copy_bytes(o.exec_, stats_dev_.data(), stats_host_.data(), stats_host_.size() * sizeof(float));
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
  /// column states every rank holding part of a factored tensor keeps whole, and the
  /// statistics.
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
    if constexpr (on_device)  // the items' sums and column windows, the values' mirror, the item table
      r.entries.push_back({"statistics (device work)", sums_dev_.bytes() + col_acc_dev_.bytes() + col_lo_dev_.bytes() +
                                                           stats_dev_.bytes() + items_dev_.bytes() + slots_dev_.bytes() +
                                                           scalars_dev_.bytes() + tensors_dev_.bytes() + piece_item_dev_.bytes() +
                                                           merged_dev_.bytes() + values_dev_.bytes()});
    if constexpr (on_device)  // their host copies
      r.entries.push_back({"statistics (host staging)", merged_host_.size() * sizeof(fixed_sum) +
                                                            values_host_.size() * sizeof(double) +
                                                            stats_host_.size() * sizeof(float) +
                                                            descs_.size() * sizeof(layer_item_desc) +
                                                            tdescs_.size() * sizeof(layer_tensor_desc)});
  }

  std::vector<layer_tensor> lt_;
  std::vector<layer_item> items_;
  std::vector<std::size_t> bucket_items_;                 // items of bucket k: [k], [k + 1])
  std::vector<std::size_t> tensor_items_;                 // items of tensor i: [i], [i + 1])
  std::size_t stat_bytes_ = 0;                            // statistics put on the wire so far
  // Device executors only (init_device).
  std::vector<layer_item_desc> descs_;
  std::vector<std::size_t> stat_at_;     // per tensor: its values in the statistics mirror
  std::vector<float> stats_host_;
  std::vector<layer_tensor_desc> tdescs_;
  std::vector<std::size_t> merged_count_;  // per phase: the merged sums of all tensors
  std::vector<fixed_sum> merged_host_;     // the merged sums, where a wire needs them
  std::vector<double> values_host_;        // else their values
  std::vector<std::size_t> phase_sums_;  // per phase: the fixed_sums of all items
  std::size_t col_count_ = 0;            // column doubles of all items (one phase's window exponents)
  std::size_t max_item_cols_ = 0;        // the most columns of one factored item
  detail::buffer<layer_item_desc, Exec> items_dev_;
  detail::buffer<slot_offsets, Exec> slots_dev_;
  detail::buffer<std::size_t, Exec> piece_item_dev_;
  detail::buffer<fixed_sum, Exec> sums_dev_;
  detail::buffer<layer_tensor_desc, Exec> tensors_dev_;
  detail::buffer<fixed_sum, Exec> merged_dev_;
  detail::buffer<double, Exec> values_dev_;
  detail::buffer<double, Exec> col_acc_dev_;
  detail::buffer<std::uint32_t, Exec> col_lo_dev_;
  detail::buffer<float, Exec> stats_dev_;
  detail::buffer<typename Policy::scalars, Exec> scalars_dev_;
};

/// Marks the layer-wise stage as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct stage_included<Policy, layer_stage_tag> : std::true_type {};

}  // namespace distopt::detail
