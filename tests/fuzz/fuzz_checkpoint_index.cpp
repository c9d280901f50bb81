// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// libFuzzer target: io::detail::parse_index (a checkpoint's index.json) on arbitrary text.
// Refusing it with checkpoint_error is fine; any other exception, a crash or a sanitizer
// report is a bug. Random bytes rarely get past the index's own checksum, so each input
// that is a JSON object is parsed a second time with its "checksum" recomputed, which
// fuzzes the checks behind it. An accepted index must hold what parse_index promises.
#include <distopt/checkpoint.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fuzz_check.hpp"

namespace io = distopt::io;

namespace {

void parse(std::string_view text) {
  try {
    const io::detail::checkpoint_index index = io::detail::parse_index(text, "fuzz/index.json");
    FUZZ_CHECK(index.dp_size >= 1 && index.dp_size <= 65536);
    FUZZ_CHECK(index.tp_size >= 1 && index.tp_size <= 65536);
    FUZZ_CHECK(index.files.size() == static_cast<std::size_t>(index.tp_size));
    for (const auto& part : index.files) {
      FUZZ_CHECK(part.size() == static_cast<std::size_t>(index.dp_size));
      for (const auto& f : part)
        FUZZ_CHECK(!f.name.empty() && f.name[0] != '.' && f.name.find('/') == std::string::npos);
    }
  } catch (const io::checkpoint_error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  parse(text);
  // The same object with a right checksum, computed as index_text does (parsed as
  // parse_index parses it, which bounds the nesting that dump() recurses through).
  nlohmann::json j;
  try {
    j = io::detail::parse_json(text, "fuzz/index.json");
  } catch (const io::checkpoint_error&) {
    return 0;
  }
  if (j.is_object()) {
    j.erase("checksum");
    const std::string body = j.dump();
    j["checksum"] = io::detail::hex64(io::detail::xxh3(body.data(), body.size()));
    parse(j.dump(1));
  }
  return 0;
}
