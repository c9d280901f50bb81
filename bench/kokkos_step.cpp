// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-kokkos: one optimizer step through the Kokkos executor against the CPU
// executor with the same number of threads (the Kokkos space's concurrency), same tensors,
// same run, alternating the two so that drifts of a shared machine hit both. Prints
// ns/param, GB/s (bytes model of distopt-bench-step) and the time ratio kokkos / cpu;
// JSON lines with --json. Results and commands: RESULTS.md ("Kokkos executor").

#include <distopt/exec/kokkos.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "step_bench.hpp"

namespace {

struct pair_row {
  bench::row cpu, kokkos;
};

template <class Policy, class State, class Param, class Grad>
pair_row both(const bench::settings& s, int rounds, const typename Policy::hyper_params& h, const std::string& options) {
  pair_row best;
  for (int r = 0; r < rounds; ++r) {
    const bench::row c = bench::measure<Policy, State, Param, Grad>(s, h, options);
    const bench::row k = bench::measure_on<Policy, State, Param, Grad>(distopt::kokkos<>{}, s, h, options);
    if (r == 0 || c.ns_per_param < best.cpu.ns_per_param) best.cpu = c;
    if (r == 0 || k.ns_per_param < best.kokkos.ns_per_param) best.kokkos = k;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard scope(argc, argv);  // takes Kokkos's own flags (--kokkos-num-threads=N)
  bench::settings s;
  s.repeats = 3;
  int rounds = 2;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kokkos", 0) == 0) continue;
    if (i + 1 >= argc) {
      std::fprintf(stderr, "distopt-bench-kokkos: missing value after %s\n", a.c_str());
      return 2;
    }
    const std::string v = argv[++i];
    try {
      if (a == "--params") s.params = std::stoull(v);
      else if (a == "--repeats") s.repeats = std::stoi(v);
      else if (a == "--rounds") rounds = std::stoi(v);
      else if (a == "--json") json = v;
      else throw std::invalid_argument(a);
    } catch (const std::logic_error&) {
      std::fprintf(stderr,
                   "distopt-bench-kokkos: bad option %s %s\nusage: distopt-bench-kokkos [--params N] [--repeats R] "
                   "[--rounds K] [--json FILE] [Kokkos flags]\n",
                   a.c_str(), v.c_str());
      return 2;
    }
  }
  s.threads = distopt::kokkos<>{}.concurrency();
  std::printf("distopt-bench-kokkos: %zu params, space %s (Kokkos %d), %d threads for both executors, best of %d x %d\n",
              s.params, Kokkos::DefaultHostExecutionSpace::name(), KOKKOS_VERSION, s.threads, rounds, s.repeats);
  using distopt::bf16;
  distopt::sgd::hyper_params momentum;
  momentum.momentum = 0.9;
  const distopt::adamw::hyper_params w{};
  const distopt::lion::hyper_params li{};
  std::vector<pair_row> rows;
  rows.push_back(both<distopt::sgd, float, float, float>(s, rounds, momentum, "momentum=0.9"));
  rows.push_back(both<distopt::adamw, float, float, float>(s, rounds, w, "-"));
  rows.push_back(both<distopt::adamw, float, bf16, bf16>(s, rounds, w, "-"));
  rows.push_back(both<distopt::lion, float, float, float>(s, rounds, li, "-"));
  rows.push_back(both<distopt::adamw, distopt::q8, float, float>(s, rounds, w, "-"));
  std::printf("%-6s %-13s %-12s %-5s %-5s %8s %10s %8s %10s %8s %8s\n", "policy", "options", "param", "grad", "state",
              "B/param", "cpu ns/p", "GB/s", "kokkos ns/p", "GB/s", "k/cpu");
  std::ofstream out;
  if (!json.empty()) out.open(json, std::ios::app);
  for (const auto& [c, k] : rows) {
    std::printf("%-6s %-13s %-12s %-5s %-5s %8.2f %10.3f %8.1f %10.3f %8.1f %8.2f\n", c.policy.c_str(),
                c.options.c_str(), c.param.c_str(), c.grad.c_str(), c.state.c_str(), c.bytes_per_param, c.ns_per_param,
                c.gbps, k.ns_per_param, k.gbps, k.ns_per_param / c.ns_per_param);
    if (out)
      out << "{\"bench\":\"kokkos-step\",\"space\":\"" << Kokkos::DefaultHostExecutionSpace::name()
          << "\",\"kokkos_version\":" << KOKKOS_VERSION << ",\"threads\":" << s.threads << ",\"policy\":\""
          << c.policy << "\",\"param\":\"" << c.param << "\",\"grad\":\"" << c.grad << "\",\"state\":\"" << c.state
          << "\",\"bytes_per_param\":" << c.bytes_per_param << ",\"cpu_ns_per_param\":" << c.ns_per_param
          << ",\"kokkos_ns_per_param\":" << k.ns_per_param << "}\n";
  }
  return 0;
}
