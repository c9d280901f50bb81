// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "run.hpp"

replay::result replay::run_sgd(const trace& tr, const config& cfg) {
  return run_policy<distopt::sgd>(tr, cfg);
}
