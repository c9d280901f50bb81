// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-experts: memory per rank and bytes per step of a mixture-of-experts model
// held by two optimizers (the dense tensors over the dense grid, the experts over the
// expert grid, stepped by joint_step), on a world of ranks as threads, for each mesh shape
// the world divides, against the byte model.
//
//   distopt-bench-experts [--ranks W] [--layers L] [--dim D] [--vocab V] [--experts E]
//                         [--stage 1|2]
//
// The model is GPT-like: a vocabulary-parallel embedding [V, D] (rows split over TP); per
// layer an attention qkv [3D, D] (column-parallel: rows split), its output [D, D]
// (row-parallel: columns split), two norms [D] and a router [E, D] (replicated over TP);
// and E experts per layer, each an MLP of w_in [4D, D] (column-parallel inside the expert,
// over ETP) and w_out [D, 4D] (row-parallel). Top-k routing (top-2) decides activations and
// compute, not what the optimizer holds or sends, so k does not appear here.
//
// AdamW, fp32 params, grads and states, sharded at --stage 1 or 2. For each shape rank 0's
// memory report (joint_memory: the dense categories, then the experts'), and the bytes each
// rank sends in one step over its dense DP group, its expert-DP group and its EP group (the
// threads communicator's ring model), against the model:
//   stage 1: params 4 N + grads 4 N + states 8 N / d;  stage 2: grads 4 N / d instead,
//   plus the buckets of full grads lent during backward at their peak ("pool", measured:
//   the grads are declared ready tensor by tensor, buckets of 2^20 elements, and this
//   backward computes nothing, so every bucket's reduce-scatter is in flight at once, the
//   worst case; distopt-bench-zero models a backward's compute); "ratio" is the total over
//   model + pool;
//   sent: reduce-scatter of the grads and all-gather of the params, 2 (d - 1) / d * 4 N,
// for the dense tensors (N: this rank's TP part, d = dp) and its experts (N: its experts'
// ETP part, d = expert-DP). "excess B": the bytes sent over DP, expert-DP and EP beyond
// the model: the norms' exact sums (70 doubles per all-reduce; the ep column is the one
// over EP) and the buckets' padding to whole shards.
// (The TP and ETP groups, inside the optimizers, carry only the norms' sums for AdamW.)

#include <distopt/comm/mesh.hpp>
#include <distopt/distopt.hpp>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct settings {
  int ranks = 8, layers = 4, dim = 256, vocab = 8192, experts = 8, stage = 1;
};

struct shape_result {
  distopt::memory_report memory;
  std::size_t dense_elems = 0, expert_elems = 0;  // rank 0's local parts
  std::size_t sent_dp = 0, sent_edp = 0, sent_ep = 0;
};

using distopt::tp_split;

template <int Stage>
shape_result run(const settings& s, const distopt::mesh_shape& shape) {
  using opt = distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32, Stage>, distopt::threads>;
  shape_result out;
  std::mutex m;
  distopt::run_ranks(s.ranks, [&](distopt::threads& world) {
    distopt::mesh<distopt::threads> g = distopt::make_mesh(world, shape);
    const std::int64_t d = s.dim, tp = shape.tp, etp = shape.etp;
    distopt::layout dense, experts;
    const auto f32 = distopt::dtype::f32;
    dense.add("embedding", {s.vocab / tp, d}, f32, 0, tp > 1 ? tp_split::rows : tp_split::none);
    for (int l = 0; l < s.layers; ++l) {
      const std::string p = "h" + std::to_string(l) + ".";
      dense.add(p + "qkv", {3 * d / tp, d}, f32, 0, tp > 1 ? tp_split::rows : tp_split::none);
      dense.add(p + "out", {d, d / tp}, f32, 0, tp > 1 ? tp_split::cols : tp_split::none);
      dense.add(p + "norm1", {d}, f32);
      dense.add(p + "norm2", {d}, f32);
      dense.add(p + "router", {s.experts, d}, f32);
      const distopt::expert_range mine = g.experts(s.experts);
      for (int e = mine.first; e < mine.first + mine.count; ++e) {
        const std::string x = p + "expert" + std::to_string(e) + ".";
        experts.add(x + "w_in", {4 * d / etp, d}, f32, 0, etp > 1 ? tp_split::rows : tp_split::none);
        experts.add(x + "w_out", {d, 4 * d / etp}, f32, 0, etp > 1 ? tp_split::cols : tp_split::none);
      }
    }
    distopt::optimizer_options o;
    o.max_grad_norm = 1.0;
    o.bucket_elems = std::size_t{1} << 20;
    opt dn(dense, distopt::adamw::hyper_params{}, o, distopt::cpu(1), std::move(g.dp));
    opt ex(experts, distopt::adamw::hyper_params{}, o, distopt::cpu(1), std::move(g.edp));
    if (tp > 1) dn.set_tensor_parallel_group(std::move(g.tp));
    if (etp > 1) ex.set_tensor_parallel_group(std::move(g.etp));
    // A backward: each tensor's grads written, the last first, and declared ready (the
    // hooks: at stage 2 a bucket's full grads are lent only until its reduce-scatter).
    const auto fill = [](opt& o, const distopt::layout& l) {
      const auto tensors = l.tensors();
      for (std::size_t i = tensors.size(); i-- > 0;) {
        for (float& v : o.grad(tensors[i].name)) v = 1e-3f;
        o.grads_ready(tensors[i].name);
      }
    };
    fill(dn, dense);
    fill(ex, experts);
    distopt::joint_step(dn, ex, g.ep);  // the first step allocates what steps keep
    const std::size_t dp0 = dn.communicator().bytes_sent(), edp0 = ex.communicator().bytes_sent(), ep0 = g.ep.bytes_sent();
    fill(dn, dense);
    fill(ex, experts);
    distopt::joint_step(dn, ex, g.ep);
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(m);
      out.memory = distopt::joint_memory(dn, ex);
      out.dense_elems = dense.numel();
      out.expert_elems = experts.numel();
      out.sent_dp = dn.communicator().bytes_sent() - dp0;
      out.sent_edp = ex.communicator().bytes_sent() - edp0;
      out.sent_ep = g.ep.bytes_sent() - ep0;
    }
  });
  return out;
}

