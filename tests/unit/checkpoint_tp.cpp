// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Checkpoints that reshard over tensor parallelism: saved on a DP x TP grid, loaded on a
// grid of another TP size (and DP size), trained on; the reassembled params, master
// weights and states equal the uninterrupted unsplit run's bit for bit. Tensors are split
// by rows and by columns, stacks of matrices by their first dim and by columns, and one
// part of a cols-split matrix spans several checksum chunks (2^18 elements), so loads read
// partial chunk ranges of other parts' files. A load at the same TP size with one tensor
// split otherwise reshards that tensor only. Then the refusals: 8-bit absmax of blocks a
// TP cut splits, and checkpoints from before TP resharding on another TP size.
#include <boost/test/unit_test.hpp>

#include <distopt/checkpoint.hpp>
#include <distopt/distopt.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "layerwise_cases.hpp"
#include "scratch_dir.hpp"
#include "sharded_harness.hpp"

using namespace distopt;
namespace fs = std::filesystem;

namespace {

using harness::scratch_dir;

struct tp_tensor {
  std::vector<std::int64_t> shape;  // the whole tensor
  tp_split split;                   // under TP (a grid of TP size 1 splits nothing)
};

/// Every dim that TP splits divides by 4, so the same tensors run at TP 1, 2 and 4.
std::vector<tp_tensor> mixed_tensors() {
  return {{{12, 40}, tp_split::rows},     // column-parallel weight
          {{20, 32}, tp_split::cols},     // row-parallel weight
          {{8}, tp_split::rows},          // its bias
          {{4, 6, 10}, tp_split::rows},   // a stack of matrices split by the stack
          {{3, 5, 16}, tp_split::cols},   // a stack split by columns
          {{9}, tp_split::none},          // replicated over TP
          {{7, 304}, tp_split::cols},     // rows that straddle DP cuts
          {{4, 2, 3, 8}, tp_split::rows}, // a 4-D stack split by its first dim
          {{2, 3, 4, 8}, tp_split::cols}, // a 4-D stack split by columns
          {{12}, tp_split::cols},         // a vector split by its one (last) dim
          {{1040, 512}, tp_split::cols}}; // a TP-2 part spans two checksum chunks
}

/// 8-bit states whose blocks stay blocks of the whole tensor: rows split into parts of a
/// multiple of the block, and unsplit tensors.
std::vector<tp_tensor> q8_aligned_tensors() {
  return {{{64, 128}, tp_split::rows}, {{256, 64}, tp_split::rows}, {{4096}, tp_split::none}, {{9}, tp_split::none}};
}

std::size_t numel(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (auto s : shape) n *= static_cast<std::size_t>(s);
  return n;
}

/// The whole tensor's flat index of element l of TP part t of tp.
std::size_t whole_index(const tp_tensor& x, int t, int tp, std::size_t l) {
  if (tp == 1 || x.split == tp_split::none) return l;
  if (x.split == tp_split::rows) return static_cast<std::size_t>(t) * (numel(x.shape) / static_cast<std::size_t>(tp)) + l;
  const std::size_t c = static_cast<std::size_t>(x.shape.back()), lc = c / static_cast<std::size_t>(tp);
  return (l / lc) * c + static_cast<std::size_t>(t) * lc + l % lc;
}

std::string name_of(std::size_t i) { return std::string("t").append(std::to_string(i)); }

/// A run's reassembled whole tensors.
struct result {
  std::vector<std::vector<float>> params, master;
  std::vector<std::vector<std::vector<float>>> states;  // [slot][tensor], decoded for q8
  std::int64_t step = 0;
  bool operator==(const result&) const = default;
};

struct grid {
  int dp = 1, tp = 1;
};

/// One run on a DP x TP grid (ranks as threads): load `from` (else the initial params),
/// steps [s0, s1) of the rank-0 gradient (sum reduction), save to `to`. Returns the whole
/// tensors, or the load's error per rank in `errors` (the run then stops after the load).
template <class Policy, class Storage, class Prec>
result run_grid(const std::vector<tp_tensor>& xs, const typename Policy::hyper_params& h, grid g, int s0, int s1,
                const fs::path* from, const fs::path* to, std::vector<std::string>* errors = nullptr) {
  using opt_t = optimizer<Policy, Storage, threads, cpu, Prec>;
  using P = typename opt_t::param_type;
  const int slots = Policy::state_slots(h);
  result out;
  for (const auto& x : xs) {
    out.params.emplace_back(numel(x.shape), 0.0f);
    out.master.emplace_back(numel(x.shape), 0.0f);
  }
  out.states.assign(static_cast<std::size_t>(slots), out.params);
  if (errors) errors->assign(static_cast<std::size_t>(g.dp * g.tp), "");
  std::mutex m;
  run_ranks(g.dp * g.tp, [&](threads& world) {
    const int rank = world.rank(), d = rank / g.tp, t = rank % g.tp;
    std::optional<threads> tp_comm;
    if (g.tp > 1) tp_comm.emplace(world.split(d, t));
    threads dp_comm = g.tp > 1 ? world.split(t, d) : std::move(world);
    layout l;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      auto shape = xs[i].shape;
      const tp_split split = g.tp > 1 ? xs[i].split : tp_split::none;
      if (split == tp_split::rows) shape.front() /= g.tp;
      if (split == tp_split::cols) shape.back() /= g.tp;
      l.add(name_of(i), shape, dtype_of<P>, 0, split);
    }
    optimizer_options o;
    o.grad_reduce = reduce_op::sum;
    o.bucket_elems = 1 << 16;  // several buckets
    o.min_8bit_size = 1024;
    opt_t opt(l, h, o, cpu(1), std::move(dp_comm));
    if (tp_comm) opt.set_tensor_parallel_group(std::move(*tp_comm));
    const auto place = [&](std::size_t i, std::size_t e) { return whole_index(xs[i], t, g.tp, e); };
    if (from) {
      try {
        opt.load(*from);
      } catch (const io::checkpoint_error& e) {
        if (!errors) throw;
        (*errors)[static_cast<std::size_t>(rank)] = e.what();
        return;
      }
    } else {
      for (std::size_t i = 0; i < xs.size(); ++i) {
        auto p = opt.param(name_of(i));
        for (std::size_t e = 0; e < p.size(); ++e) p[e] = from_float<P>(harness::init_value(i, place(i, e)));
      }
    }
    for (int s = s0; s < s1; ++s) {
      for (std::size_t i = 0; i < xs.size(); ++i) {
        auto gr = opt.grad(name_of(i));
        for (std::size_t e = 0; e < gr.size(); ++e)
          gr[e] = from_float<typename opt_t::grad_type>(d == 0 ? harness::grad_value(s, i, place(i, e)) : 0.0f);
      }
      opt.step();
      opt.zero_grad();
    }
    if (to) opt.save(*to);
    std::lock_guard<std::mutex> lock(m);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const std::string name = name_of(i);
      if (d == 0) {
        const auto p = opt.param(name);
        for (std::size_t e = 0; e < p.size(); ++e) out.params[i][place(i, e)] = to_float(p[e]);
      }
      if constexpr (!std::is_same_v<P, float>) {  // master weights (the default for bf16 params)
        const auto mv = opt.local_master(name);
        for (std::size_t e = 0; e < mv.values.size(); ++e) out.master[i][place(i, mv.first + e)] = mv.values[e];
      }
      for (int k = 0; k < slots; ++k) {
        const auto sv = opt.local_state_values(name, k);
        for (std::size_t e = 0; e < sv.values.size(); ++e)
          out.states[static_cast<std::size_t>(k)][i][place(i, sv.first + e)] = sv.values[e];
      }
    }
    if (rank == 0) out.step = opt.step_count();
  });
  return out;
}

