// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-bench-layerwise: one step of the layer-wise optimizers (lamb, adafactor, came)
// over GPT-like tensors, beside AdamW (one fused pass) in the same run, for fp32 params
// and grads and for bf16 params and grads with fp32 master weights (fp32 states).
//
// Bytes per parameter are derived from each policy's `phases` (layerwise_bench.hpp):
// every pass reads the grad (the engine's loop loads it in each pass), the param or master
// when the phase reads it, the state slots it reads and the tensor keeps, and writes what
// it writes. "loaded" leaves out the grad in the passes whose element function ignores it
// (probed), where the compiler drops the load. "one pass" is the least a step can move.
//
// Ceiling: each pass of the step replayed as a fused stream kernel with the same access
// shape (the same number of fp32 arrays read, read and written back, written), over the
// same thread pool, chunks and element count, measured in the same run; the ceiling time is
// the sum over passes (and over factored / unfactored tensors) of bytes / that kernel's
// GB/s. Ratio = ceiling time / measured time = achieved GB/s / ceiling GB/s.
//
// Per phase: the optimizer runs on an executor that times its parallel_for calls (one per
// phase, the last phase one per bucket; where a phase's statistics are large, their merge
// and conversion one call over the tensors each), so the best step splits into the element pass of each phase and
// the host time between them (merging and reducing the statistics, the policy's hooks),
// without changing the step.
//
//   distopt-bench-layerwise [--layers L] [--width D] [--threads T] [--repeats R]
//                           [--only adamw|lamb|adafactor|came] [--json FILE]
//                           [--label TEXT]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "layerwise_bench.hpp"

namespace {

struct settings {
  int layers = 4;
  std::int64_t width = 1024;
  int threads = 0;
  int repeats = 5;
  std::string only;
  std::string json_path;
  std::string label;  ///< copied into every JSON line (e.g. the run number)
};

// ---- the ceiling: fused stream kernels of a given access shape ----

constexpr std::size_t chunk = 1 << 14;  // the optimizer's chunk_elems

/// RO arrays read, RW read and written back in place, WO written: one fused pass over
/// [b, e), 16 elements at a time in four 4-lane vectors (SSE, as the x86-64 baseline the
/// benchmark is compiled for). A read-only pass sums into four vector accumulators, so that
/// it is bound by loads, not by the latency of one chain of adds.
typedef float v4 __attribute__((vector_size(16)));

inline v4 load4(const float* p) {
  v4 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, v4 v) { __builtin_memcpy(p, &v, sizeof v); }

template <int RO, int RW, int WO>
float stream_pass(float* const* a, std::size_t b, std::size_t e) {
  v4 acc[4] = {};
  std::size_t i = b;
  for (; i + 16 <= e; i += 16) {
    v4 x[4];
    for (int q = 0; q < 4; ++q) x[q] = v4{1e-3f, 1e-3f, 1e-3f, 1e-3f};
    for (int r = 0; r < RO; ++r)
      for (int q = 0; q < 4; ++q) x[q] += load4(a[r] + i + 4 * q);
    for (int r = 0; r < RW; ++r)
      for (int q = 0; q < 4; ++q) store4(a[RO + r] + i + 4 * q, load4(a[RO + r] + i + 4 * q) * 0.999f + x[q]);
    for (int r = 0; r < WO; ++r)
      for (int q = 0; q < 4; ++q) store4(a[RO + RW + r] + i + 4 * q, x[q] * 0.5f);
    if constexpr (RW + WO == 0)
      for (int q = 0; q < 4; ++q) acc[q] += x[q];
  }
  float s = 0;
  for (; i < e; ++i) s += a[0][i];
  for (const v4& v : acc) s += v[0] + v[1] + v[2] + v[3];
  return s;
}

using pass_fn = float (*)(float* const*, std::size_t, std::size_t);
constexpr int max_ro = 5, max_rw = 4, max_wo = 3;

template <int... I>
constexpr std::array<pass_fn, sizeof...(I)> pass_table(std::integer_sequence<int, I...>) {
  return {&stream_pass<I / (max_rw * max_wo), I / max_wo % max_rw, I % max_wo>...};
}
constexpr auto passes = pass_table(std::make_integer_sequence<int, max_ro * max_rw * max_wo>{});

/// GB/s of the fused stream kernel with this access shape, over n elements (fp32 arrays).
class ceilings {
 public:
  ceilings(distopt::cpu& exec, std::size_t n, int repeats) : exec_(exec), n_(n), repeats_(repeats) {}

