// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-replay: replays a gradient trace through a distopt optimizer and writes the
// resulting parameters, to check distopt against a PyTorch run.

#include <distopt/io/safetensors.hpp>
#include <distopt/types/dtype.hpp>

#include <array>
#include <charconv>
#include <optional>
#include <cstdio>
#include <exception>
#include <iostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "replay.hpp"

#ifdef DISTOPT_REPLAY_MPI
#include <distopt/comm/mpi.hpp>
#endif
#ifdef DISTOPT_REPLAY_KOKKOS
#include <Kokkos_Core.hpp>
#endif

#ifndef DISTOPT_REPLAY_MPI
// Built without MPI: --comm mpi is refused.
#define DISTOPT_REPLAY_NO_MPI(policy)                                             \
  replay::result replay::run_##policy##_mpi(const trace&, const config&) {         \
    throw usage_error("--comm mpi: this distopt-replay was built without MPI "     \
                      "(configure with -DDISTOPT_ENABLE_MPI=ON)");                 \
  }
DISTOPT_REPLAY_NO_MPI(sgd)
DISTOPT_REPLAY_NO_MPI(adam)
DISTOPT_REPLAY_NO_MPI(adamw)
DISTOPT_REPLAY_NO_MPI(lion)
DISTOPT_REPLAY_NO_MPI(lamb)
DISTOPT_REPLAY_NO_MPI(adafactor)
DISTOPT_REPLAY_NO_MPI(came)
#ifdef DISTOPT_REPLAY_GALORE
DISTOPT_REPLAY_NO_MPI(muon)
#endif
#undef DISTOPT_REPLAY_NO_MPI
#endif
// galore_adamw: no MPI mode (its projections run on every rank; threads show the same),
// and nothing without LAPACK.
replay::result replay::run_galore_adamw_mpi(const trace&, const config&) {
  throw usage_error("--comm mpi: galore_adamw runs on one rank or with --ranks N (threads) in distopt-replay");
}
#ifndef DISTOPT_REPLAY_GALORE
// muon needs BLAS, galore_adamw LAPACK: both come with distopt::galore.
#define DISTOPT_REPLAY_NO_BLAS(policy, mode)                                                             \
  replay::result replay::run_##policy##_##mode(const trace&, const config&) {                            \
    throw usage_error("--optimizer " #policy ": this distopt-replay was built without BLAS/LAPACK (install " \
                      "libopenblas-dev liblapack-dev)");                                                  \
  }
DISTOPT_REPLAY_NO_BLAS(galore_adamw, single)
DISTOPT_REPLAY_NO_BLAS(galore_adamw, threads)
DISTOPT_REPLAY_NO_BLAS(galore_adamw, kokkos)
DISTOPT_REPLAY_NO_BLAS(muon, single)
DISTOPT_REPLAY_NO_BLAS(muon, threads)
DISTOPT_REPLAY_NO_BLAS(muon, kokkos)
DISTOPT_REPLAY_NO_BLAS(muon, mpi)
#undef DISTOPT_REPLAY_NO_BLAS
#endif
#ifndef DISTOPT_REPLAY_KOKKOS
// Built without Kokkos: --backend kokkos is refused.
#define DISTOPT_REPLAY_NO_KOKKOS(policy)                                             \
  replay::result replay::run_##policy##_kokkos(const trace&, const config&) {         \
    throw usage_error("--backend kokkos: this distopt-replay was built without Kokkos " \
                      "(configure with -DDISTOPT_ENABLE_KOKKOS=ON)");                  \
  }
