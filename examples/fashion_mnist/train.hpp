// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// The training loop for one policy and one param number type, on one rank or data-parallel
// over several (ranks as threads, or MPI processes) with sharded optimizer state. Included
// only by the train_<policy>.cpp files, each of which instantiates it for fp32 and bf16
// params and every way of running ranks. Ranks as threads and MPI processes hold their
// communicator in a `distopt::any_comm`, so that both run the same optimizer types.

#include <distopt/distopt.hpp>
#include <distopt/offload.hpp>
#ifdef DISTOPT_FASHION_MNIST_CHECKPOINT
#include <distopt/checkpoint.hpp>
#endif
#ifdef DISTOPT_FASHION_MNIST_KOKKOS
#include <distopt/exec/kokkos.hpp>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef DISTOPT_FASHION_MNIST_MPI
#include <distopt/comm/mpi.hpp>
#endif

#include "fashion_mnist.hpp"
#include "mlp.hpp"
#include "progress.hpp"
#include "setup.hpp"

namespace fmnist {

/// Trains on one rank; rank 0 prints and writes the log. With `distopt::single` (one rank,
/// replicated state) each step's gradient is the batch's mean. With d ranks, rank r takes
/// share_of(batch, d, r) of every batch and writes (sum of its rows' loss gradients) /
/// batch size; the optimizer sums the ranks' gradients (reduce_op::sum: with unequal parts,
/// avg's division by d would weight the rows of smaller parts more), so it sees the batch's
/// mean gradient as with one rank, up to the order of the additions. It then updates its
/// shard of the state and all-gathers the params, which every rank's BLAS reads in place.
/// Every rank returns the same history.
///
/// With tensor parallelism (--tp T, ranks as threads only) `comm` is the data-parallel group
/// and `tp_opt` and `tp_model` two communicators over the same tensor-parallel group (the
/// optimizer keeps one, the model's forward and backward use the other): every layer is split
/// over it as mlp.hpp describes, each TP rank registering and updating its parts only. The
/// TP ranks of one data-parallel rank take the same rows of every batch; rank 0 of both
/// groups prints and writes the log.
///
/// With --zero S the loop calls the optimizer's overlap hooks layer by layer (mlp's
/// layer_calls): a layer's params are gathered before its forward and its backward and
/// released after each (ZeRO-3: all-gathered into pooled buffers, the next layer's
/// prefetched meanwhile; other stages: bookkeeping), and its grads declared ready as soon as
/// backward has written them, so that their reduce-scatter runs while the layers below
/// compute. Every tensor is a bucket of its own then (bucket_elems = 1), for one collective
/// per tensor. The stage and the hooks change no bit of the result.
template <class Policy, class Param, class Storage, class Comm, class Exec = distopt::cpu>
history train_rank(const config& cfg, const prepared<Policy>& in, std::string_view comm_name, Comm comm,
                   std::optional<Comm> tp_opt = std::nullopt, std::optional<Comm> tp_model = std::nullopt) {
  using clock = std::chrono::steady_clock;
  using seconds = std::chrono::duration<double>;
  constexpr bool fp32_params = std::is_same_v<Param, float>;
  constexpr bool distributed = !std::is_same_v<Comm, distopt::single>;
  const int rank = comm.rank(), ranks = comm.size();
  const int tp_rank = tp_model ? tp_model->rank() : 0, tp_size = tp_model ? tp_model->size() : 1;
  const bool writer = rank == 0 && tp_rank == 0;
  const dataset& data = in.data;
  const bool hooks = cfg.zero > 0;  // the overlap hooks, layer by layer
  constexpr int zero_stage = distopt::storage_zero_stage<Storage>();
  // --offload: the params and grads in the emulated device's memory (a GPU's, in a GPU
  // trainer), which BLAS reads and writes through host copies, as a GPU trainer's kernels
  // would not need to; the master weights and states on the host. Always with the hooks.
  constexpr bool offloaded = !distopt::host_memory<Exec>;

  const std::vector<int> sizes = model_sizes(cfg, data.pixels);
  const int layer_count = static_cast<int>(sizes.size()) - 1;

  // Each tensor's TP split (none without --tp) and this TP rank's part of its shape.
  distopt::layout tensors;
  std::vector<std::string> names;  // fc1.weight, fc1.bias, fc2.weight, ...
  std::vector<distopt::tp_split> splits;
  std::size_t whole_params = 0;  // of the whole model, over every TP rank's parts
  for (int l = 0; l < layer_count; ++l) {
    const std::string fc = "fc" + std::to_string(l + 1);
    const layer_split split = mlp::split_of(l, layer_count, tp_size);
    const std::int64_t m = sizes[l + 1], k = sizes[l], t = tp_size;
    if (split == layer_split::column) {  // rows of the weight and the bias
      tensors.add(fc + ".weight", {m / t, k}, distopt::dtype_of<Param>, 0, distopt::tp_split::rows);
      tensors.add(fc + ".bias", {m / t}, distopt::dtype_of<Param>, 1, distopt::tp_split::rows);
      splits.insert(splits.end(), {distopt::tp_split::rows, distopt::tp_split::rows});
    } else if (split == layer_split::row) {  // columns of the weight; the bias whole
      tensors.add(fc + ".weight", {m, k / t}, distopt::dtype_of<Param>, 0, distopt::tp_split::cols);
      tensors.add(fc + ".bias", {m}, distopt::dtype_of<Param>, 1, distopt::tp_split::none);
      splits.insert(splits.end(), {distopt::tp_split::cols, distopt::tp_split::none});
    } else {
      // GaLore, Muon: the output layer's weight (10 rows) in group 2, with weight decay but
      // no rank (GaLore), or with AdamW (Muon).
      tensors.add(fc + ".weight", {m, k}, distopt::dtype_of<Param>,
                  has_matrix_groups<Policy> && l == layer_count - 1 ? 2 : 0);
      tensors.add(fc + ".bias", {m}, distopt::dtype_of<Param>, 1);
      splits.insert(splits.end(), {distopt::tp_split::none, distopt::tp_split::none});
    }
    names.push_back(fc + ".weight");
    names.push_back(fc + ".bias");
    whole_params += static_cast<std::size_t>(m * k + m);
  }
  distopt::optimizer_options options;
  options.seed = cfg.seed;
  if constexpr (distributed) options.grad_reduce = distopt::reduce_op::sum;  // already divided by the batch size
  if (hooks) options.bucket_elems = 1;  // a bucket per tensor: each layer's reduction starts after its backward
  options.micro_batches = cfg.accumulate;  // --accumulate N: N micro-batches per step
  options.accumulate = cfg.accumulate_each ? distopt::accumulation::reduce_each : distopt::accumulation::reduce_last;
  const bool accumulating = cfg.accumulate > 1;
  distopt::optimizer<Policy, Storage, Comm, Exec, distopt::precision<Param, float>> opt(
      std::move(tensors), groups_of(in), options, distopt::make_executor<Exec>(cfg.threads), std::move(comm));
  if constexpr (distributed)
    if (tp_opt) opt.set_tensor_parallel_group(std::move(*tp_opt));
  // The sum of one number over the ranks (a loss, a count of correct answers).
  auto sum_over_ranks = [&opt](double x) {
    if constexpr (distributed) {
      double v[1] = {x};
      opt.communicator().all_reduce(std::span<double>(v), distopt::reduce_op::sum);
      return v[0];
    } else {
      return x;
    }
  };

  // The initial model (draw_initial_params): every rank draws the whole tensors, of which
  // each TP rank keeps its part, so that --tp T starts from the same model as one rank.
  std::mt19937 rng(static_cast<std::mt19937::result_type>(cfg.seed));
  draw_initial_params(rng, sizes, [&](int l, int t, std::size_t rows, std::size_t cols, const std::vector<float>& whole) {
    const std::string& name = names[static_cast<std::size_t>(2 * l + t)];
    if (hooks) opt.gather(name);  // ZeRO-3: a full view to write into
    std::vector<Param> part(opt.param(name).size());
    const distopt::tp_split split = splits[static_cast<std::size_t>(2 * l + t)];
    const auto ut = static_cast<std::size_t>(tp_size), ur = static_cast<std::size_t>(tp_rank);
    const std::size_t part_cols = split == distopt::tp_split::cols ? cols / ut : cols;
    const std::size_t first_row = split == distopt::tp_split::rows ? ur * (rows / ut) : 0;
    const std::size_t first_col = split == distopt::tp_split::cols ? ur * part_cols : 0;
    for (std::size_t i = 0; i < part.size(); ++i)
      part[i] = distopt::from_float<Param>(whole[(first_row + i / part_cols) * cols + first_col + i % part_cols]);
    distopt::upload(opt.executor(), part, opt.param(name));  // a plain copy on cpu
    if (hooks) opt.release(name, distopt::keep_writes);  // ZeRO-3: this rank keeps its shard
  });

  // fp32 params are read by BLAS in place; bf16 params through a float copy refreshed
  // after every step (distopt keeps the fp32 master weights the update works on). With the
  // hooks, the layer calls below hand BLAS each layer's params and grads when it runs.
  // --offload: params and grads through host copies (`shadow`, `staged`), fp32 only.
  constexpr bool in_place = fp32_params && !offloaded;
  std::vector<std::vector<float>> shadow(in_place ? 0 : names.size()), staged(offloaded ? names.size() : 0);
  std::vector<const float*> values(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::size_t numel = opt.tensors().find(names[i]).numel;
    if constexpr (in_place) {
      if (!hooks) values[i] = opt.param(names[i]).data();
    } else {
      shadow[i].resize(numel);
      values[i] = shadow[i].data();
    }
    if constexpr (offloaded) staged[i].resize(numel);
  }
  // --offload: tensor i's device params into its shadow.
  const auto fetch_params = [&](std::size_t i) {
    if constexpr (offloaded) distopt::download(opt.executor(), opt.param(names[i]), std::span<float>(shadow[i]));
  };
  auto refresh_shadow = [&] {
    if constexpr (offloaded) {
      if constexpr (zero_stage < 3)  // stage 3: a layer's params are fetched when it is gathered
        for (std::size_t i = 0; i < names.size(); ++i) fetch_params(i);
    } else if constexpr (!fp32_params)
      for (std::size_t i = 0; i < names.size(); ++i) {
        auto p = opt.param(names[i]);
        std::transform(p.begin(), p.end(), shadow[i].begin(), [](Param x) { return distopt::to_float(x); });
      }
  };
  refresh_shadow();
  // --resume: params and states from the checkpoint; the loop below replays the shuffles
  // and skips the batches before its step, so batches and rounding continue as they were.
  std::size_t first_step = 0;
#ifdef DISTOPT_FASHION_MNIST_CHECKPOINT
  if (!cfg.resume_dir.empty()) {
    opt.load(cfg.resume_dir);
    refresh_shadow();
    // The batches of every step() call made, skipped ones included, are behind.
    first_step = static_cast<std::size_t>(opt.step_calls());
    // --set after the load, as a PyTorch loop sets a param group's lr after
    // load_state_dict: the checkpoint's hyper-parameters, with the keys --set names taking its values.
    if (!cfg.sets.empty())
      for (int g = 0; g < opt.group_count(); ++g) {
        auto h = with_sets<Policy>(cfg, opt.hyper(g));
        shape_group<Policy>(h, static_cast<std::size_t>(g));
        opt.set_hyper(g, std::move(h));
      }
    if (writer) std::cout << "resumed from " << cfg.resume_dir << " at step " << first_step << "\n";
  }
#endif
  const auto save_checkpoint = [&](std::size_t step) {
#ifdef DISTOPT_FASHION_MNIST_CHECKPOINT
    if (cfg.checkpoint_dir.empty()) return;
    opt.save(cfg.checkpoint_dir);
    if (writer && cfg.checkpoint_every > 0) std::fprintf(stderr, "checkpoint: step %zu -> %s\n", step, cfg.checkpoint_dir.c_str());
#else
    (void)step;
#endif
  };
  std::vector<linear_ref> layers;
  if (!hooks && !offloaded)
    for (int l = 0; l < layer_count; ++l)
      layers.push_back({values[2 * l], values[2 * l + 1], opt.grad(names[2 * l]).data(),
                        opt.grad(names[2 * l + 1]).data()});
  // The layer calls of --zero: layer l's tensors are names[2l] (weight) and names[2l + 1].
  const auto layer_names = [&names](int l) {
    const auto i = static_cast<std::size_t>(2 * l);
    return distopt::tensor_names{names[i], names[i + 1]};
  };
  layer_calls calls;
  calls.acquire = [&](int l, bool backward) {
    opt.gather(layer_names(l));
    const int next = backward ? l - 1 : l + 1;  // the next layer of this pass, on its way meanwhile
    if (next >= 0 && next < layer_count) opt.prefetch(layer_names(next));
    const auto i = static_cast<std::size_t>(2 * l);
    linear_ref r{};
    if constexpr (offloaded) {
      if constexpr (zero_stage >= 3) {
        fetch_params(i);
        fetch_params(i + 1);
      }
      r.weight = shadow[i].data();
      r.bias = shadow[i + 1].data();
      if (backward) {
        r.weight_grad = staged[i].data();
        r.bias_grad = staged[i + 1].data();
      }
      return r;
    }
    if constexpr (in_place) {
      r.weight = opt.param(names[i]).data();
      r.bias = opt.param(names[i + 1]).data();
    } else {  // --zero 1 only (main refuses bf16 at stages 2 and 3): params in place, read through the copy
      r.weight = shadow[i].data();
      r.bias = shadow[i + 1].data();
    }
    if (backward) {
      r.weight_grad = opt.grad(names[i]).data();
      r.bias_grad = opt.grad(names[i + 1]).data();
    }
    return r;
  };
  calls.release = [&](int l) { opt.release(layer_names(l)); };
  calls.grads_written = [&](int l) {
    if constexpr (offloaded)  // the grads BLAS wrote, into the device's views
      for (std::size_t i = static_cast<std::size_t>(2 * l); i < static_cast<std::size_t>(2 * l + 2); ++i)
        distopt::upload(opt.executor(), std::span<const float>(staged[i]), opt.grad(names[i]));
    opt.grads_ready(layer_names(l));
  };
  const layer_calls* const model_calls = hooks ? &calls : nullptr;
  // A pass without rows, on a rank whose part of a batch is empty: the model's layer calls in
  // the model's order (backward: zero grads; accumulating, nothing added into grads that the
  // optimizer zeroed at their first view), so that its collectives (ZeRO-3's gathers, the
  // grads' reductions) pair with those of the ranks that compute.
  const auto idle_pass = [&](bool backward) {
    for (int l = 0; l < layer_count; ++l) {
      calls.acquire(l, false);
      calls.release(l);
    }
    for (int l = layer_count - 1; backward && l >= 0; --l) {
      const linear_ref r = calls.acquire(l, true);
      const auto i = static_cast<std::size_t>(2 * l);
      if (!accumulating) {
        std::fill_n(r.weight_grad, opt.tensors().find(names[i]).numel, 0.0f);
        std::fill_n(r.bias_grad, opt.tensors().find(names[i + 1]).numel, 0.0f);
      }
      calls.grads_written(l);
      calls.release(l);
    }
  };
  std::FILE* const log = writer ? in.log.get() : nullptr;

  std::string shape;
  for (int s : sizes) shape += (shape.empty() ? "" : "-") + std::to_string(s);
  if (writer) {
    std::cout << "distopt-fashion-mnist: " << Policy::name << " "
              << distopt::hyper_params_string<Policy>(in.decay) << " (biases: weight_decay=0)\n"
              << "model: MLP " << shape << ", " << whole_params << " params ";
    if (tp_size > 1) std::cout << "(" << opt.tensors().numel() << " on TP rank 0) ";
    std::cout << "(" << (fp32_params ? "fp32" : "bf16 with fp32 master weights")
              << (decltype(opt)::is_quantized ? ", 8-bit states" : "") << "); data: "
              << data.train.count << " train / " << data.test.count << " test samples; batch "
              << cfg.batch_size;
    if (tp_size > 1)
      std::cout << " split over " << ranks << " data-parallel ranks, each layer over " << tp_size
                << " tensor-parallel ranks (" << comm_name << ", " << ranks * tp_size << " in all), " << cfg.epochs
                << " epochs, " << cfg.threads << " threads per rank; optimizer state sharded over the "
                << "data-parallel ranks";
    else if constexpr (distributed)
      std::cout << " split over " << ranks << " ranks (" << comm_name << "), " << cfg.epochs << " epochs, "
                << cfg.threads << " threads per rank; optimizer state sharded over the ranks";
    else
      std::cout << ", " << cfg.epochs << " epochs, " << cfg.threads << " threads";
    if (hooks)
      std::cout << "; ZeRO-" << zero_stage << " ("
                << (zero_stage == 1   ? "states"
                    : zero_stage == 2 ? "states and grads"
                                      : "states, grads and params")
                << " sharded), hooks layer by layer";
    if (offloaded) std::cout << "; master weights and states offloaded to the host (params and grads on the emulated device)";
    if (accumulating)
      std::cout << "; " << cfg.accumulate << " micro-batches a step, the grads reduced "
                << (cfg.accumulate_each ? "after each (into an fp32 accumulator)" : "after the last");
    std::cout << std::endl;
  }

  const std::size_t pixels = data.pixels, batch = static_cast<std::size_t>(cfg.batch_size);
  const std::size_t most_rows = share_of(batch, ranks, 0).count;  // rank 0's part is the largest
  const int eval_batch = 1000;
  tp_group model_tp;
  if constexpr (distributed)
    if (tp_model)
      model_tp = {tp_rank, tp_size,
                  [&tp_model](std::span<float> v) { tp_model->all_reduce(v, distopt::reduce_op::sum); }};
  mlp model(sizes, std::max(static_cast<int>(most_rows), eval_batch), std::move(model_tp));
  // Each rank scores its part of the test set; the counts are summed exactly.
  const share test_part = share_of(data.test.count, ranks, rank);
  // With --zero every rank runs as many evaluation batches as rank 0 (whose part is the
  // largest): each is a pass of layer calls that the ranks make together.
  const std::size_t eval_rows = static_cast<std::size_t>(eval_batch);
  const std::size_t eval_batches = (share_of(data.test.count, ranks, 0).count + eval_rows - 1) / eval_rows;
  auto test_accuracy = [&] {
    std::size_t correct = 0;
    const std::size_t end = test_part.first + test_part.count;
    for (std::size_t j = 0; j < eval_batches; ++j) {
      const std::size_t b = test_part.first + j * eval_rows;
      if (b >= end) {
        if (hooks) idle_pass(false);
        continue;
      }
      const int n = static_cast<int>(std::min(eval_rows, end - b));
      correct += static_cast<std::size_t>(model.count_correct(
          layers, data.test.images.data() + b * data.pixels, data.test.labels.data() + b, n, model_calls));
    }
    return sum_over_ranks(static_cast<double>(correct)) / static_cast<double>(data.test.count);
  };

  std::vector<float> batch_x(most_rows * pixels);
  std::vector<std::uint8_t> batch_y(most_rows);
  std::vector<std::size_t> order(data.train.count);
  std::iota(order.begin(), order.end(), std::size_t{0});

  history hist;
  hist.steps_per_epoch = (data.train.count + batch - 1) / batch;
  double optimizer_seconds = 0.0;
  std::size_t skipped = 0;
  std::size_t step_index = 0;  // batches so far, over epochs (the optimizer's step count unless steps were skipped)
  const auto train_start = clock::now();
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto epoch_start = clock::now();
    std::shuffle(order.begin(), order.end(), rng);
    if (step_index + hist.steps_per_epoch <= first_step) {  // done before the checkpoint: only its shuffle
      step_index += hist.steps_per_epoch;
      continue;
    }
    std::optional<progress_bar> bar;
    if (writer) bar.emplace(epoch, cfg.epochs, data.train.count);
    double loss_sum = 0.0;  // sum over samples, for the epoch's mean
    std::size_t samples = 0;  // this epoch's, in loss_sum (fewer when resumed mid-epoch)
    for (std::size_t b = 0; b < data.train.count; b += batch) {
      const std::size_t n = std::min(batch, data.train.count - b);
      if (step_index++ < first_step) continue;  // done before the checkpoint
      const share part = share_of(n, ranks, rank);
      double part_loss = 0.0;  // sum over this rank's rows
      for (int k = 0; k < cfg.accumulate; ++k) {
        // --accumulate N: micro-batch k of this rank's part, cut as --ranks cuts a batch, its
        // grads added into views taken again (zeroed by the optimizer at the first view).
        const share micro = share_of(part.count, cfg.accumulate, k);
        if (accumulating && !hooks)
          for (int l = 0; l < layer_count; ++l) {
            layers[static_cast<std::size_t>(l)].weight_grad = opt.grad(names[static_cast<std::size_t>(2 * l)]).data();
            layers[static_cast<std::size_t>(l)].bias_grad = opt.grad(names[static_cast<std::size_t>(2 * l + 1)]).data();
          }
        if (micro.count > 0) {
          for (std::size_t r = 0; r < micro.count; ++r) {
            const std::size_t s = order[b + part.first + micro.first + r];
            std::copy_n(data.train.images.data() + s * pixels, pixels, batch_x.data() + r * pixels);
            batch_y[r] = data.train.labels[s];
          }
          part_loss += model.train_batch(layers, batch_x.data(), batch_y.data(), static_cast<int>(micro.count),
                                         static_cast<int>(n), model_calls, accumulating);
        } else if (hooks) {
          idle_pass(true);  // nothing to add, in the other ranks' order of layer calls
        } else if (!accumulating) {
          opt.zero_grad();  // a last batch smaller than the number of ranks: nothing to add
        }
        if (accumulating) opt.end_micro_batch();
      }
      const double loss = sum_over_ranks(part_loss) / static_cast<double>(n);

      const auto step_start = clock::now();
      if (cfg.clip > 0.0) opt.clip_grad_norm(cfg.clip);
      skipped += opt.step().skipped;
      optimizer_seconds += seconds(clock::now() - step_start).count();
      refresh_shadow();

      loss_sum += loss * static_cast<double>(n);
      samples += n;
      hist.step_loss.push_back(static_cast<float>(loss));
      if (log) std::fprintf(log, "%zu,%d,%.6g\n", step_index, epoch, loss);
      if (bar) bar->update(b + n, loss_sum / static_cast<double>(samples));
      if (cfg.checkpoint_every > 0 && step_index % static_cast<std::size_t>(cfg.checkpoint_every) == 0)
        save_checkpoint(step_index);
    }
    const double mean_loss = loss_sum / static_cast<double>(samples);
    if (bar) bar->finish(mean_loss);
    hist.epoch_loss.push_back(mean_loss);
    hist.test_accuracy.push_back(test_accuracy());
    if (writer)
      std::cout << epoch_line(epoch, cfg.epochs, mean_loss, hist.test_accuracy.back(),
                              seconds(clock::now() - epoch_start).count())
                << std::flush;
  }
  if (step_index > first_step) save_checkpoint(step_index);  // the end (once more after a save at the last step: cheap)
  const double total_seconds = seconds(clock::now() - train_start).count();
  const double accuracy = hist.test_accuracy.empty() ? test_accuracy() : hist.test_accuracy.back();
  if (!writer) return hist;