  double gbps(int ro, int rw, int wo) {
    if (ro >= max_ro || rw >= max_rw || wo >= max_wo || ro + rw + wo == 0)
      throw std::logic_error("ceiling: access shape out of range");
    const auto key = std::make_tuple(ro, rw, wo);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    const int arrays = ro + rw + wo;
    std::vector<float*> a(static_cast<std::size_t>(arrays));
    for (auto& p : a) {
      p = static_cast<float*>(exec_.allocate_bytes(n_ * sizeof(float)));
      std::fill(p, p + n_, 1e-3f);
    }
    const pass_fn f = passes[static_cast<std::size_t>((ro * max_rw + rw) * max_wo + wo)];
    std::vector<float> sink((n_ + chunk - 1) / chunk);
    const auto run = [&] {
      exec_.parallel_for(sink.size(), [&](std::size_t c) { sink[c] = f(a.data(), c * chunk, std::min(n_, (c + 1) * chunk)); });
    };
    run();
    const double s = lwbench::time_repeats(repeats_, run).best;
    for (auto& p : a) exec_.deallocate_bytes(p, n_ * sizeof(float));
    const double g = static_cast<double>(n_) * sizeof(float) * (ro + 2 * rw + wo) / s / 1e9;
    cache_[key] = g;
    std::printf("ceiling: %d read + %d read/written + %d written fp32 arrays: %.1f GB/s\n", ro, rw, wo, g);
    std::fflush(stdout);
    return g;
  }

  /// Seconds per element at the ceiling for one access.
  double seconds(const lwbench::access& a) { return a.bytes / (gbps(a.ro, a.rw, a.wo) * 1e9); }

  const std::map<std::tuple<int, int, int>, double>& all() const { return cache_; }

 private:
  distopt::cpu& exec_;
  std::size_t n_;
  int repeats_;
  std::map<std::tuple<int, int, int>, double> cache_;
};

// ---- a CPU executor that times its parallel_for calls ----

/// distopt::cpu, timing every parallel_for: wall time, and each thread's time inside the
/// index function. A layer-wise step makes one parallel_for over work items per phase (the
/// last phase one per bucket) and does its host work (merging and reducing the statistics,
/// the policy's hooks: parallel_for calls over the tensors, and serial code) between them,
/// so the log of one step splits it into passes and host time.
class timed_cpu {
 public:
  using executor_concept = distopt::executor_tag;
  using memory_space = distopt::cpu::memory_space;

  struct call {
    bool host = false;  ///< the engine's host work (its statistics' merges), not an element pass
    double wall = 0, busy_sum = 0, busy_max = 0;  ///< seconds
  };

  explicit timed_cpu(int threads = 1) : inner_(threads), log_(std::make_shared<std::vector<call>>()) {}

  int concurrency() const noexcept { return inner_.concurrency(); }
  void* allocate_bytes(std::size_t n) { return inner_.allocate_bytes(n); }
  void deallocate_bytes(void* p, std::size_t n) noexcept { inner_.deallocate_bytes(p, n); }

  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    std::array<std::atomic<double>, max_threads> busy{};
    const auto t0 = clock::now();
    inner_.parallel_for(n, [&](std::size_t i) {
      const auto a = clock::now();
      f(i);
      busy[slot()].fetch_add(std::chrono::duration<double>(clock::now() - a).count(), std::memory_order_relaxed);
    });
    call c;
    c.wall = std::chrono::duration<double>(clock::now() - t0).count();
    // The merges run detail::layer_merge_phase (through detail::launch's lambda) and the
    // conversions lambdas of layer_stage::reduce_layer_sums: names their mangled type names
    // carry (GCC and Clang).
    const std::string_view type = typeid(std::remove_cvref_t<F>).name();
    c.host = type.find("reduce_layer_sums") != std::string_view::npos ||
             type.find("layer_merge_phase") != std::string_view::npos;
    for (const auto& b : busy) {
      c.busy_sum += b.load();
      c.busy_max = std::max(c.busy_max, b.load());
    }
    log_->push_back(c);
  }

