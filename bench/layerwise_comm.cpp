// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-layerwise-comm: the bytes the layer-wise statistics (per-tensor, per-row and
// per-column exact sums of lamb, adafactor and came) add to a step's communication, with
// sharded<fp32> states over d data-parallel ranks, and over a tensor-parallel group of 2.
//
// For each case, per rank and step: `statistics_bytes()` (the statistics this rank put
// into all-reduces, DP and TP together), the DP communicator's `bytes_sent()` and AdamW's
// `bytes_sent()` on the same layout and d (the same reduce-scatter and all-gather), and
// the model of the statistics' wire bytes from the policy's phases (layerwise_bench.hpp).
//
// Sections:
//   dp     GPT-like tensors (--layers, --width), d ranks, fp32 and bf16+master params.
//   shapes single matrices (same rows, 2x the cols; 2x the rows; [4096, 4096]) and a
//          vector, at d = 2 (threads) or the MPI world size: the statistics grow with
//          rows and columns, not with params.
//   tp     the GPT-like tensors split by Megatron's rules over TP = 2 (rank r = dp*2 + t,
//          world.split(dp, t) the TP group, world.split(t, dp) the DP group), DP d = 1, 2.
//
//   distopt-bench-layerwise-comm [--comm threads|mpi] [--ranks 1,2,4] [--tp-ranks 1,2]
//       [--layers L] [--width D] [--repeats R] [--sections dp,shapes,tp] [--json FILE]
//
// --comm mpi (built with DISTOPT_ENABLE_MPI): start under `mpirun -np N`; dp runs at d = N,
// shapes at d = N, tp at DP d = N / 2 (N even). Each rank runs 1 executor thread.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "layerwise_bench.hpp"

#ifdef DISTOPT_BENCH_MPI
#include <distopt/comm/mpi.hpp>
#endif

