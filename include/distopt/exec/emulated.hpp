// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The emulated device executor: the CPU executor's threads and loops over memory the
/// host cannot touch outside a launch, a copy or a collective. It proves in CI, where there
/// is no GPU, that the optimizer reaches its buffers only as a device backend may: a stray
/// host access compiles nowhere (its views are device_spans) and faults at run time (its
/// memory is mapped PROT_NONE between launches). Linux (mmap/mprotect) only.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "cpu.hpp"

namespace distopt {

namespace detail {

/// Every arena of every emulated_device in the process. They are readable and writable
/// while at least one launch, copy or collective on any of them is in flight, and mapped
/// PROT_NONE otherwise. One count for the process, because ranks as threads share it: a
/// collective of one rank reads another's memory. With one rank the check is exact; with
/// several, host code of one rank that runs while another rank's launch is in flight is
/// not caught.
class device_arenas {
 public:
  static device_arenas& instance();
  void* allocate(std::size_t bytes);
  void release(void* p) noexcept;
  /// Opens every arena to the host (counted).
  void open();
  /// Closes them again when the last opener closes.
  void close() noexcept;
  /// Launches, copies and collectives in flight.
  int opened() const;
  /// True when the `bytes` from `p` on lie inside one arena (a null `p` with no bytes too):
  /// what a communicator of device memory may be handed.
  bool contains(const void* p, std::size_t bytes) const;
  /// Counts one copy of `n` bytes (copy_bytes); one whose host side (dst or src outside
  /// the arenas) lies outside every registered range counts as pageable too.
  void count_copy(void* dst, const void* src, std::size_t n);
  /// Copies so far, in the whole process: what a GPU's host thread would wait for.
  std::size_t copies() const noexcept { return copies_.load(std::memory_order_relaxed); }
  /// Copies so far whose host memory was not registered: on a GPU, copies through the
  /// driver's staging buffer.
  std::size_t pageable_copies() const noexcept { return pageable_.load(std::memory_order_relaxed); }
  /// Host memory registered as page-locked (emulated_device::register_host): [p, p + bytes).
  /// A range that overlaps a registered one is refused, as cudaHostRegister refuses it.
  void register_host(void* p, std::size_t bytes);
  void unregister_host(void* p) noexcept;
  /// Bytes registered now, in the whole process.
  std::size_t registered_bytes() const;

