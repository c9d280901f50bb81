// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// One of two translation units that include every CUDA header and are linked into one
// program (cuda.two_units_link): a kernel or other function defined, not only declared, in
// a header without being a template or inline would be defined twice, and the link fails.
// The program runs no device code: it passes wherever it links.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>
#include <distopt/exec/cuda/phases.cuh>
#include <distopt/exec/cuda/q8_update.cuh>
#include <distopt/exec/cuda/update.cuh>

int two_units_b();

int main() { return two_units_b(); }