namespace {

struct settings {
  std::string comm = "threads";
  std::vector<int> ranks{1, 2, 4};
  std::vector<int> tp_ranks{1, 2};
  int layers = 1;
  std::int64_t width = 1024;
  int repeats = 2;
  std::vector<std::string> sections{"dp", "shapes", "tp"};
  std::string json_path;
};

/// One measured case, per rank and step (rank 0 of the world; bytes_sent the maximum over
/// the DP ranks).
struct result {
  std::string section, comm, policy, param, shape;
  int dp = 1, tp = 1;
  std::size_t params = 0;         ///< this rank's layout (its TP part)
  std::size_t tensors = 0, straddling = 0, factored_rows = 0, factored_cols = 0;
  double step_ms = 0;             ///< best step, slowest DP rank
  double stat_bytes = 0;          ///< statistics_bytes() per step
  double sent = 0;                ///< DP bytes_sent() per step
  lwbench::wire_model model;
};

template <class Comm>
void barrier(Comm& c) {
  std::array<double, 1> x{0};
  c.all_reduce(std::span<double>(x), distopt::reduce_op::max);
}

/// Runs on every rank of a DP x TP grid: a warm-up step, then `repeats` steps; returns the
/// per-step byte counts (the same every step) and the best step time of the slowest DP rank.
template <class Policy, class Param, class Comm>
result measure(Comm dp, Comm* tp, const distopt::layout& l, const settings& s) {
  using opt_t = distopt::optimizer<Policy, distopt::sharded<distopt::fp32>, Comm, distopt::cpu,
                                   distopt::precision<Param, Param>>;
  distopt::optimizer_options o;
  o.check_finite = false;  // its all-reduce (70 doubles) would be counted by every policy alike
  o.master_weights = true;
  const int tp_size = tp ? tp->size() : 1;
  const std::size_t d = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  opt_t opt(l, typename Policy::hyper_params{}, o, distopt::cpu(1), std::move(dp));
  if (tp) opt.set_tensor_parallel_group(std::move(*tp));
  Comm& c = opt.communicator();
  std::fill(opt.params().begin(), opt.params().end(), distopt::from_float<Param>(0.02f));
  std::fill(opt.grads().begin(), opt.grads().end(), distopt::from_float<Param>(1e-3f * static_cast<float>(rank + 1)));
  opt.step();

  result r;
  r.policy = std::string(Policy::name);
  r.param = lwbench::precision_name(!std::is_same_v<Param, float>, true);
  r.dp = static_cast<int>(d);
  r.tp = tp_size;
  r.params = l.numel();
  r.tensors = l.tensors().size();
  if constexpr (distopt::policy_is_layerwise<Policy>) {
    const typename Policy::hyper_params h{};
    r.model = lwbench::statistics_wire<Policy>(l, h, d, rank, o.bucket_elems, tp_size);
    const lwbench::dp_place place = lwbench::place_tensors(l, d, rank, o.bucket_elems);
    for (std::size_t i = 0; i < l.tensors().size(); ++i) {
      const auto& t = l.tensors()[i];
      if (d > 1 && place.straddles[i]) ++r.straddling;
      if (Policy::factored(h, t.shape)) {
        const lwbench::matrix_geometry g = lwbench::geometry(t);
        r.factored_rows += g.matrices * g.rows;
        r.factored_cols += g.matrices * g.cols;
      }
    }
  }
  double best = 1e30, stat = 0, sent = 0;
  for (int rep = 0; rep < s.repeats; ++rep) {
    barrier(c);
    const double b0 = static_cast<double>(c.bytes_sent()), s0 = static_cast<double>(opt.statistics_bytes());
    const auto t0 = std::chrono::steady_clock::now();
    opt.step();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double b1 = static_cast<double>(c.bytes_sent()), s1 = static_cast<double>(opt.statistics_bytes());
    std::array<double, 2> m{t, b1 - b0};
    c.all_reduce(std::span<double>(m), distopt::reduce_op::max);
    best = std::min(best, m[0]);
    sent = m[1];
    stat = s1 - s0;
  }
  r.step_ms = best * 1e3;
  r.stat_bytes = stat;
  r.sent = sent;
  return r;
}

// ---- output ----

void print_header() {
  std::printf("distopt-bench-layerwise-comm: sharded<fp32> states, 1 executor thread per rank, %d hardware threads; "
              "bytes per rank and step (rank 0); stat B/step: statistics_bytes(); model B: the phases' exact sums x "
              "%zu doubles; DP sent: bytes_sent() of the DP communicator (max over DP ranks); extra: minus AdamW's\n\n",
              static_cast<int>(std::thread::hardware_concurrency()), lwbench::wire_doubles);
  std::printf("%-7s %-7s %-10s %-11s %-14s %2s %2s %9s %5s %5s %6s %6s %12s %12s %6s %13s %13s %12s %8s %9s\n",
              "section", "comm", "policy", "param", "shape", "d", "tp", "params", "tens", "strad", "rows", "cols",
              "stat B/step", "model B", "match", "DP sent", "adamw sent", "extra", "extra %", "step ms");
}

void print_row(const result& r, double adamw_sent) {
  const bool lw = r.policy != "adamw";
  const double extra = r.sent - adamw_sent;
  std::printf("%-7s %-7s %-10s %-11s %-14s %2d %2d %9zu %5zu %5zu %6zu %6zu %12.0f %12zu %6s %13.0f %13.0f %12.0f %8.4f %9.2f\n",
              r.section.c_str(), r.comm.c_str(), r.policy.c_str(), r.param.c_str(), r.shape.c_str(), r.dp, r.tp,
              r.params, r.tensors, r.straddling, r.factored_rows, r.factored_cols, r.stat_bytes,
              lw ? r.model.bytes() : std::size_t{0},
              !lw ? "-" : (static_cast<double>(r.model.bytes()) == r.stat_bytes ? "yes" : "NO"), r.sent, adamw_sent,
              extra, adamw_sent > 0 ? 100.0 * extra / adamw_sent : 0.0, r.step_ms);
  std::fflush(stdout);
}

std::string json(const result& r, double adamw_sent) {
  char buf[1536];
  std::snprintf(buf, sizeof buf,
                "{\"bench\":\"layerwise_comm\",\"section\":\"%s\",\"comm\":\"%s\",\"policy\":\"%s\",\"param\":\"%s\","
                "\"shape\":\"%s\",\"dp\":%d,\"tp\":%d,\"params\":%zu,\"tensors\":%zu,\"straddling\":%zu,"
                "\"factored_rows\":%zu,\"factored_cols\":%zu,\"statistics_bytes\":%.0f,\"model_dp_bytes\":%zu,"
                "\"model_tp_bytes\":%zu,\"dp_bytes_sent\":%.0f,\"adamw_bytes_sent\":%.0f,\"extra_bytes_sent\":%.0f,"
                "\"step_ms\":%.3f}",
                r.section.c_str(), r.comm.c_str(), r.policy.c_str(), r.param.c_str(), r.shape.c_str(), r.dp, r.tp,
                r.params, r.tensors, r.straddling, r.factored_rows, r.factored_cols, r.stat_bytes,
                r.model.dp_bytes(), r.model.tp_bytes(), r.sent, adamw_sent, r.sent - adamw_sent, r.step_ms);
  return buf;
}

struct sink {
  std::vector<std::string> lines;
  void add(const result& r, double adamw_sent) {
    print_row(r, adamw_sent);
    lines.push_back(json(r, adamw_sent));
  }
  void flush(const settings& s) {
    std::printf("\n");
    std::FILE* f = s.json_path.empty() ? nullptr : std::fopen(s.json_path.c_str(), "a");
    for (const auto& l : lines) {
      std::printf("%s\n", l.c_str());
      if (f) std::fprintf(f, "%s\n", l.c_str());
    }
    if (f) std::fclose(f);
  }
};

/// A named layout of one case.
struct shape_case {
  std::string name;
  distopt::layout (*make)(distopt::dtype);
};

distopt::layout one(std::vector<std::int64_t> shape, distopt::dtype t) {
  distopt::layout l;
  l.add("w", std::move(shape), t);
  return l;
}
const std::array<shape_case, 5> shape_cases{{
    {"[1024,1024]", [](distopt::dtype t) { return one({1024, 1024}, t); }},
    {"[1024,2048]", [](distopt::dtype t) { return one({1024, 2048}, t); }},
    {"[2048,1024]", [](distopt::dtype t) { return one({2048, 1024}, t); }},
    {"[4096,4096]", [](distopt::dtype t) { return one({4096, 4096}, t); }},
    {"[1048576]", [](distopt::dtype t) { return one({1048576}, t); }},
}};

/// Every policy on one grid: `run(policy tag)` returns rank 0's result. AdamW first, its
/// bytes_sent the reference of the others.
template <class Run>
void each_policy(sink& out, const std::string& section, const std::string& comm, const std::string& shape,
                 bool print, Run&& run) {
  result a = run(static_cast<distopt::adamw*>(nullptr));
  std::vector<result> rs{a};
  rs.push_back(run(static_cast<distopt::lamb*>(nullptr)));
  rs.push_back(run(static_cast<distopt::adafactor*>(nullptr)));
  rs.push_back(run(static_cast<distopt::came*>(nullptr)));
  if (!print) return;
  for (result& r : rs) {
    r.section = section;
    r.comm = comm;
    r.shape = shape;
    out.add(r, a.sent);
  }
}

std::string gpt_name(const settings& s, int tp) {
  std::string n = "gpt L";
  n += std::to_string(s.layers);
  n += " w";
  n += std::to_string(s.width);
  if (tp > 1) n += "/tp2";
  return n;
}

bool has(const settings& s, std::string_view section) {
  return std::find(s.sections.begin(), s.sections.end(), section) != s.sections.end();
}

// ---- threads ----

int run_threads(const settings& s) {
  sink out;
  print_header();
  const auto dp_grid = [&]<class Param>(Param*, int d, const distopt::layout& l, const std::string& section,
                                        const std::string& shape) {
    each_policy(out, section, "threads", shape, true, [&]<class P>(P*) {
      result r0;
      distopt::run_ranks(
          d,
          [&](distopt::threads& c) {
            const int rank = c.rank();
            result r = measure<P, Param>(std::move(c), static_cast<distopt::threads*>(nullptr), l, s);
            if (rank == 0) r0 = std::move(r);
          },
          std::chrono::minutes(10));
      return r0;
    });
  };
  if (has(s, "dp"))
    for (int d : s.ranks) {
      dp_grid(static_cast<float*>(nullptr), d, lwbench::gpt_layers(s.layers, s.width, distopt::dtype::f32), "dp",
              gpt_name(s, 1));
      if (d > 1)
        dp_grid(static_cast<distopt::bf16*>(nullptr), d, lwbench::gpt_layers(s.layers, s.width, distopt::dtype::bf16),
                "dp", gpt_name(s, 1));
    }
  if (has(s, "shapes"))
    for (const shape_case& c : shape_cases) dp_grid(static_cast<float*>(nullptr), 2, c.make(distopt::dtype::f32), "shapes", c.name);
  if (has(s, "tp"))
    for (int d : s.tp_ranks) {
      const distopt::layout l = lwbench::gpt_layers(s.layers, s.width, distopt::dtype::f32, 2);
      each_policy(out, "tp", "threads", gpt_name(s, 2), true, [&]<class P>(P*) {
        result r0;
        distopt::run_ranks(
            2 * d,
            [&](distopt::threads& world) {
              const int rank = world.rank(), dp = rank / 2, t = rank % 2;
              distopt::threads tp = world.split(dp, t);
              distopt::threads dpc = world.split(t, dp);
              result r = measure<P, float>(std::move(dpc), &tp, l, s);
              if (rank == 0) r0 = std::move(r);
            },
            std::chrono::minutes(10));
        return r0;
      });
    }
  out.flush(s);
  return 0;
}

// ---- MPI ----

#ifdef DISTOPT_BENCH_MPI
int run_mpi(const settings& s) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  sink out;
  if (rank == 0) print_header();
  const auto dp_grid = [&]<class Param>(Param*, const distopt::layout& l, const std::string& section,
                                        const std::string& shape) {
    each_policy(out, section, "mpi", shape, rank == 0, [&]<class P>(P*) {
      return measure<P, Param>(distopt::mpi(MPI_COMM_WORLD), static_cast<distopt::mpi*>(nullptr), l, s);
    });
  };
  if (has(s, "dp")) {
    dp_grid(static_cast<float*>(nullptr), lwbench::gpt_layers(s.layers, s.width, distopt::dtype::f32), "dp", gpt_name(s, 1));
    if (size > 1)
      dp_grid(static_cast<distopt::bf16*>(nullptr), lwbench::gpt_layers(s.layers, s.width, distopt::dtype::bf16), "dp",
              gpt_name(s, 1));
  }
  if (has(s, "shapes") && size > 1)
    for (const shape_case& c : shape_cases) dp_grid(static_cast<float*>(nullptr), c.make(distopt::dtype::f32), "shapes", c.name);
  if (has(s, "tp") && size % 2 == 0) {
    const distopt::layout l = lwbench::gpt_layers(s.layers, s.width, distopt::dtype::f32, 2);
    const int dp = rank / 2, t = rank % 2;
    each_policy(out, "tp", "mpi", gpt_name(s, 2), rank == 0, [&]<class P>(P*) {
      distopt::mpi world(MPI_COMM_WORLD);
      distopt::mpi tp = world.split(dp, t);
      distopt::mpi dpc = world.split(t, dp);
      return measure<P, float>(std::move(dpc), &tp, l, s);
    });
  }
  if (rank == 0) out.flush(s);
  return 0;
}
#endif

