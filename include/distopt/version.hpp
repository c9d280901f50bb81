// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once

namespace distopt {
/// Library version, bumped with every release; the package config checks it.
inline constexpr int version_major = 0;
inline constexpr int version_minor = 1;
inline constexpr int version_patch = 0;
}  // namespace distopt
