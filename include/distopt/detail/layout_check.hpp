// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Checks that every rank registered the same layout, before any collective that
/// depends on it. Costs one all_gather of four doubles when the layouts agree.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "function_ref.hpp"
#include "../layout/registry.hpp"
#include "../types/dtype.hpp"

namespace distopt::detail {

/// "'w' [4, 5] f32 group 0 tp none": one tensor as the error names it.
DISTOPT_CORE_FN std::string describe_tensor(const tensor_slot& t);
/// describe_tensor without the TP split, with `shape` in place of the slot's.
DISTOPT_CORE_FN std::string describe_tensor_shape(const tensor_slot& t, const std::vector<std::int64_t>& shape);

/// Throws std::logic_error unless this optimizer's expert tensors, over `ep` ranks that
/// each hold as many, are every expert: what a checkpoint or a norm over the experts needs.
/// With `ep_rank` (this rank's index in an expert-parallel group of `ep` > 1 ranks), also
/// unless it holds expert tensors only (a dense one would count once per rank), each the
/// run of experts of its index (mesh::experts).
inline void check_experts_held(const layout& l, int ep, const char* who, int ep_rank = -1) {
  if (ep_rank >= 0 && ep > 1)
    for (const tensor_slot& t : l.tensors()) {
      if (t.experts_of.empty())
        throw std::logic_error(std::string(who) + ": tensor '" + t.name + "' is not an expert tensor; over an "
                               "expert-parallel group an optimizer holds experts only (put dense tensors in the "
                               "dense optimizer)");
      const int each = t.experts / ep, first = ep_rank * each;
      if (t.expert < first || t.expert >= first + each)
        throw std::logic_error(std::string(who) + ": expert-parallel rank " + std::to_string(ep_rank) + " holds '" +
                               t.name + "'; it holds experts " + std::to_string(first) + " to " +
                               std::to_string(first + each - 1) + " of '" + t.experts_of + "' (mesh::experts)");
    }
  std::map<std::string, std::pair<int, int>, std::less<>> held;  // experts held, of how many
  for (const tensor_slot& t : l.tensors())
    if (!t.experts_of.empty()) held[t.experts_of] = {held[t.experts_of].first + 1, t.experts};
  for (const auto& [name, ne] : held) {
    const auto [n, e] = ne;
    if (n * ep != e)
      throw std::logic_error(std::string(who) + ": this optimizer holds " + std::to_string(n) + " of the " +
                             std::to_string(e) + " experts of '" + name + "' over an expert-parallel group of " +
                             std::to_string(ep) + (ep == 1 ? " rank" : " ranks") +
                             "; give it the ranks that hold the others (set_expert_parallel_group(m.ep))");
  }
}

inline std::uint64_t fnv1a(std::uint64_t h, const std::string& s) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return (h ^ 0xffu) * 0x100000001b3ull;  // a separator, so "ab"+"c" differs from "a"+"bc"
}

/// A 64-bit hash as three doubles of at most 22 bits each (exact in any float format a
/// communicator carries as double).
inline void hash_to_doubles(std::uint64_t h, double* out) {
  out[0] = static_cast<double>(h & 0x3fffff);
  out[1] = static_cast<double>((h >> 22) & 0x3fffff);
  out[2] = static_cast<double>(h >> 44);
}

/// A communicator's all_gather of doubles, as the layout check below uses it.
using all_gather_doubles = function_ref<void(std::span<const double>, std::span<double>)>;

/// The layout check of `d` > 1 ranks, through `all_gather` over them: throws
/// std::invalid_argument on every rank, with the same message, when the ranks registered
/// different layouts (names, shapes, dtypes, groups, order, block). The optimizer passes
/// its all_gather_host, which a communicator of device memory (nccl) can take.
DISTOPT_CORE_FN void check_layout_agreement(std::size_t d, all_gather_doubles all_gather, const layout& l,
                                            const char* who);

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN std::string describe_tensor_shape(const tensor_slot& t, const std::vector<std::int64_t>& shape) {
  return "'" + t.name + "' " + shape_string(shape) + " " + std::string(dtype_name(t.dtype)) + " group " +
         std::to_string(t.group);
}

