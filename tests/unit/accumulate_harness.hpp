// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Gradient accumulation's test loop and its references (tests/unit/accumulate*.cpp).
//
// Every rank r writes, in micro-batch k of step s, the grads part(s, t, j, r, k) of element j
// of tensor t, added into zeroed views, as a backward adds into its .grad. The reference is
// one rank with one micro-batch fed the global gradient G that the schedule's arithmetic
// gives, computed here in float in its documented order:
//   reduce_last  G = sum over ranks (in rank order) of each rank's sum over micro-batches;
//   reduce_each  G = sum over micro-batches of each micro-batch's sum over ranks.
// A rank's part goes into a zeroed view (0 + x); reduce_each's accumulator starts as a copy
// of the first micro-batch's sum. With `exact` parts (small integers
// times 2^-16) every order gives the same G, so every run equals one reference.
#pragma once

#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace acc {

using namespace distopt;

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Rank r's grads of element j of tensor t in micro-batch k of step s; NaN at `nan_step`
/// in micro-batch 1 of the last rank (element 3 of tensor 0).
struct parts {
  bool exact = false;
  int nan_step = -1;
  int last_rank = 0;
  float operator()(int s, std::size_t t, std::size_t j, int r, int k) const {
    if (s == nan_step && r == last_rank && k == 1 && t == 0 && j == 3) return std::nanf("");
    const std::uint64_t h = mix((static_cast<std::uint64_t>(s) << 52) ^ (static_cast<std::uint64_t>(t) << 44) ^
                                (static_cast<std::uint64_t>(j) << 12) ^ (static_cast<std::uint64_t>(r) << 6) ^
                                static_cast<std::uint64_t>(k));
    if (exact) return std::ldexp(static_cast<float>(static_cast<int>(h % 64) - 32), -16);  // |sum of 12| < 2^9
    return (static_cast<float>(h >> 40) / 16777216.0f - 0.5f) * 0.03f * (1.0f + 0.37f * static_cast<float>(k));
  }
};

inline const char* schedule_name(accumulation a) {
  return a == accumulation::reduce_last ? "reduce_last" : "reduce_each";
}

/// Every part of d ranks and n micro-batches, summed in any order: exact for `exact` parts.
inline float sum_of_parts(const parts& p, int d, int n, int s, std::size_t t, std::size_t j) {
  float g = 0.0f;
  for (int k = 0; k < n; ++k)
    for (int r = 0; r < d; ++r) g += p(s, t, j, r, k);
  return g;
}

struct run_cfg {
  int d = 1;
  int n = 1;
  bool hooks = false;
  int steps = 3;
  optimizer_options options{};
};

struct outcome {
  std::vector<std::uint32_t> params;  // rank 0's full params, as bits (of float)
  std::vector<double> norms;
  std::vector<int> skipped;
};

template <class Opt>
std::vector<std::string> names_of(const Opt& opt) {
  std::vector<std::string> names;
  for (const auto& t : opt.tensors().tensors()) names.push_back(t.name);
  return names;
}

/// Initial params (every stage: gathered, written, kept), the steps, and rank 0's params.
/// `grad(s, t, j, r, k)` gives what rank r adds in micro-batch k.
template <class Opt>
void train(Opt& opt, int rank, const run_cfg& cfg, const std::function<float(int, std::size_t, std::size_t, int, int)>& grad,
           outcome* out) {
  using P = typename Opt::param_type;
  using G = typename Opt::grad_type;
  const auto names = names_of(opt);
  opt.gather(names);
  for (std::size_t t = 0; t < names.size(); ++t) {
    const auto view = opt.param(names[t]);
    std::vector<P> p(view.size());
    for (std::size_t j = 0; j < p.size(); ++j)
      p[j] = static_cast<P>(0.25f * std::sin(0.37f * static_cast<float>(j) + static_cast<float>(t)));
    upload(opt.executor(), std::span<const P>(p), view);
  }
  opt.release(names, keep_writes);
  std::vector<G> v;
  for (int s = 0; s < cfg.steps; ++s) {
    opt.zero_grad();
    for (int k = 0; k < cfg.n; ++k) {
      for (std::size_t q = names.size(); q-- > 0;) {  // backward: the last tensor first
        const auto view = opt.grad(names[q]);  // in host or (offload) device memory
        v.resize(view.size());
        download(opt.executor(), view, std::span<G>(v));
        for (std::size_t j = 0; j < v.size(); ++j)
          v[j] = static_cast<G>(static_cast<float>(v[j]) + grad(s, q, j, rank, k));
        upload(opt.executor(), std::span<const G>(v), view);
        if (cfg.hooks) opt.grads_ready(names[q]);
      }
      if (cfg.n > 1) opt.end_micro_batch();
    }
    const step_result r = opt.step();
    if (out) {
      out->norms.push_back(r.grad_norm);
      out->skipped.push_back(r.skipped ? 1 : 0);
    }
  }
  opt.gather(names);
  if (out)
    for (const auto& name : names) {
      const auto view = opt.param(name);
      std::vector<P> p(view.size());
      download(opt.executor(), view, std::span<P>(p));
      for (const P& x : p) {
        const float f = static_cast<float>(x);
        std::uint32_t b;
        std::memcpy(&b, &f, sizeof b);
        out->params.push_back(b);
      }
    }
  opt.release(names);
}

