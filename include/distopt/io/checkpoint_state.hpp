// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file An optimizer's state as checkpoint items, read from its context and stages
/// (engine/): each tensor's params, master weights and state slots where the state layout
/// (engine/state_layout.hpp) puts them, and what a stage keeps besides (factored row and
/// column states, GaLore's low-rank states and projections); the scalars an index holds
/// and their restoration; and the checkpoint_party of io/checkpoint_files.hpp over them.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../detail/checkpoint_item.hpp"
#include "../detail/layout_check.hpp"
#include "../engine/collectives.hpp"
#include "../engine/mirror.hpp"
#include "../engine/stages.hpp"
#include "../exec/transfer.hpp"
#include "../layout/registry.hpp"
#include "../options.hpp"
#include "../policy/hyper_text.hpp"
#include "../storage/q8_encoding.hpp"
#include "../types/dtype.hpp"
#include "checkpoint_files.hpp"

namespace distopt::detail {

/// What checkpoint_scalars_of writes, gathered from an optimizer of any type.
struct scalar_facts {
  std::string_view policy, encoding, param_dtype, grad_dtype;
  bool master_weights = false, quantized = false, master_ready = false;
  int slots = 0;
  const layout* tensors = nullptr;
  const optimizer_options* options = nullptr;
  std::vector<std::vector<std::int64_t>> whole_shapes;  // per tensor, over the TP group
  std::int64_t step = 0, step_calls = 0;
  std::string started;              // per group, '1' where its state has started
  std::vector<std::string> groups;  // per group, its hyper-parameters' text
  std::optional<std::pair<double, std::int64_t>> scaler;  // loss scale, growth tracker
};

/// The key of tensor `t` in a checkpoint's identity: "tensor NAME", or for an expert tensor
/// its logical tensor's, "experts NAME".
inline std::string checkpoint_key(const tensor_slot& t) {
  return t.experts_of.empty() ? "tensor " + t.name : "experts " + t.experts_of;
}
/// describe_tensor of an expert tensor's logical tensor: its experts' count and one
/// expert's (TP part's) shape.
inline std::string describe_experts(const tensor_slot& t) {
  return "'" + t.experts_of + "' " + std::to_string(t.experts) + " experts of " + shape_string(t.shape) + " " +
         std::string(dtype_name(t.dtype)) + " group " + std::to_string(t.group) + " tp " + tp_split_name(t.tp);
}

/// Each item's identity key, and an expert tensor's items placed in its logical tensor: each
/// box gains the expert axis in front ([experts, ...], at this expert), so that a checkpoint
/// reshards over expert-parallel sizes as it does over TP sizes. (A box left empty, 8-bit
/// absmax of blocks a TP cut splits, stays empty: it loads on the saving layout only.)
inline void place_items(const layout& l, std::vector<checkpoint_item>& items) {
  for (checkpoint_item& it : items) {
    const tensor_slot& t = l.find(it.tensor);
    it.key = checkpoint_key(t);
    if (t.experts_of.empty() || it.tp.whole.empty()) continue;
    it.tp.whole.insert(it.tp.whole.begin(), t.experts);
    it.tp.box.insert(it.tp.box.begin(), 1);
    it.tp.offset.insert(it.tp.offset.begin(), t.expert);
  }
}

/// The checkpoint's scalars: what must match on load (identity), what is restored (state).
inline checkpoint_scalars checkpoint_scalars_of(const scalar_facts& f) {
  checkpoint_scalars s;
  const auto id = [&](std::string k, std::string v) { s.identity.emplace_back(std::move(k), std::move(v)); };
  const optimizer_options& o = *f.options;
  const auto tensors = f.tensors->tensors();
  id("policy", std::string(f.policy));
  id("encoding", std::string(f.encoding));
  id("param_dtype", std::string(f.param_dtype));
  id("grad_dtype", std::string(f.grad_dtype));
  id("master_weights", f.master_weights ? "true" : "false");
  id("block_size", std::to_string(f.tensors->block_size()));
  id("groups", std::to_string(f.groups.size()));
  id("state_slots", std::to_string(f.slots));
  if (f.quantized) id("min_8bit_size", std::to_string(o.min_8bit_size));
  id("percentile_clipping", std::to_string(o.percentile_clipping));
  id("loss_scaling", f.scaler ? "dynamic" : "off");
  // An expert tensor's experts are one logical tensor, which any expert-parallel size holds.
  std::vector<std::size_t> listed;
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].experts_of.empty() ||
        std::none_of(listed.begin(), listed.end(), [&](std::size_t k) { return tensors[k].experts_of == tensors[i].experts_of; }))
      listed.push_back(i);
  id("tensors", std::to_string(listed.size()));
  for (const std::size_t i : listed) {
    const tensor_slot& t = tensors[i];
    id(checkpoint_key(t), t.experts_of.empty() ? describe_tensor(t) : describe_experts(t));
    // Without the TP split: a tensor split otherwise on load is resharded, not refused.
    if (t.experts_of.empty()) s.whole.emplace_back(checkpoint_key(t), describe_tensor_shape(t, f.whole_shapes[i]));
    else {
      std::vector<std::int64_t> whole = f.whole_shapes[i];
      whole.insert(whole.begin(), t.experts);
      s.whole.emplace_back(checkpoint_key(t), "'" + t.experts_of + "' " + shape_string(whole) + " " +
                                                  std::string(dtype_name(t.dtype)) + " group " + std::to_string(t.group));
    }
  }
  const auto st = [&](std::string k, std::string v) { s.state.emplace_back(std::move(k), std::move(v)); };
  st("step", std::to_string(f.step));
  st("step_calls", std::to_string(f.step_calls));  // skipped ones included: a resume starts after the last call
  st("seed", std::to_string(o.seed));
  st("master_ready", f.master_ready ? "true" : "false");
  st("state_started", f.started);
  if (f.scaler) {
    st("loss_scale", format_number(f.scaler->first));
    st("growth_tracker", std::to_string(f.scaler->second));
  }
  for (std::size_t g = 0; g < f.groups.size(); ++g) st("group " + std::to_string(g), f.groups[g]);
  return s;
}

}  // namespace distopt::detail

