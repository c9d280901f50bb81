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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
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
template <class Policy>
struct prepared {
  typename Policy::hyper_params decay, no_decay;  // the matrices', the norm weights'
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
  try {
    p.decay = distopt::apply_hyper_params<Policy>(typename Policy::hyper_params{}, cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {
    throw usage_error(std::string("--set ") + e.what());
  }
  p.no_decay = p.decay;
  p.no_decay.weight_decay = 0.0;
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
    p.batch_count = static_cast<std::size_t>(shape[0]);
  }
  if (cfg.batches_path.empty() || cfg.eval_batches > 0) p.text = load_corpus(cfg.data_dir);
  return p;
}

/// GPT-2's initialisation (N(0, 0.02) for every matrix, ones for the norm weights), each
/// whole tensor drawn in model_tensors' order from one generator seeded with --seed, so that
/// every TP size starts from the same model.
inline std::vector<std::vector<float>> draw_init(const model_config& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::vector<float>> whole;
  for (const tensor_info& t : model_tensors(c, 1)) {
    whole.emplace_back(static_cast<std::size_t>(t.rows * t.cols), 1.0f);
    if (t.matrix())
      for (float& x : whole.back()) x = normal(rng);
  }
  return whole;
}

/// The sequences of data-parallel rank `d` of `dp`: a contiguous share of the batch's rows.
inline std::pair<int, int> sequences_of(int batch, int dp, int d) { return {d * (batch / dp), batch / dp}; }

/// One rank: `dp_comm` its data-parallel group, `tp_opt` and `tp_model` two handles of its
/// tensor-parallel group (the optimizer's and the model's activations').
template <class Policy, class Storage>
history train_rank(const config& cfg, const prepared<Policy>& in, distopt::any_comm dp_comm,
                   distopt::any_comm tp_opt, distopt::any_comm tp_model) {
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
  std::size_t whole_params = 0;
  for (const tensor_info& t : tensors) {
    const distopt::tp_split how = t.how == split::rows   ? distopt::tp_split::rows
                                  : t.how == split::cols ? distopt::tp_split::cols
                                                         : distopt::tp_split::none;
    std::vector<std::int64_t> shape{t.local_rows(tp)};
    if (t.matrix()) shape.push_back(t.local_cols(tp));
    layout.add(t.name, shape, distopt::dtype::f32, t.matrix() ? 0 : 1, how);
    unit_names[static_cast<std::size_t>(t.unit)].push_back(t.name);
    whole_params += static_cast<std::size_t>(t.rows * t.cols);
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  options.grad_reduce = distopt::reduce_op::sum;  // each rank's grads are already over the whole batch's positions
  if (hooks) options.bucket_elems = 1;           // a bucket per tensor: a unit's reduction starts after its backward
  const int threads = std::max(cfg.threads, 1);
  distopt::optimizer<Policy, Storage, distopt::any_comm> opt(std::move(layout), {in.decay, in.no_decay}, options,
                                                             distopt::make_executor<distopt::cpu>(threads),
                                                             std::move(dp_comm));
  if (tp > 1) opt.set_tensor_parallel_group(std::move(tp_opt));
  auto sum_over_dp = [&opt](double x) {
    double v[1] = {x};
    opt.communicator().all_reduce(std::span<double>(v), distopt::reduce_op::sum);
    return v[0];
  };

  // The initial model: --init's tensors or GPT-2's drawn from --seed, this TP rank's parts.
  {
    const std::vector<std::vector<float>> whole = in.init.empty() ? draw_init(mc, cfg.seed) : in.init;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (hooks) opt.gather(tensors[i].name);  // ZeRO-3: a full view to write into
      const std::vector<float> part = part_of(tensors[i], whole[i], tp, tp_rank);
      auto p = opt.param(tensors[i].name);
      std::copy(part.begin(), part.end(), p.begin());
      if (hooks) opt.release(tensors[i].name, distopt::keep_writes);
    }
  }
  std::size_t first_step = 0;
#ifdef DISTOPT_GPT_CHECKPOINT
  if (!cfg.resume_dir.empty()) {
    opt.load(cfg.resume_dir);
    first_step = static_cast<std::size_t>(opt.step_calls());
    if (writer) std::cout << "resumed from " << cfg.resume_dir << " at step " << first_step << "\n";
  }
#endif

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
    for (const std::string& n : names)
      refs.push_back({opt.param(n).data(), backward ? opt.grad(n).data() : nullptr});
    return refs;
  };
  calls.release = [&](int u) {
    if (hooks) opt.release(unit_names[static_cast<std::size_t>(u)]);
  };
  calls.grads_written = [&](int u) {
    if (hooks) opt.grads_ready(unit_names[static_cast<std::size_t>(u)]);
  };