/// `cfg.d` ranks as threads, each training optimizer type Opt; rank 0's outcome.
template <class Opt>
outcome run(const layout& l, const std::vector<typename Opt::hyper_params>& h, const run_cfg& cfg,
            const std::function<float(int, std::size_t, std::size_t, int, int)>& grad) {
  outcome out;
  run_ranks(cfg.d, [&](threads& comm) {
    const int rank = comm.rank();
    Opt opt(l, h, cfg.options, make_executor<typename Opt::executor_type>(1), std::move(comm));
    train(opt, rank, cfg, grad, rank == 0 ? &out : nullptr);
  });
  return out;
}

/// The global gradient the schedule forms from `p` over d ranks and n micro-batches, in
/// float (fp32 grads), as the header says.
inline float global_grad(const parts& p, accumulation sched, int d, int n, int s, std::size_t t, std::size_t j) {
  if (sched == accumulation::reduce_last || n == 1) {
    float g = 0.0f;
    for (int r = 0; r < d; ++r) {
      float a = 0.0f;
      for (int k = 0; k < n; ++k) a = a + p(s, t, j, r, k);
      g = r == 0 ? a : g + a;
    }
    return g;
  }
  float acc = 0.0f;
  for (int k = 0; k < n; ++k) {
    float red = 0.0f;
    for (int r = 0; r < d; ++r) {
      const float x = 0.0f + p(s, t, j, r, k);
      red = r == 0 ? x : red + x;
    }
    acc = k == 0 ? red : acc + red;
  }
  return acc;
}

inline void check_same(const outcome& got, const outcome& want) {
  BOOST_TEST(got.skipped == want.skipped, boost::test_tools::per_element());
  BOOST_REQUIRE_EQUAL(got.norms.size(), want.norms.size());
  for (std::size_t i = 0; i < got.norms.size(); ++i)  // as bits: NaN where no norm was computed
    BOOST_TEST(std::memcmp(&got.norms[i], &want.norms[i], sizeof(double)) == 0,
               "step " << i << ": norm " << got.norms[i] << " vs " << want.norms[i]);
  BOOST_REQUIRE_EQUAL(got.params.size(), want.params.size());
  std::size_t differ = 0, first = 0;
  for (std::size_t i = 0; i < got.params.size(); ++i)
    if (got.params[i] != want.params[i] && differ++ == 0) first = i;
  BOOST_TEST(differ == 0u, differ << " params differ in their bits, the first at element " << first);
}

/// For every d in `ds`, n in {1, 4}, schedule and hooks on or off: Opt on d ranks with n
/// micro-batches equals Ref (one rank, one micro-batch) fed the schedule's global gradient;
/// with `exact` parts every run equals one reference.
template <class Opt, class Ref = Opt>
void check_schedules(const layout& l, const std::vector<typename Opt::hyper_params>& h, optimizer_options o,
                     std::vector<int> ds, bool exact, std::vector<int> ns = {1, 4},
                     std::vector<accumulation> schedules = {accumulation::reduce_last, accumulation::reduce_each}) {
  o.grad_reduce = reduce_op::sum;
  o.bucket_elems = 512;
  for (const accumulation sched : schedules)
    for (const int d : ds)
      for (const int n : ns) {
        parts p;
        p.exact = exact;
        run_cfg ref_cfg;
        ref_cfg.options = o;
        const outcome want = run<Ref>(l, h, ref_cfg, [&](int s, std::size_t t, std::size_t j, int, int) {
          return global_grad(p, sched, d, n, s, t, j);
        });
        for (const bool hooks : {false, true}) {
          run_cfg cfg;
          cfg.d = d;
          cfg.n = n;
          cfg.hooks = hooks;
          cfg.options = o;
          cfg.options.micro_batches = n;
          cfg.options.accumulate = sched;
          BOOST_TEST_CONTEXT(schedule_name(sched) << " d=" << d << " n=" << n << (hooks ? " hooks" : "") << (exact ? " exact" : "")) {
            check_same(run<Opt>(l, h, cfg, std::cref(p)), want);
          }
        }
      }
}

/// Matrices and vectors over several buckets of 512 elements, cut across shards.
inline layout mixed_layout(dtype t = dtype::f32) {
  layout l;
  l.add("w0", {33, 20}, t);
  l.add("b0", {20}, t);
  l.add("w1", {17, 9}, t);
  l.add("e", {1000}, t);
  return l;
}

}  // namespace acc