namespace distopt::io {

/// The optimizer's private side, for save_checkpoint and load_checkpoint.
struct checkpoint_access {
  // ---------------------------------------------------------------------------------
  // Checkpoints: this rank's state as named flat vectors (distopt/checkpoint.hpp does
  // the files). A slice item is the elements of a tensor this rank holds (all of them when
  // replicated, where rank 0 alone writes); a whole item (row and column states, GaLore's
  // low-rank states and projections) is kept by every rank holding part of its tensor and
  // written by the one holding the tensor's first element.
  // ---------------------------------------------------------------------------------

  static std::string safetensors_dtype(dtype t) {
    return t == dtype::f32 ? "F32" : t == dtype::bf16 ? "BF16" : "F16";
  }

  /// What the placement of an optimizer's items depends on, apart from its type: its
  /// layout and shard plan, whether this rank writes the slices it holds (sharded, or rank
  /// 0 of replicated state), and its TP group's size and rank.
  struct item_place {
    const layout* tensors;
    const distopt::detail::shard_plan* plan;
    bool writes_slices;
    int tp_size, tp_rank;
  };
  template <class Opt>
  static item_place place_of(const Opt& o) {
    const bool tp = o.tp_ && o.tp_->size() > 1;
    return {&o.layout_, &o.plan_, Opt::is_sharded || o.comm_.rank() == 0, tp ? o.tp_->size() : 1, tp ? o.tp_->rank() : 0};
  }

  /// Whether this rank writes the items of tensor `i`: sliced (`whole` false) or whole.
  static bool writes_tensor(const item_place& at, std::size_t i, bool whole) {
    const distopt::detail::piece_range r = at.plan->pieces_of(i);
    if (r.empty() || !at.writes_slices) return false;
    return !whole || at.plan->pieces()[r.first].layout == at.tensors->tensors()[i].offset;
  }
  template <class Opt>
  static bool writes_tensor(const Opt& o, std::size_t i, bool whole) {
    return writes_tensor(place_of(o), i, whole);
  }

