// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
#pragma once
/// \file GaLore-AdamW (Zhao et al., "GaLore: Memory-Efficient LLM Training by Gradient
/// Low-Rank Projection"), following galore-torch 1.0's `GaLoreAdamW` and `GaLoreProjector`:
/// the math core, ready for the optimizer engine.
///
/// A group without `rank` is the AdamW of transformers (eps 1e-6, `correct_bias`, weight
/// decay after the update). In a group with `rank`, each 2-D tensor's gradient G (m x n) is
/// projected to a low-rank R by a matrix taken from the SVD of G, refreshed every
/// `update_proj_gap` steps; Adam runs on R (its states have R's shape and are kept across
/// refreshes, as galore-torch keeps them), and the normalised update is projected back,
/// times `scale`:
///
///     iter = steps taken before this one (0 on the first step)
///     if no projection yet or iter % update_proj_gap == 0: refresh from G
///     R = project(G);  m = b1 m + (1 - b1) R;  v = b2 v + (1 - b2) R^2
///     N = m / (sqrt(v) + eps);  U = project_back(N) * scale
///     p += -step_size U,  step_size = lr sqrt(1 - b2^t) / (1 - b1^t)  (lr without correct_bias)
///     if weight_decay > 0: p += (-lr weight_decay) p
///
/// Pieces: `galore_adamw` (hyper-parameters and the per-element functions, `DISTOPT_HD`)
/// and `galore_projector` (host: the SVD and the projections of one matrix, through
/// LAPACK/BLAS; link distopt::galore). Only float32 on the host for now.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "../concepts.hpp"
#include "../config.hpp"
#include "../detail/lapack.hpp"
#include "../engine/projection.hpp"
#include "../step_info.hpp"
#include "hyper_params.hpp"
#include "hyper_text.hpp"

namespace distopt {

/// galore-torch's `proj_type`: which side(s) of G the projection multiplies.
///   std_         m >= n: right (R = G P^T, m x r), else left (R = Q^T G, r x n): the smaller side
///   reverse_std  the opposite choice: m >= n: left, else right
///   left         R = Q^T G (r x n), Q = U[:, :r]
///   right        R = G P^T (m x r), P = Vh[:r, :]
///   full         R = Q^T G P^T (r x r)
enum class galore_proj { std_, reverse_std, left, right, full };

/// galore-torch's spelling of `p` ("std", "reverse_std", "left", "right", "full").
constexpr std::string_view galore_proj_name(galore_proj p) noexcept {
  switch (p) {
    case galore_proj::std_:
      return "std";
    case galore_proj::reverse_std:
      return "reverse_std";
    case galore_proj::left:
      return "left";
    case galore_proj::right:
      return "right";
    case galore_proj::full:
      return "full";
  }
  return "?";
}

/// The projection type spelled `text`; throws invalid_hyper_parameter naming the text and
/// the valid spellings otherwise (galore-torch itself would fail later: with an unknown
/// proj_type its `project` returns an unbound variable).
inline galore_proj parse_galore_proj(std::string_view text) {
  for (auto p : {galore_proj::std_, galore_proj::reverse_std, galore_proj::left, galore_proj::right,
                 galore_proj::full})
    if (galore_proj_name(p) == text) return p;
  throw invalid_hyper_parameter("galore_adamw: invalid proj_type '" + std::string(text) +
                                "': must be one of std, reverse_std, left, right, full");
}

/// GaLore-AdamW's hyper-parameters and per-element math. `update` is the step of a group
/// without `rank` (a plain AdamW element); in a group with `rank`, run `moments` on each
/// element of the projected gradient, project the results back with `galore_projector`,
/// then `apply` on each parameter element.
struct galore_adamw {
  static constexpr std::string_view name = "galore_adamw";
  /// Slots: 0 exp_avg, 1 exp_avg_sq (per element of the projected gradient in a rank group).
  static constexpr int max_state_slots = 2;
  static constexpr int min_state_slots = 2;  // the update loops are built for 2..max_state_slots
  /// exp_avg_sq never goes negative (8-bit states may give it the unsigned map).
  static constexpr bool nonnegative_slot(int k) { return k == 1; }

