// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-zero: what the overlap hooks hide. A data-parallel AdamW training loop on
// the GPT-like layout (fp32, sharded states at --stage 1, 2 or 3) with a modelled
// backward: for each layer, last first, a compute loop of --backward-ns nanoseconds per
// parameter of the layer (scalar arithmetic on a private array, no memory traffic worth
// counting), then the layer's grads are written. With the hooks each layer is declared
// ready right after (grads_ready), so its buckets' reduce-scatters run behind the next
// layers' compute; without them every collective runs inside step(). At stage 3 each
// layer is gathered before its backward and released after (the next one prefetched).
//
//   distopt-bench-zero [--params N] [--stage 1|2|3] [--backward-ns X] [--bucket E]
//                      [--repeats R] [--ranks d] [--comm threads|mpi] [--bf16] [--offload]
//                      [--accumulate N] [--accumulate-schedule last|each]
//
// --bf16: bf16 params and grads with fp32 master weights (fp32 params without it).
// --offload: ZeRO-Offload (distopt/offload.hpp) on the emulated device, bf16 params and
// grads with fp32 master weights; the params and grads are written through copies (a GPU
// backward writes them in place), grads_ready and step() copy them to and from the host.
// Rank 0's memory report (hooks on) is printed after the table, with or without --offload.
// --accumulate N: gradient accumulation, N micro-batches a step (optimizer_options::
// micro_batches), each a whole modelled backward whose grads are added into the views, and
// end_micro_batch() after each; --accumulate-schedule picks reduce_last (the default) or
// reduce_each (with --offload the device views are added into through copies). Rank 0's
// bytes sent per iteration are printed beside the byte model of the grads' reductions and
// the params' gathers (threads.hpp's ring model).
//
// For each mode (hooks off, on) it prints rank 0's median over --repeats iterations of
// the backward time, the step() time and their sum, and "exposed": the sum minus the same
// loop's sum without communication (every rank runs it at once with the `single`
// communicator, so the machine is as loaded as in the real run): the communication
// that backward did not hide.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <distopt/offload.hpp>
#endif

#include "step_bench.hpp"

#ifdef DISTOPT_BENCH_MPI
#include <distopt/comm/mpi.hpp>
#endif

