// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-fashion-mnist: trains an MLP classifier on Fashion-MNIST, with BLAS for the
// forward and backward passes and a distopt optimizer for the updates.

#include <cblas.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#ifdef DISTOPT_FASHION_MNIST_MPI
#include <distopt/comm/mpi.hpp>
#endif

#ifdef DISTOPT_FASHION_MNIST_KOKKOS
#include <Kokkos_Core.hpp>
#endif

#include "fashion_mnist.hpp"

namespace {

/// The most ranks --ranks accepts (each is a thread with its own copy of the model).
constexpr int max_ranks = 256;
constexpr int max_threads = 1024;  // host threads per rank: a typo, not a machine, beyond it

constexpr const char* usage_text =
    "usage: distopt-fashion-mnist [--optimizer sgd|adam|adamw|lion|lamb|adafactor|came|galore_adamw|muon]\n"
    "                             [--set KEY=VALUE]...\n"
    "                             [--epochs N] [--batch-size N] [--hidden W1,W2,...]\n"
    "                             [--param-dtype fp32|bf16] [--state fp32|q8]\n"
    "                             [--threads N] [--seed N]\n"
    "                             [--data DIR] [--log FILE.csv] [--plot FILE.png]\n"
    "                             [--limit N] [--clip MAX_NORM] [--normalize on|off]\n"
    "                             [--ranks N] [--tp T] [--comm threads|mpi] [--zero 1|2|3 [--offload]]\n"
    "                             [--accumulate N [--accumulate-schedule last|each]]\n"
    "                             [--checkpoint DIR [--checkpoint-every N]] [--resume DIR]\n"
    "                             [--backend cpu|kokkos|cuda]\n"
    "Trains an MLP (784-512-256-10, ReLU, softmax cross-entropy) on Fashion-MNIST.\n"
    "  --optimizer     default adamw; hyper-parameters by the reference's argument names,\n"
    "                  tuples as comma lists (--set betas=0.9,0.95), None as none. Defaults\n"
    "                  are the reference's (PyTorch; lion: lion-pytorch's, lr=1e-4; lamb:\n"
    "                  torch-optimizer's; adafactor: transformers', lr=None with its relative\n"
    "                  step size: --set relative_step=false --set lr=X for a fixed lr; came:\n"
    "                  came-pytorch's) except sgd: lr=0.05 momentum=0.9; lamb: lr=1e-2\n"
    "                  weight_decay=0.01; came: lr=1e-3; galore_adamw: rank=128\n"
    "                  update_proj_gap=200 scale=0.25 on the hidden layers' weights (the\n"
    "                  output layer and biases unprojected); muon: Muon on the hidden layers'\n"
    "                  weights, AdamW on the output layer and biases, with adjust_lr_fn=\n"
    "                  match_rms_adamw (one lr for both, Moonlight's recipe; torch's default\n"
    "                  lr=1e-3, weight_decay=0.1). Biases get weight_decay=0.\n"
    "  --epochs        default 10             --batch-size  default 128\n"
    "  --hidden        hidden widths, default 512,256\n"
    "  --param-dtype   fp32 (default) or bf16 with fp32 master weights\n"
    "  --state         optimizer state: fp32 (default) or q8, 8-bit block-wise (sgd, adam,\n"
    "                  adamw, lion, galore_adamw's low-rank states; under 4096 elements: fp32)\n"
    "  --threads       threads of distopt and OpenBLAS per rank; default 2 per process, split\n"
    "                  over the ranks on this machine (at least 1); 0: the cores, split the same\n"
    "                  way. OpenBLAS's count is process-wide: ranks x threads may run at once\n"
    "  --seed          initialisation, shuffling and rounding seed, default 0\n"
    "  --data          directory of the idx files (gzipped or not), default\n"
    "                  /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)\n"
    "  --log           per-step CSV: step,epoch,loss\n"
    "  --plot          loss and test-accuracy curves as PNG (needs gnuplot: gnuplot-nox)\n"
    "  --limit         train on the first N samples only (all test samples are scored)\n"
    "  --clip          clip the global gradient norm (torch.nn.utils.clip_grad_norm_)\n"
    "  --normalize     scale pixels to zero mean, unit variance (default on; off: [0, 1])\n"
    "  --checkpoint    save the optimizer (params and states) into DIR at the end, and every\n"
    "                  --checkpoint-every N steps; each save replaces the last one atomically\n"
    "  --resume        load DIR (saved with any --ranks and --tp, the same model) and continue\n"
    "                  after its last step() call (skipped steps count): the same shuffles\n"
    "                  and batches as an uninterrupted run; --set then changes the loaded\n"
    "                  hyper-parameters it names\n"
    "  --ranks         data-parallel ranks as threads of this process, default 1. Each rank\n"
    "                  takes a contiguous part of every batch (the first batch % N ranks one\n"
    "                  sample more) and the optimizer state is sharded over the ranks; the\n"
    "                  summed gradient is the batch's mean, as with one rank. Results are\n"
    "                  the same from run to run for a given N, not between different N\n"
    "  --tp            tensor-parallel ranks per data-parallel rank, as threads, default 1\n"
    "                  (Megatron's MLP: layers alternately column-parallel, weight rows and\n"
    "                  bias split, and row-parallel, weight columns split and outputs summed\n"
    "                  over the T ranks; the output layer row-parallel, its bias whole). Every\n"
    "                  hidden width must divide by T; --ranks N --tp T runs N x T threads.\n"
    "                  Starts from the same weights as --tp 1 and trains the same up to the\n"
    "                  rounding of the split sums. Not with --comm mpi\n"
    "  --comm          threads (default) or mpi: one rank per MPI process, started with\n"
    "                  mpirun -np N distopt-fashion-mnist --comm mpi (--ranks, if given, must\n"
    "                  be N); rank 0 prints and writes --log and --plot\n"
    "  --zero          the ZeRO stage of the sharded state (1 states, 2 and grads, 3 and\n"
    "                  params), with the overlap hooks: each layer's params gathered around its\n"
    "                  forward and backward (stage 3: all-gathered, the next layer prefetched),\n"
    "                  its grads' reduce-scatter started as soon as backward has written them.\n"
    "                  Trains bit for bit as without --zero for the same --ranks (one rank:\n"
    "                  sharded over one). Stages 2 and 3: fp32 params and states. Not for\n"
    "                  galore_adamw and muon, nor with --tp or --backend kokkos\n"
    "  --offload       with --zero S: ZeRO-Offload, the params and grads in device memory (the\n"
    "                  emulated device: host memory closed outside launches and copies), the\n"
    "                  master weights and states on the host, stepped by the CPU; grads copied\n"
    "                  to the host layer by layer as backward writes them. Trains bit for bit as\n"
    "                  without --offload. adamw with fp32 params and states, Linux\n"
    "  --accumulate    N micro-batches per step (gradient accumulation, default 1): each rank's\n"
    "                  part of a batch cut into N, as --ranks cuts the batch, each micro-batch's\n"
    "                  backward adding into the grads, one step after the last. Every --zero\n"
    "                  stage trains bit for bit alike. CPU backend, not with --offload\n"
    "  --accumulate-schedule  last (default: the grads reduced after the last micro-batch,\n"
    "                  as PyTorch's no_sync) or each (reduced after each micro-batch into an\n"
    "                  fp32 accumulator of this rank's shard, as DeepSpeed's ZeRO-2)\n"
    "  --backend       the optimizer's executor: cpu (default; --threads threads) or kokkos\n"
    "                  (Kokkos's default host space, its own threads; one rank): both train\n"
    "                  bit for bit alike. cuda: the whole training on GPU 0, the products on\n"
    "                  cuBLAS, the optimizer on distopt::cuda (one rank, fp32 params and\n"
    "                  states, adamw or adafactor; trains to about the CPU's accuracy, not\n"
    "                  to its bits)\n";

/// `flag` needs a part this build left out: refused, naming the CMake option that adds it.
[[noreturn]] [[maybe_unused]] void not_built(const std::string& flag, const char* part, const char* option) {
  throw fmnist::usage_error(flag + ": this distopt-fashion-mnist was built without " + part + " (configure with -D" +
                            option + "=ON)");
}

template <class T>
T parse_number(std::string_view flag, std::string_view v, T min) {
  T x{};
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc{} || p != v.data() + v.size())
    throw fmnist::usage_error(std::string(flag) + ": expected an integer, got '" + std::string(v) + "'");
  if (x < min)
    throw fmnist::usage_error(std::string(flag) + ": must be >= " + std::to_string(min) + ", got " +
                              std::string(v));
  return x;
}