  /// galore_torch.GaLoreAdamW arguments and defaults, plus the GaLore group keys. galore-torch
  /// has no defaults for the group keys (a group with `rank` must name all four); the
  /// defaults here are GaLoreProjector's constructor defaults.
  struct hyper_params {
    double lr = 1e-3;
    std::array<double, 2> betas{0.9, 0.999};
    double eps = 1e-6;
    double weight_decay = 0.0;
    bool correct_bias = true;
    /// Empty: a plain group (galore-torch: a group without 'rank').
    std::optional<int> rank{};
    int update_proj_gap = 200;
    double scale = 1.0;
    galore_proj proj_type = galore_proj::std_;

    /// The keys hyper_text.hpp can read and write itself; `rank` (an integer or None) and
    /// `proj_type` (a name) are handled by the set_hyper_param / hyper_params_string
    /// specialisations below.
    static constexpr auto fields() {
      return std::tuple{
          hyper_field<hyper_params, double>{"lr", &hyper_params::lr},
          hyper_field<hyper_params, std::array<double, 2>>{"betas", &hyper_params::betas},
          hyper_field<hyper_params, double>{"eps", &hyper_params::eps},
          hyper_field<hyper_params, double>{"weight_decay", &hyper_params::weight_decay},
          hyper_field<hyper_params, bool>{"correct_bias", &hyper_params::correct_bias},
          hyper_field<hyper_params, int>{"update_proj_gap", &hyper_params::update_proj_gap},
          hyper_field<hyper_params, double>{"scale", &hyper_params::scale}};
    }

    /// galore-torch checks lr, betas and eps like this; it silently ignores a negative
    /// weight_decay (`if weight_decay > 0`) and checks none of the group keys (rank <= 0,
    /// update_proj_gap <= 0 fail or misbehave only inside its step), which are refused here.
    /// rank against the matrix shape is checked by galore_projector.
    void validate() const {
      require_lr(name, lr);
      require(std::isfinite(eps) && eps >= 0.0, name, "eps", eps, "must be a finite value >= 0");
      require_betas(name, betas);
      require_weight_decay(name, weight_decay);
      if (rank)
        require(*rank >= 1, name, "rank", *rank, "must be >= 1 (or None for a plain group)");
      require(update_proj_gap >= 1, name, "update_proj_gap", update_proj_gap, "must be >= 1");
      require(std::isfinite(scale) && scale > 0.0, name, "scale", scale,
              "must be a finite value > 0");
    }
  };

  static int state_slots(const hyper_params&) { return 2; }

  /// Whether the 2-D tensors of a group with these hyper-parameters are projected (a
  /// group with a rank); the optimizer refuses other shapes in such a group.
  static bool projects(const hyper_params& h) { return h.rank.has_value(); }

  /// Per-step, per-group values, rounded to float32 the way PyTorch rounds Python floats.
  struct scalars {
    float beta1, one_minus_beta1;  // exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    float beta2, one_minus_beta2;  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    float eps;
    float neg_step_size;  // alpha=-step_size, step_size formed in double
    float neg_decay;      // alpha=(-lr * weight_decay) when weight_decay > 0, else 0
  };

  /// `s.step` is the step being taken, from 1 (galore-torch's state["step"] after its increment).
  static scalars prepare(const hyper_params& h, const step_info& s) {
    const double t = static_cast<double>(s.step);
    double step_size = h.lr;
    if (h.correct_bias) {
      const double bias_correction1 = 1.0 - std::pow(h.betas[0], t);
      const double bias_correction2 = 1.0 - std::pow(h.betas[1], t);
      step_size = step_size * std::sqrt(bias_correction2) / bias_correction1;
    }
    return {static_cast<float>(h.betas[0]),
            static_cast<float>(1.0 - h.betas[0]),
            static_cast<float>(h.betas[1]),
            static_cast<float>(1.0 - h.betas[1]),
            static_cast<float>(h.eps),
            static_cast<float>(-step_size),
            h.weight_decay > 0.0 ? static_cast<float>(-h.lr * h.weight_decay) : 0.0f};
  }

  /// Updates the moments from one (projected) gradient element and returns
  /// norm_grad = exp_avg / (sqrt(exp_avg_sq) + eps), in galore-torch's operation order.
  DISTOPT_HD static float moments(const scalars& s, float g, float* state) {
    float& m = state[0];
    float& v = state[1];
    m = m * s.beta1;
    m = m + s.one_minus_beta1 * g;
    v = v * s.beta2;
    v = v + (s.one_minus_beta2 * g) * g;  // addcmul: self + value * t1 * t2
    const float denom = std::sqrt(v) + s.eps;
    return m / denom;
  }

