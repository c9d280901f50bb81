// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// distopt-replay: the trace, the run configuration, and one entry point per policy (each
// compiled in its own translation unit, so the instantiations build in parallel).

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

/// The gradient trace: initial params and one gradient per tensor per step, all fp32.
struct trace {
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::int64_t>> shapes;  // as in the file; [] for 0-d
  std::map<std::string, std::vector<float>> params;
  std::vector<std::map<std::string, std::vector<float>>> grads;  // [step][name]
};

/// What to run.
struct config {
  std::string optimizer;
  std::vector<std::pair<std::string, std::string>> sets;  // --set KEY=VALUE, in order
  std::string param_dtype = "fp32", grad_dtype = "fp32", state = "fp32";
  bool master_weights = true;
  int threads = 1;
};

/// Final params by name, fp32.
using result = std::map<std::string, std::vector<float>>;

result run_sgd(const trace&, const config&);
result run_adam(const trace&, const config&);
result run_adamw(const trace&, const config&);
result run_lion(const trace&, const config&);

}  // namespace replay
