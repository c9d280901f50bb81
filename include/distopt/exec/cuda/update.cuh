// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file The CUDA kernel family of the element-wise update phase: one fused pass over a
/// multi-tensor chunk list, instantiated per (policy, slot count, param mode, param, grad
/// and state number type) from the same per-element body the CPU executor runs
/// (detail::update_one), so strict builds (nvcc --fmad=false) give the CPU's bits.
///
/// An update_plan is built once from the pieces a rank updates (pointers into device
/// buffers, element counts, layout indices): each piece is cut into chunks, and every
/// chunk whose arrays are all 16-byte aligned and whose length is a multiple of the vector
/// width is marked for 16-byte vector loads and stores. The plan lives in device memory;
/// each step launches one kernel over all chunks (persistent blocks, grid-stride over the
/// chunks), with the step's scalars, gradient scale and random key as arguments.
/// Stochastic rounding draws its bits from the counter hash of (seed and step, layout
/// index), so results do not depend on the launch configuration.
///
/// Status: run on an H200 (2026-11-27, bench/RESULTS.md): bit-identical to the CPU
/// (tests/cuda/update_kernels.cu), clean under compute-sanitizer memcheck and racecheck.
/// The optimizer's own update phase on cuda (exec/cuda/phases.cuh) moves elements the same
/// way, from its piece table; this plan is the standalone family over user pointers.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../config.hpp"
#include "../../detail/update_loop.hpp"
#include "error.cuh"

/// `#pragma unroll` in the device pass only (the host compiler warns about it).
#if defined(__CUDA_ARCH__)
#define DISTOPT_CUDA_UNROLL _Pragma("unroll")
#else
#define DISTOPT_CUDA_UNROLL
#endif

namespace distopt::cuda_exec {
/// Kernel symbols live in an ABI-versioned inline namespace (and have hidden visibility,
/// DISTOPT_KERNEL), so two shared libraries built with different distopt versions do not
/// resolve each other's instantiations.
inline namespace abi_v0_1 {

/// One run of elements a rank updates: pointers to its first element in device memory
/// (params and grads in the full buffers, master and states in the shard buffers; unused
/// slots null) and the layout index of that element (keys stochastic rounding).
template <class Param, class Grad, class Enc>
struct piece {
  Param* param;
  const Grad* grad;
  float* master;
  Enc* state[4];
  std::size_t count;
  std::size_t random_base;
};

/// A piece's [offset, offset + count); `vector`: every array is 16-byte aligned at the
/// chunk's start and count is a multiple of the vector width.
struct chunk {
  std::uint32_t piece;
  std::uint32_t count;
  std::uint64_t offset;
  std::uint32_t vector;
};

/// Elements per thread and vector step: 8, so that 2-byte types load 16 bytes at once
/// and 4-byte types 2 x 16.
inline constexpr std::size_t vector_width = 8;

/// The first element (below vector_width) at which every array an update touches is
/// 16-byte aligned: params, grads, `master` unless null, `slots` state arrays; `n` when there
/// is none before n (arrays of 2- and 4-byte elements that are not aligned together within
/// 8 elements never are).
template <class Param, class Grad, class Enc>
DISTOPT_HD std::size_t vector_head(const Param* p, const Grad* g, const float* master, Enc* const* state,
                                   int slots, std::size_t n) {
  const auto at16 = [](const void* q) { return reinterpret_cast<std::uintptr_t>(q) % 16 == 0; };
  for (std::size_t e = 0; e < vector_width && e < n; ++e) {
    bool ok = at16(p + e) && at16(g + e) && (!master || at16(master + e));
    for (int k = 0; k < slots; ++k) ok = ok && at16(state[k] + e);
    if (ok) return e;
  }
  return n;
}

namespace detail_ {

/// Copies `Count` elements of T between memory and registers in 16-byte words.
template <class T, std::size_t Count>
DISTOPT_HD DISTOPT_INLINE void vector_copy(T* DISTOPT_RESTRICT dst, const T* DISTOPT_RESTRICT src) {
  static_assert(Count * sizeof(T) % 16 == 0, "a vector step must be whole 16-byte words");
  constexpr std::size_t words = Count * sizeof(T) / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4 w[words];
DISTOPT_CUDA_UNROLL
  for (std::size_t k = 0; k < words; ++k) w[k] = s[k];
  memcpy(static_cast<void*>(dst), w, sizeof(w));
}
template <class T, std::size_t Count>
DISTOPT_HD DISTOPT_INLINE void vector_store(T* DISTOPT_RESTRICT dst, const T* DISTOPT_RESTRICT src) {
  constexpr std::size_t words = Count * sizeof(T) / 16;
  uint4 w[words];
  memcpy(w, static_cast<const void*>(src), sizeof(w));
  uint4* d = reinterpret_cast<uint4*>(dst);
DISTOPT_CUDA_UNROLL
  for (std::size_t k = 0; k < words; ++k) d[k] = w[k];
}

/// A device copy of `v` (at least one element allocated), for the plans' lists.
template <class T>
void* upload(const std::vector<T>& v, const char* what) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(1, v.size()) * sizeof(T)), what);
  check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), what);
  return p;
}

