// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// distopt-bench-step: shared pieces. One translation unit per policy instantiates its cases
// (param x grad x state), so the benchmark builds in parallel.

#include <distopt/distopt.hpp>

#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace bench {

struct settings {
  std::size_t params = std::size_t{64} << 20;
  int threads = 0;
  int repeats = 5;
  /// One timed run of the stream kernel with `rw` arrays read and written (the row's access
  /// shape) over the optimizer's pool: GB/s. measure_on runs it after each timed step, so
  /// that a row and its ceiling see the same moments of a machine whose bandwidth drifts.
  std::function<double(int rw)> beside;
};

/// One measured case.
struct row {
  std::string policy, options, param, grad, state;
  double ns_per_param = 0, bytes_per_param = 0, gbps = 0;
  double beside_gbps = 0;  ///< the best of the same-shape stream kernel, timed in turn with the steps
  int rw_arrays = 0;  ///< arrays read and written back: param, master, state slots
  bool finite_check = false;  ///< default options: the exact norm and finite check read the grads first
  std::uint64_t digest = 0;   ///< FNV-1a of the params' bytes after the timed steps: equal across builds
};

/// GPT-like tensors (d = 1024): an embedding, then layers of qkv/proj/fc matrices and
/// their biases and norms, until n parameters.
inline distopt::layout gpt_like(std::size_t n, distopt::dtype t) {
  distopt::layout l;
  const std::int64_t d = 1024;
  std::size_t total = 0;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
    std::size_t numel = 1;
    for (auto x : shape) numel *= static_cast<std::size_t>(x);
    if (total + numel > n) return false;
    l.add(name, std::move(shape), t);
    total += numel;
    return true;
  };
  add("wte", {8192, d});
  for (int i = 0; total < n; ++i) {
    std::string p = "h";  // appended, not "h" + ...: GCC 12 warns -Wrestrict on the latter
    p += std::to_string(i);
    p += '.';
    if (!add(p + "ln1", {d}) || !add(p + "qkv", {3 * d, d}) || !add(p + "qkv.bias", {3 * d}) ||
        !add(p + "proj", {d, d}) || !add(p + "ln2", {d}) || !add(p + "fc", {4 * d, d}) ||
        !add(p + "fc.bias", {4 * d}) || !add(p + "fc_proj", {d, 4 * d}))
      break;
  }
  if (total < n) l.add("rest", {static_cast<std::int64_t>(n - total)}, t);
  return l;
}

/// How a case is run: the fused update alone (the finite check off), or a user's default
/// options (check_finite on: the exact norm pass reads the grads before the update).
enum class checks { off, defaults };

/// Times one step of Policy with the given number types, on executor `exec`.
template <class Policy, class State, class Param, class Grad, class Exec>
row measure_on(Exec exec, const settings& s, const typename Policy::hyper_params& h, std::string options,
               bool master_weights = true, checks c = checks::off) {
  using opt_t = distopt::optimizer<Policy, distopt::replicated<State>, distopt::single,
                                   Exec, distopt::precision<Param, Grad>>;
  distopt::optimizer_options o;
  o.check_finite = c == checks::defaults;
  o.master_weights = master_weights;
  opt_t opt(gpt_like(s.params, distopt::dtype_of<Param>), h, o, std::move(exec));
  for (auto& g : opt.grads()) g = distopt::from_float<Grad>(1e-3f);
  opt.step();
  const auto mem = opt.memory();
  const int slots = Policy::state_slots(h);
  const bool master = mem.bytes("master") != 0;
  const int rw = 1 + (master ? 1 : 0) + slots;
  double secs = 1e30, beside = 0;
  for (int k = 0; k < s.repeats; ++k) {
    secs = std::min(secs, best_seconds(1, [&] { opt.step(); }));
    if (s.beside) beside = std::max(beside, s.beside(rw));
  }
  const double n = static_cast<double>(opt.tensors().numel());
  row r;
  r.digest = 14695981039346656037ull;
  for (const auto& p : opt.params()) {
    unsigned char b[sizeof p];
    std::memcpy(b, &p, sizeof p);
    for (unsigned char c : b) r.digest = (r.digest ^ c) * 1099511628211ull;
  }
  r.policy = std::string(Policy::name);
  r.options = std::move(options);
  r.param = std::string(distopt::dtype_name(distopt::dtype_of<Param>));
  if (!std::is_same_v<Param, float>) r.param += master ? "+master" : "+sr";
  r.grad = std::string(distopt::dtype_name(distopt::dtype_of<Grad>));
  // q8: a code read and written per slot, and an fp32 absmax per 256 elements (read and
  // written); the tensors under 4096 elements (biases, norms: 0.1 %) keep fp32 states.
  constexpr bool q8 = distopt::quantized_encoding<State>;
  if constexpr (q8) r.state = slots ? "q8" : "-";
  else r.state = slots ? std::string(distopt::dtype_name(distopt::dtype_of<State>)) : "-";
  r.finite_check = c == checks::defaults;
  r.bytes_per_param = 2.0 * sizeof(Param) + sizeof(Grad) + (master ? 8.0 : 0.0) +
                      (q8 ? slots * (2.0 + 8.0 / distopt::q8::block) : 2.0 * slots * sizeof(State)) +
                      (r.finite_check ? sizeof(Grad) : 0.0);
  r.ns_per_param = secs / n * 1e9;
  r.gbps = n * r.bytes_per_param / secs / 1e9;
  r.beside_gbps = beside;
  r.rw_arrays = rw;
  return r;
}

/// measure_on the CPU executor with s.threads threads.
template <class Policy, class State, class Param, class Grad>
row measure(const settings& s, const typename Policy::hyper_params& h, std::string options,
            bool master_weights = true, checks c = checks::off) {
  return measure_on<Policy, State, Param, Grad>(distopt::cpu(s.threads), s, h, std::move(options), master_weights, c);
}

/// The (param, grad, state) combinations measured for every policy.
template <class Policy>
void measure_all(const settings& s, const typename Policy::hyper_params& h,
                 const std::string& options, std::vector<row>& out) {
  using distopt::bf16;
  using distopt::fp16;
  out.push_back(measure<Policy, float, float, float>(s, h, options, true, checks::defaults));
  out.push_back(measure<Policy, float, bf16, bf16>(s, h, options, true, checks::defaults));
  out.push_back(measure<Policy, float, float, float>(s, h, options));
  out.push_back(measure<Policy, bf16, float, float>(s, h, options));
  out.push_back(measure<Policy, float, bf16, bf16>(s, h, options));
  out.push_back(measure<Policy, bf16, bf16, bf16>(s, h, options));
  out.push_back(measure<Policy, float, bf16, bf16>(s, h, options, false));
  out.push_back(measure<Policy, float, bf16, float>(s, h, options));
  out.push_back(measure<Policy, float, fp16, fp16>(s, h, options));
  out.push_back(measure<Policy, distopt::q8, float, float>(s, h, options));
  out.push_back(measure<Policy, distopt::q8, bf16, bf16>(s, h, options));
}

void run_sgd(const settings&, std::vector<row>&);
void run_adam(const settings&, std::vector<row>&);
void run_adamw(const settings&, std::vector<row>&);
void run_lion(const settings&, std::vector<row>&);

}  // namespace bench
