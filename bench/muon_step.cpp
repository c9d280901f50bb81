// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Muon's step on GPT-like blocks (Muon on each block's four matrices, AdamW on its vectors),
// against this machine's single-thread sgemm (the compute ceiling), with the Newton-Schulz
// flops counted as torch counts them (no symmetry: 4 r^2 c + 2 r^3 per iteration for an
// r x c matrix, r <= c). bench/peers/torch_muon.py times torch.optim.Muon on the same
// shapes and threads. Results and commands: bench/RESULTS.md, "Muon".
//
// With --ranks N (threads) the matrices are placed `sharded` (every rank holding part of
// a matrix runs its whole Newton-Schulz or SVD) or `owned` (one rank per matrix); the
// report adds the bytes every rank sent and the Newton-Schulz or SVD runs of the job.
// --optimizer galore runs GaLore-AdamW (rank --rank, a projection refresh every --gap
// steps: 1 makes every timed step an SVD step) on the same matrices instead of Muon.
//
//   distopt-bench-muon [--threads N] [--width D] [--layers L] [--repeats R] [--ns fp32|bf16]
//                      [--ranks N] [--placement sharded|owned] [--optimizer muon|galore]
//                      [--rank R] [--gap G] [--json FILE]
#include <distopt/distopt.hpp>
#include <distopt/policy/galore_adamw.hpp>
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
  int threads = 1, width = 512, layers = 1, repeats = 3, ranks = 1, rank = 64, gap = 1;
  std::string ns = "fp32", json, placement = "sharded", optimizer = "muon";
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
    else if (k == "--placement") a.placement = v;
    else if (k == "--optimizer") a.optimizer = v;
    else if (k == "--rank") a.rank = std::atoi(v.c_str());
    else if (k == "--gap") a.gap = std::atoi(v.c_str());
    else if (k == "--json") a.json = v;
    else {
      std::fprintf(stderr, "distopt-bench-muon: unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  if ((a.placement != "sharded" && a.placement != "owned") || (a.optimizer != "muon" && a.optimizer != "galore")) {
    std::fprintf(stderr, "distopt-bench-muon: --placement sharded|owned, --optimizer muon|galore\n");
    std::exit(2);
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

/// What a run on ranks measured: the slowest rank's best step, the bytes each rank sent
/// per step, and the memory report of rank 0 and of the rank holding the most.
struct ranks_run {
  double seconds = 0;
  std::vector<std::size_t> sent;
  distopt::memory_report memory, largest;
};

/// Steps `Policy` with `Storage` on a.ranks ranks as threads, rank 0 holding the gradient.
template <class Policy, class Storage>
ranks_run time_ranks(const args& a, const distopt::layout& l, const std::vector<typename Policy::hyper_params>& h) {
  distopt::optimizer_options o;
  o.grad_reduce = distopt::reduce_op::sum;
  ranks_run out;
  std::vector<double> per(static_cast<std::size_t>(a.ranks));
  std::vector<distopt::memory_report> reports(per.size());
  out.sent.resize(per.size());
  distopt::run_ranks(a.ranks, [&](distopt::threads& comm) {
    const int rank = comm.rank();
    distopt::optimizer<Policy, Storage, distopt::threads> opt(l, h, o, distopt::cpu(a.threads), std::move(comm));
    fill_grads(opt, rank);
    opt.step();
    const std::size_t before = opt.communicator().bytes_sent();
    per[static_cast<std::size_t>(rank)] = bench::best_seconds(a.repeats, [&] {
      fill_grads(opt, rank);
      opt.step();
    });
    out.sent[static_cast<std::size_t>(rank)] =
        (opt.communicator().bytes_sent() - before) / static_cast<std::size_t>(a.repeats);
    reports[static_cast<std::size_t>(rank)] = opt.memory();
  });
  out.seconds = *std::max_element(per.begin(), per.end());
  out.memory = reports[0];
  out.largest = *std::max_element(reports.begin(), reports.end(), [](const auto& x, const auto& y) {
    return x.total_bytes() < y.total_bytes();
  });
  return out;
}

template <class Policy>
ranks_run time_placement(const args& a, const distopt::layout& l, const std::vector<typename Policy::hyper_params>& h) {
  if (a.placement == "owned") return time_ranks<Policy, distopt::owned<distopt::fp32>>(a, l, h);
  return time_ranks<Policy, distopt::sharded<distopt::fp32>>(a, l, h);
}

/// How many whole-matrix runs (Newton-Schulz or SVD) one step makes over all ranks: one per
/// rank holding part of a matrix (sharded), one per matrix (owned).
std::size_t matrix_runs(const args& a, const distopt::layout& l) {
  std::vector<char> whole;
  for (const auto& t : l.tensors()) whole.push_back(t.group == 0);
  std::size_t runs = 0;
  for (int r = 0; r < a.ranks; ++r) {
    const distopt::detail::shard_plan p(l, a.ranks, r, distopt::optimizer_options{}.bucket_elems, 1u << 14,
                                        a.placement == "owned" ? whole : std::vector<char>{});
    for (std::size_t i = 0; i < whole.size(); ++i) runs += whole[i] && p.local_count(i) > 0;
  }
  return runs;
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
  distopt::galore_adamw::hyper_params plain, galore;  // group 0 projected, group 1 plain
  galore.rank = a.rank;
  galore.update_proj_gap = a.gap;
  const bool is_galore = a.optimizer == "galore";
  double seconds = 0;
  std::size_t sent = 0, sent_all = 0;
  std::string memory, largest;  // rank 0's report and the largest one, bytes per parameter by category
  const auto describe = [](std::string& memory, const distopt::memory_report& r) {
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
    const auto one = [&](auto& opt) {
      fill_grads(opt, 0);
      opt.step();  // warm-up: work buffers, pages
      seconds = bench::best_seconds(a.repeats, [&] { opt.step(); });
      describe(memory, opt.memory());
    };
    if (is_galore) {
      distopt::optimizer<distopt::galore_adamw> opt(l, {galore, plain}, {}, distopt::cpu(a.threads));
      one(opt);
    } else {
      distopt::optimizer<distopt::muon> opt(l, {muon, adamw}, {}, distopt::cpu(a.threads));
      one(opt);
    }
  } else {
    const ranks_run r = is_galore ? time_placement<distopt::galore_adamw>(a, l, {galore, plain})
                                  : time_placement<distopt::muon>(a, l, {muon, adamw});
    seconds = r.seconds;
    sent = r.sent[0];
    for (const std::size_t s : r.sent) sent_all += s;
    describe(memory, r.memory);
    describe(largest, r.largest);
  }
  const std::size_t runs = a.ranks == 1 ? 4u * static_cast<std::size_t>(a.layers) : matrix_runs(a, l);
  const double flops = ns_flops(l, muon.ns_steps), ceiling = is_galore ? 0.0 : sgemm_gflops(a.width);
  if (is_galore) {
    std::printf("galore rank %d, refresh every %d step(s): %d x width %d (%zu params), %d thread(s), %d rank(s), "
                "%s: %.1f ms/step, %zu SVD-sized matrix runs per refresh over the job\n",
                a.rank, a.gap, a.layers, a.width, l.numel(), a.threads, a.ranks, a.placement.c_str(), seconds * 1e3,
                runs);
  } else {
    std::printf("muon %s: %d x width %d (%zu params), %d thread(s), %d rank(s), %s: %.1f ms/step; Newton-Schulz "
                "%.1f GFLOP (torch's count) at %.1f GFLOP/s = %.2f x one thread's sgemm (%.1f GFLOP/s); %zu "
                "Newton-Schulz runs per step over the job\n",
                a.ns.c_str(), a.layers, a.width, l.numel(), a.threads, a.ranks, a.placement.c_str(), seconds * 1e3,
                flops / 1e9, flops / seconds / 1e9, flops / seconds / 1e9 / ceiling, ceiling, runs);
  }
  if (a.ranks > 1) std::printf("  rank 0 sent %zu bytes per step, all ranks %zu\n", sent, sent_all);
  std::printf("  memory (rank 0): %s\n", memory.c_str());
  if (a.ranks > 1) std::printf("  memory (the rank holding the most): %s\n", largest.c_str());
  if (!a.json.empty()) {
    std::ofstream(a.json, std::ios::app) << "{\"bench\":\"" << a.optimizer << "\",\"ns\":\"" << a.ns
                                         << "\",\"placement\":\"" << a.placement << "\",\"width\":" << a.width
                                         << ",\"layers\":" << a.layers << ",\"params\":" << l.numel()
                                         << ",\"threads\":" << a.threads << ",\"ranks\":" << a.ranks
                                         << ",\"ms_per_step\":" << seconds * 1e3 << ",\"matrix_runs\":" << runs
                                         << (is_galore ? "" : ",\"ns_gflop\":" + std::to_string(flops / 1e9) +
                                                                  ",\"gflops\":" + std::to_string(flops / seconds / 1e9) +
                                                                  ",\"sgemm_1thread_gflops\":" + std::to_string(ceiling))
                                         << ",\"bytes_sent\":" << sent << ",\"bytes_sent_all_ranks\":" << sent_all
                                         << "}\n";
  }
}
