// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt with adamw: its optimizer types (ZeRO stages 1, 2 and 3; bf16 params and q8 states at stage 1) in a translation unit of its own.
#include "train.hpp"

gpt::history gpt::train_adamw(const config& cfg) { return train_policy<distopt::adamw>(cfg); }
