// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The stages of an optimizer's step, chosen once from its policy and storage:
///   layer_stage        engine/layerwise.hpp   (layer-wise policies: lamb.hpp, adafactor.hpp, came.hpp)
///   bucket_stages      below: a matrix stage and an element stage on each bucket in turn
///     projection_stage engine/projection.hpp  (projecting policies: galore_adamw.hpp)
///     orthogonal_stage engine/orthogonal.hpp  (orthogonalising policies: muon.hpp)
///     q8_stage         engine/q8.hpp          (8-bit states: storage/q8.hpp)
///     element_stage    engine/elementwise.hpp (fp32 and bf16 states)
/// A stage is a type with init(ctx) and what the step and the views ask of it; it sees the
/// context (engine/context.hpp), never the optimizer. An optimizer that does not need a
/// stage never parses or compiles it: the header of the policy or storage that needs one
/// includes it, and marks it included (stage_included), which optimizer.hpp checks with a
/// message naming the header.

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "../concepts.hpp"
#include "../memory_report.hpp"
#include "../shard_view.hpp"
#include "decide.hpp"
#include "elementwise.hpp"
#include "schedule.hpp"

namespace distopt::detail {

struct layer_stage_tag {};
template <class Policy, class State, class Exec>
struct layer_stage;

struct q8_stage_tag {};
template <class Policy, class Exec>
struct q8_stage;

struct projection_stage_tag {};
template <class Policy, class State, class Exec>
struct projection_stage;

struct orthogonal_stage_tag {};
template <class Policy, class State>
struct orthogonal_stage;

/// True once the header defining the stage `Tag` is included (each one specialises it).
template <class Policy, class Tag>
struct stage_included : std::false_type {};

/// This rank's part of state slot `k` of tensor `i` decoded to fp32, for states of fp32
/// or bf16 (what every stage but q8's keeps).
template <class Ctx>
shard_values element_values(const Ctx& c, std::size_t i, int k) {
  using state = typename Ctx::state_type;
  const piece_range r = c.plan_.pieces_of(i);
  if (r.empty()) return {};
  const state_home home = c.states_at_.home(r.first, k);
  if (home == state_home::none) return {};
  const std::size_t count = c.plan_.local_count(i), at = c.states_at_.offset(r.first, k);
  const state* base = home == state_home::momentum ? c.momentum_.data() : c.states_[k].data();
  std::vector<state> raw(count);
  download(c.exec_, typename Ctx::template view<const state>(base + at, count), std::span<state>(raw));
  shard_values out{std::vector<float>(count), c.plan_.pieces()[r.first].layout - c.layout_.tensors()[i].offset};
  for (std::size_t e = 0; e < count; ++e) out.values[e] = to_float(raw[e]);
  return out;
}

/// The stages of an optimizer that updates bucket by bucket: on each bucket, a matrix
/// stage (projection, orthogonalisation, or none) then an element stage (element or q8).
template <class Policy, class Matrix, class Element>
struct bucket_stages {
  Matrix matrix;
  Element element;

  /// The matrix stage first: it marks the matrices it updates whole, which the element
  /// stage then leaves out.
  template <class Ctx>
  void init(Ctx& c) {
    matrix.init(c);
    element.init(c);
  }

  /// Each group's scalars are prepared on the executor (engine/decide.hpp): an
  /// element-wise policy's prepare is a DISTOPT_HD function; GaLore's and Muon's run on the host.
  static constexpr bool prepares_on_executor = !Matrix::runs_between_buckets;

  /// The step's update, as decided (engine/decide.hpp).
  template <class Ctx>
  void run(Ctx& c) {
    c.with_reduced_grads([&](const auto* grads) {
      step_inputs<Policy, std::remove_cvref_t<decltype(*grads)>> in;
      std::vector<typename Policy::scalars> host_scalars;
      if (!step_inputs_of(c, grads, Matrix::runs_between_buckets, in, host_scalars)) return;
      with_param_mode(c, [&](auto mode) { run<decltype(mode)::value>(c, in); });
    });
  }

  /// The update of every bucket (step_inputs: what the phases read this step).
  template <param_mode Mode, class Ctx, class G>
  void run(Ctx& c, const step_inputs<Policy, G>& in) {
    const auto& buckets = c.plan_.buckets();
    run_buckets(c, !Matrix::runs_between_buckets, [&](std::size_t first, std::size_t end) {
      if constexpr (Matrix::runs_between_buckets)
        for (std::size_t k = first; k < end; ++k) matrix.template run_bucket<Mode>(c, in, buckets[k]);
      shard_bucket b = buckets[first];  // the buckets' pieces are consecutive
      b.end_piece = buckets[end - 1].end_piece;
      element.template run_bucket<Mode>(c, in, b);
    });
  }

  template <class Ctx>
  shard_values local_values(const Ctx& c, std::size_t i, int k) const {
    if constexpr (requires { element.local_values(c, i, k); }) return element.local_values(c, i, k);
    else return element_values(c, i, k);
  }
  /// set_hyper and a checkpoint's groups: the matrix stage may refuse a change of group.
  template <class Ctx>
  void check_hyper(const Ctx& c, int g, const typename Policy::hyper_params& h) const {
    if constexpr (requires { matrix.check_hyper(c, g, h); }) matrix.check_hyper(c, g, h);
  }
  template <class Ctx>
  void add_memory(const Ctx& c, memory_report& r) const {
    if constexpr (requires { matrix.add_memory(c, r); }) matrix.add_memory(c, r);
  }
  /// A tensor-parallel group was set: nothing here depends on it.
  template <class Ctx>
  void init_geometry(Ctx&) {}
  /// Only the layer-wise stage reduces statistics.
  std::size_t statistics_bytes() const noexcept { return 0; }
};

/// The stages of optimizer<Policy, Storage, Comm, Exec, ...>.
template <class Policy, class Storage, class Exec>
struct stages_of {
  using state = typename Storage::encoding;
  static constexpr bool matrices = projects_matrices<Policy> || orthogonalizes_matrices<Policy>;
  using matrix = std::conditional_t<projects_matrices<Policy>, projection_stage<Policy, state, Exec>,
                                    std::conditional_t<orthogonalizes_matrices<Policy>, orthogonal_stage<Policy, state>,
                                                       no_matrix_stage>>;
  using element = std::conditional_t<quantized_encoding<state>, q8_stage<Policy, Exec>,
                                     element_stage<Policy, state, Exec, matrices>>;
  using type = std::conditional_t<policy_is_layerwise<Policy>, layer_stage<Policy, state, Exec>,
                                  bucket_stages<Policy, matrix, element>>;
};

}  // namespace distopt::detail
