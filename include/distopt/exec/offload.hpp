// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The former place of ZeRO-Offload, which wraps an optimizer rather than visiting
/// elements: it is <distopt/offload.hpp> now, which this includes for code written
/// against the old path.

#include "../offload.hpp"
