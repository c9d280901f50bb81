// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-step: time one optimizer step per (policy, param dtype, grad dtype, state
// encoding) over N parameters in GPT-like tensor sizes, and compare its bandwidth with a
// plain stream kernel of the same access shape (same arrays read, written back in place),
// measured in the same run. Prints a table, then JSON lines.
//
//   distopt-bench-step [--params N] [--threads T] [--repeats R]

#include <distopt/distopt.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct settings {
  std::size_t params = std::size_t{64} << 20;
  int threads = 0;
  int repeats = 5;
};

/// GPT-like tensors: a few big matrices, many layer matrices, small vectors, until n.
distopt::layout gpt_like(std::size_t n, distopt::dtype t) {
  distopt::layout l;
  const std::int64_t d = 1024;
  std::size_t total = 0;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
    std::size_t numel = 1;
    for (auto s : shape) numel *= static_cast<std::size_t>(s);
    if (total + numel > n) return false;
    l.add(name, std::move(shape), t);
    total += numel;
    return true;
  };
  add("wte", {8192, d});
  for (int i = 0; total < n; ++i) {
    const std::string p = "h" + std::to_string(i) + ".";
    if (!add(p + "ln1", {d}) || !add(p + "qkv", {3 * d, d}) || !add(p + "qkv.bias", {3 * d}) ||
        !add(p + "proj", {d, d}) || !add(p + "ln2", {d}) || !add(p + "fc", {4 * d, d}) ||
        !add(p + "fc.bias", {4 * d}) || !add(p + "fc_proj", {d, 4 * d}))
      break;
  }
  if (total < n) l.add("rest", {static_cast<std::int64_t>(n - total)}, t);
  return l;
}

template <class F>
double best_seconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = clock_type::now();
    f();
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  return best;
}

/// One fused pass: every element of `rw` arrays read and written in place, one array read.
template <int RW>
void stream_pass(float* const* a, const float* __restrict__ g, std::size_t b, std::size_t e) {
  float* __restrict__ a0 = a[0];
  float* __restrict__ a1 = a[RW > 1 ? 1 : 0];
  float* __restrict__ a2 = a[RW > 2 ? 2 : 0];
  float* __restrict__ a3 = a[RW > 3 ? 3 : 0];
  for (std::size_t i = b; i < e; ++i) {
    const float x = g[i];
    a0[i] = a0[i] * 0.999f + x;
    if constexpr (RW > 1) a1[i] = a1[i] * 0.999f + x;
    if constexpr (RW > 2) a2[i] = a2[i] * 0.999f + x;
    if constexpr (RW > 3) a3[i] = a3[i] * 0.999f + x;
  }
}

/// The roofline: `rw` float arrays read and written in place plus one read-only array in
/// one fused pass, the access shape of an optimizer step, over the same executor and chunks.
double stream_gbps(distopt::cpu& exec, std::size_t n, int rw, int repeats) {
  std::vector<float*> arrays(static_cast<std::size_t>(rw) + 1);
  for (auto& a : arrays) a = static_cast<float*>(exec.allocate_bytes(n * sizeof(float)));
  constexpr std::size_t chunk = 1 << 14;
  const std::size_t chunks = (n + chunk - 1) / chunk;
  auto run = [&] {
    exec.parallel_for(chunks, [&](std::size_t c) {
      const std::size_t b = c * chunk, e = std::min(n, b + chunk);
      float* const* a = arrays.data() + 1;
      if (rw == 1) stream_pass<1>(a, arrays[0], b, e);
      else if (rw == 2) stream_pass<2>(a, arrays[0], b, e);
      else if (rw == 3) stream_pass<3>(a, arrays[0], b, e);
      else stream_pass<4>(a, arrays[0], b, e);
    });
  };
  run();
  const double s = best_seconds(repeats, run);
  for (auto& a : arrays) exec.deallocate_bytes(a, n * sizeof(float));
  return double(n) * sizeof(float) * (2 * rw + 1) / s / 1e9;
}

struct row {
  std::string policy, param, grad, state;
  double ns_per_param, bytes_per_param, gbps, ceiling_gbps;
};

