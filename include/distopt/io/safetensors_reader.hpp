// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The safetensors reader: a whole file held in memory (or its header alone),
/// validated on open (io/safetensors.hpp says how strictly).

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

/// A whole safetensors file held in memory, validated on open.
class safetensors_reader {
public:
  /// Reads and validates `path`. Throws format_error for malformed content and
  /// std::runtime_error (naming the path and errno text) if the file cannot be read.
  [[nodiscard]] static safetensors_reader open(const std::filesystem::path& path) {
    safetensors_reader r;
    r.path_ = path;
    r.file_ = detail::read_whole_file(path);
    r.file_size_ = r.file_.size();
    r.parse();
    return r;
  }

  /// Validates `bytes` as a whole safetensors file; `label` names it in messages (fuzzing,
  /// files already in memory).
  [[nodiscard]] static safetensors_reader from_bytes(std::vector<std::byte> bytes, std::string label) {
    safetensors_reader r;
    r.path_ = std::move(label);
    r.file_ = std::move(bytes);
    r.file_size_ = r.file_.size();
    r.parse();
    return r;
  }

  /// Reads only the length field and the header of `path` (plus its size) and validates
  /// them, including that the entries tile the data section the file size implies. The
  /// data is not read: bytes() and read_f32() refuse; read a tensor at data_start() +
  /// info(name).begin yourself (checkpoints read only the slices they need).
  [[nodiscard]] static safetensors_reader open_header(const std::filesystem::path& path) {
    auto [head, size] = read_header(path);
    return from_header(path, std::move(head), size);
  }

  /// The first bytes of `path` up to the end of its header (only the length field when
  /// that is out of range) and the file's size: what open_header validates, for callers
  /// that check a checksum of the raw bytes first.
  [[nodiscard]] static std::pair<std::vector<std::byte>, std::uint64_t> read_header(const std::filesystem::path& path) {
    const auto fail_io = [&](const char* what) {
      return std::runtime_error(path.string() + ": " + what + ": " + std::strerror(errno));
    };
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw fail_io("cannot open");
    struct closer {
      int fd;
      ~closer() { ::close(fd); }
    } guard{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw fail_io("cannot stat");
    const auto file_size = static_cast<std::uint64_t>(st.st_size);
    std::vector<std::byte> head;
    std::uint64_t header_size = 0;
    if (file_size >= 8) {
      if (!detail::read_at(fd, reinterpret_cast<std::byte*>(&header_size), 8, 0)) throw fail_io("cannot read");
      head.resize(8);
      if (header_size <= file_size - 8 && header_size <= max_header_size) {
        head.resize(static_cast<std::size_t>(8 + header_size));
        if (!detail::read_at(fd, head.data(), head.size(), 0)) throw fail_io("cannot read");
      } else {
        std::memcpy(head.data(), &header_size, 8);  // parse() reports the bad length
      }
    }
    return {std::move(head), file_size};
  }

  /// Validates what read_header returned (`label` names the file in messages).
  [[nodiscard]] static safetensors_reader from_header(std::filesystem::path label, std::vector<std::byte> head,
                                                      std::uint64_t file_size) {
    safetensors_reader r;
    r.path_ = std::move(label);
    r.header_only_ = true;
    r.file_size_ = file_size;
    r.file_ = std::move(head);
    r.parse();
    return r;
  }

  /// The length field and the JSON header, as in the file (what a checkpoint checksums).
  [[nodiscard]] std::span<const std::byte> header_bytes() const noexcept {
    return std::span<const std::byte>(file_).first(static_cast<std::size_t>(data_start_));
  }
  /// Offset of the data section from the start of the file.
  [[nodiscard]] std::uint64_t data_start() const noexcept { return data_start_; }
  /// Size of the whole file in bytes.
  [[nodiscard]] std::uint64_t file_size() const noexcept { return file_size_; }

  /// The path the file was opened from.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  /// The "__metadata__" object; empty if the file has none.
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept {
    return metadata_;
  }

  /// Tensor names in sorted order.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& [name, info] : tensors_) out.push_back(name);
    return out;
  }

  /// Whether the file holds a tensor called `name`.
  [[nodiscard]] bool contains(std::string_view name) const {
    return tensors_.find(name) != tensors_.end();
  }

  /// The header entry of `name`; format_error "missing tensor 'name'" if absent.
  [[nodiscard]] const tensor_info& info(std::string_view name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("missing tensor '" + std::string(name) + "'");
    return it->second;
  }