namespace {

using clock_type = std::chrono::steady_clock;

struct settings {
  std::size_t params = std::size_t{64} << 20;
  int stage = 2;
  double backward_ns = 2.0;
  std::size_t bucket_elems = std::size_t{1} << 22;
  int repeats = 5;
  int ranks = 2;
  std::string comm = "threads";
  bool offload = false;
  bool bf16 = false;  // bf16 params and grads with fp32 master weights (always with --offload)
  int accumulate = 1;
  bool each = false;  // accumulation::reduce_each
};

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

/// The layers of the layout: the tensors sharing a name up to the first '.' ("h3.qkv",
/// "h3.fc" ...), in layout order.
std::vector<std::vector<std::string>> layers_of(const distopt::layout& l) {
  std::vector<std::vector<std::string>> layers;
  std::string last;
  for (const auto& t : l.tensors()) {
    const std::string key = t.name.substr(0, t.name.find('.'));
    if (layers.empty() || key != last) layers.emplace_back();
    layers.back().push_back(t.name);
    last = key;
  }
  return layers;
}

/// `steps` multiply-adds in a dependent chain (not vectorisable, no memory traffic).
[[gnu::noinline]] float chain(std::size_t steps, float acc) {
  for (std::size_t i = 0; i < steps; ++i) acc = acc * 0.9999999f + 1e-7f;
  return acc;
}

/// backward_ns per parameter of compute, through `chain` calibrated once (its ns per
/// step); returns the chain's result so that it is not optimised away.
float model_compute(std::size_t params, double ns_per_param, float seed) {
  static const double per_step_ns = [seed] {
    const std::size_t n = 20'000'000;
    const auto t = clock_type::now();
    volatile float sink = chain(n, seed);
    (void)sink;
    return std::max(1e-3, seconds_since(t) * 1e9 / static_cast<double>(n));
  }();
  return chain(static_cast<std::size_t>(static_cast<double>(params) * ns_per_param / per_step_ns), seed);
}

struct timing {
  double backward = 0, step = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// Sets every element of `v`, a view in host or device memory, to x.
template <class Opt, class View>
void fill(Opt& opt, View v, float x) {
  using T = typename View::value_type;
  if constexpr (std::is_same_v<View, std::span<T>>) {
    std::fill(v.begin(), v.end(), distopt::from_float<T>(x));
  } else {
    const std::vector<T> h(v.size(), distopt::from_float<T>(x));
    distopt::upload(opt.executor(), h, v);
  }
}

/// Adds x to every element of `v`, a view in host or device memory (through copies, as
/// fill writes one), as a backward adds into .grad.
template <class Opt, class View>
void add(Opt& opt, View v, float x) {
  using T = typename View::value_type;
  if constexpr (std::is_same_v<View, std::span<T>>) {
    for (auto& g : v) g = distopt::from_float<T>(distopt::to_float(g) + x);
  } else {
    std::vector<T> h(v.size());
    distopt::download(opt.executor(), v, std::span<T>(h));
    for (auto& g : h) g = distopt::from_float<T>(distopt::to_float(g) + x);
    distopt::upload(opt.executor(), std::span<const T>(h), v);
  }
}

/// Rank 0's bytes sent per iteration with the hooks (set by run_loop with `mem`).
std::size_t sent_per_iteration = 0;

/// One training loop's iterations; returns rank 0's per-iteration timings, and with `mem`
/// the optimizer's memory report at the end.
template <class Opt>
std::vector<timing> run_loop(Opt& opt, const settings& s, bool hooks, distopt::memory_report* mem) {
  const auto layers = layers_of(opt.tensors());
  std::map<std::string, std::size_t> numel;
  for (const auto& t : opt.tensors().tensors()) numel[t.name] = t.numel;
  for (const auto& layer : layers) {  // initial params
    opt.gather(layer);
    for (const auto& n : layer) fill(opt, opt.param(n), 0.01f);
    opt.release(layer, distopt::keep_writes);
  }
  std::vector<timing> out;
  float sink = 0;
  const std::size_t sent_before = opt.communicator().bytes_sent();
  for (int it = 0; it < s.repeats + 1; ++it) {  // the first iteration warms up
    const auto t0 = clock_type::now();
    for (int m = 0; m < s.accumulate; ++m) {
      for (std::size_t j = layers.size(); j-- > 0;) {
        if (j > 0) opt.prefetch(layers[j - 1]);
        opt.gather(layers[j]);
        std::size_t n = 0;
        for (const auto& name : layers[j]) n += numel[name];
        sink += model_compute(n, s.backward_ns, sink);
        for (const auto& name : layers[j]) {
          if (s.accumulate == 1) fill(opt, opt.grad(name), 1e-3f);
          else add(opt, opt.grad(name), 1e-3f);  // into views zeroed at the step's (reduce_each: micro-batch's) first use
        }
        if (hooks) opt.grads_ready(layers[j]);
        opt.release(layers[j]);
      }
      if (s.accumulate > 1) opt.end_micro_batch();
    }
    const double backward = seconds_since(t0);
    const auto t1 = clock_type::now();
    opt.step();
    const double step = seconds_since(t1);
    if (it > 0) out.push_back({backward, step});
  }
  volatile float keep = sink;
  (void)keep;
  if (mem) {  // rank 0's run with the hooks
    sent_per_iteration = (opt.communicator().bytes_sent() - sent_before) / static_cast<std::size_t>(s.repeats + 1);
    *mem = opt.memory();
  }
  return out;
}

template <int Stage, class Comm>
std::vector<timing> run_stage(const settings& s, Comm comm, bool hooks, distopt::memory_report* mem) {
  distopt::optimizer_options o;
  o.bucket_elems = s.bucket_elems;
  o.micro_batches = s.accumulate;
  o.accumulate = s.each ? distopt::accumulation::reduce_each : distopt::accumulation::reduce_last;
  distopt::adamw::hyper_params h;
  h.lr = 1e-4;
  if (s.offload) {
#if defined(__linux__)
    using exec = distopt::offload<distopt::emulated_device>;
    distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32, Stage>, Comm, exec,
                       distopt::precision<distopt::bf16>>
        opt(bench::gpt_like(s.params, distopt::dtype::bf16), h, o, exec(1), std::move(comm));
    return run_loop(opt, s, hooks, mem);
#endif
  }
  if (s.bf16) {
    distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32, Stage>, Comm, distopt::cpu,
                       distopt::precision<distopt::bf16>>
        opt(bench::gpt_like(s.params, distopt::dtype::bf16), h, o, distopt::cpu(1), std::move(comm));
    return run_loop(opt, s, hooks, mem);
  }
  distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32, Stage>, Comm> opt(
      bench::gpt_like(s.params, distopt::dtype::f32), h, o, distopt::cpu(1), std::move(comm));
  return run_loop(opt, s, hooks, mem);
}

template <class Comm>
std::vector<timing> run(const settings& s, Comm comm, bool hooks, distopt::memory_report* mem = nullptr) {
  if (s.stage == 1) return run_stage<1>(s, std::move(comm), hooks, mem);
  if (s.stage == 2) return run_stage<2>(s, std::move(comm), hooks, mem);
  return run_stage<3>(s, std::move(comm), hooks, mem);
}

double total_median(const std::vector<timing>& t) {
  std::vector<double> sum;
  for (const auto& x : t) sum.push_back(x.backward + x.step);
  return median(sum);
}

void report(const char* mode, const std::vector<timing>& t, double base) {
  std::vector<double> b, st, sum;
  for (const auto& x : t) {
    b.push_back(x.backward);
    st.push_back(x.step);
    sum.push_back(x.backward + x.step);
  }
  std::printf("%-10s %12.1f %12.1f %12.1f %12.1f\n", mode, median(b) * 1e3, median(st) * 1e3, median(sum) * 1e3,
              (median(sum) - base) * 1e3);
}

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "distopt-bench-zero: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--params") s.params = std::stoull(value());
    else if (a == "--stage") s.stage = std::stoi(value());
    else if (a == "--backward-ns") s.backward_ns = std::stod(value());
    else if (a == "--bucket") s.bucket_elems = std::stoull(value());
    else if (a == "--repeats") s.repeats = std::stoi(value());
    else if (a == "--ranks") s.ranks = std::stoi(value());
    else if (a == "--comm") s.comm = value();
    else if (a == "--offload") s.offload = s.bf16 = true;
    else if (a == "--bf16") s.bf16 = true;
    else if (a == "--accumulate") s.accumulate = std::stoi(value());
    else if (a == "--accumulate-schedule") {
      const std::string v = value();
      if (v != "last" && v != "each") {
        std::fprintf(stderr, "distopt-bench-zero: --accumulate-schedule last|each, got %s\n", v.c_str());
        std::exit(2);
      }
      s.each = v == "each";
    }
    else {
      std::fprintf(stderr, "distopt-bench-zero: unknown argument %s\n", argv[i]);
      std::exit(2);
    }
  }
  if (s.stage < 1 || s.stage > 3 || s.repeats < 1 || s.ranks < 1 || (s.comm != "threads" && s.comm != "mpi") ||
      s.accumulate < 1) {
    std::fprintf(stderr,
                 "distopt-bench-zero: --stage 1..3, --repeats >= 1, --ranks >= 1, --comm threads|mpi, --accumulate >= 1\n");
    std::exit(2);
  }
