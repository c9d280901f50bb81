// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Where every element lives when the flat buffers are cut into buckets and each
/// bucket is split over the data-parallel ranks.
///
/// Three coordinates name one element:
///   layout index  its place in the layout (tensor offset + index in the tensor): the
///                 same for every d, so it keys stochastic rounding;
///   buffer index  its place in the full buffers every rank holds (params, grads);
///                 buckets are padded to a multiple of d blocks, so it shifts with d;
///   local index   its place in this rank's shard buffers (master weights, states).
/// Buckets are whole tensors, closed once they reach `bucket_elems`, so they do not depend
/// on d. Each bucket of B blocks is cut into d shards of ceil(B / d) blocks: cuts fall on
/// block boundaries only, and the last shards hold the padding.
///
/// Owned tensors (`owned` placement: the matrices GaLore and Muon need whole) sit in
/// buckets of their own, and each belongs to one rank. The owners split the owned tensors,
/// in layout order, into d consecutive runs whose largest cost (m n min(m, n) for a matrix:
/// an SVD's or a Newton–Schulz step's work) is the least possible; so an owned bucket's
/// shards are cut at tensor boundaries, one run of each owner, with no padding, and shard r
/// may be empty. The owners depend only on the layout and d.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../config.hpp"
#include "../layout/registry.hpp"

namespace distopt::detail {

struct shard_bucket {
  std::size_t layout_begin = 0, layout_end = 0;  ///< [begin, end) in layout coordinates
  std::size_t buffer_begin = 0;                  ///< first element in the full buffers
  std::size_t shard_elems = 0;  ///< even cut: elements of each rank's shard, padding included; owned: this rank's
  std::size_t local_begin = 0;                   ///< first element of this rank's shard in the local buffers
  std::size_t first_tensor = 0, end_tensor = 0;  ///< tensors [first, end) of the layout
  std::size_t first_piece = 0, end_piece = 0;    ///< this rank's pieces [first, end) of the plan
  std::size_t shards = 1;
  /// Owned buckets: shard r is [cuts[r], cuts[r + 1]) from buffer_begin (d + 1 entries).
  /// Empty for an even cut.
  std::vector<std::size_t> cuts;

  bool owned() const noexcept { return !cuts.empty(); }
  /// Elements of the bucket in the full buffers, padding included.
  std::size_t padded() const noexcept { return owned() ? cuts.back() : shard_elems * shards; }
  /// Rank r's shard: its first element (from buffer_begin) and its elements.
  std::size_t shard_begin(std::size_t r) const noexcept { return owned() ? cuts[r] : r * shard_elems; }
  std::size_t shard_size(std::size_t r) const noexcept { return owned() ? cuts[r + 1] - cuts[r] : shard_elems; }
};

/// This rank's pieces of one tensor, [first, end) in the plan (empty when it holds none).
struct piece_range {
  std::size_t first = 0, end = 0;
  bool empty() const noexcept { return first == end; }
};

/// A contiguous run of one tensor inside this rank's shard: the unit of work.
struct shard_piece {
  std::size_t buffer = 0;  ///< buffer index of its first element
  std::size_t local = 0;   ///< local index of its first element
  std::size_t layout = 0;  ///< layout index of its first element
  std::size_t count = 0;
  int group = 0;
  std::size_t tensor = 0;  ///< index in the layout
};

class shard_plan {
 public:
  shard_plan() = default;
  /// Plans `l` for rank `rank` of `shards` ranks, with pieces of at most `piece_elems`
  /// (a multiple of the block size) and buckets closed at `bucket_elems`. The tensors i
  /// with `owned[i]` (none when empty) are placed whole, each on one rank.
  shard_plan(const layout& l, int shards, int rank, std::size_t bucket_elems, std::size_t piece_elems,
             const std::vector<char>& owned = {});