  char line[240];
  std::snprintf(line, sizeof line, "test accuracy: %.4f\n", accuracy);
  std::cout << line;
  if (skipped) std::cout << "skipped steps (NaN/Inf gradient): " << skipped << "\n";
  if (tp_size > 1)
    std::cout << "optimizer memory (rank 0 of " << ranks << " data-parallel x " << tp_size
              << " tensor-parallel ranks):\n" << opt.memory();
  else if constexpr (distributed)
    std::cout << "optimizer memory (rank 0 of " << ranks << "):\n" << opt.memory();
  else
    std::cout << "optimizer memory:\n" << opt.memory();
  const double rest = total_seconds - optimizer_seconds;
  const double pct = total_seconds > 0 ? 100.0 / total_seconds : 0.0;
  // With several ranks a step also reduce-scatters the grads, all-gathers the params and
  // waits there for the slowest rank's forward and backward.
  std::snprintf(line, sizeof line,
                "time%s: optimizer steps%s %.2f s (%.1f%%), forward/backward/data/evaluation %.2f s "
                "(%.1f%%), total %.2f s\n",
                distributed ? " (rank 0)" : "", distributed ? " with communication" : "", optimizer_seconds,
                optimizer_seconds * pct, rest, rest * pct, total_seconds);
  std::cout << line << std::flush;
  return hist;
}

