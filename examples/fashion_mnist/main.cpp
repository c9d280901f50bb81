// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-fashion-mnist: trains an MLP classifier on Fashion-MNIST, with BLAS for the
// forward and backward passes and a distopt optimizer for the updates.

#include <cblas.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "fashion_mnist.hpp"

namespace {

constexpr const char* usage_text =
    "usage: distopt-fashion-mnist [--optimizer sgd|adam|adamw|lion] [--set KEY=VALUE]...\n"
    "                             [--epochs N] [--batch-size N] [--hidden W1,W2,...]\n"
    "                             [--param-dtype fp32|bf16] [--threads N] [--seed N]\n"
    "                             [--data DIR] [--log FILE.csv] [--plot FILE.png]\n"
    "                             [--limit N] [--clip MAX_NORM] [--normalize on|off]\n"
    "Trains an MLP (784-512-256-10, ReLU, softmax cross-entropy) on Fashion-MNIST.\n"
    "  --optimizer     default adamw; hyper-parameters by PyTorch's argument names, tuples as\n"
    "                  comma lists (--set betas=0.9,0.95). Defaults are PyTorch's (lion:\n"
    "                  lion-pytorch's, lr=1e-4) except sgd: lr=0.05 momentum=0.9. Biases get\n"
    "                  weight_decay=0.\n"
    "  --epochs        default 10             --batch-size  default 128\n"
    "  --hidden        hidden widths, default 512,256\n"
    "  --param-dtype   fp32 (default) or bf16 with fp32 master weights\n"
    "  --threads       threads of distopt and OpenBLAS, default 2 (0: one per core)\n"
    "  --seed          initialisation, shuffling and rounding seed, default 0\n"
    "  --data          directory of the idx files (gzipped or not), default\n"
    "                  /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)\n"
    "  --log           per-step CSV: step,epoch,loss\n"
    "  --plot          loss and test-accuracy curves as PNG (needs gnuplot: gnuplot-nox)\n"
    "  --limit         train on the first N samples only (all test samples are scored)\n"
    "  --clip          clip the global gradient norm (torch.nn.utils.clip_grad_norm_)\n"
    "  --normalize     scale pixels to zero mean, unit variance (default on; off: [0, 1])\n";

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
    } else if (a == "--threads") cfg.threads = parse_number<int>(a, value(), 0);
    else if (a == "--seed") cfg.seed = parse_number<std::uint64_t>(a, value(), 0);
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
      if (v == "q8") throw usage_error("--state q8: 8-bit states are not supported yet (planned)");
      if (v != "fp32")
        throw usage_error("--state " + std::string(v) + ": not supported by this example (fp32 states)");
    } else if (a == "--ranks" || a == "--backend" || a == "--checkpoint" || a == "--resume")
      throw usage_error(std::string(a) + ": not supported yet (planned in a later release)");
    else
      throw usage_error("unknown option '" + std::string(a) + "' (see --help)");
  }
  if (cfg.threads == 0) cfg.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return cfg;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const fmnist::config cfg = parse_args(argc, argv);
    fmnist::history (*train)(const fmnist::config&) = nullptr;
    if (cfg.optimizer == "sgd") train = fmnist::train_sgd;
    else if (cfg.optimizer == "adam") train = fmnist::train_adam;
    else if (cfg.optimizer == "adamw") train = fmnist::train_adamw;
    else if (cfg.optimizer == "lion") train = fmnist::train_lion;
    else
      throw fmnist::usage_error("--optimizer: unknown optimizer '" + cfg.optimizer +
                                "' (sgd, adam, adamw or lion)");
    // Output problems surface now, not after minutes of training.
    if (!cfg.plot_path.empty()) fmnist::require_gnuplot();
    for (const std::string& path : {cfg.log_path, cfg.plot_path})
      if (!path.empty() && !std::ofstream(path, std::ios::app))
        throw fmnist::usage_error(path + ": cannot write (" + std::strerror(errno) + ")");

    // BLAS and distopt take turns, never run at once, so both get every thread.
    openblas_set_num_threads(cfg.threads);
    const fmnist::history h = train(cfg);

    if (!cfg.plot_path.empty()) {
      fmnist::write_plot(cfg.plot_path,
                         "Fashion-MNIST MLP, distopt " + cfg.optimizer + " (" + cfg.param_dtype + " params)", h);
      std::cout << "plot: " << cfg.plot_path << "\n";
    }
    return 0;
  } catch (const fmnist::usage_error& e) {
    std::cerr << "distopt-fashion-mnist: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "distopt-fashion-mnist: error: " << e.what() << std::endl;
    return 1;
  }
}
