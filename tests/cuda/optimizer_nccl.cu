// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// optimizer<..., nccl, cuda>: a communicator of device memory on the executor's stream.
// The buckets' collectives get the executor's memory in place, and the host-side wires
// (the layout check, the norm and statistics wires, percentile clipping) go through the
// optimizer's device scratch. Against optimizer<..., cpu> bit for bit, with sharded states:
//  - one GPU: one rank (AdamW clipped inside the step, decided on the device; AdamW with
//    clipping and percentile clipping; CAME with bf16 params and fp32 master weights), and
//    an executor on another stream than the communicator's, refused at construction. One
//    rank makes no collective (the optimizer skips them): plumbing only;
//  - two or more GPUs: d = 2..4 ranks, one per GPU, threads of this process. Rank 0 writes
//    the global grads and the others zeros, so that a sum in NCCL's order (not the ranks')
//    is exact: NCCL does not give the same bits for every d otherwise.
// Without a CUDA device the program exits 77 (ctest: skipped). The emulated twin that CI
// runs is tests/unit/emulated_comm.cpp (device_threads on the emulated device).

#include "check_cases.hpp"

#include <distopt/comm/nccl.hpp>

#include "../unit/layerwise_cases.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace distopt;
using namespace cuda_check;

/// d ranks, one per GPU 0..d-1, each a thread with its optimizer on its communicator's
/// stream: what rank 0 sees and every rank's shard.
template <class Policy, class Enc, class Prec>
harness::outcome run_nccl(int d, const layout& l, const std::vector<typename Policy::hyper_params>& h,
                          harness::run_options ro) {
  using opt_t = optimizer<Policy, sharded<Enc>, nccl, cuda, Prec>;
  ro.options.grad_reduce = reduce_op::sum;
  harness::outcome out = harness::blank<opt_t>(l, Policy::state_slots(h.front()));
  std::vector<int> devices(static_cast<std::size_t>(d));
  std::iota(devices.begin(), devices.end(), 0);
  std::vector<nccl> group = nccl::init_all(devices);
  std::vector<std::thread> ranks;
  for (nccl& c : group)
    ranks.emplace_back([&, &c = c] {
      const int rank = c.rank();
      try {
        cuda_exec::check(cudaSetDevice(c.device()), "cudaSetDevice");
        const cuda exec(c.device(), c.stream());
        opt_t opt(l, h, ro.options, exec, std::move(c));
        harness::drive(opt, rank, ro, rank == 0 ? &out : nullptr);
        harness::collect(opt, rank, out);  // disjoint elements
      } catch (const std::exception& e) {
        // The other ranks may now wait inside NCCL forever: report and leave at once.
        std::fprintf(stderr, "FAILED with an exception on rank %d: %s\n", rank, e.what());
        std::_Exit(1);
      }
    });
  for (std::thread& t : ranks) t.join();
  return out;
}

/// On each layout: cpu on one rank against nccl on d = 1 and, where there are that many
/// GPUs, d = 2..4.
template <class Policy, class Enc, class Prec>
void check_nccl(const std::string& what, int gpus, const std::vector<typename Policy::hyper_params>& h,
                harness::run_options ro, dtype t = dtype::f32,
                const std::vector<harness::layout_case>& layouts = harness::awkward_layouts()) {
  for (const harness::layout_case& c : layouts) {
    ro.options.bucket_elems = c.bucket;
    const layout l = harness::make_layout(c, t, static_cast<int>(h.size()));
    const harness::outcome ref = harness::run_single<Policy, Enc, Prec, cpu>(l, h, ro);
    for (int d = 1; d <= std::min(gpus, 4); ++d)
      compare(what + ", layout " + c.name + ", nccl d=" + std::to_string(d), run_nccl<Policy, Enc, Prec>(d, l, h, ro),
              ref);
  }
}

/// The communicator on one stream, the executor on another: refused at construction.
void another_stream_is_refused() {
  ++checks;
  layout l;
  l.add("w", {10, 3}, dtype::f32);
  cudaStream_t other;
  cuda_exec::check(cudaStreamCreate(&other), "cudaStreamCreate");
  std::vector<nccl> group = nccl::init_all(std::vector<int>{0});
  std::string error;
  try {
    optimizer<adamw, sharded<fp32>, nccl, cuda> opt(l, adamw::hyper_params{}, {}, cuda(0, other), std::move(group[0]));
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  cuda_exec::check(cudaStreamDestroy(other), "cudaStreamDestroy");
  const std::string want =
      "distopt::optimizer: the communicator enqueues its collectives on another stream or device than the "
      "executor's kernels; give both the same device and stream";
  if (error != want) {
    ++failures;
    std::printf("FAILED: an executor on another stream: got \"%s\"\n", error.c_str());
  }
}

}  // namespace

int main() {
  skip_without_device("optimizer<..., nccl, cuda>");
  int gpus = 0;
  cuda_exec::check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  try {
    adamw::hyper_params h;
    h.lr = 1e-2;
    harness::run_options inside;
    inside.options.max_grad_norm = 1.0;
    check_nccl<adamw, fp32, precision<float>>("adamw clipped inside the step", gpus, {h}, inside);
    harness::run_options clipped;
    clipped.clip = 1.0;
    clipped.options.percentile_clipping = 5;
    check_nccl<adamw, fp32, precision<float>>("adamw clipped, percentile clipping", gpus, {h}, clipped);
    check_nccl<came, fp32, precision<bf16, bf16>>("came, bf16 params with master", gpus, {harness::came_case()},
                                                  harness::run_options{}, dtype::bf16, harness::layerwise_layouts());
    another_stream_is_refused();
  } catch (const std::exception& e) {
    std::printf("FAILED with an exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d optimizer runs on nccl and cuda (%d GPUs) equal to cpu bit for bit\n", checks - failures,
              checks, gpus);
  return failures == 0 ? 0 : 1;
}
