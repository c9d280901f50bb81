// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The checkpoint format (distopt/checkpoint.hpp describes it): the checksums of
/// chunks (xxHash3-64), index.json and each rank file's "distopt.items" metadata, written
/// and parsed with every field checked.

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "../detail/checkpoint_item.hpp"
#include "../version.hpp"

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

namespace distopt::io {

/// A checkpoint that cannot be written or loaded; what() names the file and the problem.
class checkpoint_error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// Elements per checksum chunk.
inline constexpr std::uint64_t checkpoint_chunk = std::uint64_t{1} << 18;
/// The format version this code writes and reads.
inline constexpr int checkpoint_format_version = 1;

namespace detail {

inline std::uint64_t xxh3(const void* data, std::size_t size) noexcept { return XXH3_64bits(data, size); }

inline std::string hex64(std::uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

inline std::optional<std::uint64_t> parse_hex64(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = v << 4 | static_cast<std::uint64_t>(d);
  }
  return v;
}

/// Chunks of the slice [first, first + count) of a vector: chunk boundaries at multiples
/// of checkpoint_chunk.
inline std::uint64_t chunk_count(std::uint64_t first, std::uint64_t count) noexcept {
  return count == 0 ? 0 : (first + count - 1) / checkpoint_chunk - first / checkpoint_chunk + 1;
}

/// The hashes of each chunk of `count` elements starting at element `first`.
inline std::vector<std::uint64_t> chunk_hashes(const std::byte* data, std::uint64_t first, std::uint64_t count,
                                               std::size_t element_size) {
  std::vector<std::uint64_t> out;
  for (std::uint64_t a = first; a < first + count;) {
    const std::uint64_t e = std::min(first + count, (a / checkpoint_chunk + 1) * checkpoint_chunk);
    out.push_back(xxh3(data + (a - first) * element_size, (e - a) * element_size));
    a = e;
  }
  return out;
}

/// One rank file's record of one slice.
struct slice_record {
  std::string dtype;
  std::uint64_t total = 0, first = 0, count = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::uint64_t> hashes;
  distopt::detail::tp_box tp;  // empty in files written before TP resharding: loads on the saving TP layout only
  // Filled by the loader from the safetensors header.
  int part = 0;  // the TP part whose files hold it
  std::size_t file = 0;
  std::uint64_t offset = 0;  // of the slice's first byte in the file
  std::size_t element_size = 0;
};

struct file_record {
  std::string name;
  std::uint64_t bytes = 0, header_hash = 0;
};

/// index.json.
struct checkpoint_index {
  std::string generation;
  int dp_size = 1, tp_size = 1;
  std::map<std::string, std::string, std::less<>> identity, state;
  std::map<std::string, std::string, std::less<>> whole;  // checkpoint_scalars::whole; empty in older indexes
  std::vector<std::vector<file_record>> files;  // [tp rank][dp rank]
};

[[noreturn]] inline void fail(const std::string& label, const std::string& what) {
  throw checkpoint_error(label + ": " + what);
}

inline const nlohmann::json& member(const nlohmann::json& j, const char* key, const std::string& label,
                                    nlohmann::json::value_t type) {
  if (!j.is_object()) fail(label, "expected a JSON object");
  const auto it = j.find(key);
  if (it == j.end()) fail(label, std::string("missing \"") + key + "\"");
  const bool ok = type == nlohmann::json::value_t::number_unsigned ? it->is_number_unsigned() : it->type() == type;
  if (!ok) fail(label, std::string("\"") + key + "\" has the wrong type");
  return *it;
}

inline std::map<std::string, std::string, std::less<>> string_map(const nlohmann::json& j, const std::string& label) {
  if (!j.is_object()) fail(label, "expected an object of strings");
  std::map<std::string, std::string, std::less<>> out;
  for (const auto& [k, v] : j.items()) {
    if (!v.is_string()) fail(label, "\"" + k + "\" is not a string");
    out.emplace(k, v.get<std::string>());
  }
  return out;
}

inline nlohmann::json parse_json(std::string_view text, const std::string& label) {
  // nlohmann's dump() recurses, so deeply nested JSON would overflow the stack in parse_index.
  constexpr int max_depth = 128;
  const auto limit_depth = [&](int depth, nlohmann::json::parse_event_t, const nlohmann::json&) {
    if (depth > max_depth) fail(label, "JSON nested deeper than " + std::to_string(max_depth) + " levels");
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), limit_depth, false);
  if (j.is_discarded()) fail(label, "not valid JSON");
  return j;
}

/// The text of index.json: `index` plus "checksum", the xxHash3 of the same object's
/// compact dump without it (keys sorted, so the dump is canonical).
inline std::string index_text(const checkpoint_index& index) {
  nlohmann::json j;
  j["format"] = "distopt-checkpoint";
  j["format_version"] = checkpoint_format_version;
  j["distopt_version"] = std::to_string(version_major) + "." + std::to_string(version_minor) + "." +
                         std::to_string(version_patch);
  j["generation"] = index.generation;
  j["dp_size"] = index.dp_size;
  j["tp_size"] = index.tp_size;
  j["identity"] = index.identity;
  j["state"] = index.state;
  j["whole_tensors"] = index.whole;
  nlohmann::json files = nlohmann::json::array();
  for (const auto& part : index.files) {
    nlohmann::json p = nlohmann::json::array();
    for (const auto& f : part) p.push_back({{"file", f.name}, {"bytes", f.bytes}, {"header_xxh3", hex64(f.header_hash)}});
    files.push_back(std::move(p));
  }
  j["files"] = std::move(files);
  const std::string body = j.dump();
  j["checksum"] = hex64(xxh3(body.data(), body.size()));
  return j.dump(1) + "\n";
}

/// Parses and checks the text of index.json (`label` names it in messages).
inline checkpoint_index parse_index(std::string_view text, const std::string& label) {
  using vt = nlohmann::json::value_t;
  nlohmann::json j = parse_json(text, label);
  if (!j.is_object()) fail(label, "not a JSON object");
  const auto sum = parse_hex64(member(j, "checksum", label, vt::string).get<std::string>());
  if (!sum) fail(label, "\"checksum\" is not 16 hex digits");
  j.erase("checksum");
  const std::string body = j.dump();
  if (xxh3(body.data(), body.size()) != *sum) fail(label, "checksum mismatch: the index is corrupt");
  if (member(j, "format", label, vt::string) != "distopt-checkpoint") fail(label, "not a distopt checkpoint index");
  const auto version = member(j, "format_version", label, vt::number_unsigned).get<std::uint64_t>();
  if (version != checkpoint_format_version)
    fail(label, "format version " + std::to_string(version) + ", this distopt reads version " +
                    std::to_string(checkpoint_format_version));
  checkpoint_index index;
  index.generation = member(j, "generation", label, vt::string).get<std::string>();
  const auto dp = member(j, "dp_size", label, vt::number_unsigned).get<std::uint64_t>();
  const auto tp = member(j, "tp_size", label, vt::number_unsigned).get<std::uint64_t>();
  if (dp < 1 || dp > 65536 || tp < 1 || tp > 65536) fail(label, "dp_size or tp_size out of range");
  index.dp_size = static_cast<int>(dp);
  index.tp_size = static_cast<int>(tp);
  index.identity = string_map(member(j, "identity", label, vt::object), label + " identity");
  index.state = string_map(member(j, "state", label, vt::object), label + " state");
  if (j.contains("whole_tensors"))  // optional: indexes written before TP resharding have none
    index.whole = string_map(member(j, "whole_tensors", label, vt::object), label + " whole_tensors");
  const auto& files = member(j, "files", label, vt::array);
  if (files.size() != tp) fail(label, "\"files\" has " + std::to_string(files.size()) + " parts, tp_size is " + std::to_string(tp));
  for (const auto& part : files) {
    if (!part.is_array() || part.size() != dp) fail(label, "a part of \"files\" does not list dp_size files");
    auto& out = index.files.emplace_back();
    for (const auto& f : part) {
      file_record r;
      r.name = member(f, "file", label, vt::string).get<std::string>();
      if (r.name.empty() || r.name.find('/') != std::string::npos || r.name[0] == '.')
        fail(label, "file name '" + r.name + "' is not a plain file name");
      r.bytes = member(f, "bytes", label, vt::number_unsigned).get<std::uint64_t>();
      const auto h = parse_hex64(member(f, "header_xxh3", label, vt::string).get<std::string>());
      if (!h) fail(label, "\"header_xxh3\" of '" + r.name + "' is not 16 hex digits");
      r.header_hash = *h;
      out.push_back(std::move(r));
    }
  }
  return index;
}

/// The "distopt.items" metadata of a rank file: name -> its slice.
inline std::string items_text(const std::vector<distopt::detail::checkpoint_item>& items,
                              const std::vector<std::vector<std::uint64_t>>& hashes) {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t k = 0; k < items.size(); ++k) {
    const auto& it = items[k];
    if (!it.save) continue;
    nlohmann::json h = nlohmann::json::array();
    for (std::uint64_t x : hashes[k]) h.push_back(hex64(x));
    j[it.name] = {{"dtype", it.dtype}, {"total", it.total}, {"first", it.first}, {"count", it.count},
                  {"shape", it.shape}, {"xxh3", std::move(h)}};
    if (!it.tp.whole.empty())
      j[it.name]["tp"] = {{"whole", it.tp.whole}, {"box", it.tp.box}, {"offset", it.tp.offset}};
  }
  return j.dump();
}

