// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt with galore_adamw: its optimizer type (stage 1) in a translation unit of its own.
#include <distopt/policy/galore_adamw.hpp>

#include "train.hpp"

gpt::history gpt::train_galore_adamw(const config& cfg) { return train_policy<distopt::galore_adamw>(cfg); }
