// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore-AdamW's math core (policy/galore_adamw.hpp, detail/lapack.hpp):
//  - the LAPACK SVD wrapper against a float64 reconstruction and against torch.linalg.svd
//    (tests/reference/traces/galore_svd_reference.safetensors), with the singular-vector
//    sign agreement reported;
//  - the projector for every proj_type against float64 re-computations, and project-back
//    of a rank-r matrix returning it;
//  - a standalone replay of the golden galore-torch traces (galore_cases.txt), one tensor
//    at a time in galore-torch's order, with the projection taken from torch's SVD factors
//    and from our own LAPACK, and a deliberately wrong refresh step that must miss; and of
//    the one-refresh expectations (galore_one_refresh_cases.txt), which do not depend on
//    the singular vectors' signs, so every matrix compares with our own LAPACK's SVD;
//  - the per-element functions against float64 at tile-edge sizes, the refusals, and
//    bit-identical results whatever the OpenBLAS thread setting.

#include <boost/test/unit_test.hpp>

#include <distopt/concepts.hpp>
#include <distopt/detail/lapack.hpp>
#include <distopt/io/safetensors.hpp>
#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/hyper_text.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef DISTOPT_REFERENCE_DIR
#error "DISTOPT_REFERENCE_DIR (tests/reference) must be defined by the build"
#endif

namespace {

using distopt::galore_adamw;
using distopt::galore_proj;
using distopt::galore_projector;
using distopt::galore_side;

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
constexpr double kEps32 = 0x1p-24;
const std::string kRefDir = DISTOPT_REFERENCE_DIR;

constexpr std::array<galore_proj, 5> kAllProj{galore_proj::std_, galore_proj::reverse_std,
                                              galore_proj::left, galore_proj::right,
                                              galore_proj::full};

std::vector<float> random_matrix(std::int64_t m, std::int64_t n, std::uint32_t seed,
                                 double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<float> a(static_cast<std::size_t>(m * n));
  for (auto& x : a) x = static_cast<float>(normal(rng) * scale);
  return a;
}

// A row-major m x n matrix of rank r: X (m x r) Y^T (n x r), formed in double.
std::vector<float> rank_r_matrix(std::int64_t m, std::int64_t n, std::int64_t r,
                                 std::uint32_t seed) {
  const auto x = random_matrix(m, r, seed), y = random_matrix(n, r, seed + 1);
  std::vector<float> a(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (std::int64_t l = 0; l < r; ++l) s += double(x[i * r + l]) * double(y[j * r + l]);
      a[i * n + j] = static_cast<float>(s);
    }
  return a;
}

// max |got - want| / (atol + rtol |want|), as compare-safetensors reports it.
double tolerance_ratio(std::span<const float> got, std::span<const float> want) {
  double worst = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double e = want[i];
    worst = std::max(worst, std::abs(double(got[i]) - e) / (kAtol + kRtol * std::abs(e)));
  }
  return worst;
}

// ---------------------------------------------------------------------------------------
// SVD checks
// ---------------------------------------------------------------------------------------

template <class T>
void check_svd_float64(const distopt::detail::thin_svd<T>& f, std::span<const float> a,
                       double tol_unit) {
  const std::int64_t m = f.m, n = f.n, k = f.k;
  double amax = 0.0;
  for (float x : a) amax = std::max(amax, double(std::abs(x)));
  double rec = 0.0, orth_u = 0.0, orth_v = 0.0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (std::int64_t l = 0; l < k; ++l)
        s += double(f.u[i * k + l]) * double(f.s[l]) * double(f.vh[l * n + j]);
      rec = std::max(rec, std::abs(s - double(a[i * n + j])));
    }
  for (std::int64_t p = 0; p < k; ++p)
    for (std::int64_t q = 0; q < k; ++q) {
      double su = 0.0, sv = 0.0;
      for (std::int64_t i = 0; i < m; ++i) su += double(f.u[i * k + p]) * double(f.u[i * k + q]);
      for (std::int64_t j = 0; j < n; ++j) sv += double(f.vh[p * n + j]) * double(f.vh[q * n + j]);
      orth_u = std::max(orth_u, std::abs(su - (p == q)));
      orth_v = std::max(orth_v, std::abs(sv - (p == q)));
    }
  for (std::int64_t l = 0; l + 1 < k; ++l) BOOST_TEST(f.s[l] >= f.s[l + 1]);
  for (std::int64_t l = 0; l < k; ++l) BOOST_TEST(f.s[l] >= T(0));
  const double dim = double(std::max(m, n));
  BOOST_TEST_CONTEXT(m << " x " << n) {
    BOOST_TEST(rec <= 30.0 * dim * tol_unit * std::max(amax, 1e-30) * std::sqrt(double(k)));
    BOOST_TEST(orth_u <= 30.0 * dim * tol_unit);
    BOOST_TEST(orth_v <= 30.0 * dim * tol_unit);
  }
}

BOOST_AUTO_TEST_SUITE(galore)

