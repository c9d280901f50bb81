// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-sharded: one data-parallel AdamW step with sharded optimizer state
// (distopt::sharded<fp32>) against the number of ranks d, split into its three phases:
// reduce (reduce_grads: one reduce-scatter per bucket), update (the fused update of this
// rank's shard) and gather (gather_params: one all-gather per bucket). For each phase it
// records communicator().bytes_sent() (the ring byte model of comm/threads.hpp) and
// compares the step's bytes with the theory, computed here from the layout alone:
// per bucket (d-1) * shard * sizeof(grad) for the reduce-scatter plus (d-1) * shard *
// sizeof(param) for the all-gather, that is 2 (d-1)/d of the padded param bytes.
//
//   distopt-bench-sharded [--params N] [--ranks 1,2,4] [--threads T] [--repeats R]
//                         [--bucket E] [--check-finite off|on|both] [--json FILE]
//                         [--comm threads|mpi]
//
// --comm threads (the default) runs every d of --ranks as threads of this process
// (distopt::run_ranks). --comm mpi (built with DISTOPT_ENABLE_MPI) runs one rank per MPI
// process: start it with `mpirun -np d`; --ranks is ignored. --threads is each rank's
// executor threads. Prints a table, then one JSON line per row (also appended to FILE).

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

#include "step_bench.hpp"

#ifdef DISTOPT_BENCH_MPI
#include <distopt/comm/mpi.hpp>
#endif

namespace {

struct settings {
  std::size_t params = std::size_t{16} << 20;
  std::vector<int> ranks{1, 2, 3, 4, 5, 6, 7, 8};
  int threads = 1;
  int repeats = 5;
  std::size_t bucket_elems = distopt::optimizer_options{}.bucket_elems;
  std::string check_finite = "both";
  std::string json_path;
  std::string comm = "threads";
};

/// Elements of the padded buffers for d ranks, worked out from the layout by the rule
/// shard_plan documents (buckets of whole tensors closed once they reach bucket_elems,
/// each cut into d shards of whole blocks), not read back from the optimizer.
struct padded_plan {
  std::size_t buckets = 0;
  std::size_t shard_sum = 0;  ///< sum over buckets of one rank's shard, padding included
};

padded_plan plan_for(const distopt::layout& l, std::size_t d, std::size_t bucket_elems) {
  const std::size_t block = l.block_size();
  const auto tensors = l.tensors();
  padded_plan p;
  for (std::size_t t = 0; t < tensors.size();) {
    const std::size_t begin = tensors[t].offset;
    std::size_t end = begin;
    do {
      end = tensors[t].offset + (tensors[t].numel + block - 1) / block * block;
      ++t;
    } while (t < tensors.size() && end - begin < bucket_elems);
    const std::size_t blocks = (end - begin) / block;
    p.shard_sum += (blocks + d - 1) / d * block;
    ++p.buckets;
  }
  return p;
}

/// One measured (comm, d, precision, check_finite) case. Times are the slowest rank's: the
/// phases from the repeat whose phases add up to the least, the step the shortest of all
/// repeats. Bytes are per rank per step.
struct result {
  std::string comm, param, grad;
  int ranks = 1, threads = 1;
  bool check_finite = false;
  std::size_t params = 0, padded = 0, buckets = 0;
  std::size_t grad_size = 0, param_size = 0;
  double reduce_s = 0, update_s = 0, gather_s = 0, step_s = 0;
  double rs_bytes = 0, update_bytes = 0, ag_bytes = 0;  ///< per phase, max over ranks
  double step_bytes_min = 0, step_bytes_max = 0;        ///< the whole step, over ranks
  double theory_rs = 0, theory_ag = 0;                  ///< padded: what the ring must send
  double ideal = 0;                                     ///< 2 (d-1)/d of the unpadded bytes
  bool padded_matches = true;  ///< the optimizer's buffers have the size the plan above says

