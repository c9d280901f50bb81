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

namespace gpt {

/// What the ranks of the process share, read and checked before any rank starts.
/// Whether the policy treats some matrices apart (GaLore's projected ones, Muon's
/// orthogonalised ones): the embedding and the output projection then go to a third group,
/// without that treatment (GaLore's recipe keeps them full-rank; Moonlight's Muon gives them
/// AdamW), as the norm weights.
template <class Policy>
inline constexpr bool has_matrix_groups =
    distopt::projects_matrices<Policy> || distopt::orthogonalizes_matrices<Policy>;

/// A tensor's hyper-parameter group: 0 the matrices (weight decay; GaLore's projection,
/// Muon), 1 the norm weights (no weight decay, no matrix treatment), 2 the embedding and the
/// output projection under GaLore and Muon (weight decay, no matrix treatment).
template <class Policy>
int group_of(const tensor_info& t) {
  if (!t.matrix()) return 1;
  const bool vocabulary = t.unit == 0 || t.name == "output.weight";
  return has_matrix_groups<Policy> && vocabulary ? 2 : 0;
}

template <class Policy>
struct prepared {
  std::vector<typename Policy::hyper_params> groups;  // group_of's
  std::optional<corpus> text;                     // without --batches, or for validation
  std::vector<std::vector<float>> init;           // --init: whole tensors, model_tensors' order
  std::vector<std::int32_t> batches;              // --batches: [steps, batch, seq + 1]
  std::size_t batch_count = 0;
};

/// The hyper-parameters: the reference's defaults, then every --set in order. The norm
/// weights get no weight decay (as Llama's and nanoGPT's recipes).
template <class Policy>
prepared<Policy> prepare(const config& cfg) {
  prepared<Policy> p;
  typename Policy::hyper_params h;
  if constexpr (distopt::projects_matrices<Policy>) {
    // GaLore's recipe (galore-torch's README) at this model's size: rank dim / 4, a new
    // projection every 200 steps, scale 0.25.
    h.rank = std::max(1, cfg.model.dim / 4);
    h.update_proj_gap = 200;
    h.scale = 0.25;
  } else if constexpr (distopt::orthogonalizes_matrices<Policy>) {
    // Moonlight's recipe: the update's RMS matched to AdamW's, one lr for Muon and AdamW.
    h.adjust_lr_fn = decltype(h.adjust_lr_fn)::match_rms_adamw;
  }
  try {
    h = distopt::apply_hyper_params<Policy>(std::move(h), cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {
    throw usage_error(std::string("--set ") + e.what());
  }
  p.groups.assign(has_matrix_groups<Policy> ? 3 : 2, h);
  p.groups[1].weight_decay = 0.0;
  for (std::size_t g = 1; g < p.groups.size(); ++g) {
    if constexpr (distopt::projects_matrices<Policy>) p.groups[g].rank.reset();
    if constexpr (distopt::orthogonalizes_matrices<Policy>) p.groups[g].use_muon = false;
  }
  const std::vector<tensor_info> tensors = model_tensors(cfg.model, 1);
  if (!cfg.init_path.empty()) {
    const auto file = distopt::io::safetensors_reader::open(cfg.init_path);
    for (const tensor_info& t : tensors) {
      if (!file.contains(t.name)) throw usage_error("--init " + cfg.init_path + ": no tensor " + t.name);
      const auto& info = file.info(t.name);
      const std::vector<std::int64_t> shape = t.matrix() ? std::vector<std::int64_t>{t.rows, t.cols}
                                                         : std::vector<std::int64_t>{t.rows};
      if (info.shape != shape)
        throw usage_error("--init " + cfg.init_path + ": " + t.name + " has another shape than the model's (see " +
                          "--dim, --layers, --heads, --ffn)");
      p.init.push_back(file.read_f32(t.name));
    }
  }
  if (!cfg.batches_path.empty()) {
    const auto file = distopt::io::safetensors_reader::open(cfg.batches_path);
    if (!file.contains("tokens") || file.info("tokens").dtype != "I32" || file.info("tokens").shape.size() != 3)
      throw usage_error("--batches " + cfg.batches_path + ": needs an I32 tensor 'tokens' [steps, batch, seq + 1]");
    const auto& shape = file.info("tokens").shape;
    if (shape[1] != cfg.batch || shape[2] != cfg.model.seq + 1)
      throw usage_error("--batches " + cfg.batches_path + ": batches of " + std::to_string(shape[1]) + " x " +
                        std::to_string(shape[2]) + " tokens, not --batch " + std::to_string(cfg.batch) + " x (--seq " +
                        std::to_string(cfg.model.seq) + " + 1)");
    if (shape[0] < cfg.steps)
      throw usage_error("--batches " + cfg.batches_path + ": " + std::to_string(shape[0]) + " batches, fewer than --steps");
    const auto bytes = file.bytes("tokens");
    p.batches.resize(bytes.size() / sizeof(std::int32_t));
    std::memcpy(p.batches.data(), bytes.data(), bytes.size());
    for (std::size_t i = 0; i < p.batches.size(); ++i)
      if (p.batches[i] < 0 || p.batches[i] >= cfg.model.vocab)
        throw usage_error("--batches " + cfg.batches_path + ": token " + std::to_string(p.batches[i]) + " at index " +
                          std::to_string(i) + " is outside the vocabulary of " + std::to_string(cfg.model.vocab));
    p.batch_count = static_cast<std::size_t>(shape[0]);
  }
  if (cfg.batches_path.empty() || cfg.eval_batches > 0) {
    try {
      p.text = load_corpus(cfg.data_dir);
    } catch (const std::runtime_error& e) {
      if (cfg.batches_path.empty()) throw;
      throw std::runtime_error(std::string(e.what()) + "; with --batches, --eval-batches 0 runs without a corpus");
    }
  }
  return p;
}

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
    for (int s = 0; s < local_seqs; ++s) {
      const std::int32_t* row = batch + static_cast<std::size_t>(first_seq + s) * stride;
      std::copy_n(row, T, inputs.data() + static_cast<std::size_t>(s) * T);
      std::copy_n(row + 1, T, targets.data() + static_cast<std::size_t>(s) * T);
    }
  };
  const double positions = static_cast<double>(cfg.batch) * T;

  // Validation: --eval-batches fixed batches of the held-out text, the same at every evaluation.
  std::vector<std::vector<std::int32_t>> val;
  if (in.text) {
    batch_source src(in.text->validation, T, cfg.seed + 1);
    for (int k = 0; k < cfg.eval_batches; ++k) val.push_back(src.next(cfg.batch));
  }
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
    if (in.text && in.batches.empty())
      std::cout << "data: " << in.text->files << " fortune files, " << in.text->fortunes << " fortunes: "
                << in.text->train.size() << " training bytes, " << in.text->validation.size()
                << " held out (every 10th fortune)\n";
    std::cout << std::flush;
  }

