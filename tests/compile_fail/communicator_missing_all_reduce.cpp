// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: Comm must model distopt::communicator,
//   e.g. distopt::single
// A communicator without all_reduce.

#include <distopt/distopt.hpp>

#include <algorithm>
#include <cstddef>
#include <span>

struct group_without_all_reduce {
  using communicator_concept = distopt::communicator_tag;
  int rank() const { return 0; }
  int size() const { return 1; }
  // Missing: template <class T> void all_reduce(std::span<T>, distopt::reduce_op);
  void all_gather(std::span<const float> in, std::span<float> out) {
    std::copy(in.begin(), in.end(), out.begin());
  }
  void reduce_scatter(std::span<const float> in, std::span<float> out, distopt::reduce_op) {
    std::copy(in.begin(), in.end(), out.begin());
  }
  void reduce(std::span<const float> in, std::span<float> out, distopt::reduce_op, int) {
    std::copy(in.begin(), in.end(), out.begin());
  }
  void broadcast(std::span<float>, int) {}
  std::size_t bytes_sent() const { return 0; }
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::sgd, distopt::replicated<distopt::fp32>, group_without_all_reduce>
      opt(tensors, distopt::sgd::hyper_params{});
  opt.step();
}