  tp_group group;
  if (tp > 1)
    group = {tp_rank, tp, [&tp_model](std::span<float> v) { tp_model.all_reduce(v, distopt::reduce_op::sum); },
             [&tp_model](std::span<float> v) { tp_model.all_reduce(v, distopt::reduce_op::max); }};
  const auto [first_seq, local_seqs] = sequences_of(cfg.batch, dp, dp_rank);
  model net(mc, local_seqs, std::move(group));

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
      sum += net.loss(calls, inputs.data(), targets.data(), local_seqs);
    }
    return sum_over_dp(sum) / (positions * static_cast<double>(val.size()));
  };

  std::optional<batch_source> train_src;
  if (in.batches.empty()) {
    train_src.emplace(in.text->train, T, cfg.seed);
    train_src->skip(first_step, cfg.batch);
  }
  if (writer) {
    std::cout << "distopt-gpt: " << Policy::name << " " << distopt::hyper_params_string<Policy>(in.decay)
              << " (norm weights: weight_decay=0)\n"
              << "model: Llama-style decoder, " << mc.layers << " layers, dim " << mc.dim << ", " << mc.heads
              << " heads, SwiGLU " << mc.ffn << ", vocabulary " << mc.vocab << " (bytes), " << T
              << " tokens a sequence: " << whole_params << " params";
    if (tp > 1) std::cout << " (" << opt.tensors().numel() << " on each TP rank)";
    std::cout << "\nrun: batch " << cfg.batch << " x " << T << " tokens, " << cfg.steps << " steps on " << dp * tp
              << (dp * tp == 1 ? " rank" : " ranks as threads (" + std::to_string(dp) + " data-parallel x " +
                                                 std::to_string(tp) + " tensor-parallel)")
              << ", " << threads << (threads == 1 ? " thread" : " threads") << " a rank; state sharded over the data-parallel ranks, ZeRO-" << zero_stage
              << (hooks ? " with the hooks unit by unit" : "") << "\n";
    if (in.text && in.batches.empty())
      std::cout << "data: " << in.text->files << " fortune files, " << in.text->fortunes << " fortunes: "
                << in.text->train.size() << " training bytes, " << in.text->validation.size()
                << " held out (every 10th fortune)\n";
    std::cout << std::flush;
  }

  std::FILE* log = nullptr;
  if (writer && !cfg.log_path.empty()) {
    log = std::fopen(cfg.log_path.c_str(), first_step > 0 ? "a" : "w");
    if (!log) throw std::runtime_error(cfg.log_path + ": cannot write");
    if (first_step == 0) std::fputs("step,train_loss,val_loss\n", log);
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
    const double local = net.train_batch(calls, inputs.data(), targets.data(), local_seqs, positions);
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
  const std::size_t steps_run = static_cast<std::size_t>(cfg.steps) - first_step;
  char line[256];
  std::snprintf(line, sizeof line,
                "time (rank 0): %.2f s, %.0f tokens/s; optimizer steps with communication %.2f s (%.1f%% of the "
                "time), forward/backward/data/evaluation the rest\n",
                total, total > 0 ? positions * static_cast<double>(steps_run) / total : 0.0, optimizer_seconds,
                total > 0 ? 100.0 * optimizer_seconds / total : 0.0);
  std::cout << line << std::flush;
  return hist;
}

/// Runs --ranks ranks as threads, rank r = d x tp + t, at --zero's stage (1 without it).
template <class Policy>
history train_policy(const config& cfg) {
  const prepared<Policy> in = prepare<Policy>(cfg);
  const int tp = cfg.tp, dp = cfg.ranks / cfg.tp;
  history out;
  distopt::run_ranks(cfg.ranks, [&](distopt::threads& world) {
    const int rank = world.rank(), d = rank / tp, t = rank % tp;
    distopt::any_comm tp_opt(world.split(d, t)), tp_model(world.split(d, t));
    distopt::any_comm dp_comm(world.split(t, d));
    (void)dp;
    history h;
    if (cfg.zero == 2)
      h = train_rank<Policy, distopt::sharded<distopt::fp32, 2>>(cfg, in, std::move(dp_comm), std::move(tp_opt),
                                                                 std::move(tp_model));
    else if (cfg.zero == 3)
      h = train_rank<Policy, distopt::sharded<distopt::fp32, 3>>(cfg, in, std::move(dp_comm), std::move(tp_opt),
                                                                 std::move(tp_model));
    else
      h = train_rank<Policy, distopt::sharded<distopt::fp32>>(cfg, in, std::move(dp_comm), std::move(tp_opt),
                                                              std::move(tp_model));
    if (rank == 0) out = std::move(h);
  });
  return out;
}

}  // namespace gpt
