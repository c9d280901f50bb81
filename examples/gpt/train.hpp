// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The training loop of distopt-gpt for one policy: ranks as threads, tensor parallel x data
// parallel, the optimizer's state sharded over the data-parallel ranks at ZeRO stage 1, 2 or
// 3. Included only by the train_<policy>.cpp files.

#include <distopt/distopt.hpp>
#include <distopt/io/safetensors.hpp>
#ifdef DISTOPT_GPT_CHECKPOINT
#include <distopt/checkpoint.hpp>
#endif
#ifdef DISTOPT_GPT_MPI
#include <distopt/comm/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpt.hpp"
#include "setup.hpp"

namespace gpt {

/// The sequences of data-parallel rank `d` of `dp`: a contiguous share of the batch's rows.
inline std::pair<int, int> sequences_of(int batch, int dp, int d) { return {d * (batch / dp), batch / dp}; }

/// One rank: `dp_comm` its data-parallel group, `tp_opt` and `tp_model` two handles of its
/// tensor-parallel group (the optimizer's and the model's activations').
template <class Policy, class Storage, class Param = float>
history train_rank(const config& cfg, const prepared<Policy>& in, distopt::any_comm dp_comm,
                   distopt::any_comm tp_opt, distopt::any_comm tp_model) {
  constexpr bool fp32_params = std::is_same_v<Param, float>;
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  constexpr int zero_stage = distopt::storage_zero_stage<Storage>();
  const int dp_rank = dp_comm.rank(), dp = dp_comm.size();
  const int tp_rank = tp_model.rank(), tp = tp_model.size();
  const bool writer = dp_rank == 0 && tp_rank == 0;
  const bool hooks = cfg.zero > 0;
  const model_config& mc = cfg.model;

  // The layout: every tensor of model_tensors with this TP rank's part of its shape.
  const std::vector<tensor_info> tensors = model_tensors(mc, tp);
  distopt::layout layout;
  std::vector<std::vector<std::string>> unit_names(static_cast<std::size_t>(mc.layers + 2));
  std::vector<std::vector<std::size_t>> unit_tensors(unit_names.size());  // indices into `tensors`
  std::size_t whole_params = 0, whole_index = 0;
  for (const tensor_info& t : tensors) {
    const distopt::tp_split how = tp == 1                ? distopt::tp_split::none  // whole (GaLore needs it so)
                                  : t.how == split::rows ? distopt::tp_split::rows
                                  : t.how == split::cols ? distopt::tp_split::cols
                                                         : distopt::tp_split::none;
    std::vector<std::int64_t> shape{t.local_rows(tp)};
    if (t.matrix()) shape.push_back(t.local_cols(tp));
    layout.add(t.name, shape, distopt::dtype_of<Param>, group_of<Policy>(t), how);
    unit_names[static_cast<std::size_t>(t.unit)].push_back(t.name);
    unit_tensors[static_cast<std::size_t>(t.unit)].push_back(whole_index);
    ++whole_index;
    whole_params += static_cast<std::size_t>(t.rows * t.cols);
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  options.grad_reduce = distopt::reduce_op::sum;  // each rank's grads are already over the whole batch's positions
  if (hooks) options.bucket_elems = 1;           // a bucket per tensor: a unit's reduction starts after its backward
  options.micro_batches = cfg.accumulate;        // --accumulate N: N micro-batches a step
  options.accumulate = cfg.accumulate_each ? distopt::accumulation::reduce_each : distopt::accumulation::reduce_last;
  const bool accumulating = cfg.accumulate > 1;
  const int threads = std::max(cfg.threads, 1);
  distopt::optimizer<Policy, Storage, distopt::any_comm, distopt::cpu, distopt::precision<Param, float>> opt(
      std::move(layout), in.groups, options, distopt::make_executor<distopt::cpu>(threads), std::move(dp_comm));
  if (tp > 1) opt.set_tensor_parallel_group(std::move(tp_opt));
  auto sum_over_dp = [&opt](double x) {
    double v[1] = {x};
    opt.communicator().all_reduce(std::span<double>(v), distopt::reduce_op::sum);
    return v[0];
  };

  // The initial model: --init's tensors or GPT-2's drawn from --seed, this TP rank's parts.
  {
    const std::vector<std::vector<float>> whole = in.init.empty() ? initial_weights(mc, cfg.seed) : in.init;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (hooks) opt.gather(tensors[i].name);  // ZeRO-3: a full view to write into
      const std::vector<float> part = part_of(tensors[i], whole[i], tp, tp_rank);
      auto p = opt.param(tensors[i].name);
      std::transform(part.begin(), part.end(), p.begin(), [](float x) { return distopt::from_float<Param>(x); });
      if (hooks) opt.release(tensors[i].name, distopt::keep_writes);
    }
  }
  std::size_t first_step = 0;
#ifdef DISTOPT_GPT_CHECKPOINT
  if (!cfg.resume_dir.empty()) {
    opt.load(cfg.resume_dir);
    first_step = static_cast<std::size_t>(opt.step_calls());
    if (first_step != cfg.resume_step)
      throw std::runtime_error("--resume " + cfg.resume_dir + ": the checkpoint is at step " + std::to_string(first_step) +
                               ", its run record (distopt-gpt.run) at step " + std::to_string(cfg.resume_step) +
                               ": a save was cut short; resume from another checkpoint");
    if (first_step >= static_cast<std::size_t>(cfg.steps))
      throw std::runtime_error("--resume " + cfg.resume_dir + ": the checkpoint is at step " + std::to_string(first_step) +
                               ", not before --steps " + std::to_string(cfg.steps) + ": nothing to run");
    if (writer) std::cout << "resumed from " << cfg.resume_dir << " at step " << first_step << "\n";
  }
#endif

  // Two buffers of one unit's size, as the model uses one unit at a time. bf16 params: the
  // model reads a float copy of the unit in use, made as it is acquired (the optimizer keeps
  // the fp32 master weights it updates). --accumulate: backward writes a unit's grads into
  // `staged`, and grads_written adds them into the optimizer's views (zeroed at a step's
  // first view), once per element, so that micro-batches add as the data-parallel ranks'
  // parts of a batch do.
  const auto local_numel = [&](std::size_t i) {
    return static_cast<std::size_t>(tensors[i].local_rows(tp) * tensors[i].local_cols(tp));
  };
  std::size_t largest_unit = 0;
  for (const auto& unit : unit_tensors) {
    std::size_t n = 0;
    for (const std::size_t i : unit) n += local_numel(i);
    largest_unit = std::max(largest_unit, n);
  }
  std::vector<float> shadow(fp32_params ? 0 : largest_unit), staged(accumulating ? largest_unit : 0);
  // The model's units through the optimizer: with the hooks, gathered before each use (the
  // next unit prefetched meanwhile), released after it, their grads declared ready as soon
  // as backward has written them.
  unit_calls calls;
  const int units = mc.layers + 2;
  calls.acquire = [&](int u, bool backward) {
    const auto& names = unit_names[static_cast<std::size_t>(u)];
    if (hooks) {
      opt.gather(names);
      const int next = backward ? u - 1 : u + 1;
      if (next >= 0 && next < units) opt.prefetch(unit_names[static_cast<std::size_t>(next)]);
    }
    std::vector<tensor_ref> refs;
    float* next_shadow = shadow.data();
    float* next_staged = staged.data();
    for (const std::size_t i : unit_tensors[static_cast<std::size_t>(u)]) {
      const std::string& n = tensors[i].name;
      float* g = !backward ? nullptr : accumulating ? next_staged : opt.grad(n).data();
      next_staged += accumulating ? local_numel(i) : 0;
      if constexpr (fp32_params) {
        refs.push_back({opt.param(n).data(), g});
      } else {
        auto p = opt.param(n);
        std::transform(p.begin(), p.end(), next_shadow, [](Param x) { return distopt::to_float(x); });
        refs.push_back({next_shadow, g});
        next_shadow += p.size();
      }
    }
    return refs;
  };
  calls.release = [&](int u) {
    if (hooks) opt.release(unit_names[static_cast<std::size_t>(u)]);
  };
  calls.grads_written = [&](int u) {
    if (accumulating) {
      const float* from = staged.data();
      for (const std::size_t i : unit_tensors[static_cast<std::size_t>(u)]) {
        auto g = opt.grad(tensors[i].name);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] += from[k];
        from += g.size();
      }
    }
    if (hooks) opt.grads_ready(unit_names[static_cast<std::size_t>(u)]);
  };

