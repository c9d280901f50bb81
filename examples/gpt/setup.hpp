// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// What distopt-gpt's trainers share before training, on any backend (train.hpp's ranks on
// the CPU, train_cuda.cu's GPU): the hyper-parameter groups, the initial weights and the
// batches read and checked, the corpus loaded.

#include <distopt/distopt.hpp>
#include <distopt/io/safetensors.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpt.hpp"

namespace gpt {

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

/// What the ranks of the process share, read and checked before any rank starts.
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

/// The validation batches: --eval-batches fixed batches of --batch windows of the held-out
/// text, the same at every evaluation (none without the corpus).
template <class Policy>
std::vector<std::vector<std::int32_t>> validation_batches(const config& cfg, const prepared<Policy>& in) {
  std::vector<std::vector<std::int32_t>> val;
  if (!in.text) return val;
  batch_source src(in.text->validation, cfg.model.seq, cfg.seed + 1);
  for (int k = 0; k < cfg.eval_batches; ++k) val.push_back(src.next(cfg.batch));
  return val;
}

/// Whether the validation loss is due after step `done` (every --eval-every and at the end).
inline bool evaluation_due(const config& cfg, int done) { return done % cfg.eval_every == 0 || done == cfg.steps; }

/// Sequences [first, first + count) of a batch (rows of seq + 1 tokens) into `inputs` and
/// `targets` (count x seq each): a row's tokens, and the same shifted by one.
inline void split_batch(const std::int32_t* batch, int first, int count, int seq, std::int32_t* inputs,
                        std::int32_t* targets) {
  for (int s = 0; s < count; ++s) {
    const std::int32_t* row = batch + static_cast<std::size_t>(first + s) * (seq + 1);
    std::copy_n(row, seq, inputs + static_cast<std::size_t>(s) * seq);
    std::copy_n(row + 1, seq, targets + static_cast<std::size_t>(s) * seq);
  }
}

/// The corpus line of a run's header (drawn batches only).
inline void print_corpus(const corpus& text) {
  std::cout << "data: " << text.files << " fortune files, " << text.fortunes << " fortunes: " << text.train.size()
            << " training bytes, " << text.validation.size() << " held out (every 10th fortune)\n";
}

/// A run's per-step output on its writing rank: the --log rows (a resumed run keeps the rows
/// up to its checkpoint's step, which a crashed run may have passed, and appends from there;
/// each row flushed as written) and a progress line every --eval-every steps and at the end.
class step_reporter {
 public:
  /// `positions`: the tokens of a step (for tokens/s). A rank that does not write passes
  /// writer = false and gets no output.
  step_reporter(const config& cfg, std::size_t first_step, bool writer, double positions)
      : cfg_(cfg), writer_(writer), positions_(positions), interval_start_(clock::now()) {
    if (!writer || cfg.log_path.empty()) return;
    std::vector<std::string> kept;
    if (first_step > 0) {
      std::ifstream old(cfg.log_path);
      for (std::string line; std::getline(old, line);)
        if (!line.empty() && line.front() != 's' && std::strtoull(line.c_str(), nullptr, 10) <= first_step)
          kept.push_back(line);
    }
    log_ = std::fopen(cfg.log_path.c_str(), "w");
    if (!log_) throw std::runtime_error(cfg.log_path + ": cannot write");
    std::fputs("step,train_loss,val_loss\n", log_);
    for (const std::string& line : kept) std::fprintf(log_, "%s\n", line.c_str());
    std::fflush(log_);
  }
  ~step_reporter() {
    if (log_) std::fclose(log_);
  }
  step_reporter(const step_reporter&) = delete;
  step_reporter& operator=(const step_reporter&) = delete;

  /// Step `done` (from 1) ended with training loss `loss` and, at an evaluation, `val`.
  void step(int done, double loss, std::optional<double> val) {
    interval_loss_ += loss;
    ++interval_steps_;
    if (log_) {
      std::fprintf(log_, "%d,%a,", done, loss);
      if (val) std::fprintf(log_, "%a", *val);
      std::fputc('\n', log_);
      std::fflush(log_);
    }
    if (!writer_ || !evaluation_due(cfg_, done)) return;
    const double s = std::chrono::duration<double>(clock::now() - interval_start_).count();
    std::printf("step %d/%d  train loss %.4f", done, cfg_.steps, interval_loss_ / interval_steps_);
    if (val) std::printf("  val loss %.4f", *val);
    std::printf("  %.0f tokens/s\n", s > 0 ? positions_ * interval_steps_ / s : 0.0);
    std::fflush(stdout);
    interval_loss_ = 0.0;
    interval_steps_ = 0;
    interval_start_ = clock::now();
  }

 private:
  using clock = std::chrono::steady_clock;
  const config& cfg_;
  bool writer_;
  double positions_;
  std::FILE* log_ = nullptr;
  double interval_loss_ = 0.0;
  int interval_steps_ = 0;
  clock::time_point interval_start_;
};

/// The closing lines of a run on its writing rank: skipped steps, the optimizer's memory
/// report (`memory_title` names whose), and the time split with tokens/s (`time_title`: whose
/// clock; `optimizer_what`: what the optimizer's seconds hold).
template <class Optimizer>
void print_summary(const Optimizer& opt, const std::string& memory_title, const char* time_title, std::size_t skipped,
                   double positions, std::size_t steps_run, double total, double optimizer_seconds,
                   const char* optimizer_what) {
  if (skipped) std::cout << "skipped steps (NaN/Inf gradient): " << skipped << "\n";
  std::cout << "optimizer memory (" << memory_title << "):\n" << opt.memory();
  char line[256];
  std::snprintf(line, sizeof line,
                "%s: %.2f s, %.0f tokens/s; %s %.2f s (%.1f%% of the time), forward/backward/data/evaluation the "
                "rest\n",
                time_title, total, total > 0 ? positions * static_cast<double>(steps_run) / total : 0.0, optimizer_what,
                optimizer_seconds, total > 0 ? 100.0 * optimizer_seconds / total : 0.0);
  std::cout << line << std::flush;
}

}  // namespace gpt