/// Saves after K steps on each grid of `saves`, loads each on every grid of `loads`, runs
/// N more steps; every result must equal the uninterrupted unsplit run bit for bit.
template <class Policy, class Storage, class Prec = precision<float>>
void check_tp_resharding(const std::string& tag, const std::vector<tp_tensor>& xs,
                         const typename Policy::hyper_params& h, const std::vector<grid>& saves,
                         const std::vector<grid>& loads, int K = 3, int N = 3) {
  const result reference = run_grid<Policy, Storage, Prec>(xs, h, {1, 1}, 0, K + N, nullptr, nullptr);
  BOOST_TEST_REQUIRE(reference.step == K + N);
  for (const grid& a : saves) {
    scratch_dir dir(tag);
    run_grid<Policy, Storage, Prec>(xs, h, a, 0, K, nullptr, &dir.path);
    for (const grid& b : loads) {
      const result resumed = run_grid<Policy, Storage, Prec>(xs, h, b, K, K + N, &dir.path, nullptr);
      BOOST_TEST_CONTEXT(tag << ": saved on DP " << a.dp << " x TP " << a.tp << ", loaded on DP " << b.dp << " x TP "
                             << b.tp) {
        BOOST_TEST(resumed.step == reference.step);
        for (std::size_t i = 0; i < xs.size(); ++i) {
          BOOST_TEST(resumed.params[i] == reference.params[i], "params of tensor " << i);
          BOOST_TEST(resumed.master[i] == reference.master[i], "master weights of tensor " << i);
          for (std::size_t k = 0; k < reference.states.size(); ++k)
            BOOST_TEST(resumed.states[k][i] == reference.states[k][i], "state " << k << " of tensor " << i);
        }
      }
    }
  }
  // Not vacuous: the params moved, and a checkpoint of another step gives other params.
  const result initial = run_grid<Policy, Storage, Prec>(xs, h, {1, 1}, 0, 0, nullptr, nullptr);
  BOOST_TEST(!(initial.params == reference.params));
  scratch_dir early(tag + "-early");
  run_grid<Policy, Storage, Prec>(xs, h, {1, 2}, 0, K - 1, nullptr, &early.path);
  BOOST_TEST(!(run_grid<Policy, Storage, Prec>(xs, h, {1, 4}, K, K + N, &early.path, nullptr).params == reference.params));
}

