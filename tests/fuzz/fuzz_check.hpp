// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// FUZZ_CHECK(cond): an invariant of an accepted input; aborts (a libFuzzer crash) if broken.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                                    \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: broken invariant: %s\n", __FILE__, __LINE__, #cond);     \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)
