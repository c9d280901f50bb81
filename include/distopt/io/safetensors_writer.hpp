// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The safetensors writer: tensors collected (copied, or viewed) and written as one
/// file, atomically (a temporary file, fsync, rename).

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "safetensors_common.hpp"

namespace distopt::io {

/// Collects tensors (copying their bytes) and writes them as one safetensors file.
class safetensors_writer {
public:
  /// Sets (or replaces) a "__metadata__" entry.
  void set_metadata(std::string key, std::string value) {
    detail::require_json_string(key, "metadata key");
    detail::require_json_string(value, "metadata value");
    metadata_.insert_or_assign(std::move(key), std::move(value));
  }

  /// Adds a tensor of safetensors `dtype` and `shape` whose little-endian bytes are `data`.
  /// std::invalid_argument on a duplicate or reserved name, an unknown dtype, a negative
  /// dimension, or data.size() != numel * dtype size.
  void add(std::string name, std::string dtype, std::vector<std::int64_t> shape,
           std::span<const std::byte> data) {
    add_entry(std::move(name), std::move(dtype), std::move(shape), data, true);
  }

  /// add() without a copy: `data` must stay valid until write() returns.
  void add_view(std::string name, std::string dtype, std::vector<std::int64_t> shape,
                std::span<const std::byte> data) {
    add_entry(std::move(name), std::move(dtype), std::move(shape), data, false);
  }

  /// add() for float32 values.
  void add_f32(std::string name, std::vector<std::int64_t> shape, std::span<const float> values) {
    add(std::move(name), "F32", std::move(shape), std::as_bytes(values));
  }

  /// The 8-byte length field and the JSON header the file will start with.
  [[nodiscard]] std::string header() const {
    const std::string text = header_text();
    const std::uint64_t size = text.size();
    std::string out(8, '\0');
    std::memcpy(out.data(), &size, 8);
    return out + text;
  }

  /// Writes the file atomically: a temporary file in the target's directory, flushed and
  /// fsynced, then renamed over `path` (the directory is fsynced too, best effort).
  /// On failure the temporary file is removed and std::runtime_error names the path and
  /// the errno text; an existing file at `path` is then left untouched.
  void write(const std::filesystem::path& path) const { write(path, header()); }

  /// write() with the header() already made; returns the file's size in bytes.
  std::uint64_t write(const std::filesystem::path& path, const std::string& head) const {
    std::vector<std::span<const std::byte>> parts{std::as_bytes(std::span<const char>(head))};
    std::uint64_t size = head.size();
    for (const auto& [name, e] : tensors_) {
      parts.push_back(e.view);
      size += e.view.size();
    }
    detail::atomic_write(path, parts);
    return size;
  }

private:
  struct entry {
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> owned;     // add(): a copy
    std::span<const std::byte> view;  // what is written: the copy, or add_view()'s bytes
  };

  void add_entry(std::string name, std::string dtype, std::vector<std::int64_t> shape,
                 std::span<const std::byte> data, bool copy) {
    const std::string where = "safetensors_writer: tensor '" + name + "': ";
    if (name == "__metadata__") throw std::invalid_argument(where + "name is reserved");
    if (tensors_.contains(name)) throw std::invalid_argument(where + "duplicate name");
    detail::require_json_string(name, "tensor name");
    const auto element_size = dtype_size(dtype);
    if (!element_size) throw std::invalid_argument(where + "unknown dtype '" + dtype + "'");
    for (auto d : shape) {
      if (d < 0) throw std::invalid_argument(where + "negative dimension " + std::to_string(d));
    }
    const auto expected = detail::byte_count(shape, *element_size);
    if (!expected || *expected != data.size()) {
      throw std::invalid_argument(where + "dtype " + dtype + " and shape " +
                                  detail::shape_string(shape) + " need " +
                                  (expected ? std::to_string(*expected) : "too many") +
                                  " bytes, got " + std::to_string(data.size()));
    }
    auto& e = tensors_[std::move(name)];
    e.dtype = std::move(dtype);
    e.shape = std::move(shape);
    if (copy) {
      e.owned.assign(data.begin(), data.end());
      e.view = e.owned;
    } else {
      e.view = data;
    }
  }

  // Compact JSON as the reference writer emits it: "__metadata__" first, then tensors by
  // name with keys dtype, shape, data_offsets; spaces pad it to a multiple of 8 bytes.
  std::string header_text() const {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      auto& meta = header["__metadata__"] = nlohmann::ordered_json::object();
      for (const auto& [key, value] : metadata_) meta[key] = value;
    }
    std::uint64_t offset = 0;
    for (const auto& [name, e] : tensors_) {
      nlohmann::ordered_json t = nlohmann::ordered_json::object();
      t["dtype"] = e.dtype;
      t["shape"] = e.shape;
      t["data_offsets"] = nlohmann::ordered_json::array({offset, offset + e.view.size()});
      offset += e.view.size();
      header[name] = std::move(t);
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    return text;
  }

  std::map<std::string, std::string> metadata_;
  std::map<std::string, entry> tensors_;
};

}  // namespace distopt::io