  std::vector<call>& log() { return *log_; }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr std::size_t max_threads = 64;
  static std::size_t slot() {
    static std::atomic<std::size_t> next{0};
    thread_local const std::size_t mine = next.fetch_add(1) % max_threads;
    return mine;
  }

  distopt::cpu inner_;
  std::shared_ptr<std::vector<call>> log_;
};

// ---- one case ----

struct phase_row {
  int phase = 0;
  double bytes = 0;        ///< model B/param of this pass (grad counted)
  std::string grad_used;   ///< "yes", "no", or "factored only"
  double ns = 0;           ///< wall time of this pass's parallel_for calls, in the best step
  double busy = 0;         ///< of that, the threads' mean time in the element loop / wall
  double ceiling_ns = 0;   ///< this pass at its ceiling
};

struct row {
  std::string policy, options, param, grad;
  int threads = 0, phases = 1;
  std::size_t params = 0;
  double ns_best = 0, ns_median = 0;
  double bytes = 0, bytes_loaded = 0, bytes_one_pass = 0;
  double ceiling_ns = 0, one_pass_ns = 0;  ///< all passes at their ceilings; one pass at its ceiling
  double adamw_ns = 0;
  double host_ns = 0;  ///< the best step's time outside the element passes (statistics, hooks)
  std::vector<phase_row> phase_rows;

  double gbps() const { return bytes / ns_best; }
  double ceiling_gbps() const { return bytes / ceiling_ns; }
  double ratio() const { return ceiling_ns / ns_best; }
};

/// The step time (best and median of the repeats) and the executor's log of the best step.
struct step_timing {
  lwbench::timing t;
  std::vector<timed_cpu::call> calls;
};

template <class Policy, class Param, class Grad>
step_timing time_step(const settings& s, const distopt::layout& l, const typename Policy::hyper_params& h) {
  using opt_t = distopt::optimizer<Policy, distopt::replicated<distopt::fp32>, distopt::single, timed_cpu,
                                   distopt::precision<Param, Grad>>;
  distopt::optimizer_options o;
  o.check_finite = false;  // a separate read of the grads; off as in distopt-bench-step
  o.master_weights = true;
  opt_t opt(l, h, o, timed_cpu(s.threads));
  {
    auto p = opt.params();
    auto g = opt.grads();
    opt.executor().parallel_for((p.size() + chunk - 1) / chunk, [&](std::size_t c) {
      for (std::size_t i = c * chunk; i < std::min(p.size(), (c + 1) * chunk); ++i) {
        p[i] = distopt::from_float<Param>(0.02f * static_cast<float>(1 + i % 5));
        g[i] = distopt::from_float<Grad>(1e-3f * static_cast<float>(1 + i % 7));
      }
    });
  }
  opt.step();  // warm-up: master weights loaded, states touched
  step_timing out;
  double best = 1e30;
  auto& log = opt.executor().log();
  out.t = lwbench::time_repeats(s.repeats, [&] {
    log.clear();
    const auto t0 = std::chrono::steady_clock::now();
    opt.step();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t < best) {
      best = t;
      out.calls = log;
    }
  });
  return out;
}

