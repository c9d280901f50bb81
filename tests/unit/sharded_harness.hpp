// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Runs one optimizer configuration for some steps on d ranks (threads) or on one rank,
// with the rank-0 trick of DESIGN.md: rank 0 gets the global gradient, the other ranks
// zeros, reduced with a sum, so the reduction is exact and any difference from the
// single-rank run is the library's. Collects the full params, master weights and states.
#pragma once

#include <distopt/distopt.hpp>

#include "sanitizer.hpp"

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace harness {

using namespace distopt;

/// True in the sanitizer builds (sanitizer.hpp).
inline constexpr bool under_sanitizer = DISTOPT_TEST_SANITIZED != 0;
/// `steps`, or at most `cap` of them in a sanitizer build.
constexpr int sanitized_steps(int steps, int cap) { return under_sanitizer && steps > cap ? cap : steps; }

/// Awkward layouts: tensors smaller than a block, tensors straddling shard cuts, totals
/// not divisible by d, a single tensor; `bucket` elements per bucket (small: several buckets).
struct layout_case {
  std::string name;
  std::vector<std::vector<std::int64_t>> shapes;
  std::size_t bucket;
};

inline std::vector<layout_case> awkward_layouts() {
  return {
      {"mixed", {{1}, {3}, {257}, {17, 33}, {3, 4, 5}, {700}}, std::size_t{1} << 22},
      {"single", {{1000}}, std::size_t{1} << 22},
      {"tiny", {{1}, {2}, {5}}, std::size_t{1} << 22},
      {"buckets", {{300}, {40, 30}, {2}, {513}, {1024}, {7, 7}}, 512},
  };
}

inline layout make_layout(const layout_case& c, dtype t, int groups = 1) {
  layout l;
  for (std::size_t i = 0; i < c.shapes.size(); ++i)
    l.add(std::string("t").append(std::to_string(i)), c.shapes[i], t, static_cast<int>(i) % groups);
  return l;
}

/// A gradient value that depends only on (step, tensor, element): the same on any d.
inline float grad_value(int step, std::size_t tensor, std::size_t i) {
  std::uint64_t z = (static_cast<std::uint64_t>(step) << 40) ^ (static_cast<std::uint64_t>(tensor) << 32) ^ i;
  z = distopt::detail::splitmix64_finalise(z + 0x9e3779b97f4a7c15ull);
  const float u = static_cast<float>(z >> 40) / static_cast<float>(1u << 24) * 2.0f - 1.0f;  // [-1, 1)
  return u * (0.5f + static_cast<float>(tensor % 3));
}
inline float init_value(std::size_t tensor, std::size_t i) { return 0.5f * grad_value(-1, tensor, i); }

/// Everything a run leaves behind, as raw bytes per tensor, in layout order.
struct outcome {
  std::vector<std::vector<unsigned char>> params, master;
  std::vector<std::vector<std::vector<unsigned char>>> states;  // [slot][tensor] (q8: the codes)
  std::vector<std::vector<std::vector<unsigned char>>> absmax;  // [slot][tensor], q8 only
  std::vector<std::vector<std::vector<unsigned char>>> decoded; // [slot][tensor], q8 only: fp32 values
  std::vector<double> norms;
  std::vector<char> skipped;
  bool operator==(const outcome&) const = default;
};

template <class T>
void put(std::vector<unsigned char>& dst, std::size_t first, std::span<const T> src) {
  if (!src.empty()) std::memcpy(dst.data() + first * sizeof(T), src.data(), src.size_bytes());
}

struct run_options {
  int steps = 20;
  int threads = 1;           // per rank
  double clip = 0.0;         // clip_grad_norm(clip) before each step when > 0
  int nan_step = -1;         // at this step a NaN appears in the grad of rank `nan_rank`
  int nan_rank = 0;
  float rank0_factor = 1.0f;  // rank 0's grad is this times the global grad (avg: d)
  float divide_by = 0.0f;     // if not 0, rank 0's grad is then divided by it, rounded once
  distopt::optimizer_options options{};
};

/// Writes the initial params (init_value) through distopt::upload, so that executors of
/// device memory run it too.
template <class Opt>
void set_initial_params(Opt& opt) {
  using P = typename Opt::param_type;
  const auto tensors = opt.tensors().tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    std::vector<P> p(tensors[t].numel);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = from_float<P>(init_value(t, i));
    upload(opt.executor(), p, opt.param(tensors[t].name));
  }
}

