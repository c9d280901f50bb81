// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Saving and loading a checkpoint's files, for any optimizer through its
/// `checkpoint_party` (its communicators, scalars and items, with their types erased):
/// each rank's file written atomically and the index last, and on load each rank's slices
/// read and checked, resharded over DP and TP, agreed on by every rank before any is
/// installed.

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
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "../detail/checkpoint_item.hpp"
#include "../detail/layout_check.hpp"
#include "../options.hpp"
#include "../policy/hyper_text.hpp"
#include "../storage/q8_encoding.hpp"
#include "checkpoint_format.hpp"
#include "safetensors.hpp"

namespace distopt::io::detail {

/// What saving and loading need from an optimizer and its communicators, with their types
/// erased: the checkpoint code below is compiled once per translation unit, not once per
/// optimizer type (save and load were an eighth of the object code of a TU instantiating 21
/// optimizers, one copy per optimizer).
struct checkpoint_party {
  int rank = 0, size = 1;        ///< in the data-parallel group
  int tp_rank = 0, tp_size = 1;  ///< in the tensor-parallel group (0 of 1 without one)
  /// The optimizer's context and stages, which the functions below are given back: plain
  /// function pointers, one small function per optimizer type (std::function made a
  /// manager and an invoker of each).
  void* opt = nullptr;
  void* stages = nullptr;
  void (*all_max_fn)(const checkpoint_party&, std::span<double>) = nullptr;
  void (*all_gather_fn)(const checkpoint_party&, std::span<const double>, std::span<double>) = nullptr;
  distopt::detail::checkpoint_scalars (*scalars_fn)(const checkpoint_party&) = nullptr;
  std::vector<distopt::detail::checkpoint_item> (*items_fn)(const checkpoint_party&) = nullptr;
  void (*restore_fn)(const checkpoint_party&, const std::map<std::string, std::string, std::less<>>&) = nullptr;
  void (*check_group_fn)(const checkpoint_party&, int, const std::string&) = nullptr;