  /// The TP box of a part of extents `box`, split along `axis` over the TP group (-1: every
  /// TP part holds the whole).
  static distopt::detail::tp_box tp_box_of(const item_place& at, std::vector<std::int64_t> box, int axis) {
    distopt::detail::tp_box b;
    b.whole = box;
    b.offset.assign(box.size(), 0);
    if (axis >= 0 && at.tp_size > 1) {
      const auto a = static_cast<std::size_t>(axis);
      b.whole[a] *= at.tp_size;
      b.offset[a] = at.tp_rank * box[a];
    }
    b.box = std::move(box);
    return b;
  }
  template <class Opt>
  static distopt::detail::tp_box tp_box_of(const Opt& o, std::vector<std::int64_t> box, int axis) {
    return tp_box_of(place_of(o), std::move(box), axis);
  }

  /// The axis of tensor `i`'s elements that TP splits: 0 for rows, the last for columns.
  static int element_axis(const layout& l, std::size_t i) {
    const tensor_slot& t = l.tensors()[i];
    if (t.tp == tp_split::none) return -1;  // (layout::add refuses empty shapes)
    return t.tp == tp_split::rows ? 0 : static_cast<int>(t.shape.size()) - 1;
  }
  template <class Opt>
  static int element_axis(const Opt& o, std::size_t i) {
    return element_axis(o.layout_, i);
  }

  /// Appends the item for this rank's slice [first, first + count) of tensor `i`'s vector
  /// `suffix`, whose element k lives at `base[k - first]` (elements of `element_size`
  /// bytes): one per element of the tensor's TP part, or (`whole`) a vector every holder
  /// of the tensor keeps whole.
  static void add_slice_item(const item_place& at, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i,
                             std::string_view suffix, std::string st_dtype, std::size_t element_size, std::byte* base,
                             std::uint64_t total, std::uint64_t first, std::uint64_t count,
                             std::vector<std::int64_t> shape, bool whole) {
    const tensor_slot& t = at.tensors->tensors()[i];
    out.push_back(slice_item(t.name + "/" + std::string(suffix), std::move(st_dtype), element_size, base, total, first,
                             count, std::move(shape), writes_tensor(at, i, whole)));
    out.back().tensor = t.name;
    if (whole) out.back().tp = tp_box_of(at, {static_cast<std::int64_t>(total)}, -1);
    else out.back().tp = tp_box_of(at, t.shape, element_axis(*at.tensors, i));
  }
  template <class Opt, class T>
  static void add_slice_item(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i,
                             std::string_view suffix, std::string st_dtype, T* base, std::uint64_t total,
                             std::uint64_t first, std::uint64_t count, std::vector<std::int64_t> shape,
                             bool whole = false) {
    add_slice_item(place_of(o), out, i, suffix, std::move(st_dtype), sizeof(T), reinterpret_cast<std::byte*>(base), total,
                   first, count, std::move(shape), whole);
  }

  /// add_slice_item for a slice of the optimizer's buffers. In device memory it is saved
  /// from a host copy made when the file is written, and installed by a copy through the
  /// executor.
  template <class Opt, class T>
  static void add_buffer_item(Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i,
                              std::string suffix, std::string st_dtype, T* base, std::uint64_t total,
                              std::uint64_t first, std::uint64_t count, std::vector<std::int64_t> shape) {
    add_slice_item(o, out, i, std::move(suffix), std::move(st_dtype), base, total, first, count, std::move(shape));
    if constexpr (!host_memory<typename Opt::executor_type>) {
      distopt::detail::checkpoint_item& it = out.back();
      const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(T);
      it.source = nullptr;
      it.fetch = [exec = o.exec_, base, bytes, host = std::make_shared<std::vector<std::byte>>()]() mutable {
        host->resize(bytes);
        distopt::detail::copy_bytes(exec, host->data(), base, bytes);
        return static_cast<const std::byte*>(host->data());
      };
      it.install = [exec = o.exec_, base, bytes](std::span<const std::byte> b) mutable {
        distopt::detail::copy_bytes(exec, base, b.data(), bytes);
      };
    }
  }