/// Sets the initial params, then for each step writes the grads, clips, steps and zeroes.
template <class Opt>
void drive(Opt& opt, int rank, const run_options& ro, outcome* out) {
  using G = typename Opt::grad_type;
  const auto tensors = opt.tensors().tensors();
  set_initial_params(opt);
  for (int s = 0; s < ro.steps; ++s) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      std::vector<G> g(tensors[t].numel);
      for (std::size_t i = 0; i < g.size(); ++i) {
        float v = grad_value(s, t, i) * ro.rank0_factor;
        if (ro.divide_by != 0.0f) v /= ro.divide_by;
        g[i] = from_float<G>(rank == 0 ? v * static_cast<float>(opt.loss_scale()) : 0.0f);
      }
      if (s == ro.nan_step && rank == ro.nan_rank) g[g.size() / 2] = from_float<G>(std::nanf(""));
      upload(opt.executor(), g, opt.grad(tensors[t].name));
    }
    if (ro.clip > 0) opt.clip_grad_norm(ro.clip);
    const step_result r = opt.step();
    if (out) {
      out->norms.push_back(r.grad_norm);
      out->skipped.push_back(r.skipped);
    }
    opt.zero_grad();
  }
}

/// Copies view `v` (any memory space) of executor `e` into `dst` from element `first` on.
template <class E, class View>
void put_view(E& e, std::vector<unsigned char>& dst, std::size_t first, View v) {
  using T = std::remove_const_t<typename View::element_type>;
  std::vector<T> host(v.size());
  download(e, v, std::span<T>(host));
  put(dst, first, std::span<const T>(host));
}

/// Copies this rank's params (rank 0 only: they are all-gathered), master and states into `out`.
template <class Opt>
void collect(Opt& opt, int rank, outcome& out) {
  const auto tensors = opt.tensors().tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const auto& ts = tensors[t];
    if (rank == 0) {
      put_view(opt.executor(), out.params[t], 0, opt.param(ts.name));
    }
    if (!Opt::is_sharded && rank != 0) continue;  // replicated: every rank holds all of it
    try {
      auto m = opt.local_master(ts.name);
      put_view(opt.executor(), out.master[t], m.first, m.values);
    } catch (const std::logic_error&) {
    }
    for (std::size_t k = 0; k < out.states.size(); ++k) {
      if constexpr (Opt::is_quantized) {
        auto codes = opt.local_state_codes(ts.name, static_cast<int>(k));
        put_view(opt.executor(), out.states[k][t], codes.first, codes.values);
        auto amax = opt.local_state_absmax(ts.name, static_cast<int>(k));
        put_view(opt.executor(), out.absmax[k][t], amax.first, amax.values);
        auto v = opt.local_state_values(ts.name, static_cast<int>(k));
        put(out.decoded[k][t], v.first, std::span<const float>(v.values));
      } else {
        auto st = opt.local_state(ts.name, static_cast<int>(k));
        put_view(opt.executor(), out.states[k][t], st.first, st.values);
      }
    }
  }
}

template <class Opt>
outcome blank(const layout& l, int slots) {
  outcome o;
  for (const auto& t : l.tensors()) {
    o.params.emplace_back(t.numel * sizeof(typename Opt::param_type));
    o.master.emplace_back(t.numel * sizeof(float));
  }
  o.states.resize(static_cast<std::size_t>(slots));
  for (auto& s : o.states)
    for (const auto& t : l.tensors()) s.emplace_back(t.numel * sizeof(typename Opt::state_type));
  if constexpr (Opt::is_quantized) {
    o.absmax.resize(static_cast<std::size_t>(slots));
    o.decoded.resize(static_cast<std::size_t>(slots));
    for (std::size_t k = 0; k < o.absmax.size(); ++k)
      for (const auto& t : l.tensors()) {
        o.absmax[k].emplace_back((t.numel + q8::block - 1) / q8::block * sizeof(float));
        o.decoded[k].emplace_back(t.numel * sizeof(float));
      }
  }
  return o;
}

/// The single-rank reference: replicated storage, `single` communicator.
template <class Policy, class Enc, class Prec, class Exec = cpu>
outcome run_single(const layout& l, const std::vector<typename Policy::hyper_params>& h, run_options ro) {
  using opt_t = optimizer<Policy, replicated<Enc>, single, Exec, Prec>;
  opt_t opt(l, h, ro.options, make_executor<Exec>(ro.threads));
  outcome out = blank<opt_t>(l, Policy::state_slots(h.front()));
  drive(opt, 0, ro, &out);
  collect(opt, 0, out);
  return out;
}