/// The current device's multiprocessors.
inline int multiprocessors() {
  int device = 0, sms = 1;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms;
}

}  // namespace detail_

/// Thread blocks of 256 threads of `Kernel`, with `shared` bytes of dynamic shared memory
/// each (the same at every call), that one multiprocessor runs at once (asked of the device
/// current at the first call, once per kernel; at least 1). A grid-stride
/// ("persistent") kernel wants that many blocks a multiprocessor and no more: blocks beyond
/// it run in a later wave, and the last, partial wave leaves most of the chip idle. (On an
/// H200, 8 blocks a multiprocessor where 3 fit held the AdamW fp32 kernel at 0.87 of the
/// copy bandwidth; the resident grid runs it at 0.93.)
template <auto Kernel>
int resident_blocks(std::size_t shared = 0) {
  static const int per_sm = [shared] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, 256, shared) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());  // a failed query is not the launch's error
      return 1;
    }
    return b > 0 ? b : 1;
  }();
  return per_sm;
}

/// Lets `Kernel` take `shared` bytes of dynamic shared memory a block where that is above
/// the 48 KiB a launch gets by default: the attribute set once per device, at the first
/// launch there (a step's first launch precedes any graph capture of a later one), and
/// the same `shared` at every call.
template <auto Kernel>
void allow_shared(std::size_t shared) {
  if (shared <= 48 * 1024) return;
  static std::atomic<std::uint64_t> set{0};  // bit d: done on device d (d < 64)
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::uint64_t bit = device >= 0 && device < 64 ? std::uint64_t{1} << device : 0;
  if (bit != 0 && (set.load(std::memory_order_acquire) & bit) != 0) return;
  check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
        "cudaFuncSetAttribute (dynamic shared memory)");
  set.fetch_or(bit, std::memory_order_acq_rel);
}

/// The grid of a grid-stride kernel over `items` on `sms` multiprocessors: as many blocks
/// as run at once, at most one per item.
template <auto Kernel>
unsigned resident_grid(std::size_t items, int sms, std::size_t shared = 0) {
  return static_cast<unsigned>(
      std::min<std::size_t>(items, static_cast<std::size_t>(sms) * resident_blocks<Kernel>(shared)));
}

