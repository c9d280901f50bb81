// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file Muon (momentum orthogonalised by Newton–Schulz), following `torch.optim.Muon`
/// (PyTorch >= 2.9), with AdamW (`torch.optim.AdamW`) for the tensors outside the Muon
/// groups in the same optimizer, as Moonlight's recipe trains: one object, one step.
///
/// In a group with `use_muon` (the default) every tensor must be a matrix (m x n), and its
/// step is torch.optim.Muon's:
///
///     B = lerp(B, G, 1 - momentum)                  (buf.lerp_(grad, 1 - momentum))
///     U = nesterov ? lerp(G, B, momentum) : B
///     O = NS(U): X = U (transposed when m > n, so that X is wide), X /= max(||X||_F, eps),
///         ns_steps times: A = X X^T;  B' = b A + c A A;  X = a X + B' X
///     p = p * (1 - lr weight_decay);  p = p - adjusted_lr O
///     adjusted_lr = lr * (original: sqrt(max(1, m / n)) | match_rms_adamw: 0.2 sqrt(max(m, n))
///                         | spectral_unclamped: sqrt(m / n))
///
/// PyTorch runs NS in bf16 (`ns_dtype = bf16` here: every product and sum rounded to bf16
/// where torch's bf16 tensors round); `ns_dtype = fp32` (the default here) keeps it in fp32.
/// A group with `use_muon = false` is AdamW with lr, betas, adamw_eps and weight_decay.
///
/// Pieces: `muon` (hyper-parameters, the per-element functions, `DISTOPT_HD`) and
/// `muon_newton_schulz` (host: NS of one matrix through BLAS sgemm on one BLAS thread, so
/// that the bits do not depend on any thread count; link distopt::muon). The optimizer's
/// orthogonalisation stage (engine/orthogonal.hpp) keeps the momentum sharded like any
/// element state and runs NS on whole matrices.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/lapack.hpp"
#include "../engine/orthogonal.hpp"
#include "../step_info.hpp"
#include "../types/rounding.hpp"
#include "adam.hpp"
#include "hyper_params.hpp"
#include "hyper_text.hpp"

namespace distopt {

/// torch.optim.Muon's `adjust_lr_fn` (None reads as original).
enum class muon_adjust_lr { original, match_rms_adamw, spectral_unclamped };
/// The number type Newton–Schulz runs in: fp32, or bf16 as torch.optim.Muon computes it.
enum class muon_ns_dtype { fp32, bf16 };

constexpr std::string_view muon_adjust_lr_name(muon_adjust_lr a) noexcept {
  switch (a) {
    case muon_adjust_lr::original:
      return "original";
    case muon_adjust_lr::match_rms_adamw:
      return "match_rms_adamw";
    case muon_adjust_lr::spectral_unclamped:
      return "spectral_unclamped";
  }
  return "?";
}

constexpr std::string_view muon_ns_dtype_name(muon_ns_dtype d) noexcept {
  return d == muon_ns_dtype::bf16 ? "bf16" : "fp32";
}

struct muon {
  static constexpr std::string_view name = "muon";
  /// Slots: Muon groups 0 momentum_buffer; AdamW groups 0 exp_avg, 1 exp_avg_sq.
  static constexpr int max_state_slots = 3;  // adamw's update touches a third (amsgrad) slot: never stored
  static constexpr int min_state_slots = 1;  // the update loops are built for 1..max_state_slots
  static constexpr bool nonnegative_slot(int k) { return k >= 1; }

  /// torch.optim.Muon's arguments and defaults, plus `ns_dtype`, `use_muon` and the AdamW
  /// keys of groups without Muon (torch.optim.AdamW's betas and eps; `adamw_eps` here,
  /// since `eps` is Muon's).
  struct hyper_params {
    double lr = 1e-3;
    double weight_decay = 0.1;
    double momentum = 0.95;
    bool nesterov = true;
    std::array<double, 3> ns_coefficients{3.4445, -4.7750, 2.0315};
    double eps = 1e-7;
    int ns_steps = 5;
    muon_adjust_lr adjust_lr_fn = muon_adjust_lr::original;
    muon_ns_dtype ns_dtype = muon_ns_dtype::fp32;
    bool use_muon = true;
    std::array<double, 2> betas{0.9, 0.999};
    double adamw_eps = 1e-8;

