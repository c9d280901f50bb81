// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The projection stage of distopt::optimizer (GaLore): the 2-D tensors of groups
/// with a rank. policy/galore_adamw.hpp includes it; other optimizers never parse it.
///
/// Every rank holding part of such a matrix gets its whole reduced gradient (sharded
/// storage all-gathers the reduced grads of the buckets holding one: (d-1)/d of their
/// bytes more than ZeRO's step), projects it, updates the low-rank Adam states and
/// projects back the same way (so every rank computes the same bits, for any d), and
/// applies the update to its own elements of the master weights / params. With `owned`
/// storage each matrix lies whole on one rank: its grads are reduced there, nothing is
/// gathered, and one rank in the job computes its SVD and keeps its low-rank states.
///
/// On a device executor (emulated_device, cuda) the same steps run on the executor's
/// memory: the grads' scaling, the low-rank Adam and the update as phases (below), the
/// products and the SVD through matrix_ops<Exec> (cuBLAS and cuSOLVER on cuda), with the
/// low-rank states and the projection in device buffers. The host keeps a mirror of both,
/// filled by explicit copies when a checkpoint, projected_state or projector reads them.

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
#include "../exec/transfer.hpp"
#include "../layout/registry.hpp"
#include "../memory_report.hpp"
#include "../shard_view.hpp"
#include "../types/rounding.hpp"
#include "../detail/buffer.hpp"
#include "../detail/matrix_ops.hpp"
#include "../detail/q8_loop.hpp"
#include "../detail/shard_plan.hpp"
#include "../detail/update_loop.hpp"
#include "elementwise.hpp"
#include "phases.hpp"
#include "q8.hpp"
#include "stages.hpp"

namespace distopt::detail {

/// data[e] *= scale (a projected matrix's scaled grads, its update times GaLore's scale).
struct scale_phase : chunked {
  float* data = nullptr;
  float scale = 1.0f;
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    float* d = data + c * chunk;
    for (std::size_t i = first; i < last; ++i) d[i] = d[i] * scale;
  }
};

/// Adam on the projected gradient: low[e] becomes Policy::moments of it and the two fp32
/// low-rank states.
template <class Policy>
struct low_rank_moments_phase : chunked {
  typename Policy::scalars s{};
  float* low = nullptr;
  float* state0 = nullptr;
  float* state1 = nullptr;
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    const std::size_t at = c * chunk;
    for (std::size_t i = at + first; i < at + last; ++i) {
      float st[2] = {state0[i], state1[i]};
      low[i] = Policy::moments(s, low[i], st);
      state0[i] = st[0];
      state1[i] = st[1];
    }
  }
};

/// The projected-back update `back` (the whole m x n matrix) applied to this rank's pieces
/// of it: Policy::apply on each element's fp32 value, then stored as the update phase
/// stores (master weights, stochastic rounding keyed by layout index). Items are runs of
/// `chunk` elements of a piece, so that a device spreads a whole matrix (one piece when
/// replicated) over its blocks; a matrix has a few pieces (one per rank it is cut over).
template <class Policy, param_mode Mode, class Param>
struct projected_apply_phase {
  typename Policy::scalars s{};
  const shard_piece* pieces = nullptr;  ///< the matrix's first piece on this rank
  std::size_t piece_count = 0;          ///< its pieces on this rank
  std::size_t chunk = 4096;
  std::size_t tensor_offset = 0;  ///< the matrix's first layout index
  const float* back = nullptr;
  Param* params = nullptr;
  bool params_local = false;  ///< params indexed by local index (ZeRO-3), else buffer index
  float* master = nullptr;  ///< null without master weights
  std::uint64_t key = 0;

