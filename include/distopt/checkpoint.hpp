// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Checkpoints: `opt.save(dir)` and `opt.load(dir)` (collective).
///
/// A checkpoint is a directory:
///   index.json                                  written last, atomically (rename)
///   distopt-GEN-tpT-of-TT-rankR-of-D.safetensors  one per rank, written before the index
/// GEN names one save (the step and a random number all ranks agree on), so a new save
/// never overwrites the files the current index names: a crash at any point leaves the
/// previous checkpoint loadable. After the new index is in place, rank 0 removes the older
/// generations' files and any temporary files.
///
/// Each rank file holds this rank's slices of every tensor's params, master weights and
/// states under stable names ("<tensor>/param", "<tensor>/master", "<tensor>/state.K",
/// "<tensor>/state.K.codes" and ".absmax" for q8, "<tensor>/row_states",
/// "<tensor>/col_states", "<tensor>/projected.K", "<tensor>/projector.left|right",
/// "<tensor>/clip_history"). Its "__metadata__" entry "distopt.items" says, per name, which
/// elements [first, first + count) of a flat vector of `total` elements the slice holds,
/// the whole vector's shape, and an xxHash3-64 of each chunk of 2^18 elements (chunks
/// aligned to the vector, so a reader checks exactly the chunks it reads). The index holds
/// the policy, dtypes, layout, step, hyper-parameters and other scalars, the size and
/// header hash of every rank file, and a hash of itself.
///
/// Loading works for any data-parallel size: each rank reads the headers, then only the
/// chunks that hold its own elements. Every rank checks everything it reads; then the
/// ranks agree (one all-reduce) before anyone changes its state, so a bad checkpoint
/// leaves every rank's optimizer as it was. Each TP part writes its own files; the items
/// also say where the part's box lies in the whole (TP-unsplit) array, so a checkpoint
/// loads on another TP size, or another split of a tensor: each rank then reads its box
/// from the parts holding it (the index's "whole_tensors" must match). 8-bit absmax of
/// blocks that a TP cut splits have no such place and load only on the saving TP layout.
///
/// Needs xxHash (Debian: libxxhash-dev), used header-only.

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "detail/checkpoint_item.hpp"
#include "detail/layout_check.hpp"
#include "io/safetensors.hpp"
#include "optimizer.hpp"
#include "policy/hyper_text.hpp"
#include "version.hpp"

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

/// What saving and loading need from an optimizer and its communicators, with their types
/// erased: the checkpoint code below is compiled once per translation unit, not once per
/// optimizer type (save and load were an eighth of the object code of a TU instantiating 21
/// optimizers, one copy per optimizer).
struct checkpoint_party {
  int rank = 0, size = 1;        ///< in the data-parallel group
  int tp_rank = 0, tp_size = 1;  ///< in the tensor-parallel group (0 of 1 without one)
  /// In place: the largest value of every rank, over the DP group and then the TP group.
  std::function<void(std::span<double>)> all_max;
  /// Every rank's `mine` into `grid`, TP part by TP part, DP rank by DP rank.
  std::function<void(std::span<const double> mine, std::span<double> grid)> all_gather;
  std::function<distopt::detail::checkpoint_scalars()> scalars;
  std::function<std::vector<distopt::detail::checkpoint_item>()> items;
  std::function<void(const std::map<std::string, std::string, std::less<>>&)> restore;
  /// Throws if `text` is not a hyper-parameter group this optimizer can restore as group `g`.
  std::function<void(int g, const std::string& text)> check_group;
};

/// The largest `value` of any rank.
inline double all_max(const checkpoint_party& p, double value) {
  std::array<double, 1> v{value};
  p.all_max(std::span<double>(v));
  return v[0];
}

/// Raises the same decision on every rank: this rank's own error if it had one, else a
/// checkpoint_error naming the (highest) failing rank.
inline void agree(const checkpoint_party& p, const std::string& error, const std::string& what) {
  const int global = p.tp_rank * p.size + p.rank;
  const double failed = all_max(p, error.empty() ? 0.0 : static_cast<double>(global + 1));
  if (!error.empty()) throw checkpoint_error(error);
  if (failed > 0)
    throw checkpoint_error(what + ": rank " + std::to_string(static_cast<long>(failed) - 1) +
                           " failed (its error says why); nothing was changed");
}

inline std::string rank_file_name(const std::string& generation, int t, int tp, int r, int d) {
  return "distopt-" + generation + "-tp" + std::to_string(t) + "-of-" + std::to_string(tp) + "-rank" +
         std::to_string(r) + "-of-" + std::to_string(d) + ".safetensors";
}

/// Removes the files of other generations and temporary files left by crashed writes.
inline void remove_stale(const std::filesystem::path& dir, const std::string& generation) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool ours = n.starts_with("distopt-") && n.ends_with(".safetensors");
    const bool tmp = (n.starts_with(".distopt-") || n.starts_with(".index.json")) && n.find(".tmp-") != std::string::npos;
    if ((ours && n.find("-" + generation + "-") == std::string::npos) || tmp) std::filesystem::remove(e.path(), ec);
  }
}

/// A file opened for reading slices, on first use: a rank resharding over TP may read from
/// every part's files (TP x DP of them), so it holds only those of one item at a time open.
struct read_file {
  std::filesystem::path path;
  read_file() = default;
  read_file(const read_file&) = delete;
  read_file& operator=(const read_file&) = delete;
  ~read_file() { close(); }
  int handle() const {
    if (fd_ < 0) {
      fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd_ < 0) fail(path.string(), std::string("cannot open: ") + std::strerror(errno));
    }
    return fd_;
  }
  void close() const {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

private:
  mutable int fd_ = -1;
};