DISTOPT_REPLAY_NO_KOKKOS(sgd)
DISTOPT_REPLAY_NO_KOKKOS(adam)
DISTOPT_REPLAY_NO_KOKKOS(adamw)
DISTOPT_REPLAY_NO_KOKKOS(lion)
DISTOPT_REPLAY_NO_KOKKOS(lamb)
DISTOPT_REPLAY_NO_KOKKOS(adafactor)
DISTOPT_REPLAY_NO_KOKKOS(came)
#ifdef DISTOPT_REPLAY_GALORE
DISTOPT_REPLAY_NO_KOKKOS(galore_adamw)
DISTOPT_REPLAY_NO_KOKKOS(muon)
#endif
#undef DISTOPT_REPLAY_NO_KOKKOS
#endif
// galore_adamw and muon run on host memory only (their projections and Newton-Schulz call
// LAPACK and BLAS on the host): --backend emulated and cuda are refused for them.
#define DISTOPT_REPLAY_HOST_ONLY(policy, mode)                                                              \
  replay::result replay::run_##policy##_##mode(const trace&, const config&) {                               \
    throw usage_error("--backend " #mode ": --optimizer " #policy " runs on host memory only (cpu or kokkos)"); \
  }
DISTOPT_REPLAY_HOST_ONLY(galore_adamw, emulated)
DISTOPT_REPLAY_HOST_ONLY(galore_adamw, cuda)
DISTOPT_REPLAY_HOST_ONLY(muon, emulated)
DISTOPT_REPLAY_HOST_ONLY(muon, cuda)
#undef DISTOPT_REPLAY_HOST_ONLY
#ifndef DISTOPT_REPLAY_EMULATED
// Not on Linux: the emulated device (mmap/mprotect) is left out.
#define DISTOPT_REPLAY_NO_EMULATED(policy)                                                  \
  replay::result replay::run_##policy##_emulated(const trace&, const config&) {              \
    throw usage_error("--backend emulated: this distopt-replay was built without the emulated " \
                      "device (Linux only)");                                               \
  }
DISTOPT_REPLAY_NO_EMULATED(sgd)
DISTOPT_REPLAY_NO_EMULATED(adam)
DISTOPT_REPLAY_NO_EMULATED(adamw)
DISTOPT_REPLAY_NO_EMULATED(lion)
DISTOPT_REPLAY_NO_EMULATED(lamb)
DISTOPT_REPLAY_NO_EMULATED(adafactor)
DISTOPT_REPLAY_NO_EMULATED(came)
#undef DISTOPT_REPLAY_NO_EMULATED
#endif
#ifndef DISTOPT_REPLAY_CUDA
// Built without CUDA: --backend cuda is refused.
#define DISTOPT_REPLAY_NO_CUDA(policy)                                             \
  replay::result replay::run_##policy##_cuda(const trace&, const config&) {         \
    throw usage_error("--backend cuda: this distopt-replay was built without CUDA " \
                      "(configure with -DDISTOPT_ENABLE_CUDA=ON)");                 \
  }
DISTOPT_REPLAY_NO_CUDA(sgd)
DISTOPT_REPLAY_NO_CUDA(adam)
DISTOPT_REPLAY_NO_CUDA(adamw)
DISTOPT_REPLAY_NO_CUDA(lion)
DISTOPT_REPLAY_NO_CUDA(lamb)
DISTOPT_REPLAY_NO_CUDA(adafactor)
DISTOPT_REPLAY_NO_CUDA(came)
#undef DISTOPT_REPLAY_NO_CUDA
#endif

