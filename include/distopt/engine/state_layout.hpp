// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Where the optimizer states lie: one table (piece, slot) -> (buffer, offset) that
/// the stages fill at construction and that the update phases (through its device copy),
/// the state views, the memory report and the checkpoint read.
///
/// A piece's slot k lies in one of the context's state buffers:
///  - `slot`: state_k, the slot's buffer of element states (of 8-bit codes with q8);
///  - `small`: q8's fp32 states of the tensors below min_8bit_size (small_k);
///  - `momentum`: the momentum buffer of the matrices Muon orthogonalises;
///  - `none`: the piece keeps no such state (a slot a layer-wise tensor does not use, the
///    element states of a matrix GaLore projects, whose low-rank states are its stage's).
/// The element-wise stage lays out every slot of a piece at the piece's local index (the
/// buffers then have the shard's padding); the others pack the pieces that keep a slot.

#include <array>
#include <cstddef>
#include <vector>

#include "../config.hpp"

namespace distopt::detail {

/// Each state slot's offset of one piece (in the buffer its home names); what the update
/// phases read per piece.
struct slot_offsets {
  std::size_t at[4] = {};
};

/// The buffer a piece's state slot lies in.
enum class state_home : unsigned char { none, slot, small, momentum };

/// The state layout of one rank's pieces.
class state_layout {
 public:
  state_layout() = default;
  /// `pieces` pieces with no state anywhere yet; `tensors` tensors, none updated whole.
  state_layout(std::size_t pieces, std::size_t tensors)
      : offsets_(pieces), homes_(pieces), matrix_index_(tensors, -1) {}

  /// Puts piece `c`'s slot `k` (`count` elements) at `offset` of buffer `home`.
  void place(std::size_t c, int k, state_home home, std::size_t offset, std::size_t count) {
    offsets_[c].at[k] = offset;
    homes_[c][static_cast<std::size_t>(k)] = home;
    used_[static_cast<std::size_t>(home)][static_cast<std::size_t>(k)] += count;
  }
  state_home home(std::size_t c, int k) const { return homes_[c][static_cast<std::size_t>(k)]; }
  std::size_t offset(std::size_t c, int k) const { return offsets_[c].at[k]; }
  /// The per-piece table the update phases read.
  const std::vector<slot_offsets>& offsets() const noexcept { return offsets_; }

  /// Elements of the pieces placed in buffer `home` of slot `k` (the rest of a buffer is
  /// padding: the shard's, or the 8-bit codes' last partial blocks).
  std::size_t used(state_home home, int k) const noexcept {
    return used_[static_cast<std::size_t>(home)][static_cast<std::size_t>(k)];
  }

  /// Per tensor: >= 0 for a matrix a matrix stage updates whole (GaLore's projected: its
  /// index among them; Muon's orthogonalised: 1), -1 for a tensor of the element-wise update.
  const std::vector<int>& matrix_index() const noexcept { return matrix_index_; }
  std::vector<int>& matrix_index() noexcept { return matrix_index_; }
  bool whole_matrix(std::size_t tensor) const noexcept { return matrix_index_[tensor] >= 0; }
  /// Whether any of the tensors [first, end) (a bucket's) is such a matrix.
  bool any_whole_matrix(std::size_t first, std::size_t end) const noexcept {
    for (std::size_t i = first; i < end; ++i)
      if (whole_matrix(i)) return true;
    return false;
  }

 private:
  std::vector<slot_offsets> offsets_;
  std::vector<std::array<state_home, 4>> homes_;
  std::vector<int> matrix_index_;
  std::array<std::array<std::size_t, 4>, 4> used_{};
};

}  // namespace distopt::detail