BOOST_AUTO_TEST_CASE(svd_reconstructs_in_float64) {
  // Shapes around LAPACK's paths: vectors, square, tall (QR-first when m >> n), wide.
  const std::vector<std::pair<int, int>> shapes{{1, 1},    {1, 5},    {5, 1},   {7, 3},
                                                {3, 7},    {16, 16},  {17, 33}, {33, 17},
                                                {129, 40}, {40, 129}, {200, 9}};
  std::uint32_t seed = 1;
  for (auto [m, n] : shapes) {
    const auto a = random_matrix(m, n, seed++);
    const auto f = distopt::detail::svd_thin<float>(a, m, n);
    BOOST_REQUIRE_EQUAL(f.k, std::min(m, n));
    BOOST_REQUIRE_EQUAL(f.u.size(), std::size_t(m) * f.k);
    BOOST_REQUIRE_EQUAL(f.vh.size(), std::size_t(f.k) * n);
    check_svd_float64(f, a, kEps32);
    std::vector<double> ad(a.begin(), a.end());
    const auto fd = distopt::detail::svd_thin<double>(ad, m, n);
    for (std::int64_t l = 0; l < f.k; ++l)  // float vs double singular values
      BOOST_TEST(std::abs(double(f.s[l]) - fd.s[l]) <= 20.0 * kEps32 * std::max(m, n) * fd.s[0]);
    check_svd_float64(fd, a, 0x1p-53);
  }
  // An empty matrix has an empty SVD.
  const auto e = distopt::detail::svd_thin<float>(std::span<const float>(), 0, 4);
  BOOST_TEST(e.k == 0);
}

// Singular vectors of torch.linalg.svd (MKL on the machine that made the file) against ours:
// singular values to fp32 rounding, vectors up to sign, u_i and v_i flipping together.
// The sign agreement is reported (log_level=message), not required: LAPACK fixes no sign.
BOOST_AUTO_TEST_CASE(svd_matches_torch_up_to_sign) {
  const auto file =
      distopt::io::safetensors_reader::open(kRefDir + "/traces/galore_svd_reference.safetensors");
  int matrices = 0, vectors = 0, flips = 0;
  for (const auto& name : file.names()) {
    if (name.rfind("a.", 0) != 0) continue;
    const std::string key = name.substr(2);
    const auto& info = file.info(name);
    const std::int64_t m = info.shape.at(0), n = info.shape.at(1), k = std::min(m, n);
    const auto a = file.read_f32(name);
    const auto u = file.read_f32("u." + key), s = file.read_f32("s." + key),
               vh = file.read_f32("vh." + key);
    const auto f = distopt::detail::svd_thin<float>(a, m, n);
    ++matrices;
    std::string pattern;
    double worst_s = 0.0, worst_dot = 0.0;
    for (std::int64_t l = 0; l < k; ++l) {
      worst_s =
          std::max(worst_s, std::abs(double(f.s[l]) - double(s[l])) / (kEps32 * double(s[0])));
      double du = 0.0, dv = 0.0;
      for (std::int64_t i = 0; i < m; ++i) du += double(f.u[i * k + l]) * double(u[i * k + l]);
      for (std::int64_t j = 0; j < n; ++j) dv += double(f.vh[l * n + j]) * double(vh[l * n + j]);
      // Well-separated singular values (all of the GaLore gradients' leading ones and, for
      // these random matrices, all but near-ties) give vectors equal up to sign.
      const double gap = std::min(l > 0 ? double(s[l - 1] - s[l]) : 1e30,
                                  l + 1 < k ? double(s[l] - s[l + 1]) : 1e30) /
                         double(s[0]);
      if (gap > 1e-3) {
        worst_dot = std::max(worst_dot, 1.0 - std::abs(du));
        BOOST_TEST_CONTEXT(key << " vector " << l) {
          BOOST_TEST(std::abs(du) > 1.0 - 1e-3);
          BOOST_TEST(std::abs(dv) > 1.0 - 1e-3);
          BOOST_TEST((du > 0) == (dv > 0));  // u_i and v_i flip together
        }
      }
      ++vectors;
      flips += du < 0;
      pattern += du < 0 ? '-' : '+';
    }
    BOOST_TEST_CONTEXT(key) { BOOST_TEST(worst_s <= 64.0 * double(std::max(m, n))); }
    BOOST_TEST_MESSAGE(
        "svd " << key << " [" << m << "x" << n << "]: max |S - S_torch| = " << worst_s
               << " x eps32 x s_max, max 1 - |<u, u_torch>| = " << worst_dot
               << ", signs vs torch (first " << std::min<std::int64_t>(k, 12)
               << "): " << pattern.substr(0, 12) << " ("
               << std::count(pattern.begin(), pattern.end(), '-') << " of " << k << " flipped)");
  }
  BOOST_TEST(matrices >= 16);
  BOOST_TEST_MESSAGE("svd vs torch: " << flips << " of " << vectors
                                      << " singular vector pairs have the opposite sign");
}

// ---------------------------------------------------------------------------------------
// Projector
// ---------------------------------------------------------------------------------------

// A float64 product of row-major matrices and the bound sum |a||b| per element.
struct dmat {
  std::int64_t r = 0, c = 0;
  std::vector<double> v, bound;
};

dmat to_d(std::span<const float> x, std::int64_t r, std::int64_t c, bool transpose = false) {
  dmat d{transpose ? c : r, transpose ? r : c, {}, {}};
  d.v.resize(static_cast<std::size_t>(r * c));
  d.bound.resize(d.v.size());
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < c; ++j) {
      const double e = x[i * c + j];
      const std::size_t at = transpose ? j * r + i : i * c + j;
      d.v[at] = e;
      d.bound[at] = std::abs(e);
    }
  return d;
}

dmat mul(const dmat& a, const dmat& b) {
  BOOST_REQUIRE_EQUAL(a.c, b.r);
  dmat out{a.r, b.c, std::vector<double>(a.r * b.c), std::vector<double>(a.r * b.c)};
  for (std::int64_t i = 0; i < a.r; ++i)
    for (std::int64_t j = 0; j < b.c; ++j) {
      double s = 0.0, t = 0.0;
      for (std::int64_t l = 0; l < a.c; ++l) {
        s += a.v[i * a.c + l] * b.v[l * b.c + j];
        t += a.bound[i * a.c + l] * b.bound[l * b.c + j];
      }
      out.v[i * b.c + j] = s;
      out.bound[i * b.c + j] = t;
    }
  return out;
}

