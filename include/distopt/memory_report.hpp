// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace distopt {

/// Bytes held by one rank, by category, and per parameter of the model.
struct memory_report {
  struct entry {
    /// "params", "grads", "grads fp32", "master", "state 0".., "padding", "comm buffers"
    std::string category;
    std::size_t bytes = 0;  ///< bytes this rank allocates, padding included
  };
  std::vector<entry> entries;
  /// Parameters of the whole model (padding excluded): the denominator of bytes/param.
  std::size_t parameters = 0;

  std::size_t total_bytes() const {
    std::size_t t = 0;
    for (const auto& e : entries) t += e.bytes;
    return t;
  }
  double bytes_per_param(const entry& e) const {
    return parameters ? static_cast<double>(e.bytes) / static_cast<double>(parameters) : 0.0;
  }
  /// Bytes of `category` (0 when this optimizer has none).
  std::size_t bytes(std::string_view category) const {
    std::size_t t = 0;
    for (const auto& e : entries)
      if (e.category == category) t += e.bytes;
    return t;
  }
  /// Bytes per parameter of every category whose name starts with `prefix` ("state" adds the slots).
  double bytes_per_param(std::string_view prefix) const {
    std::size_t t = 0;
    for (const auto& e : entries)
      if (std::string_view(e.category).substr(0, prefix.size()) == prefix) t += e.bytes;
    return parameters ? static_cast<double>(t) / static_cast<double>(parameters) : 0.0;
  }
  double total_bytes_per_param() const {
    return parameters ? static_cast<double>(total_bytes()) / static_cast<double>(parameters) : 0.0;
  }
};

/// Prints one line per category: bytes and bytes per parameter (names padded to the longest).
inline std::ostream& operator<<(std::ostream& os, const memory_report& r) {
  int width = 12;
  for (const auto& e : r.entries) width = std::max(width, static_cast<int>(std::min<std::size_t>(e.category.size(), 40)));
  char line[160];
  for (const auto& e : r.entries) {
    std::snprintf(line, sizeof line, "  %-*.40s %14zu B  %6.2f B/param\n", width, e.category.c_str(), e.bytes,
                  r.bytes_per_param(e));
    os << line;
  }
  std::snprintf(line, sizeof line, "  %-*s %14zu B  %6.2f B/param (%zu params)\n", width, "total",
                r.total_bytes(), r.total_bytes_per_param(), r.parameters);
  return os << line;
}

}  // namespace distopt
