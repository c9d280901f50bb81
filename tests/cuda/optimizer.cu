// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// optimizer<..., distopt::cuda> against optimizer<..., distopt::cpu>, bit for bit (strict
// build, --fmad=false): params, master weights, states, norms and skipped steps after 20
// steps of the element-wise policies (fp32, bf16 and 8-bit states) on the awkward layouts of the unit suites (the same
// harness, sharded_harness.hpp, writing and reading through distopt::upload/download), on
// one rank and on d = 1..4 ranks as threads sharing the GPU (sharded states, collectives
// staged through host memory). ZeRO-Offload (offload<cuda>: the states on the host, at
// ZeRO-1 and 2; its host buffers page-locked). And a
// step captured into a CUDA graph, replayed.
// Without a CUDA device the program exits 77 (ctest: skipped).

#include "check_cases.hpp"

#include <distopt/offload.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace distopt;
using namespace cuda_check;
using harness::run_options;

/// offload<cuda> page-locks the host buffers each step copies whole (ZeRO-1: params and
/// grads) for the optimizer's life: the driver reports them as registered host memory;
/// with pin_host_buffers off it does not register them. At ZeRO-3 (one rank) the host's
/// gathered-params bucket and its grads are registered at their first copies.
void offload_pins_host_buffers() {
  ++checks;
  layout l;
  l.add("w", {300, 17}, dtype::bf16);
  const auto registered = [](const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeHost;
  };
  using opt_t = optimizer<adamw, sharded<fp32>, single, offload<cuda>, precision<bf16>>;
  opt_t pinned(l, adamw::hyper_params{});
  optimizer_options o;
  o.pin_host_buffers = false;
  opt_t pageable(l, adamw::hyper_params{}, o);
  const bool ok = registered(pinned.host().params().data()) && registered(pinned.host().grads().data()) &&
                  !registered(pageable.host().params().data()) && !registered(pageable.host().grads().data());
  if (!ok) {
    ++failures;
    std::printf("FAILED: offload<cuda>: host params/grads registered %d/%d (expected 1/1), with pin_host_buffers "
                "off %d/%d (expected 0/0)\n",
                registered(pinned.host().params().data()), registered(pinned.host().grads().data()),
                registered(pageable.host().params().data()), registered(pageable.host().grads().data()));
  }
  using opt3_t = optimizer<adamw, sharded<fp32, 3>, single, offload<cuda>, precision<bf16>>;
  opt3_t s3(l, adamw::hyper_params{});
  s3.gather("w");
  const bool gathered = registered(s3.host().param("w").data());
  s3.release("w");
  (void)s3.grad("w");
  s3.grads_ready("w");
  s3.step();
  const bool grads = registered(s3.host().grad("w").data());
  if (!gathered || !grads) {
    ++failures;
    std::printf("FAILED: offload<cuda> ZeRO-3: host gathered params/grads registered %d/%d (expected 1/1)\n", gathered,
                grads);
  }
}

/// A whole step captured into a CUDA graph and replayed 10 times leaves what 10 step()
/// calls leave, bit for bit: step() neither synchronises nor copies (engine/decisions.hpp),
/// and the device's step counter, loss scale and key advance at each replay. bf16 params
/// with stochastic rounding, a loss scale that grows every 3 steps.
void graph_replay_equals_steps() {
  ++checks;
  layout l;
  l.add("w", {300, 17}, dtype::bf16);
  l.add("b", {50}, dtype::bf16);
  adamw::hyper_params h;
  h.lr = 1e-2;
  optimizer_options o;
  o.master_weights = false;
  o.loss_scale = dynamic_loss_scale{1024.0, 2.0, 0.5, 3};
  cudaStream_t stream;  // the legacy default stream cannot be captured
  cuda_exec::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  using opt_t = optimizer<adamw, replicated<fp32>, single, cuda, precision<bf16, bf16>>;
  std::vector<bf16> a_params, b_params;
  std::int64_t a_steps = 0, b_steps = 0;
  double a_scale = 0, b_scale = 0;
  {
    opt_t a(l, h, o, cuda(0, stream)), b(l, h, o, cuda(0, stream));
    const std::size_t n = a.params().size();
    std::vector<bf16> p(n), g(n);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = from_float<bf16>(std::sin(0.37f * static_cast<float>(i)));
      g[i] = from_float<bf16>(std::cos(0.11f * static_cast<float>(i)) * 300.0f);
    }
    for (opt_t* x : {&a, &b}) {
      upload(x->executor(), std::span<const bf16>(p), x->params());
      upload(x->executor(), std::span<const bf16>(g), x->grads());
      x->step();  // the first step copies the host's decisions state to the device
    }
    for (int s = 0; s < 10; ++s) a.step();
    cudaGraph_t graph;
    cudaGraphExec_t replay;
    cuda_exec::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    b.step();
    cuda_exec::check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cuda_exec::check(cudaGraphInstantiate(&replay, graph, 0), "cudaGraphInstantiate");
    for (int s = 0; s < 10; ++s) cuda_exec::check(cudaGraphLaunch(replay, stream), "cudaGraphLaunch");
    cuda_exec::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    a_params.resize(n);
    b_params.resize(n);
    download(a.executor(), a.params(), std::span<bf16>(a_params));
    download(b.executor(), b.params(), std::span<bf16>(b_params));
    a_steps = a.step_count();
    b_steps = b.step_count();
    a_scale = a.loss_scale();
    b_scale = b.loss_scale();
    cudaGraphExecDestroy(replay);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
  const bool same = a_params.size() == b_params.size() &&
                    std::memcmp(a_params.data(), b_params.data(), a_params.size() * sizeof(bf16)) == 0;
  if (same && a_steps == 11 && b_steps == 11 && a_scale == b_scale && a_scale == 8192.0) return;
  ++failures;
  std::printf("FAILED: a step captured into a CUDA graph, replayed 10 times: params %s, steps %lld and %lld, "
              "loss scales %g and %g (want 11 steps, 8192)\n",
              same ? "equal" : "DIFFERENT", static_cast<long long>(a_steps),
              static_cast<long long>(b_steps), a_scale, b_scale);
}

}  // namespace