namespace {

constexpr const char* usage_text =
    "usage: distopt-replay --optimizer NAME --trace IN.safetensors --out OUT.safetensors\n"
    "                      [--set KEY=VALUE]... [--param-dtype fp32|bf16|fp16]\n"
    "                      [--grad-dtype fp32|bf16|fp16] [--master-weights on|off]\n"
    "                      [--state fp32|bf16|q8] [--min-8bit-size N]\n"
    "                      [--percentile-clipping P] [--threads N] [--ranks N] [--tp T]\n"
    "                      [--comm threads|mpi] [--placement sharded|owned]\n"
    "                      [--save-at K DIR] [--resume DIR]\n"
    "                      [--backend cpu|kokkos|emulated|cuda] [--zero 1|2|3]\n"
    "--save-at K DIR saves a checkpoint after step K into DIR; --resume DIR loads one (saved\n"
    "on any number of ranks and any --tp) and runs the trace's remaining steps.\n"
    "--state q8 keeps 8-bit block-wise states for tensors of at least --min-8bit-size\n"
    "elements (default 4096; smaller ones keep fp32). --percentile-clipping P (0..100,\n"
    "default 100 = off) clips each tensor's gradient at the P-th percentile of its last 100\n"
    "norms, as bitsandbytes.\n"
    "--ranks N runs N ranks as threads with sharded state (rank 0 gets the trace's gradient,\n"
    "the others zeros, summed): the output equals one rank's byte for byte. --comm mpi runs\n"
    "one rank per MPI process (start it with mpirun -np N); rank 0 writes the output.\n"
    "--backend kokkos runs the optimizer through the Kokkos executor on Kokkos's default host\n"
    "execution space (one rank; its threads are Kokkos's, e.g. OMP_NUM_THREADS): the output\n"
    "equals --backend cpu's (the default) byte for byte.\n"
    "--backend emulated runs it on the emulated device (host threads over memory the host\n"
    "cannot touch outside the optimizer's launches and copies; --threads sets its threads),\n"
    "--backend cuda on the current CUDA GPU (a build with -DDISTOPT_ENABLE_CUDA=ON): one\n"
    "rank each, params and grads written with distopt::upload and read with download, the\n"
    "output byte for byte --backend cpu's. Not for galore_adamw and muon (host memory).\n"
    "--tp T adds T tensor-parallel ranks per data-parallel rank: each matrix is split over\n"
    "them by rows (dim 0) or, when its rows do not divide, by columns; the output is the\n"
    "reassembled tensors. With --comm mpi the world is the DP x TP grid (mpirun -np N*T).\n"
    "--zero S runs the ranks at ZeRO stage S (1: states sharded; 2: grads too; 3: params\n"
    "too) with the overlap hooks: params written through gather/release, each tensor's grads\n"
    "declared ready as soon as written, last tensor first. The output equals one rank's.\n"
    "Without --ranks or --comm mpi it runs one rank (as threads, sharded storage).\n"
    "Stages 2 and 3 take fp32 params, grads and states, and not galore_adamw or muon.\n"
    "--placement owned (galore_adamw, muon; on --ranks or --comm mpi) puts each matrix they\n"
    "update whole on one data-parallel rank (distopt::owned): its grads are reduced to that\n"
    "rank, which alone projects or orthogonalises it, and broadcasts the new params.\n"
    "galore_adamw puts the 2-D tensors not named *.bias in a group with the GaLore keys\n"
    "(--set rank=R --set update_proj_gap=G --set scale=S --set proj_type=std), the rest in a\n"
    "plain group, as tests/reference/galore_cases.txt describes. muon likewise puts them in\n"
    "the Muon group and runs AdamW on the rest (--set betas=..., --set adamw_eps=...).\n"
    "optimizers: sgd, adam, adamw, lion, lamb, adafactor, came, galore_adamw, muon (hyper-parameters\n"
    "by the "
    "reference implementations' argument names, tuples as comma lists: --set betas=0.9,0.95,\n"
    "None for an unset optional: --set beta1=None)\n";

struct paths {
  std::string trace, out;
};

int parse_int(std::string_view flag, std::string_view v) {
  int x = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || p != v.data() + v.size())
    throw replay::usage_error(std::string(flag) + ": expected an integer, got '" + std::string(v) + "'");
  return x;
}