    /// The keys hyper_text.hpp reads and writes by itself; adjust_lr_fn and ns_dtype (names)
    /// are handled by the set_hyper_param / hyper_params_string specialisations below.
    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
          hyper_field<hyper_params, double>{"momentum", &hyper_params::momentum},
          hyper_field<hyper_params, bool>{"nesterov", &hyper_params::nesterov},
          hyper_field<hyper_params, std::array<double, 3>>{"ns_coefficients", &hyper_params::ns_coefficients},
          hyper_field<hyper_params, double>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, int>{"ns_steps", &hyper_params::ns_steps},
          hyper_field<hyper_params, bool>{"use_muon", &hyper_params::use_muon},
          hyper_field<hyper_params, std::array<double, 2>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"adamw_eps", &hyper_params::adamw_eps}};
    }

    /// torch.optim.Muon's checks (lr, momentum, weight_decay >= 0; ns_steps < 100), and
    /// what it leaves to fail later or never: finite coefficients, eps >= 0, ns_steps >= 1.
    void validate() const {
      require_lr(name, lr);
      require_weight_decay(name, weight_decay);
      require(std::isfinite(momentum) && momentum >= 0.0 && momentum < 1.0, name, "momentum", momentum,
              "must be in [0, 1)");
      for (double c : ns_coefficients)
        require(std::isfinite(c), name, "ns_coefficients", c, "must be finite numbers");
      require(std::isfinite(eps) && eps >= 0.0, name, "eps", eps, "must be a finite value >= 0");
      require(ns_steps >= 1 && ns_steps < 100, name, "ns_steps", ns_steps,
              "must be in [1, 100) (torch.optim.Muon refuses 100 or more)");
      require_betas(name, betas);
      require(std::isfinite(adamw_eps) && adamw_eps >= 0.0, name, "adamw_eps", adamw_eps,
              "must be a finite value >= 0");
    }
  };

  static int state_slots(const hyper_params& h) { return h.use_muon ? 1 : 2; }

  /// torch's lerp(start, end, w) with w rounded to float: start + w (end - start) for
  /// |w| < 0.5, else end - (end - start) (1 - w).
  struct lerp_weight {
    float w, one_minus_w;
    bool small;
    DISTOPT_HD float operator()(float start, float end) const {
      return small ? start + w * (end - start) : end - (end - start) * one_minus_w;
    }
  };
  static lerp_weight make_lerp(double w) {
    const float f = static_cast<float>(w);
    return {f, 1.0f - f, std::fabs(f) < 0.5f};
  }

  /// Per-step, per-group values, rounded to float32 as PyTorch rounds Python floats.
  struct scalars {
    detail::adam_family<true>::scalars adamw;  // groups without Muon
    lerp_weight to_grad;                       // buf.lerp_(grad, 1 - momentum)
    lerp_weight to_buf;                        // grad.lerp(buf, momentum)
    bool nesterov;
    float decay;  // param.mul_(1 - lr * weight_decay)
  };

  static scalars prepare(const hyper_params& h, const step_info& s) {
    detail::adam_family<true>::hyper_params a;
    a.lr = h.lr;
    a.betas = h.betas;
    a.eps = h.adamw_eps;
    a.weight_decay = h.weight_decay;
    return {detail::adam_family<true>::prepare(a, s), make_lerp(1.0 - h.momentum), make_lerp(h.momentum),
            h.nesterov, static_cast<float>(1.0 - h.lr * h.weight_decay)};
  }

  /// Whether the tensors of a group are Muon matrices (the optimizer refuses other shapes).
  static bool orthogonalizes(const hyper_params& h) { return h.use_muon; }

  /// torch's _adjust_lr: the learning rate of an m x n matrix's orthogonalised update.
  static double adjusted_lr(const hyper_params& h, std::int64_t m, std::int64_t n) {
    const double a = static_cast<double>(m), b = static_cast<double>(n);
    switch (h.adjust_lr_fn) {
      case muon_adjust_lr::match_rms_adamw:
        return h.lr * 0.2 * std::sqrt(std::max(a, b));
      case muon_adjust_lr::spectral_unclamped:
        return h.lr * std::sqrt(a / b);
      case muon_adjust_lr::original:
        break;
    }
    return h.lr * std::sqrt(std::max(1.0, a / b));
  }

  /// The momentum buffer after gradient element g: buf.lerp_(grad, 1 - momentum).
  DISTOPT_HD static float momentum_buffer(const scalars& s, float g, float buf) { return s.to_grad(buf, g); }
  /// The element of the matrix NS orthogonalises, from g and the (stored) new buffer.
  DISTOPT_HD static float blend(const scalars& s, float g, float buf) { return s.nesterov ? s.to_buf(g, buf) : buf; }

  /// Applies one element of the orthogonalised update O: param.mul_(1 - lr weight_decay),
  /// then param.add_(O, alpha=-adjusted_lr).
  DISTOPT_HD static void apply(const scalars& s, float& p, float o, float neg_adjusted_lr) {
    p = p * s.decay;
    p = p + neg_adjusted_lr * o;
  }

  /// The step of an element of a group without Muon: torch.optim.AdamW's.
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    detail::adam_family<true>::update(s.adamw, p, g, state);
  }
};

