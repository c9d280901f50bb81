// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
/// \file The compiled part of distopt (CMake target distopt::core): one definition of every
/// function the headers mark DISTOPT_CORE_FN, for programs built with DISTOPT_COMPILED_CORE.
/// Without that macro the headers define them inline and this file is not needed.

#if !defined(DISTOPT_COMPILED_CORE)
#error "src/core.cpp is built with DISTOPT_COMPILED_CORE defined (the distopt::core target does it)"
#endif
#define DISTOPT_BUILDING_CORE 1

#include <distopt/distopt.hpp>