/// Reads elements [a, b) of `s` (a slice in file `f`) into `out`, reading and checking
/// every chunk they touch.
inline void read_slice(const read_file& f, const slice_record& s, std::uint64_t a, std::uint64_t b, std::byte* out,
                       std::vector<std::byte>& buffer, const std::string& item) {
  const std::uint64_t c = checkpoint_chunk, es = s.element_size;
  const std::uint64_t lo = std::max(s.first, a / c * c), hi = std::min(s.first + s.count, (b + c - 1) / c * c);
  // Whole chunks wanted (the usual case: the slice, or cuts on chunk boundaries): read them
  // straight into `out`; otherwise through `buffer`, then copy the wanted part.
  const bool direct = lo == a && hi == b;
  std::byte* dst = out;
  if (!direct) {
    buffer.resize(static_cast<std::size_t>((hi - lo) * es));
    dst = buffer.data();
  }
  if (!::distopt::io::detail::read_at(f.handle(), dst, static_cast<std::size_t>((hi - lo) * es), s.offset + (lo - s.first) * es))
    fail(f.path.string(), "cannot read '" + item + "'" + (errno ? std::string(": ") + std::strerror(errno) : ": file ends early"));
  for (std::uint64_t x = lo; x < hi;) {
    const std::uint64_t e = std::min(s.first + s.count, (x / c + 1) * c);
    const std::size_t k = static_cast<std::size_t>(x / c - s.first / c);
    if (xxh3(dst + (x - lo) * es, (e - x) * es) != s.hashes[k])
      fail(f.path.string(), "checksum mismatch in '" + item + "' elements [" + std::to_string(x) + ", " +
                                std::to_string(e) + "): the file is corrupt");
    x = e;
  }
  if (!direct) std::memcpy(out, buffer.data() + (a - lo) * es, static_cast<std::size_t>((b - a) * es));
}

/// Reads elements [it.first, it.first + it.count) of `it` into `out` from a checkpoint whose
/// TP parts cut the item's whole array otherwise than this optimizer does (another TP size,
/// or another split of a tensor). Each element's place in the whole array (it.tp) is looked
/// up in the boxes the saving parts wrote; the first part holding it is read (every part
/// holding an element holds the same bits). Runs along the last axis are cut where a part's
/// box or a rank's slice ends; each slice is read once over the range its runs span, and
/// every chunk read is checked.
inline void read_resharded(const distopt::detail::checkpoint_item& it, const std::vector<slice_record>& slices,
                           const std::vector<read_file>& files, std::byte* out, std::vector<std::byte>& buffer) {
  const distopt::detail::tp_box& want = it.tp;
  const auto fixed = [&](const std::string& label) {
    fail(label, "'" + it.name + "' holds 8-bit absmax of blocks that a TP cut splits (a tensor split by columns, or "
                "by rows into parts not a multiple of " + std::to_string(q8::block) +
                " elements): it loads only with the TP layout that saved it");
  };
  if (want.whole.empty()) fixed("this optimizer's TP layout");
  struct part_slices {
    const distopt::detail::tp_box* box = nullptr;
    std::vector<std::size_t> slices;  // by first element
  };
  std::map<int, part_slices> parts;  // by TP part: the lowest holder of an element is read
  for (std::size_t k = 0; k < slices.size(); ++k) {
    const slice_record& s = slices[k];
    const std::string file = files[s.file].path.string();
    if (s.tp.whole.empty()) fixed(file);
    if (s.dtype != it.dtype || s.tp.whole != want.whole)
      fail(file, "'" + it.name + "' is " + s.dtype + " in a whole array of shape " + shape_string(s.tp.whole) +
                     ", this optimizer keeps " + it.dtype + " in one of shape " + shape_string(want.whole));
    part_slices& p = parts[s.part];
    if (p.box && (p.box->box != s.tp.box || p.box->offset != s.tp.offset))
      fail(file, "'" + it.name + "': the files of TP part " + std::to_string(s.part) + " disagree on its box");
    p.box = &s.tp;
    p.slices.push_back(k);
  }
  for (auto& [part, p] : parts)
    std::sort(p.slices.begin(), p.slices.end(), [&](std::size_t a, std::size_t b) { return slices[a].first < slices[b].first; });

  struct run {
    std::size_t slice;
    std::uint64_t from, to, count;  // elements [from, from + count) of the slice's part -> out[to, ...)
  };
  std::vector<run> runs;
  const std::size_t nd = want.whole.size();
  std::vector<std::int64_t> c(nd);  // the element's place in the whole array
  const std::uint64_t end = it.first + it.count;
  for (std::uint64_t e = it.first; e < end;) {
    std::uint64_t x = e;
    for (std::size_t a = nd; a-- > 0;) {
      c[a] = want.offset[a] + static_cast<std::int64_t>(x % static_cast<std::uint64_t>(want.box[a]));
      x /= static_cast<std::uint64_t>(want.box[a]);
    }
    std::uint64_t left = std::min(static_cast<std::uint64_t>(want.offset.back() + want.box.back() - c.back()), end - e);
    while (left > 0) {
      const part_slices* holder = nullptr;
      for (const auto& [part, p] : parts) {
        bool in = true;
        for (std::size_t a = 0; a < nd && in; ++a) in = c[a] >= p.box->offset[a] && c[a] < p.box->offset[a] + p.box->box[a];
        if (in) {
          holder = &p;
          break;
        }
      }
      if (!holder) fail("the checkpoint", "no TP part holds element " + shape_string(c) + " of '" + it.name + "'");
      const distopt::detail::tp_box& b = *holder->box;
      std::uint64_t at = 0;
      for (std::size_t a = 0; a < nd; ++a) at = at * static_cast<std::uint64_t>(b.box[a]) + static_cast<std::uint64_t>(c[a] - b.offset[a]);
      const auto next = std::upper_bound(holder->slices.begin(), holder->slices.end(), at,
                                         [&](std::uint64_t v, std::size_t k) { return v < slices[k].first; });
      const slice_record* s = next == holder->slices.begin() ? nullptr : &slices[*std::prev(next)];
      if (!s || at >= s->first + s->count)
        fail("the checkpoint", "the rank files of TP part " + std::to_string(slices[holder->slices.front()].part) +
                                   " hold no element " + std::to_string(at) + " of '" + it.name + "'");
      const std::uint64_t n = std::min({left, static_cast<std::uint64_t>(b.offset.back() + b.box.back() - c.back()),
                                        s->first + s->count - at});
      runs.push_back({static_cast<std::size_t>(s - slices.data()), at, e - it.first, n});
      c.back() += static_cast<std::int64_t>(n);
      e += n;
      left -= n;
    }
  }
  // By slice, in order within each (a slice's runs ascend: both boxes are row-major). Each
  // slice is read in windows of at most `window` elements plus the runs' tails, so that a
  // rank needing a narrow band of columns of a wide part does not hold the whole part.
  std::stable_sort(runs.begin(), runs.end(), [](const run& a, const run& b) { return a.slice < b.slice; });
  constexpr std::uint64_t window = 16 * checkpoint_chunk;
  std::vector<std::byte> data;
  const std::size_t es = it.element_size;
  for (std::size_t j = 0; j < runs.size();) {
    std::size_t k = j;
    std::uint64_t lo = runs[j].from, hi = runs[j].from + runs[j].count;
    for (; k < runs.size() && runs[k].slice == runs[j].slice && (k == j || runs[k].from < lo + window); ++k)
      hi = std::max(hi, runs[k].from + runs[k].count);
    const slice_record& s = slices[runs[j].slice];
    data.resize(static_cast<std::size_t>((hi - lo) * es));
    read_slice(files[s.file], s, lo, hi, data.data(), buffer, it.name);
    for (; j < k; ++j)
      std::memcpy(out + runs[j].to * es, data.data() + (runs[j].from - lo) * es, static_cast<std::size_t>(runs[j].count * es));
  }
  for (const run& r : runs) files[slices[r.slice].file].close();
}

}  // namespace detail