  std::size_t shards() const noexcept { return shards_; }
  std::size_t rank() const noexcept { return rank_; }
  const std::vector<shard_bucket>& buckets() const noexcept { return buckets_; }
  const std::vector<shard_piece>& pieces() const noexcept { return pieces_; }
  /// Elements of each full buffer (params, grads), padding included.
  std::size_t buffer_size() const noexcept { return buffer_size_; }
  /// Elements of each local buffer (master, states), padding included.
  std::size_t local_size() const noexcept { return local_size_; }
  /// Elements of real tensors in this rank's shard.
  std::size_t local_numel() const noexcept { return local_numel_; }
  /// Buffer index of tensor `i`'s first element.
  std::size_t tensor_buffer(std::size_t i) const { return tensor_buffer_.at(i); }
  /// This rank's pieces of tensor `i` (consecutive in pieces()).
  piece_range pieces_of(std::size_t i) const { return tensor_pieces_.at(i); }
  /// Elements of this rank's pieces of tensor `i` (0 when it holds none).
  std::size_t local_count(std::size_t i) const {
    const piece_range r = tensor_pieces_.at(i);
    std::size_t n = 0;
    for (std::size_t c = r.first; c < r.end; ++c) n += pieces_[c].count;
    return n;
  }
  /// Whether tensor `i`'s elements lie in more than one rank's shard.
  bool straddles(std::size_t i) const { return straddles_.at(i); }
  /// The rank that holds owned tensor `i` whole; -1 for a tensor cut evenly.
  int owner(std::size_t i) const { return owner_.empty() ? -1 : owner_.at(i); }

  /// The owners of the tensors with `owned[i]` (-1 for the others) for `shards` ranks:
  /// consecutive runs in layout order whose largest total cost is the least possible;
  /// among such splits, each run takes as many tensors as it can, from rank 0 on.
  static std::vector<int> assign_owners(const layout& l, int shards, const std::vector<char>& owned);
  /// What owning tensor `t` costs its rank: m n min(m, n) for a matrix, numel otherwise.
  static std::uint64_t owned_cost(const tensor_slot& t);

 private:
  static std::size_t round_up(std::size_t n, std::size_t b) { return (n + b - 1) / b * b; }