  /// The item add_slice_item describes, built apart from the optimizer's type (one copy of
  /// this code and of its install function per program, not one per optimizer and element type).
  static distopt::detail::checkpoint_item slice_item(std::string name, std::string st_dtype, std::size_t element_size,
                                                     std::byte* base, std::uint64_t total, std::uint64_t first,
                                                     std::uint64_t count, std::vector<std::int64_t> shape, bool save) {
    distopt::detail::checkpoint_item it;
    it.name = std::move(name);
    it.dtype = std::move(st_dtype);
    it.element_size = element_size;
    it.total = total;
    it.shape = shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(total)} : std::move(shape);
    it.first = first;
    it.count = count;
    it.save = save;
    it.load = true;
    it.source = base;
    it.install = [base, bytes = count * element_size](std::span<const std::byte> b) {
      if (bytes != 0) std::memcpy(static_cast<void*>(base), b.data(), bytes);
    };
    return it;
  }

  /// A whole item of tensor `i` held in `v` (which load resizes only through `install`).
  template <class Opt>
  static void add_whole_item(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i, std::string suffix,
                      std::vector<float>& v) {
    add_slice_item(o, out, i, std::move(suffix), "F32", v.data(), v.size(), 0, v.size(), {}, true);
  }

  template <class Opt, class T>
  static void add_whole_q8_items(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i, const std::string& suffix,
                          std::vector<std::uint8_t>& codes, std::vector<T>& absmax) {
    add_slice_item(o, out, i, suffix + ".codes", "U8", codes.data(), codes.size(), 0, codes.size(), {}, true);
    add_slice_item(o, out, i, suffix + ".absmax", "F32", absmax.data(), absmax.size(), 0, absmax.size(), {}, true);
  }

  // What a stage keeps of a tensor besides its element states: none by default.
  template <class Opt, class S>
  static void stage_items(Opt&, S&, std::vector<distopt::detail::checkpoint_item>&, std::size_t) {}
  template <class Opt, class S>
  static void stage_pull(const Opt&, const S&) {}
  template <class Opt, class S>
  static void stage_restore(Opt&, S&) {}
  template <class Opt, class S>
  static void stage_check_group(const Opt&, const S&, int, const typename Opt::hyper_params&) {}

  // Bucket stages: their matrix stage's.
  template <class Opt, class P, class M, class E>
  static void stage_items(Opt& o, distopt::detail::bucket_stages<P, M, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    stage_items(o, s.matrix, out, i);
  }
  template <class Opt, class P, class M, class E>
  static void stage_pull(const Opt& o, const distopt::detail::bucket_stages<P, M, E>& s) {
    stage_pull(o, s.matrix);
  }
  template <class Opt, class P, class M, class E>
  static void stage_restore(Opt& o, distopt::detail::bucket_stages<P, M, E>& s) {
    stage_restore(o, s.matrix);
  }
  /// A checkpoint's groups must not turn Muon matrices into AdamW tensors or the reverse.
  template <class Opt, class P, class M, class E>
  static void stage_check_group(const Opt& o, const distopt::detail::bucket_stages<P, M, E>& s, int g,
                                const typename Opt::hyper_params& h) {
    s.check_hyper(o, g, h);
  }

  // Layer-wise: the factored row and column states.
  template <class Opt, class P, class St, class E>
  static void stage_items(Opt& o, distopt::detail::layer_stage<P, St, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    auto& lt = s.lt_[i];
    if (!lt.factored) return;
    const tensor_slot& t = o.layout_.tensors()[i];
    // [slots][matrices][rows] and [slots][matrices][columns]. TP splits the rows of a
    // matrix (its column states are then summed over TP, the same on every part), the
    // matrices of a stack (dim 0 of a tensor of more than 2 dims), or the columns.
    const auto m = static_cast<std::int64_t>(lt.matrices), rows = static_cast<std::int64_t>(lt.rows),
               cols = static_cast<std::int64_t>(lt.cols);
    const bool stack = lt.tp_split && t.tp == tp_split::rows && !lt.tp_rows;
    if (!lt.row_state.empty()) {
      add_whole_item(o, out, i, "row_states", lt.row_state);
      out.back().tp = tp_box_of(o, {P::row_states, m, rows}, lt.tp_rows ? 2 : stack ? 1 : -1);
    }
    if (!lt.col_state.empty()) {
      add_whole_item(o, out, i, "col_states", lt.col_state);
      out.back().tp = tp_box_of(o, {P::col_states, m, cols}, lt.tp_cols ? 2 : stack ? 1 : -1);
    }
  }
  template <class Opt, class P, class St, class E>
  static void stage_restore(Opt& o, distopt::detail::layer_stage<P, St, E>& s) {
    s.init_geometry(o);
  }