  /// Items over all the pieces.
  std::size_t items(const shard_piece* host_pieces) const noexcept {
    std::size_t n = 0;
    for (std::size_t k = 0; k < piece_count; ++k) n += (host_pieces[k].count + chunk - 1) / chunk;
    return n;
  }
  /// Item c's piece and its first element there.
  struct run {
    const shard_piece* piece;
    std::size_t first, count;
  };
  DISTOPT_HD run run_of(std::size_t c) const noexcept {
    std::size_t k = 0;
    for (; k + 1 < piece_count; ++k) {
      const std::size_t in_piece = (pieces[k].count + chunk - 1) / chunk;
      if (c < in_piece) break;
      c -= in_piece;
    }
    const std::size_t first = c * chunk, left = pieces[k].count - first;
    return {pieces + k, first, left < chunk ? left : chunk};
  }
  DISTOPT_HD std::size_t size(std::size_t c) const noexcept { return run_of(c).count; }
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    const run r = run_of(c);
    const shard_piece& pc = *r.piece;
    const float* u = back + (pc.layout - tensor_offset);
    Param* p = params + (params_local ? pc.local : pc.buffer);
    float* m = master ? master + pc.local : nullptr;
    for (std::size_t e = r.first + first; e < r.first + last; ++e) {
      float value = Mode == param_mode::master ? m[e] : to_float(p[e]);
      Policy::apply(s, value, u[e]);
      store_param<Mode>(p, m, e, value, key, pc.layout);
    }
  }
};

/// The projection stage of an optimizer<Policy, ...> with element states of type State
/// (float, bf16, or q8: codes for the low-rank states of at least min_8bit_size elements)
/// on executor Exec: the matrices of the groups with a rank. The other tensors are the
/// element stage's.
template <class Policy, class State, class Exec>
struct projection_stage {
  using projector_type = typename matrix_projector<Policy>::type;
  /// On a device the projection's factors and the fp32 low-rank states live in its memory
  /// (device_matrix), and the projector's factors and projected_matrix's states are the
  /// host's copies (pull, push_all); on a host they are the only ones.
  static constexpr bool on_device = !host_memory<Exec>;
  static_assert(sizeof(matrix_ops<Exec>) > 0);  // its check: the executor's matrix operations are included
  struct projected_matrix {
    std::size_t tensor = 0;
    std::int64_t m = 0, n = 0;
    projector_type proj;
    std::array<std::vector<float>, 2> state;  // fp32 low-rank states (a device's: their host copy)
    std::array<std::vector<std::uint8_t>, 2> codes;  // q8 instead (at least min_8bit_size elements)
    std::array<std::vector<float>, 2> absmax;
    bool held() const noexcept { return !state[0].empty() || !codes[0].empty(); }  // this rank holds part of it
  };
  /// A projected matrix's memory on a device (nothing on a host, and on other ranks' matrices).
  struct device_matrix {
    std::array<buffer<float, Exec>, 2> state;  // the fp32 low-rank states
    buffer<float, Exec> q, p;                  // the projection's factors (by side)
    bool ready = false;         // a projection has been computed (galore_projector::has_ortho)
    bool host_current = true;   // proj's factors on the host are these
  };

  /// Memory report: each projected matrix's low-rank states (fp32, or q8 codes and
  /// absmax), projection and one work buffer (the largest) that every rank holding the
  /// matrix keeps. The element states of the other tensors are reported as usual.
  template <class Ctx>
  void add_memory(const Ctx&, memory_report& r) const {
    std::size_t states = 0, projections = 0, work = 0;
    for (std::size_t j = 0; j < matrices_.size(); ++j) {
      const projected_matrix& t = matrices_[j];
      if (!t.held()) continue;  // another rank's matrix
      for (int k = 0; k < 2; ++k)
        states += t.state[k].size() * sizeof(float) + t.codes[k].size() + t.absmax[k].size() * sizeof(float);
      if constexpr (on_device)  // allocated with the states
        projections += (device_[j].q.size() + device_[j].p.size()) * sizeof(float);
      else  // after the first step
        projections += (t.proj.left().size() + t.proj.right().size()) * sizeof(float);
      work = std::max(work, work_floats(t) * sizeof(float));
    }
    r.entries.push_back({"state projected", states});
    r.entries.push_back({"projections", projections});
    r.entries.push_back({"projection work", work});
    if (gathered_.size() > 0) r.entries.push_back({"projection gather", gathered_.bytes()});
  }

