// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt with lamb: its optimizer types (ZeRO stages 1, 2 and 3; bf16 params at stage 1) in a translation unit of its own.
#include "train.hpp"

gpt::history gpt::train_lamb(const config& cfg) { return train_policy<distopt::lamb>(cfg); }
