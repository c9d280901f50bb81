// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file What the overlap hooks keep between forward, backward and `step()`: which
/// tensors' grads are ready this step and which buckets' reductions have started
/// (`grad_hooks`), which tensors' params are gathered (`param_gathers`, ZeRO-3), and the
/// pools of full-bucket buffers (`bucket_pool`): ZeRO-2's grads, which live only from a
/// bucket's first write until its reduce-scatter ends, and ZeRO-3's params, which live
/// only from a gather until the release.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../detail/buffer.hpp"
#include "../detail/shard_plan.hpp"
#include "../layout/registry.hpp"

namespace distopt {

/// The tensors an overlap hook names: one tensor ("h0.w") or a layer's, as a list
/// ({"h0.w", "h0.b"}) or any range of names (a std::vector<std::string>).
class tensor_names {
 public:
  tensor_names(const char* name) : names_{std::string_view(name)} {}
  tensor_names(std::string_view name) : names_{name} {}
  tensor_names(const std::string& name) : names_{std::string_view(name)} {}
  tensor_names(std::initializer_list<std::string_view> names) : names_(names) {}
  template <class R>
    requires(requires(const R& r) {
      { *std::begin(r) } -> std::convertible_to<std::string_view>;
      std::end(r);
    } && !std::convertible_to<const R&, std::string_view>)
  tensor_names(const R& names) {
    for (auto&& n : names) names_.emplace_back(n);
  }
  auto begin() const noexcept { return names_.begin(); }
  auto end() const noexcept { return names_.end(); }

 private:
  std::vector<std::string_view> names_;
};

/// `release(layer, keep_writes)`: this rank keeps its shard of what was written into the
/// gathered params (ZeRO-3), e.g. the initial values.
struct keep_writes_t {
  explicit keep_writes_t() = default;
};
inline constexpr keep_writes_t keep_writes{};

}  // namespace distopt

namespace distopt::detail {

/// The hooks' bookkeeping for one step: per tensor, whether `grads_ready` named it; per
/// bucket, how many of its tensors are still missing, whether its reduction started and
/// whether its grads were viewed (ZeRO-2 zeroes them at the first view of a step).
class grad_hooks {
 public:
  grad_hooks() = default;
  explicit grad_hooks(const shard_plan& plan, std::size_t tensors)
      : ready_(tensors, 0),
        missing_(plan.buckets().size()),
        started_(plan.buckets().size(), 0),
        lent_(plan.buckets().size(), 0),
        bucket_of_(tensors) {
    for (std::size_t k = 0; k < plan.buckets().size(); ++k) {
      const shard_bucket& b = plan.buckets()[k];
      for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) bucket_of_[i] = k;
    }
    reset(plan);
  }

  /// The bucket that holds tensor `i`.
  std::size_t bucket_of(std::size_t i) const { return bucket_of_.at(i); }
  /// Whether any hook was called since the last reset (the step then needs every tensor).
  bool in_use() const noexcept { return in_use_; }
  bool ready(std::size_t i) const { return ready_.at(i) != 0; }
  bool started(std::size_t k) const { return started_.at(k) != 0; }
  /// Records that bucket `k`'s grads were viewed in this step; true the first time.
  bool lend(std::size_t k) {
    if (lent_.at(k)) return false;
    lent_[k] = 1;
    return true;
  }
  void start(std::size_t k) { started_.at(k) = 1; }

  /// Marks tensor `i` (named `name`) ready; returns true when that completes its bucket.
  /// Naming a tensor twice in one step is refused.
  bool mark(std::size_t i, const std::string& name) {
    if (ready_.at(i))
      throw std::logic_error("distopt::optimizer::grads_ready: the grads of '" + name +
                             "' were already declared ready in this step (call grads_ready once per tensor per "
                             "step, or per micro-batch with gradient accumulation, after its last write)");
    in_use_ = true;
    ready_[i] = 1;
    return --missing_[bucket_of_[i]] == 0;
  }