  /// Applies one element of the full-size update (already projected back and scaled):
  /// p.add_(u, alpha=-step_size), then p.add_(p, alpha=-lr * weight_decay) when
  /// weight_decay > 0 (with no decay the second term is p + 0 * p = p).
  DISTOPT_HD static void apply(const scalars& s, float& p, float u) {
    p = p + s.neg_step_size * u;
    p = p + s.neg_decay * p;
  }

  /// The whole step of an element in a group without `rank`.
  DISTOPT_HD static void update(const scalars& s, float& p, float g, float* state) {
    apply(s, p, moments(s, g, state));
  }
};

namespace detail {
/// galore_adamw's keys that hyper_text.hpp handles by itself (everything but rank, proj_type).
struct galore_adamw_text_fields {
  static constexpr std::string_view name = galore_adamw::name;
  using hyper_params = galore_adamw::hyper_params;
};
}  // namespace detail

/// `--set` for galore_adamw: `rank` takes an integer or None, `proj_type` one of std,
/// reverse_std, left, right, full; the other keys as for every policy.
template <>
inline void set_hyper_param<galore_adamw>(galore_adamw::hyper_params& h, std::string_view key,
                                          std::string_view value) {
  if (key == "rank") {
    if (value == "None" || value == "none" || value == "null") {
      h.rank.reset();
      return;
    }
    int r = 0;
    if (!detail::parse_value(value, r))
      throw std::invalid_argument(
          "galore_adamw: hyper-parameter 'rank' expects an integer or "
          "None, got '" +
          std::string(value) + "'");
    h.rank = r;
    return;
  }
  if (key == "proj_type") {
    h.proj_type = parse_galore_proj(value);
    return;
  }
  try {
    set_hyper_param<detail::galore_adamw_text_fields>(h, key, value);
  } catch (const std::invalid_argument& e) {
    if (std::string_view(e.what()).find("unknown hyper-parameter") == std::string_view::npos) throw;
    throw std::invalid_argument("galore_adamw: unknown hyper-parameter '" + std::string(key) +
                                "' (known: lr, betas, eps, weight_decay, correct_bias, rank, "
                                "update_proj_gap, scale, proj_type)");
  }
}

/// "lr=0.001 betas=0.9,0.999 eps=1e-06 ... rank=None update_proj_gap=200 scale=1 proj_type=std",
/// in galore-torch's order; set_hyper_param<galore_adamw> reads it back.
template <>
inline std::string hyper_params_string<galore_adamw>(const galore_adamw::hyper_params& h) {
  std::string s;
  const auto add = [&s](std::string_view key, const std::string& value) {
    if (!s.empty()) s += ' ';
    s += key;
    s += '=';
    s += value;
  };
  add("lr", detail::value_string(h.lr));
  add("betas", detail::value_string(h.betas));
  add("eps", detail::value_string(h.eps));
  add("weight_decay", detail::value_string(h.weight_decay));
  add("correct_bias", detail::value_string(h.correct_bias));
  add("rank", h.rank ? std::to_string(*h.rank) : std::string("None"));
  add("update_proj_gap", detail::value_string(h.update_proj_gap));
  add("scale", detail::value_string(h.scale));
  add("proj_type", std::string(galore_proj_name(h.proj_type)));
  return s;
}

/// Which factor(s) of the SVD a projector keeps for its matrix.
enum class galore_side {
  left,   ///< Q = U[:, :r] (m x r); R = Q^T G (r x n); back: Q N
  right,  ///< P = Vh[:r, :] (r x n); R = G P^T (m x r); back: N P
  full    ///< both; R = (Q^T G) P^T (r x r); back: (Q N) P
};

/// GaLore's projection of one m x n float32 matrix (galore-torch's GaLoreProjector, one per
/// parameter), on the host. Holds rank, update_proj_gap, scale, proj_type and the
/// orthogonal factor(s) taken from the last refresh.
///
/// Use per step, with `iter` the number of steps taken before this one:
///     if (p.refresh_due(iter)) p.refresh(G, m, n);
///     p.project(G, R);  ... Adam on R ...;  p.project_back(N, U);
/// Matrix products run through cblas_sgemm on one BLAS thread (see detail/lapack.hpp), in
/// galore-torch's association order; the scale multiplies after the product, as torch's
/// `full_rank_grad * self.scale` does.
///
/// Shapes galore-torch mishandles, refused here instead:
///   - rank > min(m, n): galore-torch slices U[:, :rank] / Vh[:rank] silently down to
///     min(m, n) columns/rows (so the "low-rank" states are full-size); refused here.
///   - reverse_std with m < n and rank == m: galore-torch projects to m x m and its
///     project_back (which tests the low-rank shape, rows <= cols) then multiplies
///     P (m x n) by an m x m matrix and raises a shape error; refused here up front.
///   - tensors that are not 2-D are the caller's business: galore-torch raises on them
///     in a rank group (1-D: shape[1] out of range, or linalg.svd needs 2 dimensions;
///     3-D: batched SVD, then shape errors in the matmuls or .t() of a 3-D tensor).
class galore_projector {
 public:
  galore_projector() = default;
  explicit galore_projector(int rank, int update_proj_gap = 200, double scale = 1.0,
                            galore_proj proj_type = galore_proj::std_)
      : rank_(rank), gap_(update_proj_gap), scale_(scale), type_(proj_type) {
    galore_adamw::hyper_params h;
    h.rank = rank;
    h.update_proj_gap = update_proj_gap;
    h.scale = scale;
    h.proj_type = proj_type;
    h.validate();
  }
  /// The projector for one matrix of a group with `rank` (throws if the group has none).
  explicit galore_projector(const galore_adamw::hyper_params& h)
      : galore_projector(h.rank ? *h.rank : 0, h.update_proj_gap, h.scale, h.proj_type) {}