  double theory() const { return theory_rs + theory_ag; }
  double measured() const { return step_bytes_max; }
  double ratio() const { return measured() == theory() ? 1.0 : measured() / theory(); }
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs on every rank: builds the optimizer, takes a warm-up step, then `repeats` timed
/// steps, and returns the result (the same on every rank).
template <class Param, class Grad, class Comm>
result measure(Comm comm, const settings& s, bool check_finite, const char* comm_name) {
  using opt_t = distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32>, Comm, distopt::cpu,
                                   distopt::precision<Param, Grad>>;
  distopt::optimizer_options o;
  o.check_finite = check_finite;
  o.gather_params = false;  // gather_params() is called (and timed) separately
  o.bucket_elems = s.bucket_elems;
  o.master_weights = true;
  const int rank = comm.rank();
  const auto d = static_cast<std::size_t>(comm.size());
  opt_t opt(bench::gpt_like(s.params, distopt::dtype_of<Param>), distopt::adamw::hyper_params{}, o,
            distopt::cpu(s.threads), std::move(comm));
  Comm& c = opt.communicator();

  std::fill(opt.params().begin(), opt.params().end(), distopt::from_float<Param>(0.02f));
  // Grads differ by rank, so the reduction is not of equal terms.
  const Grad g = distopt::from_float<Grad>(1e-3f * static_cast<float>(rank + 1));
  auto write_grads = [&] {  // stands in for backward; not timed
    auto grads = opt.grads();
    constexpr std::size_t chunk = 1 << 16;
    opt.executor().parallel_for((grads.size() + chunk - 1) / chunk, [&](std::size_t i) {
      std::fill(grads.begin() + static_cast<std::ptrdiff_t>(i * chunk),
                grads.begin() + static_cast<std::ptrdiff_t>(std::min(grads.size(), (i + 1) * chunk)), g);
    });
  };
  auto barrier = [&] {
    std::array<double, 1> x{0};
    c.all_reduce(std::span<double>(x), distopt::reduce_op::max);
  };

  result r;
  r.comm = comm_name;
  r.param = std::string(distopt::dtype_name(distopt::dtype_of<Param>));
  if (!std::is_same_v<Param, float>) r.param += "+master";
  r.grad = std::string(distopt::dtype_name(distopt::dtype_of<Grad>));
  r.ranks = static_cast<int>(d);
  r.threads = opt.executor().concurrency();
  r.check_finite = check_finite;
  r.params = opt.tensors().numel();
  r.padded = opt.params().size();
  r.grad_size = sizeof(Grad);
  r.param_size = sizeof(Param);
  const padded_plan plan = plan_for(opt.tensors(), d, s.bucket_elems);
  r.buckets = plan.buckets;
  r.padded_matches = plan.shard_sum * d == r.padded;
  r.theory_rs = static_cast<double>((d - 1) * plan.shard_sum * sizeof(Grad));
  r.theory_ag = static_cast<double>((d - 1) * plan.shard_sum * sizeof(Param));
  r.ideal = 2.0 * static_cast<double>(d - 1) / static_cast<double>(d) * static_cast<double>(r.params) *
            static_cast<double>(sizeof(Grad) + sizeof(Param)) / 2.0;

  write_grads();
  opt.reduce_grads();  // warm-up step: first touch, master weights loaded, states started
  opt.step();
  opt.gather_params();

  // Each repeat takes two steps. The first times the phases one by one, each started
  // together on every rank (a barrier before each, outside the timings and byte counts);
  // the second is the step as training runs it, without barriers: its time is `step_s`.
  double best_phases = 1e30;
  r.step_s = 1e30;
  for (int rep = 0; rep < s.repeats; ++rep) {
    write_grads();
    barrier();
    const double b0 = static_cast<double>(c.bytes_sent()), t0 = now_s();
    opt.reduce_grads();
    const double t1 = now_s(), b1 = static_cast<double>(c.bytes_sent());
    barrier();
    const double b1b = static_cast<double>(c.bytes_sent()), t1b = now_s();
    opt.step();
    const double t2 = now_s(), b2 = static_cast<double>(c.bytes_sent());
    barrier();
    const double b2b = static_cast<double>(c.bytes_sent()), t2b = now_s();
    opt.gather_params();
    const double t3 = now_s(), b3 = static_cast<double>(c.bytes_sent());

    write_grads();
    barrier();
    const double s0 = now_s(), c0 = static_cast<double>(c.bytes_sent());
    opt.reduce_grads();
    opt.step();  // gather_params is off: reduce_grads + step + gather_params is step() with it on
    opt.gather_params();
    const double s1 = now_s(), c1 = static_cast<double>(c.bytes_sent());

    // The slowest rank's times and the extremes of the byte counts, in one max-reduction
    // (a minimum is the max of the negated value).
    std::array<double, 9> m{t1 - t0, t2 - t1b, t3 - t2b, s1 - s0, b1 - b0, b2 - b1b, b3 - b2b, c1 - c0, -(c1 - c0)};
    c.all_reduce(std::span<double>(m), distopt::reduce_op::max);
    if (m[0] + m[1] + m[2] < best_phases) {
      best_phases = m[0] + m[1] + m[2];
      r.reduce_s = m[0];
      r.update_s = m[1];
      r.gather_s = m[2];
      r.rs_bytes = m[4];
      r.update_bytes = m[5];
      r.ag_bytes = m[6];
    }
    r.step_s = std::min(r.step_s, m[3]);
    r.step_bytes_max = m[7];
    r.step_bytes_min = -m[8];
  }
  return r;
}

double gbps(double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; }

void print_header() {
  std::printf("%-7s %2s %3s %-12s %-4s %-6s %8s %8s %8s %8s %8s %11s %11s %9s %7s %7s %7s %7s %7s\n", "comm", "d",
              "T", "param", "grad", "finite", "step ms", "reduce", "update", "gather", "upd ns/p", "bytes/rank",
              "theory", "ratio", "+bytes", "RS GB/s", "AG GB/s", "RS mem", "AG mem");
}

/// Memory traffic of the `threads` collectives, summed over ranks (write-allocate not
/// counted): a reduce-scatter rank reads its shard from all d ranks and writes it once,
/// (d+1) * padded elements in all; an all-gather rank copies d-1 shards in, 2 (d-1) * padded.
double rs_memory_bytes(const result& r) {
  return static_cast<double>(r.ranks + 1) * static_cast<double>(r.padded * r.grad_size);
}
double ag_memory_bytes(const result& r) {
  return 2.0 * static_cast<double>(r.ranks - 1) * static_cast<double>(r.padded * r.param_size);
}

void print_row(const result& r, int cores) {
  const bool threads = r.comm == "threads";
  const bool multi = r.ranks > 1;
  const bool over = r.ranks * r.threads > cores;
  char rs_mem[16] = "-", ag_mem[16] = "-";
  if (threads && multi) {
    std::snprintf(rs_mem, sizeof rs_mem, "%.1f", gbps(rs_memory_bytes(r), r.reduce_s));
    std::snprintf(ag_mem, sizeof ag_mem, "%.1f", gbps(ag_memory_bytes(r), r.gather_s));
  }
  std::printf("%-7s %2d %2d%s %-12s %-4s %-6s %8.2f %8.2f %8.2f %8.2f %8.3f %11.0f %11.0f %9.6f %7.0f %7.1f %7.1f %7s %7s\n",
              r.comm.c_str(), r.ranks, r.threads, over ? "*" : " ", r.param.c_str(), r.grad.c_str(),
              r.check_finite ? "on" : "off", r.step_s * 1e3, r.reduce_s * 1e3, r.update_s * 1e3, r.gather_s * 1e3,
              r.update_s * r.ranks / static_cast<double>(r.params) * 1e9, r.measured(), r.theory(), r.ratio(),
              r.measured() - r.theory(), multi ? gbps(r.rs_bytes, r.reduce_s) : 0.0,
              multi ? gbps(r.ag_bytes, r.gather_s) : 0.0, rs_mem, ag_mem);
  if (!r.padded_matches)
    std::printf("  warning: the optimizer's buffers (%zu elements) are not the padded size the plan gives\n",
                r.padded);
  if (r.rs_bytes + r.update_bytes + r.ag_bytes != r.step_bytes_max)
    std::printf("  warning: the phases sent %.0f bytes, the step %.0f\n", r.rs_bytes + r.update_bytes + r.ag_bytes,
                r.step_bytes_max);
  if (!r.check_finite && r.step_bytes_min != r.step_bytes_max)
    std::printf("  warning: ranks sent different byte counts (%.0f to %.0f)\n", r.step_bytes_min, r.step_bytes_max);
  std::fflush(stdout);
}

std::string json(const result& r, int cores) {
  char buf[1536];
  const bool threads = r.comm == "threads" && r.ranks > 1;
  std::snprintf(
      buf, sizeof buf,
      "{\"bench\":\"sharded_step\",\"comm\":\"%s\",\"ranks\":%d,\"threads_per_rank\":%d,\"cores\":%d,"
      "\"policy\":\"adamw\",\"param\":\"%s\",\"grad\":\"%s\",\"state\":\"fp32\",\"check_finite\":%s,"
      "\"params\":%zu,\"padded\":%zu,\"buckets\":%zu,\"step_ms\":%.4f,\"reduce_ms\":%.4f,\"update_ms\":%.4f,"
      "\"gather_ms\":%.4f,\"phases_ms\":%.4f,\"update_ns_per_param\":%.4f,\"bytes_reduce\":%.0f,\"bytes_update\":%.0f,"
      "\"bytes_gather\":%.0f,\"bytes_per_rank\":%.0f,\"bytes_per_rank_min\":%.0f,\"theory_bytes\":%.0f,"
      "\"unpadded_bytes\":%.0f,\"ratio\":%.6f,\"extra_bytes\":%.0f,\"rs_busbw_gbps\":%.3f,"
      "\"ag_busbw_gbps\":%.3f,\"rs_mem_gbps\":%.3f,\"ag_mem_gbps\":%.3f}",
      r.comm.c_str(), r.ranks, r.threads, cores, r.param.c_str(), r.grad.c_str(), r.check_finite ? "true" : "false",
      r.params, r.padded, r.buckets, r.step_s * 1e3, r.reduce_s * 1e3, r.update_s * 1e3, r.gather_s * 1e3,
      (r.reduce_s + r.update_s + r.gather_s) * 1e3, r.update_s * r.ranks / static_cast<double>(r.params) * 1e9, r.rs_bytes, r.update_bytes, r.ag_bytes,
      r.measured(), r.step_bytes_min, r.theory(), r.ideal, r.ratio(), r.measured() - r.theory(),
      r.ranks > 1 ? gbps(r.rs_bytes, r.reduce_s) : 0.0, r.ranks > 1 ? gbps(r.ag_bytes, r.gather_s) : 0.0,
      threads ? gbps(rs_memory_bytes(r), r.reduce_s) : 0.0, threads ? gbps(ag_memory_bytes(r), r.gather_s) : 0.0);
  return buf;
}

std::vector<bool> finite_modes(const settings& s) {
  if (s.check_finite == "off") return {false};
  if (s.check_finite == "on") return {true};
  return {false, true};
}

/// Every case for one communicator handle factory: `run(precision tag, check_finite)`.
template <class Run>
void each_case(const settings& s, Run&& run) {
  for (bool cf : finite_modes(s)) run(static_cast<float*>(nullptr), cf);
  for (bool cf : finite_modes(s)) run(static_cast<distopt::bf16*>(nullptr), cf);
}

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-sharded: %s\nusage: distopt-bench-sharded [--params N] [--ranks 1,2,4] "
               "[--threads T] [--repeats R] [--bucket E] [--check-finite off|on|both] [--json FILE] "
               "[--comm threads|mpi]\n",
               bad);
  return 2;
}