template <class Policy, class Param, class Grad>
row measure(const settings& s, ceilings& ceil, const distopt::layout& l, const typename Policy::hyper_params& h,
            std::string options, double adamw_ns) {
  constexpr bool low = !std::is_same_v<Param, float>;
  const lwbench::number_sizes z{sizeof(Grad), sizeof(Param), 4.0, low};
  const double n = static_cast<double>(l.numel());
  row r;
  r.policy = std::string(Policy::name);
  r.options = std::move(options);
  r.param = lwbench::precision_name(low, true);
  r.grad = std::string(distopt::dtype_name(distopt::dtype_of<Grad>));
  r.threads = s.threads;
  r.params = l.numel();
  r.adamw_ns = adamw_ns;
  std::printf("  %s %s %s/%s ...", r.policy.c_str(), r.options.c_str(), r.param.c_str(), r.grad.c_str());
  std::fflush(stdout);

  if constexpr (distopt::policy_is_layerwise<Policy>) {
    constexpr std::size_t K = Policy::phases.size();
    r.phases = static_cast<int>(K);
    const auto by_class = lwbench::numel_by_class<Policy>(l, h);  // [unfactored, factored]
    const auto used = lwbench::grad_use<Policy>(h);
    double bytes = 0, loaded = 0, one = 0, ceil_s = 0, one_s = 0;
    for (int f = 0; f < 2; ++f) {
      if (by_class[f] == 0) continue;
      const lwbench::access a1 = lwbench::one_pass_access<Policy>(h, f, z);
      one += by_class[f] * a1.bytes;
      one_s += by_class[f] * ceil.seconds(a1);
    }
    for (std::size_t p = 0; p < K; ++p) {
      phase_row pr;
      pr.phase = static_cast<int>(p);
      pr.grad_used = used[p][0] && used[p][1] ? "yes" : used[p][1] ? "factored only" : used[p][0] ? "unfactored only" : "no";
      double pass_s = 0;
      for (int f = 0; f < 2; ++f) {
        if (by_class[f] == 0) continue;
        const lwbench::access a = lwbench::phase_access<Policy>(h, p, f, z);
        const lwbench::access al = lwbench::phase_access<Policy>(h, p, f, z, used[p][f]);
        pr.bytes += by_class[f] * a.bytes / n;
        loaded += by_class[f] * al.bytes;
        pass_s += by_class[f] * ceil.seconds(a);
      }
      pr.ceiling_ns = pass_s / n * 1e9;
      bytes += pr.bytes * n;
      ceil_s += pass_s;
      r.phase_rows.push_back(pr);
    }
    r.bytes = bytes / n;
    r.bytes_loaded = loaded / n;
    r.bytes_one_pass = one / n;
    r.ceiling_ns = ceil_s / n * 1e9;
    r.one_pass_ns = one_s / n * 1e9;

    const step_timing st = time_step<Policy, Param, Grad>(s, l, h);
    r.ns_best = st.t.best / n * 1e9;
    r.ns_median = st.t.median / n * 1e9;
    // The statistics' merges are host work; of the other calls, 0 .. K-2 are phases
    // 0 .. K-2 (one parallel_for each), the rest the last phase (one per bucket).
    std::vector<timed_cpu::call> passes_log;
    for (const timed_cpu::call& c : st.calls)
      if (!c.host) passes_log.push_back(c);
    if (passes_log.size() >= K) {
      double passes = 0;
      std::vector<double> busy(K, 0.0), wall(K, 0.0);
      for (std::size_t c = 0; c < passes_log.size(); ++c) {
        const std::size_t p = std::min(c, K - 1);
        wall[p] += passes_log[c].wall;
        busy[p] += passes_log[c].busy_sum;
        passes += passes_log[c].wall;
      }
      for (std::size_t p = 0; p < K; ++p) {
        r.phase_rows[p].ns = wall[p] / n * 1e9;
        r.phase_rows[p].busy = wall[p] > 0 ? busy[p] / (wall[p] * s.threads) : 0.0;
      }
      r.host_ns = (st.t.best - passes) / n * 1e9;
    }
  } else {
    const int slots = Policy::state_slots(h);
    const lwbench::access a = lwbench::elementwise_access(slots, z);
    r.bytes = r.bytes_loaded = r.bytes_one_pass = a.bytes;
    r.ceiling_ns = r.one_pass_ns = ceil.seconds(a) * 1e9;
    const step_timing st = time_step<Policy, Param, Grad>(s, l, h);
    r.ns_best = st.t.best / n * 1e9;
    r.ns_median = st.t.median / n * 1e9;
  }
  std::printf(" %.3f ns/param (median %.3f)\n", r.ns_best, r.ns_median);
  std::fflush(stdout);
  return r;
}