  int rank() const noexcept { return rank_; }
  int update_proj_gap() const noexcept { return gap_; }
  double scale() const noexcept { return scale_; }
  galore_proj proj_type() const noexcept { return type_; }

  /// Whether the step with `iter` earlier steps refreshes the projection: galore-torch's
  /// `ortho_matrix is None or iter % update_proj_gap == 0` (so steps 0, gap, 2 gap, ...).
  bool refresh_due(std::int64_t iter) const noexcept { return !ready_ || iter % gap_ == 0; }

  /// The side(s) galore-torch projects an m x n matrix on with this proj_type.
  galore_side side_for(std::int64_t m, std::int64_t n) const noexcept {
    switch (type_) {
      case galore_proj::std_:
        return m >= n ? galore_side::right : galore_side::left;
      case galore_proj::reverse_std:
        return m >= n ? galore_side::left : galore_side::right;
      case galore_proj::left:
        return galore_side::left;
      case galore_proj::right:
        return galore_side::right;
      case galore_proj::full:
        return galore_side::full;
    }
    return galore_side::full;
  }

  /// Shape {rows, cols} of the projected gradient (and of the Adam states) of an m x n
  /// matrix. Throws std::invalid_argument for the shapes galore-torch cannot handle (above).
  std::array<std::int64_t, 2> low_rank_shape(std::int64_t m, std::int64_t n) const {
    check_shape(m, n);
    const std::int64_t r = rank_;
    switch (side_for(m, n)) {
      case galore_side::left:
        return {r, n};
      case galore_side::right:
        return {m, r};
      case galore_side::full:
        return {r, r};
    }
    return {r, r};
  }

  /// Recomputes the projection from the row-major m x n gradient `g`: the thin SVD of g in
  /// float32 (LAPACK sgesdd_, as torch.linalg.svd), keeping U[:, :r] and/or Vh[:r, :].
  void refresh(const float* g, std::int64_t m, std::int64_t n) {
    check_shape(m, n);
    const auto f =
        detail::svd_thin<float>(std::span<const float>(g, static_cast<std::size_t>(m * n)), m, n);
    refresh(f);
  }

  /// Takes the projection from a thin SVD computed elsewhere (another LAPACK, a GPU solver,
  /// or a reference's factors in tests): keeps U[:, :r] and/or Vh[:r, :] of `f`.
  void refresh(const detail::thin_svd<float>& f) {
    check_shape(f.m, f.n);
    const std::int64_t m = f.m, n = f.n, k = f.k, r = rank_;
    if (k != std::min(m, n) || static_cast<std::int64_t>(f.u.size()) != m * k ||
        static_cast<std::int64_t>(f.vh.size()) != k * n)
      throw std::invalid_argument("galore_projector::refresh: SVD factors do not match an " +
                                  dims(m, n) + " matrix");
    const galore_side side = side_for(m, n);
    std::vector<float> q(side != galore_side::right ? static_cast<std::size_t>(m * r) : 0);
    std::vector<float> p(side != galore_side::left ? static_cast<std::size_t>(r * n) : 0);
    detail::take_factors(f, r, q.empty() ? nullptr : q.data(), p.empty() ? nullptr : p.data());
    set_ortho(m, n, std::move(q), std::move(p));
  }