  /// The first tensor whose grads were not declared ready, or -1 when all were.
  std::ptrdiff_t first_missing() const noexcept {
    for (std::size_t i = 0; i < ready_.size(); ++i)
      if (!ready_[i]) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }

  /// A new step: nothing ready, nothing started.
  void reset(const shard_plan& plan) { next_micro_batch(plan, false); }
  /// A new micro-batch: nothing ready, nothing started; the views stay lent (not zeroed
  /// again) with `keep_lent`.
  void next_micro_batch(const shard_plan& plan, bool keep_lent) {
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(started_.begin(), started_.end(), 0);
    if (!keep_lent) std::fill(lent_.begin(), lent_.end(), 0);
    for (std::size_t k = 0; k < plan.buckets().size(); ++k)
      missing_[k] = plan.buckets()[k].end_tensor - plan.buckets()[k].first_tensor;
    in_use_ = false;
  }

 private:
  std::vector<char> ready_;
  std::vector<std::size_t> missing_;
  std::vector<char> started_, lent_;
  std::vector<std::size_t> bucket_of_;
  bool in_use_ = false;
};

/// ZeRO-3's gathered params: per tensor whether a `gather` holds it, per bucket how many
/// tensors do (the bucket's full params live while any does) and whether a prefetch of
/// it is in flight.
class param_gathers {
 public:
  param_gathers() = default;
  param_gathers(std::size_t buckets, std::size_t tensors)
      : gathered_(tensors, 0), refs_(buckets, 0), prefetched_(buckets, 0) {}

  bool gathered(std::size_t i) const { return gathered_.at(i) != 0; }
  bool holds(std::size_t k) const { return refs_.at(k) != 0; }
  bool prefetched(std::size_t k) const { return prefetched_.at(k) != 0; }
  void set_prefetched(std::size_t k, bool on) { prefetched_.at(k) = on; }

  /// Tensor `i` (in bucket `k`) is gathered; true when its bucket must be gathered now.
  bool gather(std::size_t i, std::size_t k, const std::string& name) {
    if (gathered_.at(i))
      throw std::logic_error("distopt::optimizer::gather: '" + name +
                             "' is gathered already; release it before gathering it again");
    gathered_[i] = 1;
    return refs_.at(k)++ == 0;
  }
  /// Tensor `i` (in bucket `k`) is released; true when its bucket holds no gathered tensor.
  bool release(std::size_t i, std::size_t k, const std::string& name) {
    if (!gathered_.at(i))
      throw std::logic_error("distopt::optimizer::release: '" + name + "' is not gathered (gather it first)");
    gathered_[i] = 0;
    return --refs_.at(k) == 0;
  }
  /// The first tensor gathered and not released, or -1.
  std::ptrdiff_t first_gathered() const noexcept {
    for (std::size_t i = 0; i < gathered_.size(); ++i)
      if (gathered_[i]) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }

 private:
  std::vector<char> gathered_;
  std::vector<std::size_t> refs_;
  std::vector<char> prefetched_;
};