/// sharded<Enc> at the ZeRO stage of --zero (1 without it). Stages 2 and 3 are built for
/// fp32 params and states only, and not for GaLore and Muon (the library runs them there;
/// distopt-replay --zero tests it): main refuses the rest before anything starts.
template <class Policy, class Param, class Enc, class... Args>
history train_sharded(const config& cfg, const prepared<Policy>& in, Args&&... args) {
  if (cfg.offload) {  // main checked: adamw, fp32, --zero S
#if defined(__linux__)
    if constexpr (std::is_same_v<Policy, distopt::adamw> && std::is_same_v<Param, float> &&
                  std::is_same_v<Enc, distopt::fp32>) {
      using device = distopt::offload<distopt::emulated_device>;
      if (cfg.zero == 1) return train_rank<Policy, Param, distopt::sharded<Enc>, distopt::any_comm, device>(cfg, in, std::forward<Args>(args)...);
      if (cfg.zero == 2) return train_rank<Policy, Param, distopt::sharded<Enc, 2>, distopt::any_comm, device>(cfg, in, std::forward<Args>(args)...);
      return train_rank<Policy, Param, distopt::sharded<Enc, 3>, distopt::any_comm, device>(cfg, in, std::forward<Args>(args)...);
    }
#endif
    throw usage_error("--offload: not built for this combination");
  }
  if constexpr (std::is_same_v<Param, float> && std::is_same_v<Enc, distopt::fp32> && !has_matrix_groups<Policy>) {
    if (cfg.zero == 2) return train_rank<Policy, Param, distopt::sharded<Enc, 2>>(cfg, in, std::forward<Args>(args)...);
    if (cfg.zero == 3) return train_rank<Policy, Param, distopt::sharded<Enc, 3>>(cfg, in, std::forward<Args>(args)...);
  }
  if (cfg.zero >= 2) throw usage_error("--zero " + std::to_string(cfg.zero) + ": not built for this combination");
  return train_rank<Policy, Param, distopt::sharded<Enc>>(cfg, in, std::forward<Args>(args)...);
}

