// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The replay loop for one policy, dispatched over (state, param, grad) number types.

#include <distopt/distopt.hpp>

#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#ifdef DISTOPT_REPLAY_MPI
#include <distopt/comm/mpi.hpp>
#endif

#include "replay.hpp"

namespace replay {

/// One rank's replay: the trace's gradient is the global gradient, so rank 0 gets it and
/// every other rank zeros, summed over the ranks: the result equals one rank's, bit for bit.
template <class Policy, class Storage, class Comm, class Param, class Grad>
result run_rank(const trace& tr, const config& cfg, Comm comm) {
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
  opts.grad_reduce = distopt::reduce_op::sum;
  const int rank = comm.rank();
  distopt::optimizer<Policy, Storage, Comm, distopt::cpu, distopt::precision<Param, Grad>> opt(
      std::move(lay), h, opts, distopt::cpu(cfg.threads), std::move(comm));

  for (const auto& n : tr.names) {
    auto p = opt.param(n);
    const auto& src = tr.params.at(n);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = distopt::from_float<Param>(src[i]);
  }
  for (const auto& step : tr.grads) {
    for (const auto& n : tr.names) {
      auto g = opt.grad(n);
      const auto& src = step.at(n);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = distopt::from_float<Grad>(rank == 0 ? src[i] : 0.0f);
    }
    opt.step();
    opt.zero_grad();
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

/// How the ranks run: one rank with replicated state, or --ranks N threads (or the MPI
/// world) with sharded state.
struct single_mode {};
struct threads_mode {};
struct mpi_mode {};

template <class Policy, class Mode, class State, class Param, class Grad>
result run_typed(const trace& tr, const config& cfg) {
  if constexpr (std::is_same_v<Mode, single_mode>) {
    return run_rank<Policy, distopt::replicated<State>, distopt::single, Param, Grad>(tr, cfg, distopt::single{});
  } else if constexpr (std::is_same_v<Mode, threads_mode>) {
    result out;
    distopt::run_ranks(cfg.ranks, [&](distopt::threads& comm) {
      const int rank = comm.rank();
      result r = run_rank<Policy, distopt::sharded<State>, distopt::threads, Param, Grad>(tr, cfg, std::move(comm));
      if (rank == 0) out = std::move(r);
    });
    return out;
  } else {
#ifdef DISTOPT_REPLAY_MPI
    return run_rank<Policy, distopt::sharded<State>, distopt::mpi, Param, Grad>(tr, cfg, distopt::mpi(MPI_COMM_WORLD));
#else
    static_assert(!std::is_same_v<Mode, mpi_mode>, "the mpi mode needs DISTOPT_REPLAY_MPI");
    return {};
#endif
  }
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

template <class Policy, class Mode>
result run_policy(const trace& tr, const config& cfg) {
  return with_number("--param-dtype", cfg.param_dtype, [&](auto p) {
    return with_number("--grad-dtype", cfg.grad_dtype, [&](auto g) {
      using P = typename decltype(p)::type;
      using G = typename decltype(g)::type;
      // Several ranks: the (param, grad) pairs that training uses, to keep the build small.
      constexpr bool distributed_pair = std::is_same_v<P, G> || std::is_same_v<G, float>;
      if constexpr (!std::is_same_v<Mode, single_mode> && !distributed_pair) {
        throw usage_error("--ranks/--comm: --grad-dtype must be fp32 or equal --param-dtype with several ranks");
        return result{};  // gives the lambda its return type
      } else {
        if (cfg.state == "fp32") return run_typed<Policy, Mode, float, P, G>(tr, cfg);
        if (cfg.state == "bf16") return run_typed<Policy, Mode, distopt::bf16, P, G>(tr, cfg);
        if (cfg.state == "q8")
          throw usage_error("--state q8: 8-bit states are not supported yet (planned)");
        throw usage_error("--state: unknown encoding '" + cfg.state + "' (fp32 or bf16)");
      }
    });
  });
}

}  // namespace replay
