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
      if (dot != std::string::npos && !digits.empty() && digits.size() < 6 &&
          digits.find_first_not_of("0123456789") == std::string::npos) {
        e = std::stoi(digits);
        logical = "experts" + n.substr(dot);
      }
    }
    m.expert.push_back(e);
    m.logical.push_back(std::move(logical));
    m.experts = std::max(m.experts, e + 1);
  }
  return m;
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