  std::size_t shards_ = 1, rank_ = 0;
  std::vector<shard_bucket> buckets_;
  std::vector<shard_piece> pieces_;
  std::vector<std::size_t> tensor_buffer_;
  std::vector<piece_range> tensor_pieces_;
  std::vector<char> straddles_;
  std::vector<int> owner_;  // per tensor (empty without owned tensors)
  std::size_t buffer_size_ = 0, local_size_ = 0, local_numel_ = 0;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN std::uint64_t shard_plan::owned_cost(const tensor_slot& t) {
  if (t.shape.size() != 2) return t.numel;
  const auto m = static_cast<std::uint64_t>(t.shape[0]), n = static_cast<std::uint64_t>(t.shape[1]);
  if (std::min(m, n) != 0 && m * n > std::numeric_limits<std::uint64_t>::max() / std::min(m, n))  // (m n: a numel)
    throw std::invalid_argument("distopt: owned tensor '" + t.name + "' is too large to weigh (m n min(m, n) overflows)");
  return m * n * std::min(m, n);
}

DISTOPT_CORE_FN std::vector<int> shard_plan::assign_owners(const layout& l, int shards, const std::vector<char>& owned) {
  const auto tensors = l.tensors();
  std::vector<int> owner(tensors.size(), -1);
  std::vector<std::size_t> which;
  std::vector<std::uint64_t> cost;
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (i < owned.size() && owned[i]) {
      which.push_back(i);
      cost.push_back(owned_cost(tensors[i]));
    }
  if (which.empty()) return owner;
  // Greedy runs under a cap: the fewest runs that fit it; the least cap that fits in
  // `shards` runs, by bisection over integers (exact: no rounding decides an owner).
  const auto runs_under = [&](std::uint64_t cap) {
    std::size_t runs = 1;
    std::uint64_t load = 0;
    for (const std::uint64_t c : cost) {
      if (load + c > cap) {
        ++runs;
        load = 0;
      }
      load += c;
    }
    return runs;
  };
  std::uint64_t lo = *std::max_element(cost.begin(), cost.end()), hi = 0;
  for (const std::uint64_t c : cost) {
    if (hi > std::numeric_limits<std::uint64_t>::max() - c)
      throw std::invalid_argument("distopt: the owned tensors are too large to weigh (their costs overflow)");
    hi += c;
  }
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (runs_under(mid) <= static_cast<std::size_t>(shards)) hi = mid;
    else lo = mid + 1;
  }
  int rank = 0;
  std::uint64_t load = 0;
  for (std::size_t k = 0; k < which.size(); ++k) {
    if (load + cost[k] > lo) {
      ++rank;
      load = 0;
    }
    load += cost[k];
    owner[which[k]] = rank;
  }
  return owner;
}

DISTOPT_CORE_FN shard_plan::shard_plan(const layout& l, int shards, int rank, std::size_t bucket_elems,
                                       std::size_t piece_elems, const std::vector<char>& owned)
    : shards_(static_cast<std::size_t>(shards)), rank_(static_cast<std::size_t>(rank)) {
  if (shards < 1 || rank < 0 || rank >= shards)
    throw std::invalid_argument("distopt: rank " + std::to_string(rank) + " of " + std::to_string(shards) +
                                " shards does not exist");
  const std::size_t block = l.block_size();
  const auto tensors = l.tensors();
  tensor_buffer_.resize(tensors.size());
  tensor_pieces_.resize(tensors.size());
  straddles_.resize(tensors.size());
  if (std::any_of(owned.begin(), owned.end(), [](char c) { return c != 0; })) owner_ = assign_owners(l, shards, owned);
  const auto is_owned = [&](std::size_t i) { return !owner_.empty() && owner_[i] >= 0; };
  std::size_t t = 0, buffer = 0, local = 0;
  while (t < tensors.size()) {
    shard_bucket b;
    b.shards = shards_;
    b.first_tensor = t;
    b.layout_begin = tensors[t].offset;
    const bool owns = is_owned(t);
    do {
      b.layout_end = tensors[t].offset + round_up(tensors[t].numel, block);
      ++t;
    } while (t < tensors.size() && b.layout_end - b.layout_begin < bucket_elems && is_owned(t) == owns);
    b.end_tensor = t;
    b.buffer_begin = buffer;
    b.local_begin = local;
    if (owns) {
      // Shard r: the run of tensors rank r owns (owners never decrease along the layout).
      b.cuts.assign(shards_ + 1, b.layout_end - b.layout_begin);
      for (std::size_t i = b.end_tensor; i-- > b.first_tensor;)
        for (auto r = static_cast<std::size_t>(owner_[i]) + 1; r-- > 0;) b.cuts[r] = tensors[i].offset - b.layout_begin;
      b.shard_elems = b.shard_size(rank_);
    } else {
      const std::size_t blocks = (b.layout_end - b.layout_begin) / block;
      b.shard_elems = (blocks + shards_ - 1) / shards_ * block;
    }
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      tensor_buffer_[i] = buffer + (tensors[i].offset - b.layout_begin);
      const std::size_t lo = tensors[i].offset - b.layout_begin, hi = lo + tensors[i].numel - 1;
      straddles_[i] = !owns && lo / b.shard_elems != hi / b.shard_elems;
    }
    buffer += b.padded();
    local += b.shard_size(rank_);
    buckets_.push_back(b);
  }
  buffer_size_ = buffer;
  local_size_ = local;
  // This rank's pieces: its shard of each bucket intersected with the bucket's tensors.
  for (shard_bucket& b : buckets_) {
    b.first_piece = pieces_.size();
    const std::size_t lo = b.layout_begin + b.shard_begin(rank_), hi = lo + b.shard_size(rank_);
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      const tensor_slot& ts = tensors[i];
      tensor_pieces_[i].first = pieces_.size();
      const std::size_t a = std::max(lo, ts.offset), e = std::min(hi, ts.offset + ts.numel);
      for (std::size_t p = a; p < e; p += piece_elems) {
        const std::size_t n = std::min(piece_elems, e - p);
        pieces_.push_back({b.buffer_begin + (p - b.layout_begin), b.local_begin + (p - lo), p, n, ts.group, i});
        local_numel_ += n;
      }
      tensor_pieces_[i].end = pieces_.size();
    }
    b.end_piece = pieces_.size();
  }
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt::detail
