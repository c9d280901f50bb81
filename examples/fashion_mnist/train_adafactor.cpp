// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#include "train.hpp"

fmnist::history fmnist::train_adafactor(const config& cfg) {
  return train_policy<distopt::adafactor>(cfg);
}
