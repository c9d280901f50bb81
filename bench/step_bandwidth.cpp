// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-step: one optimizer step per (policy, param dtype, grad dtype, state
// encoding) over N parameters in GPT-like tensors, against a plain stream kernel of the
// same access shape (the same arrays read, written back in place) measured in the same
// run, twice: over distopt's thread pool and chunks, and as a plain OpenMP loop compiled
// -march=native (plain_loops.cpp); the ratio is taken against the faster of the two. Also
// times a plain OpenMP AdamW loop, the bar for the AdamW rows. Prints a table, then one
// JSON line per case.
//
//   distopt-bench-step [--params N] [--threads T] [--repeats R] [--only POLICY] [--evict MIB]
//
// --evict MIB writes MIB MiB before each timed run (every row, the ceilings too): the arrays
// then come from memory, as in a training step after the model's passes.
//
// The ceilings are measured first, and again beside every row: after each of the row's
// timed steps, one run of the stream kernel of its access shape over the same pool
// ("beside"). This VM's bandwidth drifts by up to 40 % over a minute; a row and the
// ceiling timed in turn with it see the same moments, and their ratio ("r/beside") is the
// figure to read. "ratio" holds the row against the ceilings of the run's start. The
// kernel's six arrays stay allocated for the whole run (24 B per param: 1.5 GiB at 64 Mi),
// beside each row's optimizer.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "plain_loops.hpp"
#include "step_bench.hpp"
#include "stream_kernel.hpp"

namespace {

/// The roofline: `rw` fp32 arrays read and written in place plus one read-only array in one
/// fused pass, over the same executor and chunk size as the optimizer. Bytes over seconds.
/// The stream kernel's arrays over n floats: one read, up to five read and written.
struct stream_arrays {
  distopt::cpu& exec;
  std::size_t n;
  std::vector<float*> a;
  stream_arrays(distopt::cpu& e, std::size_t count) : exec(e), n(count), a(6) {
    for (auto& p : a) p = static_cast<float*>(exec.allocate_bytes(n * sizeof(float)));
  }
  ~stream_arrays() {
    for (auto& p : a) exec.deallocate_bytes(p, n * sizeof(float));
  }
  stream_arrays(const stream_arrays&) = delete;
  stream_arrays& operator=(const stream_arrays&) = delete;

