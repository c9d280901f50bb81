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
#include <span>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpt.hpp"

#ifdef DISTOPT_GPT_MPI
#include <distopt/comm/mpi.hpp>
#endif

namespace {

constexpr const char* usage_text =
    "usage: distopt-gpt [--optimizer adafactor|adamw|lamb|came|galore_adamw|muon] [--set KEY=VALUE]...\n"
    "                   [--backend cpu|cuda]\n"
    "                   [--tp T] [--ranks N] [--comm threads|mpi] [--zero 1|2|3] [--threads N]\n"
    "                   [--param-dtype fp32|bf16] [--state fp32|q8] [--accumulate N [--accumulate-schedule last|each]]\n"
    "                   [--steps N] [--batch N] [--seq N] [--dim N] [--layers N] [--heads N] [--ffn N]\n"
    "                   [--eval-every N] [--eval-batches N] [--seed N] [--data DIR]\n"
    "                   [--log FILE.csv] [--plot FILE.png]\n"
    "                   [--checkpoint DIR [--checkpoint-every N]] [--resume DIR]\n"
    "                   [--init FILE] [--batches FILE] [--save-init DIR] [--dump-grads FILE]\n"
    "                   [--expect FILE [--rtol R]]\n"
    "Trains a Llama-style decoder (RMSNorm, rotary attention, SwiGLU) on fortune cookies, a\n"
    "byte a token.\n"
    "  --optimizer   default adafactor (transformers' defaults: relative step size); adamw,\n"
    "                lamb and came with their references' defaults; galore_adamw (rank dim/4,\n"
    "                a new projection every 200 steps, scale 0.25; not with --tp) and muon\n"
    "                (AdamW on the embedding, output and norm weights, lr matched to AdamW's\n"
    "                RMS) on the blocks' matrices; --set as in distopt-fashion-mnist. The norm\n"
    "                weights have no weight decay.\n"
    "  --backend     cpu (default: OpenBLAS) or cuda: one GPU, the products on cuBLAS, the\n"
    "                optimizer on distopt::cuda (adafactor and adamw; not with --tp, --ranks,\n"
    "                --zero, --param-dtype, --state, --accumulate, checkpoints or --dump-grads)\n"
    "  --tp T        tensor-parallel ranks (Megatron's split: column-parallel wq, wk, wv, w1,\n"
    "                w3; row-parallel wo, w2; vocabulary-parallel embedding and output)\n"
    "  --ranks N     every rank, as threads: N / T data-parallel ranks of T (default T);\n"
    "                --comm mpi: one rank a process, mpirun -np N distopt-gpt --comm mpi\n"
    "  --zero S      ZeRO stage with the overlap hooks unit by unit (default: stage 1 without)\n"
    "  --param-dtype bf16  bf16 params with fp32 master weights (adamw, adafactor); --state q8:\n"
    "                8-bit AdamW states (both at stage 1)\n"
    "  --accumulate N  N micro-batches a step (each rank's sequences split), the grads reduced\n"
    "                after the last (or, --accumulate-schedule each, after each)\n"
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
    else if (flag == "--backend") {
      if (v != "cpu" && v != "cuda") throw gpt::usage_error("--backend: '" + std::string(v) + "' (cpu or cuda)");
      c.backend = v;
    }
    else if (flag == "--set") {
      const auto eq = v.find('=');
      if (eq == std::string_view::npos || eq == 0) throw gpt::usage_error("--set: expected KEY=VALUE, got '" + std::string(v) + "'");
      c.sets.emplace_back(std::string(v.substr(0, eq)), std::string(v.substr(eq + 1)));
    } else if (flag == "--tp") c.tp = to_int(flag, v, 1, 64);
    else if (flag == "--ranks") c.ranks = to_int(flag, v, 1, 256), ranks_given = true;
    else if (flag == "--zero") c.zero = to_int(flag, v, 1, 3);
    else if (flag == "--comm") c.comm = v;
    else if (flag == "--param-dtype") c.param_dtype = v;
    else if (flag == "--state") c.state = v;
    else if (flag == "--accumulate") c.accumulate = to_int(flag, v, 1, 1 << 16);
    else if (flag == "--accumulate-schedule") {
      if (v != "last" && v != "each") throw gpt::usage_error("--accumulate-schedule: '" + std::string(v) + "' (last or each)");
      c.accumulate_each = v == "each";
    }
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
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), c.rtol);
      if (ec != std::errc{} || end != v.data() + v.size() || !(c.rtol >= 0.0))
        throw gpt::usage_error("--rtol: '" + std::string(v) + "' is not a tolerance (a number >= 0)");
    }
    else throw gpt::usage_error("unknown flag " + std::string(flag));
  }
  if (!ranks_given) c.ranks = 0;
  return c;
}

