// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The phases of a step that visit elements, each written once as a trivially
/// copyable body with `DISTOPT_HD` members, and `detail::launch`, which runs one on any
/// executor. A body holds only pointers into the executor's memory and scalars, so the
/// same object is a host loop's functor and a device kernel's argument.
///
/// A phase is a list of work items (a chunk of a flat array, a piece of a tensor); item c
/// has `size(c)` units (elements, or the 8-bit phase's blocks of 256), and
/// `body(c, first, last)` does units [first, last) of it.
/// A host executor calls body(c, 0, size(c)) once per item: one contiguous loop, the
/// vectorised (and AVX2-cloned) code of the CPU path. A device executor cuts each item
/// over its threads. Which thread does which elements never changes a result: every
/// element's math is independent, and a reduction phase has items of size 1 whose body
/// sums in its own fixed order.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/exact_sum.hpp"
#include "../detail/shard_plan.hpp"
#include "../detail/update_loop.hpp"
#include "decisions.hpp"
#include "state_layout.hpp"
#include "../types/rounding.hpp"

namespace distopt::detail {

/// Runs phase `p` over its work items [0, items) on executor `e`: through `e.launch` where
/// the executor has one (a device kernel), else through `e.parallel_for`, one item per call.
template <executor E, class Phase>
void launch(E& e, std::size_t items, const Phase& p) {
  static_assert(std::is_trivially_copyable_v<Phase>,
                "distopt: a phase is copied to the device as a kernel argument: it must be trivially copyable");
  if (items == 0) return;
  if constexpr (requires { e.launch(items, p); }) e.launch(items, p);
  else e.parallel_for(items, [&p](std::size_t c) { p(c, 0, p.size(c)); });
}

/// A flat array of `n` elements in items of `chunk` (the last one shorter).
struct chunked {
  std::size_t n = 0, chunk = 1;
  std::size_t items() const noexcept { return (n + chunk - 1) / chunk; }
  DISTOPT_HD std::size_t size(std::size_t c) const noexcept {
    const std::size_t left = n - c * chunk;
    return left < chunk ? left : chunk;
  }
};

/// Sets every element of `data` to `value` (zero_grad; q8 codes start as the code of 0).
template <class T>
struct fill_phase : chunked {
  T* data = nullptr;
  T value{};
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    T* p = data + c * chunk;
    const T v = value;
    for (std::size_t i = first; i < last; ++i) p[i] = v;
  }
};

/// Zeroes `n` elements at `p` in executor `e`'s memory, in items of `chunk`.
template <executor E, class T>
void fill_zero(E& e, T* p, std::size_t n, std::size_t chunk = std::size_t{1} << 14) {
  fill_phase<T> zero;
  zero.n = n;
  zero.chunk = chunk;
  zero.data = p;
  launch(e, zero.items(), zero);
}

/// Converts `src` to fp32 into `dst` (the staging bucket of an fp32 grad reduction).
template <class G>
struct widen_phase : chunked {
  const G* src = nullptr;
  float* dst = nullptr;
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    const G* s = src + c * chunk;
    float* d = dst + c * chunk;
    for (std::size_t i = first; i < last; ++i) d[i] = to_float(s[i]);
  }
};

/// Adds `src` into the fp32 accumulator `acc` (gradient accumulation, reduce_each); with
/// `first` (the step's first micro-batch), copies it.
template <class G>
struct accumulate_phase : chunked {
  const G* src = nullptr;
  float* acc = nullptr;
  bool first = false;
  DISTOPT_HD void operator()(std::size_t c, std::size_t lo, std::size_t hi) const {
    const G* s = src + c * chunk;
    float* a = acc + c * chunk;
    if (first)
      for (std::size_t i = lo; i < hi; ++i) a[i] = to_float(s[i]);
    else
      for (std::size_t i = lo; i < hi; ++i) a[i] += to_float(s[i]);
  }
};

/// Copies each piece's params into its fp32 master weights (local index); with `control`,
/// only when the device decided so (the first step not skipped).
template <class P>
struct master_load_phase {
  const shard_piece* pieces = nullptr;
  const P* params = nullptr;
  bool params_local = false;  ///< params indexed by local index (ZeRO-3), else buffer index
  float* master = nullptr;
  const step_control* control = nullptr;
  DISTOPT_HD std::size_t size(std::size_t c) const noexcept {
    return control && !control->load_master ? 0 : pieces[c].count;
  }
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    const shard_piece& pc = pieces[c];
    const P* p = params + (params_local ? pc.local : pc.buffer);
    float* m = master + pc.local;
    for (std::size_t i = first; i < last; ++i) m[i] = to_float(p[i]);
  }
};