  /// The raw little-endian bytes of `name` (no alignment guarantee; copy before reinterpreting).
  [[nodiscard]] std::span<const std::byte> bytes(std::string_view name) const {
    const tensor_info& t = info(name);
    if (header_only_) fail("tensor '" + t.name + "': the file was opened for its header only");
    return std::span<const std::byte>(file_).subspan(
        static_cast<std::size_t>(data_start_ + t.begin), static_cast<std::size_t>(t.end - t.begin));
  }

  /// `name` converted to float: F32, BF16 and F16 exactly; F64 rounded to nearest
  /// (values beyond float range become infinities). Other dtypes give format_error.
  [[nodiscard]] std::vector<float> read_f32(std::string_view name) const {
    const tensor_info& t = info(name);
    const auto raw = bytes(name);
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    if (t.dtype == "F32") {
      if (!out.empty()) std::memcpy(out.data(), raw.data(), raw.size());
    } else if (t.dtype == "BF16" || t.dtype == "F16") {
      const bool bf16 = t.dtype == "BF16";
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t bits = 0;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        out[i] = bf16 ? detail::bf16_bits_to_float(bits) : detail::f16_bits_to_float(bits);
      }
    } else if (t.dtype == "F64") {
      for (std::size_t i = 0; i < out.size(); ++i) {
        double v = 0;
        std::memcpy(&v, raw.data() + 8 * i, 8);
        out[i] = static_cast<float>(v);
      }
    } else {
      fail("tensor '" + t.name + "': read_f32 cannot convert dtype " + t.dtype +
           " (supported: F32, BF16, F16, F64)");
    }
    return out;
  }

