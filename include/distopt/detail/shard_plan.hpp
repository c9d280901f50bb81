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

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "../config.hpp"
#include "../layout/registry.hpp"

namespace distopt::detail {

struct shard_bucket {
  std::size_t layout_begin = 0, layout_end = 0;  ///< [begin, end) in layout coordinates
  std::size_t buffer_begin = 0;                  ///< first element in the full buffers
  std::size_t shard_elems = 0;                   ///< elements of each rank's shard, padding included
  std::size_t local_begin = 0;                   ///< first element of this rank's shard in the local buffers
  std::size_t first_tensor = 0, end_tensor = 0;  ///< tensors [first, end) of the layout
  std::size_t first_piece = 0, end_piece = 0;    ///< this rank's pieces [first, end) of the plan
  std::size_t shards = 1;
  std::size_t padded() const noexcept { return shard_elems * shards; }
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
  /// (a multiple of the block size) and buckets closed at `bucket_elems`.
  shard_plan(const layout& l, int shards, int rank, std::size_t bucket_elems, std::size_t piece_elems);

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

 private:
  static std::size_t round_up(std::size_t n, std::size_t b) { return (n + b - 1) / b * b; }

  std::size_t shards_ = 1, rank_ = 0;
  std::vector<shard_bucket> buckets_;
  std::vector<shard_piece> pieces_;
  std::vector<std::size_t> tensor_buffer_;
  std::vector<piece_range> tensor_pieces_;
  std::vector<char> straddles_;
  std::size_t buffer_size_ = 0, local_size_ = 0, local_numel_ = 0;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN shard_plan::shard_plan(const layout& l, int shards, int rank, std::size_t bucket_elems,
                                       std::size_t piece_elems)
    : shards_(static_cast<std::size_t>(shards)), rank_(static_cast<std::size_t>(rank)) {
  if (shards < 1 || rank < 0 || rank >= shards)
    throw std::invalid_argument("distopt: rank " + std::to_string(rank) + " of " + std::to_string(shards) +
                                " shards does not exist");
  const std::size_t block = l.block_size();
  const auto tensors = l.tensors();
  tensor_buffer_.resize(tensors.size());
  tensor_pieces_.resize(tensors.size());
  straddles_.resize(tensors.size());
  std::size_t t = 0, buffer = 0, local = 0;
  while (t < tensors.size()) {
    shard_bucket b;
    b.shards = shards_;
    b.first_tensor = t;
    b.layout_begin = tensors[t].offset;
    do {
      b.layout_end = tensors[t].offset + round_up(tensors[t].numel, block);
      ++t;
    } while (t < tensors.size() && b.layout_end - b.layout_begin < bucket_elems);
    b.end_tensor = t;
    const std::size_t blocks = (b.layout_end - b.layout_begin) / block;
    b.shard_elems = (blocks + shards_ - 1) / shards_ * block;
    b.buffer_begin = buffer;
    b.local_begin = local;
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      tensor_buffer_[i] = buffer + (tensors[i].offset - b.layout_begin);
      const std::size_t lo = tensors[i].offset - b.layout_begin, hi = lo + tensors[i].numel - 1;
      straddles_[i] = lo / b.shard_elems != hi / b.shard_elems;
    }
    buffer += b.padded();
    local += b.shard_elems;
    buckets_.push_back(b);
  }
  buffer_size_ = buffer;
  local_size_ = local;
  // This rank's pieces: its shard of each bucket intersected with the bucket's tensors.
  for (shard_bucket& b : buckets_) {
    b.first_piece = pieces_.size();
    const std::size_t lo = b.layout_begin + rank_ * b.shard_elems, hi = lo + b.shard_elems;
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