/// --comm mpi: one rank per process. Every process checks its inputs and they agree before
/// training: if any refused, the lowest such rank prints why and every process exits with
/// code 2 (none is left waiting in a collective for a process that gave up).
template <class Policy, class Param, class Enc>
history train_mpi(const config& cfg) {
#ifdef DISTOPT_FASHION_MNIST_MPI
  distopt::mpi world(MPI_COMM_WORLD);
  const int rank = world.rank(), ranks = world.size();
  std::optional<prepared<Policy>> in;
  std::string refusal;
  try {
    if (cfg.ranks > 0 && cfg.ranks != ranks)
      throw usage_error("--ranks " + std::to_string(cfg.ranks) + " differs from the MPI world size " +
                        std::to_string(ranks) + " (mpirun -np)");
    in.emplace(prepare<Policy>(cfg, rank == 0));
  } catch (const usage_error& e) {
    refusal = e.what();
  }
  double first_refusing[1] = {refusal.empty() ? 0.0 : static_cast<double>(ranks - rank)};  // max: lowest rank
  world.all_reduce(std::span<double>(first_refusing), distopt::reduce_op::max);
  if (first_refusing[0] > 0.0) {
    if (ranks - static_cast<int>(first_refusing[0]) != rank) throw refused_elsewhere{};
    throw usage_error(rank == 0 ? refusal : "rank " + std::to_string(rank) + ": " + refusal);
  }
  return train_sharded<Policy, Param, Enc>(cfg, *in, "MPI processes", distopt::any_comm(std::move(world)));
#else
  (void)cfg;
  throw usage_error("--comm mpi: this distopt-fashion-mnist was built without MPI (configure with "
                    "-DDISTOPT_ENABLE_MPI=ON)");
#endif
}

