// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt: trains a small Llama-style decoder on Debian's fortune cookies, byte by
// byte, with tensor parallelism, data parallelism and a distopt optimizer whose state is
// sharded over the data-parallel ranks.

#include <cblas.h>

#include <distopt/io/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "gpt.hpp"
#include "train.hpp"  // draw_init

namespace {

constexpr const char* usage_text =
    "usage: distopt-gpt [--optimizer adafactor|adamw|lamb|came] [--set KEY=VALUE]...\n"
    "                   [--tp T] [--ranks N] [--zero 1|2|3] [--threads N]\n"
    "                   [--steps N] [--batch N] [--seq N] [--dim N] [--layers N] [--heads N] [--ffn N]\n"
    "                   [--eval-every N] [--eval-batches N] [--seed N] [--data DIR]\n"
    "                   [--log FILE.csv] [--plot FILE.png]\n"
    "                   [--checkpoint DIR [--checkpoint-every N]] [--resume DIR]\n"
    "                   [--init FILE] [--batches FILE] [--save-init DIR] [--dump-grads FILE]\n"
    "Trains a Llama-style decoder (RMSNorm, rotary attention, SwiGLU) on fortune cookies, a\n"
    "byte a token.\n"
    "  --optimizer   default adafactor (transformers' defaults: relative step size); adamw,\n"
    "                lamb and came with their references' defaults; --set as in\n"
    "                distopt-fashion-mnist. The norm weights have no weight decay.\n"
    "  --tp T        tensor-parallel ranks (Megatron's split: column-parallel wq, wk, wv, w1,\n"
    "                w3; row-parallel wo, w2; vocabulary-parallel embedding and output)\n"
    "  --ranks N     every rank, as threads: N / T data-parallel ranks of T (default T)\n"
    "  --zero S      ZeRO stage with the overlap hooks unit by unit (default: stage 1 without)\n"
    "  --batch N     sequences a step over every data-parallel rank (default 16; divides by N / T)\n"
    "  --seq N       tokens a sequence (default 64); model: --dim 128 --layers 4 --heads 4 --ffn 352\n"
    "  --steps N     default 300; --eval-every 50 steps the validation loss of --eval-batches 4\n"
    "  --init FILE   initial weights (safetensors, whole tensors), else N(0, 0.02) from --seed\n"
    "  --batches FILE  training batches (safetensors 'tokens', I32 [steps, batch, seq + 1])\n"
    "  --save-init DIR  writes DIR/init.safetensors and DIR/batches.safetensors (--steps\n"
    "                batches) for the PyTorch reference (tests/reference/gpt_reference.py), and stops\n"
    "  --dump-grads FILE  the first step's gradients (one rank, without --zero)\n"
    "  --expect FILE  fails (exit 1) unless each step's training loss is within --rtol (1e-4)\n"
    "                of FILE's: the reference's JSON (the --optimizer's losses) or a --log CSV\n";

int to_int(std::string_view flag, std::string_view v, int lo, int hi) {
  int x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || end != v.data() + v.size() || x < lo || x > hi)
    throw gpt::usage_error(std::string(flag) + ": '" + std::string(v) + "' is not a whole number in [" +
                           std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

gpt::config parse(int argc, char** argv) {
  gpt::config c;
  bool ranks_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << usage_text;
      std::exit(0);
    }
    if (i + 1 >= argc) throw gpt::usage_error(std::string(flag) + ": needs a value (or unknown flag)");
    const std::string_view v = argv[++i];
    constexpr int big = 1 << 24;
    if (flag == "--optimizer") c.optimizer = v;
    else if (flag == "--set") {
      const auto eq = v.find('=');
      if (eq == std::string_view::npos || eq == 0) throw gpt::usage_error("--set: expected KEY=VALUE, got '" + std::string(v) + "'");
      c.sets.emplace_back(std::string(v.substr(0, eq)), std::string(v.substr(eq + 1)));
    } else if (flag == "--tp") c.tp = to_int(flag, v, 1, 64);
    else if (flag == "--ranks") c.ranks = to_int(flag, v, 1, 256), ranks_given = true;
    else if (flag == "--zero") c.zero = to_int(flag, v, 1, 3);
    else if (flag == "--threads") c.threads = to_int(flag, v, 1, 1024);
    else if (flag == "--steps") c.steps = to_int(flag, v, 1, big);
    else if (flag == "--batch") c.batch = to_int(flag, v, 1, 65536);
    else if (flag == "--seq") c.model.seq = to_int(flag, v, 1, 65536);
    else if (flag == "--dim") c.model.dim = to_int(flag, v, 2, 65536);
    else if (flag == "--layers") c.model.layers = to_int(flag, v, 1, 1024);
    else if (flag == "--heads") c.model.heads = to_int(flag, v, 1, 1024);
    else if (flag == "--ffn") c.model.ffn = to_int(flag, v, 1, 1 << 20);
    else if (flag == "--eval-every") c.eval_every = to_int(flag, v, 1, big);
    else if (flag == "--eval-batches") c.eval_batches = to_int(flag, v, 0, 1 << 16);
    else if (flag == "--seed") c.seed = static_cast<std::uint64_t>(to_int(flag, v, 0, 1 << 30));
    else if (flag == "--data") c.data_dir = v;
    else if (flag == "--log") c.log_path = v;
    else if (flag == "--plot") c.plot_path = v;
    else if (flag == "--checkpoint") c.checkpoint_dir = v;
    else if (flag == "--checkpoint-every") c.checkpoint_every = to_int(flag, v, 1, big);
    else if (flag == "--resume") c.resume_dir = v;
    else if (flag == "--init") c.init_path = v;
    else if (flag == "--batches") c.batches_path = v;
    else if (flag == "--save-init") c.save_init_dir = v;
    else if (flag == "--dump-grads") c.dump_grads_path = v;
    else if (flag == "--expect") c.expect_path = v;
    else if (flag == "--rtol") {
      c.rtol = std::strtod(std::string(v).c_str(), nullptr);
      if (!(c.rtol >= 0.0)) throw gpt::usage_error("--rtol: '" + std::string(v) + "' is not a tolerance");
    }
    else throw gpt::usage_error("unknown flag " + std::string(flag));
  }
  if (!ranks_given) c.ranks = c.tp;
  if (c.ranks % c.tp != 0)
    throw gpt::usage_error("--ranks " + std::to_string(c.ranks) + " is not a multiple of --tp " + std::to_string(c.tp));
  const int dp = c.ranks / c.tp;
  if (c.batch % dp != 0)
    throw gpt::usage_error("--batch " + std::to_string(c.batch) + " does not divide over the " + std::to_string(dp) +
                           " data-parallel ranks (--ranks / --tp)");
  try {
    (void)gpt::model_tensors(c.model, c.tp);
  } catch (const std::invalid_argument& e) {
    throw gpt::usage_error(e.what());
  }
  if (c.threads < 0) c.threads = std::max(1, 2 / c.ranks);
  if (!c.dump_grads_path.empty() && (c.ranks != 1 || c.zero != 0))
    throw gpt::usage_error("--dump-grads: one rank without --zero only (the whole gradients of the first step)");
  if (!c.checkpoint_dir.empty() || !c.resume_dir.empty() || c.checkpoint_every > 0) {
#ifndef DISTOPT_GPT_CHECKPOINT
    throw gpt::usage_error("--checkpoint/--resume: this distopt-gpt was built without distopt::checkpoint (xxHash)");
#endif
    if (c.checkpoint_every > 0 && c.checkpoint_dir.empty()) throw gpt::usage_error("--checkpoint-every needs --checkpoint DIR");
  }
  return c;
}