std::vector<int> parse_widths(std::string_view v) {
  std::vector<int> widths;
  for (;;) {
    const auto comma = v.find(',');
    widths.push_back(parse_number<int>("--hidden", v.substr(0, comma), 1));
    if (comma == std::string_view::npos) break;
    v.remove_prefix(comma + 1);
  }
  return widths;
}

fmnist::config parse_args(int argc, char** argv) {
  using fmnist::usage_error;
  fmnist::config cfg;
  std::vector<std::string_view> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage_text;
      std::exit(0);
    }
    auto value = [&]() -> std::string_view {
      if (i + 1 >= args.size()) throw usage_error(std::string(a) + ": missing value");
      return args[++i];
    };
    if (a == "--optimizer") cfg.optimizer = value();
    else if (a == "--set") {
      const std::string kv(value());
      const auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) throw usage_error("--set " + kv + ": expected KEY=VALUE");
      cfg.sets.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else if (a == "--epochs") cfg.epochs = parse_number<int>(a, value(), 1);
    else if (a == "--batch-size") cfg.batch_size = parse_number<int>(a, value(), 1);
    else if (a == "--hidden") cfg.hidden = parse_widths(value());
    else if (a == "--param-dtype") {
      cfg.param_dtype = value();
      if (cfg.param_dtype == "fp16")
        throw usage_error("--param-dtype fp16: not supported by this example (fp32 or bf16)");
      if (cfg.param_dtype != "fp32" && cfg.param_dtype != "bf16")
        throw usage_error("--param-dtype: unknown dtype '" + cfg.param_dtype + "' (fp32 or bf16)");
    } else if (a == "--threads") {
      cfg.threads = parse_number<int>(a, value(), 0);
      if (cfg.threads > max_threads)
        throw usage_error("--threads: must be at most " + std::to_string(max_threads) + ", got " + std::to_string(cfg.threads));
    } else if (a == "--seed") cfg.seed = parse_number<std::uint64_t>(a, value(), 0);
    else if (a == "--data") cfg.data_dir = value();
    else if (a == "--log") cfg.log_path = value();
    else if (a == "--plot") cfg.plot_path = value();
    else if (a == "--limit") cfg.limit = parse_number<std::size_t>(a, value(), 1);
    else if (a == "--clip") {
      const std::string v(value());
      char* end = nullptr;
      cfg.clip = std::strtod(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !(cfg.clip > 0) || !std::isfinite(cfg.clip))
        throw usage_error("--clip: expected a finite number > 0, got '" + v + "'");
    } else if (a == "--normalize") {
      const std::string_view v = value();
      if (v != "on" && v != "off")
        throw usage_error("--normalize: expected on or off, got '" + std::string(v) + "'");
      cfg.normalize = v == "on";
    } else if (a == "--state") {
      const std::string_view v = value();
      if (v != "fp32" && v != "q8")
        throw usage_error("--state " + std::string(v) + ": not supported by this example (fp32 or q8)");
      cfg.state = v;
    } else if (a == "--ranks") {
      cfg.ranks = parse_number<int>(a, value(), 1);
      if (cfg.ranks > max_ranks)
        throw usage_error("--ranks: must be at most " + std::to_string(max_ranks) + ", got " + std::to_string(cfg.ranks));
    } else if (a == "--tp") {
      cfg.tp = parse_number<int>(a, value(), 1);
      if (cfg.tp > max_ranks)
        throw usage_error("--tp: must be at most " + std::to_string(max_ranks) + ", got " + std::to_string(cfg.tp));
    } else if (a == "--zero") {
      cfg.zero = parse_number<int>(a, value(), 1);
      if (cfg.zero > 3) throw usage_error("--zero: the ZeRO stage is 1, 2 or 3, got " + std::to_string(cfg.zero));
    } else if (a == "--offload") {
      cfg.offload = true;
    } else if (a == "--accumulate") {
      cfg.accumulate = parse_number<int>(a, value(), 1);
    } else if (a == "--accumulate-schedule") {
      const std::string v(value());
      if (v != "last" && v != "each") throw usage_error("--accumulate-schedule: last or each, got '" + v + "'");
      cfg.accumulate_each = v == "each";
    } else if (a == "--comm") {
      cfg.comm = value();
      if (cfg.comm != "threads" && cfg.comm != "mpi")
        throw usage_error("--comm: unknown communicator '" + cfg.comm + "' (threads or mpi)");
#ifndef DISTOPT_FASHION_MNIST_MPI
      if (cfg.comm == "mpi") not_built("--comm mpi", "MPI", "DISTOPT_ENABLE_MPI");
#endif
    } else if (a == "--checkpoint" || a == "--checkpoint-every" || a == "--resume") {
#ifndef DISTOPT_FASHION_MNIST_CHECKPOINT
      throw usage_error(std::string(a) + ": this distopt-fashion-mnist was built without checkpoints (install "
                        "libxxhash-dev)");
#endif
      if (a == "--checkpoint") cfg.checkpoint_dir = value();
      else if (a == "--resume") cfg.resume_dir = value();
      else cfg.checkpoint_every = parse_number<int>(a, value(), 1);
    } else if (a == "--backend") {
      cfg.backend = value();
      if (cfg.backend != "cpu" && cfg.backend != "kokkos" && cfg.backend != "cuda")
        throw usage_error("--backend: unknown backend '" + cfg.backend + "' (cpu, kokkos or cuda)");
#ifndef DISTOPT_FASHION_MNIST_CUDA
      if (cfg.backend == "cuda") not_built("--backend cuda", "CUDA", "DISTOPT_ENABLE_CUDA");
#endif
#ifndef DISTOPT_FASHION_MNIST_KOKKOS
      if (cfg.backend == "kokkos") not_built("--backend kokkos", "Kokkos", "DISTOPT_ENABLE_KOKKOS");
#endif
    } else
      throw usage_error("unknown option '" + std::string(a) + "' (see --help)");
  }
  if (cfg.checkpoint_every > 0 && cfg.checkpoint_dir.empty())
    throw usage_error("--checkpoint-every " + std::to_string(cfg.checkpoint_every) +
                      ": saves into --checkpoint DIR, which is not given");
  if (cfg.zero > 0) {
    const std::string stage = "--zero " + std::to_string(cfg.zero);
    if (cfg.optimizer == "galore_adamw" || cfg.optimizer == "muon")
      throw usage_error(stage + ": distopt-fashion-mnist runs " + cfg.optimizer + " without --zero (its state " +
                        "sharded over --ranks as usual; distopt-replay --zero runs it at every stage)");
    if (cfg.tp > 1) throw usage_error(stage + ": not with --tp in distopt-fashion-mnist");
    if (cfg.backend == "kokkos") throw usage_error(stage + ": not with --backend kokkos (one rank, replicated state)");
    if (cfg.zero >= 2 && (cfg.param_dtype != "fp32" || cfg.state != "fp32"))
      throw usage_error(stage + ": distopt-fashion-mnist builds stages 2 and 3 for fp32 params and states "
                        "(--param-dtype fp32 --state fp32); stage 1 takes every combination");
  }
  if (cfg.offload) {
#if !defined(__linux__)
    throw usage_error("--offload: needs the emulated device, built on Linux only");
#endif
    if (cfg.zero == 0) throw usage_error("--offload: needs --zero 1, 2 or 3 (the hooks copy each layer's grads)");
    if (cfg.optimizer != "adamw" || cfg.param_dtype != "fp32" || cfg.state != "fp32")
      throw usage_error("--offload: distopt-fashion-mnist builds it for --optimizer adamw with fp32 params and "
                        "states");
  }
  if (cfg.accumulate > 1) {
    if (cfg.backend != "cpu") throw usage_error("--accumulate: runs on --backend cpu, not " + cfg.backend);
    if (cfg.offload)
      throw usage_error("--accumulate: not with --offload in distopt-fashion-mnist (its offload path writes the "
                        "device grads from host copies)");
  }
  if (cfg.backend == "kokkos" && (cfg.ranks > 1 || cfg.tp > 1 || cfg.comm == "mpi"))
    throw usage_error("--backend kokkos: runs one rank in distopt-fashion-mnist (no --ranks, --tp or --comm mpi)");
  if (cfg.backend == "cuda") {
    const auto refuse = [](const std::string& what) {
      throw usage_error("--backend cuda: " + what + " (it runs one rank with fp32 params and states)");
    };
    if (cfg.ranks > 1 || cfg.tp > 1 || cfg.comm == "mpi") refuse("not with --ranks, --tp or --comm mpi");
    if (cfg.zero > 0 || cfg.offload) refuse("not with --zero or --offload");
    if (cfg.param_dtype != "fp32" || cfg.state != "fp32") refuse("not with --param-dtype bf16 or --state q8");
    if (!cfg.checkpoint_dir.empty() || !cfg.resume_dir.empty()) refuse("not with --checkpoint or --resume");
    if (cfg.optimizer != "adamw" && cfg.optimizer != "adafactor")
      refuse("built for --optimizer adamw and adafactor, not " + cfg.optimizer);
  }
  if (cfg.tp > 1) {
    if (cfg.comm == "mpi")
      throw usage_error("--tp " + std::to_string(cfg.tp) +
                        ": tensor parallelism runs its ranks as threads only, not with --comm mpi");
    if (std::max(cfg.ranks, 1) * cfg.tp > max_ranks)
      throw usage_error("--ranks x --tp: at most " + std::to_string(max_ranks) + " ranks in all, got " +
                        std::to_string(std::max(cfg.ranks, 1) * cfg.tp));
    for (int w : cfg.hidden)
      if (w % cfg.tp != 0)
        throw usage_error("--tp " + std::to_string(cfg.tp) + ": hidden width " + std::to_string(w) +
                          " does not divide by " + std::to_string(cfg.tp) +
                          " (each tensor-parallel rank holds 1/T of every hidden layer's units)");
  }
  return cfg;
}

