// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The replay loop for one policy, dispatched over (state, param, grad) number types.

#include <distopt/distopt.hpp>

#include <algorithm>
#include <cstdio>
#include <locale.h>
#include <iostream>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <distopt/comm/any.hpp>
#include <distopt/comm/mesh.hpp>
// The cuda entries (run_<policy>_cuda.cu, nvcc) hold the cuda mode alone: MPI and Kokkos
// stay out of their translation units.
#if defined(DISTOPT_REPLAY_MPI) && !defined(__CUDACC__)
#include <distopt/comm/mpi.hpp>
#endif
#ifdef DISTOPT_REPLAY_CHECKPOINT
#include <distopt/checkpoint.hpp>
#endif
#if defined(DISTOPT_REPLAY_KOKKOS) && !defined(__CUDACC__)
#include <distopt/exec/kokkos.hpp>
#endif
#ifdef DISTOPT_REPLAY_EMULATED
#include <distopt/exec/emulated.hpp>
#endif
#ifdef __CUDACC__
#include <distopt/exec/cuda/executor.cuh>
#endif

#include "replay.hpp"

namespace replay {

/// Where this rank sits on the tensor-parallel axis (--tp): its index and the group size.
struct tp_place {
  int index = 0, size = 1;
};

/// How --tp splits the i-th tensor of the trace: matrices alternate between preferring
/// rows (dim 0) and columns (last dim), falling back to the other when the preferred one
/// does not divide by the TP size; vectors split by rows when they divide.
inline distopt::tp_split split_of(const std::vector<std::int64_t>& shape, std::size_t i, int tp) {
  if (tp == 1 || shape.empty()) return distopt::tp_split::none;
  const bool rows_ok = shape.front() % tp == 0, cols_ok = shape.size() >= 2 && shape.back() % tp == 0;
  if (shape.size() >= 2 && i % 2 == 1 && cols_ok) return distopt::tp_split::cols;
  if (rows_ok) return distopt::tp_split::rows;
  if (cols_ok) return distopt::tp_split::cols;
  return distopt::tp_split::none;
}

/// The full tensor's flat index of element `l` of TP part `t.index` of a tensor of `shape`.
inline std::size_t full_index(const std::vector<std::int64_t>& shape, distopt::tp_split split, tp_place t,
                              std::size_t l, std::size_t numel) {
  if (split == distopt::tp_split::rows) return static_cast<std::size_t>(t.index) * (numel / static_cast<std::size_t>(t.size)) + l;
  if (split == distopt::tp_split::cols) {
    const std::size_t c = static_cast<std::size_t>(shape.back()), lc = c / static_cast<std::size_t>(t.size);
    return (l / lc) * c + static_cast<std::size_t>(t.index) * lc + l % lc;
  }
  return l;
}

/// What one rank's replay needs of the trace, worked out once, apart from the optimizer's
/// type (this code is not instantiated per optimizer; only the lines that touch it are).
struct rank_plan {
  distopt::layout lay;
  /// Per tensor: the trace's flat index of each element of this rank's part.
  std::vector<std::vector<std::size_t>> at;
  std::vector<const std::vector<float>*> params;  ///< per tensor: the trace's initial values
  std::vector<std::size_t> trace_index;           ///< per tensor: its index in the trace
};

/// The layout of this TP part (group 1 for GaLore's matrices: 2-D and not *.bias) and the
/// element maps: of every tensor of the trace, or (`moe`) of its dense tensors
/// (`experts` empty) or of the experts in `experts`, each registered as that expert of
/// its expert tensor (layout::add_experts).
inline rank_plan plan_rank(const trace& tr, distopt::dtype param, bool projects, tp_place tp,
                           const moe_split* moe = nullptr, distopt::expert_range experts = {}) {
  rank_plan r;
  for (std::size_t k = 0; k < tr.names.size(); ++k) {
    const int e = moe ? moe->expert[k] : -1;
    if (moe && (experts.count == 0 ? e >= 0 : e < experts.first || e >= experts.first + experts.count)) continue;
    const auto& n = tr.names[k];
    auto shape = tr.shapes.at(n);  // a 0-d tensor is registered as [1]
    if (shape.empty()) shape = {1};
    const auto& full_shape = tr.shapes.at(n);
    const distopt::tp_split split = split_of(shape, moe ? moe->split_key[k] : k, tp.size);
    if (split == distopt::tp_split::rows) shape.front() /= tp.size;
    if (split == distopt::tp_split::cols) shape.back() /= tp.size;
    const bool bias = n.size() >= 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
    const int group = projects && shape.size() == 2 && !bias ? 1 : 0;
    if (e >= 0) r.lay.add_experts(moe->logical[k], moe->experts, {e, 1}, shape, param, group, split);
    else r.lay.add(n, shape, param, group, split);
    r.trace_index.push_back(k);
    r.params.push_back(&tr.params.at(n));
    const std::size_t numel = r.params.back()->size();
    std::size_t local = 1;
    for (auto e : shape) local *= static_cast<std::size_t>(e);
    auto& at = r.at.emplace_back(local);
    for (std::size_t i = 0; i < local; ++i) at[i] = full_index(full_shape, split, tp, i, numel);
  }
  return r;
}

/// Applies --set to `h` (the policy's defaults, or a loaded checkpoint's group); bad values
/// are usage errors.
template <class Policy>
typename Policy::hyper_params hyper_of(const config& cfg, typename Policy::hyper_params h = {}) {
  try {
    return distopt::apply_hyper_params<Policy>(std::move(h), cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {  // a value out of range
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {  // a setting that does not parse
    throw usage_error(std::string("--set ") + e.what());
  }
}

/// The optimizer options the flags ask for.
inline distopt::optimizer_options options_of(const config& cfg) {
  distopt::optimizer_options opts;
  opts.master_weights = cfg.master_weights;
  opts.grad_reduce = distopt::reduce_op::sum;
  opts.min_8bit_size = cfg.min_8bit_size;
  opts.percentile_clipping = cfg.percentile_clipping;
  opts.max_grad_norm = cfg.max_grad_norm;
  opts.grad_reduce_in_fp32 = cfg.grad_reduce_fp32;
  opts.micro_batches = cfg.accumulate;
  opts.accumulate = cfg.accumulate_each ? distopt::accumulation::reduce_each : distopt::accumulation::reduce_last;
  if (cfg.loss_scale > 0.0) {
    distopt::dynamic_loss_scale ls;
    ls.init_scale = cfg.loss_scale;
    ls.growth_interval = cfg.growth_interval;
    opts.loss_scale = ls;
  }
  return opts;
}

/// galore_adamw: the GaLore group (group 1, with the rank) holds the matrices not named
/// *.bias; everything else is in a plain group (group 0), as in tests/reference.
/// muon: likewise, the Muon group (group 1) holds the matrices not named *.bias, group 0
/// runs AdamW on the rest (use_muon = false), as tests/reference/muon_cases.txt describes.
/// What makes group g what it is, applied after --set (when built, and after a load).
template <class Policy>
void shape_group(typename Policy::hyper_params& h, std::size_t g) {
  if constexpr (distopt::projects_matrices<Policy>)
    if (g == 0) h.rank.reset();
  if constexpr (distopt::orthogonalizes_matrices<Policy>)
    if (g == 0) h.use_muon = false;
}

/// The first step to run after --resume loaded a checkpoint made after `calls` step() calls
/// (skipped steps included: each call consumed one step of the trace).
inline std::size_t resume_step(const trace& tr, const config& cfg, std::int64_t calls) {
  const auto first = static_cast<std::size_t>(calls);
  if (first > tr.grads.size())
    throw usage_error("--resume: the checkpoint is at step " + std::to_string(first) + ", the trace has " +
                      std::to_string(tr.grads.size()) + " steps");
  if (cfg.save_at > 0 && cfg.save_at <= static_cast<int>(first))
    throw usage_error("--save-at " + std::to_string(cfg.save_at) + ": the run resumes after step " +
                      std::to_string(first) + " (" + cfg.resume_dir + "), so it would save nothing");
  return first;
}

/// Writes a view of the optimizer's memory: `fill(i)` gives element i. In device memory
/// (emulated, cuda) through a host copy and distopt::upload, as a training code would.
template <class Exec, class View, class Fill>
void write_view(Exec& exec, View view, Fill&& fill) {
  using T = std::remove_const_t<typename View::element_type>;
  std::vector<T> host(view.size());
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = fill(i);
  distopt::upload(exec, std::span<const T>(host), view);
}

/// Reads a view of the optimizer's memory into host memory (distopt::download).
template <class Exec, class View>
auto read_view(Exec& exec, View view) {
  using T = std::remove_const_t<typename View::element_type>;
  std::vector<T> host(view.size());
  distopt::download(exec, view, std::span<T>(host));
  return host;
}

/// --accumulate: part `m` of `n` of `g` (a value of the grad type): the bits of its
/// significand cut into n runs, so that any sum of parts of one value is exact and all n
/// sum to g. Zeros and non-finite values are part 0; the other parts are zeros of g's sign.
inline float micro_part(float g, int m, int n) {
  if (n == 1) return g;
  if (g == 0.0f || !std::isfinite(g)) return m == 0 ? g : std::copysign(0.0f, g);
  int e = 0;
  const float f = std::frexp(std::fabs(g), &e);  // |g| = f 2^e, f in [0.5, 1)
  const auto sig = static_cast<std::uint32_t>(std::ldexp(f, 24));  // 24 bits, exact
  const int lo = 24 * m / n, hi = 24 * (m + 1) / n;
  const std::uint32_t mask = (hi >= 32 ? ~0u : (1u << hi) - 1u) & ~((1u << lo) - 1u);
  return std::copysign(std::ldexp(static_cast<float>(sig & mask), e - 24), g);
}

/// --log's line for step s (from 0): hexadecimal floats, the exact bits, in the "C" locale.
inline std::string log_line(std::size_t s, const distopt::step_result& r, double clip_norm) {
  char line[256];
  static const locale_t c_numbers = newlocale(LC_NUMERIC_MASK, "C", locale_t{});
  const locale_t before = uselocale(c_numbers);
  std::snprintf(line, sizeof line, "step %zu: skipped %d norm %a clip %a count %lld loss_scale %a\n", s + 1,
                r.skipped ? 1 : 0, r.grad_norm, clip_norm, static_cast<long long>(r.step), r.loss_scale);
  uselocale(before);
  return line;
}

/// One rank's replay: the trace's gradient is the global gradient, so rank 0 gets it and
/// every other rank zeros, summed over the ranks: the result equals one rank's, bit for bit.
template <class Policy, class Storage, class Comm, class Param, class Grad, class Exec = distopt::cpu>
result run_rank(const trace& tr, const config& cfg, Comm comm, std::optional<Comm> tp_comm = {},
                tp_place tp = {}) {
  constexpr bool matrix_groups = distopt::projects_matrices<Policy> || distopt::orthogonalizes_matrices<Policy>;
  std::vector<typename Policy::hyper_params> groups{hyper_of<Policy>(cfg)};
  if constexpr (matrix_groups) groups.push_back(groups[0]);
  for (std::size_t g = 0; g < groups.size(); ++g) shape_group<Policy>(groups[g], g);
  rank_plan plan = plan_rank(tr, distopt::dtype_of<Param>, matrix_groups, tp);
  const int rank = comm.rank();
  distopt::optimizer<Policy, Storage, Comm, Exec, distopt::precision<Param, Grad>> opt(
      std::move(plan.lay), groups, options_of(cfg), distopt::make_executor<Exec>(cfg.threads), std::move(comm));
  if (tp_comm) opt.set_tensor_parallel_group(std::move(*tp_comm));

  // --zero: the overlap hooks, as a training loop calls them. The params are written and
  // read one tensor at a time, gathered (the next one prefetched) and released (kept when
  // written: ZeRO-3 then holds only this rank's shard), and each tensor's grads are
  // declared ready as soon as they are written, the last tensor first (backward's order),
  // so that its bucket's reduction starts while the next ones are written.
  const bool hooks = cfg.zero > 0;
  const auto each_gathered = [&](auto&& use, bool keep) {
    for (std::size_t k = 0; k < tr.names.size(); ++k) {
      if (hooks) {
        opt.gather(tr.names[k]);
        if (k + 1 < tr.names.size()) opt.prefetch(tr.names[k + 1]);
      }
      use(k);
      if (hooks && keep) opt.release(tr.names[k], distopt::keep_writes);
      else if (hooks) opt.release(tr.names[k]);
    }
  };
  // Element i of this rank's part of tensor k is element plan.at[k][i] of the trace's tensor.
  each_gathered(
      [&](std::size_t k) {
        const auto& at = plan.at[k];
        const auto& src = *plan.params[k];
        write_view(opt.executor(), opt.param(tr.names[k]), [&](std::size_t i) { return distopt::from_float<Param>(src[at[i]]); });
      },
      true);
  std::size_t first_step = 0;
#ifdef DISTOPT_REPLAY_CHECKPOINT
  if (!cfg.resume_dir.empty()) {
    try {
      opt.load(cfg.resume_dir);
    } catch (const distopt::io::checkpoint_error& e) {  // missing, corrupt or another run's
      throw usage_error(std::string("--resume: ") + e.what());
    }
    first_step = resume_step(tr, cfg, opt.step_calls());
    // --set after the load, as a PyTorch loop sets a param group's lr after load_state_dict:
    // the checkpoint's hyper-parameters, with the keys --set names taking its values.
    if (!cfg.sets.empty())
      for (int g = 0; g < opt.group_count(); ++g) {
        auto h = hyper_of<Policy>(cfg, opt.hyper(g));
        shape_group<Policy>(h, static_cast<std::size_t>(g));
        opt.set_hyper(g, std::move(h));
      }
  }
#endif
  if (cfg.save_at > static_cast<int>(tr.grads.size()))
    throw usage_error("--save-at " + std::to_string(cfg.save_at) + ": the trace has only " +
                      std::to_string(tr.grads.size()) + " steps");
  std::size_t steps_run = 0;
  result out;
  const bool writer = rank == 0 && tp.index == 0;
  for (std::size_t s = first_step; s < tr.grads.size(); ++s, ++steps_run) {
    // --loss-scale: the grads of a loss multiplied by the scale; --nan-at: one NaN in rank
    // 0's first tensor (every rank then skips the step).
    const float scale = static_cast<float>(opt.loss_scale());
    const bool nan_step = static_cast<int>(s + 1) == cfg.nan_at;
    const int n = cfg.accumulate;
    for (int m = 0; m < n; ++m) {  // --accumulate: micro-batch m's part of each value, added
      for (std::size_t j = 0; j < tr.names.size(); ++j) {
        const std::size_t k = hooks ? tr.names.size() - 1 - j : j;
        const auto& at = plan.at[k];
        const auto& src = tr.grads[s].at(tr.names[k]);
        const auto view = opt.grad(tr.names[k]);
        const auto before = m == 0 ? std::vector<Grad>() : read_view(opt.executor(), view);
        write_view(opt.executor(), view, [&](std::size_t i) {
          if (nan_step && rank == 0 && k == 0 && i == 0) return distopt::from_float<Grad>(std::numeric_limits<float>::quiet_NaN());
          // The value in the grad type, then its part: exact in the grad type too.
          const float g = rank == 0 ? distopt::to_float(distopt::from_float<Grad>(src[at[i]] * scale)) : 0.0f;
          const float part = micro_part(g, m, n);
          // Over a zero (the first micro-batch, or reduce_each's zeroed view) the part itself,
          // so that a -0 stays -0 in the sum, as in the unsplit run.
          const float was = m == 0 ? 0.0f : distopt::to_float(before[i]);
          return distopt::from_float<Grad>(was == 0.0f ? part : was + part);
        });
        if (hooks) opt.grads_ready(tr.names[k]);
      }
      if (n > 1) opt.end_micro_batch();
    }
    const double clip_norm = cfg.clip > 0.0 ? opt.clip_grad_norm(cfg.clip) : 0.0;
    const distopt::step_result r = opt.step();
    opt.zero_grad();
    if (!cfg.log_path.empty() && writer) out.log += log_line(s, r, clip_norm);
#ifdef DISTOPT_REPLAY_CHECKPOINT
    if (static_cast<int>(s + 1) == cfg.save_at) opt.save(cfg.save_dir);
#endif
  }
#ifdef DISTOPT_REPLAY_CHECKPOINT
  // What the resumed run did, for a reader and for tests/reference/resume_identical.cmake
  // (a load that restored nothing would start at step 0 and replay the whole trace).
  if (!cfg.resume_dir.empty() && writer)
    std::cout << "distopt-replay: resumed at step " << first_step << ", ran " << steps_run << " steps\n";
#endif
  if (hooks && writer) {  // what the stage keeps on a rank, before the final gather
    const distopt::memory_report m = opt.memory();
    const auto per_param = [&](std::size_t bytes) {
      return std::to_string(static_cast<double>(bytes) / static_cast<double>(opt.tensors().numel())).substr(0, 4);
    };
    std::cout << "distopt-replay: ZeRO-" << decltype(opt)::zero_stage << " with the overlap hooks; rank 0 of "
              << opt.communicator().size() << " holds params " << per_param(m.bytes("params")) << ", grads "
              << per_param(m.bytes("grads")) << ", in all " << per_param(m.total_bytes()) << " B/param\n";
  }
  // The full tensors, with this rank's parts filled in (all of them without --tp).
  each_gathered(
      [&](std::size_t k) {
        const auto p = read_view(opt.executor(), opt.param(tr.names[k]));
        const auto& at = plan.at[k];
        auto& dst = out.params[tr.names[k]];
        dst.assign(plan.params[k]->size(), 0.0f);
        for (std::size_t i = 0; i < p.size(); ++i) dst[at[i]] = distopt::to_float(p[i]);
      },
      false);
  return out;
}

/// The full tensors from the parts of DP rank 0's TP ranks (part t holds its elements, at
/// the indices plan_rank maps them to).
inline result merge_tp_parts(const trace& tr, const config& cfg, std::vector<result> parts) {
  result out = std::move(parts[0]);
  for (int t = 1; t < cfg.tp; ++t) {
    const rank_plan plan = plan_rank(tr, distopt::dtype::f32, false, tp_place{t, cfg.tp});
    for (std::size_t k = 0; k < tr.names.size(); ++k) {
      const auto& n = tr.names[k];
      if (plan.at[k].size() == out.params[n].size()) continue;  // replicated over TP: part 0 has it all
      for (const std::size_t f : plan.at[k]) out.params[n][f] = parts[static_cast<std::size_t>(t)].params[n][f];
    }
  }
  return out;
}

/// --ep E: one rank of a mixture of experts, ranks as threads. make_mesh folds the world of
/// --ranks x --tp ranks into the dense grid (TP x DP) and the expert grid (ETP = TP, EP =
/// E, expert-DP = ranks / E); the dense tensors step in one optimizer over DP, this rank's
/// experts in another over expert-DP, both by one joint_step on the global norm. As in
/// run_rank, the DP (expert-DP) index 0 ranks hold the gradient and the others zeros. Fills
/// in `out`'s full tensors with this rank's parts (index 0 ranks), under `m`.
template <class Policy, class Storage, class Param, class Grad>
void run_experts_rank(const trace& tr, const config& cfg, distopt::threads& world, result& out, std::mutex& m) {
  using opt_t = distopt::optimizer<Policy, Storage, distopt::any_comm, distopt::cpu, distopt::precision<Param, Grad>>;
  constexpr bool matrix_groups = distopt::projects_matrices<Policy> || distopt::orthogonalizes_matrices<Policy>;
  std::vector<typename Policy::hyper_params> groups{hyper_of<Policy>(cfg)};
  if constexpr (matrix_groups) groups.push_back(groups[0]);
  for (std::size_t g = 0; g < groups.size(); ++g) shape_group<Policy>(groups[g], g);
  const moe_split moe = moe_of(tr);
  distopt::mesh<distopt::threads> g = distopt::make_mesh(world, {.tp = cfg.tp, .ep = cfg.ep, .etp = cfg.tp});
  const distopt::expert_range mine = g.experts(moe.experts);
  rank_plan plans[2] = {plan_rank(tr, distopt::dtype_of<Param>, matrix_groups, {g.at.tp, cfg.tp}, &moe),
                        plan_rank(tr, distopt::dtype_of<Param>, matrix_groups, {g.at.etp, cfg.tp}, &moe, mine)};
  const bool holds[2] = {g.at.dp == 0, g.at.edp == 0};  // the gradient, and the params to report
  const bool writer = world.rank() == 0;
  const auto names = [&](int o) {
    std::vector<std::string> n;
    for (const auto& t : plans[o].lay.tensors()) n.push_back(t.name);
    return n;
  };
  const std::vector<std::string> tensor_names[2] = {names(0), names(1)};
  opt_t d(std::move(plans[0].lay), groups, options_of(cfg), distopt::make_executor<distopt::cpu>(cfg.threads),
          distopt::any_comm(std::move(g.dp)));
  opt_t x(std::move(plans[1].lay), groups, options_of(cfg), distopt::make_executor<distopt::cpu>(cfg.threads),
          distopt::any_comm(std::move(g.edp)));
  if (cfg.tp > 1) {
    d.set_tensor_parallel_group(distopt::any_comm(std::move(g.tp)));
    x.set_tensor_parallel_group(distopt::any_comm(std::move(g.etp)));
  }
  x.set_expert_parallel_group(distopt::any_comm(std::move(g.ep)));
  opt_t* opts[2] = {&d, &x};
  for (int o = 0; o < 2; ++o)
    for (std::size_t j = 0; j < tensor_names[o].size(); ++j) {
      const auto& at = plans[o].at[j];
      const auto& src = *plans[o].params[j];
      write_view(opts[o]->executor(), opts[o]->param(tensor_names[o][j]),
                 [&](std::size_t i) { return distopt::from_float<Param>(src[at[i]]); });
    }
  for (std::size_t s = 0; s < tr.grads.size(); ++s) {
    const float scale = static_cast<float>(d.loss_scale());
    const bool nan_step = static_cast<int>(s + 1) == cfg.nan_at;
    for (int o = 0; o < 2; ++o)
      for (std::size_t j = 0; j < tensor_names[o].size(); ++j) {
        const std::size_t k = plans[o].trace_index[j];
        const auto& at = plans[o].at[j];
        const auto& src = tr.grads[s].at(tr.names[k]);
        write_view(opts[o]->executor(), opts[o]->grad(tensor_names[o][j]), [&](std::size_t i) {
          if (nan_step && holds[o] && k == 0 && i == 0) return distopt::from_float<Grad>(std::numeric_limits<float>::quiet_NaN());
          return distopt::from_float<Grad>(holds[o] ? distopt::to_float(distopt::from_float<Grad>(src[at[i]] * scale)) : 0.0f);
        });
      }
    const distopt::step_result r = distopt::joint_step(d, x);
    d.zero_grad();
    x.zero_grad();
    if (!cfg.log_path.empty() && writer) out.log += log_line(s, r, 0.0);
  }
  std::lock_guard<std::mutex> lock(m);
  for (int o = 0; o < 2; ++o) {
    if (!holds[o]) continue;
    for (std::size_t j = 0; j < tensor_names[o].size(); ++j) {
      const std::size_t k = plans[o].trace_index[j];
      const auto p = read_view(opts[o]->executor(), opts[o]->param(tensor_names[o][j]));
      auto& dst = out.params[tr.names[k]];
      dst.resize(tr.params.at(tr.names[k]).size());
      for (std::size_t i = 0; i < p.size(); ++i) dst[plans[o].at[j][i]] = distopt::to_float(p[i]);
    }
  }
}

/// How the ranks run: threads (--ranks N, ranks as threads) or mpi (the MPI world), with
/// sharded (or owned) state; or one rank with replicated state on the executor the mode
/// names: single (cpu), kokkos, emulated, cuda (--backend). A mode is declared only where its
/// DISTOPT_REPLAY_<MODE> is defined (examples/replay/CMakeLists.txt).
/// The threads and mpi modes hold their communicator in a `distopt::any_comm`, so that they
/// share one optimizer type per (policy, dtypes, state): the communicator is chosen at run
/// time, and each collective costs one indirect call more.
struct single_mode {
  using executor = distopt::cpu;
};
struct threads_mode {};
struct mpi_mode {};
#if defined(DISTOPT_REPLAY_KOKKOS) && !defined(__CUDACC__)
struct kokkos_mode {
  using executor = distopt::kokkos<>;
};
#endif
#ifdef DISTOPT_REPLAY_EMULATED
struct emulated_mode {
  using executor = distopt::emulated_device;
};
#endif
#ifdef __CUDACC__
struct cuda_mode {
  using executor = distopt::cuda;
  /// Without a device, the entry exits 77 (no_device_error) before building anything.
  static void check_device() {
    int devices = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0)
      throw no_device_error(std::string("--backend cuda: no CUDA device (") +
                            (e != cudaSuccess ? cudaGetErrorString(e) : "none found") + ")");
  }
};
#endif

/// A mode that runs one rank on the executor it names.
template <class Mode>
concept one_rank_mode = requires { typename Mode::executor; };

/// One data-parallel rank of several: sharded state, or with --placement owned (GaLore and
/// Muon only) each whole matrix on one rank (distopt::owned). --zero 2 and 3
/// (sharded<State, 2|3>, owned<State, 2|3>) are built for fp32 params, grads and states:
/// main.cpp refuses the rest. Stage 1 takes every combination.
template <class Policy, class State, class Param, class Grad, class... Args>
result run_dp_rank(const trace& tr, const config& cfg, Args&&... args) {
  constexpr bool matrices = distopt::projects_matrices<Policy> || distopt::orthogonalizes_matrices<Policy>;
  constexpr bool fp32 = std::is_same_v<State, float> && std::is_same_v<Param, float> && std::is_same_v<Grad, float>;
  const auto at = [&]<template <class, int> class Storage>() -> result {
    const auto go = [&]<int Stage>() {
      return run_rank<Policy, Storage<State, Stage>, distopt::any_comm, Param, Grad>(tr, cfg,
                                                                                     std::forward<Args>(args)...);
    };
    if constexpr (fp32) {
      if (cfg.zero == 2) return go.template operator()<2>();
      if (cfg.zero == 3) return go.template operator()<3>();
    }
    if (cfg.zero >= 2) throw usage_error("--zero " + std::to_string(cfg.zero) + ": not built for these types");
    return go.template operator()<1>();
  };
  if constexpr (matrices) {
    if (cfg.placement == "owned") return at.template operator()<distopt::owned>();
  }
  return at.template operator()<distopt::sharded>();
}

template <class Policy, class Mode, class State, class Param, class Grad>
result run_typed(const trace& tr, const config& cfg) {
  if constexpr (one_rank_mode<Mode>) {
    if constexpr (requires { Mode::check_device(); }) Mode::check_device();
    return run_rank<Policy, distopt::replicated<State>, distopt::single, Param, Grad, typename Mode::executor>(
        tr, cfg, distopt::single{});
  } else if constexpr (std::is_same_v<Mode, threads_mode>) {
    if (cfg.ep > 0) {  // main.cpp refuses --ep with other types, --zero, --accumulate, checkpoints
      if constexpr (std::is_same_v<State, float> && std::is_same_v<Param, float> && std::is_same_v<Grad, float>) {
        result out;
        std::mutex m;
        distopt::run_ranks(cfg.ranks * cfg.tp, [&](distopt::threads& world) {
          run_experts_rank<Policy, distopt::sharded<float>, Param, Grad>(tr, cfg, world, out, m);
        });
        return out;
      }
      throw usage_error("--ep: distopt-replay builds it for fp32 params, grads and states");
    }
    // Rank r = dp * tp + t of the grid; DP rank 0's TP ranks each fill in their parts.
    std::vector<result> parts(static_cast<std::size_t>(cfg.tp));
    distopt::run_ranks(cfg.ranks * cfg.tp, [&](distopt::threads& world) {
      const int dp = world.rank() / cfg.tp, t = world.rank() % cfg.tp;
      std::optional<distopt::any_comm> tp_comm;
      if (cfg.tp > 1) tp_comm.emplace(world.split(dp, t));
      distopt::threads dp_comm = cfg.tp > 1 ? world.split(t, dp) : std::move(world);
      result r = run_dp_rank<Policy, State, Param, Grad>(tr, cfg, distopt::any_comm(std::move(dp_comm)),
                                                         std::move(tp_comm), tp_place{t, cfg.tp});
      if (dp == 0) parts[static_cast<std::size_t>(t)] = std::move(r);
    });
    return merge_tp_parts(tr, cfg, std::move(parts));
  } else {
#if defined(DISTOPT_REPLAY_MPI) && !defined(__CUDACC__)
    distopt::mpi world(MPI_COMM_WORLD);
    if (cfg.tp == 1)
      return run_dp_rank<Policy, State, Param, Grad>(tr, cfg, distopt::any_comm(std::move(world)));
    // The world as the DP x TP grid, rank r = dp * tp + t, as with threads. The TP group
    // twice: the optimizer's, and one that brings the parts together for the output.
    const int dp = world.rank() / cfg.tp, t = world.rank() % cfg.tp;
    distopt::mpi tp_comm = world.split(dp, t), parts_comm = world.split(dp, t), dp_comm = world.split(t, dp);
    result mine = run_dp_rank<Policy, State, Param, Grad>(tr, cfg, distopt::any_comm(std::move(dp_comm)),
                                                          std::optional<distopt::any_comm>(distopt::any_comm(std::move(tp_comm))),
                                                          tp_place{t, cfg.tp});
    std::vector<result> parts(static_cast<std::size_t>(cfg.tp));
    for (const auto& n : tr.names) {
      const std::vector<float>& part = mine.params.at(n);
      std::vector<float> all(part.size() * static_cast<std::size_t>(cfg.tp));
      parts_comm.all_gather(std::span<const float>(part), std::span<float>(all));
      for (int p = 0; p < cfg.tp; ++p)
        parts[static_cast<std::size_t>(p)].params[n].assign(all.begin() + static_cast<std::ptrdiff_t>(p * part.size()),
                                                            all.begin() + static_cast<std::ptrdiff_t>((p + 1) * part.size()));
    }
    parts[0].log = std::move(mine.log);
    return merge_tp_parts(tr, cfg, std::move(parts));
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
      // remove_cvref: nvcc's front end (CUDA 13.0) sees decltype(p) of a nested generic
      // lambda's parameter as a reference here.
      using P = typename std::remove_cvref_t<decltype(p)>::type;
      using G = typename std::remove_cvref_t<decltype(g)>::type;
      // Several ranks, and layer-wise policies (several passes, each instantiated per
      // number type): the (param, grad) pairs that training uses, to keep the build small.
      constexpr bool training_pair = std::is_same_v<P, G> || std::is_same_v<G, float>;
      // GaLore (projected matrices) and Muon are built like the layer-wise policies: fp32 states.
      constexpr bool layerwise = distopt::policy_is_layerwise<Policy> || distopt::projects_matrices<Policy> ||
                                 distopt::orthogonalizes_matrices<Policy>;
      constexpr bool one_rank_backend = one_rank_mode<Mode> && !std::is_same_v<Mode, single_mode>;
      if constexpr ((!std::is_same_v<Mode, single_mode> || layerwise) && !training_pair) {
        throw usage_error(layerwise ? "--grad-dtype must be fp32 or equal --param-dtype for " + std::string(Policy::name)
                          : one_rank_backend ? "--backend " + cfg.backend + ": --grad-dtype must be fp32 or equal --param-dtype"
                                    : std::string("--ranks/--comm: --grad-dtype must be fp32 or equal --param-dtype with several ranks"));
        return result{};  // gives the lambda its return type
      } else {
        if (cfg.state == "fp32") return run_typed<Policy, Mode, float, P, G>(tr, cfg);
        if (cfg.state == "bf16" && layerwise)
          throw usage_error("--state bf16: " + std::string(Policy::name) + " keeps fp32 states in distopt-replay");
        if constexpr (!layerwise)
          if (cfg.state == "bf16") return run_typed<Policy, Mode, distopt::bf16, P, G>(tr, cfg);
        if (cfg.state == "q8") {
          // 8-bit states: element-wise policies, fp32 or bf16 params (to keep the build small).
          if constexpr (!layerwise && training_pair && (std::is_same_v<P, float> || std::is_same_v<P, distopt::bf16>))
            return run_typed<Policy, Mode, distopt::q8, P, G>(tr, cfg);
          throw usage_error(layerwise ? "--state q8: 8-bit states are for element-wise policies, not " + std::string(Policy::name)
                                      : std::string("--state q8: distopt-replay takes fp32 or bf16 params with q8, and grads "
                                                    "of the param dtype or fp32"));
        }
        throw usage_error("--state: unknown encoding '" + cfg.state + "' (fp32, bf16 or q8)");
      }
    });
  });
}

}  // namespace replay