  // --log: a resumed run keeps the rows up to its checkpoint's step (a crashed run may have
  // written more) and appends from there; each row is flushed as written.
  std::FILE* log = nullptr;
  if (writer && !cfg.log_path.empty()) {
    std::vector<std::string> kept;
    if (first_step > 0) {
      std::ifstream old(cfg.log_path);
      for (std::string line; std::getline(old, line);)
        if (!line.empty() && line.front() != 's' && std::strtoull(line.c_str(), nullptr, 10) <= first_step)
          kept.push_back(line);
    }
    log = std::fopen(cfg.log_path.c_str(), "w");
    if (!log) throw std::runtime_error(cfg.log_path + ": cannot write");
    std::fputs("step,train_loss,val_loss\n", log);
    for (const std::string& line : kept) std::fprintf(log, "%s\n", line.c_str());
    std::fflush(log);
  }
  history hist;
  hist.first_step = first_step;
  double optimizer_seconds = 0.0, interval_loss = 0.0;
  int interval_steps = 0;
  std::size_t skipped = 0;
  const auto start = clock::now();
  auto interval_start = start;
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
    interval_loss += loss;
    ++interval_steps;
    const int done = static_cast<int>(step) + 1;
    std::optional<double> val_loss;
    if (!val.empty() && (done % cfg.eval_every == 0 || done == cfg.steps)) {
      val_loss = validation_loss();
      hist.val_loss.emplace_back(done, *val_loss);
    }
    if (log) {
      std::fprintf(log, "%d,%a,", done, loss);
      if (val_loss) std::fprintf(log, "%a", *val_loss);
      std::fputc('\n', log);
      std::fflush(log);
    }
    if (writer && (done % cfg.eval_every == 0 || done == cfg.steps)) {
      const double s = seconds(clock::now() - interval_start).count();
      std::printf("step %d/%d  train loss %.4f", done, cfg.steps, interval_loss / interval_steps);
      if (val_loss) std::printf("  val loss %.4f", *val_loss);
      std::printf("  %.0f tokens/s\n", s > 0 ? positions * interval_steps / s : 0.0);
      std::fflush(stdout);
      interval_loss = 0.0;
      interval_steps = 0;
      interval_start = clock::now();
    }
#ifdef DISTOPT_GPT_CHECKPOINT
    if (!cfg.checkpoint_dir.empty() &&
        ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || done == cfg.steps)) {
      opt.save(cfg.checkpoint_dir);
      if (writer) std::fprintf(stderr, "checkpoint: step %d -> %s\n", done, cfg.checkpoint_dir.c_str());
    }
#endif
  }
  if (log) std::fclose(log);
  const double total = seconds(clock::now() - start).count();
  if (!writer) return hist;
  if (skipped) std::cout << "skipped steps (NaN/Inf gradient): " << skipped << "\n";
  std::cout << "optimizer memory (rank 0 of " << dp << " data-parallel x " << tp << " tensor-parallel):\n"
            << opt.memory();
  const std::size_t steps_run = hist.train_loss.size();
  char line[256];
  std::snprintf(line, sizeof line,
                "time (rank 0): %.2f s, %.0f tokens/s; optimizer steps with communication %.2f s (%.1f%% of the "
                "time), forward/backward/data/evaluation the rest\n",
                total, total > 0 ? positions * static_cast<double>(steps_run) / total : 0.0, optimizer_seconds,
                total > 0 ? 100.0 * optimizer_seconds / total : 0.0);
  std::cout << line << std::flush;
  return hist;
}

/// One rank of `world` (rank r = d x tp + t) with the optimizer type that --zero, --param-dtype
/// and --state name. main refuses what is not built here: GaLore and Muon, bf16 params and q8
/// states at stage 1 only (as distopt-fashion-mnist; the library runs them at every stage),
/// q8 for AdamW only.
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
    if (cfg.param_dtype == "bf16") return run.template operator()<distopt::sharded<distopt::fp32>, distopt::bf16>();
  }
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
