// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file 8-bit block-wise optimizer states: `replicated<q8>`, `sharded<q8>`. The encoding
/// tag (q8_encoding.hpp), bitsandbytes' dynamic maps and their codebooks
/// (detail/q8_map.hpp), and the optimizer's 8-bit stage (engine/q8.hpp). An
/// optimizer with q8 states needs this header; one with fp32 or bf16 states never parses it.

#include "../engine/q8.hpp"
#include "../detail/q8_map.hpp"
#include "q8_encoding.hpp"