void emit(const std::vector<result>& rows, const settings& s, int cores) {
  std::printf("\n");
  std::FILE* f = s.json_path.empty() ? nullptr : std::fopen(s.json_path.c_str(), "a");
  for (const result& r : rows) {
    const std::string line = json(r, cores);
    std::printf("%s\n", line.c_str());
    if (f) std::fprintf(f, "%s\n", line.c_str());
  }
  if (f) std::fclose(f);
}

void print_intro(const settings& s, int cores, const char* comm, const std::string& ranks) {
  std::printf("distopt-bench-sharded: adamw, sharded<fp32> states, %zu params, bucket %zu elements, %s ranks %s, "
              "%d executor thread(s) per rank, %d hardware threads, best of %d steps\n",
              s.params, s.bucket_elems, comm, ranks.c_str(), s.threads, cores, s.repeats);
  std::printf("times: the slowest rank's. step: reduce_grads + step + gather_params as training runs them; "
              "reduce, update, gather: each phase started on all ranks at once (barriers between them).\n"
              "bytes: per rank per step (bytes_sent); theory: 2 (d-1)/d of the padded param bytes; "
              "* = more threads than cores\n\n");
  print_header();
  std::fflush(stdout);
}

int run_threads(const settings& s, int cores) {
  std::string list;
  for (int d : s.ranks) {
    if (!list.empty()) list += ',';
    list += std::to_string(d);  // appended: GCC 12 warns -Wrestrict on "," + std::string
  }
  print_intro(s, cores, "threads", list);
  std::vector<result> rows;
  each_case(s, [&]<class P>(P*, bool cf) {
    for (int d : s.ranks) {
      result out;
      distopt::run_ranks(
          d,
          [&](distopt::threads& c) {
            const int rank = c.rank();
            result r = measure<P, P>(std::move(c), s, cf, "threads");
            if (rank == 0) out = std::move(r);
          },
          std::chrono::minutes(10));
      print_row(out, cores);
      rows.push_back(std::move(out));
    }
  });
  emit(rows, s, cores);
  return 0;
}