double mb(double bytes) { return bytes / 1e6; }

void usage(const char* why) {
  std::fprintf(stderr,
               "distopt-bench-experts: %s\nusage: distopt-bench-experts [--ranks W] [--layers L] [--dim D] "
               "[--vocab V] [--experts E] [--stage 1|2]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + std::string(a)).c_str());
    const int v = std::atoi(argv[++i]);
    if (v <= 0) usage(("bad value for " + std::string(a)).c_str());
    if (a == "--ranks") s.ranks = v;
    else if (a == "--layers") s.layers = v;
    else if (a == "--dim") s.dim = v;
    else if (a == "--vocab") s.vocab = v;
    else if (a == "--experts") s.experts = v;
    else if (a == "--stage") s.stage = v;
    else usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.stage != 1 && s.stage != 2) usage("--stage must be 1 or 2");
  const double dense_model = static_cast<double>(s.vocab) * s.dim + s.layers * (4.0 * s.dim * s.dim + 2.0 * s.dim + s.experts * s.dim);
  const double expert_model = s.layers * s.experts * 8.0 * s.dim * s.dim;
  std::printf("# distopt-bench-experts: %d ranks as threads, %d layers, D %d, V %d, E %d; AdamW fp32 at ZeRO-%d\n",
              s.ranks, s.layers, s.dim, s.vocab, s.experts, s.stage);
  std::printf("# model: %.2f M dense params, %.2f M expert params; rank 0's memory and bytes sent per step\n",
              dense_model / 1e6, expert_model / 1e6);
  std::printf("%3s %3s %3s %3s %4s | %9s %10s | %9s %9s %8s %6s | %10s %10s %10s %9s %6s\n", "tp", "ep", "etp", "dp", "edp",
              "dense MB", "experts MB", "total MB", "model MB", "pool MB", "ratio", "sent dp MB", "edp MB", "model MB", "excess B",
              "ep B");
  for (int tp : {1, 2})
    for (int ep : {1, 2, 4, 8})
      for (int etp : {1, 2}) {
        if (etp > tp || s.ranks % tp != 0 || s.ranks % (ep * etp) != 0 || s.experts % ep != 0) continue;
        const distopt::mesh_shape shape{tp, ep, etp};
        const shape_result r = s.stage == 1 ? run<1>(s, shape) : run<2>(s, shape);
        const int dp = s.ranks / tp, edp = s.ranks / (ep * etp);
        std::size_t dense_b = 0, expert_b = 0;
        for (const auto& e : r.memory.entries) (e.category.starts_with("experts ") ? expert_b : dense_b) += e.bytes;
        const double pool = static_cast<double>(r.memory.bytes("grad buckets (peak)") + r.memory.bytes("experts grad buckets (peak)"));
        const double nd = static_cast<double>(r.dense_elems), nx = static_cast<double>(r.expert_elems);
        const auto held = [&](double n, int d) { return 4 * n + (s.stage == 1 ? 4 * n : 4 * n / d) + 8 * n / d; };
        const double model = held(nd, dp) + held(nx, edp);
        const double sent_model = 2.0 * (dp - 1) / dp * 4 * nd + 2.0 * (edp - 1) / edp * 4 * nx;
        const double sent = static_cast<double>(r.sent_dp + r.sent_edp + r.sent_ep);
        std::printf("%3d %3d %3d %3d %4d | %9.2f %10.2f | %9.2f %9.2f %8.2f %6.3f | %10.3f %10.3f %10.3f %9.0f %6zu\n", tp, ep,
                    etp, dp, edp, mb(static_cast<double>(dense_b)), mb(static_cast<double>(expert_b)),
                    mb(static_cast<double>(r.memory.total_bytes())), mb(model), mb(pool),
                    static_cast<double>(r.memory.total_bytes()) / (model + pool),
                    mb(static_cast<double>(r.sent_dp)), mb(static_cast<double>(r.sent_edp)), mb(sent_model), sent - sent_model,
                    r.sent_ep);
        std::fflush(stdout);
      }
  return 0;
}