/// One vector step: elements [i0, i0 + vector_width) of every array loaded in 16-byte
/// words, updated in registers by detail::update_one (stochastic rounding keyed by base +
/// element), stored back the same way. Every array must be 16-byte aligned at i0.
template <class Policy, int N, distopt::detail::param_mode Mode, class Param, class Grad, class Enc>
__device__ DISTOPT_INLINE void vector_step(const typename Policy::scalars& s, Param* p, const Grad* g, float* m,
                                           Enc* const* st, std::size_t i0, float scale, std::uint64_t key,
                                           std::size_t base) {
  using distopt::detail::param_mode;
  constexpr std::size_t V = vector_width;
  constexpr bool uses_master = Mode == param_mode::master;
  Param rp[V];
  Grad rg[V];
  float rm[uses_master ? V : 1];
  Enc rs[N > 0 ? N : 1][V];
  // With master weights the params are only written (the master holds the value).
  if constexpr (!uses_master) detail_::vector_copy<Param, V>(rp, p + i0);
  detail_::vector_copy<Grad, V>(rg, g + i0);
  if constexpr (uses_master) detail_::vector_copy<float, V>(rm, m + i0);
DISTOPT_CUDA_UNROLL
  for (int k = 0; k < N; ++k) detail_::vector_copy<Enc, V>(rs[k], st[k] + i0);
  Enc* r0 = N > 0 ? rs[0] : nullptr;
  Enc* r1 = N > 1 ? rs[N > 1 ? 1 : 0] : nullptr;
  Enc* r2 = N > 2 ? rs[N > 2 ? 2 : 0] : nullptr;
  Enc* r3 = N > 3 ? rs[N > 3 ? 3 : 0] : nullptr;
DISTOPT_CUDA_UNROLL
  for (std::size_t j = 0; j < V; ++j)
    distopt::detail::update_one<Policy, N, Mode>(s, rp, rg, rm, r0, r1, r2, r3, j, scale, key, base + i0);
  detail_::vector_store<Param, V>(p + i0, rp);
  if constexpr (uses_master) detail_::vector_store<float, V>(m + i0, rm);
DISTOPT_CUDA_UNROLL
  for (int k = 0; k < N; ++k) detail_::vector_store<Enc, V>(st[k] + i0, rs[k]);
}

/// The fused update over every chunk of a plan: blocks take chunks in a grid-stride loop;
/// in a vector chunk each thread loads 8 consecutive elements of each array with 16-byte
/// loads into registers, updates them there and stores them back the same way.
template <class Policy, int N, distopt::detail::param_mode Mode, class Param, class Grad, class Enc>
DISTOPT_KERNEL void __launch_bounds__(256)
    update_kernel(const typename Policy::scalars s, const piece<Param, Grad, Enc>* __restrict__ pieces,
                  const chunk* __restrict__ chunks, std::size_t chunk_count, float scale, std::uint64_t key) {
  using distopt::detail::param_mode;
  using distopt::detail::update_one;
  constexpr std::size_t V = vector_width;
  constexpr bool uses_master = Mode == param_mode::master;
  for (std::size_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    const chunk ch = chunks[c];
    const piece<Param, Grad, Enc> pc = pieces[ch.piece];
    Param* p = pc.param + ch.offset;
    const Grad* g = pc.grad + ch.offset;
    float* m = uses_master ? pc.master + ch.offset : nullptr;
    Enc* st[4];
DISTOPT_CUDA_UNROLL
    for (int k = 0; k < 4; ++k) st[k] = k < N ? pc.state[k] + ch.offset : nullptr;
    const std::size_t base = pc.random_base + ch.offset;
    if (ch.vector) {
      for (std::size_t i0 = static_cast<std::size_t>(threadIdx.x) * V; i0 < ch.count;
           i0 += static_cast<std::size_t>(blockDim.x) * V)
        vector_step<Policy, N, Mode>(s, p, g, m, st, i0, scale, key, base);
    } else {
      for (std::size_t i = threadIdx.x; i < ch.count; i += blockDim.x)
        update_one<Policy, N, Mode>(s, p, g, m, st[0], st[1], st[2], st[3], i, scale, key, base);
    }
  }
}

