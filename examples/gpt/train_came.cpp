// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt with came: its optimizer types (ZeRO stages 1, 2 and 3; bf16 params at stage 1) in a translation unit of its own.
#include "train.hpp"

gpt::history gpt::train_came(const config& cfg) { return train_policy<distopt::came>(cfg); }