  /// Installs the factors directly (checkpoint restore): `left` Q (m x r) for the left and
  /// full sides, `right` P (r x n) for the right and full sides, empty where unused.
  void set_ortho(std::int64_t m, std::int64_t n, std::vector<float> left,
                 std::vector<float> right) {
    check_shape(m, n);
    const galore_side side = side_for(m, n);
    const std::size_t want_q = side == galore_side::right ? 0 : static_cast<std::size_t>(m * rank_);
    const std::size_t want_p = side == galore_side::left ? 0 : static_cast<std::size_t>(rank_ * n);
    if (left.size() != want_q || right.size() != want_p)
      throw std::invalid_argument("galore_projector::set_ortho: a " + dims(m, n) + " matrix with " +
                                  std::string(galore_proj_name(type_)) + " projection and rank " +
                                  std::to_string(rank_) + " needs " + std::to_string(want_q) +
                                  " left and " + std::to_string(want_p) + " right values, got " +
                                  std::to_string(left.size()) + " and " +
                                  std::to_string(right.size()));
    m_ = m;
    n_ = n;
    side_ = side;
    q_ = std::move(left);
    p_ = std::move(right);
    ready_ = true;
  }

  /// Whether a refresh has happened (galore-torch: ortho_matrix is not None).
  bool has_ortho() const noexcept { return ready_; }
  std::int64_t rows() const noexcept { return m_; }
  std::int64_t cols() const noexcept { return n_; }
  galore_side side() const noexcept { return side_; }
  /// Q = U[:, :r], m x r row-major (empty for the right side).
  std::span<const float> left() const noexcept { return q_; }
  /// P = Vh[:r, :], r x n row-major (empty for the left side).
  std::span<const float> right() const noexcept { return p_; }

  /// R = the projection of the m x n gradient `g` (the matrix of the last refresh) into
  /// `low` (low_rank_shape(m, n) elements, row-major).
  void project(const float* g, float* low) const {
    require_ready("project");
    std::vector<float> tmp(side_ == galore_side::full ? static_cast<std::size_t>(rank_ * n_) : 0);
    project_products(host_gemm, side_, m_, n_, rank_, q_.data(), p_.data(), g, low, tmp.data());
  }

  /// `full` (m x n) = project_back(`low`) * scale. Which side multiplies follows
  /// galore-torch's tests on the low-rank shape (std: rows >= cols -> N P, else Q N;
  /// reverse_std: rows <= cols -> Q N, else N P); for the shapes accepted here they agree
  /// with the side of the projection.
  void project_back(const float* low, float* full) const {
    require_ready("project_back");
    std::vector<float> tmp(side_ == galore_side::full ? static_cast<std::size_t>(m_ * rank_) : 0);
    project_back_products(host_gemm, side_, m_, n_, rank_, q_.data(), p_.data(), low, full, tmp.data());
    const float scale = static_cast<float>(scale_);  // tensor * Python float: a float multiply
    if (scale != 1.0f)
      for (std::int64_t i = 0; i < m_ * n_; ++i) full[i] = full[i] * scale;
  }

  /// The products of project() with the factors `q` (m x r) and `p` (r x n) in any memory,
  /// in galore-torch's association order, through `gemm(trans_a, trans_b, rows, cols,
  /// inner, a, lda, b, ldb, c)`: row-major c = op(a) op(b) with rows `cols` apart
  /// (detail::sgemm_row_major's meaning). `tmp`: r x n floats for the full side. project()
  /// runs them on the host, the optimizer's projection engine on a device executor's memory.
  template <class Gemm>
  static void project_products(Gemm&& gemm, galore_side side, std::int64_t m, std::int64_t n, std::int64_t r,
                               const float* q, const float* p, const float* g, float* low, float* tmp) {
    switch (side) {
      case galore_side::right:  // torch.matmul(G, P.t())
        gemm(false, true, m, r, n, g, n, p, n, low);
        break;
      case galore_side::left:  // torch.matmul(Q.t(), G)
        gemm(true, false, r, n, m, q, r, g, n, low);
        break;
      case galore_side::full:  // torch.matmul(Q.t(), G) @ P.t()
        gemm(true, false, r, n, m, q, r, g, n, tmp);
        gemm(false, true, r, r, n, tmp, n, p, n, low);
        break;
    }
  }