/// Parses and checks a rank file's "distopt.items" text (`label` names the file).
inline std::map<std::string, slice_record, std::less<>> parse_items(std::string_view text, const std::string& label) {
  using vt = nlohmann::json::value_t;
  const nlohmann::json j = parse_json(text, label + " distopt.items");
  if (!j.is_object()) fail(label, "distopt.items is not a JSON object");
  std::map<std::string, slice_record, std::less<>> out;
  for (const auto& [name, v] : j.items()) {
    const std::string where = label + " item '" + name + "'";
    slice_record r;
    r.dtype = member(v, "dtype", where, vt::string).get<std::string>();
    r.total = member(v, "total", where, vt::number_unsigned).get<std::uint64_t>();
    r.first = member(v, "first", where, vt::number_unsigned).get<std::uint64_t>();
    r.count = member(v, "count", where, vt::number_unsigned).get<std::uint64_t>();
    if (r.first > r.total || r.count > r.total - r.first)
      fail(where, "slice [" + std::to_string(r.first) + ", +" + std::to_string(r.count) + ") exceeds its " +
                      std::to_string(r.total) + " elements");
    const auto& shape = member(v, "shape", where, vt::array);
    std::uint64_t n = 1;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) fail(where, "shape holds a value that is not a non-negative integer");
      const auto u = d.get<std::uint64_t>();
      // Each dimension too, not only the product: after a 0 the product stays 0.
      if (u > (std::uint64_t{1} << 62) || (u != 0 && n > (std::uint64_t{1} << 62) / u)) fail(where, "shape is too large");
      n *= u;
      r.shape.push_back(static_cast<std::int64_t>(u));
    }
    if (n != r.total) fail(where, "shape does not hold " + std::to_string(r.total) + " elements");
    const auto& hashes = member(v, "xxh3", where, vt::array);
    if (hashes.size() != chunk_count(r.first, r.count))
      fail(where, "has " + std::to_string(hashes.size()) + " chunk checksums, its slice has " +
                      std::to_string(chunk_count(r.first, r.count)) + " chunks");
    for (const auto& h : hashes) {
      const auto x = h.is_string() ? parse_hex64(h.get<std::string>()) : std::nullopt;
      if (!x) fail(where, "a chunk checksum is not 16 hex digits");
      r.hashes.push_back(*x);
    }
    if (v.contains("tp")) {  // optional: files written before TP resharding have none
      const auto& tp = member(v, "tp", where, vt::object);
      const auto dims = [&](const char* key) {
        std::vector<std::int64_t> out;
        for (const auto& d : member(tp, key, where + " tp", vt::array)) {
          if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (std::uint64_t{1} << 62))
            fail(where, std::string("tp ") + key + " holds a value that is not a non-negative integer");
          out.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
        }
        return out;
      };
      r.tp = {dims("whole"), dims("box"), dims("offset")};
      const std::size_t rank = r.tp.whole.size();
      std::uint64_t cells = 1;
      bool inside = rank != 0 && r.tp.box.size() == rank && r.tp.offset.size() == rank;
      for (std::size_t a = 0; inside && a < rank; ++a) {
        inside = r.tp.offset[a] <= r.tp.whole[a] && r.tp.box[a] <= r.tp.whole[a] - r.tp.offset[a] &&
                 (cells == 0 || static_cast<std::uint64_t>(r.tp.box[a]) <= r.total / cells);
        if (inside) cells *= static_cast<std::uint64_t>(r.tp.box[a]);
      }
      if (!inside || cells != r.total)
        fail(where, "its tp box does not hold its " + std::to_string(r.total) + " elements inside the whole array");
    }
    out.emplace(name, std::move(r));
  }
  return out;
}

}  // namespace detail
}  // namespace distopt::io
