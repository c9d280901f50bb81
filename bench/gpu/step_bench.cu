// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-gpu-step: optimizer<..., distopt::cuda>::step(), the path a user runs, over
// GPT-like tensors and over many small tensors, against the device's copy bandwidth
// measured in the same run. Default options (the finite check and exact norm on) and the
// check off, so that the norm's cost shows. Bytes per parameter: the update's (each array
// read once, written once where written; with master weights the params only written)
// plus, with the check on, one more read of the grads. A step's time is the host's wall
// clock around step() and a stream synchronisation, best of --repeats after a warm-up.
// JSON lines with --json; bench/gpu/run.sh runs it beside distopt-bench-gpu-update. Last,
// ZeRO-Offload's step (states on the host) against the device-resident one, and after a
// modelled backward with the overlap hooks and without.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>
#include <distopt/offload.hpp>
#include <distopt/storage/q8.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../step_bench.hpp"
#include "cli.hpp"
#include "timing.hpp"

namespace {

namespace ce = distopt::cuda_exec;

using gpu_bench::options;

using gpu_bench::best_seconds;

struct row {
  std::string policy, model, precision, check;
  double bytes_per_param, seconds, params;
};

/// `count` tensors of 1,024 elements: 65,536 is the multi-tensor case of issue 18's targets
/// (fewer when --params is below 64 M, for quick runs).
std::size_t small_count(const options& o) { return std::min<std::size_t>(65536, o.params / 1024); }

distopt::layout small_tensors(distopt::dtype t, std::size_t count) {
  distopt::layout l;
  for (std::size_t i = 0; i < count; ++i) {
    std::string name = "t";
    name += std::to_string(i);
    l.add(std::move(name), {1024}, t);
  }
  return l;
}

template <class Policy, class Param, class Grad, class Enc = distopt::fp32>
row run_case(const options& o, cudaStream_t stream, const typename Policy::hyper_params& h, bool many,
             bool check_finite) {
  using opt_t = distopt::optimizer<Policy, distopt::replicated<Enc>, distopt::single, distopt::cuda,
                                   distopt::precision<Param, Grad>>;
  const distopt::layout l = many ? small_tensors(distopt::dtype_of<Param>, small_count(o))
                                 : bench::gpt_like(o.params, distopt::dtype_of<Param>);
  distopt::optimizer_options opts;
  opts.check_finite = check_finite;
  opt_t opt(l, h, opts, distopt::cuda(0, stream));
  // Small grads everywhere (the buffers are zero-filled: write a constant through a copy).
  const std::vector<Grad> g(opt.grads().size(), distopt::from_float<Grad>(1e-3f));
  distopt::upload(opt.executor(), g, opt.grads());
  const double secs = best_seconds(o.repeats, stream, [&] { opt.step(); });
  constexpr bool master = !std::is_same_v<Param, float>;
  const int slots = Policy::state_slots(h);
  // Each state slot read and written: 4 B fp32, 2 B bf16; q8 1 B codes and a 4 B absmax per 256.
  constexpr bool quantized = distopt::quantized_encoding<Enc>;
  const double per_slot = quantized ? 2.0 + 8.0 / 256 : 2.0 * sizeof(Enc);
  const double bytes = (master ? sizeof(Param) + 8.0 : 2.0 * sizeof(Param)) + sizeof(Grad) + per_slot * slots +
                       (check_finite ? sizeof(Grad) : 0.0);
  std::string prec = master ? std::string(distopt::dtype_name(distopt::dtype_of<Param>)) + "+master" : "fp32";
  if (quantized) prec += "/q8";
  return {std::string(Policy::name), many ? std::to_string(small_count(o)) + "x1024" : "gpt-like", prec,
          check_finite ? "on" : "off", bytes, secs, static_cast<double>(l.numel())};
}

/// ZeRO-Offload (distopt/offload.hpp): bf16 params and grads on the GPU, fp32 master
/// weights and AdamW states on the host, stepped by cpu on every host thread. A step copies
/// the grads to the host and the params back around the host update: from page-locked host
/// buffers (`pinned`, the default) or through pageable memory (pin_host_buffers off).
using offload_opt = distopt::optimizer<distopt::adamw, distopt::replicated<distopt::fp32>, distopt::single,
                                       distopt::offload<distopt::cuda>,
                                       distopt::precision<distopt::bf16, distopt::bf16>>;

/// The offloaded optimizer over GPT-like tensors `l`, small grads written on the device.
offload_opt make_offload(const distopt::layout& l, cudaStream_t stream, const distopt::adamw::hyper_params& h,
                         int threads, const distopt::optimizer_options& opts) {
  offload_opt opt(l, h, opts, distopt::offload<distopt::cuda>(distopt::cpu(threads), distopt::cuda(0, stream)));
  const std::vector<distopt::bf16> g(opt.grads().size(), distopt::from_float<distopt::bf16>(1e-3f));
  distopt::upload(opt.executor(), g, opt.grads());
  return opt;
}

double offload_seconds(const options& o, cudaStream_t stream, const distopt::adamw::hyper_params& h, int threads,
                       bool pinned) {
  distopt::optimizer_options opts;
  opts.pin_host_buffers = pinned;
  offload_opt opt = make_offload(bench::gpt_like(o.params, distopt::dtype::bf16), stream, h, threads, opts);
  return best_seconds(o.repeats, stream, [&] { opt.step(); });
}

/// A stand-in for one layer's backward kernels: one thread block that spins for `ns`
/// nanoseconds of the device's clock (%globaltimer), occupying the stream, not the chip.
__global__ void modelled_backward(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  while (t - t0 < ns);
}

/// ZeRO-Offload's step after a modelled backward: per tensor, last first, a kernel of
/// `ns_per_param` x its elements on the stream; then, with `hooks`, grads_ready(tensor) at
/// once (the copy to the host starts on the device's copy stream and the next tensor's
/// kernel runs meanwhile); then step(). Without hooks step() copies every grad after
/// backward. Returns {backward alone, backward + step} in seconds, best of --repeats.
std::pair<double, double> offload_overlap_seconds(const options& o, cudaStream_t stream,
                                                  const distopt::adamw::hyper_params& h, int threads, bool hooks,
                                                  double ns_per_param) {
  const distopt::layout l = bench::gpt_like(o.params, distopt::dtype::bf16);
  offload_opt opt = make_offload(l, stream, h, threads, {});
  const auto& ts = l.tensors();
  const auto backward = [&](bool ready) {
    for (std::size_t k = ts.size(); k-- > 0;) {
      const auto ns = static_cast<unsigned long long>(ns_per_param * static_cast<double>(ts[k].numel));
      modelled_backward<<<1, 1, 0, stream>>>(ns);
      if (ready) opt.grads_ready(ts[k].name);
    }
  };
  const double alone = best_seconds(o.repeats, stream, [&] { backward(false); });
  const double both = best_seconds(o.repeats, stream, [&] {
    backward(hooks);
    opt.step();
  });
  return {alone, both};
}

}  // namespace

