// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The replay loop for one policy, dispatched over (state, param, grad) number types.

#include <distopt/distopt.hpp>

#include <string>
#include <string_view>
#include <tuple>

#include "replay.hpp"

namespace replay {

template <class Policy, class State, class Param, class Grad>
result run_typed(const trace& tr, const config& cfg) {
  typename Policy::hyper_params h;
  try {
    h = distopt::apply_hyper_params<Policy>(h, cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {  // a value out of range
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {  // a setting that does not parse
    throw usage_error(std::string("--set ") + e.what());
  }

  distopt::layout lay;
  for (const auto& n : tr.names) {
    const auto& shape = tr.shapes.at(n);  // a 0-d tensor is registered as [1]
    lay.add(n, shape.empty() ? std::vector<std::int64_t>{1} : shape, distopt::dtype_of<Param>);
  }
  distopt::optimizer_options opts;
  opts.master_weights = cfg.master_weights;
  distopt::optimizer<Policy, distopt::replicated<State>, distopt::single, distopt::cpu,
                     distopt::precision<Param, Grad>>
      opt(std::move(lay), h, opts, distopt::cpu(cfg.threads));

  for (const auto& n : tr.names) {
    auto p = opt.param(n);
    const auto& src = tr.params.at(n);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = distopt::from_float<Param>(src[i]);
  }
  for (const auto& step : tr.grads) {
    for (const auto& n : tr.names) {
      auto g = opt.grad(n);
      const auto& src = step.at(n);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = distopt::from_float<Grad>(src[i]);
    }
    opt.step();
  }
  result out;
  for (const auto& n : tr.names) {
    auto p = opt.param(n);
    auto& dst = out[n];
    dst.reserve(p.size());
    for (auto x : p) dst.push_back(distopt::to_float(x));
  }
  return out;
}

template <class T>
struct type_tag {
  using type = T;
};

/// Calls f(type_tag<T>) for the number type named `name` (fp32, bf16, fp16).
template <class F>
result with_number(std::string_view what, std::string_view name, F&& f) {
  const auto t = distopt::parse_dtype(name);
  if (!t) throw usage_error(std::string(what) + ": unknown dtype '" + std::string(name) +
                            "' (fp32, bf16 or fp16)");
  switch (*t) {
    case distopt::dtype::f32: return f(type_tag<float>{});
    case distopt::dtype::bf16: return f(type_tag<distopt::bf16>{});
    case distopt::dtype::f16: return f(type_tag<distopt::fp16>{});
  }
  throw usage_error(std::string(what) + ": unsupported dtype");
}

template <class Policy>
result run_policy(const trace& tr, const config& cfg) {
  return with_number("--param-dtype", cfg.param_dtype, [&](auto p) {
    return with_number("--grad-dtype", cfg.grad_dtype, [&](auto g) {
      using P = typename decltype(p)::type;
      using G = typename decltype(g)::type;
      if (cfg.state == "fp32") return run_typed<Policy, float, P, G>(tr, cfg);
      if (cfg.state == "bf16") return run_typed<Policy, distopt::bf16, P, G>(tr, cfg);
      if (cfg.state == "q8")
        throw usage_error("--state q8: 8-bit states are not supported yet (planned)");
      throw usage_error("--state: unknown encoding '" + cfg.state + "' (fp32 or bf16)");
    });
  });
}

}  // namespace replay
