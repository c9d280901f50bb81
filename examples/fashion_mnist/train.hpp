// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The training loop for one policy and one param number type. Included only by the
// train_<policy>.cpp files, each of which instantiates it for fp32 and bf16 params.

#include <distopt/distopt.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "fashion_mnist.hpp"
#include "mlp.hpp"
#include "progress.hpp"

namespace fmnist {

/// The reference's defaults, except where they do not train this model: torch.optim.SGD's
/// lr=1e-3 without momentum barely moves in ten epochs.
template <class Policy>
void apply_example_defaults(typename Policy::hyper_params& h) {
  if constexpr (std::is_same_v<Policy, distopt::sgd>) {
    h.lr = 0.05;
    h.momentum = 0.9;
  }
}

/// The hyper-parameters of the weights: example defaults, then every --set in order.
template <class Policy>
typename Policy::hyper_params hyper_from(const config& cfg) {
  typename Policy::hyper_params h;
  apply_example_defaults<Policy>(h);
  try {
    return distopt::apply_hyper_params<Policy>(h, cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {  // a value out of range
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {  // a setting that does not parse
    throw usage_error(std::string("--set ") + e.what());
  }
}

template <class Policy, class Param>
history train_typed(const config& cfg) {
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  constexpr bool fp32_params = std::is_same_v<Param, float>;

  const auto decay = hyper_from<Policy>(cfg);
  auto no_decay = decay;  // group 1: biases, without weight decay as usual in PyTorch recipes
  no_decay.weight_decay = 0.0;
  const dataset data = load_dataset(cfg);  // after the checks above: a typo fails at once

  std::vector<int> sizes{static_cast<int>(data.pixels)};
  sizes.insert(sizes.end(), cfg.hidden.begin(), cfg.hidden.end());
  sizes.push_back(10);
  const int layer_count = static_cast<int>(sizes.size()) - 1;

  distopt::layout tensors;
  std::vector<std::string> names;  // fc1.weight, fc1.bias, fc2.weight, ...
  for (int l = 0; l < layer_count; ++l) {
    const std::string fc = "fc" + std::to_string(l + 1);
    tensors.add(fc + ".weight", {sizes[l + 1], sizes[l]}, distopt::dtype_of<Param>, 0);
    tensors.add(fc + ".bias", {sizes[l + 1]}, distopt::dtype_of<Param>, 1);
    names.push_back(fc + ".weight");
    names.push_back(fc + ".bias");
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  distopt::optimizer<Policy, distopt::replicated<distopt::fp32>, distopt::single, distopt::cpu,
                     distopt::precision<Param, float>>
      opt(std::move(tensors), {decay, no_decay}, options, distopt::cpu(cfg.threads));

  // torch.nn.Linear's initialisation: kaiming_uniform_(a=sqrt(5)) on the weight and the
  // bias bound both come to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  std::mt19937 rng(static_cast<std::mt19937::result_type>(cfg.seed));
  for (int l = 0; l < layer_count; ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(sizes[l]));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (int t = 0; t < 2; ++t)
      for (auto& p : opt.param(names[2 * l + t])) p = distopt::from_float<Param>(uniform(rng));
  }

  // fp32 params are read by BLAS in place; bf16 params through a float copy refreshed
  // after every step (distopt keeps the fp32 master weights the update works on).
  std::vector<std::vector<float>> shadow(fp32_params ? 0 : names.size());
  std::vector<const float*> values(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    if constexpr (fp32_params) {
      values[i] = opt.param(names[i]).data();
    } else {
      shadow[i].resize(opt.param(names[i]).size());
      values[i] = shadow[i].data();
    }
  }
  auto refresh_shadow = [&] {
    if constexpr (!fp32_params)
      for (std::size_t i = 0; i < names.size(); ++i) {
        auto p = opt.param(names[i]);
        std::transform(p.begin(), p.end(), shadow[i].begin(), [](Param x) { return distopt::to_float(x); });
      }
  };
  refresh_shadow();
  std::vector<linear_ref> layers;
  for (int l = 0; l < layer_count; ++l)
    layers.push_back({values[2 * l], values[2 * l + 1], opt.grad(names[2 * l]).data(),
                      opt.grad(names[2 * l + 1]).data()});

  std::unique_ptr<std::FILE, int (*)(std::FILE*)> log(nullptr, &std::fclose);
  if (!cfg.log_path.empty()) {
    log.reset(std::fopen(cfg.log_path.c_str(), "w"));
    if (!log) throw usage_error(cfg.log_path + ": cannot write (" + std::strerror(errno) + ")");
    std::fputs("step,epoch,loss\n", log.get());
  }

  std::string shape;
  for (int s : sizes) shape += (shape.empty() ? "" : "-") + std::to_string(s);
  std::cout << "distopt-fashion-mnist: " << Policy::name << " "
            << distopt::hyper_params_string<Policy>(decay) << " (biases: weight_decay=0)\n"
            << "model: MLP " << shape << ", " << opt.tensors().numel() << " params ("
            << (fp32_params ? "fp32" : "bf16 with fp32 master weights") << "); data: "
            << data.train.count << " train / " << data.test.count << " test samples; batch "
            << cfg.batch_size << ", " << cfg.epochs << " epochs, " << cfg.threads << " threads"
            << std::endl;

  const int eval_batch = 1000;
  mlp model(sizes, std::max(cfg.batch_size, eval_batch));
  auto test_accuracy = [&] {
    std::size_t correct = 0;
    for (std::size_t b = 0; b < data.test.count; b += eval_batch) {
      const int n = static_cast<int>(std::min<std::size_t>(eval_batch, data.test.count - b));
      correct += static_cast<std::size_t>(model.count_correct(
          layers, data.test.images.data() + b * data.pixels, data.test.labels.data() + b, n));
    }
    return static_cast<double>(correct) / static_cast<double>(data.test.count);
  };

  const std::size_t pixels = data.pixels, batch = static_cast<std::size_t>(cfg.batch_size);
  std::vector<float> batch_x(batch * pixels);
  std::vector<std::uint8_t> batch_y(batch);
  std::vector<std::size_t> order(data.train.count);
  std::iota(order.begin(), order.end(), std::size_t{0});

  history hist;
  hist.steps_per_epoch = (data.train.count + batch - 1) / batch;
  double optimizer_seconds = 0.0;
  std::size_t skipped = 0;
  const auto train_start = clock::now();
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto epoch_start = clock::now();
    std::shuffle(order.begin(), order.end(), rng);
    progress_bar bar(epoch, cfg.epochs, data.train.count);
    double loss_sum = 0.0;  // sum over samples, for the epoch's mean
    for (std::size_t b = 0; b < data.train.count; b += batch) {
      const std::size_t n = std::min(batch, data.train.count - b);
      for (std::size_t r = 0; r < n; ++r) {
        const std::size_t s = order[b + r];
        std::copy_n(data.train.images.data() + s * pixels, pixels, batch_x.data() + r * pixels);
        batch_y[r] = data.train.labels[s];
      }
      const double loss = model.train_batch(layers, batch_x.data(), batch_y.data(), static_cast<int>(n));

      const auto step_start = clock::now();
      if (cfg.clip > 0.0) opt.clip_grad_norm(cfg.clip);
      skipped += opt.step().skipped;
      optimizer_seconds += seconds(clock::now() - step_start).count();
      refresh_shadow();

      loss_sum += loss * static_cast<double>(n);
      hist.step_loss.push_back(static_cast<float>(loss));
      if (log) std::fprintf(log.get(), "%zu,%d,%.6g\n", hist.step_loss.size(), epoch, loss);
      bar.update(b + n, loss_sum / static_cast<double>(b + n));
    }
    const double mean_loss = loss_sum / static_cast<double>(data.train.count);
    bar.finish(mean_loss);
    hist.epoch_loss.push_back(mean_loss);
    hist.test_accuracy.push_back(test_accuracy());
    char line[160];
    std::snprintf(line, sizeof line, "epoch %d/%d  train loss %.4f  test accuracy %.4f  (%.1f s)\n",
                  epoch, cfg.epochs, mean_loss, hist.test_accuracy.back(),
                  seconds(clock::now() - epoch_start).count());
    std::cout << line << std::flush;
  }
  const double total_seconds = seconds(clock::now() - train_start).count();

  char line[200];
  std::snprintf(line, sizeof line, "test accuracy: %.4f\n",
                hist.test_accuracy.empty() ? test_accuracy() : hist.test_accuracy.back());
  std::cout << line;
  if (skipped) std::cout << "skipped steps (NaN/Inf gradient): " << skipped << "\n";
  std::cout << "optimizer memory:\n" << opt.memory();
  const double rest = total_seconds - optimizer_seconds;
  const double pct = total_seconds > 0 ? 100.0 / total_seconds : 0.0;
  std::snprintf(line, sizeof line,
                "time: optimizer steps %.2f s (%.1f%%), forward/backward/data/evaluation %.2f s "
                "(%.1f%%), total %.2f s\n",
                optimizer_seconds, optimizer_seconds * pct, rest, rest * pct, total_seconds);
  std::cout << line << std::flush;
  return hist;
}

/// Runs `Policy` with the param number type named by --param-dtype.
template <class Policy>
history train_policy(const config& cfg) {
  if (cfg.param_dtype == "fp32") return train_typed<Policy, float>(cfg);
  if (cfg.param_dtype == "bf16") return train_typed<Policy, distopt::bf16>(cfg);
  throw usage_error("--param-dtype: unknown dtype '" + cfg.param_dtype + "' (fp32 or bf16)");
}

}  // namespace fmnist
