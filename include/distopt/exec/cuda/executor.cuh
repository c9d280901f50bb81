// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file distopt::cuda, the CUDA executor: device memory allocated on a stream, and the
/// step's phases (distopt/engine/phases.hpp) launched as kernels on that stream, from the
/// same `DISTOPT_HD` bodies the CPU executor loops over. Built with nvcc in strict mode
/// (--fmad=false, the distopt::cuda target) its results are the CPU executor's, bit for bit.
///
/// What runs on it today: the element-wise policies (sgd, adam, adamw, lion, custom ones)
/// with fp32, bf16 or q8 states, replicated or sharded; fp32, bf16 and fp16 params, master
/// weights or stochastic rounding, the exact global norm, clipping, percentile clipping,
/// loss scaling and the NaN/Inf skip; host communicators (single, threads, mpi, any_comm),
/// whose collectives the optimizer stages through host memory, and nccl on this executor's
/// device and stream, handed the device buffers in place. The layer-wise policies
/// (lamb, adafactor, came) run their element passes here, a thread block per work item
/// (layer_phase.cuh), their items' sums merged here too (layer_merge_kernel), and the
/// policies' hooks on the host between passes (engine/layerwise.hpp). GaLore runs its
/// scaling, low-rank Adam and update as phases here and its products and SVD on cuBLAS and
/// cuSOLVER (matrix_ops.cuh, distopt::cuda_galore; within rounding of the CPU). The
/// element-wise step is decided on the device (engine/decisions.hpp): with `single` it
/// makes no copy and no synchronisation, and a CUDA graph can capture it. The element
/// update, the 8-bit update, the exact norm and the layer-wise passes and merges have
/// kernels of their own (phases.cuh, layer_phase.cuh); every other phase runs through
/// phase_kernel. Run on H200s (2026-11-27 and 28): bit-identical to `cpu` in tests/cuda,
/// the figures in bench/RESULTS.md. Copies to and from the host can run beside the stream
/// (copy_async, on a copy stream per device: ZeRO-Offload's grads and params).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../concepts.hpp"
#include "../../config.hpp"
#include "../../space.hpp"
#include "error.cuh"
#include "layer_phase.cuh"
#include "phases.cuh"

namespace distopt {

namespace cuda_exec {
inline namespace abi_v0_1 {

/// f(i) for every i in [0, n), grid-stride.
template <class F>
DISTOPT_KERNEL void __launch_bounds__(256) index_kernel(const F f, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

/// A phase: blocks take items grid-stride, and the threads of a block take an item's
/// elements one each (consecutive threads, consecutive elements: coalesced).
/// (Measured on an H200, 2026-11-27: runs of 4 or 8 consecutive elements a thread, through
/// the phase's body and its scalar loads, were 1.1x and 1.9x slower for the update than one;
/// the update's own kernel takes 8 with 16-byte loads.)
template <class Phase>
DISTOPT_KERNEL void __launch_bounds__(256) phase_kernel(const Phase p, std::size_t items) {
  for (std::size_t c = blockIdx.x; c < items; c += gridDim.x) {
    const std::size_t n = p.size(c);
    for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) p(c, i, i + 1);
  }
}

/// Makes `device` current while it lives, and restores the caller's device after (-1:
/// leaves the current device as it is).
class device_guard {
 public:
  explicit device_guard(int device) {
    if (device < 0) return;
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

/// The copies to and from the host that run beside a device's streams (cuda::copy_async),
/// for the current device: one non-blocking copy stream, and the completion events of the
/// copies in flight, in order. Made at the first such copy on a device and kept for the
/// process's life (never destroyed: a stream outliving the driver's teardown is harmless,
/// one destroyed after it is not).
class side_copies {
 public:
  static side_copies& current() {
    static std::mutex m;
    static std::map<int, side_copies*> of;
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    const std::lock_guard<std::mutex> lock(m);
    side_copies*& q = of[device];
    if (!q) q = new side_copies();
    return *q;
  }
  /// Copies n bytes after everything enqueued on `after` so far; returns the ticket.
  std::uint64_t enqueue(void* dst, const void* src, std::size_t n, cudaStream_t after) {
    const std::lock_guard<std::mutex> lock(m_);
    cudaEvent_t before = take();
    check(cudaEventRecord(before, after), "cudaEventRecord (before an asynchronous copy)");
    check(cudaStreamWaitEvent(side_, before, 0), "cudaStreamWaitEvent (copy stream)");
    spare_.push_back(before);  // the wait has taken its state: reusable at once
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, side_), "cudaMemcpyAsync (asynchronous copy)");
    cudaEvent_t done = take();
    check(cudaEventRecord(done, side_), "cudaEventRecord (after an asynchronous copy)");
    pending_.push_back({++issued_, done});
    return issued_;
  }
  void wait(std::uint64_t t) {
    const std::lock_guard<std::mutex> lock(m_);
    while (finished_ < t && !pending_.empty()) {
      check(cudaEventSynchronize(pending_.front().second), "cudaEventSynchronize (an asynchronous copy)");
      pop();
    }
  }

 private:
  side_copies() { check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate (copy stream)"); }
  cudaEvent_t take() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }
  void pop() {
    finished_ = pending_.front().first;
    spare_.push_back(pending_.front().second);
    pending_.pop_front();
  }
  std::mutex m_;
  cudaStream_t side_ = nullptr;
  std::deque<std::pair<std::uint64_t, cudaEvent_t>> pending_;
  std::vector<cudaEvent_t> spare_;
  std::uint64_t issued_ = 0, finished_ = 0;
};

}  // namespace abi_v0_1
}  // namespace cuda_exec

/// The CUDA executor: one device and one stream (the caller's). Every allocation, copy
/// and kernel of the optimizer is ordered on that stream, so a training code that writes
/// grads on the same stream needs no synchronisation of its own. A cheap handle: copies
/// share the device and the stream.
class cuda {
 public:
  using executor_concept = executor_tag;
  using memory_space = device_space;
  /// Runs device code only: phases and device-callable functions.
  static constexpr bool runs_host_functions = false;

