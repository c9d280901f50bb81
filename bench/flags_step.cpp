// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-flags: the step as a user's build compiles it. bench/flags/run.sh builds this
// one file with each compiler and optimisation level a user picks (GCC and Clang; -O2, -O3,
// CMake's RelWithDebInfo) and the usage requirements of distopt::distopt, links each build
// with the same plain loop (plain_loops.cpp, -O3 -march=native), and runs them in turn.
// Prints one JSON line per case:
//   {"build": LABEL, "case": ..., "ns_per_param": ..., "bytes_per_param": ..., "gbps": ...}
// and the plain AdamW loop as case "plain_adamw" (28 B per param; the default step reads
// the grads once more, for its finite check: 32 B). "digest" hashes the params after the
// timed steps: every build must print the same one per case (run.sh checks).
//
//   distopt-bench-flags LABEL [--params N] [--repeats R]

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "plain_loops.hpp"
#include "step_bench.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: distopt-bench-flags LABEL [--params N] [--repeats R]\n");
    return 2;
  }
  const std::string label = argv[1];
  bench::settings s;
  s.params = std::size_t{16} << 20;
  s.threads = 1;
  s.repeats = 5;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--params") s.params = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--repeats") s.repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "distopt-bench-flags: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (s.params < 4096 || s.repeats < 1) {
    std::fprintf(stderr, "distopt-bench-flags: --params must be at least 4096 and --repeats at least 1\n");
    return 2;
  }
  using bench::checks;
  using distopt::bf16;
  std::vector<std::pair<std::string, bench::row>> rows;
  const distopt::adamw::hyper_params adamw{};
  distopt::sgd::hyper_params sgd{};
  sgd.momentum = 0.9;
  const distopt::lion::hyper_params lion{};
  // The default step: default options (the exact norm and finite check read the grads first).
  rows.emplace_back("adamw fp32 default", bench::measure<distopt::adamw, float, float, float>(s, adamw, "", true, checks::defaults));
  rows.emplace_back("adamw fp32", bench::measure<distopt::adamw, float, float, float>(s, adamw, ""));
  rows.emplace_back("adamw bf16+master", bench::measure<distopt::adamw, float, bf16, bf16>(s, adamw, ""));
  rows.emplace_back("lion fp32", bench::measure<distopt::lion, float, float, float>(s, lion, ""));
  rows.emplace_back("lion bf16+master", bench::measure<distopt::lion, float, bf16, bf16>(s, lion, ""));
  rows.emplace_back("sgd fp32", bench::measure<distopt::sgd, float, float, float>(s, sgd, ""));
  rows.emplace_back("sgd bf16+master", bench::measure<distopt::sgd, float, bf16, bf16>(s, sgd, ""));
  rows.emplace_back("q8 adamw fp32", bench::measure<distopt::adamw, distopt::q8, float, float>(s, adamw, ""));
  rows.emplace_back("q8 adamw bf16+master", bench::measure<distopt::adamw, distopt::q8, bf16, bf16>(s, adamw, ""));
  for (const auto& [name, r] : rows)
    std::printf("{\"build\": \"%s\", \"case\": \"%s\", \"ns_per_param\": %.4f, \"bytes_per_param\": %.2f, \"gbps\": %.2f, "
                "\"digest\": \"%016llx\"}\n",
                label.c_str(), name.c_str(), r.ns_per_param, r.bytes_per_param, r.gbps,
                static_cast<unsigned long long>(r.digest));
  const double plain = bench::plain_adamw_ns(s.params, 1, s.repeats);
  std::printf("{\"build\": \"%s\", \"case\": \"plain_adamw\", \"ns_per_param\": %.4f, \"bytes_per_param\": 28.00, \"gbps\": %.2f}\n",
              label.c_str(), plain, 28.0 / plain);
}