  /// The products of project_back() (without the scale), as project_products; `tmp`: m x r
  /// floats for the full side.
  template <class Gemm>
  static void project_back_products(Gemm&& gemm, galore_side side, std::int64_t m, std::int64_t n, std::int64_t r,
                                    const float* q, const float* p, const float* low, float* full, float* tmp) {
    switch (side) {
      case galore_side::right:  // torch.matmul(N, P)
        gemm(false, false, m, n, r, low, r, p, n, full);
        break;
      case galore_side::left:  // torch.matmul(Q, N)
        gemm(false, false, m, n, r, q, r, low, n, full);
        break;
      case galore_side::full:  // torch.matmul(Q, N) @ P
        gemm(false, false, m, r, r, q, r, low, r, tmp);
        gemm(false, false, m, n, r, tmp, r, p, n, full);
        break;
    }
  }

 private:
  static void host_gemm(bool trans_a, bool trans_b, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                        const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c) {
    detail::sgemm_row_major(trans_a, trans_b, rows, cols, inner, a, lda, b, ldb, c);
  }
  static std::string dims(std::int64_t m, std::int64_t n) {
    return std::to_string(m) + " x " + std::to_string(n);
  }

  // The side galore-torch's project_back picks from the low-rank shape (see project_back).
  galore_side back_side(std::int64_t rows, std::int64_t cols) const noexcept {
    switch (type_) {
      case galore_proj::std_:
        return rows >= cols ? galore_side::right : galore_side::left;
      case galore_proj::reverse_std:
        return rows <= cols ? galore_side::left : galore_side::right;
      case galore_proj::left:
        return galore_side::left;
      case galore_proj::right:
        return galore_side::right;
      case galore_proj::full:
        return galore_side::full;
    }
    return galore_side::full;
  }

  void check_shape(std::int64_t m, std::int64_t n) const {
    if (rank_ < 1)
      throw std::invalid_argument("galore_projector: rank " + std::to_string(rank_) +
                                  " (a group with rank needs rank >= 1)");
    if (m < 1 || n < 1)
      throw std::invalid_argument("galore_projector: cannot project a " + dims(m, n) + " matrix");
    if (rank_ > std::min(m, n))
      throw std::invalid_argument(
          "galore_projector: rank " + std::to_string(rank_) +
          " exceeds min(m, n) = " + std::to_string(std::min(m, n)) + " of a " + dims(m, n) +
          " matrix (galore-torch would silently use rank " + std::to_string(std::min(m, n)) +
          "; put the tensor in a group without rank, or lower the rank)");
    const galore_side side = side_for(m, n);
    const std::int64_t r = rank_;
    const std::int64_t rows = side == galore_side::left || side == galore_side::full ? r : m;
    const std::int64_t cols = side == galore_side::right || side == galore_side::full ? r : n;
    if (back_side(rows, cols) != side)
      throw std::invalid_argument(
          "galore_projector: " + std::string(galore_proj_name(type_)) + " projection of a " +
          dims(m, n) + " matrix with rank " + std::to_string(rank_) +
          " cannot be projected back (galore-torch's project_back multiplies mismatched "
          "shapes here); use rank < " +
          std::to_string(std::min(m, n)));
  }

  void require_ready(const char* what) const {
    if (!ready_)
      throw std::logic_error(std::string("galore_projector::") + what +
                             ": no projection yet (call refresh first)");
  }

  int rank_ = 0;
  int gap_ = 200;
  double scale_ = 1.0;
  galore_proj type_ = galore_proj::std_;
  bool ready_ = false;
  std::int64_t m_ = 0, n_ = 0;
  galore_side side_ = galore_side::right;
  std::vector<float> q_, p_;
};

/// The optimizer updates the 2-D tensors of galore_adamw's groups with a rank through a
/// galore_projector each (optimizer.hpp, "matrix projection").
template <>
struct matrix_projector<galore_adamw> {
  using type = galore_projector;
};

}  // namespace distopt
