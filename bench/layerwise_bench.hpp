// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// Shared pieces of distopt-bench-layerwise (layerwise_step.cpp: time and memory traffic of
// the layer-wise step) and distopt-bench-layerwise-comm (layerwise_comm.cpp: the bytes
// the layer-wise statistics add to the communication).
//
// Every byte count here is derived from the policy's `phases` array (distopt/layerwise.hpp)
// and its `uses_slot`, `factored` and `state_slots` functions, plus the number types: the
// model follows the code when a policy changes its phases.

#include <distopt/distopt.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace lwbench {

// ---------------------------------------------------------------------------------------
// Shapes
// ---------------------------------------------------------------------------------------

/// GPT-like tensors of width d: an [8d, d] embedding, then `layers` layers of ln1 [d],
/// qkv [3d, d], qkv.bias [3d], proj [d, d], ln2 [d], fc [4d, d], fc.bias [4d],
/// fc_proj [d, 4d] (with d = 1024 and whole layers these are the shapes of bench::gpt_like).
/// With tp > 1, this TP rank's part under Megatron's splits: the embedding, qkv, fc and
/// their biases split along dim 0 (column-parallel linears store [out, in]), proj and
/// fc_proj along the last dim (row-parallel), the norms not split.
inline distopt::layout gpt_layers(int layers, std::int64_t d, distopt::dtype t, int tp = 1) {
  using distopt::tp_split;
  distopt::layout l;
  const auto add = [&](const std::string& name, std::vector<std::int64_t> shape, tp_split s) {
    if (tp <= 1) s = tp_split::none;
    if (s == tp_split::rows) shape.front() /= tp;
    if (s == tp_split::cols) shape.back() /= tp;
    l.add(name, std::move(shape), t, 0, s);
  };
  add("wte", {8 * d, d}, tp_split::rows);
  for (int i = 0; i < layers; ++i) {
    std::string p = "h";  // appended, not "h" + ...: GCC 12 warns -Wrestrict on the latter
    p += std::to_string(i);
    p += '.';
    add(p + "ln1", {d}, tp_split::none);
    add(p + "qkv", {3 * d, d}, tp_split::rows);
    add(p + "qkv.bias", {3 * d}, tp_split::rows);
    add(p + "proj", {d, d}, tp_split::cols);
    add(p + "ln2", {d}, tp_split::none);
    add(p + "fc", {4 * d, d}, tp_split::rows);
    add(p + "fc.bias", {4 * d}, tp_split::rows);
    add(p + "fc_proj", {d, 4 * d}, tp_split::cols);
  }
  return l;
}

/// Matrix geometry of a factored tensor of shape [..., R, C]: M matrices of R x C.
struct matrix_geometry {
  std::size_t matrices = 1, rows = 0, cols = 0;
};
inline matrix_geometry geometry(const distopt::tensor_slot& t) {
  matrix_geometry g;
  if (t.shape.size() < 2) return g;
  g.cols = static_cast<std::size_t>(t.shape.back());
  g.rows = static_cast<std::size_t>(t.shape[t.shape.size() - 2]);
  g.matrices = t.numel / (g.rows * g.cols);
  return g;
}

// ---------------------------------------------------------------------------------------
// Memory traffic of one step, per element, from the phases
// ---------------------------------------------------------------------------------------

/// Sizes of the number types: grads, params, state slots; master: an fp32 master copy is
/// the value updated (read and written), and the low-precision param is written from it.
struct number_sizes {
  double grad = 4, param = 4, state = 4;
  bool master = false;
};

/// Bytes one element moves in one pass, and the shape of that pass as the stream kernel
/// of the ceiling sees it: arrays only read, read and written back in place, only written.
struct access {
  double bytes = 0;
  int ro = 0, rw = 0, wo = 0;
  void read(double b) { bytes += b, ++ro; }
  void read_write(double b) { bytes += 2 * b, ++rw; }
  void write(double b) { bytes += b, ++wo; }
};

template <class Policy>
bool keeps_slot(const typename Policy::hyper_params& h, int k, bool factored) {
  return k < Policy::state_slots(h) && Policy::uses_slot(h, k, factored);
}