  tp_group group;
  if (tp > 1)
    group = {tp_rank, tp, [&tp_model](std::span<float> v) { tp_model.all_reduce(v, distopt::reduce_op::sum); },
             [&tp_model](std::span<float> v) { tp_model.all_reduce(v, distopt::reduce_op::max); }};
  const auto [first_seq, local_seqs] = sequences_of(cfg.batch, dp, dp_rank);
  const int micro_seqs = local_seqs / cfg.accumulate;  // main checked that it divides
  model net(mc, micro_seqs, std::move(group));

  const int T = mc.seq, stride = T + 1;
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(local_seqs) * T), targets(inputs.size());
  auto take = [&](const std::int32_t* batch) {  // this rank's sequences of a global batch
    split_batch(batch, first_seq, local_seqs, T, inputs.data(), targets.data());
  };
  const double positions = static_cast<double>(cfg.batch) * T;

  const std::vector<std::vector<std::int32_t>> val = validation_batches(cfg, in);
  auto validation_loss = [&] {
    double sum = 0.0;
    for (const auto& b : val) {
      take(b.data());
      for (int k = 0; k < cfg.accumulate; ++k) {  // in micro-batches, as training: the model holds that many
        const std::size_t at = static_cast<std::size_t>(k) * micro_seqs * T;
        sum += net.loss(calls, inputs.data() + at, targets.data() + at, micro_seqs);
      }
    }
    return sum_over_dp(sum) / (positions * static_cast<double>(val.size()));
  };

  std::optional<batch_source> train_src;
  if (in.batches.empty()) {
    train_src.emplace(in.text->train, T, cfg.seed);
    train_src->skip(first_step, cfg.batch);
  }
  if (writer) {
    std::cout << "distopt-gpt: " << Policy::name << " " << distopt::hyper_params_string<Policy>(in.groups[0])
              << " (norm weights: weight_decay=0" << (has_matrix_groups<Policy> ? "; embedding, output and norm weights: "
                                                      + std::string(distopt::projects_matrices<Policy> ? "not projected" : "AdamW") : "")
              << ")\n"
              << "model: Llama-style decoder, " << mc.layers << " layers, dim " << mc.dim << ", " << mc.heads
              << " heads, SwiGLU " << mc.ffn << ", vocabulary " << mc.vocab << " (bytes), " << T
              << " tokens a sequence: " << whole_params << " params";
    if (tp > 1) std::cout << " (" << opt.tensors().numel() << " on each TP rank)";
    std::cout << ", " << (fp32_params ? "fp32" : "bf16 with fp32 master weights")
              << (decltype(opt)::is_quantized ? ", 8-bit states" : "");
    std::cout << "\nrun: batch " << cfg.batch << " x " << T << " tokens, " << cfg.steps << " steps on " << dp * tp
              << (dp * tp == 1 ? std::string(" rank")
                                : (cfg.comm == "mpi" ? " MPI processes (" : " ranks as threads (") + std::to_string(dp) + " data-parallel x " +
                                                 std::to_string(tp) + " tensor-parallel)")
              << ", " << threads << (threads == 1 ? " thread" : " threads") << " a rank; state sharded over the data-parallel ranks, ZeRO-" << zero_stage
              << (hooks ? " with the hooks unit by unit" : "");
    if (accumulating)
      std::cout << "; " << cfg.accumulate << " micro-batches a step, the grads reduced "
                << (cfg.accumulate_each ? "after each (into an fp32 accumulator)" : "after the last");
    std::cout << "\n";
    if (in.text && in.batches.empty()) print_corpus(*in.text);
    std::cout << std::flush;
  }

  step_reporter report(cfg, first_step, writer, positions);
  history hist;
  hist.first_step = first_step;
  double optimizer_seconds = 0.0;
  std::size_t skipped = 0;
  const auto start = clock::now();
  for (std::size_t step = first_step; step < static_cast<std::size_t>(cfg.steps); ++step) {
    std::vector<std::int32_t> drawn;
    const std::int32_t* batch = nullptr;
    if (train_src) {
      drawn = train_src->next(cfg.batch);
      batch = drawn.data();
    } else {
      batch = in.batches.data() + step * static_cast<std::size_t>(cfg.batch) * stride;
    }
    take(batch);
    double local = 0.0;
    for (int k = 0; k < cfg.accumulate; ++k) {  // --accumulate N: micro-batch k of this rank's sequences
      const std::size_t at = static_cast<std::size_t>(k) * micro_seqs * T;
      local += net.train_batch(calls, inputs.data() + at, targets.data() + at, micro_seqs, positions);
      if (accumulating) opt.end_micro_batch();
    }
    const double loss = sum_over_dp(local) / positions;
    if (step == 0 && !cfg.dump_grads_path.empty()) {  // main allows it on one rank without the hooks
      distopt::io::safetensors_writer w;
      for (const tensor_info& t : tensors) {
        auto g = opt.grad(t.name);
        w.add_f32(t.name, t.matrix() ? std::vector<std::int64_t>{t.rows, t.cols} : std::vector<std::int64_t>{t.rows},
                  std::span<const float>(g.data(), g.size()));
      }
      w.write(cfg.dump_grads_path);
    }
    const auto step_start = clock::now();
    skipped += opt.step().skipped;
    optimizer_seconds += seconds(clock::now() - step_start).count();
    hist.train_loss.push_back(loss);
    const int done = static_cast<int>(step) + 1;
    std::optional<double> val_loss;
    if (!val.empty() && evaluation_due(cfg, done)) {
      val_loss = validation_loss();
      hist.val_loss.emplace_back(done, *val_loss);
    }
    report.step(done, loss, val_loss);
#ifdef DISTOPT_GPT_CHECKPOINT
    if (!cfg.checkpoint_dir.empty() &&
        ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || done == cfg.steps)) {
      opt.save(cfg.checkpoint_dir);
      if (writer) write_run_record(cfg, static_cast<std::size_t>(done));
      if (writer) std::fprintf(stderr, "checkpoint: step %d -> %s\n", done, cfg.checkpoint_dir.c_str());
    }
