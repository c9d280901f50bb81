// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-step: one optimizer step per (policy, param dtype, grad dtype, state
// encoding) over N parameters in GPT-like tensors, against a plain stream kernel of the
// same access shape (the same arrays read, written back in place) measured in the same
// run. Prints a table, then one JSON line per case.
//
//   distopt-bench-step [--params N] [--threads T] [--repeats R] [--only POLICY]

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "step_bench.hpp"

namespace {

/// One fused pass: `RW` arrays read and written in place, one array read.
template <int RW>
void stream_pass(float* const* a, const float* __restrict__ g, std::size_t b, std::size_t e) {
  float* __restrict__ a0 = a[0];
  float* __restrict__ a1 = a[RW > 1 ? 1 : 0];
  float* __restrict__ a2 = a[RW > 2 ? 2 : 0];
  float* __restrict__ a3 = a[RW > 3 ? 3 : 0];
  float* __restrict__ a4 = a[RW > 4 ? 4 : 0];
  for (std::size_t i = b; i < e; ++i) {
    const float x = g[i];
    a0[i] = a0[i] * 0.999f + x;
    if constexpr (RW > 1) a1[i] = a1[i] * 0.999f + x;
    if constexpr (RW > 2) a2[i] = a2[i] * 0.999f + x;
    if constexpr (RW > 3) a3[i] = a3[i] * 0.999f + x;
    if constexpr (RW > 4) a4[i] = a4[i] * 0.999f + x;
  }
}

/// The roofline: `rw` fp32 arrays read and written in place plus one read-only array in one
/// fused pass, over the same executor and chunk size as the optimizer. Bytes over seconds.
double stream_gbps(distopt::cpu& exec, std::size_t n, int rw, int repeats) {
  std::vector<float*> arrays(static_cast<std::size_t>(rw) + 1);
  for (auto& a : arrays) a = static_cast<float*>(exec.allocate_bytes(n * sizeof(float)));
  constexpr std::size_t chunk = 1 << 14;
  const std::size_t chunks = (n + chunk - 1) / chunk;
  auto run = [&] {
    exec.parallel_for(chunks, [&](std::size_t c) {
      const std::size_t b = c * chunk, e = std::min(n, b + chunk);
      float* const* a = arrays.data() + 1;
      switch (rw) {
        case 1: stream_pass<1>(a, arrays[0], b, e); break;
        case 2: stream_pass<2>(a, arrays[0], b, e); break;
        case 3: stream_pass<3>(a, arrays[0], b, e); break;
        case 4: stream_pass<4>(a, arrays[0], b, e); break;
        default: stream_pass<5>(a, arrays[0], b, e); break;
      }
    });
  };
  run();
  const double s = bench::best_seconds(repeats, run);
  for (auto& a : arrays) exec.deallocate_bytes(a, n * sizeof(float));
  return double(n) * sizeof(float) * (2 * rw + 1) / s / 1e9;
}

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-step: %s\nusage: distopt-bench-step [--params N] [--threads T] "
               "[--repeats R] [--only sgd|adam|adamw|lion]\n",
               bad);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  bench::settings s;
  std::string only;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) return usage("missing value");
    const char* v = argv[i + 1];
    if (a == "--params") s.params = std::strtoull(v, nullptr, 10);
    else if (a == "--threads") s.threads = std::atoi(v);
    else if (a == "--repeats") s.repeats = std::atoi(v);
    else if (a == "--only") only = v;
    else return usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.params == 0 || s.repeats < 1 || s.threads < 0) return usage("invalid value");
  distopt::cpu exec(s.threads);
  s.threads = exec.concurrency();
  std::printf("distopt-bench-step: %zu params, %d threads, best of %d repeats\n", s.params,
              s.threads, s.repeats);
  std::vector<double> ceiling(6);
  for (int rw = 1; rw <= 5; ++rw) {
    ceiling[rw] = stream_gbps(exec, s.params, rw, s.repeats);
    std::printf("ceiling: %d arrays read+written + 1 read: %.1f GB/s\n", rw, ceiling[rw]);
  }
  std::fflush(stdout);

  std::vector<bench::row> rows;
  if (only.empty() || only == "sgd") bench::run_sgd(s, rows);
  if (only.empty() || only == "adam") bench::run_adam(s, rows);
  if (only.empty() || only == "adamw") bench::run_adamw(s, rows);
  if (only.empty() || only == "lion") bench::run_lion(s, rows);
  if (rows.empty()) return usage("--only: unknown policy");

  std::printf("\n%-6s %-13s %-12s %-5s %-5s %9s %8s %7s %8s %6s\n", "policy", "options", "param",
              "grad", "state", "ns/param", "B/param", "GB/s", "ceiling", "ratio");
  for (const auto& r : rows)
    std::printf("%-6s %-13s %-12s %-5s %-5s %9.3f %8.1f %7.1f %8.1f %6.2f\n", r.policy.c_str(),
                r.options.empty() ? "-" : r.options.c_str(), r.param.c_str(), r.grad.c_str(),
                r.state.c_str(), r.ns_per_param, r.bytes_per_param, r.gbps, ceiling[r.rw_arrays],
                r.gbps / ceiling[r.rw_arrays]);
  std::printf("\n");
  for (const auto& r : rows)
    std::printf(
        "{\"bench\":\"step\",\"policy\":\"%s\",\"options\":\"%s\",\"param\":\"%s\",\"grad\":\"%s\","
        "\"state\":\"%s\",\"params\":%zu,\"threads\":%d,\"ns_per_param\":%.4f,"
        "\"bytes_per_param\":%.1f,\"gbps\":%.2f,\"ceiling_gbps\":%.2f,\"ratio\":%.3f}\n",
        r.policy.c_str(), r.options.c_str(), r.param.c_str(), r.grad.c_str(), r.state.c_str(),
        s.params, s.threads, r.ns_per_param, r.bytes_per_param, r.gbps, ceiling[r.rw_arrays],
        r.gbps / ceiling[r.rw_arrays]);
}