/// Buffers of T in an executor's memory, lent and given back, and kept for reuse: ZeRO-2's
/// full-bucket grads and ZeRO-3's gathered params (bucket_pool below), ZeRO-Offload's
/// device grads and params per tensor (offload.hpp). A lend of n elements takes the
/// smallest free buffer that holds them and is at most twice their size; when none is
/// free, a buffer of exactly n is made. Buffers are kept: the pool's size is its peak, and
/// it grows only when a lend finds no such buffer free. Lends of one size (a transformer's
/// layers) share as many buffers as are lent at once, and a lend never holds a buffer more
/// than twice its size (a large one's, which would make the large one need another: best
/// fit alone did that, 1.5x the full params in the Fashion-MNIST MLP).
template <class T, class Exec>
class buffer_pool {
 public:
  /// A buffer of at least `n` elements. `fresh` is set when it was just made (zero-filled);
  /// a buffer lent before holds what its last user left.
  T* lend(Exec& exec, std::size_t n, bool& fresh) {
    fresh = false;
    if (auto it = free_.lower_bound(n); it != free_.end() && it->first <= 2 * n) {
      T* p = it->second;
      lent_.emplace(p, it->first);
      free_.erase(it);
      return p;
    }
    fresh = true;
    owned_.emplace_back(exec, n);
    bytes_ += owned_.back().bytes();
    lent_.emplace(owned_.back().data(), n);
    return owned_.back().data();
  }
  /// Returns a lent buffer (nothing for one this pool did not lend).
  void give_back(T* p) {
    const auto it = lent_.find(p);
    if (it == lent_.end()) return;
    free_.emplace(it->second, p);
    lent_.erase(it);
  }
  /// The elements of lent buffer `p` (0 for one this pool did not lend).
  std::size_t size_of(const T* p) const {
    const auto it = lent_.find(p);
    return it == lent_.end() ? 0 : it->second;
  }
  /// Bytes of the buffers the pool holds (lent or free): its peak.
  std::size_t bytes() const noexcept { return bytes_; }
  /// How many buffers it holds.
  std::size_t buffers() const noexcept { return owned_.size(); }

 private:
  std::vector<buffer<T, Exec>> owned_;  // the buffers (their memory does not move with them)
  std::multimap<std::size_t, T*> free_;  // elements -> a free buffer
  std::map<const T*, std::size_t> lent_;  // a lent buffer -> its elements
  std::size_t bytes_ = 0;
};

/// Full-bucket buffers of T, lent (buffer_pool) to buckets and returned when their
/// reduction is done (ZeRO-2's grads) or their params are released (ZeRO-3).
template <class T, class Exec>
class bucket_pool {
 public:
  bucket_pool() = default;
  /// One entry of `elems` per bucket: its elements.
  explicit bucket_pool(std::vector<std::size_t> elems)
      : held_(elems.size(), nullptr), reducing_(elems.size(), 0), elems_(std::move(elems)) {}

  /// Bucket `k`'s buffer, or null when it holds none.
  T* of(std::size_t k) const { return held_.at(k); }
  /// The bytes of bucket `k`'s buffer (0 when it holds none): a pooled buffer may be larger
  /// than the bucket (up to twice).
  std::size_t bytes_of(std::size_t k) const { return pool_.size_of(held_.at(k)) * sizeof(T); }

  /// Lends bucket `k` a buffer (the one it holds, if any). `dirty` is set when the
  /// buffer's contents may not be zeros (a returned one): the caller zeroes the bucket's
  /// elements.
  T* acquire(Exec& exec, std::size_t k, bool& dirty) {
    dirty = false;
    if (held_.at(k)) return held_[k];
    bool fresh = false;
    held_[k] = pool_.lend(exec, elems_[k], fresh);
    dirty = !fresh;
    return held_[k];
  }

  /// Returns bucket `k`'s buffer to the pool (nothing when it holds none).
  void release(std::size_t k) {
    reducing_.at(k) = 0;
    if (!held_[k]) return;
    pool_.give_back(std::exchange(held_[k], nullptr));
  }
  /// Bucket `k`'s buffer is the source of a reduction in flight: `finish` returns it.
  void reducing(std::size_t k) { reducing_.at(k) = 1; }
  /// The reduction of bucket `k` is done: its buffer goes back, if it was the source.
  void finish(std::size_t k) {
    if (k < reducing_.size() && reducing_[k]) release(k);
  }

  /// Bytes of the buffers the pool holds (lent or free): its peak.
  std::size_t bytes() const noexcept { return pool_.bytes(); }
  /// How many buffers it holds.
  std::size_t buffers() const noexcept { return pool_.buffers(); }

 private:
  buffer_pool<T, Exec> pool_;
  std::vector<T*> held_;
  std::vector<char> reducing_;
  std::vector<std::size_t> elems_;
};

}  // namespace distopt::detail
