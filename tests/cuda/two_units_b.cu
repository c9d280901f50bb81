// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The second translation unit of cuda.two_units_link (two_units_a.cu says why).

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>
#include <distopt/exec/cuda/phases.cuh>
#include <distopt/exec/cuda/q8_update.cuh>
#include <distopt/exec/cuda/update.cuh>

int two_units_b() { return 0; }