  // GaLore: each projected matrix's low-rank states and projection.
  template <class Opt, class P, class St, class E>
  static void stage_items(Opt& o, distopt::detail::projection_stage<P, St, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    const int j = o.states_at_.matrix_index()[i];
    if (j < 0) return;
    const tensor_slot& t = o.layout_.tensors()[i];
    auto& pm = s.matrices_[static_cast<std::size_t>(j)];
    for (int k = 0; k < 2; ++k) {
      const std::string name = "projected." + std::to_string(k);
      if (!pm.codes[k].empty()) add_whole_q8_items(o, out, i, name, pm.codes[k], pm.absmax[k]);
      else add_whole_item(o, out, i, name, pm.state[k]);
    }
    // The projection: Q (m x r) and/or P (r x n); saved once computed, loaded when
    // the checkpoint has it (into staging: set_ortho installs both at the end).
    const auto side = pm.proj.side_for(pm.m, pm.n);
    using side_t = decltype(side);
    const std::int64_t rk = pm.proj.rank();
    auto& staged = s.ortho_staging_[static_cast<std::size_t>(j)];
    const std::array<std::uint64_t, 2> sizes{side == side_t::right ? 0u : static_cast<std::uint64_t>(pm.m * rk),
                                             side == side_t::left ? 0u : static_cast<std::uint64_t>(rk * pm.n)};
    for (int k = 0; k < 2; ++k) {
      if (sizes[k] == 0) continue;
      distopt::detail::checkpoint_item it;
      it.name = t.name + (k == 0 ? "/projector.left" : "/projector.right");
      it.tensor = t.name;
      it.dtype = "F32";
      it.total = it.count = sizes[k];
      it.shape = k == 0 ? std::vector<std::int64_t>{pm.m, rk} : std::vector<std::int64_t>{rk, pm.n};
      it.tp = tp_box_of(o, {static_cast<std::int64_t>(sizes[k])}, -1);  // GaLore's matrices are not TP-split
      it.save = writes_tensor(o, i, true) && pm.proj.has_ortho();
      it.load = false;  // optional: when the checkpoint has it
      it.source = reinterpret_cast<const std::byte*>(k == 0 ? pm.proj.left().data() : pm.proj.right().data());
      it.install = [&staged, k, n = sizes[k]](std::span<const std::byte> b) {
        staged[static_cast<std::size_t>(k)].resize(n);
        std::memcpy(staged[static_cast<std::size_t>(k)].data(), b.data(), n * sizeof(float));
        staged[2].resize(1);  // marks the matrix as staged
      };
      out.push_back(std::move(it));
    }
  }
  template <class Opt, class P, class St, class E>
  static void stage_pull(const Opt& o, const distopt::detail::projection_stage<P, St, E>& s) {
    s.pull_all(o);
  }
  /// The projectors anew from the loaded groups, with the projections the checkpoint had.
  template <class Opt, class P, class St, class E>
  static void stage_restore(Opt& o, distopt::detail::projection_stage<P, St, E>& s) {
    for (std::size_t j = 0; j < s.matrices_.size(); ++j) {
      auto& pm = s.matrices_[j];
      auto& staged = s.ortho_staging_[j];
      const typename Opt::hyper_params& h = o.groups_[static_cast<std::size_t>(o.layout_.tensors()[pm.tensor].group)];
      pm.proj = decltype(pm.proj)(h);
      if (!staged[2].empty()) pm.proj.set_ortho(pm.m, pm.n, std::move(staged[0]), std::move(staged[1]));
      staged = {};
    }
    s.push_all(o);  // a device executor's copies of them
  }