#ifdef DISTOPT_BENCH_MPI
int run_mpi(const settings& s, int cores) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Every process of this node shares its cores: ranks * threads over the node's cores.
  if (rank == 0) print_intro(s, cores, "mpi", std::to_string(size));
  std::vector<result> rows;
  each_case(s, [&]<class P>(P*, bool cf) {
    result r = measure<P, P>(distopt::mpi(MPI_COMM_WORLD), s, cf, "mpi");
    if (rank == 0) {
      print_row(r, cores);
      rows.push_back(std::move(r));
    }
  });
  if (rank == 0) emit(rows, s, cores);
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) return usage("missing value");
    const char* v = argv[i + 1];
    if (a == "--params") s.params = std::strtoull(v, nullptr, 10);
    else if (a == "--threads") s.threads = std::atoi(v);
    else if (a == "--repeats") s.repeats = std::atoi(v);
    else if (a == "--bucket") s.bucket_elems = std::strtoull(v, nullptr, 10);
    else if (a == "--check-finite") s.check_finite = v;
    else if (a == "--json") s.json_path = v;
    else if (a == "--comm") s.comm = v;
    else if (a == "--ranks") {
      s.ranks.clear();
      for (std::string_view rest = v; !rest.empty();) {
        const std::size_t comma = rest.find(',');
        s.ranks.push_back(std::atoi(std::string(rest.substr(0, comma)).c_str()));
        rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      }
    } else return usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.params == 0 || s.repeats < 1 || s.threads < 1 || s.bucket_elems == 0 || s.ranks.empty() ||
      std::any_of(s.ranks.begin(), s.ranks.end(), [](int d) { return d < 1; }))
    return usage("invalid value");
  if (s.check_finite != "off" && s.check_finite != "on" && s.check_finite != "both")
    return usage("--check-finite: off, on or both");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  if (s.comm == "threads") {
    try {
      return run_threads(s, cores);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distopt-bench-sharded: %s\n", e.what());
      return 1;
    }
  }
  if (s.comm != "mpi") return usage("--comm: threads or mpi");
#ifdef DISTOPT_BENCH_MPI
  distopt::mpi_session session;
  try {
    return run_mpi(s, cores);
  } catch (const std::exception& e) {
    // Returning through ~mpi_session would wait for the other ranks in MPI_Finalize.
    std::fprintf(stderr, "distopt-bench-sharded: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 1;
#else
  return usage("--comm mpi: this build has no MPI (configure with -DDISTOPT_ENABLE_MPI=ON)");
#endif
}