replay::config parse_args(int argc, char** argv, paths& io) {
  replay::config cfg;
  bool threads_given = false;
  std::vector<std::string_view> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage_text;
      std::exit(0);
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw replay::usage_error(std::string(a) + ": missing value");
      return std::string(args[++i]);
    };
    if (a == "--optimizer") cfg.optimizer = value();
    else if (a == "--trace") io.trace = value();
    else if (a == "--out") io.out = value();
    else if (a == "--set") {
      const std::string kv = value();
      const auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw replay::usage_error("--set " + kv + ": expected KEY=VALUE");
      cfg.sets.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else if (a == "--param-dtype") cfg.param_dtype = value();
    else if (a == "--grad-dtype") cfg.grad_dtype = value();
    else if (a == "--state") cfg.state = value();
    else if (a == "--master-weights") {
      const std::string v = value();
      if (v != "on" && v != "off")
        throw replay::usage_error("--master-weights: expected on or off, got '" + v + "'");
      cfg.master_weights = v == "on";
    } else if (a == "--threads") {
      cfg.threads = parse_int(a, value());
      threads_given = true;
      if (cfg.threads < 0) throw replay::usage_error("--threads: must be >= 0 (0 = one per core)");
    } else if (a == "--min-8bit-size") {
      const int n = parse_int(a, value());
      if (n < 0) throw replay::usage_error("--min-8bit-size: must be >= 0");
      cfg.min_8bit_size = static_cast<std::size_t>(n);
    } else if (a == "--percentile-clipping") {
      cfg.percentile_clipping = parse_int(a, value());
      if (cfg.percentile_clipping < 0 || cfg.percentile_clipping > 100)
        throw replay::usage_error("--percentile-clipping: must be between 0 and 100 (100 = off)");
    } else if (a == "--ranks") {
      cfg.ranks = parse_int(a, value());
      if (cfg.ranks < 1 || cfg.ranks > 1024) throw replay::usage_error("--ranks: must be between 1 and 1024");
    } else if (a == "--tp") {
      cfg.tp = parse_int(a, value());
      if (cfg.tp < 1 || cfg.tp > 64) throw replay::usage_error("--tp: must be between 1 and 64");
    } else if (a == "--placement") {
      cfg.placement = value();
      if (cfg.placement != "sharded" && cfg.placement != "owned")
        throw replay::usage_error("--placement: unknown placement '" + cfg.placement + "' (sharded or owned)");
    } else if (a == "--comm") {
      cfg.comm = value();
      if (cfg.comm != "threads" && cfg.comm != "mpi")
        throw replay::usage_error("--comm: unknown communicator '" + cfg.comm + "' (threads or mpi)");
    } else if (a == "--save-at" || a == "--resume") {
#ifndef DISTOPT_REPLAY_CHECKPOINT
      throw replay::usage_error(std::string(a) + ": this distopt-replay was built without checkpoints (install libxxhash-dev)");
#endif
      if (a == "--save-at") {
        cfg.save_at = parse_int(a, value());
        if (cfg.save_at < 1) throw replay::usage_error("--save-at: the step must be >= 1");
        cfg.save_dir = value();
      } else {
        cfg.resume_dir = value();
      }
    } else if (a == "--zero") {
      cfg.zero = parse_int(a, value());
      if (cfg.zero < 1 || cfg.zero > 3) throw replay::usage_error("--zero: the ZeRO stage is 1, 2 or 3");
    } else if (a == "--backend") {
      cfg.backend = value();
      if (cfg.backend != "cpu" && cfg.backend != "kokkos" && cfg.backend != "emulated" && cfg.backend != "cuda")
        throw replay::usage_error("--backend: unknown backend '" + cfg.backend + "' (cpu, kokkos, emulated or cuda)");
    } else
      throw replay::usage_error("unknown option '" + std::string(a) + "' (see --help)");
  }
  if (cfg.optimizer.empty()) throw replay::usage_error("--optimizer is required (see --help)");
  if (io.trace.empty()) throw replay::usage_error("--trace is required (see --help)");
  if (io.out.empty()) throw replay::usage_error("--out is required (see --help)");
  if (cfg.backend != "cpu") {
    if (cfg.ranks > 0 || cfg.tp > 1 || cfg.comm == "mpi")
      throw replay::usage_error("--backend " + cfg.backend + ": distopt-replay runs one rank with it (no --ranks, --tp or --comm "
                                "mpi; the unit suites run this executor on several ranks)");
    if (threads_given && cfg.backend == "kokkos")
      throw replay::usage_error("--threads: sets the cpu backend's threads; --backend kokkos uses Kokkos's own "
                                "(e.g. OMP_NUM_THREADS)");
    if (threads_given && cfg.backend == "cuda")
      throw replay::usage_error("--threads: sets the host threads of --backend cpu and emulated, not of cuda");
  }
  if (cfg.placement == "owned") {
    if (cfg.optimizer != "galore_adamw" && cfg.optimizer != "muon")
      throw replay::usage_error("--placement owned: only galore_adamw and muon update whole matrices (--optimizer " +
                                cfg.optimizer + " runs sharded)");
    if (cfg.backend != "cpu")
      throw replay::usage_error("--placement owned: runs on --ranks or --comm mpi, not --backend " + cfg.backend);
  }
  if (cfg.zero > 0) {
    if (cfg.backend != "cpu")
      throw replay::usage_error("--zero: the ZeRO stages run on --ranks or --comm mpi, not --backend " + cfg.backend);
    if (cfg.placement == "owned")
      throw replay::usage_error("--zero: --placement owned puts whole matrices on their owners; the ZeRO stages shard "
                                "(use one or the other)");
    if (cfg.zero >= 2 && (cfg.optimizer == "galore_adamw" || cfg.optimizer == "muon"))
      throw replay::usage_error("--zero " + std::to_string(cfg.zero) + ": " + cfg.optimizer +
                                " reads whole matrices of the full grads; use --zero 1 or --placement owned");
    const auto fp32 = [](const std::string& t) { return distopt::parse_dtype(t) == distopt::dtype::f32; };
    if (cfg.zero >= 2 && (!fp32(cfg.param_dtype) || !fp32(cfg.grad_dtype) || cfg.state != "fp32"))
      throw replay::usage_error("--zero " + std::to_string(cfg.zero) +
                                ": distopt-replay builds stages 2 and 3 for fp32 params, grads and states "
                                "(--zero 1 takes every combination; the unit suite tests the others)");
  }
  if ((cfg.tp > 1 || cfg.placement == "owned" || cfg.zero > 0) && cfg.ranks == 0 && cfg.comm != "mpi")
    cfg.ranks = 1;  // a TP grid, owned placement and the ZeRO stages run as threads
  return cfg;
}

