// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The harness of ctest `experts` (experts.cpp, experts_muon.cpp) and mpi.experts. A
// mixture-of-experts model on the two grids of make_mesh (comm/mesh.hpp), ranks as
// threads: the dense tensors in one optimizer over the dense grid (TP x DP), this rank's
// experts (layout::add_experts: each expert a tensor of its own) in a second one over the
// expert grid (ETP x EP x expert-DP), stepped together by joint_step on one global norm. Against the run that holds
// every expert in one optimizer on the TP ranks alone (dp = ep = 1), bit for bit: params,
// slot-0 states, each step's norm and skips, with clipping by max_grad_norm on and a NaN
// planted in one expert at one step. That run's norms are held to a float64 recomputation of
// the global norm from the gradients, so a tensor counted twice (a TP-replicated one on
// every TP rank) or an expert left out fails here, whatever both runs share.
//
// DP and expert-DP: the rank-0 trick (index 0 writes the global grads, the others zeros,
// summed), so every grid has the same global gradient.

#pragma once

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mesh.hpp>
#include <distopt/distopt.hpp>

#include "tp_grid.hpp"  // tp_tensor, full_index, grad_value, init_value

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace experts_test {

using distopt::tp_split;
using harness::tp_tensor;

inline constexpr int experts_total = 4;
inline constexpr int steps = 6;
inline constexpr int nan_step = 3;  // a NaN in expert 3's first weight: every rank skips this step

inline std::vector<tp_tensor> dense_tensors() {
  return {{{24, 40}, tp_split::rows},  // column-parallel (QKV-like)
          {{20, 24}, tp_split::cols},  // row-parallel (attention out)
          {{20}, tp_split::none},      // its bias and a norm weight: replicated over TP
          {{8, 20}, tp_split::none}};  // the router: replicated over TP
}
inline std::vector<tp_tensor> expert_tensors() {  // one expert's; each expert has its own
  return {{{32, 20}, tp_split::rows},      // MLP in (column-parallel inside the expert)
          {{20, 32}, tp_split::cols},      // MLP out (row-parallel)
          {{20}, tp_split::none}};         // its bias: replicated over ETP
}

/// Global tensor ids (for grad_value and the results): dense i, then expert e's j. The
/// lists' sizes are counted once (grad_at asks for an id per element).
inline std::size_t dense_id(std::size_t i) { return i; }
inline std::size_t expert_id(int e, std::size_t j) {
  static const std::size_t dense = dense_tensors().size(), each = expert_tensors().size();
  return dense + static_cast<std::size_t>(e) * each + j;
}
inline std::string dense_name(std::size_t i) { return "dense" + std::to_string(i); }
/// Expert tensor j is the logical tensor "w<j>" of experts_total experts (layout::add_experts).
inline std::string expert_logical(std::size_t j) { return "w" + std::to_string(j); }
inline std::string expert_name(int e, std::size_t j) { return distopt::expert_tensor_name(expert_logical(j), e); }

inline std::size_t numel(const tp_tensor& x) {
  std::size_t n = 1;
  for (auto s : x.shape) n *= static_cast<std::size_t>(s);
  return n;
}

inline float grad_at(int step, std::size_t id, std::size_t i) {
  if (step == nan_step && id == expert_id(3, 0) && i == 5) return std::numeric_limits<float>::quiet_NaN();
  return harness::grad_value(step, id, i);
}

struct moe_result {
  std::vector<std::vector<float>> params, states;  // per global tensor id, whole
  std::vector<double> norms;                       // per step (rank 0's)
  std::vector<int> skipped;
  bool ranks_agree = true;  // every rank's step results had rank 0's bits
};

/// One tensor registered as a TP part of tp, with params of type P: a dense one, or
/// (`expert` >= 0) that expert of expert tensor `name`.
template <class P>
void add_tensor(distopt::layout& l, const std::string& name, const tp_tensor& x, int tp, int expert = -1) {
  auto shape = x.shape;
  const tp_split split = tp > 1 ? x.split : tp_split::none;
  if (split == tp_split::rows) shape.front() /= tp;
  if (split == tp_split::cols) shape.back() /= tp;
  const int group = shape.size() == 2 ? 0 : 1;
  if (expert < 0) l.add(name, shape, distopt::dtype_of<P>, group, split);
  else l.add_experts(name, experts_total, {expert, 1}, shape, distopt::dtype_of<P>, group, split);
}

/// Two groups: the matrices (group 0) and the rest (group 1), with the policy's defaults;
/// Muon's group 1 is its AdamW (use_muon false), GaLore's group 0 projects to rank 4, a new
/// projection every other step.
template <class Policy>
std::vector<typename Policy::hyper_params> groups() {
  std::vector<typename Policy::hyper_params> h(2);
  if constexpr (requires { h[1].use_muon; }) h[1].use_muon = false;
  if constexpr (requires { h[0].update_proj_gap; }) {
    h[0].rank = 4;
    h[0].update_proj_gap = 2;
  }
  return h;
}

inline distopt::optimizer_options options() {
  distopt::optimizer_options o;
  o.grad_reduce = distopt::reduce_op::sum;
  o.bucket_elems = 700;      // several buckets
  o.max_grad_norm = 2.0;     // clips every step (the norms are about 88)
  o.min_8bit_size = 256;     // q8: the matrices in 8 bits
  return o;
}

/// A tensor's part: what this rank writes (grads when `writes`, else zeros) and reads back.
struct part {
  std::string name;
  std::size_t id;
  const tp_tensor* x;
  int expert = -1;  // expert `expert` of expert tensor `logical`
  std::string logical;
};
template <class P>
void add_part(distopt::layout& l, const part& p, int tp) {
  add_tensor<P>(l, p.expert < 0 ? p.name : p.logical, *p.x, tp, p.expert);
}

/// Which steps a run takes, and what it does with the two optimizers (dense, experts) before
/// the first (a checkpoint loaded) and after the last (one saved).
struct no_hook {
  template <class Opt>
  void operator()(Opt&, Opt&) const {}
};
template <class Before = no_hook, class After = no_hook>
struct run_span {
  int from = 0, to = steps;
  Before before{};
  After after{};
};

template <class Opt>
void write_params(Opt& opt, const std::vector<part>& parts, int t, int tp) {
  using P = typename Opt::param_type;
  for (const part& p : parts) {
    std::vector<P> v(opt.param(p.name).size());
    for (std::size_t e = 0; e < v.size(); ++e)
      v[e] = distopt::from_float<P>(harness::init_value(p.id, harness::full_index(*p.x, t, tp, e)));
    upload(opt.executor(), v, opt.param(p.name));
  }
}
template <class Opt>
void write_grads(Opt& opt, const std::vector<part>& parts, int t, int tp, int step, bool writes) {
  using G = typename Opt::grad_type;
  opt.zero_grad();
  for (const part& p : parts) {
    std::vector<G> v(opt.grad(p.name).size());
    for (std::size_t e = 0; e < v.size(); ++e)
      v[e] = distopt::from_float<G>(writes ? grad_at(step, p.id, harness::full_index(*p.x, t, tp, e)) : 0.0f);
    upload(opt.executor(), v, opt.grad(p.name));
  }
}
/// Params (from the DP index 0 rank: `reads_params`) and slot-0 states (every rank's part),
/// into `r`; a tensor replicated over TP from TP index 0 only. Call under the results' lock.
template <class Opt>
void read_back(Opt& opt, const std::vector<part>& parts, int t, int tp, bool reads_params, moe_result& r) {
  for (const part& p : parts) {
    if (t != 0 && p.x->split == tp_split::none) continue;
    if (reads_params) {
      std::vector<typename Opt::param_type> v(opt.param(p.name).size());
      download(opt.executor(), opt.param(p.name), std::span(v));
      for (std::size_t e = 0; e < v.size(); ++e)
        r.params[p.id][harness::full_index(*p.x, t, tp, e)] = distopt::to_float(v[e]);
    }
    const auto s = opt.local_state_values(p.name, 0);
    for (std::size_t e = 0; e < s.values.size(); ++e)
      r.states[p.id][harness::full_index(*p.x, t, tp, s.first + e)] = s.values[e];
  }
}

inline moe_result empty_result() {
  moe_result r;
  r.norms.assign(steps, 0.0);
  r.skipped.assign(steps, 0);
  const auto dense = dense_tensors(), expert = expert_tensors();
  for (std::size_t i = 0; i < dense.size(); ++i) r.params.emplace_back(numel(dense[i]));
  for (int e = 0; e < experts_total; ++e)
    for (std::size_t j = 0; j < expert.size(); ++j) r.params.emplace_back(numel(expert[j]));
  r.states = r.params;
  return r;
}

inline void record(moe_result& r, std::mutex& m, int rank, int step, const distopt::step_result& s) {
  std::lock_guard<std::mutex> lock(m);
  if (rank == 0) {
    r.norms[static_cast<std::size_t>(step)] = s.grad_norm;
    r.skipped[static_cast<std::size_t>(step)] = s.skipped;
  }
}

/// One rank's run, on world `w` of communicator type Comm: every tensor in one optimizer
/// over `tp` ranks (the reference, w of tp ranks), or, with `ep` given, the dense and expert
/// optimizers over make_mesh(w, {tp, ep, etp = tp}) stepped by joint_step over the steps of
/// `span`, with its hooks. Writes this rank's parts into `r` under `m` (rank 0 also its
/// norms and skips) and returns its norms (-1 where the expert optimizer's step count left
/// the dense one's).
template <class Policy, class Storage, class Precision, class Exec = distopt::cpu, class Comm, class Span = run_span<>>
std::vector<double> run_rank(Comm& w, int tp, std::optional<int> ep, moe_result& r, std::mutex& m, const Span& span = {}) {
  using namespace distopt;
  using ref_opt = optimizer<Policy, Storage, Comm, cpu, Precision>;
  using opt = optimizer<Policy, Storage, Comm, Exec, Precision>;
  using P = typename opt::param_type;
  const auto dense = dense_tensors(), expert = expert_tensors();
  mesh<Comm> g = make_mesh(w, {.tp = tp, .ep = ep.value_or(1), .etp = tp});
  const int t = g.at.tp;
  std::vector<part> dense_parts, expert_parts;
  for (std::size_t i = 0; i < dense.size(); ++i) dense_parts.push_back({dense_name(i), dense_id(i), &dense[i], -1, {}});
  const expert_range mine = ep ? g.experts(experts_total) : expert_range{0, experts_total};
  for (int e = mine.first; e < mine.first + mine.count; ++e)
    for (std::size_t j = 0; j < expert.size(); ++j)
      expert_parts.push_back({expert_name(e, j), expert_id(e, j), &expert[j], e, expert_logical(j)});
  std::vector<double> norms;
  if (!ep) {  // the reference: one optimizer, every expert
    layout l;
    std::vector<part> all = dense_parts;
    all.insert(all.end(), expert_parts.begin(), expert_parts.end());
    for (const part& p : all) add_part<P>(l, p, tp);
    ref_opt o(l, groups<Policy>(), options(), make_executor<cpu>(1), std::move(g.dp));
    if (tp > 1) o.set_tensor_parallel_group(std::move(g.tp));
    write_params(o, all, t, tp);
    for (int s = 0; s < steps; ++s) {
      write_grads(o, all, t, tp, s, true);
      const step_result res = o.step();
      record(r, m, w.rank(), s, res);
      norms.push_back(res.grad_norm);
    }
    std::lock_guard<std::mutex> lock(m);
    read_back(o, all, t, tp, true, r);
    return norms;
  }
  layout ld, le;
  for (const part& p : dense_parts) add_part<P>(ld, p, tp);
  for (const part& p : expert_parts) add_part<P>(le, p, tp);
  opt d(ld, groups<Policy>(), options(), make_executor<Exec>(1), std::move(g.dp));
  opt x(le, groups<Policy>(), options(), make_executor<Exec>(1), std::move(g.edp));
  if (tp > 1) {
    d.set_tensor_parallel_group(std::move(g.tp));
    x.set_tensor_parallel_group(std::move(g.etp));
  }
  x.set_expert_parallel_group(std::move(g.ep));
  write_params(d, dense_parts, t, tp);
  write_params(x, expert_parts, g.at.etp, tp);
  span.before(d, x);
  for (int s = span.from; s < span.to; ++s) {
    write_grads(d, dense_parts, t, tp, s, g.at.dp == 0);
    write_grads(x, expert_parts, g.at.etp, tp, s, g.at.edp == 0);
    const step_result res = joint_step(d, x);
    record(r, m, w.rank(), s, res);
    norms.push_back(res.grad_norm);
    if (x.step_count() != d.step_count()) norms.back() = -1.0;  // the experts decided otherwise
  }
  span.after(d, x);
  std::lock_guard<std::mutex> lock(m);
  read_back(d, dense_parts, t, tp, g.at.dp == 0, r);
  read_back(x, expert_parts, g.at.etp, tp, g.at.edp == 0, r);
  return norms;
}

/// Whether every rank's norms have rank 0's bits.
inline bool ranks_agree(const std::vector<std::vector<double>>& seen, const std::vector<double>& norms) {
  bool agree = true;
  for (const auto& n : seen)
    agree = agree && n.size() == norms.size() && std::memcmp(n.data(), norms.data(), n.size() * sizeof(double)) == 0;
  return agree;
}

/// run_rank on `world` ranks as threads.
template <class Policy, class Storage, class Precision, class Exec = distopt::cpu, class Span = run_span<>>
moe_result run(int tp, int world, std::optional<int> ep, const Span& span = {}) {
  moe_result r = empty_result();
  std::vector<std::vector<double>> seen(static_cast<std::size_t>(world));  // each rank's norms
  std::mutex m;
  distopt::run_ranks(world, [&](distopt::threads& w) {
    std::vector<double> norms = run_rank<Policy, Storage, Precision, Exec>(w, tp, ep, r, m, span);
    std::lock_guard<std::mutex> lock(m);
    seen[static_cast<std::size_t>(w.rank())] = std::move(norms);
  });
  r.ranks_agree = ranks_agree(seen, std::vector<double>(r.norms.begin() + span.from, r.norms.begin() + span.to));
  return r;
}

/// The global norm of step s's gradient (as grads of type G) in float64, from grad_value over
/// every element of every tensor once.
template <class G>
double float64_norm(int s) {
  double sum = 0.0;
  const auto dense = dense_tensors(), expert = expert_tensors();
  for (std::size_t i = 0; i < dense.size(); ++i)
    for (std::size_t e = 0; e < numel(dense[i]); ++e) sum += std::pow(static_cast<double>(distopt::to_float(distopt::from_float<G>(grad_at(s, dense_id(i), e)))), 2);
  for (int x = 0; x < experts_total; ++x)
    for (std::size_t j = 0; j < expert.size(); ++j)
      for (std::size_t e = 0; e < numel(expert[j]); ++e)
        sum += std::pow(static_cast<double>(distopt::to_float(distopt::from_float<G>(grad_at(s, expert_id(x, j), e)))), 2);
  return std::sqrt(sum);
}

inline bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

struct grid {
  int tp, ep, world;
};

/// Every (TP, EP, DP) grid of the TP sizes `tps`, its optimizers on executor Exec, against
/// its TP's reference (on cpu).
template <class Policy, class Storage, class Precision = distopt::precision<float>, class Exec = distopt::cpu>
void check_grids(std::initializer_list<int> tps = {1, 2}) {
  for (int tp : tps) {
    const moe_result ref = run<Policy, Storage, Precision>(tp, tp, std::nullopt);
    BOOST_TEST_CONTEXT("reference, tp " << tp) {
      BOOST_TEST(ref.ranks_agree);
      for (int s = 0; s < steps; ++s) {
        BOOST_TEST(ref.skipped[static_cast<std::size_t>(s)] == (s == nan_step));
        if (s != nan_step) BOOST_TEST(ref.norms[static_cast<std::size_t>(s)] == float64_norm<typename Precision::grad_type>(s), boost::test_tools::tolerance(1e-12));
      }
    }
    for (const grid g : {grid{tp, 1, tp}, grid{tp, 2, 2 * tp}, grid{tp, 4, 4 * tp}, grid{tp, 2, 4 * tp}, grid{tp, 1, 2 * tp}}) {
      if (g.world > 8) continue;
      BOOST_TEST_CONTEXT("tp " << g.tp << ", ep " << g.ep << ", world " << g.world << " (dp " << g.world / g.tp
                               << ", expert-DP " << g.world / (g.tp * g.ep) << ")") {
        const moe_result r = run<Policy, Storage, Precision, Exec>(g.tp, g.world, g.ep);
        BOOST_TEST(r.ranks_agree);
        BOOST_TEST(std::memcmp(r.norms.data(), ref.norms.data(), steps * sizeof(double)) == 0);
        BOOST_TEST(r.skipped == ref.skipped, boost::test_tools::per_element());
        BOOST_TEST(same_bits(r.params, ref.params));
        BOOST_TEST(same_bits(r.states, ref.states));
      }
    }
  }
}

}  // namespace experts_test