template <class Param, class Grad>
void run_precision(const settings& s, ceilings& ceil, std::vector<row>& rows) {
  const distopt::layout l = lwbench::gpt_layers(s.layers, s.width, distopt::dtype_of<Param>);
  const auto want = [&](std::string_view p) { return s.only.empty() || s.only == p; };
  // AdamW always: it is the one-pass reference of every row.
  const row adamw = measure<distopt::adamw, Param, Grad>(s, ceil, l, {}, "", 0.0);
  rows.push_back(adamw);
  rows.back().adamw_ns = adamw.ns_best;
  const double ref = adamw.ns_best;
  if (want("lamb")) rows.push_back(measure<distopt::lamb, Param, Grad>(s, ceil, l, {}, "", ref));
  if (want("adafactor")) {
    rows.push_back(measure<distopt::adafactor, Param, Grad>(s, ceil, l, {}, "", ref));
    distopt::adafactor::hyper_params h;
    h.beta1 = 0.9;
    rows.push_back(measure<distopt::adafactor, Param, Grad>(s, ceil, l, h, "beta1=0.9", ref));
  }
  if (want("came")) rows.push_back(measure<distopt::came, Param, Grad>(s, ceil, l, {}, "", ref));
}

int usage(const char* bad) {
  std::fprintf(stderr,
               "distopt-bench-layerwise: %s\nusage: distopt-bench-layerwise [--layers L] [--width D] "
               "[--threads T] [--repeats R] [--only adamw|lamb|adafactor|came] [--json FILE] [--label TEXT]\n",
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
    if (a == "--layers") s.layers = std::atoi(v);
    else if (a == "--width") s.width = std::atoll(v);
    else if (a == "--threads") s.threads = std::atoi(v);
    else if (a == "--repeats") s.repeats = std::atoi(v);
    else if (a == "--only") s.only = v;
    else if (a == "--json") s.json_path = v;
    else if (a == "--label") s.label = v;
    else return usage(("unknown option " + std::string(a)).c_str());
  }
  if (s.layers < 0 || s.width < 8 || s.repeats < 1 || s.threads < 0) return usage("invalid value");
  if (!s.only.empty() && s.only != "lamb" && s.only != "adafactor" && s.only != "came" && s.only != "adamw")
    return usage("--only: lamb, adafactor, came or adamw");
  distopt::cpu exec(s.threads);
  s.threads = exec.concurrency();
  const distopt::layout shape = lwbench::gpt_layers(s.layers, s.width, distopt::dtype::f32);
  const std::size_t n = shape.numel();
  std::printf("distopt-bench-layerwise: %zu params (%zu tensors, %d GPT layers of width %lld + embedding), "
              "%d threads, best of %d steps after a warm-up\n",
              n, shape.tensors().size(), s.layers, static_cast<long long>(s.width), s.threads, s.repeats);
  std::fflush(stdout);

  std::vector<row> rows;
  std::map<std::tuple<int, int, int>, double> measured_ceilings;
  {
    ceilings ceil(exec, n, s.repeats);
    run_precision<float, float>(s, ceil, rows);
    run_precision<distopt::bf16, distopt::bf16>(s, ceil, rows);
    measured_ceilings = ceil.all();
  }

  std::printf("\nB/param: phases (grad in every pass) / loaded (grad only where used) / one pass; ceiling: all "
              "passes at their stream ceilings; one-pass: the one-pass bytes at theirs\n");
  std::printf("%-9s %-9s %-11s %-4s %6s %8s %8s %8s %6s %7s %7s %6s %9s %9s %7s\n", "policy", "options", "param",
              "grad", "passes", "ns/param", "median", "B/param", "loaded", "1-pass", "GB/s", "ratio", "ceil ns",
              "1pass ns", "x adamw");
  for (const row& r : rows)
    std::printf("%-9s %-9s %-11s %-4s %6d %8.3f %8.3f %8.1f %6.1f %7.1f %7.1f %6.2f %9.3f %9.3f %7.2f\n",
                r.policy.c_str(), r.options.empty() ? "-" : r.options.c_str(), r.param.c_str(), r.grad.c_str(),
                r.phases, r.ns_best, r.ns_median, r.bytes, r.bytes_loaded, r.bytes_one_pass, r.gbps(), r.ratio(),
                r.ceiling_ns, r.one_pass_ns, r.ns_best / r.adamw_ns);
  std::printf("\nper phase (the best step's parallel_for calls; busy: the threads' mean share of the pass in the "
              "element loop; host: the rest of the step):\n");
  std::printf("%-9s %-9s %-11s %5s %8s %-15s %8s %7s %9s %6s %5s\n", "policy", "options", "param", "phase", "B/param",
              "grad used", "ns/param", "GB/s", "ceil ns", "ratio", "busy");
  for (const row& r : rows) {
    for (const phase_row& p : r.phase_rows)
      std::printf("%-9s %-9s %-11s %5d %8.1f %-15s %8.3f %7.1f %9.3f %6.2f %5.2f\n", r.policy.c_str(),
                  r.options.empty() ? "-" : r.options.c_str(), r.param.c_str(), p.phase, p.bytes,
                  p.grad_used.c_str(), p.ns, p.ns > 0 ? p.bytes / p.ns : 0.0, p.ceiling_ns,
                  p.ns > 0 ? p.ceiling_ns / p.ns : 0.0, p.busy);
    if (!r.phase_rows.empty())
      std::printf("%-9s %-9s %-11s %5s %8s %-15s %8.3f\n", r.policy.c_str(), r.options.empty() ? "-" : r.options.c_str(),
                  r.param.c_str(), "host", "-", "-", r.host_ns);
  }

  std::printf("\n");
  std::FILE* f = s.json_path.empty() ? nullptr : std::fopen(s.json_path.c_str(), "a");
  const auto emit = [&](std::string line) {  // every line gets the label
    line.insert(1, "\"label\":\"" + s.label + "\",");
    std::printf("%s\n", line.c_str());
    if (f) std::fprintf(f, "%s\n", line.c_str());
  };
  char buf[1024];
  for (const auto& [k, g] : measured_ceilings) {
    std::snprintf(buf, sizeof buf,
                  "{\"bench\":\"layerwise_ceiling\",\"params\":%zu,\"threads\":%d,\"read\":%d,\"read_write\":%d,"
                  "\"write\":%d,\"gbps\":%.2f}",
                  n, s.threads, std::get<0>(k), std::get<1>(k), std::get<2>(k), g);
    emit(buf);
  }
  for (const row& r : rows) {
    std::snprintf(buf, sizeof buf,
                  "{\"bench\":\"layerwise_step\",\"policy\":\"%s\",\"options\":\"%s\",\"param\":\"%s\",\"grad\":\"%s\","
                  "\"state\":\"fp32\",\"params\":%zu,\"threads\":%d,\"passes\":%d,\"ns_per_param\":%.4f,"
                  "\"ns_per_param_median\":%.4f,\"bytes_per_param\":%.2f,\"bytes_per_param_loaded\":%.2f,"
                  "\"bytes_per_param_one_pass\":%.2f,\"gbps\":%.2f,\"ceiling_gbps\":%.2f,\"ratio\":%.3f,"
                  "\"ceiling_ns_per_param\":%.4f,\"one_pass_ns_per_param\":%.4f,\"adamw_ns_per_param\":%.4f,"
                  "\"host_ns_per_param\":%.4f}",
                  r.policy.c_str(), r.options.c_str(), r.param.c_str(), r.grad.c_str(), r.params, r.threads, r.phases,
                  r.ns_best, r.ns_median, r.bytes, r.bytes_loaded, r.bytes_one_pass, r.gbps(), r.ceiling_gbps(),
                  r.ratio(), r.ceiling_ns, r.one_pass_ns, r.adamw_ns, r.host_ns);
    emit(buf);
    for (const phase_row& p : r.phase_rows) {
      std::snprintf(buf, sizeof buf,
                    "{\"bench\":\"layerwise_phase\",\"policy\":\"%s\",\"options\":\"%s\",\"param\":\"%s\",\"grad\":\"%s\","
                    "\"params\":%zu,\"threads\":%d,\"phase\":%d,\"bytes_per_param\":%.2f,\"grad_used\":\"%s\","
                    "\"ns_per_param\":%.4f,\"ceiling_ns_per_param\":%.4f,\"busy\":%.3f}",
                    r.policy.c_str(), r.options.c_str(), r.param.c_str(), r.grad.c_str(), r.params, r.threads, p.phase,
                    p.bytes, p.grad_used.c_str(), p.ns, p.ceiling_ns, p.busy);
      emit(buf);
    }
  }
  if (f) std::fclose(f);
}