/// The checks that need the number of ranks (--comm mpi: the world's).
void validate(gpt::config& c, int world_size) {
  if (world_size > 0) {
    if (c.ranks > 0 && c.ranks != world_size)
      throw gpt::usage_error("--ranks " + std::to_string(c.ranks) + " differs from the MPI world size " +
                             std::to_string(world_size) + " (mpirun -np)");
    c.ranks = world_size;
  }
  if (c.ranks == 0) c.ranks = c.tp;
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
  if (c.threads < 0) c.threads = std::max(1, 2 / c.ranks);  // 2 a process (MPI: a machine), split over its ranks
  if ((c.batch / dp) % c.accumulate != 0)
    throw gpt::usage_error("--accumulate " + std::to_string(c.accumulate) + ": a rank's " + std::to_string(c.batch / dp) +
                           " sequences (--batch over the data-parallel ranks) do not divide into as many micro-batches");
  if (!c.dump_grads_path.empty() && (c.ranks != 1 || c.zero != 0 || !c.resume_dir.empty() || c.accumulate > 1))
    throw gpt::usage_error("--dump-grads: one rank without --zero, --resume or --accumulate only (the whole gradients of "
                           "the first step)");
  // The activations' sizes, as ints, and attention's probabilities (sequences x heads x seq^2).
  const std::int64_t rows = static_cast<std::int64_t>(c.batch / dp / c.accumulate) * c.model.seq;
  const std::int64_t widest = std::max({c.model.dim, c.model.ffn, c.model.vocab});
  if (rows * widest >= (std::int64_t{1} << 31) ||
      static_cast<std::int64_t>(c.batch / dp / c.accumulate) * c.model.heads * c.model.seq * c.model.seq >=
          (std::int64_t{1} << 31))
    throw gpt::usage_error("--batch " + std::to_string(c.batch) + " x --seq " + std::to_string(c.model.seq) +
                           ": too large for this example's activations on a rank (2^31 floats)");
  if (!c.checkpoint_dir.empty() || !c.resume_dir.empty() || c.checkpoint_every > 0) {
#ifndef DISTOPT_GPT_CHECKPOINT
    throw gpt::usage_error("--checkpoint/--resume: this distopt-gpt was built without distopt::checkpoint (xxHash)");
#endif
    if (c.checkpoint_every > 0 && c.checkpoint_dir.empty()) throw gpt::usage_error("--checkpoint-every needs --checkpoint DIR");
  }
  if (c.comm != "threads" && c.comm != "mpi") throw gpt::usage_error("--comm: '" + c.comm + "' (threads or mpi)");
  if (c.param_dtype != "fp32" && c.param_dtype != "bf16")
    throw gpt::usage_error("--param-dtype: '" + c.param_dtype + "' (fp32 or bf16)");
  if (c.state != "fp32" && c.state != "q8") throw gpt::usage_error("--state: '" + c.state + "' (fp32 or q8)");
  const bool matrices = c.optimizer == "galore_adamw" || c.optimizer == "muon";
  const std::string what = "--optimizer " + c.optimizer;
  if (c.state == "q8" && c.optimizer != "adamw")
    throw gpt::usage_error("--state q8: built for --optimizer adamw only (8-bit states are for element-wise policies)");
  if (c.state == "q8" && c.param_dtype == "bf16") throw gpt::usage_error("--state q8: with fp32 params only");
  if (c.zero >= 2 && (matrices || c.param_dtype == "bf16" || c.state == "q8"))
    throw gpt::usage_error("--zero " + std::to_string(c.zero) + ": not built for " +
                           (matrices ? what : c.state == "q8" ? "--state q8" : "--param-dtype bf16") +
                           " (stage 1 only here; the library runs them at every stage)");
  if (c.param_dtype == "bf16" && c.optimizer != "adamw" && c.optimizer != "adafactor")
    throw gpt::usage_error("--param-dtype bf16: built for --optimizer adamw and adafactor only, not " + c.optimizer);
  if (c.optimizer == "galore_adamw" && c.tp > 1)
    throw gpt::usage_error("--optimizer galore_adamw: GaLore projects whole matrices, not with --tp");
  if (c.backend == "cuda") {  // checked before any device is looked for
#ifndef DISTOPT_GPT_CUDA
    throw gpt::usage_error("--backend cuda: this distopt-gpt was built without CUDA (configure with -DDISTOPT_ENABLE_CUDA=ON)");
#endif
    if (c.ranks != 1 || c.comm != "threads")
      throw gpt::usage_error("--backend cuda: one GPU, not with --tp, --ranks or --comm mpi");
    if (c.zero > 0 || c.param_dtype != "fp32" || c.state != "fp32" || c.accumulate > 1)
      throw gpt::usage_error("--backend cuda: not with --zero, --param-dtype bf16, --state q8 or --accumulate");
    if (!c.checkpoint_dir.empty() || !c.resume_dir.empty() || !c.dump_grads_path.empty())
      throw gpt::usage_error("--backend cuda: not with --checkpoint, --resume or --dump-grads");
    if (c.optimizer != "adafactor" && c.optimizer != "adamw")
      throw gpt::usage_error("--backend cuda: built for --optimizer adafactor and adamw, not " + c.optimizer);
  }
}