template <class Policy, class State, class Param, class Grad>
row bench_case(const settings& s, const std::vector<double>& ceiling) {
  using opt_t = distopt::optimizer<Policy, distopt::replicated<State>, distopt::single,
                                   distopt::cpu, distopt::precision<Param, Grad>>;
  typename Policy::hyper_params h;
  distopt::optimizer_options o;
  o.check_finite = false;  // the update pass alone; the norm pass is a separate read of grads
  opt_t opt(gpt_like(s.params, distopt::dtype_of<Param>), h, o, distopt::cpu(s.threads));
  for (auto& g : opt.grads()) g = distopt::from_float<Grad>(1e-3f);
  opt.step();
  const double secs = best_seconds(s.repeats, [&] { opt.step(); });
  const auto mem = opt.memory();
  const int slots = static_cast<int>(mem.entries[3].bytes / opt.tensors().size() / sizeof(State));
  const bool master = mem.entries[2].bytes != 0;
  const double bytes = 2.0 * sizeof(Param) + sizeof(Grad) + (master ? 8.0 : 0.0) +
                       2.0 * slots * sizeof(State);
  const double n = static_cast<double>(opt.tensors().numel());
  return {std::string(Policy::name), std::string(distopt::dtype_name(distopt::dtype_of<Param>)),
          std::string(distopt::dtype_name(distopt::dtype_of<Grad>)),
          std::string(distopt::dtype_name(distopt::dtype_of<State>)), secs / n * 1e9, bytes,
          n * bytes / secs / 1e9, ceiling.at(static_cast<std::size_t>(1 + master + slots))};
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i];
    if (a == "--params") s.params = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--threads") s.threads = std::atoi(argv[i + 1]);
    else if (a == "--repeats") s.repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "distopt-bench-step: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  distopt::cpu exec(s.threads);
  std::printf("distopt-bench-step: %zu params, %d threads, best of %d\n", s.params,
              exec.concurrency(), s.repeats);
  std::vector<double> ceiling(5);  // by arrays read and written in place: param, master, slots
  for (int rw = 1; rw <= 4; ++rw) {
    ceiling[rw] = stream_gbps(exec, s.params, rw, s.repeats);
    std::printf("stream ceiling, %d arrays read+written + 1 read: %.1f GB/s (%d threads)\n", rw,
                ceiling[rw], exec.concurrency());
  }
  distopt::cpu one(1);
  std::printf("stream ceiling, 3 arrays read+written + 1 read: %.1f GB/s (1 thread)\n",
              stream_gbps(one, s.params, 3, s.repeats));

  std::vector<row> rows;
  using distopt::bf16;
  rows.push_back(bench_case<distopt::sgd, float, float, float>(s, ceiling));
  rows.push_back(bench_case<distopt::lion, float, float, float>(s, ceiling));
  rows.push_back(bench_case<distopt::adam, float, float, float>(s, ceiling));
  rows.push_back(bench_case<distopt::adamw, float, float, float>(s, ceiling));
  rows.push_back(bench_case<distopt::adamw, bf16, float, float>(s, ceiling));
  rows.push_back(bench_case<distopt::adamw, float, bf16, bf16>(s, ceiling));
  rows.push_back(bench_case<distopt::adamw, bf16, bf16, bf16>(s, ceiling));

  std::printf("\n%-6s %-5s %-5s %-5s %9s %9s %8s %8s %6s\n", "policy", "param", "grad", "state",
              "ns/param", "B/param", "GB/s", "ceiling", "ratio");
  for (const auto& r : rows)
    std::printf("%-6s %-5s %-5s %-5s %9.3f %9.1f %8.1f %8.1f %6.2f\n", r.policy.c_str(),
                r.param.c_str(), r.grad.c_str(), r.state.c_str(), r.ns_per_param,
                r.bytes_per_param, r.gbps, r.ceiling_gbps, r.gbps / r.ceiling_gbps);
  std::printf("\n");
  for (const auto& r : rows)
    std::printf("{\"bench\":\"step\",\"policy\":\"%s\",\"param\":\"%s\",\"grad\":\"%s\",\"state\":\"%s\","
                "\"params\":%zu,\"threads\":%d,\"ns_per_param\":%.4f,\"bytes_per_param\":%.1f,"
                "\"gbps\":%.2f,\"ceiling_gbps\":%.2f}\n",
                r.policy.c_str(), r.param.c_str(), r.grad.c_str(), r.state.c_str(), s.params,
                exec.concurrency(), r.ns_per_param, r.bytes_per_param, r.gbps, r.ceiling_gbps);
}