/// --expect's losses: the JSON of gpt_reference.py (key --optimizer, then "loss"), or a
/// --log CSV of another run (step, training loss, validation loss).
std::vector<double> expected_losses(const gpt::config& c) {
  std::ifstream in(c.expect_path);
  if (!in) throw gpt::usage_error("--expect " + c.expect_path + ": cannot read");
  std::vector<double> losses;
  if (c.expect_path.ends_with(".json")) {
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.contains(c.optimizer) || !j[c.optimizer].contains("loss"))
      throw gpt::usage_error("--expect " + c.expect_path + ": no losses of " + c.optimizer);
    for (const auto& x : j[c.optimizer]["loss"]) losses.push_back(x.get<double>());
    return losses;
  }
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    const auto comma = line.find(',');
    if (comma == std::string::npos) throw gpt::usage_error("--expect " + c.expect_path + ": not a --log file");
    losses.push_back(std::strtod(line.c_str() + comma + 1, nullptr));
  }
  return losses;
}

/// Compares the run's losses with --expect's, step by step; prints the worst difference.
bool matches_expected(const gpt::config& c, const std::vector<double>& expected, const gpt::history& h) {
  // A resumed run's losses are those of its steps from the checkpoint's on.
  const std::size_t n = expected.size() > h.first_step ? std::min(expected.size() - h.first_step, h.train_loss.size()) : 0;
  if (n == 0) {
    std::cerr << "distopt-gpt: --expect " << c.expect_path << ": no step to compare\n";
    return false;
  }
  double worst = 0.0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double rel = std::abs(h.train_loss[i] - expected[h.first_step + i]) / std::abs(expected[h.first_step + i]);
    if (!(rel <= worst)) worst = rel, at = i;
  }
  char line[200];
  std::snprintf(line, sizeof line, "%zu steps against %s: worst relative difference %.3g at step %zu (%.9g against %.9g)\n",
                n, c.expect_path.c_str(), worst, h.first_step + at + 1, h.train_loss[at], expected[h.first_step + at]);
  std::cout << line;
  if (worst <= c.rtol) return true;
  std::cerr << "distopt-gpt: the losses differ from " << c.expect_path << " by more than --rtol " << c.rtol << "\n";
  return false;
}

