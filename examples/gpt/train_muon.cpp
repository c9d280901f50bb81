// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// distopt-gpt with muon: its optimizer type (stage 1) in a translation unit of its own.
#include <distopt/policy/muon.hpp>

#include "train.hpp"

gpt::history gpt::train_muon(const config& cfg) { return train_policy<distopt::muon>(cfg); }