  /// The floats of one matrix's work buffer: its grads and its update (m x n each), its
  /// projection (low-rank), and for the full side the product between its two.
  static std::size_t work_floats(const projected_matrix& pm) {
    const auto low = pm.proj.low_rank_shape(pm.m, pm.n);
    std::size_t n = static_cast<std::size_t>(2 * pm.m * pm.n + low[0] * low[1]);
    if (pm.proj.side_for(pm.m, pm.n) == decltype(pm.proj.side_for(0, 0))::full)
      n += static_cast<std::size_t>(std::max(pm.proj.rank() * pm.n, pm.m * pm.proj.rank()));
    return n;
  }

  /// Device executors: the factor buffers of matrix pm for its projector's side and rank
  /// (Q m x r, P r x n, by side), made at init and remade when a checkpoint's hyper-parameters
  /// change the side.
  template <class Ctx>
  static void size_factors(Ctx& o, const projected_matrix& pm, device_matrix& dm) {
    const auto side = pm.proj.side_for(pm.m, pm.n);
    const std::int64_t r = pm.proj.rank();
    const std::size_t q = side != decltype(side)::right ? static_cast<std::size_t>(pm.m * r) : 0;
    const std::size_t p = side != decltype(side)::left ? static_cast<std::size_t>(r * pm.n) : 0;
    if (dm.q.size() != q) dm.q = q ? buffer<float, Exec>(o.exec_, q) : buffer<float, Exec>();
    if (dm.p.size() != p) dm.p = p ? buffer<float, Exec>(o.exec_, p) : buffer<float, Exec>();
  }

  template <class Ctx>
  const projected_matrix& matrix_of(const Ctx& o, std::string_view name) const {
    const std::size_t i = o.index_of(name);
    if (o.states_at_.matrix_index()[i] < 0)
      throw std::out_of_range(std::string(Policy::name) + ": tensor '" + std::string(name) +
                              "' is not projected (not a matrix of a group with a rank)");
    return matrices_[static_cast<std::size_t>(o.states_at_.matrix_index()[i])];
  }

