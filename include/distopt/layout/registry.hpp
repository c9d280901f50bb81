// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../config.hpp"
#include "../types/dtype.hpp"

namespace distopt {

/// How tensor parallelism splits a tensor over the TP group: not at all (every TP rank
/// holds the same tensor), or along its rows or columns (each TP rank holds its part).
enum class tp_split : unsigned char { none, rows, cols };

DISTOPT_CORE_FN const char* tp_split_name(tp_split s) noexcept;

/// One registered tensor and where it lives in the flat buffers.
struct tensor_slot {
  std::string name;
  std::vector<std::int64_t> shape;
  distopt::dtype dtype = distopt::dtype::f32;
  /// The hyper-parameter group it belongs to (index into the optimizer's groups).
  int group = 0;
  /// First element in the flat buffers; always a multiple of the block size.
  std::size_t offset = 0;
  /// Number of elements (product of shape).
  std::size_t numel = 0;
  /// The tensor-parallel split of the logical tensor this rank holds part of.
  tp_split tp = tp_split::none;
  /// An expert tensor (layout::add_experts): expert `expert` of the `experts` experts of
  /// the logical tensor `experts_of`, whose shape is [experts, ...this expert's shape]
  /// (over TP: its whole shape). Empty `experts_of` and expert -1 for any other tensor.
  std::string experts_of;
  int expert = -1;
  int experts = 0;
};

/// The experts [first, first + count) of a logical expert tensor that one rank holds
/// (mesh::experts gives a rank's; comm/mesh.hpp).
struct expert_range {
  int first = 0;
  int count = 0;
};

/// The name of expert `e` of the expert tensor `name` (layout::add_experts): "name[e]".
inline std::string expert_tensor_name(std::string_view name, int e) {
  return std::string(name) + "[" + std::to_string(e) + "]";
}

/// Formats a shape as "[2, 3]" for messages.
DISTOPT_CORE_FN std::string shape_string(std::span<const std::int64_t> shape);

/// The tensors an optimizer manages, in registration order, each starting on a block
/// boundary so that blocks (and later shard cuts and 8-bit absmax blocks) never straddle
/// two tensors.
class layout {
 public:
  /// Default block: 256 elements (1 KiB of fp32), a multiple of every SIMD width and warp.
  static constexpr std::size_t default_block = 256;

  explicit layout(std::size_t block = default_block);
  // Declared so that, with DISTOPT_COMPILED_CORE, copying a layout is compiled once.
  layout(const layout&);
  layout(layout&&) noexcept;
  layout& operator=(const layout&);
  layout& operator=(layout&&) noexcept;
  ~layout();

  /// Registers a tensor; names are unique, shapes non-empty with positive dimensions.
  /// `tp` says how tensor parallelism split it: `shape` is then this TP rank's part, and
  /// tensors with tp_split::none are counted once (on TP rank 0) in the global grad norm.
  const tensor_slot& add(std::string name, std::vector<std::int64_t> shape,
                         distopt::dtype type = distopt::dtype::f32, int group = 0,
                         tp_split tp = tp_split::none);

  /// Registers the experts `mine` of an expert tensor `name` of `experts` experts (a
  /// mixture-of-experts layer's weight, logically [experts, ...shape]), each a tensor of its
  /// own named expert_tensor_name(name, e), of shape `shape` (this TP rank's part of one
  /// expert, split by `tp`). The optimizer treats each expert as a tensor (its norm, its
  /// factored or matrix states, its 8-bit blocks); a checkpoint records the logical tensor,
  /// each expert a box in it, so that it reloads on any expert-parallel size. Every expert
  /// of one name has the same shape, dtype, group and split.
  void add_experts(std::string_view name, int experts, expert_range mine, const std::vector<std::int64_t>& shape,
                   distopt::dtype type = distopt::dtype::f32, int group = 0, tp_split tp = tp_split::none);

  /// The tensor registered under `name`; throws std::out_of_range naming it if there is none.
  const tensor_slot& find(std::string_view name) const;

  /// True when a tensor of that name is registered.
  bool contains(std::string_view name) const;

  /// All tensors, in registration order.
  std::span<const tensor_slot> tensors() const noexcept { return tensors_; }
  /// Elements in each flat buffer, padding included.
  std::size_t size() const noexcept { return size_; }
  /// Elements in all tensors, padding excluded.
  std::size_t numel() const noexcept;
  /// The alignment of every tensor, in elements.
  std::size_t block_size() const noexcept { return block_; }
  /// The highest group index used, plus one.
  int groups_used() const noexcept;

 private:
  std::size_t round_up(std::size_t n) const { return (n + block_ - 1) / block_ * block_; }