int main(int argc, char** argv) {
  const options o = gpu_bench::parse("distopt-bench-gpu-step", argc, argv, 10);
  const cudaDeviceProp prop = gpu_bench::device_or_exit("distopt-bench-gpu-step");
  try {
    cudaStream_t stream;
    ce::check(cudaStreamCreate(&stream), "cudaStreamCreate");
    // The roofline: a device-to-device copy of the size of one fp32 array of the model.
    const std::size_t copy_bytes = o.params * sizeof(float);
    const double copy_gbps = gpu_bench::copy_gbps(copy_bytes, o.repeats, stream);

    distopt::adamw::hyper_params w;
    std::vector<row> rows;
    for (const bool check : {true, false}) {
      rows.push_back(run_case<distopt::adamw, float, float>(o, stream, w, false, check));
      rows.push_back(run_case<distopt::adamw, distopt::bf16, distopt::bf16>(o, stream, w, false, check));
    }
    rows.push_back(run_case<distopt::adamw, float, float, distopt::q8>(o, stream, w, false, true));
    rows.push_back(run_case<distopt::adamw, float, float>(o, stream, w, true, true));
    rows.push_back(run_case<distopt::adamw, float, float>(o, stream, w, true, false));

    std::printf("device: %s; copy %.0f GB/s (read + write of %zu MB)\n", prop.name, copy_gbps, copy_bytes >> 20);
    std::printf("%-7s %-11s %-12s %-5s %8s %10s %8s %6s\n", "policy", "model", "params", "check", "B/param",
                "ns/param", "GB/s", "ratio");
    std::ofstream json = gpu_bench::open_json(o.json);
    for (const row& r : rows) {
      const double ns = r.seconds / r.params * 1e9, gbps = r.bytes_per_param * r.params / r.seconds * 1e-9;
      std::printf("%-7s %-11s %-12s %-5s %8.0f %10.4f %8.0f %6.2f\n", r.policy.c_str(), r.model.c_str(),
                  r.precision.c_str(), r.check.c_str(), r.bytes_per_param, ns, gbps, gbps / copy_gbps);
      if (json)
        json << "{\"bench\":\"gpu-step\",\"impl\":\"distopt\",\"device\":\"" << prop.name << "\",\"policy\":\""
             << r.policy << "\",\"model\":\"" << r.model << "\",\"precision\":\"" << r.precision
             << "\",\"check\":\"" << r.check << "\",\"params\":" << r.params
             << ",\"bytes_per_param\":" << r.bytes_per_param << ",\"ns_per_param\":" << ns << ",\"gbps\":" << gbps
             << ",\"copy_gbps\":" << copy_gbps << ",\"ratio\":" << gbps / copy_gbps << "}\n";
    }
    // Offload against the device-resident step of the same precision (rows[1]: bf16 + master, check on).
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (const bool pinned : {true, false}) {
      const double off_s = offload_seconds(o, stream, w, threads, pinned), dev_s = rows[1].seconds;
      const double off_ns = off_s / rows[1].params * 1e9;
      const char* host = pinned ? "page-locked" : "pageable";
      std::printf("offload (adamw bf16+master, gpt-like, states on the host, %d cpu threads, %s host buffers): "
                  "%.4f ns/param, %.1fx the device-resident step (%.4f ns/param)\n",
                  threads, host, off_ns, off_s / dev_s, dev_s / rows[1].params * 1e9);
      if (json)
        json << "{\"bench\":\"gpu-offload-step\",\"impl\":\"distopt\",\"device\":\"" << prop.name
             << "\",\"policy\":\"adamw\",\"model\":\"gpt-like\",\"precision\":\"bf16+master\",\"threads\":"
             << threads << ",\"host_buffers\":\"" << host << "\",\"params\":" << rows[1].params
             << ",\"ns_per_param\":" << off_ns << ",\"device_resident_ns_per_param\":" << dev_s / rows[1].params * 1e9
             << "}\n";
    }
    // The hooks' overlap: a modelled backward of 0.04 ns/param (the copies of the bf16 grads
    // at 50 GB/s take as long), then the step, with grads_ready per tensor and without.
    constexpr double backward_ns = 0.04;
    for (const bool hooks : {false, true}) {
      const auto [alone, both] = offload_overlap_seconds(o, stream, w, threads, hooks, backward_ns);
      const double n = rows[1].params;
      std::printf("offload after a modelled backward (%.2f ns/param, %.1f ms), %s: backward + step %.1f ms, "
                  "the step's share %.4f ns/param\n",
                  backward_ns, alone * 1e3, hooks ? "grads_ready per tensor" : "no hooks", both * 1e3,
                  (both - alone) / n * 1e9);
      if (json)
        json << "{\"bench\":\"gpu-offload-overlap\",\"impl\":\"distopt\",\"device\":\"" << prop.name
             << "\",\"policy\":\"adamw\",\"model\":\"gpt-like\",\"precision\":\"bf16+master\",\"threads\":"
             << threads << ",\"hooks\":" << (hooks ? "true" : "false") << ",\"params\":" << n
             << ",\"backward_ns_per_param\":" << backward_ns << ",\"backward_s\":" << alone
             << ",\"backward_and_step_s\":" << both << "}\n";
    }
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt-bench-gpu-step: %s\n", e.what());
    return 1;
  }
  return 0;
}