 private:
  std::size_t rounded(std::size_t bytes) const noexcept {
    return (std::max<std::size_t>(bytes, 1) + page_ - 1) / page_ * page_;
  }
  void protect_all(int prot) noexcept;
  mutable std::mutex m_;
  // start -> mapped bytes, by address: protect_all changes runs of adjacent arenas in one
  // call each (mmap places them next to each other mostly; a launch on a context of 1,500
  // arenas made as many mprotect calls, a second of system time per thousand launches).
  std::map<std::byte*, std::size_t> arenas_;
  int open_ = 0;
  std::atomic<std::size_t> copies_{0}, pageable_{0};
  std::map<const std::byte*, std::size_t> registered_;  // start -> bytes
  std::size_t page_ = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
};

#if DISTOPT_CORE_BODIES
DISTOPT_CORE_FN device_arenas& device_arenas::instance() {
  static device_arenas arenas;
  return arenas;
}

DISTOPT_CORE_FN void* device_arenas::allocate(std::size_t bytes) {
  const std::lock_guard<std::mutex> lock(m_);
  const std::size_t n = rounded(bytes);
  void* p = ::mmap(nullptr, n, open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();  // anonymous pages are zero-filled
  try {
    arenas_.emplace(static_cast<std::byte*>(p), n);
  } catch (...) {
    ::munmap(p, n);
    throw;
  }
  return p;
}

DISTOPT_CORE_FN void device_arenas::release(void* p) noexcept {
  const std::lock_guard<std::mutex> lock(m_);
  const auto it = arenas_.find(static_cast<std::byte*>(p));
  if (it == arenas_.end()) return;
  ::munmap(it->first, it->second);
  arenas_.erase(it);
}

DISTOPT_CORE_FN void device_arenas::open() {
  const std::lock_guard<std::mutex> lock(m_);
  if (open_++ == 0) protect_all(PROT_READ | PROT_WRITE);
}

DISTOPT_CORE_FN void device_arenas::close() noexcept {
  const std::lock_guard<std::mutex> lock(m_);
  if (--open_ == 0) protect_all(PROT_NONE);
}

DISTOPT_CORE_FN int device_arenas::opened() const {
  const std::lock_guard<std::mutex> lock(m_);
  return open_;
}

DISTOPT_CORE_FN bool device_arenas::contains(const void* p, std::size_t bytes) const {
  if (bytes == 0) return true;
  auto* b = static_cast<std::byte*>(const_cast<void*>(p));
  const std::lock_guard<std::mutex> lock(m_);
  const auto it = arenas_.upper_bound(b);  // the last arena starting at or before b
  return it != arenas_.begin() && std::less_equal<>{}(b + bytes, std::prev(it)->first + std::prev(it)->second);
}

DISTOPT_CORE_FN void device_arenas::count_copy(void* dst, const void* src, std::size_t n) {
  copies_.fetch_add(1, std::memory_order_relaxed);
  if (n == 0) return;
  const auto in_arena = [&](const void* p) { return contains(p, n); };
  const void* host = !in_arena(dst) ? dst : !in_arena(src) ? src : nullptr;
  if (!host) return;  // device to device
  const auto* b = static_cast<const std::byte*>(host);
  const std::lock_guard<std::mutex> lock(m_);
  auto it = registered_.upper_bound(b);  // the last range starting at or before b
  const bool pinned = it != registered_.begin() && std::less_equal<>{}(b + n, std::prev(it)->first + std::prev(it)->second);
  if (!pinned) pageable_.fetch_add(1, std::memory_order_relaxed);
}

DISTOPT_CORE_FN void device_arenas::register_host(void* p, std::size_t bytes) {
  if (!p || bytes == 0) return;
  const auto* b = static_cast<const std::byte*>(p);
  const std::lock_guard<std::mutex> lock(m_);
  const auto next = registered_.lower_bound(b);
  const bool overlaps_next = next != registered_.end() && std::less<>{}(next->first, b + bytes);
  const bool overlaps_prev = next != registered_.begin() && std::less<>{}(b, std::prev(next)->first + std::prev(next)->second);
  if (overlaps_next || overlaps_prev)
    throw std::invalid_argument("distopt::emulated_device::register_host: the range overlaps host memory registered already");
  registered_.emplace(b, bytes);
}

DISTOPT_CORE_FN void device_arenas::unregister_host(void* p) noexcept {
  const std::lock_guard<std::mutex> lock(m_);
  registered_.erase(static_cast<const std::byte*>(p));
}

DISTOPT_CORE_FN std::size_t device_arenas::registered_bytes() const {
  const std::lock_guard<std::mutex> lock(m_);
  std::size_t n = 0;
  for (const auto& r : registered_) n += r.second;
  return n;
}

DISTOPT_CORE_FN void device_arenas::protect_all(int prot) noexcept {
  const auto protect = [prot](std::byte* p, std::size_t n) {
    if (::mprotect(p, n, prot) != 0) {  // only when the kernel runs out of mappings
      std::perror("distopt::emulated_device: mprotect");
      std::abort();
    }
  };
  // A run of arenas each starting where the last ends: one call (a freed arena between two
  // is unmapped and breaks the run, so it stays unreachable).
  std::byte* run = nullptr;
  std::size_t length = 0;
  for (const auto& [p, n] : arenas_) {
    if (run && run + length == p) {
      length += n;
      continue;
    }
    if (run) protect(run, length);
    run = p;
    length = n;
  }
  if (run) protect(run, length);
}
#endif  // DISTOPT_CORE_BODIES

/// The emulated device's copies beside its launches (copies_async), either way, for the
/// whole process as one copy stream: a copy is made only when it is waited for (it or a
/// later one), writing its destination then, so that code that reads the destination too
/// early gets the wrong bytes and the tests see it. Its source is read at the start too, and
/// a wait that finds the source changed since throws: code that writes the source before
/// the copy is done (a host update of a bucket being copied, a device buffer reused) is
/// caught however the timing of a real device would have hidden it.
class emulated_copies {
 public:
  static emulated_copies& instance() {
    static emulated_copies copies;
    return copies;
  }
  std::uint64_t enqueue(void* dst, const void* src, std::size_t n) {
    device_arenas::instance().count_copy(dst, src, n);
    copy c{0, dst, src, n, std::vector<unsigned char>(n)};
    {
      const arenas_open open;
      if (n) std::memcpy(c.started.data(), src, n);
    }
    const std::lock_guard<std::mutex> lock(m_);
    c.ticket = ++issued_;
    pending_.push_back(std::move(c));
    return issued_;
  }
  /// Makes copy `t` and those before it. Throws std::logic_error, after making them, if a
  /// source changed while its copy was in flight.
  void wait(std::uint64_t t) {
    const std::lock_guard<std::mutex> lock(m_);
    std::string raced;
    while (!pending_.empty() && pending_.front().ticket <= t) {
      const copy c = std::move(pending_.front());
      pending_.erase(pending_.begin());
      const arenas_open open;
      if (c.n && std::memcmp(c.started.data(), c.src, c.n) != 0 && raced.empty())
        raced = "distopt::emulated_device: the source of asynchronous copy " + std::to_string(c.ticket) + " (" +
                std::to_string(c.n) + " bytes) was written while the copy was in flight";
      if (c.n) std::memcpy(c.dst, c.src, c.n);
    }
    if (!raced.empty()) throw std::logic_error(raced);
  }
  /// Copies enqueued and not yet made, in the whole process.
  std::size_t in_flight() const {
    const std::lock_guard<std::mutex> lock(m_);
    return pending_.size();
  }

 private:
  struct arenas_open {  // the device memory open to the host while it lives
    arenas_open() { device_arenas::instance().open(); }
    ~arenas_open() { device_arenas::instance().close(); }
    arenas_open(const arenas_open&) = delete;
    arenas_open& operator=(const arenas_open&) = delete;
  };
  struct copy {
    std::uint64_t ticket;
    void* dst;
    const void* src;
    std::size_t n;
    std::vector<unsigned char> started;  // the source's bytes when the copy started
  };
  mutable std::mutex m_;
  std::vector<copy> pending_;
  std::uint64_t issued_ = 0;
};

}  // namespace detail

/// The emulated device: `threads` host threads run its launches, as the CPU executor's,
/// and its memory is open to the host only inside a launch, a copy_bytes, or while an
/// access_scope lives (what a collective on device memory holds). Results are the CPU
/// executor's, bit for bit.
class emulated_device {
 public:
  using executor_concept = executor_tag;
  using memory_space = device_space;