// |got - want| <= c * depth * eps32 * bound, elementwise (the standard dot-product bound).
void check_product(const std::string& what, std::span<const float> got, const dmat& want,
                   double depth) {
  BOOST_REQUIRE_EQUAL(got.size(), want.v.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = 2.0 * depth * kEps32 * want.bound[i] + 1e-30;
    worst = std::max(worst, std::abs(double(got[i]) - want.v[i]) / tol);
  }
  BOOST_TEST_CONTEXT(what) { BOOST_TEST(worst <= 1.0); }
}

BOOST_AUTO_TEST_CASE(low_rank_shapes_follow_galore_torch) {
  using shape = std::array<std::int64_t, 2>;
  const galore_projector std4(4, 200, 1.0, galore_proj::std_),
      rev4(4, 200, 1.0, galore_proj::reverse_std), left4(4, 200, 1.0, galore_proj::left),
      right4(4, 200, 1.0, galore_proj::right), full4(4, 200, 1.0, galore_proj::full);
  BOOST_TEST((std4.low_rank_shape(14, 10) == shape{14, 4}));  // m >= n: right
  BOOST_TEST((std4.low_rank_shape(10, 10) == shape{10, 4}));  // m == n: right
  BOOST_TEST((std4.low_rank_shape(6, 18) == shape{4, 18}));   // m < n: left
  BOOST_TEST((rev4.low_rank_shape(14, 10) == shape{4, 10}));
  BOOST_TEST((rev4.low_rank_shape(10, 10) == shape{4, 10}));
  BOOST_TEST((rev4.low_rank_shape(6, 18) == shape{6, 4}));
  BOOST_TEST((left4.low_rank_shape(14, 10) == shape{4, 10}));
  BOOST_TEST((right4.low_rank_shape(6, 18) == shape{6, 4}));
  BOOST_TEST((full4.low_rank_shape(14, 10) == shape{4, 4}));
  BOOST_TEST((std4.side_for(10, 10) == galore_side::right));
  BOOST_TEST((rev4.side_for(10, 10) == galore_side::left));
  // rank == min(m, n) is accepted where galore-torch can project back.
  BOOST_TEST(
      (galore_projector(6, 200, 1.0, galore_proj::std_).low_rank_shape(6, 18) == shape{6, 18}));
  BOOST_TEST((galore_projector(6, 200, 1.0, galore_proj::reverse_std).low_rank_shape(18, 6) ==
              shape{6, 6}));
}