/// TP sizes 1, 2, 4 each saved, each loaded on the others, with DP sizes varied.
const std::vector<grid> tp_124 = {{2, 1}, {2, 2}, {1, 4}};
const std::vector<grid> tp_124_other_dp = {{3, 1}, {1, 2}, {2, 4}};

adamw::hyper_params adamw_case() {
  adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  return h;
}

bool mentions(const std::vector<std::string>& errors, const std::string& what) {
  for (const auto& e : errors)
    if (e.find(what) == std::string::npos) return false;
  return !errors.empty();
}

}  // namespace

BOOST_AUTO_TEST_SUITE(tp_resharding)

BOOST_AUTO_TEST_CASE(adamw_fp32) {
  check_tp_resharding<adamw, sharded<fp32>>("adamw", mixed_tensors(), adamw_case(), tp_124, tp_124_other_dp);
}

BOOST_AUTO_TEST_CASE(adamw_bf16_params_master) {
  check_tp_resharding<adamw, sharded<fp32>, precision<bf16>>("adamw-bf16", mixed_tensors(), adamw_case(), {{2, 2}},
                                                             {{1, 1}, {1, 4}});
}

BOOST_AUTO_TEST_CASE(adafactor_row_and_column_states) {
  check_tp_resharding<adafactor, sharded<fp32>>("adafactor", mixed_tensors(), harness::adafactor_lr_beta1(), tp_124,
                                                tp_124_other_dp);
}

BOOST_AUTO_TEST_CASE(came_row_and_column_states) {
  check_tp_resharding<came, sharded<fp32>>("came", mixed_tensors(), harness::came_case(), {{1, 4}}, {{2, 2}, {1, 1}});
}

BOOST_AUTO_TEST_CASE(q8_blocks_of_the_whole_tensor) {
  check_tp_resharding<adam, sharded<q8>>("q8", q8_aligned_tensors(), adam::hyper_params{}, tp_124, tp_124_other_dp);
}

BOOST_AUTO_TEST_CASE(q8_blocks_cut_by_tp_are_refused) {
  const std::vector<tp_tensor> xs = {{{64, 96}, tp_split::cols}, {{9}, tp_split::none}};
  scratch_dir dir("q8-cols");
  run_grid<adam, sharded<q8>, precision<float>>(xs, adam::hyper_params{}, {1, 2}, 0, 2, nullptr, &dir.path);
  std::vector<std::string> errors;
  run_grid<adam, sharded<q8>, precision<float>>(xs, adam::hyper_params{}, {2, 1}, 2, 3, &dir.path, nullptr, &errors);
  BOOST_TEST(mentions(errors, "t0/state.0.absmax"), errors.front());
  BOOST_TEST(mentions(errors, "loads only with the TP layout that saved it"), errors.front());
  // The same TP layout loads it.
  run_grid<adam, sharded<q8>, precision<float>>(xs, adam::hyper_params{}, {3, 2}, 2, 3, &dir.path, nullptr, &errors);
  for (const auto& e : errors) BOOST_TEST(e.empty(), e);
}

