// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Layer-wise policies (Lamb, Adafactor, CAME) stay exact when sharded and split:
//  - the exact statistics accumulator (fixed_sum) against a 128-bit integer reference,
//    and its independence of order and partition; the tensor, row and column sums of the
//    engine against their documented order, recomputed (the column windows in front of
//    the fixed_sums give the bits of one exact add per value);
//  - the global norm's pieces: exact_sum against a 128-bit integer reference and under
//    any partition, and sum_of_squares in its documented 16-lane order (fp32, bf16, fp16
//    grads) within 1e-14 of a long double sum;
//  - params, every state slot and every row/column state bit-identical for d = 1..8 DP
//    ranks (threads) over 100 steps, on awkward layouts and matrices whose rows straddle
//    shard cuts, and for 1 vs 3 threads per rank;
//  - a TP = 2 x DP = 2 grid with row- and column-split matrices equal to the unsplit
//    single-rank run, bit for bit;
//  - the statistics communicated: exactly the wire the layout predicts, O(tensors + rows
//    + cols), and the communicator's byte counter agrees;
//  - hyper-parameter refusals.
// Parity with the reference implementations is tested on golden traces (tests/reference).

#include "layerwise_cases.hpp"
#include "tp_grid.hpp"

#include <distopt/detail/exact_sum.hpp>
#include <distopt/detail/fixed_sum.hpp>
#include <distopt/detail/layer_loop.hpp>
#include <distopt/detail/update_loop.hpp>

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>
#include <mutex>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <random>
#include <utility>

namespace {

using namespace distopt;
using namespace harness;
using detail::fixed_sum;

// ---------------------------------------------------------------------------------------
// fixed_sum
// ---------------------------------------------------------------------------------------

/// Random fp32 values with exponents in [-40, 40] (both signs): multiples of 2^-63 below
/// 2^41, so their exact sum fits a 128-bit integer in units of 2^-63.
std::vector<float> moderate_values(std::size_t n, unsigned seed, bool signed_values) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> ex(-40, 40);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = static_cast<float>(std::ldexp(mant(rng), ex(rng)));
    if (signed_values && (rng() & 1)) x = -x;
  }
  return v;
}

__extension__ typedef __int128 i128;

i128 exact_units(const std::vector<float>& v) {
  i128 s = 0;
  for (float x : v) s += static_cast<i128>(std::ldexp(static_cast<double>(x), 63));  // exact: < 2^104
  return s;
}

double bits_apart(double a, double b) {
  std::int64_t x, y;
  std::memcpy(&x, &a, 8);
  std::memcpy(&y, &b, 8);
  return std::fabs(static_cast<double>(x - y));
}

BOOST_AUTO_TEST_SUITE(fixed_sum_exact)

BOOST_AUTO_TEST_CASE(matches_a_128_bit_integer_reference) {
  for (bool sgn : {false, true}) {
    const auto v = moderate_values(20000, sgn ? 7 : 3, sgn);
    fixed_sum f;
    for (float x : v) f.add(x);
    const double want = std::ldexp(static_cast<double>(exact_units(v)), -63);
    // value() rounds from the top 96 bits: at most one ulp from the correctly rounded sum.
    BOOST_TEST(bits_apart(f.value(), want) <= 1.0, f.value() << " vs " << want);
  }
}

BOOST_AUTO_TEST_CASE(independent_of_order_partition_and_segment_doubles) {
  // The whole fp32 range, subnormals and the largest finite values included.
  std::mt19937_64 rng(11);
  std::vector<float> v;
  for (int i = 0; i < 5000; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(rng()) & 0x7fffffffu;
    if (((u >> 23) & 0xff) == 0xff) u &= 0x7f7fffffu;  // finite
    float x;
    std::memcpy(&x, &u, 4);
    v.push_back(x);
  }
  fixed_sum whole;
  for (float x : v) whole.add(x);
  double wire_whole[fixed_sum::wire_size];
  whole.to_wire(wire_whole);
  for (unsigned trial = 0; trial < 5; ++trial) {
    std::vector<float> w = v;
    std::shuffle(w.begin(), w.end(), rng);
    // Cut into "ranks" at random places, each summing runs in double (as segments do) and
    // the doubles exactly; the ranks' wires are added element-wise, as an all-reduce does.
    const int ranks = 2 + static_cast<int>(trial);
    std::vector<double> wire(fixed_sum::wire_size, 0.0);
    std::size_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::size_t end = r + 1 == ranks ? w.size() : at + rng() % (w.size() - at + 1);
      fixed_sum part;
      // Segments: doubles of up to 3 fp32 values of similar size would round; sums of one
      // value never do, and whole-range doubles of several values may: use one-value runs
      // for the huge spread here (the engine's segment sums are checked end to end below).
      for (std::size_t i = at; i < end; ++i) part.add(static_cast<double>(w[i]));
      double pw[fixed_sum::wire_size];
      part.to_wire(pw);
      for (int k = 0; k < fixed_sum::wire_size; ++k) wire[static_cast<std::size_t>(k)] += pw[k];
      at = end;
    }
    const fixed_sum total = fixed_sum::from_wire(wire.data());
    BOOST_TEST(total.value() == whole.value());
    double again[fixed_sum::wire_size];
    total.to_wire(again);
    BOOST_TEST(std::memcmp(again, wire_whole, sizeof again) == 0);
  }
}

BOOST_AUTO_TEST_CASE(cancels_exactly_and_flags_non_finite) {
  fixed_sum f;
  f.add(3.0e38f);
  f.add(1.0e-45f);
  f.add(-3.0e38f);
  BOOST_TEST(f.value() == static_cast<double>(1.0e-45f));
  f.add(-1.0e-45f);
  BOOST_TEST(f.is_zero());
  fixed_sum g;
  g.add(std::numeric_limits<float>::infinity());
  g.add(1.0f);
  BOOST_TEST(std::isinf(g.value()));
  g.add(-std::numeric_limits<float>::infinity());
  BOOST_TEST(std::isnan(g.value()));
}

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// exact_sum and the block sums of squares behind the global norm
// ---------------------------------------------------------------------------------------