/// The optimizer's private side, for save_checkpoint and load_checkpoint.
struct checkpoint_access {
  // ---------------------------------------------------------------------------------
  // Checkpoints: this rank's state as named flat vectors (distopt/checkpoint.hpp does
  // the files). A slice item is the elements of a tensor this rank holds (all of them when
  // replicated, where rank 0 alone writes); a whole item (row and column states, GaLore's
  // low-rank states and projections) is kept by every rank holding part of its tensor and
  // written by the one holding the tensor's first element.
  // ---------------------------------------------------------------------------------

  static std::string safetensors_dtype(dtype t) {
    return t == dtype::f32 ? "F32" : t == dtype::bf16 ? "BF16" : "F16";
  }

  /// Whether this rank writes the items of tensor `i`: sliced (`whole` false) or whole.
  template <class Opt>
  static bool writes_tensor(const Opt& o, std::size_t i, bool whole) {
    const distopt::detail::piece_range r = o.plan_.pieces_of(i);
    if (r.empty() || (!Opt::is_sharded && o.comm_.rank() != 0)) return false;
    return !whole || o.plan_.pieces()[r.first].layout == o.layout_.tensors()[i].offset;
  }

  /// The TP box of a part of extents `box`, split along `axis` over the TP group (-1: every
  /// TP part holds the whole).
  template <class Opt>
  static distopt::detail::tp_box tp_box_of(const Opt& o, std::vector<std::int64_t> box, int axis) {
    distopt::detail::tp_box b;
    b.whole = box;
    b.offset.assign(box.size(), 0);
    if (axis >= 0 && o.tp_ && o.tp_->size() > 1) {
      const auto a = static_cast<std::size_t>(axis);
      b.whole[a] *= o.tp_->size();
      b.offset[a] = o.tp_->rank() * box[a];
    }
    b.box = std::move(box);
    return b;
  }

  /// The axis of tensor `i`'s elements that TP splits: 0 for rows, the last for columns.
  template <class Opt>
  static int element_axis(const Opt& o, std::size_t i) {
    const tensor_slot& t = o.layout_.tensors()[i];
    if (t.tp == tp_split::none) return -1;  // (layout::add refuses empty shapes)
    return t.tp == tp_split::rows ? 0 : static_cast<int>(t.shape.size()) - 1;
  }

  /// Appends the item for this rank's slice [first, first + count) of tensor `i`'s vector
  /// `suffix`, whose element k lives at `base[k - first]`: one per element of the tensor's
  /// TP part, or (`whole`) a vector every holder of the tensor keeps whole.
  template <class Opt, class T>
  static void add_slice_item(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i, std::string suffix, std::string st_dtype,
                      T* base, std::uint64_t total, std::uint64_t first, std::uint64_t count,
                      std::vector<std::int64_t> shape, bool whole = false) {
    const tensor_slot& t = o.layout_.tensors()[i];
    out.push_back(slice_item(t.name + "/" + suffix, std::move(st_dtype), sizeof(T), reinterpret_cast<std::byte*>(base),
                             total, first, count, std::move(shape), writes_tensor(o, i, whole)));
    out.back().tensor = t.name;
    if (whole) out.back().tp = tp_box_of(o, {static_cast<std::int64_t>(total)}, -1);
    else out.back().tp = tp_box_of(o, t.shape, element_axis(o, i));
  }

  /// add_slice_item for a slice of the optimizer's buffers. In device memory it is saved
  /// from a host copy made when the file is written, and installed by a copy through the
  /// executor.
  template <class Opt, class T>
  static void add_buffer_item(Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i,
                              std::string suffix, std::string st_dtype, T* base, std::uint64_t total,
                              std::uint64_t first, std::uint64_t count, std::vector<std::int64_t> shape) {
    add_slice_item(o, out, i, std::move(suffix), std::move(st_dtype), base, total, first, count, std::move(shape));
    if constexpr (!host_memory<typename Opt::executor_type>) {
      distopt::detail::checkpoint_item& it = out.back();
      const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(T);
      it.source = nullptr;
      it.fetch = [exec = o.exec_, base, bytes, host = std::make_shared<std::vector<std::byte>>()]() mutable {
        host->resize(bytes);
        distopt::detail::copy_bytes(exec, host->data(), base, bytes);
        return static_cast<const std::byte*>(host->data());
      };
      it.install = [exec = o.exec_, base, bytes](std::span<const std::byte> b) mutable {
        distopt::detail::copy_bytes(exec, base, b.data(), bytes);
      };
    }
  }