BOOST_AUTO_TEST_CASE(same_tp_size_another_split) {
  // One tensor split by rows when saved and by columns when loaded, at the same TP size: it
  // is resharded; the others load from their own part's files as saved, among them an 8-bit
  // tensor split by columns, whose absmax have no place in a whole array.
  std::vector<tp_tensor> saved = {{{64, 96}, tp_split::cols},   // q8, cut by TP: loads only as saved
                                  {{16, 32}, tp_split::rows},   // under min_8bit_size: fp32 states
                                  {{4096}, tp_split::none},
                                  {{9}, tp_split::none}};
  auto loaded = saved;
  loaded[1].split = tp_split::cols;
  const adam::hyper_params h{};
  const result reference = run_grid<adam, sharded<q8>, precision<float>>(loaded, h, {1, 2}, 0, 6, nullptr, nullptr);
  scratch_dir dir("same-tp");
  run_grid<adam, sharded<q8>, precision<float>>(saved, h, {1, 2}, 0, 3, nullptr, &dir.path);
  const result resumed = run_grid<adam, sharded<q8>, precision<float>>(loaded, h, {2, 2}, 3, 6, &dir.path, nullptr);
  BOOST_TEST(resumed.step == 6);
  for (std::size_t i = 0; i < saved.size(); ++i) {
    BOOST_TEST(resumed.params[i] == reference.params[i], "params of tensor " << i);
    for (std::size_t k = 0; k < reference.states.size(); ++k)
      BOOST_TEST(resumed.states[k][i] == reference.states[k][i], "state " << k << " of tensor " << i);
  }
}

BOOST_AUTO_TEST_CASE(resharding_holds_few_files_open) {
  // Saved on DP 8 x TP 4 (32 rank files), loaded on TP 2 with a limit of 56 open files for
  // the process: each of the 2 ranks opens only the files of the item it reads (holding
  // all 32 each, as before, needs 64 and more).
  scratch_dir dir("files");
  const auto xs = mixed_tensors();
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {8, 4}, 0, 2, nullptr, &dir.path);
  rlimit old{};
  BOOST_TEST_REQUIRE(::getrlimit(RLIMIT_NOFILE, &old) == 0);
  rlimit low = old;
  low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 56);
  BOOST_TEST_REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::vector<std::string> errors;
  const result resumed = run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 2}, 2, 4, &dir.path,
                                                                         nullptr, &errors);
  ::setrlimit(RLIMIT_NOFILE, &old);
  for (const auto& e : errors) BOOST_TEST(e.empty(), e);
  const result reference = run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 1}, 0, 4, nullptr, nullptr);
  BOOST_TEST((resumed.params == reference.params));
}

BOOST_AUTO_TEST_CASE(checkpoints_without_whole_tensors_load_on_their_tp_size_only) {
  // An index as distopt wrote it before TP resharding: no "whole_tensors".
  scratch_dir dir("old");
  const auto xs = mixed_tensors();
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 2}, 0, 2, nullptr, &dir.path);
  {
    std::ifstream in(dir.path / "index.json");
    nlohmann::json j = nlohmann::json::parse(in);
    BOOST_TEST_REQUIRE(j.contains("whole_tensors"));
    j.erase("whole_tensors");
    j.erase("checksum");
    const std::string body = j.dump();
    j["checksum"] = io::detail::hex64(io::detail::xxh3(body.data(), body.size()));
    std::ofstream(dir.path / "index.json") << j.dump(1) << "\n";
  }
  std::vector<std::string> errors;
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 4}, 2, 3, &dir.path, nullptr, &errors);
  BOOST_TEST(mentions(errors, "was written with tensor-parallel size 2, this optimizer has 4"), errors.front());
  BOOST_TEST(mentions(errors, "it loads only with TP size 2"), errors.front());
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {3, 2}, 2, 3, &dir.path, nullptr, &errors);
  for (const auto& e : errors) BOOST_TEST(e.empty(), e);
}

BOOST_AUTO_TEST_CASE(another_whole_shape_is_refused) {
  scratch_dir dir("shape");
  auto xs = mixed_tensors();
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 2}, 0, 2, nullptr, &dir.path);
  xs[1].shape = {20, 64};  // the whole tensor differs, not only its TP parts
  std::vector<std::string> errors;
  run_grid<adamw, sharded<fp32>, precision<float>>(xs, adamw_case(), {1, 4}, 2, 3, &dir.path, nullptr, &errors);
  BOOST_TEST(mentions(errors, "was written with whole tensor t1 't1' [20, 32]"), errors.front());
}

BOOST_AUTO_TEST_SUITE_END()