/// --threads per rank: as given, else 2 (or with 0 the cores) shared by the `ranks_here`
/// ranks on this machine, at least 1 each. One rank keeps the old default of 2 threads.
int threads_per_rank(int given, int ranks_here) {
  if (given > 0) return given;
  const int total = given == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : 2;
  return std::max(1, total / std::max(1, ranks_here));
}

#ifdef DISTOPT_FASHION_MNIST_MPI
/// The MPI processes that share this process's machine (its shared-memory node).
int mpi_processes_here() {
  MPI_Comm node = MPI_COMM_NULL;
  int n = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
  }
  return n;
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifdef DISTOPT_FASHION_MNIST_MPI
  std::optional<distopt::mpi_session> session;  // --comm mpi: after the command line is checked
#endif
  bool writer = true;  // prints the plot; with --comm mpi only rank 0
  try {
    fmnist::config cfg = parse_args(argc, argv);
    fmnist::history (*train)(const fmnist::config&) = nullptr;
    if (cfg.optimizer == "sgd") train = fmnist::train_sgd;
    else if (cfg.optimizer == "adam") train = fmnist::train_adam;
    else if (cfg.optimizer == "adamw") train = fmnist::train_adamw;
    else if (cfg.optimizer == "lion") train = fmnist::train_lion;
    else if (cfg.optimizer == "lamb") train = fmnist::train_lamb;
    else if (cfg.optimizer == "adafactor") train = fmnist::train_adafactor;
    else if (cfg.optimizer == "came") train = fmnist::train_came;
    else if (cfg.optimizer == "galore_adamw") {
#ifdef DISTOPT_FASHION_MNIST_GALORE
      train = fmnist::train_galore_adamw;
#else
      throw fmnist::usage_error("--optimizer galore_adamw: this distopt-fashion-mnist was built without LAPACK");
#endif
    } else if (cfg.optimizer == "muon") {
#ifdef DISTOPT_FASHION_MNIST_GALORE
      train = fmnist::train_muon;
#else
      throw fmnist::usage_error("--optimizer muon: this distopt-fashion-mnist was built without BLAS/LAPACK");
#endif
    } else
      throw fmnist::usage_error("--optimizer: unknown optimizer '" + cfg.optimizer +
                                "' (sgd, adam, adamw, lion, lamb, adafactor, came, galore_adamw or muon)");
#ifdef DISTOPT_FASHION_MNIST_CUDA
    if (cfg.backend == "cuda") train = fmnist::train_cuda;
#endif

    int ranks = std::max(cfg.ranks, 1), ranks_here = ranks * cfg.tp;
#ifdef DISTOPT_FASHION_MNIST_MPI
    if (cfg.comm == "mpi") {
      session.emplace(argc, argv);
      const distopt::mpi world(MPI_COMM_WORLD);
      ranks = world.size();
      writer = world.rank() == 0;
      ranks_here = mpi_processes_here();
    }
#endif
    cfg.threads = threads_per_rank(cfg.threads, ranks_here);
    // BLAS and distopt take turns on a rank, never run at once, so both get all its threads.
    openblas_set_num_threads(cfg.threads);

#ifdef DISTOPT_FASHION_MNIST_KOKKOS
    // --backend kokkos: Kokkos is initialised for the training only (the optimizer is
    // destroyed before finalize).
    std::optional<Kokkos::ScopeGuard> kokkos;
    if (cfg.backend == "kokkos") kokkos.emplace();
#endif
    fmnist::history h;
    try {
      h = train(cfg);
    } catch (const fmnist::usage_error&) {
      throw;  // refused before training: every process knows (see train_mpi)
    } catch (const fmnist::refused_elsewhere&) {
      throw;
    } catch (const std::exception& e) {
#ifdef DISTOPT_FASHION_MNIST_MPI
      // The other processes may be waiting for this one in a collective: end them all.
      if (session && ranks > 1) {
        int rank = -1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        std::cerr << "distopt-fashion-mnist: error on rank " << rank << ": " << e.what() << std::endl;
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
#endif
      throw;
    }

    if (writer && !cfg.plot_path.empty()) {
      std::string title = "Fashion-MNIST MLP, distopt " + cfg.optimizer + " (" + cfg.param_dtype + " params";
      if (ranks > 1) title += ", " + std::to_string(ranks) + " ranks";
      if (cfg.tp > 1) title += ", TP " + std::to_string(cfg.tp);
      fmnist::write_plot(cfg.plot_path, title + ")", h);
      std::cout << "plot: " << cfg.plot_path << "\n";
    }
    return 0;
  } catch (const fmnist::usage_error& e) {
    std::cerr << "distopt-fashion-mnist: " << e.what() << std::endl;
    return 2;
  } catch (const fmnist::refused_elsewhere&) {
    return 2;  // the rank that refused printed why
  } catch (const std::exception& e) {
    std::cerr << "distopt-fashion-mnist: error: " << e.what() << std::endl;
    return 1;
  }
}
