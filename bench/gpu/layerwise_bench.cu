// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-gpu-layerwise: optimizer<Policy, replicated<fp32>, single, cuda>::step() for
// the layer-wise policies (lamb, adafactor, came) over the GPT-like tensors of
// distopt-bench-layerwise (width 1,024, as many layers as --params allows), beside AdamW on
// the same tensors, against the device's copy bandwidth measured in the same run. fp32
// params and grads, and bf16 params and grads with fp32 master weights; default options.
// Bytes per parameter come from each policy's phases (bench/layerwise_bench.hpp, the CPU
// benchmark's model): every pass reads the grad, what it reads and writes of the param and
// the state slots the tensor keeps. A step's time is the host's wall clock around step()
// and a stream synchronisation, best of --repeats after a warm-up. JSON lines with --json.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../layerwise_bench.hpp"
#include "cli.hpp"
#include "timing.hpp"

namespace {

namespace ce = distopt::cuda_exec;

using gpu_bench::best_seconds;

struct row {
  std::string policy, precision;
  double bytes_per_param, seconds, params;
};

/// Bytes per parameter of one step: the sum over the policy's passes (layer-wise) or one
/// fused pass (element-wise), over factored and unfactored tensors.
template <class Policy>
double step_bytes(const distopt::layout& l, const typename Policy::hyper_params& h, const lwbench::number_sizes& z) {
  const double n = static_cast<double>(l.numel());
  if constexpr (distopt::policy_is_layerwise<Policy>) {
    const auto by_class = lwbench::numel_by_class<Policy>(l, h);
    double bytes = 0;
    for (std::size_t p = 0; p < Policy::phases.size(); ++p)
      for (int f = 0; f < 2; ++f) bytes += by_class[f] * lwbench::phase_access<Policy>(h, p, f, z).bytes;
    return bytes / n;
  } else {
    return lwbench::elementwise_access(Policy::state_slots(h), z).bytes;
  }
}

template <class Policy, class Param, class Grad>
row run_case(const gpu_bench::options& o, int layers, cudaStream_t stream) {
  using opt_t = distopt::optimizer<Policy, distopt::replicated<distopt::fp32>, distopt::single, distopt::cuda,
                                   distopt::precision<Param, Grad>>;
  const typename Policy::hyper_params h{};
  const distopt::layout l = lwbench::gpt_layers(layers, 1024, distopt::dtype_of<Param>);
  distopt::optimizer_options opts;
  opts.check_finite = false;  // as distopt-bench-layerwise: the norm pass is measured elsewhere
  opt_t opt(l, h, opts, distopt::cuda(0, stream));
  const std::vector<Grad> g(opt.grads().size(), distopt::from_float<Grad>(1e-3f));
  distopt::upload(opt.executor(), g, opt.grads());
  const std::string prec = !std::is_same_v<Param, float>
                               ? std::string(distopt::dtype_name(distopt::dtype_of<Param>)) + "+master"
                               : "fp32";
  std::printf("  %s %s ...", std::string(Policy::name).c_str(), prec.c_str());
  std::fflush(stdout);
  const double secs = best_seconds(o.repeats, stream, [&] { opt.step(); });
  std::printf(" %.1f ms\n", secs * 1e3);
  constexpr bool master = !std::is_same_v<Param, float>;
  lwbench::number_sizes z;
  z.grad = sizeof(Grad);
  z.param = sizeof(Param);
  z.master = master;
  return {std::string(Policy::name), prec, step_bytes<Policy>(l, h, z), secs, static_cast<double>(l.numel())};
}

}  // namespace

int main(int argc, char** argv) {
  const gpu_bench::options o = gpu_bench::parse("distopt-bench-gpu-layerwise", argc, argv, 5);
  const cudaDeviceProp prop = gpu_bench::device_or_exit("distopt-bench-gpu-layerwise");
  try {
    cudaStream_t stream;
    ce::check(cudaStreamCreate(&stream), "cudaStreamCreate");
    // One layer of width 1,024 holds 12.6 M params, the embedding 8.4 M.
    const int layers = static_cast<int>(std::max<std::size_t>(1, o.params / 12'600'000));
    const std::size_t copy_bytes = lwbench::gpt_layers(layers, 1024, distopt::dtype::f32).numel() * sizeof(float);
    const double copy_gbps = gpu_bench::copy_gbps(copy_bytes, o.repeats, stream);
    std::printf("device: %s; copy %.0f GB/s; GPT-like tensors, %d layers of width 1024\n", prop.name, copy_gbps,
                layers);

    // DISTOPT_BENCH_ONLY=<policy>: that policy's rows alone (e.g. under a profiler).
    const char* only_env = std::getenv("DISTOPT_BENCH_ONLY");
    const std::string only = only_env ? only_env : "";
    const auto wanted = [&](const char* name) { return only.empty() || only == name; };
    std::vector<row> rows;
    if (wanted("adamw")) rows.push_back(run_case<distopt::adamw, float, float>(o, layers, stream));
    if (wanted("lamb")) rows.push_back(run_case<distopt::lamb, float, float>(o, layers, stream));
    if (wanted("adafactor")) rows.push_back(run_case<distopt::adafactor, float, float>(o, layers, stream));
    if (wanted("came")) rows.push_back(run_case<distopt::came, float, float>(o, layers, stream));
    if (wanted("adafactor")) rows.push_back(run_case<distopt::adafactor, distopt::bf16, distopt::bf16>(o, layers, stream));
    if (wanted("came")) rows.push_back(run_case<distopt::came, distopt::bf16, distopt::bf16>(o, layers, stream));
    if (rows.empty()) throw std::invalid_argument("DISTOPT_BENCH_ONLY: no policy '" + only + "'");

    std::printf("%-10s %-12s %8s %10s %8s %6s %10s\n", "policy", "params", "B/param", "ns/param", "GB/s", "ratio",
                "x adamw");
    std::ofstream json = gpu_bench::open_json(o.json);
    for (const row& r : rows) {
      const double ns = r.seconds / r.params * 1e9, gbps = r.bytes_per_param * r.params / r.seconds * 1e-9;
      std::printf("%-10s %-12s %8.1f %10.4f %8.0f %6.3f %10.1f\n", r.policy.c_str(), r.precision.c_str(),
                  r.bytes_per_param, ns, gbps, gbps / copy_gbps, r.seconds / rows[0].seconds);
      if (json)
        json << "{\"bench\":\"gpu-layerwise-step\",\"impl\":\"distopt\",\"device\":\"" << prop.name
             << "\",\"policy\":\"" << r.policy << "\",\"model\":\"gpt-like\",\"layers\":" << layers
             << ",\"precision\":\"" << r.precision << "\",\"check\":\"off\",\"params\":" << r.params
             << ",\"bytes_per_param\":" << r.bytes_per_param << ",\"ns_per_param\":" << ns << ",\"gbps\":" << gbps
             << ",\"copy_gbps\":" << copy_gbps << ",\"ratio\":" << gbps / copy_gbps << "}\n";
    }
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt-bench-gpu-layerwise: %s\n", e.what());
    return 1;
  }
  return 0;
}