/// Newton–Schulz of one m x n matrix, as torch.optim.Muon's _zeropower_via_newtonschulz,
/// in fp32 or in bf16 (each matrix product, with its addmm terms, rounded once to bf16, as
/// a bf16 tensor result is). The products run through cblas_sgemm on one BLAS thread per
/// call, cut into tiles of `tile` x `tile` outputs that a parallel_for may run on any
/// threads: the cut does not depend on the thread count, so neither do the bits. The
/// Frobenius norm is summed in double in a fixed order. Holds its work buffers.
class muon_newton_schulz {
 public:
  static constexpr std::int64_t tile = 128;

  /// O = NS(U) for row-major m x n `u`, into row-major m x n `out`, one tile after another.
  void run(const muon::hyper_params& h, const float* u, std::int64_t m, std::int64_t n, float* out) {
    run(h, u, m, n, out, [](std::size_t count, const auto& f) {
      for (std::size_t i = 0; i < count; ++i) f(i);
    });
  }

  /// The same, with `parallel_for(count, f)` calling f(i) for each tile i in [0, count)
  /// (an executor's parallel_for).
  template <class ParallelFor>
  void run(const muon::hyper_params& h, const float* u, std::int64_t m, std::int64_t n, float* out,
           ParallelFor&& parallel_for) {
    const bool tall = m > n;
    const std::int64_t r = tall ? n : m, c = tall ? m : n;  // X is r x c, r <= c
    const std::size_t rc = static_cast<std::size_t>(r * c), rr = static_cast<std::size_t>(r * r);
    x_.resize(rc);
    y_.resize(rc);
    a_.resize(rr);
    b_.resize(rr);
    if (tall) {
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) x_[static_cast<std::size_t>(j * m + i)] = u[i * n + j];
    } else {
      std::copy(u, u + rc, x_.begin());
    }
    const bool half = h.ns_dtype == muon_ns_dtype::bf16;
    const auto round = [half](std::vector<float>& v) {
      if (half)
        for (float& e : v) e = to_float(from_float<bf16>(e));
    };
    round(x_);
    double sq = 0.0;
    for (float e : x_) sq += static_cast<double>(e) * e;
    float norm = static_cast<float>(std::sqrt(sq));
    norm = std::max(half ? to_float(from_float<bf16>(norm)) : norm, static_cast<float>(h.eps));
    if (half) norm = to_float(from_float<bf16>(norm));  // clamp(min=eps) of a bf16 tensor is bf16
    for (float& e : x_) e = e / norm;
    round(x_);
    const float a = static_cast<float>(h.ns_coefficients[0]), b = static_cast<float>(h.ns_coefficients[1]),
                cc = static_cast<float>(h.ns_coefficients[2]);
    // C (r x cols) = alpha L op(R) + beta C, tile by tile: tile (i, j) holds rows
    // [i0, i1) and columns [j0, j1) of C, from rows [i0, i1) of L and columns [j0, j1) of
    // op(R) (rows of R when transposed). A symmetric product (X X^T, and A A = A A^T)
    // computes the tiles on and above the diagonal, then copies the upper triangle into
    // the lower one: a third fewer flops per iteration, and exactly symmetric.
    const detail::blas_single_thread one_thread;  // this thread; workers pin their own
    const auto product = [&](bool symmetric, bool trans_r, std::int64_t cols, std::int64_t k, const float* l,
                             const float* rhs, std::int64_t ld_r, float* dst, float alpha, float beta) {
      const auto down = (r + tile - 1) / tile, across = (cols + tile - 1) / tile;
      parallel_for(static_cast<std::size_t>(down * across), [&](std::size_t t) {
        const std::int64_t i0 = static_cast<std::int64_t>(t) / across * tile, i1 = std::min(r, i0 + tile);
        const std::int64_t j0 = static_cast<std::int64_t>(t) % across * tile, j1 = std::min(cols, j0 + tile);
        if (symmetric && j1 <= i0) return;  // strictly below the diagonal: mirrored below
        const detail::blas_worker_thread worker;
        const float* rj = trans_r ? rhs + j0 * ld_r : rhs + j0;
        detail::sgemm_as_set(false, trans_r, i1 - i0, j1 - j0, k, l + i0 * k, k, rj, ld_r, dst + i0 * cols + j0,
                             cols, alpha, beta);
      });
      if (symmetric)
        for (std::int64_t i = 1; i < r; ++i)
          for (std::int64_t j = 0; j < i; ++j) dst[i * cols + j] = dst[j * cols + i];
    };
    for (int s = 0; s < h.ns_steps; ++s) {
      product(true, true, r, c, x_.data(), x_.data(), c, a_.data(), 1.0f, 0.0f);  // A = X X^T
      round(a_);
      b_ = a_;
      product(true, true, r, r, a_.data(), a_.data(), r, b_.data(), cc, b);  // B = b A + c A A^T
      round(b_);
      y_ = x_;
      product(false, false, c, r, b_.data(), x_.data(), c, y_.data(), 1.0f, a);  // X = a X + B X
      round(y_);
      x_.swap(y_);
    }
    if (tall) {
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) out[i * n + j] = x_[static_cast<std::size_t>(j * m + i)];
    } else {
      std::copy(x_.begin(), x_.end(), out);
    }
  }

  /// Throws std::invalid_argument naming `name` when an m x n matrix does not fit BLAS's
  /// 32-bit dimensions.
  static void check_shape(const std::string& name, std::int64_t m, std::int64_t n) {
    try {
      detail::lapack_dim(std::max(m, n), "muon", "the matrix's larger side");
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("muon: tensor '" + name + "': " + e.what());
    }
  }

  /// Bytes of work memory for an m x n matrix (two r x c and two r x r, r = min(m, n)).
  static std::size_t work_bytes(std::int64_t m, std::int64_t n) {
    const auto r = static_cast<std::size_t>(std::min(m, n)), c = static_cast<std::size_t>(std::max(m, n));
    return (2 * r * c + 2 * r * r) * sizeof(float);
  }

 private:
  std::vector<float> x_, y_, a_, b_;
};