/// Pass `p` of Policy over one element of a tensor (factored or not). `grad`: count the
/// grad read (the loop loads it in every pass; see grad_use for which passes use it).
template <class Policy>
access phase_access(const typename Policy::hyper_params& h, std::size_t p, bool factored,
                    const number_sizes& z, bool grad = true) {
  const distopt::phase_spec s = Policy::phases[p];
  access a;
  if (grad) a.read(z.grad);
  const double value = z.master ? 4.0 : z.param;  // what the element function updates
  if (s.reads_param && s.writes_param) a.read_write(value);
  else if (s.reads_param) a.read(value);
  else if (s.writes_param) a.write(value);
  if (s.writes_param && z.master) a.write(z.param);
  for (int k = 0; k < Policy::max_state_slots; ++k) {
    if (!keeps_slot<Policy>(h, k, factored)) continue;  // not allocated: never moved
    const bool r = (s.reads_slots >> k) & 1u, w = (s.writes_slots >> k) & 1u;
    if (r && w) a.read_write(z.state);
    else if (r) a.read(z.state);
    else if (w) a.write(z.state);
  }
  return a;
}

/// The least any step can move: one pass reading grad, param and the kept state slots and
/// writing param and state (each slot read if some phase reads it, written if some writes it).
template <class Policy>
access one_pass_access(const typename Policy::hyper_params& h, bool factored, const number_sizes& z) {
  access a;
  a.read(z.grad);
  a.read_write(z.master ? 4.0 : z.param);
  if (z.master) a.write(z.param);
  for (int k = 0; k < Policy::max_state_slots; ++k) {
    if (!keeps_slot<Policy>(h, k, factored)) continue;
    bool r = false, w = false;
    for (const distopt::phase_spec& s : Policy::phases) {
      r = r || ((s.reads_slots >> k) & 1u);
      w = w || ((s.writes_slots >> k) & 1u);
    }
    if (r && w) a.read_write(z.state);
    else if (r) a.read(z.state);
    else if (w) a.write(z.state);
  }
  return a;
}

/// An element-wise policy (one fused pass) with `slots` state slots: AdamW's 28 B (fp32).
inline access elementwise_access(int slots, const number_sizes& z) {
  access a;
  a.read(z.grad);
  a.read_write(z.master ? 4.0 : z.param);
  if (z.master) a.write(z.param);
  for (int k = 0; k < slots; ++k) a.read_write(z.state);
  return a;
}

/// Does element<P, Factored> use its grad? Probed: the function runs twice on the same
/// inputs but the grad, and any difference in param, state or sums means it does. The
/// engine's loop loads the grad in every pass; where the element function ignores it the
/// compiler drops the load, so those passes do not move the grad.
template <class Policy, int P, bool Factored>
bool element_uses_grad(const typename Policy::hyper_params& h) {
  const auto sc = Policy::prepare(h, distopt::step_info{10, false});
  float tv[8], rv[8], cv[8];
  for (int k = 0; k < 8; ++k) tv[k] = rv[k] = cv[k] = 1.25f + 0.125f * static_cast<float>(k);
  const auto run = [&](float g, float (&out)[21]) {
    float p = 0.375f;
    float st[4] = {0.25f, 0.5f, 0.75f, 1.0f};
    float sums[16] = {};
    Policy::template element<P, Factored>(sc, distopt::element_stats{tv, rv, cv}, p, g, st, sums);
    out[0] = p;
    std::memcpy(out + 1, st, sizeof st);
    std::memcpy(out + 5, sums, sizeof sums);
  };
  float a[21], b[21];
  run(0.5f, a);
  run(-0.75f, b);
  return std::memcmp(a, b, sizeof a) != 0;
}

/// grad_use[p][factored]: whether pass p's element function uses the grad.
template <class Policy>
std::vector<std::array<bool, 2>> grad_use(const typename Policy::hyper_params& h) {
  std::vector<std::array<bool, 2>> out(Policy::phases.size());
  [&]<int... P>(std::integer_sequence<int, P...>) {
    ((out[P] = {element_uses_grad<Policy, P, false>(h), element_uses_grad<Policy, P, true>(h)}), ...);
  }(std::make_integer_sequence<int, static_cast<int>(Policy::phases.size())>{});
  return out;
}

/// Elements of the layout in factored and in unfactored tensors.
template <class Policy>
std::array<double, 2> numel_by_class(const distopt::layout& l, const typename Policy::hyper_params& h) {
  std::array<double, 2> n{};
  for (const auto& t : l.tensors()) n[Policy::factored(h, t.shape) ? 1 : 0] += static_cast<double>(t.numel);
  return n;
}

// ---------------------------------------------------------------------------------------
// Statistics on the wire
// ---------------------------------------------------------------------------------------

