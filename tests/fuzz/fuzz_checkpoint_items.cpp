// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// libFuzzer target: io::detail::parse_items (a rank file's "distopt.items" metadata) on
// arbitrary text. Refusing it with checkpoint_error is fine; any other exception, a crash
// or a sanitizer report is a bug. An accepted record must be what the loader relies on: a
// slice inside its vector, a shape of non-negative dimensions holding `total` elements,
// one checksum per chunk.
#include <distopt/checkpoint.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "fuzz_check.hpp"

namespace io = distopt::io;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto records = io::detail::parse_items(text, "fuzz.safetensors");
    for (const auto& [name, r] : records) {
      FUZZ_CHECK(r.first <= r.total && r.count <= r.total - r.first);
      unsigned __int128 n = 1;
      for (auto d : r.shape) {
        FUZZ_CHECK(d >= 0);
        n *= static_cast<std::uint64_t>(d);
      }
      FUZZ_CHECK(n == r.total);
      FUZZ_CHECK(r.hashes.size() == io::detail::chunk_count(r.first, r.count));
    }
  } catch (const io::checkpoint_error&) {
  }
  return 0;
}
