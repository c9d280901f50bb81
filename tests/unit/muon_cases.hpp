// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The Muon test groups: AdamW (use_muon = false) as group 0, Muon as group 1; and the
// layout the Muon, GaLore and owned-placement suites start from.

#include <vector>

#include <distopt/layout/registry.hpp>
#include <distopt/policy/muon.hpp>

namespace harness {

/// Matrices (tall, wide, square) in group 1, a bias and a vector in group 0; with one bucket
/// several tensors straddle the shard cuts.
inline distopt::layout matrices_and_vectors(distopt::dtype t) {
  distopt::layout l;
  l.add("w0", {40, 30}, t, 1);
  l.add("b0", {30}, t, 0);
  l.add("w1", {17, 33}, t, 1);
  l.add("norm", {700}, t, 0);
  l.add("w2", {16, 64}, t, 1);
  l.add("w3", {9, 9}, t, 1);
  return l;
}

inline std::vector<distopt::muon::hyper_params> muon_groups(
    bool nesterov = true, distopt::muon_adjust_lr adjust = distopt::muon_adjust_lr::original,
    distopt::muon_ns_dtype ns = distopt::muon_ns_dtype::fp32) {
  distopt::muon::hyper_params adamw;
  adamw.use_muon = false;
  adamw.lr = 3e-3;
  adamw.weight_decay = 0.05;
  distopt::muon::hyper_params m;
  m.lr = 2e-2;
  m.weight_decay = 0.05;
  m.nesterov = nesterov;
  m.adjust_lr_fn = adjust;
  m.ns_dtype = ns;
  return {adamw, m};
}

}  // namespace harness