  std::size_t block_;
  std::size_t size_ = 0;
  std::vector<tensor_slot> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN const char* tp_split_name(tp_split s) noexcept {
  switch (s) {
  case tp_split::none: return "none";
  case tp_split::rows: return "rows";
  case tp_split::cols: return "cols";
  }
  return "?";
}

DISTOPT_CORE_FN std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

DISTOPT_CORE_FN layout::layout(std::size_t block) : block_(block) {
  if (block == 0 || (block & (block - 1)) != 0)
    throw std::invalid_argument("distopt::layout: block size must be a power of two, got " + std::to_string(block));
}
DISTOPT_CORE_FN layout::layout(const layout&) = default;
DISTOPT_CORE_FN layout::layout(layout&&) noexcept = default;
DISTOPT_CORE_FN layout& layout::operator=(const layout&) = default;
DISTOPT_CORE_FN layout& layout::operator=(layout&&) noexcept = default;
DISTOPT_CORE_FN layout::~layout() = default;

DISTOPT_CORE_FN const tensor_slot& layout::add(std::string name, std::vector<std::int64_t> shape, distopt::dtype type,
                                               int group, tp_split tp) {
  if (name.empty()) throw std::invalid_argument("distopt::layout::add: tensor name is empty");
  if (index_.count(name))
    throw std::invalid_argument("distopt::layout::add: tensor '" + name +
                                "' is already registered");
  if (shape.empty())
    throw std::invalid_argument("distopt::layout::add: tensor '" + name +
                                "' has an empty shape; use {1} for a scalar");
  if (group < 0)
    throw std::invalid_argument("distopt::layout::add: tensor '" + name + "' has group " +
                                std::to_string(group) + "; groups are numbered from 0");
  std::size_t numel = 1;
  for (auto d : shape) {
    if (d <= 0)
      throw std::invalid_argument("distopt::layout::add: tensor '" + name + "' has shape " +
                                  shape_string(shape) + "; every dimension must be positive");
    if (numel > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(d))
      throw std::invalid_argument("distopt::layout::add: tensor '" + name + "' shape " +
                                  shape_string(shape) + " overflows");
    numel *= static_cast<std::size_t>(d);
  }
  tensor_slot t{std::move(name), std::move(shape), type, group, size_, numel, tp, {}, -1, 0};
  size_ += round_up(numel);
  index_.emplace(t.name, tensors_.size());
  tensors_.push_back(std::move(t));
  return tensors_.back();
}

DISTOPT_CORE_FN void layout::add_experts(std::string_view name, int experts, expert_range mine,
                                         const std::vector<std::int64_t>& shape, distopt::dtype type, int group,
                                         tp_split tp) {
  const std::string what = "distopt::layout::add_experts: expert tensor '" + std::string(name) + "'";
  if (name.empty()) throw std::invalid_argument("distopt::layout::add_experts: tensor name is empty");
  if (experts < 1) throw std::invalid_argument(what + " has " + std::to_string(experts) + " experts; it needs at least 1");
  if (mine.count < 1 || mine.first < 0 || mine.first + mine.count > experts)
    throw std::invalid_argument(what + ": experts " + std::to_string(mine.first) + " to " +
                                std::to_string(mine.first + mine.count - 1) + " are not a non-empty range of its " +
                                std::to_string(experts) + " experts");
  for (const tensor_slot& t : tensors_)
    if (t.experts_of == name && (t.experts != experts || t.shape != shape || t.dtype != type || t.group != group || t.tp != tp))
      throw std::invalid_argument(what + ": expert " + std::to_string(mine.first) + " differs from expert " +
                                  std::to_string(t.expert) + " registered before (experts, shape, dtype, group or TP "
                                  "split); every expert of a tensor has the same");
  for (int e = mine.first; e < mine.first + mine.count; ++e)  // all or none registered
    if (index_.contains(expert_tensor_name(name, e)))
      throw std::invalid_argument(what + ": tensor '" + expert_tensor_name(name, e) + "' is already registered");
  for (int e = mine.first; e < mine.first + mine.count; ++e) {
    add(expert_tensor_name(name, e), shape, type, group, tp);
    tensor_slot& t = tensors_.back();
    t.experts_of = std::string(name);
    t.expert = e;
    t.experts = experts;
  }
}

DISTOPT_CORE_FN const tensor_slot& layout::find(std::string_view name) const {
  auto it = index_.find(name);  // std::less<>: looked up by the view, no string built
  if (it == index_.end()) throw std::out_of_range("distopt: no tensor named '" + std::string(name) + "' is registered");
  return tensors_[it->second];
}

DISTOPT_CORE_FN bool layout::contains(std::string_view name) const { return index_.contains(name); }

DISTOPT_CORE_FN std::size_t layout::numel() const noexcept {
  std::size_t n = 0;
  for (const auto& t : tensors_) n += t.numel;
  return n;
}

DISTOPT_CORE_FN int layout::groups_used() const noexcept {
  int g = 0;
  for (const auto& t : tensors_) g = std::max(g, t.group + 1);
  return g;
}
#endif  // DISTOPT_CORE_BODIES

}  // namespace distopt
