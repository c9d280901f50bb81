// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// --backend cuda: the whole training on one GPU. The model runs on cuBLAS and kernels
// (model_cuda.cuh), writing its gradients straight into the optimizer's device buffers;
// `optimizer<Policy, replicated<fp32>, single, cuda>` steps them on the same stream, with no
// copy in between. Each step the host uploads the batch's tokens and copies one loss back.
//
// It starts from the CPU run's model (--init, or drawn from --seed) and takes the same batches;
// its sums run in other orders, so it follows the CPU run's losses within rounding, not bit for bit.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpt.hpp"
#include "model_cuda.cuh"
#include "setup.hpp"

namespace gpt {
namespace {

template <class Policy>
history train_on(const config& cfg, const prepared<Policy>& in, cudaStream_t stream) {
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  const model_config& mc = cfg.model;
  const std::vector<tensor_info> tensors = model_tensors(mc, 1);
  distopt::layout layout;
  std::size_t whole_params = 0;
  for (const tensor_info& t : tensors) {
    std::vector<std::int64_t> shape{t.rows};
    if (t.matrix()) shape.push_back(t.cols);
    layout.add(t.name, shape, distopt::dtype::f32, group_of<Policy>(t));
    whole_params += static_cast<std::size_t>(t.rows * t.cols);
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  distopt::optimizer<Policy, distopt::replicated<distopt::fp32>, distopt::single, distopt::cuda> opt(
      std::move(layout), in.groups, options, distopt::cuda(0, stream));

  // The initial model, then every unit's tensors as the model reads them (device pointers).
  const std::vector<std::vector<float>> whole = in.init.empty() ? initial_weights(mc, cfg.seed) : in.init;
  std::vector<std::vector<tensor_ref>> units(static_cast<std::size_t>(mc.layers + 2));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    distopt::upload(opt.executor(), std::span<const float>(whole[i]), opt.param(tensors[i].name));
    units[static_cast<std::size_t>(tensors[i].unit)].push_back(
        {opt.param(tensors[i].name).data(), opt.grad(tensors[i].name).data()});
  }
  unit_calls calls;
  calls.acquire = [&units](int u, bool backward) {
    std::vector<tensor_ref> refs = units[static_cast<std::size_t>(u)];
    if (!backward)
      for (tensor_ref& r : refs) r.g = nullptr;
    return refs;
  };
  calls.release = [](int) {};
  calls.grads_written = [](int) {};
  gpu::device_model net(mc, cfg.batch, stream);

  // A batch's inputs and targets, uploaded on the model's stream (ordered after the kernels
  // of the step before, which read the last batch's tokens).
  const int T = mc.seq, stride = T + 1;
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(cfg.batch) * T), targets(inputs.size());
  examples::cuda::device_array<std::int32_t> inputs_dev(inputs.size()), targets_dev(inputs.size());
  auto take = [&](const std::int32_t* batch) {
    split_batch(batch, 0, cfg.batch, T, inputs.data(), targets.data());
    const std::size_t bytes = inputs.size() * sizeof(std::int32_t);
    gpu::check(cudaMemcpyAsync(inputs_dev.data(), inputs.data(), bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (inputs)");
    gpu::check(cudaMemcpyAsync(targets_dev.data(), targets.data(), bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (targets)");
    gpu::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (tokens)");  // the host buffers are reused
  };
  const double positions = static_cast<double>(cfg.batch) * T;
  const std::vector<std::vector<std::int32_t>> val = validation_batches(cfg, in);
  auto validation_loss = [&] {
    double sum = 0.0;
    for (const auto& b : val) {
      take(b.data());
      sum += net.loss(calls, inputs_dev.data(), targets_dev.data(), cfg.batch);
    }
    return sum / (positions * static_cast<double>(val.size()));
  };
  std::optional<batch_source> train_src;
  if (in.batches.empty()) train_src.emplace(in.text->train, T, cfg.seed);

  int device = 0;
  cudaDeviceProp prop{};
  gpu::check(cudaGetDevice(&device), "cudaGetDevice");
  gpu::check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::cout << "distopt-gpt: " << Policy::name << " " << distopt::hyper_params_string<Policy>(in.groups[0])
            << " (norm weights: weight_decay=0)\n"
            << "model: Llama-style decoder, " << mc.layers << " layers, dim " << mc.dim << ", " << mc.heads
            << " heads, SwiGLU " << mc.ffn << ", vocabulary " << mc.vocab << " (bytes), " << T
            << " tokens a sequence: " << whole_params << " params, fp32\n"
            << "run: batch " << cfg.batch << " x " << T << " tokens, " << cfg.steps << " steps on the GPU ("
            << prop.name << "): the products on cuBLAS, the optimizer on distopt::cuda\n";
  if (in.text && in.batches.empty()) print_corpus(*in.text);
  std::cout << std::flush;

  step_reporter report(cfg, 0, /*writer=*/true, positions);
  examples::cuda::step_timer steps;
  history hist;
  const auto start = clock::now();
  for (int step = 0; step < cfg.steps; ++step) {
    std::vector<std::int32_t> drawn;
    if (train_src) drawn = train_src->next(cfg.batch);
    take(train_src ? drawn.data() : in.batches.data() + static_cast<std::size_t>(step) * cfg.batch * stride);
    const double loss = net.train_batch(calls, inputs_dev.data(), targets_dev.data(), cfg.batch, positions) / positions;
    steps.begin(stream);
    opt.step();  // decided on the device: nothing waits here
    steps.end(stream);
    hist.train_loss.push_back(loss);
    const int done = step + 1;
    std::optional<double> val_loss;
    if (!val.empty() && evaluation_due(cfg, done)) {
      val_loss = validation_loss();
      hist.val_loss.emplace_back(done, *val_loss);
    }
    report.step(done, loss, val_loss);
  }
  const double optimizer_seconds = steps.seconds();
  const double total = seconds(clock::now() - start).count();
  const auto skipped = static_cast<std::size_t>(cfg.steps - opt.step_count());  // reads the device's count
  print_summary(opt, "device", "time", skipped, positions, hist.train_loss.size(), total, optimizer_seconds,
                "optimizer steps (GPU time)");
  return hist;
}

template <class Policy>
history train_policy_on_gpu(const config& cfg) {
  examples::cuda::require_device();
  const prepared<Policy> in = prepare<Policy>(cfg);
  const examples::cuda::owned_stream stream;  // outlives the optimizer, which frees on it
  return train_on<Policy>(cfg, in, stream.get());
}

}  // namespace

history train_cuda(const config& cfg) {
  if (cfg.optimizer == "adafactor") return train_policy_on_gpu<distopt::adafactor>(cfg);
  if (cfg.optimizer == "adamw") return train_policy_on_gpu<distopt::adamw>(cfg);
  throw usage_error("--backend cuda: distopt-gpt builds it for --optimizer adafactor and adamw, not '" + cfg.optimizer +
                    "'");
}

}  // namespace gpt