  /// In place: the largest value of every rank, over the DP group and then the TP group.
  void all_max(std::span<double> v) const { all_max_fn(*this, v); }
  /// Every rank's `mine` into `grid`, TP part by TP part, DP rank by DP rank.
  void all_gather(std::span<const double> mine, std::span<double> grid) const { all_gather_fn(*this, mine, grid); }
  distopt::detail::checkpoint_scalars scalars() const { return scalars_fn(*this); }
  std::vector<distopt::detail::checkpoint_item> items() const { return items_fn(*this); }
  void restore(const std::map<std::string, std::string, std::less<>>& state) const { restore_fn(*this, state); }
  /// Throws if `text` is not a hyper-parameter group this optimizer can restore as group `g`.
  void check_group(int g, const std::string& text) const { check_group_fn(*this, g, text); }
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

/// Why the checkpoint in `dir` is another optimizer's (another policy, or another model:
/// other tensors or whole shapes), or "" when `dir` holds none or one of this optimizer
/// (on any ranks and TP layout, with any encodings and hyper-parameters).
inline std::string other_optimizer(const std::filesystem::path& dir, const distopt::detail::checkpoint_scalars& sc) {
  const std::filesystem::path path = dir / "index.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return {};
  checkpoint_index theirs;
  try {
    const auto bytes = ::distopt::io::detail::read_whole_file(path);
    theirs = parse_index(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path.string());
  } catch (const std::exception& e) {
    return "an index.json that is not a distopt checkpoint's (" + std::string(e.what()) + ")";
  }
  const auto held = [&theirs](const std::string& k) {
    const auto it = theirs.identity.find(k);
    return it == theirs.identity.end() ? std::string("none") : it->second;
  };
  std::set<std::string, std::less<>> ours;
  for (const auto& [k, v] : sc.identity) {
    if (k == "policy" && held(k) != v) return "a checkpoint of " + held(k) + " (this optimizer is " + v + ")";
    if (!k.starts_with("tensor ") && !k.starts_with("experts ")) continue;
    ours.insert(k);
    if (!theirs.identity.contains(k)) return "a checkpoint of another model (no " + k + ")";
  }
  for (const auto& [k, v] : theirs.identity)
    if ((k.starts_with("tensor ") || k.starts_with("experts ")) && !ours.contains(k))
      return "a checkpoint of another model (" + k + ", which this optimizer's layout does not have)";
  for (const auto& [k, v] : sc.whole) {
    const auto it = theirs.whole.find(k);
    if (it != theirs.whole.end() && it->second != v)
      return "a checkpoint of another model (" + k + " " + it->second + ", this optimizer's " + v + ")";
  }
  return {};
}

inline void save_checkpoint(const checkpoint_party& party, const std::filesystem::path& dir, checkpoint_replace replace) {
  const int r = party.rank, d = party.size, t = party.tp_rank, tps = party.tp_size;
  const bool root = r == 0 && t == 0;
  const std::string what = "distopt: saving the checkpoint in '" + dir.string() + "'";
  const auto sc = party.scalars();
  std::string error;
  try {
    std::filesystem::create_directories(dir);
    if (root && replace == checkpoint_replace::same_optimizer)
      if (const std::string other = other_optimizer(dir, sc); !other.empty())
        error = what + ": it holds " + other + "; save into another directory, or pass "
                "distopt::checkpoint_replace::anything to replace it";
  } catch (const std::exception& e) {
    error = what + ": cannot create the directory: " + e.what();
  }
  agree(party, error, what);

  // The generation: the step and 40 random bits from the first rank.
  double nonce = 0;
  if (root) nonce = static_cast<double>(std::random_device{}() % (1u << 20) * (std::uint64_t{1} << 20) + std::random_device{}() % (1u << 20));
  nonce = all_max(party, nonce);
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
  std::vector<std::unique_ptr<std::byte[]>> staged;  // zero-filled, and every byte is read before use
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
    // whole tensors must not, and every part's files are read. So with expert tensors: a
    // part's experts may have been saved by any part.
    const bool can_reshard = !index.whole.empty();  // indexes written before TP resharding cannot
    const auto model_key = [](const std::string& k) { return k.starts_with("tensor ") || k.starts_with("experts "); };
    bool reshard = index.tp_size != tps ||
                   std::any_of(sc.identity.begin(), sc.identity.end(), [](const auto& kv) { return kv.first.starts_with("experts "); });
    std::set<std::string, std::less<>> changed;  // keys of tensors whose TP part differs from the saved one
    if (reshard && !can_reshard)
      detail::fail(index_path, "was written with tensor-parallel size " + std::to_string(index.tp_size) +
                                   ", this optimizer has " + std::to_string(tps) +
                                   ", by a distopt that did not record whole tensors (it loads only with TP size " +
                                   std::to_string(index.tp_size) + ")");
    for (const auto& [k, v] : sc.identity) {
      const auto it = index.identity.find(k);
      if (it == index.identity.end())
        detail::fail(index_path, k.starts_with("tensor ")    ? "holds no tensor '" + k.substr(7) + "'"
                                 : k.starts_with("experts ") ? "holds no expert tensor '" + k.substr(8) + "'"
                                                             : "records no " + k);
      if (it->second != v && model_key(k) && can_reshard) {
        reshard = true;
        changed.insert(k);
      } else if (it->second != v)
        detail::fail(index_path, "was written with " + k + " " + it->second + ", this optimizer has " + v);
    }
    for (const auto& [k, v] : index.identity)
      if (model_key(k) && std::none_of(sc.identity.begin(), sc.identity.end(), [&key = k](const auto& p) { return p.first == key; }))
        detail::fail(index_path, "holds " + v + ", which this optimizer's layout does not have");
    if (reshard)
      for (const auto& [k, v] : sc.whole) {
        const auto it = index.whole.find(k);
        if (it == index.whole.end()) detail::fail(index_path, "records no whole " + k);
        if (it->second != v)
          detail::fail(index_path, "was written with whole " + k + " " + it->second + " (over its TP parts), this optimizer's is " + v);
      }
    // What is restored: present and well-formed before anything changes. Numbers are read
    // as written, whatever the process's locale (std::from_chars).
    for (const auto& [k, v] : sc.state) {
      const auto it = index.state.find(k);
      if (it == index.state.end() && k == "step_calls") continue;  // before it was recorded: the steps taken
      if (it == index.state.end()) detail::fail(index_path, "records no " + k);
      try {
        if (k.starts_with("group ")) party.check_group(std::stoi(k.substr(6)), it->second);
        else if (k == "state_started") {
          if (it->second.size() != v.size() || it->second.find_first_not_of("01") != std::string::npos)
            throw std::invalid_argument("expected " + std::to_string(v.size()) + " digits 0 or 1");
        } else if (k == "master_ready") {
          if (it->second != "true" && it->second != "false") throw std::invalid_argument("expected true or false");
        } else if (k == "loss_scale") {
          double x = 0.0;
          if (!distopt::detail::parse_double(it->second, x) || !(x > 0) || !std::isfinite(x))
            throw std::invalid_argument("not a positive number");
        } else if (k == "seed") {
          std::uint64_t x = 0;
          if (!distopt::detail::parse_value(it->second, x)) throw std::invalid_argument("not an integer in [0, 2^64)");
        } else {
          std::int64_t x = -1;
          if (!distopt::detail::parse_value(it->second, x) || x < 0) throw std::invalid_argument("not a non-negative integer");
        }
      } catch (const std::exception& e) {
        detail::fail(index_path, "state " + k + " = '" + it->second + "' is invalid: " + e.what());
      }
    }
    if (const auto calls = index.state.find("step_calls"); calls != index.state.end()) {
      std::int64_t c = 0, taken = 0;
      distopt::detail::parse_value(calls->second, c);
      distopt::detail::parse_value(index.state.at("step"), taken);
      if (c < taken)
        detail::fail(index_path, "records " + calls->second + " step() calls but " + index.state.at("step") +
                                     " steps taken: a step is taken by a call");
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
      staged[k].reset(new std::byte[static_cast<std::size_t>(it.count * it.element_size)]());  // zeros, never stale bytes
      // Resharding over TP: a tensor whose part is as it was saved (unchanged identity, and
      // this part was saved) is read from this part's files as without resharding; the
      // others through their boxes.
      if (reshard) {
        bool own = t < index.tp_size && !changed.contains(it.key);
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
      // Which of this rank's elements the slices hold: their union, not the sum of their
      // sizes (duplicate slices in crafted rank files must not hide a hole).
      std::vector<std::pair<std::uint64_t, std::uint64_t>> held;
      for (const auto& s : found->second) {
        if (s.part != t) continue;
        if (s.dtype != it.dtype || s.total != it.total)
          detail::fail(files[s.file].path.string(), "'" + it.name + "' is " + s.dtype + " with " + std::to_string(s.total) +
                                                        " elements, this optimizer keeps " + it.dtype + " with " +
                                                        std::to_string(it.total));
        const std::uint64_t a = std::max(it.first, s.first), b = std::min(it.first + it.count, s.first + s.count);
        if (a >= b) continue;
        detail::read_slice(files[s.file], s, a, b, staged[k].get() + (a - it.first) * it.element_size, buffer, it.name);
        held.emplace_back(a, b);
      }
      std::sort(held.begin(), held.end());
      std::uint64_t reached = it.first;  // every element below it is held
      for (const auto& [a, b] : held) {
        if (a > reached) break;
        reached = std::max(reached, b);
      }
      if (reached != it.first + it.count)
        detail::fail(dir.string(), "the rank files hold no element " + std::to_string(reached) + " of '" + it.name +
                                       "' (this rank needs " + std::to_string(it.first) + " to " +
                                       std::to_string(it.first + it.count) + ")");
    }
  } catch (const std::exception& e) {
    error = what + ": " + e.what();
  }
  agree(party, error, what);
  for (std::size_t k = 0; k < items.size(); ++k)
    if (items[k].load) items[k].install(std::span<const std::byte>(staged[k].get(), items[k].count * items[k].element_size));
  party.restore(index.state);
}

}  // namespace distopt::io::detail
