// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include <distopt/policy/muon.hpp>

#include "train.hpp"

fmnist::history fmnist::train_muon(const config& cfg) {
  return train_policy<distopt::muon>(cfg);
}
