// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Real multi-rank sums, for tests/unit/real_sums.cpp (threads) and
// tests/mpi/mpi_real_sums.cpp: every rank writes a different non-zero gradient, drawn from
// values whose fp32 sum depends on the order (1e8, -1e8, 1, -0.75 and random values over
// 13 binades), and a sharded AdamW steps on them. The reference is a one-rank optimizer
// (`single`, replicated) fed, every step, the global gradient this file computes on the
// host: the ranks' values added in float in a given order of ranks, divided by d in float
// for avg, rounded once to the grad type. No collective of the library takes part in it.
//
// A run is recorded after every step as a trace: all params (gathered), and the states
// exp_avg and exp_avg_sq of the elements this rank holds (`held`).
#pragma once

#include <distopt/comm/single.hpp>
#include <distopt/exec/cpu.hpp>
#include <distopt/layout/registry.hpp>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>
#include <distopt/storage/replicated.hpp>
#include <distopt/storage/sharded.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/rounding.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace real_sums {

using namespace distopt;

constexpr int steps = 4;

/// Three tensors (1266 elements) in buckets of 512: several buckets, tensors cut by shards.
inline layout sums_layout() {
  layout l;
  l.add("w", {17, 33}, dtype::f32, 0);
  l.add("b", {5}, dtype::f32, 0);
  l.add("v", {700}, dtype::f32, 0);
  return l;
}

inline optimizer_options options_of(reduce_op op, bool in_fp32 = false) {
  optimizer_options o;
  o.grad_reduce = op;
  o.grad_reduce_in_fp32 = in_fp32;
  o.bucket_elems = 512;
  return o;
}

inline std::vector<adamw::hyper_params> hypers() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  return {h};
}

inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Rank `rank`'s gradient at `step` for element `e` (index over all tensors in layout
/// order): never zero; a fifth each 1e8, -1e8, 1, -0.75, and random values of either sign
/// in [2^-6, 2^7). So (1e8 + 1) - 1e8 = 0 but (1e8 - 1e8) + 1 = 1, and random values round
/// differently in each order. Runs with bf16 grads write each value rounded to bf16, and
/// the reference sums those.
inline float rank_grad(int rank, int step, std::size_t e) {
  const std::uint64_t h = mix((static_cast<std::uint64_t>(step) << 48) ^ (static_cast<std::uint64_t>(rank) << 40) ^ e);
  switch (h % 5) {
  case 0: return 1e8f;
  case 1: return -1e8f;
  case 2: return 1.0f;
  case 3: return -0.75f;
  default: {
    const float mant = 1.0f + static_cast<float>((h >> 8) & 0xffffff) / 16777216.0f;  // [1, 2)
    const float v = std::ldexp(mant, static_cast<int>((h >> 40) % 13) - 6);
    return (h >> 60) & 1 ? -v : v;
  }
  }
}

/// What rank `rank` writes into its grads of type G (rounded to G once).
template <class G>
G written_grad(int rank, int step, std::size_t e) {
  return from_float<G>(rank_grad(rank, step, e));
}

/// The reduced gradient of element `e` the step reads, in type R: the ranks' written
/// values summed in float in the order `order` ((g[o0] + g[o1]) + g[o2] ...), divided by
/// d in float for avg, rounded once to R (the grad type, or float with grad_reduce_in_fp32).
template <class G, class R>
R reduced_grad(std::span<const int> order, reduce_op op, int step, std::size_t e) {
  float s = to_float(written_grad<G>(order[0], step, e));
  for (std::size_t q = 1; q < order.size(); ++q) s += to_float(written_grad<G>(order[q], step, e));
  if (op == reduce_op::avg) s /= static_cast<float>(order.size());
  return from_float<R>(s);
}

/// Params after every step (all elements), and states where `held`, flattened in layout
/// order: [step * n + e].
struct trace {
  std::size_t n = 0;
  std::vector<float> params, m, v;
  std::vector<char> held;
  explicit trace(std::size_t elements = 0)
      : n(elements), params(steps * elements), m(steps * elements), v(steps * elements), held(elements, 0) {}
};

/// Writes every tensor's grads with grad(e) (e over all tensors in layout order).
template <class Opt, class F>
void write_grads(Opt& opt, F grad) {
  std::size_t e = 0;
  for (const auto& t : opt.tensors().tensors())
    for (auto& g : opt.grad(t.name)) g = grad(e++);
}

/// Records step `s` of `opt` into `out`: every param (the optimizer gathered them), the
/// states of the elements this rank holds.
template <class Opt>
void record(Opt& opt, int s, trace& out) {
  const std::size_t base = static_cast<std::size_t>(s) * out.n;
  std::size_t first = 0;
  for (const auto& t : opt.tensors().tensors()) {
    const auto p = opt.param(t.name);
    for (std::size_t i = 0; i < p.size(); ++i) out.params[base + first + i] = p[i];
    const auto m = opt.local_state(t.name, 0), v = opt.local_state(t.name, 1);
    for (std::size_t i = 0; i < m.values.size(); ++i) {
      out.m[base + first + m.first + i] = m.values[i];
      out.v[base + first + v.first + i] = v.values[i];
      out.held[first + m.first + i] = 1;
    }
    first += t.numel;
  }
}

/// The same initial params on every rank and in the reference.
template <class Opt>
void set_params(Opt& opt) {
  std::size_t e = 0;
  for (const auto& t : opt.tensors().tensors())
    for (auto& p : opt.param(t.name)) p = 0.25f * rank_grad(-1, 0, e++) / 1e8f + 0.5f;
}

/// One rank of a distributed run: writes this rank's grads and steps `steps` times.
template <class Opt>
void run_rank(Opt& opt, int rank, trace& out) {
  set_params(opt);
  for (int s = 0; s < steps; ++s) {
    write_grads(opt, [&](std::size_t e) { return written_grad<typename Opt::grad_type>(rank, s, e); });
    opt.step();
    record(opt, s, out);
    opt.zero_grad();
  }
}

/// The reference: one rank fed the reduced gradient of ranks summed in `order`, in the
/// type R the step reads (precision<float, R>).
template <class G, class R>
trace reference(std::span<const int> order, reduce_op op) {
  using opt_t = optimizer<adamw, replicated<fp32>, single, cpu, precision<float, R>>;
  const layout l = sums_layout();
  opt_t opt(l, hypers(), options_of(op), cpu(1));
  trace out(l.numel());
  set_params(opt);
  for (int s = 0; s < steps; ++s) {
    write_grads(opt, [&](std::size_t e) { return reduced_grad<G, R>(order, op, s, e); });
    opt.step();
    record(opt, s, out);
    opt.zero_grad();
  }
  return out;
}

/// Whether `a` and `b` hold the same bits.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Whether element `e` of `a` equals element `e` of `b` bit for bit at every step: the
/// params, and the states where `a` holds them.
inline bool same_element(const trace& a, const trace& b, std::size_t e) {
  for (int s = 0; s < steps; ++s) {
    const std::size_t k = static_cast<std::size_t>(s) * a.n + e;
    if (std::memcmp(&a.params[k], &b.params[k], sizeof(float)) != 0) return false;
    if (a.held[e] && (std::memcmp(&a.m[k], &b.m[k], sizeof(float)) != 0 ||
                      std::memcmp(&a.v[k], &b.v[k], sizeof(float)) != 0))
      return false;
  }
  return true;
}

}  // namespace real_sums