BOOST_AUTO_TEST_CASE(projector_matches_float64_for_every_proj_type) {
  const std::vector<std::array<int, 3>> cases{{14, 10, 4}, {6, 18, 4},  {10, 10, 4},  {11, 7, 3},
                                              {33, 17, 5}, {17, 33, 5}, {16, 16, 16}, {1, 1, 1},
                                              {1, 9, 1},   {9, 1, 1},   {64, 48, 8}};
  std::uint32_t seed = 100;
  for (galore_proj type : kAllProj)
    for (auto [m, n, r] : cases) {
      const galore_projector probe(r, 200, 1.0, type);
      bool accepted = true;
      try {
        (void)probe.low_rank_shape(m, n);
      } catch (const std::invalid_argument&) {
        accepted = false;  // the reverse_std corner (m < n, rank == m)
      }
      BOOST_TEST_CONTEXT(distopt::galore_proj_name(type) << " " << m << "x" << n << " rank " << r) {
        BOOST_TEST(accepted == !(type == galore_proj::reverse_std && m < n && r == m));
        if (!accepted) continue;
        // Project back a rank-r matrix: the projection onto its own top-r singular space
        // returns it.
        const auto g = rank_r_matrix(m, n, r, seed++);
        for (double scale : {1.0, 0.25}) {
          galore_projector p(r, 200, scale, type);
          BOOST_TEST(p.refresh_due(0));
          p.refresh(g.data(), m, n);
          BOOST_TEST(p.has_ortho());
          BOOST_TEST(!p.refresh_due(1));
          BOOST_TEST(p.refresh_due(200));
          const auto [lr, lc] = p.low_rank_shape(m, n);
          std::vector<float> low(static_cast<std::size_t>(lr * lc)), back(g.size());
          p.project(g.data(), low.data());
          p.project_back(low.data(), back.data());
          double gmax = 0.0, err = 0.0;
          for (std::size_t i = 0; i < g.size(); ++i) {
            gmax = std::max(gmax, double(std::abs(g[i])));
            err = std::max(err, std::abs(double(back[i]) - scale * double(g[i])));
          }
          BOOST_TEST(err <= 1e-4 * gmax);

          // float64 re-computation with the projector's own factors.
          const dmat gd = to_d(g, m, n);
          const galore_side side = p.side();
          dmat low_ref, back_ref;
          const std::span<const float> q = p.left(), pp = p.right();
          if (side == galore_side::left) {
            BOOST_TEST(q.size() == std::size_t(m) * r);
            BOOST_TEST(pp.empty());
            low_ref = mul(to_d(q, m, r, true), gd);
            back_ref = mul(to_d(q, m, r), to_d(low, r, n));
          } else if (side == galore_side::right) {
            BOOST_TEST(pp.size() == std::size_t(r) * n);
            BOOST_TEST(q.empty());
            low_ref = mul(gd, to_d(pp, r, n, true));
            back_ref = mul(to_d(low, m, r), to_d(pp, r, n));
          } else {
            // (Q^T G) P^T and (Q N) P, associated as galore-torch does; the bound covers the
            // rounding of the intermediate product too.
            low_ref = mul(mul(to_d(q, m, r, true), gd), to_d(pp, r, n, true));
            back_ref = mul(mul(to_d(q, m, r), to_d(low, r, r)), to_d(pp, r, n));
          }
          check_product("project", low, low_ref, double(std::max(m, n)) * 2);
          for (std::size_t i = 0; i < back_ref.v.size(); ++i) {
            back_ref.v[i] *= scale;
            back_ref.bound[i] *= scale;
          }
          check_product("project_back", back, back_ref, double(std::max(m, n)) * 2 + 1);
          // Orthonormal factors.
          auto check_orthonormal = [&](std::span<const float> x, std::int64_t rows,
                                       std::int64_t cols, bool columns) {
            const std::int64_t cnt = columns ? cols : rows, len = columns ? rows : cols;
            for (std::int64_t a = 0; a < cnt; ++a)
              for (std::int64_t b = 0; b < cnt; ++b) {
                double s = 0.0;
                for (std::int64_t i = 0; i < len; ++i)
                  s += columns ? double(x[i * cols + a]) * x[i * cols + b]
                               : double(x[a * cols + i]) * x[b * cols + i];
                BOOST_TEST(std::abs(s - (a == b)) <= 1e-5);
              }
          };
          if (!q.empty()) check_orthonormal(q, m, r, true);
          if (!pp.empty()) check_orthonormal(pp, r, n, false);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------
// Golden traces
// ---------------------------------------------------------------------------------------

struct trace {
  std::vector<std::string> names;
  std::map<std::string, std::vector<std::int64_t>> shapes;
  std::map<std::string, std::vector<float>> params, expected;
  std::vector<std::map<std::string, std::vector<float>>> grads;
  std::vector<std::string> galore_names;  // from the metadata
};

trace read_trace(const std::string& case_name) {
  const auto file = distopt::io::safetensors_reader::open(kRefDir + "/traces/" + case_name +
                                                          ".trace.safetensors");
  const auto expected = distopt::io::safetensors_reader::open(kRefDir + "/traces/" + case_name +
                                                              ".expected.safetensors");
  trace t;
  for (const auto& n : file.names())
    if (n.rfind("param.", 0) == 0) t.names.push_back(n.substr(6));
  const int steps = std::stoi(file.metadata().at("steps"));
  BOOST_REQUIRE_EQUAL(file.metadata().at("optimizer"), "galore_adamw");
  for (const auto& n : t.names) {
    t.shapes[n] = file.info("param." + n).shape;
    t.params[n] = file.read_f32("param." + n);
    t.expected[n] = expected.read_f32("param." + n);
  }
  t.grads.resize(static_cast<std::size_t>(steps));
  for (int k = 0; k < steps; ++k)
    for (const auto& n : t.names)
      t.grads[k][n] = file.read_f32("grad." + std::to_string(k) + "." + n);
  std::stringstream list(file.metadata().at("galore_params"));
  for (std::string n; std::getline(list, n, ',');) t.galore_names.push_back(n);
  return t;
}

// param.<name> of traces/<name>.expected.safetensors, by tensor name.
std::map<std::string, std::vector<float>> read_expected(const std::string& name) {
  const auto file =
      distopt::io::safetensors_reader::open(kRefDir + "/traces/" + name + ".expected.safetensors");
  std::map<std::string, std::vector<float>> out;
  for (const auto& n : file.names())
    if (n.rfind("param.", 0) == 0) out[n.substr(6)] = file.read_f32(n);
  return out;
}

// The rule galore_cases.txt states: 2-D tensors not named *.bias are in the GaLore group.
bool in_galore_group(const std::string& name, const std::vector<std::int64_t>& shape) {
  const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  return shape.size() == 2 && !bias;
}

struct case_line {
  std::string name;
  std::string trace;  // the trace's case (galore_one_refresh_cases.txt's second word)
  std::vector<std::pair<std::string, std::string>> settings;
};

// galore_cases.txt (<case> galore_adamw --set ...), or with `with_trace`
// galore_one_refresh_cases.txt (<case> <trace> galore_adamw --set ...).
std::vector<case_line> read_cases(const std::string& file = "galore_cases.txt",
                                  bool with_trace = false) {
  std::ifstream in(kRefDir + "/" + file);
  BOOST_REQUIRE_MESSAGE(in.good(), "cannot read tests/reference/" << file);
  std::vector<case_line> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::stringstream words(line);
    case_line c;
    std::string optimizer, flag, kv;
    words >> c.name;
    if (with_trace) words >> c.trace;
    else c.trace = c.name;
    words >> optimizer;
    BOOST_REQUIRE_EQUAL(optimizer, "galore_adamw");
    while (words >> flag >> kv) {
      BOOST_REQUIRE_EQUAL(flag, "--set");
      const auto eq = kv.find('=');
      c.settings.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    }
    out.push_back(std::move(c));
  }
  return out;
}

// torch's SVD factors of the GaLore gradients at the refresh steps, by "<name>.<step>".
std::map<std::string, distopt::detail::thin_svd<float>> read_torch_factors() {
  const auto file =
      distopt::io::safetensors_reader::open(kRefDir + "/traces/galore_svd_reference.safetensors");
  std::map<std::string, distopt::detail::thin_svd<float>> out;
  for (const auto& name : file.names()) {
    if (name.rfind("a.", 0) != 0 || name.rfind("a.study_", 0) == 0) continue;
    const std::string key = name.substr(2);
    distopt::detail::thin_svd<float> f;
    f.m = file.info(name).shape.at(0);
    f.n = file.info(name).shape.at(1);
    f.k = std::min(f.m, f.n);
    f.u = file.read_f32("u." + key);
    f.s = file.read_f32("s." + key);
    f.vh = file.read_f32("vh." + key);
    out[key] = std::move(f);
  }
  return out;
}

enum class factors { torch, own };

// Edits torch's factors before a refresh at step `iter` (to flip signs).
using factor_edit = std::function<void(distopt::detail::thin_svd<float>&, std::int64_t iter)>;

// Negates the first singular pair (u_0, v_0): an equally valid SVD.
void flip_first_pair(distopt::detail::thin_svd<float>& f) {
  for (std::int64_t i = 0; i < f.m; ++i) f.u[i * f.k] = -f.u[i * f.k];
  for (std::int64_t j = 0; j < f.n; ++j) f.vh[j] = -f.vh[j];
}

// galore-torch's step, one tensor at a time. `late` refreshes one step late (iter % gap
// == 1, and at the first step), the deliberate mistake the traces must catch.
std::map<std::string, std::vector<float>> replay(
    const galore_adamw::hyper_params& h, const trace& t, factors source,
    const std::map<std::string, distopt::detail::thin_svd<float>>& torch_factors, bool late = false,
    const factor_edit& edit = {}) {
  std::map<std::string, std::vector<float>> out;
  const auto steps = static_cast<std::int64_t>(t.grads.size());
  for (const auto& name : t.names) {
    std::vector<float> p = t.params.at(name);
    const auto& shape = t.shapes.at(name);
    const bool galore =
        std::find(t.galore_names.begin(), t.galore_names.end(), name) != t.galore_names.end();
    if (!galore) {
      std::vector<float> state(2 * p.size(), 0.0f);
      for (std::int64_t k = 0; k < steps; ++k) {
        const auto s = galore_adamw::prepare(h, {.step = k + 1});
        const auto& g = t.grads[k].at(name);
        for (std::size_t i = 0; i < p.size(); ++i)
          galore_adamw::update(s, p[i], g[i], &state[2 * i]);
      }
    } else {
      const std::int64_t m = shape.at(0), n = shape.at(1);
      galore_projector proj(h);
      const auto [lr, lc] = proj.low_rank_shape(m, n);
      std::vector<float> low(static_cast<std::size_t>(lr * lc)), state(2 * low.size(), 0.0f);
      std::vector<float> full(p.size());
      for (std::int64_t iter = 0; iter < steps; ++iter) {
        const auto& g = t.grads[iter].at(name);
        const bool due = late ? (!proj.has_ortho() || iter % proj.update_proj_gap() == 1)
                              : proj.refresh_due(iter);
        if (due) {
          const auto it = torch_factors.find(name + "." + std::to_string(iter));
          if (source == factors::torch && it != torch_factors.end()) {
            auto f = it->second;
            if (edit) edit(f, iter);
            proj.refresh(f);
          } else {
            proj.refresh(g.data(), m, n);
          }
        }
        const auto s = galore_adamw::prepare(h, {.step = iter + 1});
        proj.project(g.data(), low.data());
        for (std::size_t i = 0; i < low.size(); ++i)
          low[i] = galore_adamw::moments(s, low[i], &state[2 * i]);
        proj.project_back(low.data(), full.data());
        for (std::size_t i = 0; i < p.size(); ++i) galore_adamw::apply(s, p[i], full[i]);
      }
    }
    out[name] = std::move(p);
  }
  return out;
}

double worst_ratio(const trace& t, const std::map<std::string, std::vector<float>>& got) {
  double worst = 0.0;
  for (const auto& n : t.names)
    worst = std::max(worst, tolerance_ratio(got.at(n), t.expected.at(n)));
  return worst;
}

BOOST_AUTO_TEST_CASE(replays_golden_traces) {
  const auto cases = read_cases();
  BOOST_TEST(cases.size() >= 7);
  // Each case again with one refresh (update_proj_gap above the steps: only step 0), which
  // galore-torch ran on the same trace (make_galore_one_refresh.py): the states start at
  // zero in the projected coordinates, so the params do not depend on the signs of the
  // singular vectors, and every matrix compares with our own LAPACK's SVD.
  std::map<std::string, case_line> one_refresh;
  for (auto& c : read_cases("galore_one_refresh_cases.txt", true)) one_refresh[c.trace] = c;
  const auto torch_factors = read_torch_factors();
  // The SVD reference holds exactly the gradients the projector sees at the refreshes.
  const auto svd_file =
      distopt::io::safetensors_reader::open(kRefDir + "/traces/galore_svd_reference.safetensors");
  // Per GaLore tensor: the signs of our leading singular vectors relative to torch's at
  // each refresh ('+' same, '-' opposite).
  std::map<std::string, std::vector<std::string>> signs;
  for (const auto& [key, f] : torch_factors) {
    const auto own = distopt::detail::svd_thin<float>(svd_file.read_f32("a." + key), f.m, f.n);
    std::string pattern;
    for (std::int64_t l = 0; l < f.k; ++l) {
      double du = 0.0;
      for (std::int64_t i = 0; i < f.m; ++i) du += double(own.u[i * f.k + l]) * f.u[i * f.k + l];
      pattern += du < 0 ? '-' : '+';
    }
    signs[key.substr(0, key.rfind('.'))].push_back(pattern);
  }
  std::map<galore_proj, bool> seen;
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT(c.name) {
      const auto h =
          distopt::apply_hyper_params<galore_adamw>(galore_adamw::hyper_params{}, c.settings);
      BOOST_REQUIRE(h.rank.has_value());
      seen[h.proj_type] = true;
      const trace t = read_trace(c.name);
      // The metadata list agrees with the naming rule of galore_cases.txt.
      for (const auto& n : t.names) {
        const bool listed =
            std::find(t.galore_names.begin(), t.galore_names.end(), n) != t.galore_names.end();
        BOOST_TEST(listed == in_galore_group(n, t.shapes.at(n)), n);
      }
      for (const auto& [key, f] : torch_factors) {
        const auto dot = key.rfind('.');
        const auto& g = t.grads.at(std::stoul(key.substr(dot + 1))).at(key.substr(0, dot));
        BOOST_REQUIRE(svd_file.read_f32("a." + key) == g);
      }
      const auto with_torch = replay(h, t, factors::torch, torch_factors);
      const auto with_own = replay(h, t, factors::own, torch_factors);
      const double torch_ratio = worst_ratio(t, with_torch);
      const double late = worst_ratio(t, replay(h, t, factors::torch, torch_factors, true));
      BOOST_TEST_MESSAGE(c.name << ": worst |x - e| / (atol + rtol |e|) with torch's SVD factors "
                                << torch_ratio << "; refreshing one step late " << late);
      BOOST_TEST(torch_ratio <= 1.0);
      BOOST_TEST(late > 100.0);  // the trace catches a wrong refresh step
      // The sign mechanism: flipping a singular pair at every refresh changes nothing (the
      // states live in the flipped coordinates from the start); flipping it only at the
      // later refreshes turns the carried-over first moment against the new gradient.
      const double flip_all =
          worst_ratio(t, replay(h, t, factors::torch, torch_factors, false,
                                [](auto& f, std::int64_t) { flip_first_pair(f); }));
      const double flip_later = worst_ratio(
          t, replay(h, t, factors::torch, torch_factors, false, [](auto& f, std::int64_t iter) {
            if (iter > 0) flip_first_pair(f);
          }));
      BOOST_TEST_MESSAGE("  first singular pair negated at every refresh "
                         << flip_all << ", at the later refreshes only " << flip_later);
      BOOST_TEST(flip_all <= 1.0);
      BOOST_TEST(flip_later > 100.0);
      // With our own LAPACK's SVD: a sign that differs from torch's at the first refresh is
      // harmless (the states are zero then), a relation that changes at a later refresh is
      // not (the Adam states carry over in the old signs). So a tensor whose leading r signs
      // relate to torch's in the same way at every refresh must match. Where the relation
      // changes, this trace cannot compare the tensor (galore-torch's own result would change
      // with its LAPACK's signs): the one-refresh run, which compares every tensor whatever
      // the signs, must exist and match instead.
      const auto one = one_refresh.find(c.name);
      BOOST_TEST_REQUIRE((one != one_refresh.end()),
                         c.name << " has no one-refresh case in galore_one_refresh_cases.txt: the "
                                   "matrices whose signs change relation could not be compared");
      const auto h1 =
          distopt::apply_hyper_params<galore_adamw>(galore_adamw::hyper_params{}, one->second.settings);
      BOOST_TEST_REQUIRE(h1.update_proj_gap > static_cast<int>(t.grads.size()));
      auto h_gap = h1;
      h_gap.update_proj_gap = h.update_proj_gap;
      BOOST_TEST((distopt::hyper_params_string<galore_adamw>(h_gap) ==
                  distopt::hyper_params_string<galore_adamw>(h)),
                 one->first << ": the one-refresh case differs from " << c.name << " in more than update_proj_gap");
      const auto expected1 = read_expected(one->second.name);
      const auto own1 = replay(h1, t, factors::own, torch_factors);
      const auto torch1 = replay(h1, t, factors::torch, torch_factors);
      for (const auto& n : t.names) {
        const double r_own = tolerance_ratio(own1.at(n), expected1.at(n)),
                     r_torch = tolerance_ratio(torch1.at(n), expected1.at(n));
        BOOST_TEST_MESSAGE("  " << n << ", one refresh: with our LAPACK's SVD " << r_own << ", with torch's "
                                << r_torch);
        BOOST_TEST(r_own <= 1.0, n << ", one refresh, our LAPACK's SVD: " << r_own);
        BOOST_TEST(r_torch <= 1.0, n << ", one refresh, torch's SVD factors: " << r_torch);
      }
      for (const auto& n : t.galore_names) {
        const auto& pats = signs.at(n);
        bool consistent = true;
        for (const auto& pat : pats)
          consistent = consistent && pat.substr(0, *h.rank) == pats[0].substr(0, *h.rank);
        const double own = tolerance_ratio(with_own.at(n), t.expected.at(n));
        std::string shown;
        for (const auto& pat : pats) {
          if (!shown.empty()) shown += ' ';  // appended separately: GCC 12 -Wrestrict
          shown += pat.substr(0, *h.rank);
        }
        if (consistent) {
          BOOST_TEST_MESSAGE("  " << n << ": with our LAPACK's SVD " << own
                                  << " (signs vs torch at the refreshes: " << shown << ")");
          BOOST_TEST(own <= 1.0, n << " (consistent signs " << shown << "): " << own);
        } else {
          BOOST_TEST_MESSAGE("  " << n << ": signs vs torch at the refreshes " << shown
                                  << " change relation, so galore-torch's result on this trace depends on "
                                     "its LAPACK ("
                                  << own << " with ours): compared with one refresh above");
          BOOST_TEST(expected1.count(n) == 1u, n << ": not in " << one->second.name);
        }
      }
    }
  }
  for (galore_proj p : kAllProj) BOOST_TEST(seen[p], distopt::galore_proj_name(p));
}

// ---------------------------------------------------------------------------------------
// Per-element functions
// ---------------------------------------------------------------------------------------

// The plain group's step is an ordinary element policy (a rank group needs the projector).
static_assert(distopt::optimizer_policy<galore_adamw>);
static_assert(std::is_trivially_copyable_v<galore_adamw::scalars>);

BOOST_AUTO_TEST_CASE(scalars_are_formed_in_double) {
  galore_adamw::hyper_params h;
  h.lr = 3e-3;
  h.betas = {0.9, 0.95};
  h.weight_decay = 0.1;
  const auto s = galore_adamw::prepare(h, {.step = 7});
  const double want = 3e-3 * std::sqrt(1.0 - std::pow(0.95, 7.0)) / (1.0 - std::pow(0.9, 7.0));
  BOOST_TEST(s.neg_step_size == static_cast<float>(-want));
  BOOST_TEST(s.one_minus_beta2 == static_cast<float>(1.0 - 0.95));  // not 1.0f - 0.95f
  BOOST_TEST(s.neg_decay == static_cast<float>(-3e-3 * 0.1));
  BOOST_TEST(s.eps == 1e-6f);
  h.correct_bias = false;
  h.weight_decay = 0.0;
  const auto s2 = galore_adamw::prepare(h, {.step = 7});
  BOOST_TEST(s2.neg_step_size == -3e-3f);
  BOOST_TEST(s2.neg_decay == 0.0f);
}

BOOST_AUTO_TEST_CASE(plain_update_matches_float64_at_tile_edges) {
  galore_adamw::hyper_params h;
  h.lr = 1e-2;
  h.weight_decay = 0.05;
  for (int size : {1, 15, 16, 17, 127, 128, 129, 4097}) {
    std::mt19937_64 rng(size);
    std::normal_distribution<double> normal;
    std::vector<float> p(size), state(2 * size, 0.0f);
    for (auto& x : p) x = static_cast<float>(normal(rng));
    std::vector<double> pd(p.begin(), p.end()), md(size), vd(size);
    for (int t = 1; t <= 25; ++t) {
      const auto s = galore_adamw::prepare(h, {.step = t});
      const double step =
          h.lr * std::sqrt(1 - std::pow(h.betas[1], t)) / (1 - std::pow(h.betas[0], t));
      for (int i = 0; i < size; ++i) {
        const float g = static_cast<float>(normal(rng) * 0.1);
        galore_adamw::update(s, p[i], g, &state[2 * i]);
        md[i] = h.betas[0] * md[i] + (1 - h.betas[0]) * g;
        vd[i] = h.betas[1] * vd[i] + (1 - h.betas[1]) * double(g) * g;
        pd[i] -= step * md[i] / (std::sqrt(vd[i]) + h.eps);
        pd[i] -= h.lr * h.weight_decay * pd[i];
      }
    }
    double worst = 0.0;
    for (int i = 0; i < size; ++i)
      worst = std::max(worst, std::abs(p[i] - pd[i]) / (kAtol + kRtol * std::abs(pd[i])));
    BOOST_TEST(worst <= 1.0, "size " << size << ": " << worst);
  }
}

// ---------------------------------------------------------------------------------------
// Refusals and text
// ---------------------------------------------------------------------------------------

template <class F>
void check_throws(F&& f, std::string_view needle) {
  try {
    f();
    BOOST_ERROR("no exception; expected one containing '" << needle << "'");
  } catch (const std::exception& e) {
    BOOST_TEST(std::string_view(e.what()).find(needle) != std::string_view::npos,
               "'" << e.what() << "' should contain '" << needle << "'");
  }
}

BOOST_AUTO_TEST_CASE(refuses_bad_hyper_parameters) {
  const auto bad = [](auto edit, std::string_view needle) {
    galore_adamw::hyper_params h;
    h.rank = 4;
    edit(h);
    check_throws([&] { h.validate(); }, needle);
    BOOST_CHECK_THROW(h.validate(), distopt::invalid_hyper_parameter);
  };
  using hp = galore_adamw::hyper_params;
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  bad([](hp& h) { h.rank = 0; }, "invalid rank 0");
  bad([](hp& h) { h.rank = -2; }, "invalid rank -2");
  bad([](hp& h) { h.update_proj_gap = 0; }, "invalid update_proj_gap 0");
  bad([](hp& h) { h.update_proj_gap = -5; }, "invalid update_proj_gap -5");
  bad([](hp& h) { h.betas = {1.0, 0.999}; }, "invalid betas[0] 1");
  bad([](hp& h) { h.betas = {0.9, -0.1}; }, "invalid betas[1] -0.1");
  bad([](hp& h) { h.eps = -1e-6; }, "invalid eps -1e-06");
  bad([](hp& h) { h.eps = nan; }, "invalid eps nan");
  bad([](hp& h) { h.lr = -1.0; }, "invalid lr -1");
  bad([](hp& h) { h.lr = std::numeric_limits<double>::infinity(); }, "invalid lr inf");
  bad([](hp& h) { h.weight_decay = -0.1; }, "invalid weight_decay -0.1");
  bad([](hp& h) { h.scale = 0.0; }, "invalid scale 0");
  galore_adamw::hyper_params ok;  // a plain group and the defaults are valid
  BOOST_CHECK_NO_THROW(ok.validate());
  BOOST_TEST(!ok.rank.has_value());
  BOOST_TEST(ok.lr == 1e-3);
  BOOST_TEST(ok.eps == 1e-6);
  BOOST_TEST(ok.weight_decay == 0.0);
  BOOST_TEST(ok.correct_bias);
  BOOST_TEST(ok.update_proj_gap == 200);
  BOOST_TEST(ok.scale == 1.0);
  BOOST_TEST((ok.proj_type == galore_proj::std_));
}

BOOST_AUTO_TEST_CASE(refuses_shapes_galore_torch_cannot_handle) {
  check_throws([] { galore_projector(0); }, "invalid rank 0");
  check_throws([] { galore_projector(4, 0); }, "invalid update_proj_gap 0");
  check_throws([] { galore_projector(galore_adamw::hyper_params{}); }, "invalid rank 0");
  const galore_projector p(8, 200, 1.0, galore_proj::std_);
  check_throws([&] { (void)p.low_rank_shape(6, 18); },
               "rank 8 exceeds min(m, n) = 6 of a 6 x 18 matrix");
  check_throws([&] { (void)p.low_rank_shape(0, 18); }, "cannot project a 0 x 18 matrix");
  const galore_projector rev(6, 200, 1.0, galore_proj::reverse_std);
  check_throws([&] { (void)rev.low_rank_shape(6, 18); }, "cannot be projected back");
  galore_projector q(4);
  std::vector<float> g(6 * 18, 1.0f), low(4 * 18);
  check_throws([&] { q.project(g.data(), low.data()); }, "no projection yet");
  g[5] = std::numeric_limits<float>::quiet_NaN();
  check_throws([&] { q.refresh(g.data(), 6, 18); },
               "sgesdd_: the matrix holds a non-finite value at (0, 5)");
  check_throws([] { (void)distopt::parse_galore_proj("diagonal"); },
               "invalid proj_type 'diagonal': must be one of std, reverse_std, left, right, full");
  check_throws(
      [] {
        std::vector<float> a(5);
        (void)distopt::detail::svd_thin<float>(a, 2, 3);
      },
      "a 2 x 3 matrix needs 6 values, got 5");
  check_throws([&] { q.set_ortho(6, 18, {}, {}); }, "needs 24 left and 0 right values");
}

BOOST_AUTO_TEST_CASE(hyper_parameters_as_text) {
  galore_adamw::hyper_params h;
  for (auto p : kAllProj)
    BOOST_TEST((distopt::parse_galore_proj(distopt::galore_proj_name(p)) == p));
  distopt::set_hyper_param<galore_adamw>(h, "rank", "128");
  distopt::set_hyper_param<galore_adamw>(h, "proj_type", "reverse_std");
  distopt::set_hyper_param<galore_adamw>(h, "update_proj_gap", "50");
  distopt::set_hyper_param<galore_adamw>(h, "scale", "0.25");
  distopt::set_hyper_param<galore_adamw>(h, "correct_bias", "false");
  distopt::set_hyper_param<galore_adamw>(h, "betas", "0.9,0.95");
  BOOST_TEST(*h.rank == 128);
  const std::string text = distopt::hyper_params_string<galore_adamw>(h);
  BOOST_TEST(text ==
             "lr=0.001 betas=0.9,0.95 eps=1e-06 weight_decay=0 correct_bias=false rank=128 "
             "update_proj_gap=50 scale=0.25 proj_type=reverse_std");
  // Reads back.
  galore_adamw::hyper_params back;
  std::stringstream words(text);
  for (std::string kv; words >> kv;) {
    const auto eq = kv.find('=');
    distopt::set_hyper_param<galore_adamw>(back, kv.substr(0, eq), kv.substr(eq + 1));
  }
  BOOST_TEST(distopt::hyper_params_string<galore_adamw>(back) == text);
  distopt::set_hyper_param<galore_adamw>(h, "rank", "None");
  BOOST_TEST(!h.rank.has_value());
  check_throws([&] { distopt::set_hyper_param<galore_adamw>(h, "rank", "four"); },
               "'rank' expects an integer or None, got 'four'");
  check_throws([&] { distopt::set_hyper_param<galore_adamw>(h, "momentum", "0.9"); },
               "unknown hyper-parameter 'momentum' (known: lr, betas, eps, weight_decay, "
               "correct_bias, rank, "
               "update_proj_gap, scale, proj_type)");
  check_throws([&] { distopt::set_hyper_param<galore_adamw>(h, "update_proj_gap", "1.5"); },
               "'update_proj_gap' expects an integer");
  check_throws([&] { distopt::set_hyper_param<galore_adamw>(h, "proj_type", "STD"); },
               "invalid proj_type 'STD'");
  const std::vector<std::pair<std::string, std::string>> settings{{"rank", "0"}};
  check_throws(
      [&] {
        (void)distopt::apply_hyper_params<galore_adamw>(galore_adamw::hyper_params{}, settings);
      },
      "invalid rank 0");
}

// ---------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------

// The SVD and the projections give the same bits whatever OpenBLAS's thread setting and
// whether they run on several caller threads at once; the setting is restored.
BOOST_AUTO_TEST_CASE(results_do_not_depend_on_blas_threads) {
  using get_fn = int (*)();
  using set_fn = void (*)(int);
  const auto get = reinterpret_cast<get_fn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const auto set = reinterpret_cast<set_fn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  // K = 700 > OpenBLAS's GEMM_Q: where serial and threaded GEMM split the sum differently.
  const std::int64_t m = 300, n = 700;
  const auto g = random_matrix(m, n, 77);
  const auto run = [&] {
    galore_projector p(32, 200, 1.0, galore_proj::full);
    p.refresh(g.data(), m, n);
    std::vector<float> low(32 * 32), full(g.size()), out(p.left().begin(), p.left().end());
    p.project(g.data(), low.data());
    p.project_back(low.data(), full.data());
    out.insert(out.end(), p.right().begin(), p.right().end());
    out.insert(out.end(), low.begin(), low.end());
    out.insert(out.end(), full.begin(), full.end());
    return out;
  };
  const auto base = run();
  if (get != nullptr && set != nullptr) {
    const int before = get();
    for (int threads : {1, 2, 4}) {
      set(threads);
      BOOST_TEST((run() == base), "OpenBLAS threads " << threads);
      BOOST_TEST(get() == threads);  // restored
    }
    set(before);
  } else {
    BOOST_TEST_MESSAGE("not OpenBLAS: thread setting not varied");
  }
  std::vector<std::vector<float>> results(3);
  std::vector<std::thread> workers;
  for (auto& r : results) workers.emplace_back([&r, &run] { r = run(); });
  for (auto& w : workers) w.join();
  for (const auto& r : results) BOOST_TEST((r == base));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