std::vector<std::string> split_list(std::string_view v) {
  std::vector<std::string> out;
  while (!v.empty()) {
    const std::size_t comma = v.find(',');
    out.emplace_back(v.substr(0, comma));
    v = comma == std::string_view::npos ? std::string_view() : v.substr(comma + 1);
  }
  return out;
}

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-layerwise-comm: %s\nusage: distopt-bench-layerwise-comm [--comm threads|mpi] "
               "[--ranks 1,2,4] [--tp-ranks 1,2] [--layers L] [--width D] [--repeats R] "
               "[--sections dp,shapes,tp] [--json FILE]\n",
               bad);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) return usage("missing value");
    const char* v = argv[i + 1];
    const auto ints = [&] {
      std::vector<int> out;
      for (const auto& x : split_list(v)) out.push_back(std::atoi(x.c_str()));
      return out;
    };
    if (a == "--comm") s.comm = v;
    else if (a == "--ranks") s.ranks = ints();
    else if (a == "--tp-ranks") s.tp_ranks = ints();
    else if (a == "--layers") s.layers = std::atoi(v);
    else if (a == "--width") s.width = std::atoll(v);
    else if (a == "--repeats") s.repeats = std::atoi(v);
    else if (a == "--sections") s.sections = split_list(v);
    else if (a == "--json") s.json_path = v;
    else return usage(("unknown option " + std::string(a)).c_str());
  }
  const auto bad_rank = [](int d) { return d < 1; };
  if (s.layers < 0 || s.width < 8 || s.width % 2 != 0 || s.repeats < 1 || s.ranks.empty() ||
      std::any_of(s.ranks.begin(), s.ranks.end(), bad_rank) || std::any_of(s.tp_ranks.begin(), s.tp_ranks.end(), bad_rank))
    return usage("invalid value");
  if (s.comm == "threads") {
    try {
      return run_threads(s);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distopt-bench-layerwise-comm: %s\n", e.what());
      return 1;
    }
  }
  if (s.comm != "mpi") return usage("--comm: threads or mpi");
#ifdef DISTOPT_BENCH_MPI
  distopt::mpi_session session;
  try {
    return run_mpi(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distopt-bench-layerwise-comm: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 1;
#else
  return usage("--comm mpi: this build has no MPI (configure with -DDISTOPT_ENABLE_MPI=ON)");
#endif
}