/// Doubles per exact sum on the wire (distopt::detail::fixed_sum: ten limbs and a NaN/Inf term).
inline constexpr std::size_t wire_doubles = 11;

/// Per tensor of the layout, its place relative to data-parallel shard cuts, worked out
/// from the layout by the rule detail/shard_plan.hpp documents (buckets of whole tensors
/// closed once they reach bucket_elems, each cut into d shards of whole blocks).
struct dp_place {
  std::vector<bool> straddles;  ///< its elements lie in more than one rank's shard
  std::vector<bool> local;      ///< rank `rank` holds some of its elements
};
inline dp_place place_tensors(const distopt::layout& l, std::size_t d, std::size_t rank, std::size_t bucket_elems) {
  const std::size_t block = l.block_size();
  const auto tensors = l.tensors();
  dp_place p;
  p.straddles.assign(tensors.size(), false);
  p.local.assign(tensors.size(), false);
  for (std::size_t t = 0; t < tensors.size();) {
    const std::size_t first = t, begin = tensors[t].offset;
    std::size_t end = begin;
    do {
      end = tensors[t].offset + (tensors[t].numel + block - 1) / block * block;
      ++t;
    } while (t < tensors.size() && end - begin < bucket_elems);
    const std::size_t shard = ((end - begin) / block + d - 1) / d * block;
    for (std::size_t i = first; i < t; ++i) {
      const std::size_t lo = tensors[i].offset - begin, hi = lo + tensors[i].numel - 1;
      p.straddles[i] = lo / shard != hi / shard;
      p.local[i] = lo / shard <= rank && rank <= hi / shard;
    }
  }
  return p;
}

/// The exact sums one step puts on the wire, counted from the phases: over DP, every sum
/// of the tensors whose elements several ranks hold (tensor sums, and per row and per
/// column of factored matrices); over TP, the tensor sums of split tensors, the row sums
/// of matrices split along columns and the column sums of matrices split along rows, and
/// per matrix split along rows one total of each row state (phases with row_state_totals).
/// Times wire_doubles * 8 bytes. For rank `rank` of d (the TP part depends on what the
/// rank holds: a tensor it holds no element of sends only its tensor sums over TP, unless
/// it straddles DP shards).
struct wire_model {
  std::size_t dp_sums = 0, tp_sums = 0;
  std::size_t dp_bytes() const { return dp_sums * wire_doubles * sizeof(double); }
  std::size_t tp_bytes() const { return tp_sums * wire_doubles * sizeof(double); }
  std::size_t bytes() const { return dp_bytes() + tp_bytes(); }
};

template <class Policy>
wire_model statistics_wire(const distopt::layout& l, const typename Policy::hyper_params& h, std::size_t d,
                           std::size_t rank, std::size_t bucket_elems, int tp) {
  wire_model w;
  const auto tensors = l.tensors();
  const dp_place place = place_tensors(l, d, rank, bucket_elems);
  for (const distopt::phase_spec& s : Policy::phases) {
    const bool sums = s.tensor_sums + s.row_sums + s.col_sums > 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      const bool factored = Policy::factored(h, t.shape);
      const matrix_geometry g = geometry(t);
      const std::size_t rows = factored ? s.row_sums * g.matrices * g.rows : 0;
      const std::size_t cols = factored ? s.col_sums * g.matrices * g.cols : 0;
      if (sums && d > 1 && place.straddles[i]) w.dp_sums += s.tensor_sums + rows + cols;
      if (tp <= 1 || t.tp == distopt::tp_split::none) continue;
      const bool split_rows = factored && t.tp == distopt::tp_split::rows && t.shape.size() == 2;
      const bool split_cols = factored && t.tp == distopt::tp_split::cols;
      const bool sized = place.local[i] || (d > 1 && place.straddles[i]);
      if (sums) {
        w.tp_sums += s.tensor_sums;
        if (sized && split_cols) w.tp_sums += rows;
        if (sized && split_rows) w.tp_sums += cols;
      }
      if (s.row_state_totals && Policy::row_states > 0 && split_rows && place.local[i])
        w.tp_sums += static_cast<std::size_t>(Policy::row_states) * g.matrices;
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------

struct timing {
  double best = 0, median = 0;
};

template <class F>
timing time_repeats(int repeats, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

inline std::string precision_name(bool low, bool master) {
  return low ? (master ? "bf16+master" : "bf16+sr") : "fp32";
}

}  // namespace lwbench