  /// Whichever device is current at each call, and the legacy default stream. Touches no
  /// device: an empty buffer holds one of these. Allocate, step and destroy an optimizer on
  /// it with the same device current.
  cuda() noexcept = default;
  /// `device` (-1: whichever is current at each call) and `stream` (null: the legacy default
  /// stream, cudaStreamLegacy, also under nvcc --default-stream per-thread, so that an
  /// optimizer made on one host thread and stepped on another stays ordered). Both are
  /// needed: a lone int would read as a thread count in code generic over executors. The
  /// stream must outlive every optimizer on it: they free their memory on it.
  cuda(int device, cudaStream_t stream) : device_(device), stream_(stream ? stream : cudaStreamLegacy) {
    if (device_ >= 0) {
      int count = 0;
      cuda_exec::check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
      if (device_ >= count)
        throw std::invalid_argument("distopt::cuda: no CUDA device " + std::to_string(device_) + " (there are " +
                                    std::to_string(count) + ")");
    }
  }

  /// The device (-1: the current one at each call) and the stream.
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  /// Work items worth making: 8 per multiprocessor (the reductions group pieces by it).
  int concurrency() const noexcept { return multiprocessors() * 8; }

  /// Zero-filled device memory, allocated in stream order (cudaMallocAsync).
  void* allocate_bytes(std::size_t bytes) {
    const cuda_exec::device_guard on(device_);
    void* p = nullptr;
    const std::size_t n = bytes ? bytes : 1;
    cuda_exec::check(cudaMallocAsync(&p, n, stream_), "cudaMallocAsync");
    cuda_exec::check(cudaMemsetAsync(p, 0, n, stream_), "cudaMemsetAsync");
    return p;
  }
  void deallocate_bytes(void* p, std::size_t) noexcept {
    if (!p) return;
    int previous = -1;
    const bool switch_device = device_ >= 0 && cudaGetDevice(&previous) == cudaSuccess && previous != device_;
    if (switch_device) cudaSetDevice(device_);
    cudaFreeAsync(p, stream_);
    if (switch_device) cudaSetDevice(previous);
  }

  /// Copies n bytes (host to device, device to host, or device to device) in stream order,
  /// and waits for it: the host may read or reuse its side at once.
  void copy_bytes(void* dst, const void* src, std::size_t n) {
    if (n == 0) return;
    const cuda_exec::device_guard on(device_);
    cuda_exec::check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    cuda_exec::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after a copy");
  }

  /// Copies n bytes between device and host memory (either way) on the device's copy
  /// stream, after everything enqueued on this executor's stream so far, without waiting
  /// (copies_async): the stream goes on with the next kernels meanwhile, and none of them
  /// may read `dst` or write `src` before copy_wait. The host side should be page-locked
  /// (register_host): from pageable memory the driver copies synchronously.
  std::uint64_t copy_async(void* dst, const void* src, std::size_t n) {
    const cuda_exec::device_guard on(device_);
    return cuda_exec::side_copies::current().enqueue(dst, src, n, stream_);
  }
  /// Waits for copy `ticket` and those before it on this device.
  void copy_wait(std::uint64_t ticket) {
    const cuda_exec::device_guard on(device_);
    cuda_exec::side_copies::current().wait(ticket);
  }

  /// Page-locks `bytes` of host memory from `p` (cudaHostRegister), so that copies to and
  /// from it run at the link's speed rather than through the driver's staging buffer;
  /// until unregister_host(p). Registering takes time (the pages are locked one by one) and
  /// locked memory is the host's to spare: ZeRO-Offload registers the host buffers it copies.
  void register_host(void* p, std::size_t bytes) {
    if (!p || bytes == 0) return;
    const cuda_exec::device_guard on(device_);
    cuda_exec::check(cudaHostRegister(p, bytes, cudaHostRegisterPortable), "cudaHostRegister");
  }
  void unregister_host(void* p) noexcept {
    if (p) cudaHostUnregister(p);
  }