/// d ranks as threads, with `Storage` (sharded or replicated) and a sum reduction
/// (unless `keep_reduce`). `Comm` is made from each rank's `threads` handle (any_comm
/// wraps it).
template <class Policy, class Storage, class Prec, class Exec = cpu, class Comm = threads>
outcome run_threads(int d, const layout& l, const std::vector<typename Policy::hyper_params>& h, run_options ro,
                    bool keep_reduce = false) {
  using opt_t = optimizer<Policy, Storage, Comm, Exec, Prec>;
  if (!keep_reduce) ro.options.grad_reduce = reduce_op::sum;
  outcome out = blank<opt_t>(l, Policy::state_slots(h.front()));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, ro.options, make_executor<Exec>(ro.threads), Comm(std::move(comm)));
    drive(opt, rank, ro, rank == 0 ? &out : nullptr);
    collect(opt, rank, out);  // ranks write disjoint elements
  });
  return out;
}

/// Cases that every executor is held to (kokkos.cpp, emulated.cpp, tests/cuda/optimizer.cu).
namespace cases {
/// Two SGD groups: momentum with dampening and weight decay, and Nesterov.
inline std::vector<sgd::hyper_params> sgd_momentum_and_nesterov() {
  sgd::hyper_params m;
  m.lr = 0.05;
  m.momentum = 0.9;
  m.dampening = 0.1;
  m.weight_decay = 0.01;
  sgd::hyper_params n;
  n.lr = 0.05;
  n.momentum = 0.8;
  n.nesterov = true;
  return {m, n};
}
inline adam::hyper_params adam_amsgrad() {
  adam::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.amsgrad = true;
  return h;
}
inline lion::hyper_params lion_decayed() {
  lion::hyper_params h;
  h.lr = 1e-3;
  h.weight_decay = 0.1;
  return h;
}
/// bf16 params without master weights: stochastic rounding, seeded.
inline run_options stochastic_rounding() {
  run_options ro;
  ro.options.master_weights = false;
  ro.options.seed = 7;
  return ro;
}
/// q8 states on the larger tensors, fp32 on the smaller, with global and percentile clipping.
inline run_options q8_percentile_clipping() {
  run_options ro;
  ro.steps = 30;
  ro.clip = 1.0;
  ro.options.min_8bit_size = 256;
  ro.options.percentile_clipping = 5;
  return ro;
}
/// fp16 params and grads with dynamic loss scaling and one overflow (a skipped step).
inline run_options fp16_loss_scaling() {
  run_options ro;
  ro.options.loss_scale = dynamic_loss_scale{};
  ro.nan_step = 3;
  return ro;
}
}  // namespace cases

/// Rank 0's bytes sent by three steps of sharded optimizer type Opt on d ranks as threads
/// (buckets of 512 elements, no finite check), rank 0's grads 0.01 and the others' zero.
template <class Opt>
std::size_t three_steps_sent(const layout& l, const std::vector<typename Opt::hyper_params>& h, int d) {
  distopt::optimizer_options o;
  o.check_finite = false;
  o.bucket_elems = 512;
  std::size_t sent = 0;
  distopt::run_ranks(d, [&](distopt::threads& comm) {
    const int rank = comm.rank();
    Opt opt(l, h, o, distopt::cpu(1), std::move(comm));
    for (int s = 0; s < 3; ++s) {
      for (const auto& t : opt.tensors().tensors())
        for (auto& g : opt.grad(t.name)) g = rank == 0 ? 0.01f : 0.0f;
      opt.step();
    }
    if (rank == 0) sent = opt.communicator().bytes_sent();
  });
  return sent;
}

/// (d - 1) shards of fp32 for each bucket (of 512 elements, as three_steps_sent) holding
/// a tensor for which `gathered(tensor)` is true: one all-gather of those buckets in fp32.
template <class Pred>
std::size_t gathered_bucket_bytes(const layout& l, int d, Pred gathered) {
  const auto plan = distopt::detail::shard_plan(l, d, 0, 512, 1u << 14);
  std::size_t bytes = 0;
  for (const auto& b : plan.buckets()) {
    bool any = false;
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) any = any || gathered(l.tensors()[i]);
    if (any) bytes += static_cast<std::size_t>(d - 1) * b.shard_elems * sizeof(float);
  }
  return bytes;
}

}  // namespace harness