/// One rank with replicated state, --ranks N threads, or the MPI world, both with sharded
/// state. --tp T (threads only): N x T threads, rank r = dp * T + t, the same optimizer
/// type as --ranks N (sharded over the N data-parallel ranks; with N = 1, over one).
template <class Policy, class Param, class Enc>
history train_typed(const config& cfg) {
  if (cfg.comm == "mpi") {
    if (cfg.tp > 1) throw usage_error("--tp: tensor parallelism runs its ranks as threads only, not with --comm mpi");
    return train_mpi<Policy, Param, Enc>(cfg);
  }
  const prepared<Policy> in = prepare<Policy>(cfg, /*writer=*/true);
  const int dp = std::max(cfg.ranks, 1), tp = std::max(cfg.tp, 1);
  if (cfg.backend == "kokkos") {  // one rank (main checked)
#ifdef DISTOPT_FASHION_MNIST_KOKKOS
    return train_rank<Policy, Param, distopt::replicated<Enc>, distopt::single, distopt::kokkos<>>(cfg, in, "",
                                                                                                  distopt::single{});
#else
    throw usage_error("--backend kokkos: this distopt-fashion-mnist was built without Kokkos");
#endif
  }
  if (dp == 1 && tp == 1 && cfg.zero == 0)  // with --zero, one rank runs sharded over one
    return train_rank<Policy, Param, distopt::replicated<Enc>>(cfg, in, "", distopt::single{});
  history out;
  distopt::run_ranks(dp * tp, [&](distopt::threads& world) {
    const int rank = world.rank(), d = rank / tp, t = rank % tp;
    std::optional<distopt::any_comm> tp_opt, tp_model;  // the same TP group, twice
    if (tp > 1) {
      tp_opt.emplace(world.split(d, t));
      tp_model.emplace(world.split(d, t));
    }
    distopt::any_comm dp_comm(tp > 1 ? world.split(t, d) : std::move(world));
    history h = train_sharded<Policy, Param, Enc>(cfg, in, "threads", std::move(dp_comm), std::move(tp_opt),
                                                  std::move(tp_model));
    if (rank == 0) out = std::move(h);
  });
  return out;
}

/// Runs `Policy` with state encoding `Enc` and the param number type named by --param-dtype.
template <class Policy, class Enc>
history train_encoded(const config& cfg) {
  if (cfg.param_dtype == "fp32") return train_typed<Policy, float, Enc>(cfg);
  if (cfg.param_dtype == "bf16") return train_typed<Policy, distopt::bf16, Enc>(cfg);
  throw usage_error("--param-dtype: unknown dtype '" + cfg.param_dtype + "' (fp32 or bf16)");
}

/// Runs `Policy` with the state encoding named by --state and the param number type named
/// by --param-dtype.
template <class Policy>
history train_policy(const config& cfg) {
  if (cfg.state == "q8") {
    if constexpr (distopt::policy_is_layerwise<Policy> || distopt::orthogonalizes_matrices<Policy>)
      throw usage_error("--state q8: 8-bit states are for element-wise policies (sgd, adam, adamw, lion) and "
                        "galore_adamw, not " + std::string(Policy::name));
    else return train_encoded<Policy, distopt::q8>(cfg);
  }
  return train_encoded<Policy, distopt::fp32>(cfg);
}

}  // namespace fmnist