/// The documented order of the library's double sums, written out: value(i) for i < n into
/// lane i % 16 in element order, then lanes j and j + w added for w = 8, 4, 2, 1.
template <class F>
double in_documented_lanes(std::size_t n, F value) {
  double lane[16] = {};
  for (std::size_t i = 0; i < n; ++i) lane[i % 16] += value(i);
  for (std::size_t w = 8; w > 0; w /= 2)
    for (std::size_t j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

BOOST_AUTO_TEST_SUITE(global_norm_sums)

/// The exact sum's wire image, to compare sums bit for bit.
std::vector<double> wire_of(detail::exact_sum s) {
  std::vector<double> w(detail::exact_sum::wire_size);
  s.to_wire(std::span<double, detail::exact_sum::wire_size>(w.data(), w.size()));
  return w;
}

BOOST_AUTO_TEST_CASE(exact_sum_matches_a_128_bit_integer_reference_and_any_partition) {
  // Doubles with 53-bit mantissas and exponents in [-30, 20]: multiples of 2^-82 below
  // 2^21, so 20000 of them sum below 2^118 units of 2^-82.
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> ex(-30, 20);
  std::vector<double> v(20000);
  i128 want = 0;
  for (auto& x : v) {
    const std::uint64_t m = (rng() >> 11) | (std::uint64_t{1} << 52);  // 53 bits
    const int e = ex(rng);
    x = std::ldexp(static_cast<double>(m), e - 52);
    want += static_cast<i128>(m) << (e - 52 + 82);
  }
  detail::exact_sum whole;
  for (double x : v) whole.add(x);
  // value() rounds from the top three limbs: within 2 ulp of the correctly rounded sum.
  const double got = whole.value(), exact = std::ldexp(static_cast<double>(want), -82);
  BOOST_TEST(bits_apart(got, exact) <= 2.0, got << " vs " << exact);
  // Cut into "ranks" anywhere, each rank's wire added element-wise (an all-reduce): the
  // same wire, so the same bits.
  const auto reference = wire_of(whole);
  for (int ranks = 2; ranks <= 5; ++ranks) {
    std::vector<double> wire(detail::exact_sum::wire_size, 0.0);
    std::size_t at = 0;
    for (int r = 0; r < ranks; ++r) {
      const std::size_t end = r + 1 == ranks ? v.size() : at + rng() % (v.size() - at + 1);
      detail::exact_sum part;
      for (std::size_t i = at; i < end; ++i) part.add(v[i]);
      const auto pw = wire_of(part);
      for (std::size_t k = 0; k < wire.size(); ++k) wire[k] += pw[k];
      at = end;
    }
    BOOST_TEST(wire_of(detail::exact_sum::from_wire(
                   std::span<const double, detail::exact_sum::wire_size>(wire.data(), wire.size()))) == reference);
  }
}

BOOST_AUTO_TEST_CASE(exact_sum_subnormals_extremes_and_non_finite) {
  const double tiny = std::numeric_limits<double>::denorm_min(), big = std::numeric_limits<double>::max();
  detail::exact_sum s;
  for (int i = 0; i < 1000; ++i) s.add(tiny);
  s.add(3 * tiny);
  s.add(0.0);
  BOOST_TEST(s.value() == 1003 * tiny);
  detail::exact_sum b;
  b.add(big);
  b.add(big);
  BOOST_TEST(std::isinf(b.value()));  // exact inside, but 2 * max rounds to +Inf as a double
  detail::exact_sum c;
  c.add(big);
  c.add(tiny);
  BOOST_TEST(c.value() == big);
  detail::exact_sum n;
  n.add(1.0);
  n.add(std::numeric_limits<double>::infinity());
  BOOST_TEST(std::isinf(n.value()));
  n.add(std::numeric_limits<double>::quiet_NaN());
  BOOST_TEST(std::isnan(n.value()));
}

/// The device's way of adding (exec/cuda/phases.cuh): each term split by exact_sum::place
/// and its parts added into raw limbs (shared-memory atomics there), then from_parts; and
/// the items' normalised sums added part by part (norm_wire_kernel). Both must give add()'s
/// exact sum, bit for bit, and place's parts must put the value back together.
BOOST_AUTO_TEST_CASE(exact_sum_parts_add_as_the_device_does) {
  using detail::exact_sum;
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> ex(-1074, 1023);
  std::vector<double> v;
  for (int i = 0; i < 5000; ++i) {
    const double x = std::ldexp(static_cast<double>((rng() >> 11) | (std::uint64_t{1} << 52)), ex(rng) - 52);
    v.push_back(std::isfinite(x) ? x : 1.0);  // an overflow of ldexp: any finite value
  }
  for (double x : {0.0, std::numeric_limits<double>::denorm_min(), std::numeric_limits<double>::min(),
                   std::numeric_limits<double>::max(), 1.0, 3.0 * std::numeric_limits<double>::denorm_min()})
    v.push_back(x);
  for (double x : v) {
    std::uint64_t lo = 0, mid = 0, hi = 0;
    const int k = exact_sum::place(x, lo, mid, hi);
    if (x == 0.0) {
      BOOST_TEST(k == -1);
      continue;
    }
    BOOST_TEST_REQUIRE((k >= 0 && k + 2 < exact_sum::limbs), x);
    BOOST_TEST((lo < (std::uint64_t{1} << 32) && mid < (std::uint64_t{1} << 32) && hi < (std::uint64_t{1} << 32)));
    const double back = std::ldexp(static_cast<double>(hi), 32 * k + 64 - 1074) +
                        std::ldexp(static_cast<double>(mid), 32 * k + 32 - 1074) +
                        std::ldexp(static_cast<double>(lo), 32 * k - 1074);
    BOOST_TEST(back == x, x);
  }
  std::uint64_t a = 0, b = 0, c = 0;
  BOOST_TEST(exact_sum::place(std::numeric_limits<double>::quiet_NaN(), a, b, c) == -2);
  BOOST_TEST(exact_sum::place(std::numeric_limits<double>::infinity(), a, b, c) == -3);

  // Three "items", each added into raw limbs from place's parts, against add().
  v.push_back(std::numeric_limits<double>::quiet_NaN());
  v.push_back(std::numeric_limits<double>::infinity());
  v.push_back(std::numeric_limits<double>::infinity());
  exact_sum reference;
  std::vector<exact_sum> items;
  for (std::size_t first = 0; first < v.size(); first += 2000) {
    std::vector<std::uint64_t> raw(exact_sum::limbs + 2, 0);
    for (std::size_t i = first; i < std::min(v.size(), first + 2000); ++i) {
      reference.add(v[i]);
      std::uint64_t lo = 0, mid = 0, hi = 0;
      const int k = exact_sum::place(v[i], lo, mid, hi);
      if (k >= 0) {
        raw[k] += lo;
        raw[k + 1] += mid;
        raw[k + 2] += hi;
      } else if (k == -2) {
        ++raw[exact_sum::limbs];
      } else if (k == -3) {
        ++raw[exact_sum::limbs + 1];
      }
    }
    items.push_back(exact_sum::from_parts(raw.data(), raw[exact_sum::limbs], raw[exact_sum::limbs + 1]));
  }
  std::vector<std::uint64_t> total(exact_sum::limbs + 2, 0);
  for (const exact_sum& s : items)
    for (int i = 0; i < exact_sum::limbs + 2; ++i) {
      BOOST_TEST(s.part(i) < (std::uint64_t{1} << 32), "part " << i << " of a from_parts sum is normalised");
      total[static_cast<std::size_t>(i)] += s.part(i);
    }
  const exact_sum summed = exact_sum::from_parts(total.data(), total[exact_sum::limbs], total[exact_sum::limbs + 1]);
  BOOST_TEST(wire_of(summed) == wire_of(reference));
  BOOST_TEST(summed.part(exact_sum::limbs) == 1u);      // one NaN
  BOOST_TEST(summed.part(exact_sum::limbs + 1) == 2u);  // two Infs
}

/// sum_of_squares in its documented order.
template <class G>
double squares_in_documented_order(const std::vector<G>& g, double scale) {
  return in_documented_lanes(g.size(), [&](std::size_t i) {
    const double x = static_cast<double>(to_float(g[i])) * scale;
    return x * x;
  });
}

template <class G>
void check_sum_of_squares() {
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (std::size_t n : {0, 1, 5, 15, 16, 17, 31, 255, 256, 257, 1000}) {
    std::vector<G> g(n);
    for (auto& x : g) x = from_float<G>(d(rng));
    for (double scale : {1.0, 1.0 / 65536.0, 0.3}) {
      const double got = detail::sum_of_squares(g.data(), scale, n);
      BOOST_TEST(got == squares_in_documented_order(g, scale), "n " << n << " scale " << scale);
      long double ref = 0;
      for (const auto& x : g) {
        const long double y = static_cast<long double>(to_float(x)) * static_cast<long double>(scale);
        ref += y * y;
      }
      BOOST_TEST(std::fabs(got - static_cast<double>(ref)) <= 1e-14 * static_cast<double>(ref), "n " << n);
    }
  }
  std::vector<G> bad(40, from_float<G>(1.0f));
  bad[33] = from_float<G>(std::numeric_limits<float>::infinity());
  BOOST_TEST(std::isinf(detail::sum_of_squares(bad.data(), 1.0, bad.size())));
  bad[7] = from_float<G>(std::numeric_limits<float>::quiet_NaN());
  BOOST_TEST(std::isnan(detail::sum_of_squares(bad.data(), 1.0, bad.size())));
}

BOOST_AUTO_TEST_CASE(sum_of_squares_follows_its_documented_order) {
  check_sum_of_squares<float>();
  check_sum_of_squares<bf16>();
  check_sum_of_squares<fp16>();
}

BOOST_AUTO_TEST_CASE(block_squares_do_not_depend_on_where_runs_are_cut) {
  // The norm's accumulator over a run, and over the same run cut at block boundaries into
  // pieces summed by different accumulators: the same wire.
  constexpr std::size_t block = 256;
  std::mt19937 rng(13);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(block * 37 + 100);
  for (auto& x : g) x = d(rng);
  detail::exact_sum whole;
  detail::add_block_squares(whole, g.data(), 0.5, g.size(), block);
  for (std::size_t cut : {block, 5 * block, 36 * block}) {
    detail::exact_sum a, b;
    detail::add_block_squares(a, g.data(), 0.5, cut, block);
    detail::add_block_squares(b, g.data() + cut, 0.5, g.size() - cut, block);
    a.add(b);
    BOOST_TEST(wire_of(a) == wire_of(whole));
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// The statistics themselves do not depend on the cuts
// ---------------------------------------------------------------------------------------

/// A probe policy: one phase that emits each gradient itself as a tensor, row and column
/// sum, and a finish that records the reduced sums (on the rank's own thread).
thread_local std::vector<double>* probe_record = nullptr;

struct sum_probe {
  static constexpr std::string_view name = "sum_probe";
  static constexpr int max_state_slots = 0;
  struct hyper_params {
    void validate() const {}
  };
  static int state_slots(const hyper_params&) { return 0; }
  struct scalars {
    float unused;
  };
  static scalars prepare(const hyper_params&, const step_info&) { return {0.0f}; }
  static constexpr std::array<phase_spec, 1> phases{{{.tensor_sums = 1, .row_sums = 1, .col_sums = 1,
                                                      .reads_param = false, .writes_param = true}}};
  static constexpr int tensor_values = 0, row_values = 0, col_values = 0, row_states = 0, col_states = 0;
  static bool factored(const hyper_params&, std::span<const std::int64_t> shape) { return shape.size() >= 2; }
  static bool uses_slot(const hyper_params&, int, bool) { return false; }
  template <int Phase, bool Factored>
  static void element(const scalars&, const element_stats&, float&, float g, float*, float* sums) {
    sums[0] = g;
    if constexpr (Factored) sums[1] = sums[2] = g;
  }
  template <int Phase>
  static void finish(const hyper_params&, const scalars&, tensor_stats& t) {
    if (!probe_record) return;
    probe_record->push_back(-static_cast<double>(t.numel));  // a tag: which tensor follows
    probe_record->push_back(t.sums[0]);
    for (double x : t.row_sums[0]) probe_record->push_back(x);
    for (double x : t.col_sums[0]) probe_record->push_back(x);
  }
};
static_assert(policy_is_layerwise<sum_probe>);

/// One step of the probe on d ranks (threads) with `workers` threads each, rank 0 holding
/// the global grads (summed over ranks); each rank's record of the sums it saw.
std::vector<std::vector<double>> probe_step(const layout& l, int d, int workers,
                                            const std::vector<std::pair<std::string, const std::vector<float>*>>& grads) {
  std::vector<std::vector<double>> rec(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    probe_record = &rec[static_cast<std::size_t>(rank)];
    optimizer_options o;
    o.grad_reduce = reduce_op::sum;
    o.check_finite = false;
    optimizer<sum_probe, sharded<fp32>, threads> opt(l, sum_probe::hyper_params{}, o, cpu(workers), std::move(comm));
    if (rank == 0)
      for (const auto& [name, g] : grads) std::copy(g->begin(), g->end(), opt.grad(name).begin());
    opt.step();
    probe_record = nullptr;
  });
  return rec;
}

BOOST_AUTO_TEST_SUITE(statistics_do_not_depend_on_cuts)

BOOST_AUTO_TEST_CASE(a_row_that_loses_bits_in_double_gives_the_same_sum_for_every_d) {
  // Row 1 of a [2, 300] matrix holds 2^60, 211 ones, then from element 512 (a block
  // boundary, where d = 2 cuts) -2^60 and 87 ones. Summed in double over the whole row the
  // ones before -2^60 are lost and the others kept (87); summed per block-and-row segment
  // (as the engine must, since any cut may fall on a block boundary) both runs of ones are
  // lost (0). Every d must report the same sums as d = 1.
  layout l;
  l.add("m", {2, 300});
  l.add("v", {700});
  std::vector<float> gm(600, 0.5f), gv(700);
  for (std::size_t i = 300; i < 600; ++i) gm[i] = 1.0f;
  gm[300] = std::ldexp(1.0f, 60);
  gm[512] = -std::ldexp(1.0f, 60);
  for (std::size_t i = 0; i < gv.size(); ++i) gv[i] = i % 2 ? std::ldexp(1.0f, 55) : 3.0f;
  std::vector<double> want;
  for (int d = 1; d <= 5; ++d) {
    const std::vector<std::vector<double>> rec = probe_step(l, d, 2, {{"m", &gm}, {"v", &gv}});
    // Every rank holding part of a tensor records its sums; all must equal d = 1's.
    const auto split = [](const std::vector<double>& r) {
      std::map<double, std::vector<double>> by_tensor;
      std::vector<double>* cur = nullptr;
      for (double x : r) {
        if (x < 0 && x == std::floor(x) && -x >= 600) cur = &by_tensor[-x];  // a tag
        else cur->push_back(x);
      }
      return by_tensor;
    };
    if (d == 1) want = rec[0];
    const auto ref = split(want);
    BOOST_TEST_CONTEXT("d=" << d) {
      std::size_t seen = 0;
      for (const auto& r : rec)
        for (const auto& [numel, sums] : split(r)) {
          ++seen;
          BOOST_TEST(sums.size() == ref.at(numel).size());
          BOOST_TEST(std::memcmp(sums.data(), ref.at(numel).data(), sums.size() * sizeof(double)) == 0,
                     "tensor of " << numel << " elements");
        }
      BOOST_TEST(seen >= 2u);
    }
  }
  // m: tensor sum 0.5 * 300 (+ 2^60 - 2^60, the ones lost), row 0 = 150, row 1 = 0.
  const auto m = want;
  BOOST_TEST(m.at(1) == 150.0);
  BOOST_TEST(m.at(2) == 150.0);
  BOOST_TEST(m.at(3) == 0.0);
}

/// The statistics' documented order, computed independently: each segment (a row of a
/// matrix, or a run of a vector, cut at the layout's block boundaries, which are aligned to
/// the tensor's own index) summed in double, value j into lane j % 16, the lanes combined
/// pairwise (lane l and l + w for w = 8, 4, 2, 1); the segments' sums added exactly. Column
/// sums: each value added to its column's fixed_sum, one by one.
struct documented_sums {
  double tensor = 0.0;
  std::vector<double> rows, cols;
};
documented_sums documented(const std::vector<float>& g, std::size_t rows_per_matrix, std::size_t cols,
                           std::size_t block) {
  const bool factored = cols > 0;
  const std::size_t row_len = factored ? cols : g.size();
  fixed_sum tensor;
  std::vector<fixed_sum> row_sums(factored ? g.size() / cols : 0);
  std::vector<fixed_sum> col_sums(factored ? g.size() / rows_per_matrix : 0);
  for (std::size_t t = 0; t < g.size();) {
    const std::size_t end = std::min({(t / row_len + 1) * row_len, (t / block + 1) * block, g.size()});
    const double segment = in_documented_lanes(end - t, [&](std::size_t j) { return static_cast<double>(g[t + j]); });
    tensor.add(segment);
    if (factored) row_sums[t / cols].add(segment);
    t = end;
  }
  if (factored)
    for (std::size_t t = 0; t < g.size(); ++t) col_sums[t / (rows_per_matrix * cols) * cols + t % cols].add(g[t]);
  documented_sums out;
  out.tensor = tensor.value();
  for (const fixed_sum& f : row_sums) out.rows.push_back(f.value());
  for (const fixed_sum& f : col_sums) out.cols.push_back(f.value());
  return out;
}

/// The engine's tensor, row and column sums are the documented ones, bit for bit, for every
/// d and thread count. The column sums go through double windows (detail::column_window)
/// that fold into fixed_sums: the values here fall in and out of their columns' windows
/// (zeros, subnormals of both signs, cancellation, Inf, NaN, a first value 120 exponents
/// from the rest), over more rows than a window holds between folds and across the matrices
/// of a 3-D tensor. Tensor "long" breaks any fold limit above 256 rows: 1,200 one-value
/// rows whose in-window sums would pass 2^53 units of the first window (values near 2^45
/// units, with odd-unit values between them) and then cancel, so a lost low bit shows.
/// Tensor "wide" is four pieces (16,384 elements each at most), so a rank with two threads
/// holds it as several work items whose row sums (a row cut between items) and column sums
/// the host merges; with one rank there are more than the layer stage's parallel_merge_sums,
/// which merges them on the executor's threads, with three ranks fewer: on one thread.
BOOST_AUTO_TEST_CASE(statistics_follow_their_documented_order_and_column_sums_are_exact) {
  constexpr std::size_t rows = 700, cols = 9;  // 700 > column_window::max_rows
  layout l;
  l.add("tall", {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)});
  l.add("cube", {4, 30, 40});
  l.add("v", {650});
  l.add("long", {1200, 1});
  l.add("wide", {16400, 3});
  // One rank holds "wide" as more than two chunks, with more row sums than the engine merges
  // on one thread.
  static_assert(16400 * 3 > 2 * 16384);  // the optimizer's chunk_elems: pieces of at most 16,384
  static_assert(16400 >= detail::layer_stage<sum_probe, float, cpu>::parallel_merge_sums);
  std::mt19937_64 rng(29);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  const auto random_finite = [&](std::uint32_t exponent_mask) {
    std::uint32_t u = static_cast<std::uint32_t>(rng()) & (0x807fffffu | exponent_mask);
    if (((u >> 23) & 0xffu) == 0xffu) u &= 0xff7fffffu;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  std::vector<float> tall(rows * cols), cube(4800), v(650), lng(1200), wide(49200);
  for (std::size_t r = 0; r < rows; ++r) {
    float* g = &tall[r * cols];
    g[0] = r % 97 == 5 ? std::ldexp(1.0f, -40) : r % 89 == 7 ? std::ldexp(1.0f, 50) : 1.0f + static_cast<float>(r) / 1024;
    g[1] = r % 3 == 0 ? 0.0f : r % 3 == 1 ? -0.0f : 0.125f;
    const std::uint32_t sub = static_cast<std::uint32_t>((r % 2) << 31) | (static_cast<std::uint32_t>(r * 7919u) & 0x7fffffu);
    std::memcpy(&g[2], &sub, 4);  // subnormals (and a zero), both signs
    g[3] = random_finite(0x7f800000u);
    const float n = normal(rng);
    g[4] = n * n + 1e-30f;
    g[5] = (r % 2 ? -1.0f : 1.0f) * std::ldexp(1.0f, static_cast<int>((r / 2) % 60) - 30);
    g[6] = r == 0 ? std::ldexp(1.0f, -100) : std::ldexp(1.0f + static_cast<float>(r) / 700, 20);
    g[7] = r == 350 ? std::numeric_limits<float>::infinity() : 1.0f;
    g[8] = r == 123 ? std::numeric_limits<float>::quiet_NaN() : -2.0f;
  }
  for (float& x : cube) x = random_finite(0x3f800000u);
  for (float& x : v) x = random_finite(0x3f800000u);
  for (float& x : wide) x = random_finite(0x3f800000u);
  // long: 1.0 opens a window of unit 2^-37 (exponents 113 .. 134); 256 - 2^-16 is just
  // under 2^45 units, 2^-14 (1 + 2^-23) one odd unit above 2^23. Rows 1..599 hold the big
  // value, or the odd one every fourth row; rows 600..1199 the negated big values and the
  // odd ones, so the bigs cancel.
  const float big = 256.0f - std::ldexp(1.0f, -16), odd = std::ldexp(1.0f + std::ldexp(1.0f, -23), -14);
  lng[0] = 1.0f;
  for (std::size_t r = 1; r < lng.size(); ++r) lng[r] = r % 4 == 0 ? odd : r < 600 ? big : -big;
  const std::size_t big_rows = static_cast<std::size_t>(std::count(lng.begin(), lng.end(), big));
  BOOST_TEST_REQUIRE(big_rows == static_cast<std::size_t>(std::count(lng.begin(), lng.end(), -big)));
  BOOST_TEST_REQUIRE(static_cast<double>(big_rows) * std::ldexp(static_cast<double>(big), 37) > std::ldexp(1.0, 53));
  const std::map<double, documented_sums> want = {
      {static_cast<double>(tall.size()), documented(tall, rows, cols, l.block_size())},
      {static_cast<double>(cube.size()), documented(cube, 30, 40, l.block_size())},
      {static_cast<double>(v.size()), documented(v, 0, 0, l.block_size())},
      {static_cast<double>(lng.size()), documented(lng, 1200, 1, l.block_size())},
      {static_cast<double>(wide.size()), documented(wide, 16400, 3, l.block_size())}};
  BOOST_TEST(std::isinf(want.at(6300.0).cols[7]));
  BOOST_TEST(std::isnan(want.at(6300.0).cols[8]));
  BOOST_TEST(want.at(1200.0).cols[0] == 1.0 + 299.0 * static_cast<double>(odd));  // 299 odd rows, exactly
  const auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b); };
  for (int d : {1, 3})
    for (int workers : {1, 2}) {
      const std::vector<std::vector<double>> rec =
          probe_step(l, d, workers, {{"tall", &tall}, {"cube", &cube}, {"v", &v}, {"long", &lng}, {"wide", &wide}});
      BOOST_TEST_CONTEXT("d=" << d << ", " << workers << " threads") {
        std::map<double, int> seen;
        for (const auto& r : rec) {
          // Each tensor this rank holds part of: its tag, tensor sum, row sums, column sums.
          for (std::size_t at = 0; at < r.size();) {
            const double numel = -r[at];
            BOOST_TEST_REQUIRE(want.count(numel) == 1u, "a tag at " << at);
            const documented_sums& w = want.at(numel);
            BOOST_TEST_REQUIRE(r.size() >= at + 2 + w.rows.size() + w.cols.size());
            ++seen[numel];
            BOOST_TEST(same(r[at + 1], w.tensor), "tensor of " << numel << ": " << std::hexfloat << r[at + 1] << " vs "
                                                              << w.tensor);
            at += 2;
            for (std::size_t k = 0; k < w.rows.size(); ++k)
              BOOST_TEST(same(r[at + k], w.rows[k]), "tensor of " << numel << ", row " << k << ": " << std::hexfloat
                                                                 << r[at + k] << " vs " << w.rows[k]);
            at += w.rows.size();
            for (std::size_t k = 0; k < w.cols.size(); ++k)
              BOOST_TEST(same(r[at + k], w.cols[k]), "tensor of " << numel << ", column " << k << ": "
                                                                 << std::hexfloat << r[at + k] << " vs " << w.cols[k]);
            at += w.cols.size();
          }
        }
        for (const auto& [numel, unused] : want) BOOST_TEST(seen[numel] >= 1, "tensor of " << numel << " seen");
      }
    }
}


/// The window's fast path is taken: an unset window takes nothing and is opened by the
/// first value handed to the fixed_sum; then values inside it leave nothing for the
/// fixed_sum, zeros are dropped, and values outside it (and subnormals, Inf, NaN) are
/// handed over.
BOOST_AUTO_TEST_CASE(column_window_takes_values_inside_and_hands_over_the_rest) {
  std::array<double, 16> acc{};
  std::array<std::uint32_t, 16> lo;
  lo.fill(detail::column_window::unset);
  std::array<fixed_sum, 16> sums{};
  std::array<float, 16> in, rest;
  in.fill(1.5f);
  in[3] = 0.0f;
  in[4] = -0.0f;
  in[7] = std::numeric_limits<float>::denorm_min();
  BOOST_TEST(detail::add_to_windows(acc.data(), lo.data(), in.data(), rest.data(), in.size()) != 0u);
  for (double a : acc) BOOST_TEST(a == 0.0);  // nothing is taken by an unset window
  BOOST_TEST(rest[0] == 1.5f);
  detail::add_misses(sums.data(), lo.data(), rest.data(), rest.size());
  BOOST_TEST(sums[0].value() == 1.5);
  BOOST_TEST(lo[0] == detail::column_window::window_at(127 - 14));  // opened at 1.5
  BOOST_TEST(lo[3] == detail::column_window::unset);  // zeros open nothing
  BOOST_TEST(lo[4] == detail::column_window::unset);
  BOOST_TEST(lo[7] == detail::column_window::unset);  // nor do subnormals
  BOOST_TEST(sums[7].value() == static_cast<double>(std::numeric_limits<float>::denorm_min()));
  in.fill(1.0f);
  in[3] = 0.0f;
  // Columns 4 and 7 are still unset: their 1.0 goes to the fixed_sum and opens them.
  BOOST_TEST(detail::add_to_windows(acc.data(), lo.data(), in.data(), rest.data(), in.size()) != 0u);
  BOOST_TEST(acc[0] == 1.0);
  for (std::size_t j = 0; j < rest.size(); ++j) BOOST_TEST(rest[j] == (j == 4 || j == 7 ? 1.0f : 0.0f), "column " << j);
  detail::add_misses(sums.data(), lo.data(), rest.data(), rest.size());
  BOOST_TEST(lo[4] == lo[0]);
  BOOST_TEST(lo[7] == lo[0]);
  BOOST_TEST(lo[3] == detail::column_window::unset);
  in.fill(2.0f);
  in[3] = -0.0f;
  in[5] = std::ldexp(1.0f, 40);   // 40 exponents above 1.5's window
  in[6] = std::ldexp(1.0f, -20);  // below it
  in[8] = std::numeric_limits<float>::infinity();
  in[9] = std::numeric_limits<float>::quiet_NaN();
  // 1.5 opened exponents 113 .. 134: magnitudes 2^-14 up to just below 2^8.
  in[10] = 128.0f;                 // the top exponent
  in[11] = std::ldexp(1.0f, -14);  // the bottom one
  in[12] = std::ldexp(1.0f, -15);  // just below
  in[13] = 255.9f;                  // inside, near the top
  in[14] = 256.0f;                  // just above
  BOOST_TEST(detail::add_to_windows(acc.data(), lo.data(), in.data(), rest.data(), in.size()) != 0u);
  BOOST_TEST(acc[0] == 3.0);
  BOOST_TEST(acc[3] == 0.0);
  BOOST_TEST(rest[0] == 0.0f);
  BOOST_TEST(rest[5] == std::ldexp(1.0f, 40));
  BOOST_TEST(rest[6] == std::ldexp(1.0f, -20));
  BOOST_TEST(std::isinf(rest[8]));
  BOOST_TEST(std::isnan(rest[9]));
  BOOST_TEST(rest[10] == 0.0f);
  BOOST_TEST(acc[10] == 129.0);
  BOOST_TEST(rest[11] == 0.0f);
  BOOST_TEST(acc[11] == 1.0 + std::ldexp(1.0, -14));
  BOOST_TEST(rest[12] == std::ldexp(1.0f, -15));
  BOOST_TEST(rest[13] == 0.0f);
  BOOST_TEST(rest[14] == 256.0f);
  const std::array<std::uint32_t, 16> before = lo;
  detail::add_misses(sums.data(), lo.data(), rest.data(), rest.size());
  BOOST_TEST((lo == before));  // a miss leaves a set window alone, Inf and NaN open none
  BOOST_TEST(std::isinf(sums[8].value()));
  BOOST_TEST(std::isnan(sums[9].value()));
  BOOST_TEST(sums[5].value() == 1.5 + std::ldexp(1.0, 40));  // 1.5 opened it, 1.0 sits in acc[5]
  // The highest window: FLT_MAX fits, Inf (one exponent above its top) does not.
  std::array<std::uint32_t, 2> top{detail::column_window::window_at(250), detail::column_window::window_at(250)};
  BOOST_TEST(top[0] == 233u << 23);
  std::array<double, 2> top_acc{};
  std::array<float, 2> top_in{std::numeric_limits<float>::max(), -std::numeric_limits<float>::infinity()}, top_rest{};
  BOOST_TEST(detail::add_to_windows(top_acc.data(), top.data(), top_in.data(), top_rest.data(), 2) != 0u);
  BOOST_TEST(top_acc[0] == static_cast<double>(std::numeric_limits<float>::max()));
  BOOST_TEST(top_rest[0] == 0.0f);
  BOOST_TEST(top_acc[1] == 0.0);
  BOOST_TEST(top_rest[1] == -std::numeric_limits<float>::infinity());
  std::array<float, 16> none{};
  none[2] = -0.0f;
  BOOST_TEST(detail::add_to_windows(acc.data(), lo.data(), none.data(), rest.data(), none.size()) == 0u);
  detail::fold_windows(acc.data(), lo.data(), sums.data(), acc.size(), 3);
  BOOST_TEST(sums[0].value() == 4.5);
  BOOST_TEST(acc[0] == 0.0);
  BOOST_TEST(lo[0] != detail::column_window::unset);  // re-centred on the mean
}

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// d = 1..8 bit-identity over 100 steps
// ---------------------------------------------------------------------------------------

/// Row and column states of every tensor, as one rank sees them.
struct factor_copy {
  std::vector<std::vector<float>> rows, cols;  // [tensor * states + k]
  bool operator==(const factor_copy&) const = default;
};

template <class Opt>
factor_copy copy_factors(const Opt& opt) {
  using P = typename Opt::policy_type;
  factor_copy f;
  for (const auto& t : opt.tensors().tensors()) {
    for (int k = 0; k < P::row_states; ++k) {
      const auto s = opt.row_state(t.name, k);
      f.rows.emplace_back(s.begin(), s.end());
    }
    for (int k = 0; k < P::col_states; ++k) {
      const auto s = opt.col_state(t.name, k);
      f.cols.emplace_back(s.begin(), s.end());
    }
  }
  return f;
}

template <class Policy, class Prec>
void check_every_d(const typename Policy::hyper_params& h, int steps = 100, dtype t = dtype::f32) {
  run_options ro;
  ro.steps = sanitized_steps(steps, 10);  // under TSan the four cases ran 104 s at 100 steps
  const std::vector<typename Policy::hyper_params> hs{h};
  for (const layout_case& c : layerwise_layouts()) {
    ro.options.bucket_elems = c.bucket;
    const layout l = make_layout(c, t);
    // The single-rank reference, with its factored states.
    using single_t = optimizer<Policy, replicated<fp32>, single, cpu, Prec>;
    single_t ref_opt(l, hs, ro.options);
    outcome ref = blank<single_t>(l, Policy::state_slots(h));
    drive(ref_opt, 0, ro, &ref);
    collect(ref_opt, 0, ref);
    const factor_copy ref_f = copy_factors(ref_opt);
    for (int d = 1; d <= 8; ++d) {
      for (int th : {1, 3}) {
        if (th == 3 && d != 2) continue;
        BOOST_TEST_CONTEXT(Policy::name << " layout " << c.name << " d=" << d << " threads=" << th) {
          using opt_t = optimizer<Policy, sharded<fp32>, threads, cpu, Prec>;
          run_options rd = ro;
          rd.threads = th;
          rd.options.grad_reduce = reduce_op::sum;
          outcome got = blank<opt_t>(l, Policy::state_slots(h));
          std::vector<factor_copy> factors(static_cast<std::size_t>(d));
          std::vector<std::vector<char>> holds(static_cast<std::size_t>(d));
          run_ranks(d, [&](threads& comm) {
            const int rank = comm.rank();
            opt_t opt(l, hs, rd.options, cpu(th), std::move(comm));
            drive(opt, rank, rd, rank == 0 ? &got : nullptr);
            collect(opt, rank, got);
            factors[static_cast<std::size_t>(rank)] = copy_factors(opt);
          });
          BOOST_TEST((got.params == ref.params));
          BOOST_TEST((got.master == ref.master));
          BOOST_TEST((got.states == ref.states));
          // Each rank holding part of a factored tensor keeps its whole row and column
          // states, equal to the single rank's; the others keep none.
          for (const factor_copy& f : factors) {
            for (std::size_t i = 0; i < f.rows.size(); ++i)
              if (!f.rows[i].empty()) BOOST_TEST((f.rows[i] == ref_f.rows[i]), "row state " << i);
            for (std::size_t i = 0; i < f.cols.size(); ++i)
              if (!f.cols[i].empty()) BOOST_TEST((f.cols[i] == ref_f.cols[i]), "col state " << i);
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE(every_d_100_steps)

BOOST_AUTO_TEST_CASE(lamb_fp32) { check_every_d<lamb, precision<float>>(lamb_case()); }
BOOST_AUTO_TEST_CASE(adafactor_relative_step_fp32) { check_every_d<adafactor, precision<float>>(adafactor_relative()); }
BOOST_AUTO_TEST_CASE(adafactor_beta1_bf16_master) {
  check_every_d<adafactor, precision<bf16, bf16>>(adafactor_lr_beta1(), 100, dtype::bf16);
}
BOOST_AUTO_TEST_CASE(came_fp32) { check_every_d<came, precision<float>>(came_case()); }

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// TP = 2 x DP = 2 against the unsplit single rank
// ---------------------------------------------------------------------------------------

template <class Policy>
void check_tp_grid(const typename Policy::hyper_params& h) {
  std::vector<std::vector<float>> ref_states, got_states;
  const auto ref = run_grid<Policy>(tp_tensors(), {h}, {}, &ref_states);
  const auto got = run_grid<Policy>(tp_tensors(), {h}, {.dp = 2, .tp = 2}, &got_states);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    BOOST_TEST_CONTEXT(Policy::name << " tensor " << i) {
      BOOST_TEST(std::memcmp(got[i].data(), ref[i].data(), ref[i].size() * sizeof(float)) == 0);
      BOOST_TEST(std::memcmp(got_states[i].data(), ref_states[i].data(), ref_states[i].size() * sizeof(float)) == 0);
      // Not a vacuous comparison: the params moved.
      BOOST_TEST(ref[i][0] != init_value(i, 0));
    }
  }
}

BOOST_AUTO_TEST_SUITE(tensor_parallel_grid)

BOOST_AUTO_TEST_CASE(lamb_2x2) { check_tp_grid<lamb>(lamb_case()); }
BOOST_AUTO_TEST_CASE(adafactor_2x2) { check_tp_grid<adafactor>(adafactor_relative()); }
BOOST_AUTO_TEST_CASE(adafactor_beta1_2x2) { check_tp_grid<adafactor>(adafactor_lr_beta1()); }
BOOST_AUTO_TEST_CASE(came_2x2) { check_tp_grid<came>(came_case()); }

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// What the statistics cost on the wire
// ---------------------------------------------------------------------------------------

/// The statistics wire of one step as the layout predicts it: for every phase, every
/// tensor cut over several DP ranks contributes its tensor sums and, when factored, its
/// row and column sums, each as fixed_sum::wire_size doubles.
template <class Policy>
std::size_t predicted_wire_bytes(const layout& l, int d, const typename Policy::hyper_params& h,
                                 std::size_t bucket_elems) {
  const detail::shard_plan plan(l, d, 0, bucket_elems, 1u << 14);
  std::size_t sums = 0;
  for (const auto& b : plan.buckets())
    for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
      const tensor_slot& t = l.tensors()[i];
      const std::size_t lo = t.offset - b.layout_begin, hi = lo + t.numel - 1;
      if (lo / b.shard_elems == hi / b.shard_elems) continue;
      const bool f = Policy::factored(h, t.shape);
      const std::size_t c = f ? static_cast<std::size_t>(t.shape.back()) : 0;
      const std::size_t r = f ? t.numel / c : 0;  // rows of all matrices
      const std::size_t cols = f ? c * (t.numel / (c * static_cast<std::size_t>(t.shape[t.shape.size() - 2]))) : 0;
      for (const phase_spec& p : Policy::phases)
        sums += static_cast<std::size_t>(p.tensor_sums) + static_cast<std::size_t>(p.row_sums) * r +
                static_cast<std::size_t>(p.col_sums) * cols;
    }
  return sums * fixed_sum::wire_size * sizeof(double);
}

template <class Policy>
void check_wire(const typename Policy::hyper_params& h, const layout& l, int d, std::size_t* per_step) {
  optimizer_options o;
  o.bucket_elems = std::size_t{1} << 22;
  const int steps = 3;
  std::vector<std::size_t> stats(static_cast<std::size_t>(d)), sent(static_cast<std::size_t>(d)),
      base(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    threads other = comm.split(0, rank);  // the same group again, for the element-wise baseline
    optimizer<Policy, sharded<fp32>, threads> opt(l, h, o, cpu(1), std::move(comm));
    optimizer<adamw, sharded<fp32>, threads> ref(l, adamw::hyper_params{}, o, cpu(1), std::move(other));
    const std::size_t s0 = opt.communicator().bytes_sent(), r0 = ref.communicator().bytes_sent();
    for (int s = 0; s < steps; ++s) {
      for (const auto& t : l.tensors()) {
        auto g = opt.grad(t.name);
        auto gr = ref.grad(t.name);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = gr[i] = grad_value(s, 0, i);
      }
      opt.step();
      ref.step();
    }
    stats[static_cast<std::size_t>(rank)] = opt.statistics_bytes();
    sent[static_cast<std::size_t>(rank)] = opt.communicator().bytes_sent() - s0;
    base[static_cast<std::size_t>(rank)] = ref.communicator().bytes_sent() - r0;
  });
  const std::size_t want = predicted_wire_bytes<Policy>(l, d, h, o.bucket_elems);
  for (int r = 0; r < d; ++r) BOOST_TEST(stats[static_cast<std::size_t>(r)] == steps * want);
  // Over all ranks an all-reduce of W bytes sends 2 (d - 1) W (threads.hpp's ring model):
  // the only traffic lamb/adafactor/came add to adamw's step is the statistics.
  const std::size_t extra = std::accumulate(sent.begin(), sent.end(), std::size_t{0}) -
                            std::accumulate(base.begin(), base.end(), std::size_t{0});
  BOOST_TEST(extra == 2 * static_cast<std::size_t>(d - 1) * steps * want);
  *per_step = want;
}

BOOST_AUTO_TEST_SUITE(statistics_on_the_wire)

BOOST_AUTO_TEST_CASE(is_what_the_layout_predicts_and_grows_with_rows_and_cols_only) {
  // Two layouts with the same number of rows, one with 4x the columns (and params).
  for (int d : {2, 3, 4}) {
    layout narrow, wide;
    narrow.add("w", {64, 256});
    narrow.add("v", {300});
    wide.add("w", {64, 1024});
    wide.add("v", {300});
    std::size_t lamb_n = 0, ada_n = 0, ada_w = 0, came_n = 0;
    check_wire<lamb>(lamb_case(), narrow, d, &lamb_n);
    check_wire<adafactor>(adafactor_relative(), narrow, d, &ada_n);
    check_wire<adafactor>(adafactor_relative(), wide, d, &ada_w);
    check_wire<came>(came_case(), narrow, d, &came_n);
    // Lamb: 2 sums per cut tensor; Adafactor: p^2, g^2 rows/cols, u^2.
    BOOST_TEST(lamb_n == 2u * 1 * fixed_sum::wire_size * sizeof(double));
    BOOST_TEST(ada_n == (1u + 64 + 256 + 1) * fixed_sum::wire_size * sizeof(double));
    BOOST_TEST(ada_w - ada_n == (1024u - 256) * fixed_sum::wire_size * sizeof(double));
    BOOST_TEST(came_n == (2u * (64 + 256) + 1) * fixed_sum::wire_size * sizeof(double));
    // Against the params' own traffic (a reduce-scatter of grads and an all-gather of
    // params, 2 (d-1)/d * 4 bytes each per param): a few percent, not a multiple.
    const double param_traffic = 2.0 * 4.0 * (64.0 * 1024) * (d - 1) / d;
    BOOST_TEST(static_cast<double>(ada_w) * 2 * (d - 1) / d < 0.5 * param_traffic);
  }
}

BOOST_AUTO_TEST_CASE(replicated_storage_communicates_no_statistics) {
  layout l;
  l.add("w", {64, 256});
  run_ranks(3, [&](threads& comm) {
    optimizer<adafactor, replicated<fp32>, threads> opt(l, adafactor_relative(), {}, cpu(1), std::move(comm));
    for (auto& g : opt.grad("w")) g = 0.25f;
    opt.step();
    if (opt.statistics_bytes() != 0) throw std::runtime_error("replicated storage sent statistics");
  });
}

BOOST_AUTO_TEST_SUITE_END()

// ---------------------------------------------------------------------------------------
// Refusals and memory
// ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_SUITE(hyper_parameters)

template <class Policy>
std::string refusal(typename Policy::hyper_params h) {
  try {
    h.validate();
  } catch (const invalid_hyper_parameter& e) {
    return e.what();
  }
  return "";
}

BOOST_AUTO_TEST_CASE(invalid_values_are_named) {
  adafactor::hyper_params a;
  a.lr = 1e-3;  // with relative_step (the default)
  BOOST_TEST(refusal<adafactor>(a).find("cannot be combined with relative_step=true") != std::string::npos);
  a = {};
  a.relative_step = false;
  BOOST_TEST(refusal<adafactor>(a).find("lr is None and relative_step is false") != std::string::npos);
  a = {};
  a.relative_step = false;
  a.lr = 1e-2;
  a.warmup_init = true;
  BOOST_TEST(refusal<adafactor>(a).find("warmup_init=true requires relative_step=true") != std::string::npos);
  a = {};
  a.decay_rate = 0.5;
  BOOST_TEST(refusal<adafactor>(a) == "adafactor: invalid decay_rate 0.5: must be a finite value < 0 (beta2 = 1 - step^decay_rate)");
  a = {};
  a.beta1 = 1.0;
  BOOST_TEST(refusal<adafactor>(a).find("invalid beta1 1") != std::string::npos);
  came::hyper_params c;
  c.lr = 0.0;
  BOOST_TEST(refusal<came>(c) == "came: invalid lr 0: must be a finite value > 0");
  c = {};
  c.betas[2] = 1.5;
  BOOST_TEST(refusal<came>(c) == "came: invalid betas[2] 1.5: must be in [0, 1]");
  lamb::hyper_params l;
  l.clamp_value = -1.0;
  BOOST_TEST(refusal<lamb>(l) == "lamb: invalid clamp_value -1: must be >= 0 (inf: no clamp)");
  l = {};
  l.clamp_value = std::numeric_limits<double>::infinity();
  BOOST_TEST(refusal<lamb>(l).empty());  // apex's choice: no clamp
}

BOOST_AUTO_TEST_CASE(optional_values_parse_from_text) {
  adafactor::hyper_params a;
  set_hyper_param<adafactor>(a, "lr", "0.01");
  set_hyper_param<adafactor>(a, "beta1", "0.9");
  BOOST_TEST(a.lr.value() == 0.01);
  BOOST_TEST(a.beta1.value() == 0.9);
  set_hyper_param<adafactor>(a, "lr", "None");
  BOOST_TEST(!a.lr.has_value());
  BOOST_CHECK_THROW(set_hyper_param<adafactor>(a, "beta1", "maybe"), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(memory_report_shows_factored_states) {
  layout l;
  l.add("w", {256, 512});
  l.add("b", {512});
  optimizer<adafactor> a(l, adafactor_relative());
  const auto r = a.memory_report();
  // Factored: no per-element second moment for w, only its rows and columns.
  BOOST_TEST(r.bytes("state 0") == 512 * sizeof(float));  // b's exp_avg_sq only
  BOOST_TEST(r.bytes("state rows") == 256 * sizeof(float));
  BOOST_TEST(r.bytes("state cols") == 512 * sizeof(float));
  optimizer<came> c(l, came_case());
  const auto rc = c.memory_report();
  BOOST_TEST(rc.bytes("state 0") == (256 * 512 + 512) * sizeof(float));  // exp_avg everywhere
  BOOST_TEST(rc.bytes("state 1") == 512 * sizeof(float));
  BOOST_TEST(rc.bytes("state rows") == 2 * 256 * sizeof(float));
  BOOST_TEST(rc.bytes("state cols") == 2 * 512 * sizeof(float));
  BOOST_TEST(c.state("w", 1).empty());
  BOOST_TEST(c.row_state("b", 0).empty());
}

/// Params after 5 steps of lamb with `h` on a small layout.
std::vector<float> lamb_params(const lamb::hyper_params& h) {
  layout l;
  l.add("w", {9, 29});
  l.add("b", {7});
  optimizer<lamb> opt(l, h);
  for (std::size_t i = 0; i < opt.param("w").size(); ++i) opt.param("w")[i] = init_value(0, i);
  for (std::size_t i = 0; i < opt.param("b").size(); ++i) opt.param("b")[i] = init_value(1, i);
  for (int s = 0; s < 5; ++s) {
    for (std::size_t i = 0; i < opt.grad("w").size(); ++i) opt.grad("w")[i] = grad_value(s, 0, i);
    for (std::size_t i = 0; i < opt.grad("b").size(); ++i) opt.grad("b")[i] = grad_value(s, 1, i);
    opt.step();
  }
  std::vector<float> out(opt.param("w").begin(), opt.param("w").end());
  out.insert(out.end(), opt.param("b").begin(), opt.param("b").end());
  return out;
}

BOOST_AUTO_TEST_CASE(lamb_apex_options) {
  // always_adapt=false (apex without use_nvlamb): no trust ratio where weight_decay is 0,
  // which is Lamb with adam=true; with weight decay the trust ratio applies as before.
  lamb::hyper_params plain, apex, adam_like;
  apex.always_adapt = false;
  adam_like.adam = true;
  BOOST_TEST((lamb_params(apex) == lamb_params(adam_like)));
  BOOST_TEST((lamb_params(apex) != lamb_params(plain)));
  plain.weight_decay = apex.weight_decay = 0.01;
  BOOST_TEST((lamb_params(apex) == lamb_params(plain)));
  // clamp_value=inf (apex: no clamp) differs from the default clamp only where ||p|| > 10;
  // these params have norms below 1.
  lamb::hyper_params unclamped;
  unclamped.clamp_value = std::numeric_limits<double>::infinity();
  BOOST_TEST((lamb_params(unclamped) == lamb_params(lamb::hyper_params{})));
}

BOOST_AUTO_TEST_CASE(lamb_clamp_value_bounds_the_step_by_min_of_norm_and_clamp) {
  // One Lamb step moves a tensor by lr * trust * ||u|| = lr * min(||p||, clamp_value)
  // whatever the gradient, so the step's length reads the clamp back. "w" has a norm of
  // about 47 (above the clamps of 10 and 25), "b" about 2.2 (below every clamp tried).
  layout l;
  l.add("w", {9, 29});
  l.add("b", {7});
  const std::array<std::pair<const char*, float>, 2> tensors{{{"w", 20.0f}, {"b", 2.0f}}};
  for (const double clamp : {10.0, 25.0, std::numeric_limits<double>::infinity()}) {
    lamb::hyper_params h;
    h.lr = 1e-2;
    h.clamp_value = clamp;
    optimizer<lamb> opt(l, h);
    std::array<double, 2> norm{};
    for (std::size_t t = 0; t < 2; ++t) {
      auto p = opt.param(tensors[t].first);
      for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] = init_value(t, i) * tensors[t].second;
        norm[t] += double(p[i]) * p[i];
      }
      norm[t] = std::sqrt(norm[t]);
      for (std::size_t i = 0; i < p.size(); ++i) opt.grad(tensors[t].first)[i] = grad_value(0, t, i);
    }
    BOOST_TEST_REQUIRE(norm[0] > 25.0);
    BOOST_TEST_REQUIRE(norm[1] < 10.0);
    std::array<std::vector<float>, 2> before;
    for (std::size_t t = 0; t < 2; ++t) before[t].assign(opt.param(tensors[t].first).begin(), opt.param(tensors[t].first).end());
    opt.step();
    for (std::size_t t = 0; t < 2; ++t) {
      double moved = 0.0;
      const auto p = opt.param(tensors[t].first);
      for (std::size_t i = 0; i < p.size(); ++i) moved += std::pow(double(p[i]) - before[t][i], 2);
      const double want = h.lr * std::min(norm[t], clamp);
      // fp32 params: each element's step carries the rounding of a value near |p|.
      BOOST_TEST(std::sqrt(moved) == want, boost::test_tools::tolerance(2e-3));
      BOOST_TEST_MESSAGE("clamp " << clamp << ", tensor " << tensors[t].first << ": ||p|| " << norm[t]
                                  << ", step length " << std::sqrt(moved) << ", want " << want);
    }
  }
}

BOOST_AUTO_TEST_CASE(set_hyper_refuses_a_slot_that_was_not_kept) {
  layout l;
  l.add("w", {8, 8});
  optimizer<adafactor> a(l, adafactor_relative());  // beta1 None: no exp_avg kept
  adafactor::hyper_params h;
  h.beta1 = 0.9;
  BOOST_CHECK_THROW(a.set_hyper(0, h), std::invalid_argument);
}

/// Adafactor declaring that a factored tensor keeps no state slot, while its uses_slot
/// keeps exp_avg (slot 1) with beta1: layer_range would neither read nor write it.
struct adafactor_misdeclared : adafactor {
  static constexpr unsigned factored_slots = 0u;
};

/// The same with sets, neither of which holds slot 1.
struct adafactor_missing_set : adafactor {
  static constexpr std::array<unsigned, 2> factored_slots{0u, 1u};
};

template <class Policy>
std::string construction_error(const layout& l, const typename Policy::hyper_params& h) {
  try {
    optimizer<Policy> a(l, h);
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "";
}

BOOST_AUTO_TEST_CASE(factored_slots_must_cover_the_slots_a_factored_tensor_keeps) {
  layout l;
  l.add("bias", {8});
  l.add("w", {8, 8});
  const std::string want = "adafactor: tensor 'w' is factored and keeps the state slots {1}, which no set of the "
                           "policy's factored_slots holds";
  const std::string what = construction_error<adafactor_misdeclared>(l, adafactor_lr_beta1());
  BOOST_TEST(what == want);
  const std::string set = construction_error<adafactor_missing_set>(l, adafactor_lr_beta1());
  BOOST_TEST(set == want);
  // No beta1: nothing kept, which both declarations allow.
  BOOST_CHECK_NO_THROW(optimizer<adafactor_misdeclared>(l, adafactor_relative()));
  BOOST_CHECK_NO_THROW(optimizer<adafactor_missing_set>(l, adafactor_relative()));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
