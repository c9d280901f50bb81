// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// --backend cuda: the whole training on one GPU. The MLP's products run on cuBLAS and its
// other passes as kernels (mlp_cuda.cuh), writing the grads straight into the optimizer's
// device buffers; `optimizer<Policy, replicated<fp32>, single, cuda>` steps them on the same
// stream, with no copy in between. The host copies one loss a batch back (for the progress
// bar and --log) and nothing else in the loop.
//
// It starts from the CPU run's model and takes its batches in the same order (the same
// seeded draws and shuffles); its sums run in other orders (cuBLAS), so it trains to about
// the CPU run's accuracy, not to its bits.

#include <distopt/distopt.hpp>
#include <distopt/exec/cuda/executor.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fashion_mnist.hpp"
#include "mlp_cuda.cuh"
#include "progress.hpp"
#include "setup.hpp"

namespace fmnist {
namespace {

using examples::cuda::step_timer;

template <class Policy>
history train_on(const config& cfg, const prepared<Policy>& in, cudaStream_t stream) {
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  const dataset& data = in.data;
  const std::vector<int> sizes = model_sizes(cfg, data.pixels);
  const int layer_count = static_cast<int>(sizes.size()) - 1;

  distopt::layout tensors;
  std::vector<std::string> names;  // fc1.weight, fc1.bias, fc2.weight, ...
  std::size_t whole_params = 0;
  for (int l = 0; l < layer_count; ++l) {
    const std::string fc = "fc" + std::to_string(l + 1);
    const std::int64_t m = sizes[l + 1], k = sizes[l];
    tensors.add(fc + ".weight", {m, k}, distopt::dtype::f32, 0);
    tensors.add(fc + ".bias", {m}, distopt::dtype::f32, 1);
    names.push_back(fc + ".weight");
    names.push_back(fc + ".bias");
    whole_params += static_cast<std::size_t>(m * k + m);
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  distopt::optimizer<Policy, distopt::replicated<distopt::fp32>, distopt::single, distopt::cuda> opt(
      std::move(tensors), groups_of(in), options, distopt::cuda(0, stream));

  // The CPU run's initial model (draw_initial_params), then the same shuffles.
  std::mt19937 rng(static_cast<std::mt19937::result_type>(cfg.seed));
  draw_initial_params(rng, sizes, [&](int l, int t, std::size_t, std::size_t, const std::vector<float>& whole) {
    distopt::upload(opt.executor(), std::span<const float>(whole), opt.param(names[static_cast<std::size_t>(2 * l + t)]));
  });
  std::vector<gpu::device_linear> layers;
  for (int l = 0; l < layer_count; ++l) {
    const std::string& w = names[static_cast<std::size_t>(2 * l)];
    const std::string& b = names[static_cast<std::size_t>(2 * l + 1)];
    layers.push_back({opt.param(w).data(), opt.param(b).data(), opt.grad(w).data(), opt.grad(b).data()});
  }

  // The data set on the device, once; each epoch's order, once an epoch.
  const std::size_t pixels = data.pixels, batch = static_cast<std::size_t>(cfg.batch_size);
  gpu::device_array<float> train_x(data.train.images.size()), test_x(data.test.images.size());
  gpu::device_array<std::uint8_t> train_y(data.train.labels.size()), test_y(data.test.labels.size());
  train_x.upload(data.train.images);
  test_x.upload(data.test.images);
  train_y.upload(data.train.labels);
  test_y.upload(data.test.labels);
  gpu::device_array<std::uint32_t> order_dev(data.train.count);
  gpu::device_array<float> batch_x(batch * pixels);
  gpu::device_array<std::uint8_t> batch_y(batch);
  const int eval_batch = 1000;
  gpu::device_mlp model(sizes, std::max(static_cast<int>(batch), eval_batch), stream);

  int device = 0;
  cudaDeviceProp prop{};
  gpu::check(cudaGetDevice(&device), "cudaGetDevice");
  gpu::check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::string shape;
  for (int s : sizes) shape += (shape.empty() ? "" : "-") + std::to_string(s);
  std::cout << "distopt-fashion-mnist: " << Policy::name << " " << distopt::hyper_params_string<Policy>(in.decay)
            << " (biases: weight_decay=0)\n"
            << "model: MLP " << shape << ", " << whole_params << " params (fp32); data: " << data.train.count
            << " train / " << data.test.count << " test samples; batch " << cfg.batch_size << ", " << cfg.epochs
            << " epochs, on the GPU (" << prop.name << "): the products on cuBLAS, the optimizer on distopt::cuda"
            << std::endl;

  const auto test_accuracy = [&] {
    std::size_t correct = 0;
    for (std::size_t b = 0; b < data.test.count; b += static_cast<std::size_t>(eval_batch)) {
      const int n = static_cast<int>(std::min(static_cast<std::size_t>(eval_batch), data.test.count - b));
      correct += static_cast<std::size_t>(
          model.count_correct(std::span<const gpu::device_linear>(layers), test_x.data() + b * pixels,
                              test_y.data() + b, n));
    }
    return static_cast<double>(correct) / static_cast<double>(data.test.count);
  };

  std::vector<std::size_t> order(data.train.count);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::vector<std::uint32_t> order32(order.size());
  std::FILE* const log = in.log.get();
  history hist;
  hist.steps_per_epoch = (data.train.count + batch - 1) / batch;
  step_timer steps;
  std::size_t step_index = 0;
  const auto train_start = clock::now();
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto epoch_start = clock::now();
    std::shuffle(order.begin(), order.end(), rng);
    std::copy(order.begin(), order.end(), order32.begin());
    order_dev.upload(order32);
    progress_bar bar(epoch, cfg.epochs, data.train.count);
    double loss_sum = 0.0;
    for (std::size_t b = 0; b < data.train.count; b += batch) {
      const std::size_t n = std::min(batch, data.train.count - b);
      ++step_index;
      gpu::gather_batch(train_x.data(), train_y.data(), order_dev.data(), b, static_cast<int>(n),
                        static_cast<int>(pixels), batch_x.data(), batch_y.data(), stream);
      const double loss = model.train_batch(std::span<const gpu::device_linear>(layers), batch_x.data(),
                                            batch_y.data(), static_cast<int>(n), static_cast<int>(n)) /
                          static_cast<double>(n);
      steps.begin(stream);
      if (cfg.clip > 0.0) opt.clip_grad_norm(cfg.clip);
      opt.step();  // decided on the device: nothing waits here
      steps.end(stream);
      loss_sum += loss * static_cast<double>(n);
      hist.step_loss.push_back(static_cast<float>(loss));
      if (log) std::fprintf(log, "%zu,%d,%.6g\n", step_index, epoch, loss);
      bar.update(b + n, loss_sum / static_cast<double>(b + n));
    }
    const double mean_loss = loss_sum / static_cast<double>(data.train.count);
    bar.finish(mean_loss);
    hist.epoch_loss.push_back(mean_loss);
    hist.test_accuracy.push_back(test_accuracy());
    std::cout << epoch_line(epoch, cfg.epochs, mean_loss, hist.test_accuracy.back(),
                            seconds(clock::now() - epoch_start).count())
              << std::flush;
  }
  const double optimizer_seconds = steps.seconds();
  const double total_seconds = seconds(clock::now() - train_start).count();
  const double accuracy = hist.test_accuracy.empty() ? test_accuracy() : hist.test_accuracy.back();
  const auto skipped = static_cast<std::int64_t>(step_index) - opt.step_count();  // reads the device's count

  char line[240];
  std::snprintf(line, sizeof line, "test accuracy: %.4f\n", accuracy);
  std::cout << line;
  if (skipped > 0) std::cout << "skipped steps (NaN/Inf gradient): " << skipped << "\n";
  std::cout << "optimizer memory (device):\n" << opt.memory();
  const double rest = total_seconds - optimizer_seconds;
  const double pct = total_seconds > 0 ? 100.0 / total_seconds : 0.0;
  std::snprintf(line, sizeof line,
                "time: optimizer steps (GPU time) %.2f s (%.1f%%), forward/backward/data/evaluation %.2f s (%.1f%%), "
                "total %.2f s\n",
                optimizer_seconds, optimizer_seconds * pct, rest, rest * pct, total_seconds);
  std::cout << line << std::flush;
  return hist;
}

template <class Policy>
history train_policy_on_gpu(const config& cfg) {
  examples::cuda::require_device();
  const prepared<Policy> in = prepare<Policy>(cfg, /*writer=*/true);
  const examples::cuda::owned_stream stream;  // outlives the optimizer, which frees on it
  return train_on<Policy>(cfg, in, stream.get());
}

}  // namespace

history train_cuda(const config& cfg) {
  if (cfg.optimizer == "adamw") return train_policy_on_gpu<distopt::adamw>(cfg);
  if (cfg.optimizer == "adafactor") return train_policy_on_gpu<distopt::adafactor>(cfg);
  throw usage_error("--backend cuda: distopt-fashion-mnist builds it for --optimizer adamw and adafactor, not '" +
                    cfg.optimizer + "'");
}

}  // namespace fmnist
