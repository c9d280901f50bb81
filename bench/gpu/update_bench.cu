// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-gpu-update: the CUDA update kernels (exec/cuda/update.cuh) over GPT-like
// tensors against the device's measured copy bandwidth, in one run. Each case reports the
// bytes it moves per parameter (each array read once and written once where it is
// written; with master weights the low-precision params are only written), the time per
// step, the achieved GB/s and the ratio to the copy bandwidth (cudaMemcpy device to
// device: read + write). JSON lines with --json; bench/gpu/run.sh runs it with PyTorch's
// optimizers beside it.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/q8_update.cuh>
#include <distopt/exec/cuda/update.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../step_bench.hpp"
#include "cli.hpp"
#include "timing.hpp"

namespace {

namespace ce = distopt::cuda_exec;
using distopt::detail::param_mode;

using gpu_bench::options;

struct timer {
  cudaEvent_t a, b;
  timer() {
    ce::check(cudaEventCreate(&a), "cudaEventCreate");
    ce::check(cudaEventCreate(&b), "cudaEventCreate");
  }
  ~timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  /// The best of `repeats` runs of f, in seconds.
  template <class F>
  double best(int repeats, F&& f) {
    f();  // warm-up
    float best_ms = 1e30f;
    for (int r = 0; r < repeats; ++r) {
      ce::check(cudaEventRecord(a), "cudaEventRecord");
      f();
      ce::check(cudaEventRecord(b), "cudaEventRecord");
      ce::check(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      ce::check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      best_ms = std::min(best_ms, ms);
    }
    return best_ms * 1e-3;
  }
};

template <class T>
T* device_array(std::size_t n) {
  T* p = nullptr;
  ce::check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
  ce::check(cudaMemset(p, 0, n * sizeof(T)), "cudaMemset");
  return p;
}

struct row {
  std::string policy, param, grad, state;
  double bytes_per_param, seconds, params, vector_fraction;
};

/// One step of `Policy` over the GPT-like tensors, laid out as the optimizer does (each
/// tensor at its layout offset, blocks of 256 elements).
template <class Policy, int N, param_mode Mode, class Param, class Grad, class Enc>
row run_case(const options& o, timer& t, const typename Policy::hyper_params& h, std::string param_name,
             std::size_t chunk_elems = 1 << 15) {
  const distopt::layout l = bench::gpt_like(o.params, distopt::dtype_of<Param>);
  const std::size_t n = l.size();  // elements, with block padding
  constexpr bool master = Mode == param_mode::master;
  Param* p = device_array<Param>(n);
  Grad* g = device_array<Grad>(n);
  float* m = master ? device_array<float>(n) : nullptr;
  Enc* s[4] = {};
  for (int k = 0; k < N; ++k) s[k] = device_array<Enc>(n);
  std::vector<ce::piece<Param, Grad, Enc>> pieces;
  for (const auto& ts : l.tensors()) {
    ce::piece<Param, Grad, Enc> pc{p + ts.offset, g + ts.offset, master ? m + ts.offset : nullptr, {}, ts.numel, ts.offset};
    for (int k = 0; k < N; ++k) pc.state[k] = s[k] + ts.offset;
    pieces.push_back(pc);
  }
  const ce::update_plan<Param, Grad, Enc> plan(pieces, N, master, chunk_elems);
  const auto sc = Policy::prepare(h, distopt::step_info{10, false});
  const double secs = t.best(o.repeats, [&] { plan.template run<Policy, N, Mode>(sc, 1.0f, 7); });
  ce::check(cudaDeviceSynchronize(), "update kernels");
  cudaFree(p);
  cudaFree(g);
  if (m) cudaFree(m);
  for (int k = 0; k < N; ++k) cudaFree(s[k]);
  const double bytes = (master ? sizeof(Param) + 8.0 : 2.0 * sizeof(Param)) + sizeof(Grad) + 2.0 * N * sizeof(Enc);
  const auto name = [](auto x) { return std::string(distopt::dtype_name(distopt::dtype_of<decltype(x)>)); };
  return {std::string(Policy::name), std::move(param_name), name(Grad{}), name(Enc{}), bytes, secs,
          static_cast<double>(l.numel()),
          static_cast<double>(plan.vector_elements()) / static_cast<double>(plan.elements())};
}

/// q8 states: every tensor quantized (blocks of 256 codes from its layout offset; the
/// layout's tensors start on 256-element blocks), one absmax per block and slot.
template <class Policy, int N, param_mode Mode, class Param, class Grad>
row run_q8_case(const options& o, timer& t, const typename Policy::hyper_params& h, std::string param_name) {
  const distopt::layout l = bench::gpt_like(o.params, distopt::dtype_of<Param>);
  const std::size_t n = l.size();
  constexpr bool master = Mode == param_mode::master;
  Param* p = device_array<Param>(n);
  Grad* g = device_array<Grad>(n);
  float* m = master ? device_array<float>(n) : nullptr;
  std::uint8_t* codes[4] = {};
  float* absmax[4] = {};
  std::vector<const distopt::detail::q8_codebook*> books;
  for (int k = 0; k < N; ++k) {
    codes[k] = device_array<std::uint8_t>(n);
    absmax[k] = device_array<float>(n / distopt::q8::block + 1);
    books.push_back(distopt::state_slot_nonnegative<Policy>(k) ? &distopt::detail::unsigned_codebook()
                                                              : &distopt::detail::signed_codebook());
  }
  std::vector<ce::q8_piece<Param, Grad>> pieces;
  for (const auto& ts : l.tensors()) {
    ce::q8_piece<Param, Grad> pc{p + ts.offset, g + ts.offset, master ? m + ts.offset : nullptr, {}, {}, ts.numel,
                                 ts.offset};
    for (int k = 0; k < N; ++k) {
      pc.code[k] = codes[k] + ts.offset;
      pc.absmax[k] = absmax[k] + ts.offset / distopt::q8::block;
    }
    pieces.push_back(pc);
  }
  const ce::q8_update_plan<Param, Grad> plan(pieces, books);
  const auto sc = Policy::prepare(h, distopt::step_info{10, false});
  const double secs = t.best(o.repeats, [&] { plan.template run<Policy, N, Mode>(sc, 1.0f, 7); });
  ce::check(cudaDeviceSynchronize(), "q8 update kernels");
  cudaFree(p);
  cudaFree(g);
  if (m) cudaFree(m);
  for (int k = 0; k < N; ++k) {
    cudaFree(codes[k]);
    cudaFree(absmax[k]);
  }
  const double bytes = (master ? sizeof(Param) + 8.0 : 2.0 * sizeof(Param)) + sizeof(Grad) +
                       N * (2.0 + 8.0 / distopt::q8::block);
  return {std::string(Policy::name), std::move(param_name),
          std::string(distopt::dtype_name(distopt::dtype_of<Grad>)), "q8", bytes, secs,
          static_cast<double>(l.numel()), 0.0};
}

}  // namespace

int main(int argc, char** argv) {
  const options o = gpu_bench::parse("distopt-bench-gpu-update", argc, argv, 20);
  const cudaDeviceProp prop = gpu_bench::device_or_exit("distopt-bench-gpu-update");
  try {
    timer t;
    // The roofline: a device-to-device copy of the size of one fp32 array of the model.
    const std::size_t copy_bytes = o.params * sizeof(float);
    char* src = device_array<char>(copy_bytes);
    char* dst = device_array<char>(copy_bytes);
    const double copy_s = t.best(o.repeats, [&] {
      ce::check(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    });
    cudaFree(src);
    cudaFree(dst);
    const double copy_gbps = 2.0 * static_cast<double>(copy_bytes) / copy_s * 1e-9;

    distopt::sgd::hyper_params momentum;
    momentum.momentum = 0.9;
    distopt::adamw::hyper_params w;
    distopt::lion::hyper_params li;
    std::vector<row> rows;
    using distopt::bf16;
    rows.push_back(run_case<distopt::sgd, 1, param_mode::fp32, float, float, float>(o, t, momentum, "fp32"));
    rows.push_back(run_case<distopt::adamw, 2, param_mode::fp32, float, float, float>(o, t, w, "fp32"));
    // The plan's chunk length against the grid's last wave: 8 Ki and 2 Ki elements a chunk.
    rows.push_back(run_case<distopt::adamw, 2, param_mode::fp32, float, float, float>(o, t, w, "fp32,c8K", 1 << 13));
    rows.push_back(run_case<distopt::adamw, 2, param_mode::fp32, float, float, float>(o, t, w, "fp32,c2K", 1 << 11));
    rows.push_back(run_case<distopt::adamw, 2, param_mode::fp32, float, float, bf16>(o, t, w, "fp32"));
    rows.push_back(run_case<distopt::adamw, 2, param_mode::master, bf16, bf16, float>(o, t, w, "bf16+master"));
    rows.push_back(run_case<distopt::adamw, 2, param_mode::no_master_sr, bf16, bf16, bf16>(o, t, w, "bf16+sr"));
    rows.push_back(run_case<distopt::lion, 1, param_mode::fp32, float, float, float>(o, t, li, "fp32"));
    rows.push_back(run_case<distopt::lion, 1, param_mode::master, bf16, bf16, float>(o, t, li, "bf16+master"));
    rows.push_back(run_q8_case<distopt::adamw, 2, param_mode::fp32, float, float>(o, t, w, "fp32"));
    rows.push_back(run_q8_case<distopt::adamw, 2, param_mode::master, bf16, bf16>(o, t, w, "bf16+master"));

    std::printf("device: %s; copy %.0f GB/s (read + write of %zu MB)\n", prop.name, copy_gbps, copy_bytes >> 20);
    std::printf("%-8s %-12s %-5s %-5s %8s %10s %8s %6s %6s\n", "policy", "param", "grad", "state", "B/param",
                "ns/param", "GB/s", "ratio", "vec");
    std::ofstream json = gpu_bench::open_json(o.json);
    for (const row& r : rows) {
      const double ns = r.seconds / r.params * 1e9, gbps = r.bytes_per_param * r.params / r.seconds * 1e-9;
      std::printf("%-8s %-12s %-5s %-5s %8.0f %10.4f %8.0f %6.2f %6.3f\n", r.policy.c_str(), r.param.c_str(),
                  r.grad.c_str(), r.state.c_str(), r.bytes_per_param, ns, gbps, gbps / copy_gbps, r.vector_fraction);
      if (json)
        json << "{\"bench\":\"gpu-update\",\"impl\":\"distopt\",\"device\":\"" << prop.name << "\",\"policy\":\""
             << r.policy << "\",\"param\":\"" << r.param << "\",\"grad\":\"" << r.grad << "\",\"state\":\"" << r.state
             << "\",\"params\":" << r.params << ",\"bytes_per_param\":" << r.bytes_per_param
             << ",\"ns_per_param\":" << ns << ",\"gbps\":" << gbps << ",\"copy_gbps\":" << copy_gbps
             << ",\"ratio\":" << gbps / copy_gbps << "}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt-bench-gpu-update: %s\n", e.what());
    return 1;
  }
  return 0;
}
