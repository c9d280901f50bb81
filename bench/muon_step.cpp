// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Muon's step on GPT-like blocks (Muon on each block's four matrices, AdamW on its vectors),
// against this machine's single-thread sgemm (the compute ceiling), with the Newton-Schulz
// flops counted as torch counts them (no symmetry: 4 r^2 c + 2 r^3 per iteration for an
// r x c matrix, r <= c). bench/peers/torch_muon.py times torch.optim.Muon on the same
// shapes and threads. Results and commands: bench/RESULTS.md, "Muon".
//
//   distopt-bench-muon [--threads N] [--width D] [--layers L] [--repeats R] [--ns fp32|bf16]
//                      [--ranks N] [--json FILE]
#include <distopt/distopt.hpp>
#include <distopt/policy/muon.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "timing.hpp"

namespace {

struct args {
  int threads = 1, width = 512, layers = 1, repeats = 3, ranks = 1;
  std::string ns = "fp32", json;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--threads") a.threads = std::atoi(v.c_str());
    else if (k == "--width") a.width = std::atoi(v.c_str());
    else if (k == "--layers") a.layers = std::atoi(v.c_str());
    else if (k == "--repeats") a.repeats = std::atoi(v.c_str());
    else if (k == "--ranks") a.ranks = std::atoi(v.c_str());
    else if (k == "--ns") a.ns = v;
    else if (k == "--json") a.json = v;
    else {
      std::fprintf(stderr, "distopt-bench-muon: unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

/// A GPT block of width d: attn.qkv [3d, d], attn.proj [d, d], mlp.fc [4d, d], mlp.proj
/// [d, 4d] in group 0 (Muon); their biases and two LayerNorm weights in group 1 (AdamW).
distopt::layout gpt_blocks(int d, int layers) {
  distopt::layout l;
  const std::int64_t w = d;
  for (int b = 0; b < layers; ++b) {
    const std::string p = "h" + std::to_string(b) + ".";
    l.add(p + "ln1.weight", {w}, distopt::dtype::f32, 1);
    l.add(p + "attn.qkv.weight", {3 * w, w}, distopt::dtype::f32, 0);
    l.add(p + "attn.qkv.bias", {3 * w}, distopt::dtype::f32, 1);
    l.add(p + "attn.proj.weight", {w, w}, distopt::dtype::f32, 0);
    l.add(p + "attn.proj.bias", {w}, distopt::dtype::f32, 1);
    l.add(p + "ln2.weight", {w}, distopt::dtype::f32, 1);
    l.add(p + "mlp.fc.weight", {4 * w, w}, distopt::dtype::f32, 0);
    l.add(p + "mlp.fc.bias", {4 * w}, distopt::dtype::f32, 1);
    l.add(p + "mlp.proj.weight", {w, 4 * w}, distopt::dtype::f32, 0);
    l.add(p + "mlp.proj.bias", {w}, distopt::dtype::f32, 1);
  }
  return l;
}

/// Newton-Schulz flops of one step as torch spends them.
double ns_flops(const distopt::layout& l, int steps) {
  double f = 0;
  for (const auto& t : l.tensors())
    if (t.group == 0) {
      const double r = static_cast<double>(std::min(t.shape[0], t.shape[1]));
      const double c = static_cast<double>(std::max(t.shape[0], t.shape[1]));
      f += steps * (4 * r * r * c + 2 * r * r * r);
    }
  return f;
}

/// Single-thread sgemm GFLOP/s on a [d, 4d] x [4d, d] product (the ceiling of one thread).
double sgemm_gflops(int d) {
  const std::int64_t m = d, k = 4 * d;
  std::vector<float> a(static_cast<std::size_t>(m * k), 0.5f), c(static_cast<std::size_t>(m * m));
  const double s = bench::best_seconds(5, [&] {
    distopt::detail::sgemm_row_major(false, true, m, m, k, a.data(), k, a.data(), k, c.data());
  });
  return 2.0 * m * m * k / s / 1e9;
}

template <class Opt>
void fill_grads(Opt& opt, int rank) {
  std::size_t seed = 12345;
  for (const auto& t : opt.tensors().tensors()) {
    auto g = opt.grad(t.name);
    for (auto& v : g) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      v = rank == 0 ? (static_cast<float>(seed >> 40) / 16777216.0f - 0.5f) * 0.02f : 0.0f;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const args a = parse(argc, argv);
  const distopt::layout l = gpt_blocks(a.width, a.layers);
  distopt::muon::hyper_params muon;
  muon.adjust_lr_fn = distopt::muon_adjust_lr::match_rms_adamw;
  if (a.ns == "bf16") muon.ns_dtype = distopt::muon_ns_dtype::bf16;
  distopt::muon::hyper_params adamw = muon;
  adamw.use_muon = false;
  double seconds = 0;
  std::size_t sent = 0;
  std::string memory;  // rank 0's report, bytes per parameter by category
  const auto describe = [&memory](const distopt::memory_report& r) {
    char line[96];
    for (const auto& e : r.entries)
      if (e.bytes) {
        std::snprintf(line, sizeof line, "%s %.2f, ", e.category.c_str(), r.bytes_per_param(e));
        memory += line;
      }
    std::snprintf(line, sizeof line, "total %.2f B/param",
                  static_cast<double>(r.total_bytes()) / static_cast<double>(r.parameters));
    memory += line;
  };
  if (a.ranks == 1) {
    distopt::optimizer<distopt::muon> opt(l, {muon, adamw}, {}, distopt::cpu(a.threads));
    fill_grads(opt, 0);
    opt.step();  // warm-up: work buffers, pages
    seconds = bench::best_seconds(a.repeats, [&] { opt.step(); });
    describe(opt.memory());
  } else {
    distopt::optimizer_options o;
    o.grad_reduce = distopt::reduce_op::sum;
    std::vector<double> per(static_cast<std::size_t>(a.ranks));
    distopt::run_ranks(a.ranks, [&](distopt::threads& comm) {
      const int rank = comm.rank();
      distopt::optimizer<distopt::muon, distopt::sharded<distopt::fp32>, distopt::threads> opt(
          l, {muon, adamw}, o, distopt::cpu(a.threads), std::move(comm));
      fill_grads(opt, rank);
      opt.step();
      const std::size_t before = opt.communicator().bytes_sent();
      per[static_cast<std::size_t>(rank)] = bench::best_seconds(a.repeats, [&] {
        fill_grads(opt, rank);
        opt.step();
      });
      if (rank == 0) {
        sent = (opt.communicator().bytes_sent() - before) / static_cast<std::size_t>(a.repeats);
        describe(opt.memory());
      }
    });
    seconds = *std::max_element(per.begin(), per.end());
  }
  const double flops = ns_flops(l, muon.ns_steps), ceiling = sgemm_gflops(a.width);
  std::printf("muon %s: %d x width %d (%zu params), %d thread(s), %d rank(s): %.1f ms/step; Newton-Schulz "
              "%.1f GFLOP (torch's count) at %.1f GFLOP/s = %.2f x one thread's sgemm (%.1f GFLOP/s)\n",
              a.ns.c_str(), a.layers, a.width, l.numel(), a.threads, a.ranks, seconds * 1e3, flops / 1e9,
              flops / seconds / 1e9, flops / seconds / 1e9 / ceiling, ceiling);
  if (a.ranks > 1) std::printf("  rank 0 sent %zu bytes per step\n", sent);
  std::printf("  memory (rank 0): %s\n", memory.c_str());
  if (!a.json.empty()) {
    std::ofstream(a.json, std::ios::app) << "{\"bench\":\"muon\",\"ns\":\"" << a.ns << "\",\"width\":" << a.width
                                         << ",\"layers\":" << a.layers << ",\"params\":" << l.numel()
                                         << ",\"threads\":" << a.threads << ",\"ranks\":" << a.ranks
                                         << ",\"ms_per_step\":" << seconds * 1e3 << ",\"ns_gflop\":" << flops / 1e9
                                         << ",\"gflops\":" << flops / seconds / 1e9
                                         << ",\"sgemm_1thread_gflops\":" << ceiling << ",\"bytes_sent\":" << sent
                                         << "}\n";
  }
}
