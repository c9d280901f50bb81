// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: Storage must model distopt::state_storage,
//   e.g. distopt::replicated<distopt::fp32>
// A storage that does not opt in with `using storage_concept = distopt::storage_tag;`.

#include <distopt/distopt.hpp>

struct untagged_storage {
  // Missing: using storage_concept = distopt::storage_tag;
  using encoding = float;
  static constexpr bool is_sharded = false;
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::sgd, untagged_storage> opt(tensors, distopt::sgd::hyper_params{});
  opt.step();
}