#if !defined(__linux__)
  if (s.offload) {
    std::fprintf(stderr, "distopt-bench-zero: --offload needs the emulated device (Linux)\n");
    std::exit(2);
  }
#endif
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  const auto layers = layers_of(bench::gpt_like(s.params, distopt::dtype::f32));
  std::vector<double> alone;  // the modelled backward's compute, nothing else
  for (int it = 0; it < s.repeats; ++it) {
    const auto t = clock_type::now();
    volatile float sink = model_compute(s.params, s.backward_ns, 1.0f);
    (void)sink;
    alone.push_back(seconds_since(t));
  }
  const double compute = median(alone);
  std::vector<timing> off, on, alone_loop;
  distopt::memory_report mem;
  int d = s.ranks;
  bool print = true;
  if (s.comm == "mpi") {
#ifdef DISTOPT_BENCH_MPI
    distopt::mpi_session session(argc, argv);
    distopt::mpi world(MPI_COMM_WORLD);
    d = world.size();
    print = world.rank() == 0;
    alone_loop = run(s, distopt::single{}, false);
    off = run(s, distopt::mpi(MPI_COMM_WORLD), false);
    on = run(s, distopt::mpi(MPI_COMM_WORLD), true, &mem);
#else
    std::fprintf(stderr, "distopt-bench-zero: built without MPI (configure with -DDISTOPT_ENABLE_MPI=ON)\n");
    return 2;
#endif
  } else {
    distopt::run_ranks(d, [&](distopt::threads& comm) {
      auto t = run(s, distopt::single{}, false);
      if (comm.rank() == 0) alone_loop = std::move(t);
    });
    for (const bool hooks : {false, true})
      distopt::run_ranks(d, [&](distopt::threads& comm) {
        const int rank = comm.rank();
        auto t = run(s, std::move(comm), hooks, hooks && rank == 0 ? &mem : nullptr);
        if (rank == 0) (hooks ? on : off) = std::move(t);
      });
  }
  if (!print) return 0;
  std::printf("distopt-bench-zero: %zu params (%zu layers), stage %d%s, d = %d (%s), buckets of %zu, "
              "backward %.2f ns/param (compute alone %.1f ms), median of %d\n",
              s.params, layers.size(), s.stage, s.offload ? " offloaded (emulated device), bf16 + master" : s.bf16 ? ", bf16 + master" : "", d,
              s.comm.c_str(), s.bucket_elems, s.backward_ns, compute * 1e3, s.repeats);
  std::printf("%-10s %12s %12s %12s %12s\n", "hooks", "backward ms", "step ms", "total ms", "exposed ms");
  const double base = total_median(alone_loop);
  report("no comm", alone_loop, base);
  report("off", off, base);
  report("on", on, base);
  // The byte model: a reduce-scatter of the padded grads per reduction (every micro-batch with
  // reduce_each), and an all-gather of the params (after the step at stages 1 and 2; at stage
  // 3 each layer's per micro-batch, prefetched); (d - 1)/d of each, at the element's size.
  {
    const distopt::layout l = bench::gpt_like(s.params, s.bf16 ? distopt::dtype::bf16 : distopt::dtype::f32);
    const std::size_t bucket = s.bucket_elems, elem = s.bf16 ? 2 : 4;
    const auto ranks = static_cast<std::size_t>(d), block = l.block_size();
    const auto cut = [&](std::size_t e) { return (e / block + ranks - 1) / ranks * block * ranks; };  // d shards of blocks
    std::size_t padded = 0, open = 0;  // buckets close once they reach bucket_elems
    for (const auto& t : l.tensors()) {
      open += (t.numel + block - 1) / block * block;  // each tensor starts on a block
      if (open >= bucket) padded += cut(open), open = 0;
    }
    if (open) padded += cut(open);
    const double part = static_cast<double>(d - 1) / d * static_cast<double>(padded * elem);
    const int reductions = s.each ? s.accumulate : 1, gathers = s.stage == 3 ? s.accumulate : 1;
    std::printf("bytes sent per iteration (rank 0, hooks on): %zu; model %.0f (%d reduce-scatter%s, %d all-gather%s of "
                "%.0f B)\n",
                sent_per_iteration, part * (reductions + gathers), reductions, reductions > 1 ? "s" : "", gathers,
                gathers > 1 ? "s" : "", part);
  }
  std::printf("memory (rank 0, hooks on):\n");
  std::cout << mem;
  return 0;
}
