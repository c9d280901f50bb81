// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Real sums over `mpi` (run under mpiexec -n 3; tests/unit/real_sums.hpp): each process
// writes a different non-zero gradient whose fp32 sum depends on the order, and sharded
// AdamW (ZeRO-1 and ZeRO-2; fp32 grads, bf16 grads reduced as bf16 and in fp32; avg and
// sum) steps on them. mpi.hpp does not promise rank order: float sums use MPI_SUM in the
// order Open MPI's algorithm picks, the same on every rank and from run to run. So each
// element's run, every param and state after every step, must equal a one-rank
// optimizer's fed the three ranks' grads added in float in one of the three ways three
// values can be added ((g0 + g1) + g2, (g0 + g2) + g1, (g1 + g2) + g0; a + b = b + a
// exactly), divided by 3 in float for avg, rounded once to the grad type; the same way at
// every step, and the same bits in a second run. Each two of the three sums must differ on
// more than 5% of the elements a rank holds, so that a match tells the orders apart.
// How many elements took each way is logged (--log_level=message).

#include "../unit/real_sums.hpp"

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mpi.hpp>

#include <array>
#include <vector>

namespace {

using namespace real_sums;

struct mpi_environment {
  mpi_session session;
};

template <class S, class G>
trace run_mpi(reduce_op op, bool in_fp32) {
  using opt_t = optimizer<adamw, S, mpi, cpu, precision<float, G>>;
  const layout l = sums_layout();
  mpi comm(MPI_COMM_WORLD);
  const int r = comm.rank();
  opt_t opt(l, hypers(), options_of(op, in_fp32), cpu(1), std::move(comm));
  trace out(l.numel());
  run_rank(opt, r, out);
  return out;
}

template <class S, class G, class R = G>
void check(const char* what, reduce_op op, bool in_fp32 = false) {
  int d = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &d);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  BOOST_TEST_REQUIRE(d == 3, "this test enumerates the sums of three ranks; run it with -np 3");
  const std::array<std::array<int, 3>, 3> orders{{{0, 1, 2}, {0, 2, 1}, {1, 2, 0}}};
  std::vector<trace> refs;
  for (const auto& o : orders) refs.push_back(reference<G, R>(o, op));
  const trace got = run_mpi<S, G>(op, in_fp32);
  const trace again = run_mpi<S, G>(op, in_fp32);
  BOOST_TEST_CONTEXT(what << ", rank " << rank) {
    BOOST_TEST(same_bits(got.params, again.params), "a second run gives other params");
    BOOST_TEST((same_bits(got.m, again.m) && same_bits(got.v, again.v)), "a second run gives other states");
    std::size_t held = 0, matched[3] = {0, 0, 0}, none = 0, first_none = 0;
    std::size_t apart[3] = {0, 0, 0};  // held elements where sums (0, 1), (0, 2), (1, 2) differ
    for (std::size_t e = 0; e < got.n; ++e) {
      held += got.held[e] != 0;
      // Params are compared everywhere, states where this rank holds them.
      int which = -1;
      for (int c = 0; c < 3 && which < 0; ++c)
        if (same_element(got, refs[static_cast<std::size_t>(c)], e)) which = c;
      if (which < 0) {
        if (none++ == 0) first_none = e;
      } else {
        ++matched[which];
      }
      // Where each two sums differ, on the elements held here (the references hold every state).
      if (got.held[e]) {
        apart[0] += !same_element(refs[0], refs[1], e);
        apart[1] += !same_element(refs[0], refs[2], e);
        apart[2] += !same_element(refs[1], refs[2], e);
      }
    }
    BOOST_TEST(held > 0u, "this rank holds no states");
    BOOST_TEST(none == 0u, none << " of " << got.n << " elements match none of the three sums (the first: element "
                                << first_none << ")");
    // Each two of the sums must be told apart on many elements, or a match proves no order.
    for (int p = 0; p < 3; ++p)
      BOOST_TEST(apart[p] > held / 20, "only " << apart[p] << " of the " << held << " elements held here tell sums "
                                               << (p == 2 ? 1 : 0) << " and " << (p == 0 ? 1 : 2) << " apart");
    BOOST_TEST_MESSAGE(what << ", rank " << rank << ": elements matching (g0+g1)+g2 (rank order) " << matched[0]
                            << ", (g0+g2)+g1 " << matched[1] << ", (g1+g2)+g0 " << matched[2] << ", of " << got.n
                            << "; of the " << held << " held here, sums 0 and 1 differ on " << apart[0] << ", 0 and 2 on "
                            << apart[1] << ", 1 and 2 on " << apart[2]);
  }
}

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_real_sums)

BOOST_AUTO_TEST_CASE(zero1_fp32_grads_avg) { check<sharded<fp32>, float>("ZeRO-1 fp32 grads avg", reduce_op::avg); }

BOOST_AUTO_TEST_CASE(zero2_fp32_grads_sum) { check<sharded<fp32, 2>, float>("ZeRO-2 fp32 grads sum", reduce_op::sum); }

BOOST_AUTO_TEST_CASE(zero1_bf16_grads_avg_rounded_once) {
  check<sharded<fp32>, bf16>("ZeRO-1 bf16 grads avg", reduce_op::avg);
}

BOOST_AUTO_TEST_CASE(zero2_bf16_grads_reduced_in_fp32) {
  check<sharded<fp32, 2>, bf16, float>("ZeRO-2 bf16 grads avg in fp32", reduce_op::avg, true);
}

BOOST_AUTO_TEST_SUITE_END()
