// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// A training loop with the overlap hooks (grads_ready, gather, prefetch, release) for the
// ZeRO-stage tests: tests/unit/zero.cpp (ranks as threads) and tests/mpi/mpi_zero.cpp.
#pragma once

#include "executor_harness.hpp"  // check_same

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace harness {

struct hook_run {
  bool hooks = false;
  bool rank0_only = false;  // the rank-0 trick: rank 0 writes the global grads, the others zeros
  int layer = 1;          // tensors per grads_ready call
  int steps = 12;
  int nan_step = -1;      // rank 1 (or 0 when d == 1) writes a NaN at this step
  unsigned order_seed = 1;
  distopt::optimizer_options options{};
};

template <class Opt>
std::vector<std::string> all_names(const Opt& opt) {
  std::vector<std::string> names;
  for (const auto& t : opt.tensors().tensors()) names.push_back(t.name);
  return names;
}

/// The initial params, written into gathered views and kept (every stage: below ZeRO-3
/// gather and release are bookkeeping, and the views are the params themselves).
template <class Opt>
void init_params(Opt& opt) {
  const auto names = all_names(opt);
  opt.gather(names);
  set_initial_params(opt);
  opt.release(names, keep_writes);
}

/// harness::collect, with every tensor gathered.
template <class Opt>
void collect_all(Opt& opt, int rank, outcome& out) {
  const auto names = all_names(opt);
  opt.gather(names);
  collect(opt, rank, out);
  opt.release(names);
}

/// A training loop: each rank writes its own grads (they depend on the rank and on the
/// gathered params) in two micro-batches, added into the grad views. The first in layout
/// order, everything gathered; then a forward pass, layer by layer with the next layer
/// prefetched; then backward, layer by layer in an order drawn for the step (backward
/// order shuffled, the same on every rank), each layer gathered, written, declared ready
/// (when `hooks`) and released. Stage 1 zeroes the grads before each step; stage 2 lends
/// zeroed buffers, so it zeroes only every other step.
template <class Opt>
void drive_hooks(Opt& opt, int rank, int d, const hook_run& hr, outcome* out) {
  using G = typename Opt::grad_type;
  using P = typename Opt::param_type;
  const auto tensors = opt.tensors().tensors();
  const auto names = all_names(opt);
  init_params(opt);
  std::mt19937 order_rng(hr.order_seed);
  const float share = hr.rank0_only ? (rank == 0 ? 1.0f : 0.0f) : 0.5f + 0.25f * static_cast<float>(rank);
  const auto add = [&](int s, std::size_t t, int micro) {
    const auto pview = opt.param(tensors[t].name);  // gathered
    std::vector<P> p(pview.size());
    download(opt.executor(), pview, std::span<P>(p));
    const auto view = opt.grad(tensors[t].name);  // host or device memory
    std::vector<G> v(view.size());
    download(opt.executor(), view, std::span<G>(v));
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float x = (grad_value(s, t, i) + 0.125f * to_float(p[i])) * share * (micro == 0 ? 0.75f : 0.25f);
      v[i] = from_float<G>(to_float(v[i]) + x);
    }
    if (s == hr.nan_step && rank == std::min(1, d - 1) && micro == 1) v[v.size() / 2] = from_float<G>(std::nanf(""));
    upload(opt.executor(), v, view);
  };
  const std::size_t per = static_cast<std::size_t>(hr.layer);
  const auto layer_of = [&](const std::vector<std::size_t>& order, std::size_t j) {
    std::vector<std::string> layer;
    for (std::size_t q = j; q < std::min(order.size(), j + per); ++q) layer.push_back(names[order[q]]);
    return layer;
  };
  for (int s = 0; s < hr.steps; ++s) {
    if (Opt::zero_stage < 2 || s % 2 == 0) opt.zero_grad();
    opt.gather(names);
    for (std::size_t t = 0; t < tensors.size(); ++t) add(s, t, 0);
    opt.release(names);
    std::vector<std::size_t> order(tensors.size());
    for (std::size_t t = 0; t < order.size(); ++t) order[t] = t;
    for (std::size_t j = 0; j < order.size(); j += per) {  // forward: read each layer
      if (j + per < order.size()) opt.prefetch(layer_of(order, j + per));
      const auto layer = layer_of(order, j);
      opt.gather(layer);
      for (const auto& n : layer) {
        std::vector<P> p(opt.param(n).size());
        download(opt.executor(), opt.param(n), std::span<P>(p));
      }
      opt.release(layer);
    }
    std::reverse(order.begin(), order.end());  // backward
    if (s % 2 == 1) std::shuffle(order.begin(), order.end(), order_rng);
    for (std::size_t j = 0; j < order.size(); j += per) {
      if (j + per < order.size()) opt.prefetch(layer_of(order, j + per));
      const auto layer = layer_of(order, j);
      opt.gather(layer);
      for (std::size_t q = j; q < std::min(order.size(), j + per); ++q) add(s, order[q], 1);
      if (hr.hooks) opt.grads_ready(layer);
      opt.release(layer);
    }
    const step_result r = opt.step();
    if (out) {
      out->norms.push_back(r.grad_norm);
      out->skipped.push_back(r.skipped);
    }
  }
}

/// drive_hooks on d ranks as threads (`Comm` is made from each rank's `threads` handle),
/// with a sum reduction; what rank 0 sees and every rank's shard.
template <class Policy, class Storage, class Prec, class Exec = distopt::cpu, class Comm = distopt::threads>
outcome run_hooks(int d, const distopt::layout& l, const std::vector<typename Policy::hyper_params>& h, hook_run hr) {
  using opt_t = distopt::optimizer<Policy, Storage, Comm, Exec, Prec>;
  hr.options.grad_reduce = distopt::reduce_op::sum;
  outcome out = blank<opt_t>(l, Policy::state_slots(h.front()));
  distopt::run_ranks(d, [&](distopt::threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, h, hr.options, distopt::make_executor<Exec>(1), Comm(std::move(comm)));
    drive_hooks(opt, rank, d, hr, rank == 0 ? &out : nullptr);
    collect_all(opt, rank, out);
  });
  return out;
}

/// AdamW with decoupled weight decay: the policy most of the ZeRO tests run.
inline distopt::adamw::hyper_params adamw_decayed() {
  distopt::adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  return h;
}

/// AdamW (adamw_decayed) with bf16 params and grads and fp32 states, on each awkward layout
/// and d = 1..3 ranks: calls f(layout, d, hr with the hooks on, reference), the reference
/// being stage 1 without the hooks on cpu and `threads`.
template <class F>
void adamw_bf16_hook_cases(hook_run hr, F&& f) {
  using namespace distopt;
  for (const layout_case& c : awkward_layouts()) {
    hr.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, dtype::bf16);
    for (int d = 1; d <= 3; ++d) {
      BOOST_TEST_CONTEXT("layout " << c.name << " d=" << d) {
        hook_run off = hr, on = hr;
        off.hooks = false;
        on.hooks = true;
        f(l, d, on, run_hooks<adamw, sharded<float>, precision<bf16>>(d, l, {adamw_decayed()}, off));
      }
    }
  }
}

}  // namespace harness