/// The optimizer runs the Muon groups' matrices through muon_newton_schulz
/// (engine/orthogonal.hpp).
template <>
struct matrix_orthogonalizer<muon> {
  using type = muon_newton_schulz;
};

namespace detail {
/// muon's keys that hyper_text.hpp handles by itself (everything but adjust_lr_fn, ns_dtype).
struct muon_text_fields {
  static constexpr std::string_view name = muon::name;
  using hyper_params = muon::hyper_params;
};
}  // namespace detail

/// `--set` for muon: `adjust_lr_fn` takes original (or None), match_rms_adamw or
/// spectral_unclamped; `ns_dtype` fp32 or bf16; the other keys as for every policy.
template <>
inline void set_hyper_param<muon>(muon::hyper_params& h, std::string_view key, std::string_view value) {
  if (key == "adjust_lr_fn") {
    if (value == "None" || value == "none" || value == "null") value = "original";
    for (auto a : {muon_adjust_lr::original, muon_adjust_lr::match_rms_adamw, muon_adjust_lr::spectral_unclamped})
      if (muon_adjust_lr_name(a) == value) return void(h.adjust_lr_fn = a);
    throw std::invalid_argument("muon: invalid adjust_lr_fn '" + std::string(value) +
                                "': must be original (or None), match_rms_adamw or spectral_unclamped");
  }
  if (key == "ns_dtype") {
    for (auto d : {muon_ns_dtype::fp32, muon_ns_dtype::bf16})
      if (muon_ns_dtype_name(d) == value) return void(h.ns_dtype = d);
    throw std::invalid_argument("muon: invalid ns_dtype '" + std::string(value) + "': must be fp32 or bf16");
  }
  try {
    set_hyper_param<detail::muon_text_fields>(h, key, value);
  } catch (const std::invalid_argument& e) {
    if (std::string_view(e.what()).find("unknown hyper-parameter") == std::string_view::npos) throw;
    throw std::invalid_argument("muon: unknown hyper-parameter '" + std::string(key) +
                                "' (known: lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, "
                                "adjust_lr_fn, ns_dtype, use_muon, betas, adamw_eps)");
  }
}

/// "lr=0.001 weight_decay=0.1 ... adjust_lr_fn=original ns_dtype=fp32"; set_hyper_param<muon>
/// reads it back.
template <>
inline std::string hyper_params_string<muon>(const muon::hyper_params& h) {
  std::string s = hyper_params_string<detail::muon_text_fields>(h);
  s += " adjust_lr_fn=";
  s += muon_adjust_lr_name(h.adjust_lr_fn);
  s += " ns_dtype=";
  s += muon_ns_dtype_name(h.ns_dtype);
  return s;
}

}  // namespace distopt