private:
  /// Largest header the reference implementation accepts.
  static constexpr std::uint64_t max_header_size = 100'000'000;
  /// Deepest JSON nesting a header may have (about serde_json's limit of 128; a valid header
  /// nests 3 levels).
  static constexpr int max_json_depth = 128;

  safetensors_reader() = default;

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error(path_.string() + ": " + what);
  }

  void parse() {
    const std::uint64_t file_size = file_size_;
    if (file_size < 8) {
      fail("file size " + std::to_string(file_size) +
           " is smaller than the 8-byte header length field");
    }
    std::uint64_t header_size = 0;
    if (file_.size() < 8) fail("cannot read the 8-byte header length field");
    std::memcpy(&header_size, file_.data(), 8);
    if (header_size > file_size - 8) {
      fail("header length " + std::to_string(header_size) + " exceeds file size " +
           std::to_string(file_size));
    }
    if (header_size > max_header_size) {
      fail("header length " + std::to_string(header_size) + " exceeds the limit of " +
           std::to_string(max_header_size) + " bytes");
    }
    data_start_ = 8 + header_size;
    const std::uint64_t data_size = file_size - data_start_;
    const char* text = reinterpret_cast<const char*>(file_.data()) + 8;
    if (header_size == 0 || text[0] != '{') {
      fail("header does not start with '{' (it must be a JSON object)");
    }

    const nlohmann::json header = parse_json(text, text + header_size);
    if (!header.is_object()) fail("header is not a JSON object");

    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        parse_metadata(value);
      } else {
        parse_entry(key, value, data_size);
      }
    }
    check_coverage(data_size);
  }

  // nlohmann keeps the last of duplicate keys, so a parser callback tracks the keys of
  // every open object (a set: a header may have millions) and records the first repeat.
  // It also refuses nesting deeper than max_json_depth, as the reference (serde_json) does:
  // nlohmann's dump() recurses, so a deeply nested value would overflow the stack.
  nlohmann::json parse_json(const char* first, const char* last) const {
    std::vector<std::set<std::string>> open_objects;
    std::optional<std::string> duplicate;
    const auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      using ev = nlohmann::json::parse_event_t;
      if (depth > max_json_depth) {
        fail("header nests JSON deeper than " + std::to_string(max_json_depth) + " levels");
      }
      if (event == ev::object_start) {
        open_objects.emplace_back();
      } else if (event == ev::object_end) {
        if (!open_objects.empty()) open_objects.pop_back();
      } else if (event == ev::key && !open_objects.empty()) {
        auto key = parsed.get<std::string>();
        if (!open_objects.back().insert(key).second && !duplicate) duplicate = std::move(key);
      }
      return true;
    };
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(first, last, callback);
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("header is not valid JSON: ") + e.what());
    }
    if (duplicate) fail("duplicate key '" + *duplicate + "' in header");
    return header;
  }

  void parse_metadata(const nlohmann::json& value) {
    if (!value.is_object()) fail("'__metadata__' is not a JSON object");
    for (const auto& [key, v] : value.items()) {
      if (!v.is_string()) fail("'__metadata__' value of '" + key + "' is not a string");
      metadata_.emplace(key, v.get<std::string>());
    }
  }

  void parse_entry(const std::string& name, const nlohmann::json& entry, std::uint64_t data_size) {
    const std::string where = "tensor '" + name + "': ";
    if (!entry.is_object()) fail(where + "entry is not a JSON object");
    for (const auto& [key, v] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(where + "unexpected key '" + key + "'");
      }
    }
    const auto field = [&](const char* key) -> const nlohmann::json& {
      const auto it = entry.find(key);
      if (it == entry.end()) fail(where + "missing '" + key + "'");
      return *it;
    };

    tensor_info t;
    t.name = name;
    const auto& dtype = field("dtype");
    if (!dtype.is_string()) fail(where + "'dtype' is not a string");
    t.dtype = dtype.get<std::string>();
    const auto element_size = dtype_size(t.dtype);
    if (!element_size) fail(where + "unknown dtype '" + t.dtype + "'");

    const auto& shape = field("shape");
    if (!shape.is_array()) fail(where + "'shape' is not an array");
    for (const auto& d : shape) {
      if (d.is_number_unsigned()) {
        const auto u = d.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
          fail(where + "dimension " + std::to_string(u) + " is too large");
        }
        t.shape.push_back(static_cast<std::int64_t>(u));
      } else if (d.is_number_integer()) {
        fail(where + "negative dimension " + std::to_string(d.get<std::int64_t>()) +
             " in shape");
      } else {
        fail(where + "'shape' element " + d.dump() + " is not an integer");
      }
    }
    const auto expected = detail::byte_count(t.shape, *element_size);
    if (!expected) {
      fail(where + "size of dtype " + t.dtype + " and shape " + detail::shape_string(t.shape) +
           " overflows 64 bits");
    }

    const auto& offsets = field("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      fail(where + "'data_offsets' is not an array of two integers");
    }
    for (const auto& o : offsets) {
      if (o.is_number_unsigned()) continue;
      if (o.is_number_integer()) fail(where + "negative data offset " + o.dump());
      fail(where + "'data_offsets' element " + o.dump() + " is not an integer");
    }
    t.begin = offsets[0].get<std::uint64_t>();
    t.end = offsets[1].get<std::uint64_t>();
    if (t.begin > t.end) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " are reversed (begin > end)");
    }
    if (t.end - t.begin != *expected) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " do not match dtype " + t.dtype + " and shape " + detail::shape_string(t.shape) +
           " (" + std::to_string(*expected) + " bytes)");
    }
    if (t.end > data_size) {
      fail(where + "data offsets " + detail::range_string(t.begin, t.end) +
           " exceed the data section (" + std::to_string(data_size) + " bytes)");
    }
    tensors_.emplace(name, std::move(t));
  }

  // safetensors requires the tensors to tile the data section exactly.
  void check_coverage(std::uint64_t data_size) const {
    std::vector<const tensor_info*> order;
    order.reserve(tensors_.size());
    for (const auto& [name, t] : tensors_) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const tensor_info* a, const tensor_info* b) {
      return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
    });
    std::uint64_t covered = 0;
    const tensor_info* previous = nullptr;
    for (const tensor_info* t : order) {
      if (t->begin < covered) {
        fail("tensors '" + previous->name + "' " + detail::range_string(previous->begin, previous->end) +
             " and '" + t->name + "' " + detail::range_string(t->begin, t->end) + " overlap");
      }
      if (t->begin > covered) {
        fail("hole in the data section: bytes " + detail::range_string(covered, t->begin) +
             " belong to no tensor");
      }
      covered = t->end;
      previous = t;
    }
    if (covered != data_size) {
      fail("hole in the data section: bytes " + detail::range_string(covered, data_size) +
           " after the last tensor belong to no tensor");
    }
  }

  std::filesystem::path path_;
  std::vector<std::byte> file_;  // the whole file, or its first data_start_ bytes (header_only_)
  std::uint64_t file_size_ = 0;
  bool header_only_ = false;
  std::uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, tensor_info, std::less<>> tensors_;
};

}  // namespace distopt::io