  /// Every piece of state this rank holds, as checkpoint items: each tensor's params,
  /// master weights and state slots where the state layout puts them, its percentile
  /// clipping history, and what its stage keeps of it (factored states, projections).
  template <class Opt, class Stages>
  static std::vector<distopt::detail::checkpoint_item> checkpoint_items(Opt& o, Stages& stages) {
    using distopt::detail::state_home;
    distopt::detail::sync_decisions(o);  // a device executor's master_ready
    stage_pull(o, stages);               // a device executor's low-rank states and projections
    std::vector<distopt::detail::checkpoint_item> out;
    const auto tensors = o.layout_.tensors();
    const auto& pieces = o.plan_.pieces();
    std::string sdt = "U8";
    if constexpr (!Opt::is_quantized) sdt = safetensors_dtype(dtype_of<typename Opt::state_type>);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const tensor_slot& t = tensors[i];
      const distopt::detail::piece_range r = o.plan_.pieces_of(i);
      if (r.empty()) continue;
      const distopt::detail::shard_piece& p0 = pieces[r.first];
      const std::size_t count = o.plan_.local_count(i);
      const std::uint64_t first = p0.layout - t.offset;
      add_buffer_item(o, out, i, "param", safetensors_dtype(dtype_of<typename Opt::param_type>), o.params_.data() + o.param_at(p0), t.numel,
                     first, count, t.shape);
      if (o.uses_master()) {
        add_buffer_item(o, out, i, "master", "F32", o.master_.data() + p0.local, t.numel, first, count, t.shape);
        out.back().save = out.back().save && o.master_ready_;
        out.back().load = false;  // when the checkpoint has master weights (checkpoint_access decides)
      }
      for (int k = 0; k < o.slots_; ++k) {
        const std::string slot = "state." + std::to_string(k);
        const std::size_t at = o.states_at_.offset(r.first, k);
        switch (o.states_at_.home(r.first, k)) {
          case state_home::none:  // a slot this tensor does not keep
            break;
          case state_home::slot:
            if constexpr (Opt::is_quantized) {
              add_buffer_item(o, out, i, slot + ".codes", "U8", o.states_[k].data() + at, t.numel, first, count, t.shape);
              const std::uint64_t b0 = first / q8::block, b1 = (first + count + q8::block - 1) / q8::block;
              const std::uint64_t blocks = (t.numel + q8::block - 1) / q8::block;
              add_buffer_item(o, out, i, slot + ".absmax", "F32", o.absmax_[k].data() + at / q8::block, blocks, b0,
                              b1 - b0, {});
              // The blocks of a TP part are blocks of the whole tensor only when the part is
              // whole, or a run of rows of a multiple of the block.
              const int axis = o.tp_ && o.tp_->size() > 1 ? element_axis(o, i) : -1;
              if (axis < 0 || (axis == 0 && t.numel % q8::block == 0))
                out.back().tp = tp_box_of(o, {static_cast<std::int64_t>(blocks)}, axis);
              else
                out.back().tp = {};
            } else {
              add_buffer_item(o, out, i, slot, sdt, o.states_[k].data() + at, t.numel, first, count, t.shape);
            }
            break;
          case state_home::small:  // q8: the fp32 states of a tensor below min_8bit_size
            add_buffer_item(o, out, i, slot, "F32", o.small_[k].data() + at, t.numel, first, count, t.shape);
            break;
          case state_home::momentum:  // Muon: a matrix's momentum
            add_buffer_item(o, out, i, slot, sdt, o.momentum_.data() + at, t.numel, first, count, t.shape);
            break;
        }
      }
      if (!o.gnorm_vec_.empty())  // percentile clipping: the tensor's norm history (its holders' is exact)
        add_slice_item(o, out, i, "clip_history", "F32", o.gnorm_vec_[i].data(), 100, 0, 100, {}, true);
      stage_items(o, stages, out, i);
    }
    distopt::detail::place_items(o.layout_, out);
    return out;
  }

  /// What must match (identity) and what is restored (state) on load.
  template <class Opt>
  static distopt::detail::checkpoint_scalars checkpoint_scalars(const Opt& o) {
    distopt::detail::sync_decisions(o);  // a device executor's step counter and loss scaler
    distopt::detail::scalar_facts f;
    f.policy = Opt::policy_type::name;
    if constexpr (Opt::is_quantized) f.encoding = "q8";
    else f.encoding = dtype_name(dtype_of<typename Opt::state_type>);
    f.param_dtype = dtype_name(dtype_of<typename Opt::param_type>);
    f.grad_dtype = dtype_name(dtype_of<typename Opt::grad_type>);
    f.master_weights = o.uses_master();
    f.quantized = Opt::is_quantized;
    f.slots = o.slots_;
    f.tensors = &o.layout_;
    f.options = &o.options_;
    for (std::size_t i = 0; i < o.layout_.tensors().size(); ++i)
      f.whole_shapes.push_back(tp_box_of(o, o.layout_.tensors()[i].shape, element_axis(o, i)).whole);
    f.step = o.step_;
    f.step_calls = o.step_calls_;
    f.master_ready = o.master_ready_;
    for (std::size_t g = 0; g < o.groups_.size(); ++g) {
      f.started += g < o.state_started_.size() && o.state_started_[g] ? '1' : '0';
      f.groups.push_back(hyper_params_string<typename Opt::policy_type>(o.groups_[g]));
    }
    if (o.scaler_) f.scaler = std::pair(o.scaler_->scale(), o.scaler_->growth_tracker());
    return distopt::detail::checkpoint_scalars_of(f);
  }

  /// The state scalars of a checkpoint, parsed (restore_checkpoint installs them).
  struct state_scalars {
    std::int64_t step = 0, step_calls = 0, growth_tracker = 0;
    std::uint64_t seed = 0;
    bool master_ready = false;
    std::string started;
    double loss_scale = 1.0;
  };
  static state_scalars parse_state(const std::map<std::string, std::string, std::less<>>& st, bool scaler) {
    state_scalars r;
    const auto number = [&st](const char* k, auto& out) { distopt::detail::parse_value(st.at(k), out); };
    number("step", r.step);
    const auto calls = st.find("step_calls");  // absent before it was recorded: no skipped step counted
    if (calls != st.end()) distopt::detail::parse_value(calls->second, r.step_calls);
    else r.step_calls = r.step;
    number("seed", r.seed);
    r.master_ready = st.at("master_ready") == "true";
    r.started = st.at("state_started");
    if (scaler) {
      distopt::detail::parse_double(st.at("loss_scale"), r.loss_scale);
      number("growth_tracker", r.growth_tracker);
    }
    return r;
  }

  /// Restores the state scalars (already checked to parse: checkpoint_access validates
  /// them before any rank installs anything) and finishes what install staged.
  template <class Opt, class Stages>
  static void restore_checkpoint(Opt& o, Stages& stages, const std::map<std::string, std::string, std::less<>>& st) {
    distopt::detail::sync_decisions(o);  // what the device decided is replaced below, and pushed before the next step
    o.decisions_changed_ = true;
    const state_scalars r = parse_state(st, o.scaler_.has_value());
    o.step_ = r.step;
    o.step_calls_ = r.step_calls;
    o.options_.seed = r.seed;
    o.master_ready_ = r.master_ready;
    o.state_started_.assign(o.groups_.size(), false);
    for (std::size_t g = 0; g < o.groups_.size(); ++g) o.state_started_[g] = r.started[g] == '1';
    if (o.scaler_) o.scaler_->restore(r.loss_scale, r.growth_tracker);
    for (std::size_t g = 0; g < o.groups_.size(); ++g) o.groups_[g] = parse_checkpoint_group<Opt>(st.at("group " + std::to_string(g)));
    o.groups_changed_ = true;  // the step's copies of the groups and their slot counts follow
    stage_restore(o, stages);
    o.clip_.reset();
    distopt::detail::drop_step_grads(o);  // a half-done backward's grads and hooks belong to the params replaced
    if (Opt::is_sharded && o.comm_.size() > 1) distopt::detail::gather_params(o);
  }

  /// The hyper-parameters of a group from their text form; throws std::invalid_argument.
  template <class Opt>
  static typename Opt::hyper_params parse_checkpoint_group(std::string_view text) {
    typename Opt::hyper_params h;
    while (!text.empty()) {
      const std::size_t space = text.find(' ');
      const std::string_view kv = text.substr(0, space);
      const std::size_t eq = kv.find('=');
      if (eq == std::string_view::npos) throw std::invalid_argument("hyper-parameter '" + std::string(kv) + "' has no '='");
      set_hyper_param<typename Opt::policy_type>(h, kv.substr(0, eq), kv.substr(eq + 1));
      text = space == std::string_view::npos ? std::string_view() : text.substr(space + 1);
    }
    h.validate();
    return h;
  }

  /// The checkpoint's view of an optimizer's context and stages: what save_checkpoint
  /// and load_checkpoint (below) ask of it, apart from its type.
  template <class Opt, class Stages>
  static detail::checkpoint_party party(Opt& o, Stages& stages) {
    using party_t = detail::checkpoint_party;
    party_t p;
    p.rank = o.comm_.rank();
    p.size = o.comm_.size();
    // The parts: TP parts, and over expert-parallel ranks the parts of other experts.
    const int ep = o.ep_ ? o.ep_->size() : 1, tps = o.tp_ ? o.tp_->size() : 1;
    distopt::detail::check_experts_held(o.layout_, ep, "distopt: checkpoint");
    p.tp_rank = (o.ep_ ? o.ep_->rank() : 0) * tps + (o.tp_ ? o.tp_->rank() : 0);
    p.tp_size = ep * tps;
    p.opt = &o;
    p.stages = &stages;
    p.all_max_fn = [](const party_t& p, std::span<double> v) {
      Opt& o = *static_cast<Opt*>(p.opt);
      o.comms_.all_reduce_host(o.exec_, o.comm_, v, reduce_op::max);
      if (o.tp_) o.comms_.all_reduce_host(o.exec_, *o.tp_, v, reduce_op::max);
      if (o.ep_) o.comms_.all_reduce_host(o.exec_, *o.ep_, v, reduce_op::max);
    };
    p.all_gather_fn = [](const party_t& p, std::span<const double> mine, std::span<double> grid) {
      Opt& o = *static_cast<Opt*>(p.opt);  // over DP, then TP, then EP: [part][DP rank]
      std::vector<double> all(mine.begin(), mine.end());
      for (auto* g : {&o.comm_, o.tp_ ? &*o.tp_ : nullptr, o.ep_ ? &*o.ep_ : nullptr}) {
        if (!g) continue;
        std::vector<double> more(all.size() * static_cast<std::size_t>(g->size()));
        o.comms_.all_gather_host(o.exec_, *g, std::span<const double>(all), std::span<double>(more));
        all = std::move(more);
      }
      std::copy(all.begin(), all.end(), grid.begin());
    };
    p.scalars_fn = [](const party_t& p) { return checkpoint_scalars(*static_cast<Opt*>(p.opt)); };
    p.items_fn = [](const party_t& p) {  // once the collectives in flight are done
      distopt::detail::wait_pending(*static_cast<Opt*>(p.opt));
      return checkpoint_items(*static_cast<Opt*>(p.opt), *static_cast<Stages*>(p.stages));
    };
    p.restore_fn = [](const party_t& p, const std::map<std::string, std::string, std::less<>>& state) {
      restore_checkpoint(*static_cast<Opt*>(p.opt), *static_cast<Stages*>(p.stages), state);
    };
    p.check_group_fn = [](const party_t& p, int g, const std::string& text) {
      stage_check_group(*static_cast<Opt*>(p.opt), *static_cast<Stages*>(p.stages), g, parse_checkpoint_group<Opt>(text));
    };
    return p;
  }
};

