// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Reading and writing safetensors files (gradient traces now, checkpoints later).
///
/// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header
/// length N, N bytes of UTF-8 JSON (an object mapping tensor names to
/// {"dtype","shape","data_offsets"}, plus an optional "__metadata__" object of strings),
/// then the data section, which the tensors must cover exactly, without overlaps or holes.
/// The reader validates all of that up front, so accessors never see a bad offset.
/// It is stricter than the Python/Rust reference (0.8), which accepts the first three of:
/// a header not starting with '{' (the format spec requires it), duplicate JSON keys
/// (nlohmann would keep the last silently), keys other than dtype/shape/data_offsets in a
/// tensor entry; like the reference it refuses headers over 100,000,000 bytes.
/// I/O uses POSIX calls (open, fsync, rename) because an atomic replace needs them.
///
/// The parts: io/safetensors_common.hpp (errors, entries, file calls), io/safetensors_reader.hpp,
/// io/safetensors_writer.hpp.

#include "safetensors_common.hpp"
#include "safetensors_reader.hpp"
#include "safetensors_writer.hpp"