  template <class Ctx>
  void init(Ctx& o) {
    const auto tensors = o.layout_.tensors();
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
      device_matrix dm;
      const auto low = pm.proj.low_rank_shape(pm.m, pm.n);  // checks the rank against the shape
      // Its low-rank states live on the ranks that hold part of it.
      const bool held = !o.plan_.pieces_of(i).empty();
      const std::size_t ln = static_cast<std::size_t>(low[0] * low[1]);
      if (held && Ctx::is_quantized && ln >= o.options_.min_8bit_size) {
        for (int k = 0; k < 2; ++k) {  // the low-rank matrix in blocks of 256, as a tensor's
          pm.codes[k].assign(ln, q8_slot_codebook<Policy>(k).zero_code());
          pm.absmax[k].assign((ln + q8::block - 1) / q8::block, 0.0f);
        }
      } else if (held) {
        for (auto& st : pm.state) st.assign(ln, 0.0f);
        if constexpr (on_device)
          for (auto& st : dm.state) st = buffer<float, Exec>(o.exec_, ln);
      }
      if (held && on_device) size_factors(o, pm, dm);
      o.states_at_.matrix_index()[i] = static_cast<int>(matrices_.size());
      matrices_.push_back(std::move(pm));
      device_.push_back(std::move(dm));
    }
    ortho_staging_.resize(matrices_.size());
    // fp32 reduced grads (accumulated with reduce_each, or reduced with grad_reduce_in_fp32)
    // are this rank's shard: a sharded bucket's are gathered into gathered_ for its
    // projection (ZeRO-2's fp32 grads: a pooled buffer instead).
    const bool pooled = o.shards_grads() && std::is_same_v<typename Ctx::grad_type, float>;
    std::size_t gathered = 0;
    if (Ctx::is_sharded && o.comm_.size() > 1 && o.grads_in_fp32() && !pooled)
      for (const auto& b : o.plan_.buckets())
        if (!b.owned() && o.states_at_.any_whole_matrix(b.first_tensor, b.end_tensor))
          gathered = std::max(gathered, b.padded());
    if (gathered > 0) gathered_ = buffer<float, Exec>(o.exec_, gathered);
  }

  /// The projector of matrix `name`, its factors copied from the executor's memory first
  /// where those are newer.
  template <class Ctx>
  const projector_type& projector_of(const Ctx& o, std::string_view name) const {
    const projected_matrix& pm = matrix_of(o, name);
    pull(o, static_cast<std::size_t>(o.states_at_.matrix_index()[pm.tensor]), false);
    return pm.proj;
  }

  /// Device executors: copies matrix j's projection (when the device's is newer) and, with
  /// `states`, its fp32 low-rank states into the host's copies (checkpoints read them).
  template <class Ctx>
  void pull(const Ctx& o, std::size_t j, bool states) const {
    if constexpr (!on_device) return;
    projected_matrix& pm = matrices_[j];
    device_matrix& dm = device_[j];
    if (!dm.ready || (dm.host_current && !states)) return;
    Exec& e = o.exec_;  // mutable in the context: a handle
    if constexpr (on_device)
      if (states)
        for (int k = 0; k < 2; ++k)
          copy_bytes(e, pm.state[k].data(), dm.state[k].data(), pm.state[k].size() * sizeof(float));
    if (!dm.host_current) {
      std::vector<float> q(dm.q.size()), p(dm.p.size());
      copy_bytes(e, q.data(), dm.q.data(), q.size() * sizeof(float));
      copy_bytes(e, p.data(), dm.p.data(), p.size() * sizeof(float));
      pm.proj.set_ortho(pm.m, pm.n, std::move(q), std::move(p));
      dm.host_current = true;
    }
  }
  template <class Ctx>
  void pull_all(const Ctx& o) const {
    for (std::size_t j = 0; j < device_.size(); ++j) pull(o, j, true);
  }

  /// Copies the host's copies (a checkpoint just installed there) to a device: the fp32
  /// low-rank states, and the projection if the checkpoint had one.
  template <class Ctx>
  void push_all(Ctx& o) {
    for (std::size_t j = 0; j < device_.size(); ++j) {
      projected_matrix& pm = matrices_[j];
      device_matrix& dm = device_[j];
      if (!pm.held()) continue;  // another rank's matrix
      dm.ready = pm.proj.has_ortho();
      if constexpr (!on_device) continue;
      size_factors(o, pm, dm);  // the checkpoint's proj_type may project on another side
      for (int k = 0; k < 2; ++k)
        copy_bytes(o.exec_, dm.state[k].data(), pm.state[k].data(), pm.state[k].size() * sizeof(float));
      if (dm.ready) {
        copy_bytes(o.exec_, dm.q.data(), pm.proj.left().data(), dm.q.size() * sizeof(float));
        copy_bytes(o.exec_, dm.p.data(), pm.proj.right().data(), dm.p.size() * sizeof(float));
      }
      dm.host_current = true;
    }
  }

  /// State slot `k` of matrix `name`'s low-rank states, decoded to fp32.
  template <class Ctx>
  std::vector<float> state_values(const Ctx& o, std::string_view name, int k) const {
    const projected_matrix& pm = matrix_of(o, name);
    const std::size_t slot = static_cast<std::size_t>(k);
    if constexpr (on_device) {
      const device_matrix& dm = device_[static_cast<std::size_t>(o.states_at_.matrix_index()[pm.tensor])];
      std::vector<float> out(dm.state[slot].size());
      copy_bytes(o.exec_, out.data(), dm.state[slot].data(), out.size() * sizeof(float));
      return out;
    }
    if (pm.codes[slot].empty()) return pm.state[slot];
    std::vector<float> out(pm.codes[slot].size());
    decode_blocks(q8_slot_codebook<Policy>(k).values().data(), pm.codes[slot].data(), pm.absmax[slot].data(), out.size(),
                  out.data());
    return out;
  }

  /// The projection runs on each bucket before its element update.
  static constexpr bool runs_between_buckets = true;
  template <param_mode Mode, class Ctx, class G>
  void run_bucket(Ctx& o, const step_inputs<Policy, G>& in, const shard_bucket& b) {
    project_bucket<Mode>(o, *in.host_scalars, in.grads, in.grads_local, in.grad_scale, in.key, b);
  }

  /// The projected matrices of bucket `b`: gather their reduced grads (sharded), then per
  /// matrix: project, update the low-rank states, project back, apply to this rank's part.
  /// `grads` are the reduced grads the step reads (`in.grads`): by buffer index the full
  /// grads (stages 0-1), gathered in place when sharded; by local index this rank's shard
  /// (ZeRO-2's grads, or fp32 ones accumulated or reduced in fp32). An owned bucket's shard
  /// is its own run of matrices, all it projects; a sharded bucket's shards are gathered
  /// into a buffer of the grad pool (ZeRO-2's grads, lent for the bucket's projection
  /// only) or, fp32, into gathered_.
  template <detail::param_mode Mode, class Ctx, class G>
  void project_bucket(Ctx& o, const std::vector<typename Policy::scalars>& sc, const G* grads, bool grads_local,
                      float grad_scale, std::uint64_t key, const detail::shard_bucket& b) {
    using grad_type = typename Ctx::grad_type;
    if (!o.states_at_.any_whole_matrix(b.first_tensor, b.end_tensor)) return;
    const std::size_t k = static_cast<std::size_t>(&b - o.plan_.buckets().data()), me = o.plan_.rank();
    const bool gather = Ctx::is_sharded && o.comm_.size() > 1 && !b.owned();  // owned: each matrix its owner's
    const bool pooled = gather && grads_local && o.shards_grads() && std::is_same_v<G, grad_type>;
    struct lent {  // the pooled buffer goes back however the projection ends
      Ctx& o;
      std::size_t k;
      bool on;
      ~lent() {
        if (on) o.grad_pool_.release(k);
      }
    } guard{o, k, pooled};
    const G* g = nullptr;  // bucket element x at g[x - from]
    std::size_t from = 0;
    if (!grads_local) {  // the full grads: grads_ itself
      if constexpr (std::is_same_v<G, grad_type>) {
        grad_type* full = o.grads_.data() + b.buffer_begin;
        if (gather)
          o.comms_.all_gather(o.exec_, o.comm_, std::span<const G>(full + b.shard_begin(me), b.shard_elems),
                              std::span<G>(full, b.padded()), nullptr, nullptr);
        g = full;
      }
    } else if (!gather) {  // one shard holds all this rank projects
      g = grads + b.local_begin;
      from = b.owned() ? b.shard_begin(me) : 0;
    } else {
      G* full = nullptr;
      if constexpr (std::is_same_v<G, grad_type>) {
        bool dirty = false;  // every element is overwritten by the gather
        if (pooled) full = o.grad_pool_.acquire(o.exec_, k, dirty);
      }
      if constexpr (std::is_same_v<G, float>) {
        if (!pooled) full = gathered_.data();
      }
      o.comms_.all_gather(o.exec_, o.comm_, std::span<const G>(grads + b.local_begin, b.shard_elems),
                          std::span<G>(full, b.padded()), nullptr, nullptr);
      g = full;
    }
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      const detail::piece_range mine = o.plan_.pieces_of(i);
      const int j = o.states_at_.matrix_index()[i];
      if (j < 0 || mine.empty()) continue;  // not projected, or another rank's
      const tensor_slot& t = o.layout_.tensors()[i];
      const float scale = o.clip_scale_.empty() ? grad_scale : grad_scale * o.clip_scale_[i];
      const G* at = g + (o.plan_.tensor_buffer(i) - b.buffer_begin - from);
      if constexpr (std::is_same_v<G, grad_type>)
        update_matrix<Mode>(o, static_cast<std::size_t>(j), sc[static_cast<std::size_t>(t.group)], scale, key, mine, at,
                            nullptr);
      else
        update_matrix<Mode>(o, static_cast<std::size_t>(j), sc[static_cast<std::size_t>(t.group)], scale, key, mine,
                            nullptr, at);
    }
  }

  /// The element chunk of the stage's phases.
  static constexpr std::size_t chunk = 4096;

  /// Adam on the `ln` elements of the projected gradient `low`, with fp32 states s0, s1.
  template <class Ctx>
  static void launch_moments(Ctx& o, const typename Policy::scalars& s, float* low, std::size_t ln, float* s0,
                             float* s1) {
    low_rank_moments_phase<Policy> mo;
    mo.n = ln;
    mo.chunk = chunk;
    mo.s = s;
    mo.low = low;
    mo.state0 = s0;
    mo.state1 = s1;
    launch(o.exec_, mo.items(), mo);
  }

  /// The update `back` of the matrix at layout index `tensor_offset` applied to this
  /// rank's pieces of it, `mine`.
  template <param_mode Mode, class Ctx>
  static void launch_apply(Ctx& o, const typename Policy::scalars& s, std::uint64_t key, piece_range mine,
                           std::size_t tensor_offset, const float* back) {
    projected_apply_phase<Policy, Mode, typename Ctx::param_type> ap;
    ap.s = s;
    ap.pieces = o.exec_pieces() + mine.first;
    ap.piece_count = mine.end - mine.first;
    ap.chunk = chunk;
    ap.tensor_offset = tensor_offset;
    ap.back = back;
    ap.params = o.params_.data();
    ap.params_local = o.shards_params();
    ap.master = o.uses_master() ? o.master_.data() : nullptr;
    ap.key = key;
    launch(o.exec_, ap.items(o.plan_.pieces().data() + mine.first), ap);
  }

  /// One matrix's step, on every executor: its reduced grads (`grads`, or fp32 `grads32`)
  /// widened and scaled, its projection refreshed when due (the SVD), its projection, the low-rank
  /// Adam, its projection back and the update of this rank's part, as phases and through
  /// matrix_ops<Exec> on the executor's memory (BLAS and LAPACK on the host's and the
  /// emulated device's, the same bits; cuBLAS and cuSOLVER, which sum in their own order,
  /// on cuda). 8-bit low-rank states (executors of host memory only) are updated by the
  /// host per block of 256.
  template <param_mode Mode, class Ctx>
  void update_matrix(Ctx& o, std::size_t j, const typename Policy::scalars& s, float scale, std::uint64_t key,
                     piece_range mine, const typename Ctx::grad_type* grads, const float* grads32) {
    projected_matrix& pm = matrices_[j];
    device_matrix& dm = device_[j];
    Exec& e = o.exec_;
    const tensor_slot& t = o.layout_.tensors()[pm.tensor];
    const std::int64_t m = pm.m, n = pm.n, r = pm.proj.rank();
    const auto side = pm.proj.side_for(m, n);
    const auto low_shape = pm.proj.low_rank_shape(m, n);
    const std::size_t mn = t.numel, ln = static_cast<std::size_t>(low_shape[0] * low_shape[1]);
    if (work_dev_.size() < work_floats(pm)) work_dev_ = buffer<float, Exec>(e, work_floats(pm));
    float* full = work_dev_.data();
    float* low = full + mn;
    float* back = low + ln;
    float* between = back + mn;
    const auto scale_all = [&](float* data, std::size_t count, float by) {
      if (by == 1.0f) return;  // x * 1 is x
      scale_phase sp;
      sp.n = count;
      sp.chunk = chunk;
      sp.data = data;
      sp.scale = by;
      launch(e, sp.items(), sp);
    };
    const auto widen = [&](const auto* src) {
      widen_phase<std::remove_cv_t<std::remove_pointer_t<decltype(src)>>> w;
      w.n = mn;
      w.chunk = chunk;
      w.src = src;
      w.dst = full;
      launch(e, w.items(), w);
    };
    if (grads32) widen(grads32);
    else widen(grads);
    scale_all(full, mn, scale);
    if (!dm.ready || (o.step_ - 1) % pm.proj.update_proj_gap() == 0) {  // galore_projector::refresh_due
      if constexpr (on_device) {
        matrix_ops<Exec>::svd_factors(e, full, m, n, r, dm.q.size() ? dm.q.data() : nullptr,
                                      dm.p.size() ? dm.p.data() : nullptr);
        dm.host_current = false;
      } else {  // into the projector, the factors' one copy on a host
        std::vector<float> q(side != decltype(side)::right ? static_cast<std::size_t>(m * r) : 0);
        std::vector<float> p(side != decltype(side)::left ? static_cast<std::size_t>(r * n) : 0);
        matrix_ops<Exec>::svd_factors(e, full, m, n, r, q.empty() ? nullptr : q.data(), p.empty() ? nullptr : p.data());
        pm.proj.set_ortho(m, n, std::move(q), std::move(p));
      }
      dm.ready = true;
    }
    const float* q = on_device ? dm.q.data() : pm.proj.left().data();
    const float* p = on_device ? dm.p.data() : pm.proj.right().data();
    const auto gemm = [&e](bool ta, bool tb, std::int64_t rows, std::int64_t cols, std::int64_t inner, const float* a,
                           std::int64_t lda, const float* b, std::int64_t ldb, float* c) {
      matrix_ops<Exec>::gemm(e, ta, tb, rows, cols, inner, a, lda, b, ldb, c);
    };
    projector_type::project_products(gemm, side, m, n, r, q, p, full, low, between);
    if (!pm.codes[0].empty()) {
      // 8-bit low-rank states: per block of 256, decode, update, new absmax, encode.
      alignas(64) float st2[2][q8::block];
      for (std::size_t b0 = 0; b0 < ln; b0 += q8::block) {
        const std::size_t count = std::min(q8::block, ln - b0), blk = b0 / q8::block;
        for (int k = 0; k < 2; ++k)
          detail::decode_block(q8_slot_codebook<Policy>(k).values().data(), pm.codes[k].data() + b0, pm.absmax[k][blk],
                               count, st2[k]);
        for (std::size_t i = 0; i < count; ++i) {
          float st[2] = {st2[0][i], st2[1][i]};
          low[b0 + i] = Policy::moments(s, low[b0 + i], st);
          st2[0][i] = st[0];
          st2[1][i] = st[1];
        }
        for (int k = 0; k < 2; ++k)
          detail::requantize_block(st2[k], count, q8_slot_codebook<Policy>(k).lookup(), pm.absmax[k][blk],
                                   pm.codes[k].data() + b0);
      }
    } else if constexpr (on_device) {
      launch_moments(o, s, low, ln, dm.state[0].data(), dm.state[1].data());
    } else {
      launch_moments(o, s, low, ln, pm.state[0].data(), pm.state[1].data());
    }
    projector_type::project_back_products(gemm, side, m, n, r, q, p, low, back, between);
    scale_all(back, mn, static_cast<float>(pm.proj.scale()));  // tensor * Python float: a float multiply
    launch_apply<Mode>(o, s, key, mine, t.offset, back);
  }

  // mutable: a device executor's projection and states are copied into the host mirror
  // when read (pull), through const accessors too.
  mutable std::vector<projected_matrix> matrices_;  // the projected matrices
  mutable std::vector<device_matrix> device_;       // their memory in the executor's
  buffer<float, Exec> work_dev_;  // one matrix's gradient, low-rank, update and a product between
  buffer<float, Exec> gathered_;  // a sharded bucket's fp32 reduced grads, gathered (reduce_each, grad_reduce_in_fp32)
  std::vector<std::array<std::vector<float>, 3>> ortho_staging_;  // projections being loaded
};

/// Marks the projection stage as included (optimizer.hpp checks it with a clear message).
template <class Policy>
struct stage_included<Policy, projection_stage_tag> : std::true_type {};

}  // namespace distopt::detail