/// Which of a bucket's pieces an update pass takes: those whose group uses `n` state slots
/// this step (pieces of other counts are another pass's), except GaLore's projected matrices;
/// none when the device decided to skip the step. And the step's gradient scale and random
/// key: the device's decisions when `control` is set, else the host's below.
struct bucket_pieces {
  const shard_piece* pieces = nullptr;  ///< the bucket's first piece
  const int* slots = nullptr;           ///< per group, state slots in use
  const int* matrix_index = nullptr;  ///< per tensor: >= 0 for matrices a matrix stage updates (skipped here); or null
  const step_control* control = nullptr;  ///< the step's decisions (engine/decisions.hpp); null: the two below
  float grad_scale = 1.0f;                ///< without `control` (a phase built by hand, as tests/cuda does)
  std::uint64_t key = 0;
  DISTOPT_HD bool takes(std::size_t c, int n) const noexcept {
    const shard_piece& pc = pieces[c];
    return slots[pc.group] == n && !(matrix_index && matrix_index[pc.tensor] >= 0) && !(control && control->skipped);
  }
  DISTOPT_HD float step_scale() const noexcept { return control ? control->grad_scale : grad_scale; }
  DISTOPT_HD std::uint64_t step_key() const noexcept { return control ? control->key : key; }
};

/// The fused element update of the pieces of one bucket whose group uses N state slots:
/// grads (times the step's scale) -> states -> fp32 value -> params (update_range, the
/// body every backend runs). Pieces of groups with another slot count are another pass's.
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
struct update_phase : bucket_pieces {
  const typename Policy::scalars* scalars = nullptr;  ///< per group, this step's
  const float* tensor_scale = nullptr;              ///< per tensor (percentile clipping), or null
  const slot_offsets* state_at = nullptr;  ///< per piece of the bucket: its slots' offsets (packed states), or null (local index)
  Param* params = nullptr;
  bool params_local = false;  ///< params indexed by local index (ZeRO-3), else buffer index
  const Grad* grads = nullptr;
  bool grads_local = false;  ///< grads indexed by local index (the fp32 shard, ZeRO-2), else buffer index
  float* master = nullptr;   ///< null without master weights
  Enc* state[4] = {};

  DISTOPT_HD std::size_t size(std::size_t c) const noexcept { return takes(c, N) ? pieces[c].count : 0; }
  /// What update_range takes for item c's elements from `first` on: the arrays, the
  /// gradient scale, the random key and the layout index. (A device executor that visits
  /// elements its own way, exec/cuda/phases.cuh, starts from here too.)
  DISTOPT_HD update_args<Param, Grad, Enc> args(std::size_t c, std::size_t first) const {
    const shard_piece& pc = pieces[c];
    const float scale = tensor_scale ? step_scale() * tensor_scale[pc.tensor] : step_scale();
    update_args<Param, Grad, Enc> a{params + (params_local ? pc.local : pc.buffer) + first,
                                    grads + (grads_local ? pc.local : pc.buffer) + first,
                                    master ? master + pc.local + first : nullptr,
                                    {},
                                    scale,
                                    step_key(),
                                    pc.layout + first};
    for (int k = 0; k < N; ++k) a.state[k] = state[k] + (state_at ? state_at[c].at[k] : pc.local) + first;
    return a;
  }
  DISTOPT_HD void operator()(std::size_t c, std::size_t first, std::size_t last) const {
    update_range<Policy, N, Mode>(scalars[pieces[c].group], args(c, first), last - first);
  }
};

/// Exact sums of squares of grads times `scale`: item w adds pieces [w * per, (w + 1) *
/// per) into out[w], one exact term per layout block (add_block_squares), so the total
/// does not depend on how pieces are grouped into items. A reduction: items of size 1.
template <class G>
struct squares_phase {
  const shard_piece* pieces = nullptr;
  std::size_t piece_count = 0, per = 1;
  const G* grads = nullptr;
  bool grads_local = false;               ///< grads indexed by local index, else buffer index
  const unsigned char* skip = nullptr;  ///< per piece: nonzero = not counted; or null
  double scale = 1.0;
  const double* divide_by = nullptr;  ///< when set, the factor is 1 / *divide_by (the device's loss scale)
  std::size_t block = 1;
  exact_sum* out = nullptr;

  DISTOPT_HD std::size_t size(std::size_t) const noexcept { return 1; }
  DISTOPT_HD void operator()(std::size_t w, std::size_t, std::size_t) const {
    const std::size_t end = (w + 1) * per < piece_count ? (w + 1) * per : piece_count;
    const double factor = divide_by ? 1.0 / *divide_by : scale;
    for (std::size_t c = w * per; c < end; ++c) {
      if (skip && skip[c]) continue;
      const shard_piece& pc = pieces[c];
      add_block_squares(out[w], grads + (grads_local ? pc.local : pc.buffer), factor, pc.count, block);
    }
  }
};

}  // namespace distopt::detail
