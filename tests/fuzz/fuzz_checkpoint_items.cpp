// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// libFuzzer target: io::detail::parse_items (a rank file's "distopt.items" metadata) on
// arbitrary text. Refusing it with checkpoint_error is fine; any other exception, a crash
// or a sanitizer report is a bug. An accepted record must be what the loader relies on: a
// slice inside its vector, a shape of non-negative dimensions holding `total` elements,
// one checksum per chunk, and a TP box (when given) inside its whole array holding them.
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
      if (!r.tp.whole.empty()) {  // a TP box: inside its whole array, holding the vector's elements
        FUZZ_CHECK(r.tp.box.size() == r.tp.whole.size() && r.tp.offset.size() == r.tp.whole.size());
        unsigned __int128 cells = 1;
        for (std::size_t a = 0; a < r.tp.whole.size(); ++a) {
          FUZZ_CHECK(r.tp.box[a] >= 0 && r.tp.offset[a] >= 0 && r.tp.offset[a] <= r.tp.whole[a] &&
                     r.tp.box[a] <= r.tp.whole[a] - r.tp.offset[a]);
          cells *= static_cast<std::uint64_t>(r.tp.box[a]);
        }
        FUZZ_CHECK(cells == r.total);
      }
    }
  } catch (const io::checkpoint_error&) {
  }
  return 0;
}