  /// The item add_slice_item describes, built apart from the optimizer's type (one copy of
  /// this code and of its install function per program, not one per optimizer and element type).
  static distopt::detail::checkpoint_item slice_item(std::string name, std::string st_dtype, std::size_t element_size,
                                                     std::byte* base, std::uint64_t total, std::uint64_t first,
                                                     std::uint64_t count, std::vector<std::int64_t> shape, bool save) {
    distopt::detail::checkpoint_item it;
    it.name = std::move(name);
    it.dtype = std::move(st_dtype);
    it.element_size = element_size;
    it.total = total;
    it.shape = shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(total)} : std::move(shape);
    it.first = first;
    it.count = count;
    it.save = save;
    it.load = true;
    it.source = base;
    it.install = [base, bytes = count * element_size](std::span<const std::byte> b) {
      if (bytes != 0) std::memcpy(static_cast<void*>(base), b.data(), bytes);
    };
    return it;
  }

  /// A whole item of tensor `i` held in `v` (which load resizes only through `install`).
  template <class Opt>
  static void add_whole_item(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i, std::string suffix,
                      std::vector<float>& v) {
    add_slice_item(o, out, i, std::move(suffix), "F32", v.data(), v.size(), 0, v.size(), {}, true);
  }

  template <class Opt, class T>
  static void add_whole_q8_items(const Opt& o, std::vector<distopt::detail::checkpoint_item>& out, std::size_t i, const std::string& suffix,
                          std::vector<std::uint8_t>& codes, std::vector<T>& absmax) {
    add_slice_item(o, out, i, suffix + ".codes", "U8", codes.data(), codes.size(), 0, codes.size(), {}, true);
    add_slice_item(o, out, i, suffix + ".absmax", "F32", absmax.data(), absmax.size(), 0, absmax.size(), {}, true);
  }

  // What a stage keeps of a tensor besides its element states: none by default.
  template <class Opt, class S>
  static void stage_items(Opt&, S&, std::vector<distopt::detail::checkpoint_item>&, std::size_t) {}
  template <class Opt, class S>
  static void stage_pull(const Opt&, const S&) {}
  template <class Opt, class S>
  static void stage_restore(Opt&, S&) {}
  template <class Opt, class S>
  static void stage_check_group(const Opt&, const S&, int, const typename Opt::hyper_params&) {}

  // Bucket stages: their matrix stage's.
  template <class Opt, class P, class M, class E>
  static void stage_items(Opt& o, distopt::detail::bucket_stages<P, M, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    stage_items(o, s.matrix, out, i);
  }
  template <class Opt, class P, class M, class E>
  static void stage_pull(const Opt& o, const distopt::detail::bucket_stages<P, M, E>& s) {
    stage_pull(o, s.matrix);
  }
  template <class Opt, class P, class M, class E>
  static void stage_restore(Opt& o, distopt::detail::bucket_stages<P, M, E>& s) {
    stage_restore(o, s.matrix);
  }
  /// A checkpoint's groups must not turn Muon matrices into AdamW tensors or the reverse.
  template <class Opt, class P, class M, class E>
  static void stage_check_group(const Opt& o, const distopt::detail::bucket_stages<P, M, E>& s, int g,
                                const typename Opt::hyper_params& h) {
    s.check_hyper(o, g, h);
  }

  // Layer-wise: the factored row and column states.
  template <class Opt, class P, class St, class E>
  static void stage_items(Opt& o, distopt::detail::layer_stage<P, St, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    auto& lt = s.lt_[i];
    if (!lt.factored) return;
    const tensor_slot& t = o.layout_.tensors()[i];
    // [slots][matrices][rows] and [slots][matrices][columns]. TP splits the rows of a
    // matrix (its column states are then summed over TP, the same on every part), the
    // matrices of a stack (dim 0 of a tensor of more than 2 dims), or the columns.
    const auto m = static_cast<std::int64_t>(lt.matrices), rows = static_cast<std::int64_t>(lt.rows),
               cols = static_cast<std::int64_t>(lt.cols);
    const bool stack = lt.tp_split && t.tp == tp_split::rows && !lt.tp_rows;
    if (!lt.row_state.empty()) {
      add_whole_item(o, out, i, "row_states", lt.row_state);
      out.back().tp = tp_box_of(o, {P::row_states, m, rows}, lt.tp_rows ? 2 : stack ? 1 : -1);
    }
    if (!lt.col_state.empty()) {
      add_whole_item(o, out, i, "col_states", lt.col_state);
      out.back().tp = tp_box_of(o, {P::col_states, m, cols}, lt.tp_cols ? 2 : stack ? 1 : -1);
    }
  }
  template <class Opt, class P, class St, class E>
  static void stage_restore(Opt& o, distopt::detail::layer_stage<P, St, E>& s) {
    s.init_geometry(o);
  }

  // GaLore: each projected matrix's low-rank states and projection.
  template <class Opt, class P, class St, class E>
  static void stage_items(Opt& o, distopt::detail::projection_stage<P, St, E>& s,
                          std::vector<distopt::detail::checkpoint_item>& out, std::size_t i) {
    const int j = o.states_at_.matrix_index()[i];
    if (j < 0) return;
    const tensor_slot& t = o.layout_.tensors()[i];
    auto& pm = s.matrices_[static_cast<std::size_t>(j)];
    for (int k = 0; k < 2; ++k) {
      const std::string name = "projected." + std::to_string(k);
      if (!pm.codes[k].empty()) add_whole_q8_items(o, out, i, name, pm.codes[k], pm.absmax[k]);
      else add_whole_item(o, out, i, name, pm.state[k]);
    }
    // The projection: Q (m x r) and/or P (r x n); saved once computed, loaded when
    // the checkpoint has it (into staging: set_ortho installs both at the end).
    const auto side = pm.proj.side_for(pm.m, pm.n);
    using side_t = decltype(side);
    const std::int64_t rk = pm.proj.rank();
    auto& staged = s.ortho_staging_[static_cast<std::size_t>(j)];
    const std::array<std::uint64_t, 2> sizes{side == side_t::right ? 0u : static_cast<std::uint64_t>(pm.m * rk),
                                             side == side_t::left ? 0u : static_cast<std::uint64_t>(rk * pm.n)};
    for (int k = 0; k < 2; ++k) {
      if (sizes[k] == 0) continue;
      distopt::detail::checkpoint_item it;
      it.name = t.name + (k == 0 ? "/projector.left" : "/projector.right");
      it.tensor = t.name;
      it.dtype = "F32";
      it.total = it.count = sizes[k];
      it.shape = k == 0 ? std::vector<std::int64_t>{pm.m, rk} : std::vector<std::int64_t>{rk, pm.n};
      it.tp = tp_box_of(o, {static_cast<std::int64_t>(sizes[k])}, -1);  // GaLore's matrices are not TP-split
      it.save = writes_tensor(o, i, true) && pm.proj.has_ortho();
      it.load = false;  // optional: when the checkpoint has it
      it.source = reinterpret_cast<const std::byte*>(k == 0 ? pm.proj.left().data() : pm.proj.right().data());
      it.install = [&staged, k, n = sizes[k]](std::span<const std::byte> b) {
        staged[static_cast<std::size_t>(k)].resize(n);
        std::memcpy(staged[static_cast<std::size_t>(k)].data(), b.data(), n * sizeof(float));
        staged[2].resize(1);  // marks the matrix as staged
      };
      out.push_back(std::move(it));
    }
  }
  template <class Opt, class P, class St, class E>
  static void stage_pull(const Opt& o, const distopt::detail::projection_stage<P, St, E>& s) {
    s.pull_all(o);
  }
  /// The projectors anew from the loaded groups, with the projections the checkpoint had.
  template <class Opt, class P, class St, class E>
  static void stage_restore(Opt& o, distopt::detail::projection_stage<P, St, E>& s) {
    for (std::size_t j = 0; j < s.matrices_.size(); ++j) {
      auto& pm = s.matrices_[j];
      auto& staged = s.ortho_staging_[j];
      const typename Opt::hyper_params& h = o.groups_[static_cast<std::size_t>(o.layout_.tensors()[pm.tensor].group)];
      pm.proj = decltype(pm.proj)(h);
      if (!staged[2].empty()) pm.proj.set_ortho(pm.m, pm.n, std::move(staged[0]), std::move(staged[1]));
      staged = {};
    }
    s.push_all(o);  // a device executor's copies of them
  }

  /// Every piece of state this rank holds, as checkpoint items: each tensor's params,
  /// master weights and state slots where the state layout puts them, its percentile
  /// clipping history, and what its stage keeps of it (factored states, projections).
  template <class Opt, class Stages>
  static std::vector<distopt::detail::checkpoint_item> checkpoint_items(Opt& o, Stages& stages) {
    using distopt::detail::state_home;
    distopt::detail::sync_decisions(o);  // a device executor's master_ready
    stage_pull(o, stages);               // a device executor's low-rank states and projections
    std::vector<distopt::detail::checkpoint_item> out;
    const auto tensors = o.layout_.tensors();
    const auto& pieces = o.plan_.pieces();
    std::string sdt = "U8";
    if constexpr (!Opt::is_quantized) sdt = safetensors_dtype(dtype_of<typename Opt::state_type>);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const tensor_slot& t = tensors[i];
      const distopt::detail::piece_range r = o.plan_.pieces_of(i);
      if (r.empty()) continue;
      const distopt::detail::shard_piece& p0 = pieces[r.first];
      const std::size_t count = o.plan_.local_count(i);
      const std::uint64_t first = p0.layout - t.offset;
      add_buffer_item(o, out, i, "param", safetensors_dtype(dtype_of<typename Opt::param_type>), o.params_.data() + o.param_at(p0), t.numel,
                     first, count, t.shape);
      if (o.uses_master()) {
        add_buffer_item(o, out, i, "master", "F32", o.master_.data() + p0.local, t.numel, first, count, t.shape);
        out.back().save = out.back().save && o.master_ready_;
        out.back().load = false;  // when the checkpoint has master weights (checkpoint_access decides)
      }
      for (int k = 0; k < o.slots_; ++k) {
        const std::string slot = "state." + std::to_string(k);
        const std::size_t at = o.states_at_.offset(r.first, k);
        switch (o.states_at_.home(r.first, k)) {
          case state_home::none:  // a slot this tensor does not keep
            break;
          case state_home::slot:
            if constexpr (Opt::is_quantized) {
              add_buffer_item(o, out, i, slot + ".codes", "U8", o.states_[k].data() + at, t.numel, first, count, t.shape);
              const std::uint64_t b0 = first / q8::block, b1 = (first + count + q8::block - 1) / q8::block;
              const std::uint64_t blocks = (t.numel + q8::block - 1) / q8::block;
              add_buffer_item(o, out, i, slot + ".absmax", "F32", o.absmax_[k].data() + at / q8::block, blocks, b0,
                              b1 - b0, {});
              // The blocks of a TP part are blocks of the whole tensor only when the part is
              // whole, or a run of rows of a multiple of the block.
              const int axis = o.tp_ && o.tp_->size() > 1 ? element_axis(o, i) : -1;
              if (axis < 0 || (axis == 0 && t.numel % q8::block == 0))
                out.back().tp = tp_box_of(o, {static_cast<std::int64_t>(blocks)}, axis);
              else
                out.back().tp = {};
            } else {
              add_buffer_item(o, out, i, slot, sdt, o.states_[k].data() + at, t.numel, first, count, t.shape);
            }
            break;
          case state_home::small:  // q8: the fp32 states of a tensor below min_8bit_size
            add_buffer_item(o, out, i, slot, "F32", o.small_[k].data() + at, t.numel, first, count, t.shape);
            break;
          case state_home::momentum:  // Muon: a matrix's momentum
            add_buffer_item(o, out, i, slot, sdt, o.momentum_.data() + at, t.numel, first, count, t.shape);
            break;
        }
      }
      if (!o.gnorm_vec_.empty())  // percentile clipping: the tensor's norm history (its holders' is exact)
        add_slice_item(o, out, i, "clip_history", "F32", o.gnorm_vec_[i].data(), 100, 0, 100, {}, true);
      stage_items(o, stages, out, i);
    }
    return out;
  }

  /// What must match (identity) and what is restored (state) on load.
  template <class Opt>
  static distopt::detail::checkpoint_scalars checkpoint_scalars(const Opt& o) {
    distopt::detail::sync_decisions(o);  // a device executor's step counter and loss scaler
    distopt::detail::checkpoint_scalars s;
    const auto id = [&](std::string k, std::string v) { s.identity.emplace_back(std::move(k), std::move(v)); };
    id("policy", std::string(Opt::policy_type::name));
    if constexpr (Opt::is_quantized) id("encoding", "q8");
    else id("encoding", std::string(dtype_name(dtype_of<typename Opt::state_type>)));
    id("param_dtype", std::string(dtype_name(dtype_of<typename Opt::param_type>)));
    id("grad_dtype", std::string(dtype_name(dtype_of<typename Opt::grad_type>)));
    id("master_weights", o.uses_master() ? "true" : "false");
    id("block_size", std::to_string(o.layout_.block_size()));
    id("groups", std::to_string(o.groups_.size()));
    id("state_slots", std::to_string(o.slots_));
    if constexpr (Opt::is_quantized) id("min_8bit_size", std::to_string(o.options_.min_8bit_size));
    id("percentile_clipping", std::to_string(o.options_.percentile_clipping));
    id("loss_scaling", o.scaler_ ? "dynamic" : "off");
    id("tensors", std::to_string(o.layout_.tensors().size()));
    for (std::size_t i = 0; i < o.layout_.tensors().size(); ++i) {
      const tensor_slot& t = o.layout_.tensors()[i];
      id("tensor " + t.name, distopt::detail::describe_tensor(t));
      // Without the TP split: a tensor split otherwise on load is resharded, not refused.
      s.whole.emplace_back("tensor " + t.name,
                           distopt::detail::describe_tensor_shape(t, tp_box_of(o, t.shape, element_axis(o, i)).whole));
    }
    const auto st = [&](std::string k, std::string v) { s.state.emplace_back(std::move(k), std::move(v)); };
    st("step", std::to_string(o.step_));
    st("seed", std::to_string(o.options_.seed));
    st("master_ready", o.master_ready_ ? "true" : "false");
    std::string started;
    for (std::size_t g = 0; g < o.groups_.size(); ++g) started += g < o.state_started_.size() && o.state_started_[g] ? '1' : '0';
    st("state_started", started);
    if (o.scaler_) {
      st("loss_scale", distopt::detail::format_number(o.scaler_->scale()));
      st("growth_tracker", std::to_string(o.scaler_->growth_tracker()));
    }
    for (std::size_t g = 0; g < o.groups_.size(); ++g)
      st("group " + std::to_string(g), hyper_params_string<typename Opt::policy_type>(o.groups_[g]));
    return s;
  }

  /// Restores the state scalars (already checked to parse: checkpoint_access validates
  /// them before any rank installs anything) and finishes what install staged.
  template <class Opt, class Stages>
  static void restore_checkpoint(Opt& o, Stages& stages, const std::map<std::string, std::string, std::less<>>& st) {
    distopt::detail::sync_decisions(o);  // what the device decided is replaced below, and pushed before the next step
    o.decisions_changed_ = true;
    o.step_ = std::stoll(st.at("step"));
    o.options_.seed = std::stoull(st.at("seed"));
    o.master_ready_ = st.at("master_ready") == "true";
    const std::string& started = st.at("state_started");
    o.state_started_.assign(o.groups_.size(), false);
    for (std::size_t g = 0; g < o.groups_.size(); ++g) o.state_started_[g] = started[g] == '1';
    if (o.scaler_) o.scaler_->restore(std::stod(st.at("loss_scale")), std::stoll(st.at("growth_tracker")));
    for (std::size_t g = 0; g < o.groups_.size(); ++g) o.groups_[g] = parse_checkpoint_group<Opt>(st.at("group " + std::to_string(g)));
    stage_restore(o, stages);
    o.clip_.reset();
    distopt::detail::drop_step_grads(o);  // a half-done backward's grads and hooks belong to the params replaced
    if (Opt::is_sharded && o.comm_.size() > 1) distopt::detail::gather_params(o);
  }

  /// The hyper-parameters of a group from their text form; throws std::invalid_argument.
  template <class Opt>
  static typename Opt::hyper_params parse_checkpoint_group(std::string_view text) {
    typename Opt::hyper_params h;
    while (!text.empty()) {
      const std::size_t space = text.find(' ');
      const std::string_view kv = text.substr(0, space);
      const std::size_t eq = kv.find('=');
      if (eq == std::string_view::npos) throw std::invalid_argument("hyper-parameter '" + std::string(kv) + "' has no '='");
      set_hyper_param<typename Opt::policy_type>(h, kv.substr(0, eq), kv.substr(eq + 1));
      text = space == std::string_view::npos ? std::string_view() : text.substr(space + 1);
    }
    h.validate();
    return h;
  }

  /// The checkpoint's view of an optimizer's context and stages: what save_checkpoint
  /// and load_checkpoint (below) ask of it, apart from its type.
  template <class Opt, class Stages>
  static detail::checkpoint_party party(Opt& o, Stages& stages) {
    detail::checkpoint_party p;
    auto* tp = o.tp_ ? &*o.tp_ : nullptr;
    p.rank = o.comm_.rank();
    p.size = o.comm_.size();
    p.tp_rank = tp ? tp->rank() : 0;
    p.tp_size = tp ? tp->size() : 1;
    p.all_max = [&o, tp](std::span<double> v) {
      o.comms_.all_reduce_host(o.exec_, o.comm_, v, reduce_op::max);
      if (tp) o.comms_.all_reduce_host(o.exec_, *tp, v, reduce_op::max);
    };
    p.all_gather = [&o, tp](std::span<const double> mine, std::span<double> grid) {
      if (!tp) {
        o.comms_.all_gather_host(o.exec_, o.comm_, mine, grid);
        return;
      }
      std::vector<double> all(grid.size() / static_cast<std::size_t>(tp->size()));
      o.comms_.all_gather_host(o.exec_, o.comm_, mine, std::span<double>(all));
      o.comms_.all_gather_host(o.exec_, *tp, std::span<const double>(all), grid);
    };
    p.scalars = [&o] { return checkpoint_scalars(o); };
    p.items = [&o, &stages] {  // once the collectives in flight are done
      distopt::detail::wait_pending(o);
      return checkpoint_items(o, stages);
    };
    p.restore = [&o, &stages](const std::map<std::string, std::string, std::less<>>& state) {
      restore_checkpoint(o, stages, state);
    };
    p.check_group = [&o, &stages](int g, const std::string& text) {
      stage_check_group(o, stages, g, parse_checkpoint_group<Opt>(text));
    };
    return p;
  }
};