  /// Keeps the device memory open to the host while it lives: a collective in flight.
  class access_scope {
   public:
    access_scope() { detail::device_arenas::instance().open(); }
    access_scope(const access_scope&) = delete;
    access_scope& operator=(const access_scope&) = delete;
    access_scope(access_scope&& o) noexcept : live_(std::exchange(o.live_, false)) {}
    access_scope& operator=(access_scope&& o) noexcept {
      if (this != &o) {
        end();
        live_ = std::exchange(o.live_, false);
      }
      return *this;
    }
    ~access_scope() { end(); }

   private:
    void end() noexcept {
      if (std::exchange(live_, false)) detail::device_arenas::instance().close();
    }
    bool live_ = true;
  };

  /// `threads` worker threads (including the caller's); 0 means one per hardware thread.
  explicit emulated_device(int threads = 1) : host_(threads) {}

  int concurrency() const noexcept { return host_.concurrency(); }

  /// Zero-filled device memory (whole pages).
  void* allocate_bytes(std::size_t bytes) { return detail::device_arenas::instance().allocate(bytes); }
  void deallocate_bytes(void* p, std::size_t) noexcept { detail::device_arenas::instance().release(p); }

  /// Calls f(i) once for each i in [0, n), with the device memory open.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    const access_scope open;
    host_.parallel_for(n, std::forward<F>(f));
  }

  /// Runs a phase (distopt/engine/phases.hpp; detail::launch calls it) as a device kernel
  /// does: the phase taken by value, and each item's elements one call per element, last
  /// first, so that the element offsets a device thread passes are exercised here too and
  /// no order within an item is assumed. Items are spread over the threads.
  template <class Phase>
  void launch(std::size_t items, Phase p) {
    const access_scope open;
    host_.parallel_for(items, [&p](std::size_t c) {
      for (std::size_t i = p.size(c); i-- > 0;) p(c, i, i + 1);
    });
  }

  /// Copies n bytes between host and device memory (either direction, or device to device).
  void copy_bytes(void* dst, const void* src, std::size_t n) {
    detail::device_arenas::instance().count_copy(dst, src, n);
    const access_scope open;
    if (n) std::memcpy(dst, src, n);
  }

  /// Copies n bytes between device and host memory, either way, beside the launches
  /// (copies_async): the copy is made when copy_wait waits for it, and the wait throws if
  /// its source was written meanwhile (detail::emulated_copies).
  std::uint64_t copy_async(void* dst, const void* src, std::size_t n) {
    return detail::emulated_copies::instance().enqueue(dst, src, n);
  }
  void copy_wait(std::uint64_t ticket) { detail::emulated_copies::instance().wait(ticket); }

  /// Registers host memory as page-locked, as cuda does (see registers_host_memory): here
  /// only recorded, so that tests can count the copies that would go through a staging
  /// buffer on a GPU (device_arenas::pageable_copies).
  void register_host(void* p, std::size_t bytes) { detail::device_arenas::instance().register_host(p, bytes); }
  void unregister_host(void* p) noexcept { detail::device_arenas::instance().unregister_host(p); }

  /// Opens the device memory until the returned scope ends.
  access_scope open_memory() { return access_scope(); }

 private:
  cpu host_;
};

}  // namespace distopt