  /// Calls f(i) for each i in [0, n) on the device: f must be trivially copyable and
  /// callable in device code (a DISTOPT_HD functor; a host lambda does not compile).
  template <class F>
  void parallel_for(std::size_t n, const F& f) {
    static_assert(std::is_trivially_copyable_v<F>, "distopt::cuda::parallel_for: f is a kernel argument");
    if (n == 0) return;
    const cuda_exec::device_guard on(device_);
    constexpr auto kernel = cuda_exec::index_kernel<F>;
    kernel<<<cuda_exec::resident_grid<kernel>((n + 255) / 256, multiprocessors()), 256, 0, stream_>>>(f, n);
    cuda_exec::check(cudaGetLastError(), "distopt::cuda::parallel_for launch");
  }

  /// Runs a phase over `items` work items (detail::launch calls it): a block per item.
  template <class Phase>
  void launch(std::size_t items, const Phase& p) {
    run<cuda_exec::phase_kernel<Phase>>(items, p, "distopt::cuda phase launch");
  }
  /// The phases with kernels of their own (exec/cuda/phases.cuh): the element update, 8
  /// elements a thread in 16-byte words; the 8-bit update, a warp per quantization block;
  /// the exact norm's squares, a half-warp per layout block, and the items' sums, one block.
  template <class Policy, int N, detail::param_mode Mode, class Param, class Grad, class Enc>
  void launch(std::size_t items, const detail::update_phase<Policy, N, Mode, Param, Grad, Enc>& p) {
    run<cuda_exec::update_phase_kernel<Policy, N, Mode, Param, Grad, Enc>>(items, p, "distopt::cuda update launch");
  }
  template <class Policy, int N, detail::param_mode Mode, class Param, class Grad>
  void launch(std::size_t items, const detail::q8_update_phase<Policy, N, Mode, Param, Grad>& p) {
    run<cuda_exec::q8_update_phase_kernel<Policy, N, Mode, Param, Grad>>(items, p, "distopt::cuda 8-bit update launch",
                                                                          cuda_exec::q8_shared_bytes<N>);
  }
  template <class G>
  void launch(std::size_t items, const detail::squares_phase<G>& p) {
    run<cuda_exec::squares_kernel<G>>(items, p, "distopt::cuda squares launch");
  }
  /// A layer-wise phase's element pass (layer_phase.cuh): a block per work item.
  template <class Policy, int P, detail::param_mode Mode, class Param, class Grad, class State>
  void launch(std::size_t items, const detail::layer_phase_body<Policy, P, Mode, Param, Grad, State>& p) {
    const cuda_exec::device_guard on(device_);
    cuda_exec::launch_layer_phase(p, items, multiprocessors(), stream_);
  }
  /// The merge of a layer-wise phase's sums (layer_phase.cuh): blocks per tensor.
  template <class Policy, int P>
  void launch(std::size_t items, const detail::layer_merge_phase<Policy, P>& p) {
    const cuda_exec::device_guard on(device_);
    cuda_exec::launch_layer_merge(p, items, multiprocessors(), stream_);
  }
  void launch(std::size_t items, const detail::norm_wire_phase& p) {
    if (items == 0) return;
    const cuda_exec::device_guard on(device_);
    cuda_exec::norm_wire_kernel<><<<1, 1024, 0, stream_>>>(p);
    cuda_exec::check(cudaGetLastError(), "distopt::cuda norm launch");
  }

  /// Waits for everything enqueued on the stream.
  void synchronize() {
    const cuda_exec::device_guard on(device_);
    cuda_exec::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  /// Launches grid-stride kernel `Kernel(p, items)` with the blocks of 256 threads that fit
  /// on the device at once (cuda_exec::resident_grid), at most one per item; `shared`:
  /// bytes of dynamic shared memory a block.
  template <auto Kernel, class Phase>
  void run(std::size_t items, const Phase& p, const char* what, std::size_t shared = 0) {
    if (items == 0) return;
    const cuda_exec::device_guard on(device_);
    cuda_exec::allow_shared<Kernel>(shared);
    Kernel<<<cuda_exec::resident_grid<Kernel>(items, multiprocessors(), shared), 256, shared, stream_>>>(p, items);
    cuda_exec::check(cudaGetLastError(), what);
  }

  /// The device's multiprocessors (1 if it cannot be asked).
  int multiprocessors() const noexcept {
    int device = device_, sms = 0;
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return 1;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1) return 1;
    return sms;
  }

  int device_ = -1;
  cudaStream_t stream_ = cudaStreamLegacy;
};

}  // namespace distopt