/// The trainer of --backend and --optimizer (validate() has refused what is not built).
using trainer = gpt::history (*)(const gpt::config&);
trainer trainer_of(const gpt::config& c) {
#ifdef DISTOPT_GPT_CUDA
  if (c.backend == "cuda") return gpt::train_cuda;
#endif
#ifdef DISTOPT_GPT_NO_CPU_TRAINERS
  throw gpt::usage_error("--backend cpu: this distopt-gpt was built without its CPU trainers (DISTOPT_GPT_CPU_TRAINERS=OFF)");
#else
  if (c.optimizer == "adafactor") return gpt::train_adafactor;
  if (c.optimizer == "adamw") return gpt::train_adamw;
  if (c.optimizer == "lamb") return gpt::train_lamb;
  if (c.optimizer == "came") return gpt::train_came;
  if (c.optimizer == "galore_adamw" || c.optimizer == "muon") {
#ifdef DISTOPT_GPT_GALORE
    return c.optimizer == "muon" ? gpt::train_muon : gpt::train_galore_adamw;
#else
    throw gpt::usage_error("--optimizer " + c.optimizer + ": this distopt-gpt was built without LAPACK");
#endif
  }
  throw gpt::usage_error("--optimizer: unknown '" + c.optimizer + "' (adafactor, adamw, lamb, came, galore_adamw or muon)");
#endif
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
    const unsigned long step = std::strtoul(line.c_str(), nullptr, 10);
    if (comma == std::string::npos || step != losses.size() + 1)
      throw gpt::usage_error("--expect " + c.expect_path + ": not a --log file of steps 1, 2, ... (line '" + line + "')");
    losses.push_back(std::strtod(line.c_str() + comma + 1, nullptr));
  }
  return losses;
}

/// Compares the run's losses with --expect's, step by step; prints the worst difference.
bool matches_expected(const gpt::config& c, const std::vector<double>& expected, const gpt::history& h) {
  // A resumed run's losses are those of its steps from the checkpoint's on; every step of
  // the run must be in the file.
  const std::size_t n = h.train_loss.size(), last = h.first_step + n;
  if (n == 0 || expected.size() < last) {
    std::cerr << "distopt-gpt: --expect " << c.expect_path << ": " << expected.size()
              << " steps, the run's last step is " << last << "\n";
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
  const auto whole = gpt::initial_weights(c.model, c.seed);
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
#ifdef DISTOPT_GPT_MPI
  std::optional<distopt::mpi_session> session;  // --comm mpi
#endif
  bool writer = true;  // prints the plot and the comparison; with --comm mpi rank 0 only
  try {
    gpt::config cfg = parse(argc, argv);
    int world_size = 0;
    if (cfg.comm == "mpi") {
#ifdef DISTOPT_GPT_MPI
      session.emplace(argc, argv);
      const distopt::mpi world(MPI_COMM_WORLD);
      world_size = world.size();
      writer = world.rank() == 0;
#else
      throw gpt::usage_error("--comm mpi: this distopt-gpt was built without MPI (configure with -DDISTOPT_ENABLE_MPI=ON)");
#endif
    }
    validate(cfg, world_size);
    const trainer train = trainer_of(cfg);  // refuses what this build lacks before anything else
    if (!cfg.save_init_dir.empty()) {
      if (writer) save_init(cfg);
      return 0;
    }
    gpt::check_outputs(cfg);  // every rank: a refusal on one only would leave the others waiting
#ifdef DISTOPT_GPT_CHECKPOINT
    if (!cfg.resume_dir.empty()) cfg.resume_step = gpt::check_run_record(cfg);  // every rank reads it
#endif
    const std::vector<double> expected = cfg.expect_path.empty() ? std::vector<double>{} : expected_losses(cfg);
    openblas_set_num_threads(cfg.threads);
    gpt::history h;
    try {
      h = train(cfg);
    } catch (const std::exception& e) {
#ifdef DISTOPT_GPT_MPI
      // The other processes may wait for this one in a collective: end them all.
      if (session && cfg.ranks > 1) {
        int rank = -1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        std::cerr << "distopt-gpt: error on rank " << rank << ": " << e.what() << std::endl;
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
#endif
      throw;
    }
    if (!writer) return 0;
    if (!cfg.plot_path.empty()) {
      gpt::write_plot(cfg.plot_path, "distopt-gpt, " + cfg.optimizer, h);
      std::cout << "plot: " << cfg.plot_path << "\n";
    }
    if (!cfg.expect_path.empty() && !matches_expected(cfg, expected, h)) return 1;
    return 0;
  } catch (const gpt::usage_error& e) {
    if (writer) std::cerr << "distopt-gpt: " << e.what() << " (distopt-gpt --help for the flags)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "distopt-gpt: " << e.what() << "\n";
    return 1;
  }
}
