// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A data-parallel x tensor-parallel grid of ranks as threads, for the suites that compare
// it with the unsplit single rank (layerwise.cpp at stage 1; zero_tp.cpp at ZeRO-2, ZeRO-3
// and offload): each matrix split by rows or columns over the TP ranks, the rank-0 trick
// over the DP ranks (DP rank 0 writes the global grads, the others zeros), so that every
// grid gives the single rank's bits.
#pragma once

#include "sharded_harness.hpp"  // init_value, grad_value

#include <distopt/distopt.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace harness {

struct tp_tensor {
  std::vector<std::int64_t> shape;  // the whole tensor
  distopt::tp_split split;
  int group = 0;
};

inline std::vector<tp_tensor> tp_tensors() {
  using distopt::tp_split;
  return {{{12, 40}, tp_split::rows},    // column-parallel weight: rows split, column sums need TP
          {{20, 30}, tp_split::cols},    // row-parallel weight: columns split, row sums need TP
          {{6}, tp_split::rows},         // its bias
          {{4, 6, 10}, tp_split::rows},  // a batch of matrices split by the batch
          {{3, 5, 16}, tp_split::cols},  // a batch split by columns
          {{9}, tp_split::none},         // replicated over TP
          {{7, 300}, tp_split::cols}};   // rows that straddle blocks and DP cuts
}

/// The full tensor's flat index of element l of TP part t of `tp` parts.
inline std::size_t full_index(const tp_tensor& x, int t, int tp, std::size_t l) {
  std::size_t numel = 1;
  for (auto s : x.shape) numel *= static_cast<std::size_t>(s);
  if (x.split == distopt::tp_split::rows) return static_cast<std::size_t>(t) * (numel / static_cast<std::size_t>(tp)) + l;
  if (x.split == distopt::tp_split::cols) {
    const std::size_t c = static_cast<std::size_t>(x.shape.back()), lc = c / static_cast<std::size_t>(tp);
    return (l / lc) * c + static_cast<std::size_t>(t) * lc + l % lc;
  }
  return l;
}

struct grid_run {
  int dp = 1, tp = 1;  // dp = tp = 1: the unsplit single rank
  int steps = 30;
  bool hooks = false;  // each tensor's grads declared ready as written, the last tensor first
};

/// Runs `g.steps` of Policy with `Storage` on executor `Exec` over the grid and returns the
/// reassembled params of every tensor, and with `states` its slot-0 states. Params are
/// written and read through gather/release (every stage) and upload/download (every
/// executor).
template <class Policy, class Storage = distopt::sharded<distopt::fp32>, class Exec = distopt::cpu>
std::vector<std::vector<float>> run_grid(const std::vector<tp_tensor>& xs,
                                         const std::vector<typename Policy::hyper_params>& h, const grid_run& g,
                                         std::vector<std::vector<float>>* states) {
  using namespace distopt;
  const int tp = g.tp;
  std::vector<std::vector<float>> params(xs.size()), st(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    std::size_t n = 1;
    for (auto s : xs[i].shape) n *= static_cast<std::size_t>(s);
    params[i].assign(n, 0.0f);
    st[i].assign(n, 0.0f);
  }
  std::vector<std::string> names;
  for (std::size_t i = 0; i < xs.size(); ++i) names.push_back(std::string("t").append(std::to_string(i)));
  std::mutex m;
  run_ranks(g.dp * tp, [&](threads& world) {
    const int d = world.rank() / tp, t = world.rank() % tp;
    std::optional<threads> tp_comm;
    if (tp > 1) tp_comm.emplace(world.split(d, t));
    threads dp_comm = tp > 1 ? world.split(t, d) : std::move(world);
    layout l;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      auto shape = xs[i].shape;
      const tp_split split = tp > 1 ? xs[i].split : tp_split::none;
      if (split == tp_split::rows) shape.front() /= tp;
      if (split == tp_split::cols) shape.back() /= tp;
      l.add(names[i], shape, dtype::f32, xs[i].group, split);
    }
    optimizer_options o;
    o.grad_reduce = reduce_op::sum;
    o.bucket_elems = 600;  // several buckets
    optimizer<Policy, Storage, threads, Exec> opt(l, h, o, make_executor<Exec>(1), std::move(dp_comm));
    if (tp_comm) opt.set_tensor_parallel_group(std::move(*tp_comm));
    const auto place = [&](std::size_t i, std::size_t e) { return tp > 1 ? full_index(xs[i], t, tp, e) : e; };
    opt.gather(names);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      std::vector<float> p(opt.param(names[i]).size());
      for (std::size_t e = 0; e < p.size(); ++e) p[e] = init_value(i, place(i, e));
      upload(opt.executor(), p, opt.param(names[i]));
    }
    opt.release(names, keep_writes);
    for (int s = 0; s < g.steps; ++s) {
      opt.zero_grad();
      for (std::size_t i = xs.size(); i-- > 0;) {
        std::vector<float> v(opt.grad(names[i]).size());
        for (std::size_t e = 0; e < v.size(); ++e) v[e] = d == 0 ? grad_value(s, i, place(i, e)) : 0.0f;
        upload(opt.executor(), v, opt.grad(names[i]));
        if (g.hooks) opt.grads_ready(names[i]);
      }
      opt.step();
    }
    opt.gather(names);
    std::lock_guard<std::mutex> lock(m);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      if (d == 0) {
        std::vector<float> p(opt.param(names[i]).size());
        download(opt.executor(), opt.param(names[i]), std::span<float>(p));
        for (std::size_t e = 0; e < p.size(); ++e) params[i][place(i, e)] = p[e];
      }
      if (!states) continue;
      const auto sv = opt.local_state(names[i], 0);
      for (std::size_t e = 0; e < sv.values.size(); ++e) st[i][place(i, sv.first + e)] = sv.values[e];
    }
    opt.release(names);
  });
  if (states) *states = std::move(st);
  return params;
}

}  // namespace harness
