// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
// What every way of training shares before its loop starts: the hyper-parameters (the
// example's defaults, then --set), the groups, the data set and the log, checked and
// loaded once. Included by train.hpp (the host loops) and train_cuda.cu (--backend cuda).

#include <distopt/distopt.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "fashion_mnist.hpp"

namespace fmnist {

/// The reference's defaults, except where they do not train this model well:
/// torch.optim.SGD's lr=1e-3 without momentum barely moves in ten epochs; Lamb gets the
/// lr and weight decay of its usual recipes (torch-optimizer's lr=1e-3 without weight decay
/// trains slowly here); CAME, which has no default lr in came-pytorch (ours is the paper's
/// 2e-4), gets 1e-3. Adafactor keeps transformers' relative step size.
template <class Policy>
void apply_example_defaults(typename Policy::hyper_params& h) {
  if constexpr (std::is_same_v<Policy, distopt::sgd>) {
    h.lr = 0.05;
    h.momentum = 0.9;
  } else if constexpr (std::is_same_v<Policy, distopt::lamb>) {
    h.lr = 1e-2;
    h.weight_decay = 0.01;
  } else if constexpr (std::is_same_v<Policy, distopt::came>) {
    h.lr = 1e-3;
  } else if constexpr (distopt::projects_matrices<Policy>) {
    // GaLore's recipe (galore-torch's README): rank 128, a new projection every 200 steps,
    // scale 0.25, for the hidden layers' weights; the output layer stays full-rank.
    h.rank = 128;
    h.update_proj_gap = 200;
    h.scale = 0.25;
  } else if constexpr (distopt::orthogonalizes_matrices<Policy>) {
    // Moonlight's recipe ("Muon is Scalable for LLM Training"): the update's RMS matched to
    // AdamW's, so that the hidden layers' Muon and the other tensors' AdamW share AdamW's lr
    // (1e-3 here) and weight decay (0.1).
    h.adjust_lr_fn = decltype(h.adjust_lr_fn)::match_rms_adamw;
  }
}

/// Whether the policy keeps some matrices in groups of their own (GaLore's projected ones,
/// Muon's orthogonalised ones): the output layer's weight then goes to a third group.
template <class Policy>
inline constexpr bool has_matrix_groups =
    distopt::projects_matrices<Policy> || distopt::orthogonalizes_matrices<Policy>;

/// The group's hyper-parameters without the matrix treatment (no rank; AdamW, not Muon).
template <class Policy>
void drop_matrix_treatment(typename Policy::hyper_params& h) {
  if constexpr (distopt::projects_matrices<Policy>) h.rank.reset();
  if constexpr (distopt::orthogonalizes_matrices<Policy>) h.use_muon = false;
}

/// Every --set in order, applied to `h`.
template <class Policy>
typename Policy::hyper_params with_sets(const config& cfg, typename Policy::hyper_params h) {
  try {
    return distopt::apply_hyper_params<Policy>(std::move(h), cfg.sets);
  } catch (const distopt::invalid_hyper_parameter& e) {  // a value out of range
    throw usage_error(e.what());
  } catch (const std::invalid_argument& e) {  // a setting that does not parse
    throw usage_error(std::string("--set ") + e.what());
  }
}

/// The hyper-parameters of the weights: example defaults, then every --set in order.
template <class Policy>
typename Policy::hyper_params hyper_from(const config& cfg) {
  typename Policy::hyper_params h;
  apply_example_defaults<Policy>(h);
  return with_sets<Policy>(cfg, std::move(h));
}

/// Rank r's part of n items split over d ranks: a contiguous range, the first n % d ranks
/// taking one item more than the others (128 over 3 ranks: 43, 43, 42). Used for every
/// training batch and for the test set; a part may be empty (n < d).
struct share {
  std::size_t first = 0, count = 0;
};
inline share share_of(std::size_t n, int d, int r) {
  const auto ud = static_cast<std::size_t>(d), ur = static_cast<std::size_t>(r);
  const std::size_t base = n / ud, extra = n % ud;
  return {ur * base + std::min(ur, extra), base + (ur < extra ? 1 : 0)};
}

/// What the ranks of one process share, checked and loaded before any rank starts.
template <class Policy>
struct prepared {
  typename Policy::hyper_params decay, no_decay;
  dataset data;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> log{nullptr, &std::fclose};  // the writer's --log
};

/// The hyper-parameter groups: 0 weights, 1 biases (no weight decay); for GaLore and Muon
/// also 2, the output layer's weight, with weight decay but no projection (GaLore) or with
/// AdamW (Muon). What makes group g what it is, applied after --set (when built, and after
/// a load).
template <class Policy>
void shape_group(typename Policy::hyper_params& h, std::size_t g) {
  if (g == 1) h.weight_decay = 0.0;  // biases, without weight decay as usual in PyTorch recipes
  if (g >= 1) drop_matrix_treatment<Policy>(h);  // biases: not projected (GaLore), AdamW (Muon)
}

template <class Policy>
std::vector<typename Policy::hyper_params> groups_of(const prepared<Policy>& in) {
  std::vector<typename Policy::hyper_params> g(has_matrix_groups<Policy> ? 3 : 2, in.decay);
  for (std::size_t k = 0; k < g.size(); ++k) shape_group<Policy>(g[k], k);
  return g;
}

/// Checks what can be wrong with the run (outputs, on the process that writes them, then the
/// hyper-parameters), then loads the data and opens the log: a typo fails at once.
template <class Policy>
prepared<Policy> prepare(const config& cfg, bool writer) {
  prepared<Policy> p;
  if (writer) check_outputs(cfg);
  p.decay = hyper_from<Policy>(cfg);
  p.no_decay = p.decay;
  shape_group<Policy>(p.no_decay, 1);
  p.data = load_dataset(cfg);
  if (writer && !cfg.log_path.empty()) {
    p.log.reset(std::fopen(cfg.log_path.c_str(), "w"));
    if (!p.log) throw usage_error(cfg.log_path + ": cannot write (" + std::strerror(errno) + ")");
    std::fputs("step,epoch,loss\n", p.log.get());
  }
  return p;
}

/// The MLP's widths: the pixels, --hidden's widths, the 10 classes.
inline std::vector<int> model_sizes(const config& cfg, std::size_t pixels) {
  std::vector<int> sizes{static_cast<int>(pixels)};
  sizes.insert(sizes.end(), cfg.hidden.begin(), cfg.hidden.end());
  sizes.push_back(10);
  return sizes;
}

/// torch.nn.Linear's initialisation: kaiming_uniform_(a=sqrt(5)) on the weight and the
/// bias bound both come to U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Draws each whole tensor from
/// `rng` (weight [out, in], then bias [out], layer by layer) and hands it to use(layer,
/// t (0 weight, 1 bias), rows, cols, values). Every rank and backend draws the same values
/// from a generator seeded alike, and then the same shuffles from it.
template <class Use>
void draw_initial_params(std::mt19937& rng, const std::vector<int>& sizes, Use&& use) {
  std::vector<float> whole;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(sizes[l]));
    std::uniform_real_distribution<float> uniform(-bound, bound);
    for (int t = 0; t < 2; ++t) {
      const auto rows = static_cast<std::size_t>(sizes[l + 1]);
      const std::size_t cols = t == 0 ? static_cast<std::size_t>(sizes[l]) : 1;
      whole.resize(rows * cols);
      for (float& w : whole) w = uniform(rng);
      use(static_cast<int>(l), t, rows, cols, static_cast<const std::vector<float>&>(whole));
    }
  }
}

/// The line printed after each epoch.
inline std::string epoch_line(int epoch, int epochs, double loss, double accuracy, double seconds) {
  char line[160];
  std::snprintf(line, sizeof line, "epoch %d/%d  train loss %.4f  test accuracy %.4f  (%.1f s)\n", epoch, epochs, loss,
                accuracy, seconds);
  return line;
}

}  // namespace fmnist
