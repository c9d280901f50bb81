// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Expected to fail to compile with:
//   static assertion failed: distopt::optimizer: Exec must model distopt::executor,
//   e.g. distopt::cpu
// An executor that cannot visit index ranges.

#include <distopt/distopt.hpp>

#include <cstddef>
#include <new>

struct serial_without_parallel_for {
  using executor_concept = distopt::executor_tag;
  using memory_space = distopt::host_space;
  void* allocate_bytes(std::size_t n) { return ::operator new(n); }
  void deallocate_bytes(void* p, std::size_t) { ::operator delete(p); }
  int concurrency() const { return 1; }
  // Missing: template <class F> void parallel_for(std::size_t n, F f);
};

int main() {
  distopt::layout tensors;
  tensors.add("w", {4});
  distopt::optimizer<distopt::sgd, distopt::replicated<distopt::fp32>, distopt::single,
                     serial_without_parallel_for>
      opt(tensors, distopt::sgd::hyper_params{});
  opt.step();
}