/// Reads and checks a trace: every param has a grad of the same shape at every step, and
/// nothing else is in the file.
replay::trace load_trace(const std::string& path) {
  namespace io = distopt::io;
  const auto file = io::safetensors_reader::open(path);
  const auto& meta = file.metadata();
  auto it = meta.find("steps");
  if (it == meta.end()) throw io::format_error(path + ": __metadata__ has no \"steps\" entry");
  int steps = 0;
  try {
    steps = parse_int("steps", it->second);
  } catch (const replay::usage_error&) {
    throw io::format_error(path + ": __metadata__ \"steps\" is not an integer: '" + it->second + "'");
  }
  if (steps < 0) throw io::format_error(path + ": __metadata__ \"steps\" is negative");

  replay::trace tr;
  std::set<std::string> expected;
  for (const auto& n : file.names())
    if (n.rfind("param.", 0) == 0) tr.names.push_back(n.substr(6));
  if (tr.names.empty()) throw io::format_error(path + ": no param.<name> tensors");
  auto read = [&](const std::string& key, const std::string& name) {
    if (!file.contains(key)) throw io::format_error(path + ": missing tensor '" + key + "'");
    const auto& info = file.info(key);
    if (info.dtype != "F32")
      throw io::format_error(path + ": tensor '" + key + "' has dtype " + info.dtype + ", expected F32");
    if (info.shape != tr.shapes.at(name))
      throw io::format_error(path + ": tensor '" + key + "' has a different shape from 'param." + name + "'");
    expected.insert(key);
    return file.read_f32(key);
  };
  for (const auto& n : tr.names) tr.shapes[n] = file.info("param." + n).shape;
  for (const auto& n : tr.names) tr.params[n] = read("param." + n, n);
  tr.grads.resize(static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k)
    for (const auto& n : tr.names) tr.grads[k][n] = read("grad." + std::to_string(k) + "." + n, n);
  for (const auto& n : file.names())
    if (!expected.count(n))
      throw io::format_error(path + ": unexpected tensor '" + n + "' (a trace holds param.<name> and grad.<step>.<name> for step < " + std::to_string(steps) + ")");
  return tr;
}

}  // namespace