/// --save-init: the initial weights drawn from --seed and the first --steps batches.
void save_init(const gpt::config& c) {
  namespace fs = std::filesystem;
  fs::create_directories(c.save_init_dir);
  const auto tensors = gpt::model_tensors(c.model, 1);
  const auto whole = gpt::draw_init(c.model, c.seed);
  distopt::io::safetensors_writer w;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    w.add_f32(t.name, t.matrix() ? std::vector<std::int64_t>{t.rows, t.cols} : std::vector<std::int64_t>{t.rows},
              whole[i]);
  }
  const gpt::model_config& m = c.model;
  for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{
           {"vocab", std::to_string(m.vocab)}, {"dim", std::to_string(m.dim)}, {"layers", std::to_string(m.layers)},
           {"heads", std::to_string(m.heads)}, {"ffn", std::to_string(m.ffn)}, {"seq", std::to_string(m.seq)},
           {"batch", std::to_string(c.batch)}, {"norm_eps", "1e-05"}, {"rope_theta", "10000"}})
    w.set_metadata(k, v);
  w.write(fs::path(c.save_init_dir) / "init.safetensors");
  const gpt::corpus text = gpt::load_corpus(c.data_dir);
  gpt::batch_source src(text.train, m.seq, c.seed);
  std::vector<std::int32_t> tokens;
  for (int s = 0; s < c.steps; ++s) {
    const auto b = src.next(c.batch);
    tokens.insert(tokens.end(), b.begin(), b.end());
  }
  distopt::io::safetensors_writer bw;
  bw.add("tokens", "I32", {c.steps, c.batch, m.seq + 1}, std::as_bytes(std::span<const std::int32_t>(tokens)));
  bw.write(fs::path(c.save_init_dir) / "batches.safetensors");
  std::cout << "wrote " << (fs::path(c.save_init_dir) / "init.safetensors").string() << " and batches.safetensors ("
            << c.steps << " batches)\n";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const gpt::config cfg = parse(argc, argv);
    if (!cfg.save_init_dir.empty()) {
      save_init(cfg);
      return 0;
    }
    gpt::check_outputs(cfg);
    const std::vector<double> expected = cfg.expect_path.empty() ? std::vector<double>{} : expected_losses(cfg);
    openblas_set_num_threads(cfg.threads);
    gpt::history h;
    if (cfg.optimizer == "adafactor") h = gpt::train_adafactor(cfg);
    else if (cfg.optimizer == "adamw") h = gpt::train_adamw(cfg);
    else if (cfg.optimizer == "lamb") h = gpt::train_lamb(cfg);
    else if (cfg.optimizer == "came") h = gpt::train_came(cfg);
    else throw gpt::usage_error("--optimizer: unknown '" + cfg.optimizer + "' (adafactor, adamw, lamb or came)");
    if (!cfg.plot_path.empty()) {
      gpt::write_plot(cfg.plot_path, "distopt-gpt, " + cfg.optimizer, h);
      std::cout << "plot: " << cfg.plot_path << "\n";
    }
    if (!cfg.expect_path.empty() && !matches_expected(cfg, expected, h)) return 1;
    return 0;
  } catch (const gpt::usage_error& e) {
    std::cerr << "distopt-gpt: " << e.what() << "\n(distopt-gpt --help for the flags)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "distopt-gpt: " << e.what() << "\n";
    return 1;
  }
}