  /// GB/s of the best of `repeats` passes with `rw` arrays read and written, over the pool
  /// and chunks of the optimizer.
  double gbps(int rw, int repeats) {
    constexpr std::size_t chunk = 1 << 14;
    const std::size_t chunks = (n + chunk - 1) / chunk;
    const double s = bench::best_seconds(repeats, [&] {
      exec.parallel_for(chunks, [&](std::size_t c) {
        const std::size_t b = c * chunk, e = std::min(n, b + chunk);
        bench::stream_pass(rw, a.data() + 1, a[0], b, e);
      });
    });
    return double(n) * sizeof(float) * (2 * rw + 1) / s / 1e9;
  }
};

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-step: %s\nusage: distopt-bench-step [--params N] [--threads T] "
               "[--repeats R] [--only sgd|adam|adamw|lion] [--evict MIB]\n",
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
    else if (a == "--evict") bench::evict_bytes() = std::strtoull(v, nullptr, 10) << 20;
    else return usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.params == 0 || s.repeats < 1 || s.threads < 0) return usage("invalid value");
  distopt::cpu exec(s.threads);
  s.threads = exec.concurrency();
  std::printf("distopt-bench-step: %zu params, %d threads, best of %d repeats", s.params, s.threads, s.repeats);
  if (bench::evict_bytes()) std::printf(", %zu MiB written before each", bench::evict_bytes() >> 20);
  std::printf("\n");
  std::vector<double> ours(6), plain(6), ceiling(6);
  stream_arrays stream(exec, s.params);
  stream.gbps(5, 1);  // the pages touched
  s.beside = [&](int rw) { return stream.gbps(rw, 1); };
  for (int rw = 1; rw <= 5; ++rw) {
    ours[rw] = stream.gbps(rw, s.repeats);
    plain[rw] = bench::plain_stream_gbps(s.params, rw, s.threads, s.repeats);
    ceiling[rw] = std::max(ours[rw], plain[rw]);
    std::printf("ceiling: %d arrays read+written + 1 read: %.1f GB/s (distopt's pool %.1f, plain OpenMP -march=native %.1f)\n",
                rw, ceiling[rw], ours[rw], plain[rw]);
  }
  const double plain_adamw = bench::plain_adamw_ns(s.params, s.threads, s.repeats);
  std::printf("plain OpenMP AdamW loop, -O3 -march=native -fno-math-errno: %.3f ns/param, %.1f GB/s\n",
              plain_adamw, 28.0 / plain_adamw);
  std::fflush(stdout);

  std::vector<bench::row> rows;
  if (only.empty() || only == "sgd") bench::run_sgd(s, rows);
  if (only.empty() || only == "adam") bench::run_adam(s, rows);
  if (only.empty() || only == "adamw") bench::run_adamw(s, rows);
  if (only.empty() || only == "lion") bench::run_lion(s, rows);
  if (rows.empty()) return usage("--only: unknown policy");

  // The AdamW rows with fp32 params, grads and states are also held against the plain loop.
  const auto vs_plain = [&](const bench::row& r) {
    return r.policy == "adamw" && r.param == "fp32" && r.grad == "fp32" && r.state == "fp32" ? r.ns_per_param / plain_adamw
                                                                                          : 0.0;
  };
  std::printf("\n%-6s %-13s %-6s %-12s %-5s %-5s %9s %8s %7s %8s %6s %6s %7s %8s %6s\n", "policy", "options",
              "check", "param", "grad", "state", "ns/param", "B/param", "GB/s", "ceiling", "ratio", "/pool", "beside",
              "r/beside", "/loop");
  for (const auto& r : rows) {
    const double vp = vs_plain(r);
    std::printf("%-6s %-13s %-6s %-12s %-5s %-5s %9.3f %8.1f %7.1f %8.1f %6.2f %6.2f %7.1f %8.2f ", r.policy.c_str(),
                r.options.empty() ? "-" : r.options.c_str(), r.finite_check ? "on" : "off", r.param.c_str(),
                r.grad.c_str(), r.state.c_str(), r.ns_per_param, r.bytes_per_param, r.gbps, ceiling[r.rw_arrays],
                r.gbps / ceiling[r.rw_arrays], r.gbps / ours[r.rw_arrays], r.beside_gbps, r.gbps / r.beside_gbps);
    if (vp > 0) std::printf("%6.2f\n", vp);
    else std::printf("%6s\n", "-");
  }
  std::printf("\n(ratio: GB/s over the ceiling; /pool: over distopt's own stream kernel; beside: that kernel\n"
              "timed in turn with the row's steps; r/beside: GB/s over it; /loop: time over the plain OpenMP\n"
              "AdamW loop's, for the fp32 AdamW rows)\n\n");
  std::printf("{\"bench\":\"step-plain\",\"params\":%zu,\"threads\":%d,\"adamw_ns_per_param\":%.4f", s.params,
              s.threads, plain_adamw);
  for (int rw = 1; rw <= 5; ++rw) std::printf(",\"stream%d_gbps\":%.2f,\"pool%d_gbps\":%.2f", rw, plain[rw], rw, ours[rw]);
  std::printf("}\n");
  for (const auto& r : rows)
    std::printf(
        "{\"bench\":\"step\",\"policy\":\"%s\",\"options\":\"%s\",\"finite_check\":%s,\"param\":\"%s\","
        "\"grad\":\"%s\",\"state\":\"%s\",\"params\":%zu,\"threads\":%d,\"ns_per_param\":%.4f,"
        "\"bytes_per_param\":%.1f,\"gbps\":%.2f,\"ceiling_gbps\":%.2f,\"ratio\":%.3f,\"pool_ratio\":%.3f,"
        "\"beside_gbps\":%.2f,\"beside_ratio\":%.3f,\"over_plain_adamw\":%.3f}\n",
        r.policy.c_str(), r.options.c_str(), r.finite_check ? "true" : "false", r.param.c_str(), r.grad.c_str(),
        r.state.c_str(), s.params, s.threads, r.ns_per_param, r.bytes_per_param, r.gbps, ceiling[r.rw_arrays],
        r.gbps / ceiling[r.rw_arrays], r.gbps / ours[r.rw_arrays], r.beside_gbps, r.gbps / r.beside_gbps,
        vs_plain(r));
}
