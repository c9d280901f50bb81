// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// What the CUDA optimizer tests share: a run's outcome compared with the CPU's bit for bit
// (params, master weights, states, norms as bits, skipped steps), counted, and a case run
// on each of a list of layouts: cpu on one rank against cuda on one rank and on d = 1..4
// ranks as threads sharing the GPU (sharded states).
#pragma once

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../unit/sharded_harness.hpp"

namespace cuda_check {

inline int failures = 0, checks = 0;

inline void compare(const std::string& what, const harness::outcome& got, const harness::outcome& ref) {
  ++checks;
  // NaN != NaN: the norms are compared as bits.
  const bool norms = got.norms.size() == ref.norms.size() &&
                     std::memcmp(got.norms.data(), ref.norms.data(), ref.norms.size() * sizeof(double)) == 0;
  if (got.params == ref.params && got.master == ref.master && got.states == ref.states && norms &&
      got.skipped == ref.skipped)
    return;
  ++failures;
  std::printf("FAILED: %s:%s%s%s%s%s\n", what.c_str(), got.params == ref.params ? "" : " params",
              got.master == ref.master ? "" : " master", got.states == ref.states ? "" : " states",
              norms ? "" : " norms", got.skipped == ref.skipped ? "" : " skipped");
}

/// On each layout: cpu on one rank against cuda on one rank and on d = 1..4.
template <class Policy, class Enc, class Prec>
void check_case(const std::string& what, const std::vector<typename Policy::hyper_params>& h,
                harness::run_options ro, distopt::dtype t = distopt::dtype::f32,
                const std::vector<harness::layout_case>& layouts = harness::awkward_layouts()) {
  using namespace distopt;
  for (const harness::layout_case& c : layouts) {
    ro.options.bucket_elems = c.bucket;
    const layout l = harness::make_layout(c, t, static_cast<int>(h.size()));
    const harness::outcome ref = harness::run_single<Policy, Enc, Prec, cpu>(l, h, ro);
    compare(what + ", layout " + c.name + ", one rank", harness::run_single<Policy, Enc, Prec, cuda>(l, h, ro), ref);
    for (int d = 1; d <= 4; ++d)  // sharded states, d ranks as threads on one GPU
      compare(what + ", layout " + c.name + ", d=" + std::to_string(d),
              harness::run_threads<Policy, sharded<Enc>, Prec, cuda>(d, l, h, ro), ref);
  }
}

/// Exits 77 (ctest: skipped) without a CUDA device.
inline void skip_without_device(const char* what) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: %s is skipped\n", what);
    std::exit(77);
  }
}

}  // namespace cuda_check