/// The chunks of `pieces`, cut at most `chunk_elems` long: a piece whose arrays share
/// their misalignment gets a scalar head up to the first 16-byte boundary, vector chunks,
/// and a scalar tail; any other piece is scalar throughout. Host code, testable anywhere.
template <class Param, class Grad, class Enc>
std::vector<chunk> cut_chunks(const std::vector<piece<Param, Grad, Enc>>& pieces, int slots, bool master,
                              std::size_t chunk_elems = 1 << 15) {
  if (chunk_elems == 0 || chunk_elems % vector_width != 0 || chunk_elems > (std::size_t{1} << 31))
    throw std::invalid_argument("distopt cuda: chunk_elems must be a positive multiple of " +
                                std::to_string(vector_width) + " below 2^31, got " + std::to_string(chunk_elems));
  if (pieces.size() >= (std::size_t{1} << 32))
    throw std::invalid_argument("distopt cuda: more than 2^32 pieces in one plan");
  std::vector<chunk> out;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const auto& pc = pieces[k];
    const std::size_t head =
        vector_head(pc.param, pc.grad, master ? pc.master : nullptr, pc.state, slots, pc.count);
    const bool vectorisable = head < pc.count;
    const auto push = [&](std::size_t first, std::size_t n, bool vec) {
      for (std::size_t o = first; o < first + n; o += chunk_elems) {
        const std::size_t len = std::min(chunk_elems, first + n - o);
        out.push_back({static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(len), o, vec ? 1u : 0u});
      }
    };
    if (!vectorisable) {
      push(0, pc.count, false);
      continue;
    }
    const std::size_t body = (pc.count - head) / vector_width * vector_width;
    if (head) push(0, head, false);
    if (body) push(head, body, true);
    if (head + body < pc.count) push(head + body, pc.count - head - body, false);
  }
  return out;
}

/// A chunk list in device memory for one set of pieces, reused every step.
template <class Param, class Grad, class Enc>
class update_plan {
 public:
  update_plan() = default;
  /// Cuts `pieces` (slots state arrays each; master arrays when `master`) into chunks and
  /// copies both lists to the device.
  update_plan(const std::vector<piece<Param, Grad, Enc>>& pieces, int slots, bool master,
              std::size_t chunk_elems = 1 << 15) {
    if (slots < 0 || slots > 4) throw std::invalid_argument("distopt cuda: 0..4 state slots, got " + std::to_string(slots));
    const std::vector<chunk> chunks = cut_chunks(pieces, slots, master, chunk_elems);
    chunk_count_ = chunks.size();
    for (const auto& c : chunks) vector_elems_ += c.vector ? c.count : 0;
    for (const auto& p : pieces) elems_ += p.count;
    pieces_ = static_cast<piece<Param, Grad, Enc>*>(detail_::upload(pieces, "update plan"));
    chunks_ = static_cast<chunk*>(detail_::upload(chunks, "update plan"));
    sms_ = detail_::multiprocessors();
  }
  update_plan(const update_plan&) = delete;
  update_plan& operator=(const update_plan&) = delete;
  update_plan(update_plan&& o) noexcept { swap(o); }
  update_plan& operator=(update_plan&& o) noexcept {
    update_plan t(std::move(o));
    swap(t);
    return *this;
  }
  ~update_plan() {
    if (pieces_) cudaFree(pieces_);
    if (chunks_) cudaFree(chunks_);
  }

  std::size_t chunks() const noexcept { return chunk_count_; }
  std::size_t elements() const noexcept { return elems_; }
  /// Elements in vector chunks (16-byte loads).
  std::size_t vector_elements() const noexcept { return vector_elems_; }

  /// Enqueues one update of every element on `stream`: `Policy` with N state slots.
  template <class Policy, int N, distopt::detail::param_mode Mode>
  void run(const typename Policy::scalars& s, float grad_scale, std::uint64_t random_key,
           cudaStream_t stream = nullptr) const {
    if (chunk_count_ == 0) return;
    constexpr auto kernel = update_kernel<Policy, N, Mode, Param, Grad, Enc>;
    kernel<<<resident_grid<kernel>(chunk_count_, sms_), 256, 0, stream>>>(s, pieces_, chunks_, chunk_count_,
                                                                         grad_scale, random_key);
    check(cudaGetLastError(), "update_kernel launch");
  }

 private:
  void swap(update_plan& o) noexcept {
    std::swap(pieces_, o.pieces_);
    std::swap(chunks_, o.chunks_);
    std::swap(chunk_count_, o.chunk_count_);
    std::swap(elems_, o.elems_);
    std::swap(vector_elems_, o.vector_elems_);
    std::swap(sms_, o.sms_);
  }
  piece<Param, Grad, Enc>* pieces_ = nullptr;
  chunk* chunks_ = nullptr;
  std::size_t chunk_count_ = 0, elems_ = 0, vector_elems_ = 0;
  int sms_ = 1;
};

}  // namespace abi_v0_1
}  // namespace distopt::cuda_exec