int main() {
  skip_without_device("optimizer<..., cuda> against cpu");
  try {
    adamw::hyper_params w;
    w.lr = 1e-2;
    run_options plain;  // default options: the finite check and exact norm every step
    run_options clipped;
    clipped.clip = 1.0;
    run_options percentile;
    percentile.clip = 1.0;
    percentile.options.percentile_clipping = 5;

    namespace cases = harness::cases;
    check_case<sgd, fp32, precision<float>>("sgd momentum + nesterov groups, fp32", cases::sgd_momentum_and_nesterov(),
                                            plain);
    check_case<adamw, fp32, precision<float>>("adamw fp32, clipped", {w}, clipped);
    check_case<adam, bf16, precision<bf16>>("adam amsgrad, bf16 params + master, bf16 states, percentile",
                                            {cases::adam_amsgrad()}, percentile, dtype::bf16);
    check_case<lion, fp32, precision<bf16, float>>("lion, bf16 params stochastic rounding, fp32 grads",
                                                   {cases::lion_decayed()}, cases::stochastic_rounding(), dtype::bf16);
    check_case<adamw, fp32, precision<fp16>>("adamw fp16 + master, loss scaling, a NaN step", {w},
                                             cases::fp16_loss_scaling(), dtype::f16);
    check_case<adamw, q8, precision<float>>("q8 adamw, clipped, percentile clipping", {w},
                                            cases::q8_percentile_clipping());
    {  // replicated over d ranks, bf16 grads reduced in fp32 (the staged all-reduce into the fp32 grads)
      const harness::layout_case c = harness::awkward_layouts()[3];
      const layout l = harness::make_layout(c, dtype::bf16);
      run_options ro = clipped;
      ro.options.grad_reduce_in_fp32 = true;
      ro.options.bucket_elems = c.bucket;
      const harness::outcome ref = harness::run_single<adamw, fp32, precision<bf16, bf16>>(l, {w}, ro);
      for (int d = 2; d <= 3; ++d)
        compare("adamw replicated, bf16 grads reduced in fp32, d=" + std::to_string(d),
                harness::run_threads<adamw, replicated<fp32>, precision<bf16, bf16>, cuda>(d, l, {w}, ro), ref);
    }
    run_options q8_master;
    q8_master.options.min_8bit_size = 256;
    check_case<lion, q8, precision<bf16, bf16>>("q8 lion, bf16 params + master", {cases::lion_decayed()}, q8_master,
                                                dtype::bf16);
    {  // ZeRO-Offload: params and grads on the GPU, master weights and states stepped on the host
      run_options ro = cases::fp16_loss_scaling();
      ro.clip = 1.0;
      for (const harness::layout_case& c : harness::awkward_layouts()) {
        ro.options.bucket_elems = c.bucket;
        const layout l = harness::make_layout(c, dtype::f16);
        const harness::outcome ref = harness::run_single<adamw, fp32, precision<fp16>>(l, {w}, ro);
        for (int d = 1; d <= 3; ++d) {
          compare("offload<cuda> adamw fp16 + master, loss scaling, clipped, ZeRO-2, layout " + c.name +
                      ", d=" + std::to_string(d),
                  harness::run_threads<adamw, sharded<fp32, 2>, precision<fp16>, offload<cuda>>(d, l, {w}, ro), ref);
          // ZeRO-1: the host params and grads page-locked, every copy from registered memory
          compare("offload<cuda> adamw fp16 + master, loss scaling, clipped, ZeRO-1, layout " + c.name +
                      ", d=" + std::to_string(d),
                  harness::run_threads<adamw, sharded<fp32>, precision<fp16>, offload<cuda>>(d, l, {w}, ro), ref);
        }
      }
    }
    offload_pins_host_buffers();
    graph_replay_equals_steps();
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d optimizer runs on cuda equal to cpu bit for bit\n", checks - failures, checks);
  return failures ? 1 : 0;
}