#endif
  }
  const double total = seconds(clock::now() - start).count();
  if (writer)
    print_summary(opt, "rank 0 of " + std::to_string(dp) + " data-parallel x " + std::to_string(tp) + " tensor-parallel",
                  "time (rank 0)", skipped, positions, hist.train_loss.size(), total, optimizer_seconds,
                  "optimizer steps with communication");
  return hist;
}

/// One rank of `world` (rank r = d x tp + t) with the optimizer type that --zero, --param-dtype
/// and --state name. main refuses what is not built here: GaLore and Muon, bf16 params and q8
/// states at stage 1 only (as distopt-fashion-mnist; the library runs them at every stage),
/// bf16 params for AdamW and Adafactor, q8 for AdamW only (each type is a few seconds of
/// compile: Lamb's and CAME's bf16 types cost 2 x 2 of CPU in train_lamb.cpp and train_came.cpp).
template <class Policy, class World>
history train_world_rank(const config& cfg, const prepared<Policy>& in, World& world) {
  const int tp = cfg.tp, rank = world.rank(), d = rank / tp, t = rank % tp;
  distopt::any_comm tp_opt(world.split(d, t)), tp_model(world.split(d, t));
  distopt::any_comm dp(world.split(t, d));
  auto run = [&]<class Storage, class Param>() {
    return train_rank<Policy, Storage, Param>(cfg, in, std::move(dp), std::move(tp_opt), std::move(tp_model));
  };
  if constexpr (!has_matrix_groups<Policy>) {
    if (cfg.zero == 2) return run.template operator()<distopt::sharded<distopt::fp32, 2>, float>();
    if (cfg.zero == 3) return run.template operator()<distopt::sharded<distopt::fp32, 3>, float>();
  }
  if constexpr (std::is_same_v<Policy, distopt::adamw> || std::is_same_v<Policy, distopt::adafactor>)
    if (cfg.param_dtype == "bf16") return run.template operator()<distopt::sharded<distopt::fp32>, distopt::bf16>();
  if constexpr (std::is_same_v<Policy, distopt::adamw>)
    if (cfg.state == "q8") return run.template operator()<distopt::sharded<distopt::q8>, float>();
  return run.template operator()<distopt::sharded<distopt::fp32>, float>();
}

/// Runs --ranks ranks as threads, or the MPI world with --comm mpi.
template <class Policy>
history train_policy(const config& cfg) {
  const prepared<Policy> in = prepare<Policy>(cfg);
#ifdef DISTOPT_GPT_MPI
  if (cfg.comm == "mpi") {
    distopt::mpi world(MPI_COMM_WORLD);
    return train_world_rank<Policy>(cfg, in, world);
  }
#endif
  history out;
  distopt::run_ranks(cfg.ranks, [&](distopt::threads& world) {
    history h = train_world_rank<Policy>(cfg, in, world);
    if (world.rank() == 0) out = std::move(h);
  });
  return out;
}

}  // namespace gpt
