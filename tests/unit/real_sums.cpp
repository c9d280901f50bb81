// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Real sums over `threads` (real_sums.hpp): d = 2, 3, 4 ranks each write a different
// non-zero gradient whose fp32 sum depends on the order, and sharded AdamW (ZeRO-1 and
// ZeRO-2; fp32 grads, bf16 grads reduced as bf16 and in fp32; avg and sum) steps on them.
// Every param and state, after every step, must equal a one-rank optimizer's fed the
// ranks' grads summed in rank order ((g0 + g1) + g2 ...) in float, divided by d in float
// for avg and rounded once to the grad type: what threads.hpp states. The same sums in
// reversed rank order must give other bits (d >= 3; with two ranks a + b = b + a), so the
// test tells the orders apart. With executor threads 1 and 2.
//
// Boost.Test assertions are not thread-safe: the ranks record, the main thread checks.

#include "real_sums.hpp"

#include <boost/test/unit_test.hpp>

#include <distopt/comm/threads.hpp>

#include <numeric>
#include <string>
#include <vector>

namespace {

using namespace real_sums;

/// d ranks as threads with storage S and grads G; the states merged from their holders,
/// the params rank 0's (every rank's must be the same: checked here).
template <class S, class G>
trace run_threads(int d, int exec_threads, reduce_op op, bool in_fp32) {
  using opt_t = optimizer<adamw, S, threads, cpu, precision<float, G>>;
  const layout l = sums_layout();
  std::vector<trace> ranks(static_cast<std::size_t>(d), trace(l.numel()));
  run_ranks(d, [&](threads& comm) {
    const int r = comm.rank();
    opt_t opt(l, hypers(), options_of(op, in_fp32), cpu(exec_threads), std::move(comm));
    run_rank(opt, r, ranks[static_cast<std::size_t>(r)]);
  });
  trace all = ranks[0];
  for (int r = 1; r < d; ++r) {
    const trace& t = ranks[static_cast<std::size_t>(r)];
    BOOST_TEST(same_bits(t.params, all.params), "rank " << r << "'s params differ from rank 0's");
    for (std::size_t e = 0; e < all.n; ++e) {
      if (!t.held[e]) continue;
      BOOST_TEST(!all.held[e], "element " << e << " held by two ranks");
      all.held[e] = 1;
      for (int s = 0; s < steps; ++s) {
        const std::size_t k = static_cast<std::size_t>(s) * all.n + e;
        all.m[k] = t.m[k];
        all.v[k] = t.v[k];
      }
    }
  }
  return all;
}

/// Elements of `a` that differ from `b` at some step, and the first of them.
struct difference {
  std::size_t count = 0, first = 0;
};
inline difference differ(const trace& a, const trace& b) {
  difference d;
  for (std::size_t e = 0; e < a.n; ++e)
    if (!same_element(a, b, e)) {
      if (d.count++ == 0) d.first = e;
    }
  return d;
}

template <class S, class G, class R = G>
void check(const char* what, reduce_op op, bool in_fp32 = false) {
  for (const int d : {2, 3, 4}) {
    std::vector<int> order(static_cast<std::size_t>(d));
    std::iota(order.begin(), order.end(), 0);
    const trace ref = reference<G, R>(order, op);
    std::vector<int> reversed(order.rbegin(), order.rend());
    const trace rev = reference<G, R>(reversed, op);
    for (const int t : {1, 2}) {
      BOOST_TEST_CONTEXT(what << ", d = " << d << ", executor threads " << t) {
        const trace got = run_threads<S, G>(d, t, op, in_fp32);
        for (std::size_t e = 0; e < got.n; ++e) BOOST_TEST_REQUIRE(got.held[e], "element " << e << " held by no rank");
        const difference off = differ(got, ref);
        BOOST_TEST(off.count == 0u, off.count << " of " << got.n << " elements differ from the rank-order sum's run"
                                              << " (the first: element " << off.first << ")");
        // The reversed order must be told apart, or the check above proves no order.
        if (d >= 3) {
          const difference apart = differ(rev, ref);
          BOOST_TEST(apart.count > got.n / 20, "only " << apart.count << " of " << got.n
                                                       << " elements tell rank order from reversed order");
          if (t == 1) BOOST_TEST_MESSAGE(what << ", d = " << d << ": rank order and reversed order differ on "
                                              << apart.count << " of " << got.n << " elements");
        }
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(real_sums_threads)

BOOST_AUTO_TEST_CASE(zero1_fp32_grads_avg) { check<sharded<fp32>, float>("ZeRO-1 fp32 grads avg", reduce_op::avg); }

BOOST_AUTO_TEST_CASE(zero2_fp32_grads_sum) { check<sharded<fp32, 2>, float>("ZeRO-2 fp32 grads sum", reduce_op::sum); }

BOOST_AUTO_TEST_CASE(zero1_bf16_grads_avg_rounded_once) {
  // bf16 grads reduced as bf16: summed in float in rank order, divided, rounded once.
  check<sharded<fp32>, bf16>("ZeRO-1 bf16 grads avg", reduce_op::avg);
}

BOOST_AUTO_TEST_CASE(zero2_bf16_grads_reduced_in_fp32) {
  // grad_reduce_in_fp32: widened, summed in float in rank order, divided, kept in float.
  check<sharded<fp32, 2>, bf16, float>("ZeRO-2 bf16 grads avg in fp32", reduce_op::avg, true);
}

BOOST_AUTO_TEST_SUITE_END()
