// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// distopt-replay: the trace, the run configuration, and one entry point per policy (each
// compiled in its own translation unit, so the instantiations build in parallel).

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace replay {

/// A bad command line or input file: printed as one line, exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// --backend cuda on a machine without a CUDA device: printed as one line, exit code 77
/// (ctest's skip code in this project).
struct no_device_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The gradient trace: initial params and one gradient per tensor per step, all fp32.
struct trace {
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::int64_t>> shapes;  // as in the file; [] for 0-d
  std::map<std::string, std::vector<float>> params;
  std::vector<std::map<std::string, std::vector<float>>> grads;  // [step][name]
};

/// --ep: the trace's expert tensors. A tensor named "experts.<e>.<rest>" is expert e of the
/// expert tensor "experts.<rest>" (make_moe_trace.py's names); the others are dense.
struct moe_split {
  std::vector<int> expert;            ///< per trace tensor: its expert, or -1 (dense)
  std::vector<std::string> logical;   ///< per trace tensor: its expert tensor's name
  std::vector<std::size_t> split_key; ///< per trace tensor: the index --tp splits it as
  int experts = 0;                    ///< how many (the highest expert index + 1)
};
inline moe_split moe_of(const trace& tr) {
  moe_split m;
  for (const auto& n : tr.names) {
    int e = -1;
    std::string logical;
    if (n.starts_with("experts.")) {
      const std::size_t dot = n.find('.', 8);
      const std::string digits = n.substr(8, dot == std::string::npos ? std::string::npos : dot - 8);
      if (dot != std::string::npos && !digits.empty() && digits.size() < 6 && (digits.size() == 1 || digits[0] != '0') &&
          digits.find_first_not_of("0123456789") == std::string::npos) {
        e = std::stoi(digits);
        logical = "experts" + n.substr(dot);
      }
    }
    // --tp splits an expert as it splits its expert tensor's first expert in the trace.
    std::size_t key = m.expert.size();
    for (std::size_t j = 0; j < m.expert.size() && e >= 0; ++j)
      if (m.logical[j] == logical) {
        key = j;
        break;
      }
    m.split_key.push_back(key);
    m.expert.push_back(e);
    m.logical.push_back(std::move(logical));
    m.experts = std::max(m.experts, e + 1);
  }
  return m;
}

/// Why the trace's experts are not E whole expert tensors (each logical tensor has every
/// expert 0..E-1 once, all of one shape), or "" when they are.
inline std::string moe_problem(const trace& tr, const moe_split& m) {
  std::map<std::string, std::vector<int>> seen;  // logical -> its experts' trace indices by expert
  for (std::size_t k = 0; k < tr.names.size(); ++k) {
    if (m.expert[k] < 0) continue;
    auto& at = seen[m.logical[k]];
    at.resize(static_cast<std::size_t>(m.experts), -1);
    const int first = at[static_cast<std::size_t>(m.expert[k])];
    if (first >= 0) return "'" + tr.names[k] + "' and '" + tr.names[static_cast<std::size_t>(first)] + "' are one expert";
    at[static_cast<std::size_t>(m.expert[k])] = static_cast<int>(k);
  }
  for (const auto& [logical, at] : seen)
    for (std::size_t e = 0; e < at.size(); ++e) {
      if (at[e] < 0) return "'" + logical + "' has no expert " + std::to_string(e) + " of " + std::to_string(m.experts);
      if (tr.shapes.at(tr.names[static_cast<std::size_t>(at[e])]) != tr.shapes.at(tr.names[static_cast<std::size_t>(at[0])]))
        return "the experts of '" + logical + "' differ in shape ('" + tr.names[static_cast<std::size_t>(at[e])] + "')";
    }
  return {};
}

/// What to run.
struct config {
  std::string optimizer;
  std::vector<std::pair<std::string, std::string>> sets;  // --set KEY=VALUE, in order
  std::string param_dtype = "fp32", grad_dtype = "fp32", state = "fp32";
  bool master_weights = true;
  int threads = 1;
  int ranks = 0;             // --ranks N: N ranks with sharded state; 0: one rank, replicated
  int tp = 1;                // --tp T: T tensor-parallel ranks per data-parallel rank (threads)
  int ep = 0;                // --ep E: the experts over E expert-parallel ranks (threads); 0: no experts
  std::string placement = "sharded";  // --placement sharded|owned (owned: galore_adamw, muon)
  int zero = 0;              // --zero S: ZeRO stage S (1..3) with the overlap hooks; 0: stage 1, no hooks
  std::string comm = "threads";
  std::string backend = "cpu";       // --backend cpu|kokkos|emulated|cuda
  std::size_t min_8bit_size = 4096;  // --min-8bit-size N (--state q8)
  int percentile_clipping = 100;     // --percentile-clipping P
  int save_at = -1;                  // --save-at K DIR: save after K steps
  std::string save_dir;
  std::string resume_dir;            // --resume DIR: load, then run the trace's remaining steps
  double max_grad_norm = 0.0;        // --max-grad-norm X: optimizer_options::max_grad_norm
  double clip = 0.0;                 // --clip X: clip_grad_norm(X) before every step
  double loss_scale = 0.0;           // --loss-scale S[,G]: dynamic loss scaling from S (0 = off)
  std::int64_t growth_interval = 2000;  //   ... growing after G clean steps
  int nan_at = 0;                    // --nan-at K: the K-th step's gradient holds a NaN (0 = none)
  bool grad_reduce_fp32 = false;     // --grad-reduce-fp32: optimizer_options::grad_reduce_in_fp32
  std::string log_path;              // --log FILE: one line per step
  int accumulate = 1;                // --accumulate N: each step's gradient in N micro-batches
  bool accumulate_each = false;      // --accumulate-schedule each: accumulation::reduce_each
};

/// Final params by name, fp32, and what each step reported (--log).
struct result {
  std::map<std::string, std::vector<float>> params;
  std::string log;
};

// One entry point per (policy, mode), each in its own translation unit (run.cpp.in).
#define DISTOPT_REPLAY_DECLARE(policy)                         \
  result run_##policy##_single(const trace&, const config&);  \
  result run_##policy##_threads(const trace&, const config&); \
  result run_##policy##_mpi(const trace&, const config&);     \
  result run_##policy##_kokkos(const trace&, const config&);   \
  result run_##policy##_emulated(const trace&, const config&); \
  result run_##policy##_cuda(const trace&, const config&);
DISTOPT_REPLAY_DECLARE(sgd)
DISTOPT_REPLAY_DECLARE(adam)
DISTOPT_REPLAY_DECLARE(adamw)
DISTOPT_REPLAY_DECLARE(lion)
DISTOPT_REPLAY_DECLARE(lamb)
DISTOPT_REPLAY_DECLARE(adafactor)
DISTOPT_REPLAY_DECLARE(came)
DISTOPT_REPLAY_DECLARE(galore_adamw)
DISTOPT_REPLAY_DECLARE(muon)
#undef DISTOPT_REPLAY_DECLARE

}  // namespace replay
