// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include <distopt/policy/galore_adamw.hpp>

#include "train.hpp"

fmnist::history fmnist::train_galore_adamw(const config& cfg) {
  return train_policy<distopt::galore_adamw>(cfg);
}
