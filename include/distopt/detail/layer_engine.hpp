// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The former place of the layer-wise stage: <distopt/engine/layerwise.hpp>, which a
/// custom layer-wise policy's header includes now; this includes it for code written
/// against the old path.

#include "../engine/layerwise.hpp"