/// What `opt.save(dir)` and `opt.load(dir)` call (declared in optimizer.hpp), with the
/// optimizer's context and stages. A load first refuses gathered tensors (their views would
/// go stale; refused before anything is read) and drops ZeRO-3's prefetches.
template <class Context, class Stages>
struct checkpoint_files {
  static void save(Context& ctx, Stages& stages, const std::filesystem::path& dir, checkpoint_replace replace) {
    detail::save_checkpoint(checkpoint_access::party(ctx, stages), dir, replace);
  }
  static void load(Context& ctx, Stages& stages, const std::filesystem::path& dir) {
    distopt::detail::end_param_gathers(ctx, "load()");
    detail::load_checkpoint(checkpoint_access::party(ctx, stages), dir);
  }
};

/// Writes `opt`'s checkpoint into `dir` (collective): `opt.save(dir)`.
template <class Optimizer>
void save_checkpoint(Optimizer& opt, const std::filesystem::path& dir,
                     checkpoint_replace replace = checkpoint_replace::same_optimizer) {
  opt.save(dir, replace);
}

/// Loads `opt`'s state from the checkpoint in `dir` (collective): `opt.load(dir)`.
template <class Optimizer>
void load_checkpoint(Optimizer& opt, const std::filesystem::path& dir) {
  opt.load(dir);
}

}  // namespace distopt::io