namespace detail {

inline void save_checkpoint(const checkpoint_party& party, const std::filesystem::path& dir) {
  const int r = party.rank, d = party.size, t = party.tp_rank, tps = party.tp_size;
  const bool root = r == 0 && t == 0;
  const std::string what = "distopt: saving the checkpoint in '" + dir.string() + "'";
  std::string error;
  try {
    std::filesystem::create_directories(dir);
  } catch (const std::exception& e) {
    error = what + ": cannot create the directory: " + e.what();
  }
  agree(party, error, what);

  // The generation: the step and 40 random bits from the first rank.
  double nonce = 0;
  if (root) nonce = static_cast<double>(std::random_device{}() % (1u << 20) * (std::uint64_t{1} << 20) + std::random_device{}() % (1u << 20));
  nonce = all_max(party, nonce);
  const auto sc = party.scalars();
  std::string step;
  for (const auto& [k, v] : sc.state)
    if (k == "step") step = v;
  const std::string generation = "s" + step + "-" + detail::hex64(static_cast<std::uint64_t>(nonce)).substr(6);

  // This rank's file.
  std::array<double, 5> mine{};
  try {
    auto items = party.items();
    std::vector<std::vector<std::uint64_t>> hashes(items.size());
    safetensors_writer w;
    for (std::size_t k = 0; k < items.size(); ++k) {
      const auto& it = items[k];
      if (!it.save) continue;
      const std::byte* source = it.fetch ? it.fetch() : it.source;  // kept alive by `items`
      hashes[k] = detail::chunk_hashes(source, it.first, it.count, it.element_size);
      const bool whole = it.first == 0 && it.count == it.total;
      w.add_view(it.name, it.dtype, whole ? it.shape : std::vector<std::int64_t>{static_cast<std::int64_t>(it.count)},
                 std::span<const std::byte>(source, it.count * it.element_size));
    }
    w.set_metadata("distopt.generation", generation);
    w.set_metadata("distopt.rank", "tp " + std::to_string(t) + " of " + std::to_string(tps) + ", rank " +
                                       std::to_string(r) + " of " + std::to_string(d));
    w.set_metadata("distopt.items", detail::items_text(items, hashes));
    const std::string head = w.header();
    const std::uint64_t bytes = w.write(dir / detail::rank_file_name(generation, t, tps, r, d), head);
    mine = {0.0, static_cast<double>(bytes), 0, 0, 0};
    distopt::detail::hash_to_doubles(detail::xxh3(head.data(), head.size()), mine.data() + 2);
  } catch (const std::exception& e) {
    error = what + ": " + e.what();
  }
  mine[0] = error.empty() ? 0.0 : 1.0;
  std::vector<double> grid(5 * static_cast<std::size_t>(d) * static_cast<std::size_t>(tps));
  party.all_gather(std::span<const double>(mine), std::span<double>(grid));
  {
    double failed = 0;
    for (std::size_t k = 0; k < grid.size(); k += 5)
      if (grid[k] != 0 && failed == 0) failed = static_cast<double>(k / 5 + 1);
    if (!error.empty()) throw checkpoint_error(error);
    if (failed > 0)
      throw checkpoint_error(what + ": rank " + std::to_string(static_cast<long>(failed) - 1) +
                             " could not write its file (its error says why); the previous checkpoint stays");
  }

  // The index, written last by the first rank; then the older generations go.
  if (root) {
    try {
      detail::checkpoint_index index;
      index.generation = generation;
      index.dp_size = d;
      index.tp_size = tps;
      for (const auto& [k, v] : sc.identity) index.identity.emplace(k, v);
      for (const auto& [k, v] : sc.state) index.state.emplace(k, v);
      for (const auto& [k, v] : sc.whole) index.whole.emplace(k, v);
      for (int p = 0; p < tps; ++p) {
        auto& part = index.files.emplace_back();
        for (int q = 0; q < d; ++q) {
          const double* g = grid.data() + 5 * (static_cast<std::size_t>(p) * d + q);
          const std::uint64_t h = static_cast<std::uint64_t>(g[2]) | static_cast<std::uint64_t>(g[3]) << 22 |
                                  static_cast<std::uint64_t>(g[4]) << 44;
          part.push_back({detail::rank_file_name(generation, p, tps, q, d), static_cast<std::uint64_t>(g[1]), h});
        }
      }
      const std::string text = detail::index_text(index);
      const std::array<std::span<const std::byte>, 1> parts{std::as_bytes(std::span<const char>(text))};
      ::distopt::io::detail::atomic_write(dir / "index.json", parts);
      detail::remove_stale(dir, generation);
    } catch (const std::exception& e) {
      error = what + ": " + e.what();
    }
  }
  agree(party, error, what);
}

inline void load_checkpoint(const checkpoint_party& party, const std::filesystem::path& dir) {
  const int t = party.tp_rank, tps = party.tp_size;
  const std::string what = "distopt: loading the checkpoint in '" + dir.string() + "'";
  std::string error;
  std::vector<distopt::detail::checkpoint_item> items;
  std::vector<std::unique_ptr<std::byte[]>> staged;  // not zero-filled: every byte is read before use
  detail::checkpoint_index index;
  try {
    const std::string index_path = (dir / "index.json").string();
    std::string text;
    {
      const auto bytes = ::distopt::io::detail::read_whole_file(dir / "index.json");
      text.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
    index = detail::parse_index(text, index_path);
    // What must match.
    const auto sc = party.scalars();
    // Another TP layout (TP size, or how a tensor is split): the parts' tensors differ, the
    // whole tensors must not, and every part's files are read.
    const bool can_reshard = !index.whole.empty();  // indexes written before TP resharding cannot
    bool reshard = index.tp_size != tps;
    std::set<std::string, std::less<>> changed;  // tensors whose TP part differs from the saved one
    if (reshard && !can_reshard)
      detail::fail(index_path, "was written with tensor-parallel size " + std::to_string(index.tp_size) +
                                   ", this optimizer has " + std::to_string(tps) +
                                   ", by a distopt that did not record whole tensors (it loads only with TP size " +
                                   std::to_string(index.tp_size) + ")");
    for (const auto& [k, v] : sc.identity) {
      const auto it = index.identity.find(k);
      if (it == index.identity.end())
        detail::fail(index_path, k.starts_with("tensor ") ? "holds no " + k.substr(0, 6) + " '" + k.substr(7) + "'"
                                                          : "records no " + k);
      if (it->second != v && k.starts_with("tensor ") && can_reshard) {
        reshard = true;
        changed.insert(k.substr(7));
      } else if (it->second != v)
        detail::fail(index_path, "was written with " + k + " " + it->second + ", this optimizer has " + v);
    }
    for (const auto& [k, v] : index.identity)
      if (k.starts_with("tensor ") && std::none_of(sc.identity.begin(), sc.identity.end(), [&key = k](const auto& p) { return p.first == key; }))
        detail::fail(index_path, "holds " + v + ", which this optimizer's layout does not have");
    if (reshard)
      for (const auto& [k, v] : sc.whole) {
        const auto it = index.whole.find(k);
        if (it == index.whole.end()) detail::fail(index_path, "records no whole " + k);
        if (it->second != v)
          detail::fail(index_path, "was written with whole " + k + " " + it->second + " (over its TP parts), this optimizer's is " + v);
      }
    // What is restored: present and well-formed before anything changes.
    for (const auto& [k, v] : sc.state) {
      const auto it = index.state.find(k);
      if (it == index.state.end()) detail::fail(index_path, "records no " + k);
      try {
        if (k.starts_with("group ")) party.check_group(std::stoi(k.substr(6)), it->second);
        else if (k == "state_started") {
          if (it->second.size() != v.size() || it->second.find_first_not_of("01") != std::string::npos)
            throw std::invalid_argument("expected " + std::to_string(v.size()) + " digits 0 or 1");
        } else if (k == "master_ready") {
          if (it->second != "true" && it->second != "false") throw std::invalid_argument("expected true or false");
        } else if (k == "loss_scale") {
          std::size_t used = 0;
          const double x = std::stod(it->second, &used);
          if (used != it->second.size() || !(x > 0) || !std::isfinite(x)) throw std::invalid_argument("not a positive number");
        } else {
          std::size_t used = 0;
          const long long x = std::stoll(it->second, &used);
          if (used != it->second.size() || x < 0) throw std::invalid_argument("not a non-negative integer");
        }
      } catch (const std::exception& e) {
        detail::fail(index_path, "state " + k + " = '" + it->second + "' is invalid: " + e.what());
      }
    }
    // This TP part's files (every part's when resharding over TP): sizes and header
    // checksums first, then what they hold.
    std::vector<std::pair<int, const detail::file_record*>> listed;
    for (int p = reshard ? 0 : t; p < (reshard ? index.tp_size : t + 1); ++p)
      for (const auto& f : index.files[static_cast<std::size_t>(p)]) listed.emplace_back(p, &f);
    std::vector<detail::read_file> files(listed.size());
    std::map<std::string, std::vector<detail::slice_record>, std::less<>> slices;
    for (std::size_t q = 0; q < listed.size(); ++q) {
      const detail::file_record& record = *listed[q].second;
      const std::filesystem::path path = dir / record.name;
      files[q].path = path;
      std::error_code ec;
      const auto size = std::filesystem::file_size(path, ec);
      if (ec) detail::fail(path.string(), "missing (the index lists it): " + ec.message());
      if (size != record.bytes)
        detail::fail(path.string(), "has " + std::to_string(size) + " bytes, the index says " + std::to_string(record.bytes) +
                                        (size < record.bytes ? " (truncated)" : ""));
      auto [head, head_size] = safetensors_reader::read_header(path);
      if (detail::xxh3(head.data(), head.size()) != record.header_hash)
        detail::fail(path.string(), "header checksum mismatch: the file is corrupt");
      const auto header = safetensors_reader::from_header(path, std::move(head), head_size);
      const auto& meta = header.metadata();
      const auto gen = meta.find("distopt.generation");
      if (gen == meta.end() || gen->second != index.generation)
        detail::fail(path.string(), "belongs to another save than the index (generation differs)");
      const auto it = meta.find("distopt.items");
      if (it == meta.end()) detail::fail(path.string(), "has no distopt.items metadata");
      auto records = detail::parse_items(it->second, path.string());
      for (const auto& name : header.names())
        if (!records.contains(name)) detail::fail(path.string(), "tensor '" + name + "' is not in distopt.items");
      for (auto& [name, rec] : records) {
        if (!header.contains(name)) detail::fail(path.string(), "item '" + name + "' has no tensor");
        const tensor_info& ti = header.info(name);
        const auto es = dtype_size(rec.dtype);
        if (ti.dtype != rec.dtype || !es || static_cast<std::uint64_t>(ti.numel()) != rec.count)
          detail::fail(path.string(), "tensor '" + name + "' does not match its distopt.items record");
        rec.part = listed[q].first;
        rec.file = q;
        rec.offset = header.data_start() + ti.begin;
        rec.element_size = *es;
        slices[name].push_back(std::move(rec));
      }
      if (!reshard) files[q].handle();  // this part's files, open while its items are read
    }
    // This rank's slices, read and checked into staging.
    const bool with_master = index.state.at("master_ready") == "true";
    items = party.items();
    staged.resize(items.size());
    std::vector<std::byte> buffer;
    for (std::size_t k = 0; k < items.size(); ++k) {
      auto& it = items[k];
      const bool optional = !it.load;
      if (it.name.ends_with("/master")) it.load = with_master;
      else if (optional) it.load = slices.contains(it.name);  // a projection, once computed
      if (!it.load) continue;
      const auto found = slices.find(it.name);
      if (found == slices.end()) {
        const bool q8 = it.name.ends_with(".codes") || it.name.ends_with(".absmax") || slices.contains(it.name + ".codes");
        detail::fail(dir.string(), "the checkpoint holds no '" + it.name + "'" +
                                       (reshard && q8 ? " (8-bit states are quantized where a tensor's TP part has at "
                                                        "least min_8bit_size elements: this TP layout changes which are)"
                                                      : ""));
      }
      staged[k].reset(new std::byte[static_cast<std::size_t>(it.count * it.element_size)]);
      // Resharding over TP: a tensor whose part is as it was saved (unchanged identity, and
      // this part was saved) is read from this part's files as without resharding; the
      // others through their boxes.
      if (reshard) {
        bool own = t < index.tp_size && !changed.contains(it.tensor);
        bool any = false;
        for (const auto& s : found->second)
          if (s.part == t) {
            any = true;
            own = own && s.tp == it.tp;
          }
        if (!own || !any) {
          detail::read_resharded(it, found->second, files, staged[k].get(), buffer);
          continue;
        }
      }
      std::uint64_t covered = 0;
      for (const auto& s : found->second) {
        if (s.part != t) continue;
        if (s.dtype != it.dtype || s.total != it.total)
          detail::fail(files[s.file].path.string(), "'" + it.name + "' is " + s.dtype + " with " + std::to_string(s.total) +
                                                        " elements, this optimizer keeps " + it.dtype + " with " +
                                                        std::to_string(it.total));
        const std::uint64_t a = std::max(it.first, s.first), b = std::min(it.first + it.count, s.first + s.count);
        if (a >= b) continue;
        detail::read_slice(files[s.file], s, a, b, staged[k].get() + (a - it.first) * it.element_size, buffer, it.name);
        covered += b - a;
      }
      if (covered != it.count)
        detail::fail(dir.string(), "the rank files hold " + std::to_string(covered) + " of the " + std::to_string(it.count) +
                                       " elements of '" + it.name + "' this rank needs");
    }
  } catch (const std::exception& e) {
    error = what + ": " + e.what();
  }
  agree(party, error, what);
  for (std::size_t k = 0; k < items.size(); ++k)
    if (items[k].load) items[k].install(std::span<const std::byte>(staged[k].get(), items[k].count * items[k].element_size));
  party.restore(index.state);
}

}  // namespace detail

/// What `opt.save(dir)` and `opt.load(dir)` call (declared in optimizer.hpp), with the
/// optimizer's context and stages. A load first refuses gathered tensors (their views would
/// go stale; refused before anything is read) and drops ZeRO-3's prefetches.
template <class Context, class Stages>
struct checkpoint_files {
  static void save(Context& ctx, Stages& stages, const std::filesystem::path& dir) {
    detail::save_checkpoint(checkpoint_access::party(ctx, stages), dir);
  }
  static void load(Context& ctx, Stages& stages, const std::filesystem::path& dir) {
    distopt::detail::end_param_gathers(ctx, "load()");
    detail::load_checkpoint(checkpoint_access::party(ctx, stages), dir);
  }
};

/// Writes `opt`'s checkpoint into `dir` (collective): `opt.save(dir)`.
template <class Optimizer>
void save_checkpoint(Optimizer& opt, const std::filesystem::path& dir) {
  opt.save(dir);
}

/// Loads `opt`'s state from the checkpoint in `dir` (collective): `opt.load(dir)`.
template <class Optimizer>
void load_checkpoint(Optimizer& opt, const std::filesystem::path& dir) {
  opt.load(dir);
}

}  // namespace distopt::io