int main(int argc, char** argv) {
  paths io;
  try {
    const replay::config cfg = parse_args(argc, argv, io);
    using entry = replay::result (*)(const replay::trace&, const replay::config&);
    const int mode = cfg.backend == "cuda"     ? 5
                     : cfg.backend == "emulated" ? 4
                     : cfg.backend == "kokkos"   ? 3
                     : cfg.comm == "mpi"         ? 2
                     : cfg.ranks > 0             ? 1
                                                 : 0;
    entry run = nullptr;
#define DISTOPT_REPLAY_PICK(policy)                                                                    \
  if (cfg.optimizer == #policy)                                                                        \
    run = std::array<entry, 6>{replay::run_##policy##_single,   replay::run_##policy##_threads,          \
                               replay::run_##policy##_mpi,      replay::run_##policy##_kokkos,           \
                               replay::run_##policy##_emulated, replay::run_##policy##_cuda}[static_cast<std::size_t>(mode)];
    DISTOPT_REPLAY_PICK(sgd)
    DISTOPT_REPLAY_PICK(adam)
    DISTOPT_REPLAY_PICK(adamw)
    DISTOPT_REPLAY_PICK(lion)
    DISTOPT_REPLAY_PICK(lamb)
    DISTOPT_REPLAY_PICK(adafactor)
    DISTOPT_REPLAY_PICK(came)
    DISTOPT_REPLAY_PICK(galore_adamw)
    DISTOPT_REPLAY_PICK(muon)
#undef DISTOPT_REPLAY_PICK
    if (!run)
      throw replay::usage_error("--optimizer: unknown optimizer '" + cfg.optimizer +
                                "' (sgd, adam, adamw, lion, lamb, adafactor, came, galore_adamw or muon)");
    replay::trace tr;
    try {
      tr = load_trace(io.trace);
    } catch (const std::exception& e) {  // unreadable, malformed or incomplete input
      throw replay::usage_error(e.what());
    }
#ifdef DISTOPT_REPLAY_MPI
    std::optional<distopt::mpi_session> session;
    if (mode == 2) {
      session.emplace(argc, argv);
      const int world = distopt::mpi(MPI_COMM_WORLD).size();
      if (cfg.ranks > 0 && cfg.ranks * cfg.tp != world)
        throw replay::usage_error("--ranks " + std::to_string(cfg.ranks) + (cfg.tp > 1 ? " x --tp " + std::to_string(cfg.tp) : "") +
                                  " differs from the MPI world size " + std::to_string(world) + " (mpirun -np)");
      if (world % cfg.tp != 0)
        throw replay::usage_error("--tp " + std::to_string(cfg.tp) + " does not divide the MPI world size " +
                                  std::to_string(world) + " (mpirun -np)");
    }
    const bool writer = mode != 2 || distopt::mpi(MPI_COMM_WORLD).rank() == 0;
#else
    const bool writer = true;
#endif
#ifdef DISTOPT_REPLAY_KOKKOS
    // Kokkos is initialised for the run only; the optimizer is gone before finalize.
    std::optional<Kokkos::ScopeGuard> kokkos;
    if (mode == 3) kokkos.emplace();
#endif
    const replay::result out = run(tr, cfg);
    if (!writer) return 0;

    distopt::io::safetensors_writer w;
    w.set_metadata("steps", std::to_string(tr.grads.size()));
    w.set_metadata("optimizer", cfg.optimizer);
    for (const auto& n : tr.names) w.add_f32("param." + n, tr.shapes.at(n), out.at(n));
    w.write(io.out);
    std::cout << "distopt-replay: " << cfg.optimizer << ", " << tr.names.size() << " tensors, "
              << tr.grads.size() << " steps -> " << io.out << "\n";
    return 0;
  } catch (const replay::usage_error& e) {
    std::cerr << "distopt-replay: " << e.what() << "\n";
    return 2;
  } catch (const replay::no_device_error& e) {
    std::cerr << "distopt-replay: " << e.what() << "\n";
    return 77;
  } catch (const std::exception& e) {
    std::cerr << "distopt-replay: error: " << e.what() << "\n";
    return 1;
  }
}