DISTOPT_CORE_FN std::string describe_tensor(const tensor_slot& t) {
  return describe_tensor_shape(t, t.shape) + " tp " + tp_split_name(t.tp);
}

DISTOPT_CORE_FN void check_layout_agreement(std::size_t d, all_gather_doubles all_gather, const layout& l,
                                            const char* who) {
  const auto tensors = l.tensors();
  std::vector<std::uint64_t> per(tensors.size());
  std::uint64_t whole = fnv1a(0xcbf29ce484222325ull, "block " + std::to_string(l.block_size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    per[i] = fnv1a(0xcbf29ce484222325ull, describe_tensor(tensors[i]));
    whole = fnv1a(whole, std::to_string(per[i]));
  }
  std::array<double, 5> mine{};
  hash_to_doubles(whole, mine.data());
  mine[3] = static_cast<double>(tensors.size());
  mine[4] = static_cast<double>(l.block_size());
  std::vector<double> all(5 * d);
  all_gather(std::span<const double>(mine), std::span<double>(all));
  bool same = true;
  double max_count = 0;
  for (std::size_t r = 0; r < d; ++r) {
    same = same && std::equal(all.begin(), all.begin() + 5, all.begin() + static_cast<std::ptrdiff_t>(5 * r));
    max_count = std::max(max_count, all[5 * r + 3]);
  }
  if (same) return;
  const std::string prefix = std::string(who) + ": the ranks registered different layouts: ";
  for (std::size_t r = 1; r < d; ++r)
    if (all[5 * r + 4] != all[4])
      throw std::invalid_argument(prefix + "rank 0 has block size " + std::to_string(static_cast<long>(all[4])) +
                                  ", rank " + std::to_string(r) + " has " +
                                  std::to_string(static_cast<long>(all[5 * r + 4])));
  // Find the first tensor index where some rank differs from rank 0, then exchange the
  // descriptions of that tensor so every rank can name it.
  const std::size_t m = static_cast<std::size_t>(max_count);
  std::vector<double> hashes(3 * m, -1.0), every(3 * m * d);
  for (std::size_t i = 0; i < tensors.size(); ++i) hash_to_doubles(per[i], hashes.data() + 3 * i);
  all_gather(std::span<const double>(hashes), std::span<double>(every));
  std::size_t first = m;
  for (std::size_t i = 0; i < m && first == m; ++i)
    for (std::size_t r = 1; r < d; ++r)
      if (!std::equal(every.begin() + static_cast<std::ptrdiff_t>(3 * i), every.begin() + static_cast<std::ptrdiff_t>(3 * i + 3),
                      every.begin() + static_cast<std::ptrdiff_t>(3 * (r * m + i))))
        first = i;
  if (first == m) first = 0;  // unreachable unless hashes collide; name tensor 0 then
  constexpr std::size_t text = 200;
  std::string desc = first < tensors.size() ? describe_tensor(tensors[first]) : std::string("no tensor");
  desc.resize(std::min(desc.size(), text));
  std::vector<double> chars(text, 0.0), texts(text * d);
  for (std::size_t i = 0; i < desc.size(); ++i) chars[i] = static_cast<unsigned char>(desc[i]);
  all_gather(std::span<const double>(chars), std::span<double>(texts));
  const auto text_of = [&](std::size_t r) {
    std::string s;
    for (std::size_t i = 0; i < text && texts[r * text + i] != 0.0; ++i) s += static_cast<char>(texts[r * text + i]);
    return s;
  };
  std::string msg = prefix + "first difference at tensor #" + std::to_string(first) + ": rank 0 has " + text_of(0);
  for (std::size_t r = 1; r < d; ++r)
    if (text_of(r) != text_of(0)) msg += ", rank " + std::to_string(r) + " has " + text_of(r);
  throw std::invalid_argument(msg);
}

#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt::detail
