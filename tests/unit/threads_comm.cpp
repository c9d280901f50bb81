// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The `threads` communicator for d = 1..8: collectives against rank-order re-computations
// done here on the main thread, bit-identical results on every rank, split into a 2 x 4
// grid, the byte model, and the failure paths (a rank throws, mismatched calls, a rank
// that never arrives), each of which must end quickly rather than hang.
//
// The asynchronous forms: the same bits as the blocking ones, several requests in flight,
// async and blocking calls mixed, real overlap (the collective completes while the rank
// computes, shown by handshakes rather than sleeps), failures and timeouts surfacing from
// wait(), and requests left unwaited when a rank function returns.
//
// Boost.Test assertions are not thread-safe, so rank functions only record what they see
// (each rank in its own slot); the checks run on the main thread after run_ranks joins.

#include <boost/test/unit_test.hpp>

#include <distopt/comm/threads.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/fp16.hpp>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using distopt::bf16;
using distopt::comm_request;
using distopt::fp16;
using distopt::rank_failure;
using distopt::reduce_op;
using distopt::run_ranks;
using distopt::threads;
using clock_type = std::chrono::steady_clock;

static_assert(distopt::communicator<threads>, "distopt::threads must model distopt::communicator");
static_assert(distopt::async_communicator<threads>, "distopt::threads must model distopt::async_communicator");
static_assert(!std::is_copy_constructible_v<threads>);

constexpr int max_ranks = 8;
constexpr std::size_t sizes[] = {0, 1, 7, 4097};
constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max};

// The accumulator the spec names: double for double, float otherwise.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Values of mixed sign and magnitude (2^-6 .. 2^2), so that the order of a sum matters,
// small enough that fp16 sums of eight stay finite.
template <class T>
T value(int rank, std::size_t i, std::uint64_t seed) {
  const std::uint64_t h = splitmix(seed * 1000003u + static_cast<std::uint64_t>(rank) * 7919u + i);
  const double mant = static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;  // [-1, 1)
  const double v = std::ldexp(mant, static_cast<int>(h % 9) - 6);
  if constexpr (std::is_same_v<T, double>) return v;
  else return T(static_cast<float>(v));
}

template <class T>
std::vector<T> make_input(int rank, std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = value<T>(rank, i, seed);
  return v;
}

template <class T>
acc_t<T> load(T x) {
  return static_cast<acc_t<T>>(x);
}

// The spec, element by element: rank 0 op rank 1 op ... in the accumulator, rounded once.
template <class T>
T reduce_reference(const std::vector<std::vector<T>>& in, std::size_t offset, std::size_t i, reduce_op op) {
  acc_t<T> a = load(in[0][offset + i]);
  for (std::size_t q = 1; q < in.size(); ++q) {
    const acc_t<T> v = load(in[q][offset + i]);
    a = op == reduce_op::max ? (v > a ? v : a) : a + v;
  }
  if (op == reduce_op::avg) a /= static_cast<acc_t<T>>(in.size());
  return T(a);
}

// The same sum in double, for a sanity check of the float path.
template <class T>
double reduce_double(const std::vector<std::vector<T>>& in, std::size_t i, reduce_op op) {
  double a = static_cast<double>(load(in[0][i]));
  for (std::size_t q = 1; q < in.size(); ++q) {
    const double v = static_cast<double>(load(in[q][i]));
    a = op == reduce_op::max ? std::max(a, v) : a + v;
  }
  return op == reduce_op::avg ? a / static_cast<double>(in.size()) : a;
}

template <class T>
bool same_bits(std::span<const T> a, std::span<const T> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return same_bits(std::span<const T>(a), std::span<const T>(b));
}

std::string op_name(reduce_op op) {
  return op == reduce_op::sum ? "sum" : op == reduce_op::avg ? "avg" : "max";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// A one-shot signal between rank functions, so that tests order ranks by handshakes
// rather than sleeps. wait() gives up after `limit` and says so: a hang becomes a failed check.
class gate {
 public:
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }
  bool wait(std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, limit, [this] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Polls `done` (never blocking on the collective) until it holds or `limit` passes.
template <class P>
bool poll_until(P done, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto t0 = clock_type::now();
  while (!done()) {
    if (clock_type::now() - t0 > limit) return false;
    std::this_thread::yield();
  }
  return true;
}

using all_types = std::tuple<float, bf16, fp16, double>;
using gather_types = std::tuple<float, bf16, double>;

}  // namespace

BOOST_AUTO_TEST_SUITE(threads_comm)

BOOST_AUTO_TEST_CASE_TEMPLATE(all_reduce_is_rank_order_and_identical_everywhere, T, all_types) {
  for (int d = 1; d <= max_ranks; ++d) {
    // inputs[size index][rank]; results[rank][case]
    std::vector<std::vector<std::vector<T>>> inputs;
    for (std::size_t s = 0; s < std::size(sizes); ++s) {
      inputs.emplace_back();
      for (int r = 0; r < d; ++r) inputs.back().push_back(make_input<T>(r, sizes[s], 17 + s));
    }
    std::vector<std::vector<std::vector<T>>> results(static_cast<std::size_t>(d));
    run_ranks(d, [&](threads& c) {
      for (std::size_t s = 0; s < std::size(sizes); ++s)
        for (reduce_op op : ops) {
          std::vector<T> data = inputs[s][static_cast<std::size_t>(c.rank())];
          c.all_reduce(std::span<T>(data), op);
          results[static_cast<std::size_t>(c.rank())].push_back(std::move(data));
        }
    });
    std::size_t k = 0;
    for (std::size_t s = 0; s < std::size(sizes); ++s)
      for (reduce_op op : ops) {
        std::vector<T> expected(sizes[s]);
        double worst = 0;
        for (std::size_t i = 0; i < sizes[s]; ++i) {
          expected[i] = reduce_reference(inputs[s], 0, i, op);
          // Float sums of d terms stay within d ulps of the double sum of the same terms.
          const double ref = reduce_double(inputs[s], i, op);
          worst = std::max(worst, std::abs(static_cast<double>(load(expected[i])) - ref));
        }
        for (int r = 0; r < d; ++r)
          BOOST_CHECK_MESSAGE(same_bits(results[static_cast<std::size_t>(r)][k], expected),
                              "all_reduce " << op_name(op) << " d=" << d << " n=" << sizes[s] << " rank " << r
                                            << " differs from the rank-order re-computation");
        if (std::is_same_v<T, float>)
          BOOST_CHECK_MESSAGE(worst <= 1e-4,
                              "float all_reduce strays " << worst << " from double, d=" << d);
        ++k;
      }
  }
}

BOOST_AUTO_TEST_CASE(all_reduce_max_propagates_nan) {
  std::vector<std::vector<float>> out(3);
  run_ranks(3, [&](threads& c) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> v = {c.rank() == 1 ? nan : 1.0f, c.rank() == 0 ? nan : 2.0f,
                            -std::numeric_limits<float>::infinity(), static_cast<float>(c.rank())};
    c.all_reduce(std::span<float>(v), reduce_op::max);
    out[static_cast<std::size_t>(c.rank())] = v;
  });
  for (const auto& v : out) {
    BOOST_TEST(std::isnan(v[0]));
    BOOST_TEST(std::isnan(v[1]));
    BOOST_TEST(v[2] == -std::numeric_limits<float>::infinity());
    BOOST_TEST(v[3] == 2.0f);
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(all_gather_and_reduce_scatter, T, gather_types) {
  for (int d = 1; d <= max_ranks; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    for (std::size_t m : sizes) {
      std::vector<std::vector<T>> pieces, fulls;
      for (int r = 0; r < d; ++r) {
        pieces.push_back(make_input<T>(r, m, 3));
        fulls.push_back(make_input<T>(r, ud * m, 5));
      }
      struct seen {
        std::vector<T> gathered, gathered_in_place, scattered_sum, scattered_max, scattered_in_place, composed, reduced;
      };
      std::vector<seen> got(ud);
      run_ranks(d, [&](threads& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        seen& g = got[r];
        g.gathered.resize(ud * m);
        c.all_gather(std::span<const T>(pieces[r]), std::span<T>(g.gathered));
        // In place: this rank's piece already sits in its slice of the output.
        g.gathered_in_place.assign(ud * m, T{});
        std::copy(pieces[r].begin(), pieces[r].end(), g.gathered_in_place.begin() + static_cast<std::ptrdiff_t>(r * m));
        c.all_gather(std::span<const T>(g.gathered_in_place).subspan(r * m, m), std::span<T>(g.gathered_in_place));
        g.scattered_sum.resize(m);
        c.reduce_scatter(std::span<const T>(fulls[r]), std::span<T>(g.scattered_sum), reduce_op::sum);
        g.scattered_max.resize(m);
        c.reduce_scatter(std::span<const T>(fulls[r]), std::span<T>(g.scattered_max), reduce_op::max);
        // In place: the output is this rank's own slice of the input.
        std::vector<T> buf = fulls[r];
        c.reduce_scatter(std::span<const T>(buf), std::span<T>(buf).subspan(r * m, m), reduce_op::sum);
        g.scattered_in_place.assign(buf.begin() + static_cast<std::ptrdiff_t>(r * m),
                                    buf.begin() + static_cast<std::ptrdiff_t>((r + 1) * m));
        // The sharded step's path (reduce-scatter, then all-gather) gives all_reduce's bits.
        g.composed.resize(ud * m);
        c.all_gather(std::span<const T>(g.scattered_sum), std::span<T>(g.composed));
        g.reduced = fulls[r];
        c.all_reduce(std::span<T>(g.reduced), reduce_op::sum);
      });
      std::vector<T> gathered;
      for (const auto& p : pieces) gathered.insert(gathered.end(), p.begin(), p.end());
      for (std::size_t r = 0; r < ud; ++r) {
        std::vector<T> sum(m), max(m);
        for (std::size_t i = 0; i < m; ++i) {
          sum[i] = reduce_reference(fulls, r * m, i, reduce_op::sum);
          max[i] = reduce_reference(fulls, r * m, i, reduce_op::max);
        }
        const seen& g = got[r];
        BOOST_CHECK_MESSAGE(same_bits(g.gathered, gathered), "all_gather d=" << d << " m=" << m << " rank " << r);
        BOOST_CHECK_MESSAGE(same_bits(g.gathered_in_place, gathered),
                            "in-place all_gather d=" << d << " m=" << m << " rank " << r);
        BOOST_CHECK_MESSAGE(same_bits(g.scattered_sum, sum), "reduce_scatter sum d=" << d << " m=" << m << " rank " << r);
        BOOST_CHECK_MESSAGE(same_bits(g.scattered_max, max), "reduce_scatter max d=" << d << " m=" << m << " rank " << r);
        BOOST_CHECK_MESSAGE(same_bits(g.scattered_in_place, sum),
                            "in-place reduce_scatter d=" << d << " m=" << m << " rank " << r);
        BOOST_CHECK_MESSAGE(same_bits(g.composed, g.reduced),
                            "reduce_scatter + all_gather != all_reduce, d=" << d << " m=" << m << " rank " << r);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(reduce_to_every_root, T, all_types) {
  // The root gets the rank-order reduction (all_reduce's bits); the others' out, empty or
  // not, is left alone; in place on the root as well.
  constexpr std::size_t n = 777;
  for (int d = 1; d <= max_ranks; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    std::vector<std::vector<T>> ins;
    for (int r = 0; r < d; ++r) ins.push_back(make_input<T>(r, n, 23));
    struct seen {
      std::vector<std::vector<T>> out, in_place;
      std::vector<T> untouched;
    };
    std::vector<seen> got(ud);
    const T marker = T(-7.0f);
    run_ranks(d, [&](threads& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      seen& g = got[r];
      for (int root = 0; root < d; ++root)
        for (reduce_op op : ops) {
          std::vector<T> out(c.rank() == root ? n : 0);
          c.reduce(std::span<const T>(ins[r]), std::span<T>(out), op, root);
          g.out.push_back(std::move(out));
          std::vector<T> buf = ins[r];
          c.reduce(std::span<const T>(buf), std::span<T>(buf), op, root);  // in place on the root
          g.in_place.push_back(std::move(buf));
        }
      // A non-root's out of the full size is not written.
      g.untouched.assign(n, marker);
      c.reduce(std::span<const T>(ins[r]), std::span<T>(g.untouched), reduce_op::sum, 0);
    });
    std::size_t k = 0;
    for (int root = 0; root < d; ++root)
      for (reduce_op op : ops) {
        std::vector<T> expected(n);
        for (std::size_t i = 0; i < n; ++i) expected[i] = reduce_reference(ins, 0, i, op);
        const auto ur = static_cast<std::size_t>(root);
        BOOST_CHECK_MESSAGE(same_bits(got[ur].out[k], expected), "reduce " << op_name(op) << " d=" << d << " root " << root);
        BOOST_CHECK_MESSAGE(same_bits(got[ur].in_place[k], expected),
                            "in-place reduce " << op_name(op) << " d=" << d << " root " << root);
        for (std::size_t r = 0; r < ud; ++r)
          if (r != ur) {
            BOOST_CHECK_MESSAGE(got[r].out[k].empty(), "reduce wrote a non-root's out");
            BOOST_CHECK_MESSAGE(same_bits(got[r].in_place[k], ins[r]), "reduce changed a non-root's in");
          }
        ++k;
      }
    for (std::size_t r = 1; r < ud; ++r)
      BOOST_CHECK_MESSAGE(same_bits(got[r].untouched, std::vector<T>(n, marker)), "reduce wrote rank " << r << "'s out, d=" << d);
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(broadcast_from_every_root, T, gather_types) {
  constexpr std::size_t n = 1000;
  for (int d = 1; d <= max_ranks; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    std::vector<std::vector<std::vector<T>>> got(ud);  // [rank][root]
    run_ranks(d, [&](threads& c) {
      for (int root = 0; root < d; ++root) {
        std::vector<T> data = make_input<T>(c.rank(), n, 11 + static_cast<std::uint64_t>(root));
        c.broadcast(std::span<T>(data), root);
        got[static_cast<std::size_t>(c.rank())].push_back(std::move(data));
      }
    });
    for (int root = 0; root < d; ++root) {
      const std::vector<T> expected = make_input<T>(root, n, 11 + static_cast<std::uint64_t>(root));
      for (std::size_t r = 0; r < ud; ++r)
        BOOST_CHECK_MESSAGE(same_bits(got[r][static_cast<std::size_t>(root)], expected),
                            "broadcast d=" << d << " root " << root << " rank " << r);
    }
  }
}

BOOST_AUTO_TEST_CASE(split_into_a_2x4_grid) {
  // World rank w = row * 4 + col; rows are the 4-rank (TP) groups, columns the 2-rank (DP) groups.
  struct seen {
    int row_rank = -1, row_size = -1, col_rank = -1, col_size = -1;
    float row_sum = 0, col_sum = 0;
    std::vector<float> row_gather, col_gather;
    int rev_rank = -1, parity_rank = -1, parity_size = -1, sub_rank = -1, sub_size = -1;
    float after = 0;
    std::size_t world_bytes = 0, row_bytes = 0;
  };
  std::vector<seen> got(8);
  run_ranks(8, [&](threads& world) {
    const int w = world.rank(), row = w / 4, col = w % 4;
    seen& g = got[static_cast<std::size_t>(w)];
    threads rows = world.split(row, col);
    threads cols = world.split(col, row);
    g.row_rank = rows.rank();
    g.row_size = rows.size();
    g.col_rank = cols.rank();
    g.col_size = cols.size();
    // Both rows reduce at the same time, then both column groups; then the world again.
    float x = static_cast<float>(w);
    rows.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
    g.row_sum = x;
    float y = static_cast<float>(w);
    cols.all_reduce(std::span<float>(&y, 1), reduce_op::sum);
    g.col_sum = y;
    const float me = static_cast<float>(w);
    g.row_gather.resize(4);
    rows.all_gather(std::span<const float>(&me, 1), std::span<float>(g.row_gather));
    g.col_gather.resize(2);
    cols.all_gather(std::span<const float>(&me, 1), std::span<float>(g.col_gather));
    // Keys order a sub-group; equal keys fall back to the old rank order.
    g.rev_rank = world.split(0, -w).rank();
    threads parity = world.split(w % 2, 0);
    g.parity_rank = parity.rank();
    g.parity_size = parity.size();
    // A split of a sub-group.
    threads sub = rows.split(col / 2, 0);
    g.sub_rank = sub.rank();
    g.sub_size = sub.size();
    float z = 1;
    world.all_reduce(std::span<float>(&z, 1), reduce_op::sum);
    g.after = z;
    g.world_bytes = world.bytes_sent();
    g.row_bytes = rows.bytes_sent();
  });
  for (int w = 0; w < 8; ++w) {
    const seen& g = got[static_cast<std::size_t>(w)];
    const int row = w / 4, col = w % 4;
    BOOST_TEST(g.row_rank == col);
    BOOST_TEST(g.row_size == 4);
    BOOST_TEST(g.col_rank == row);
    BOOST_TEST(g.col_size == 2);
    BOOST_TEST(g.row_sum == static_cast<float>(16 * row + 6));
    BOOST_TEST(g.col_sum == static_cast<float>(2 * col + 4));
    BOOST_TEST(g.row_gather == (std::vector<float>{4.0f * row, 4.0f * row + 1, 4.0f * row + 2, 4.0f * row + 3}),
               boost::test_tools::per_element());
    BOOST_TEST(g.col_gather == (std::vector<float>{1.0f * col, 1.0f * col + 4}), boost::test_tools::per_element());
    BOOST_TEST(g.rev_rank == 7 - w);
    BOOST_TEST(g.parity_rank == w / 2);
    BOOST_TEST(g.parity_size == 4);
    BOOST_TEST(g.sub_rank == col % 2);
    BOOST_TEST(g.sub_size == 2);
    BOOST_TEST(g.after == 8.0f);
    // Each handle counts its own traffic: one 1-float all_reduce on the world of 8
    // (chunks 1,0,...: rank 0 sends (1 + 6 * 1) * 4, the others (1 + 6 * 0) * 4).
    BOOST_TEST(g.world_bytes == (w == 0 ? 28u : 4u));
    // rows: a 1-float all_reduce over 4 (chunk 1 on rank 0) and a 1-float all_gather.
    BOOST_TEST(g.row_bytes == (col == 0 ? (1u + 2u) * 4u + 3u * 4u : 1u * 4u + 3u * 4u));
  }
}

BOOST_AUTO_TEST_CASE(bytes_sent_follows_the_ring_model) {
  constexpr std::size_t n = 10, m = 5, g = 3;
  for (int d = 1; d <= max_ranks; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    std::vector<std::vector<std::size_t>> bytes(ud);
    run_ranks(d, [&](threads& c) {
      auto& b = bytes[static_cast<std::size_t>(c.rank())];
      b.push_back(c.bytes_sent());
      std::vector<float> f(n, 1.0f);
      c.all_reduce(std::span<float>(f), reduce_op::sum);
      b.push_back(c.bytes_sent());
      std::vector<float> in(ud * m, 1.0f), out(m);
      c.reduce_scatter(std::span<const float>(in), std::span<float>(out), reduce_op::avg);
      b.push_back(c.bytes_sent());
      std::vector<double> piece(g, 2.0), all(ud * g);
      c.all_gather(std::span<const double>(piece), std::span<double>(all));
      b.push_back(c.bytes_sent());
      std::vector<bf16> h(n, bf16(1.0f));
      c.broadcast(std::span<bf16>(h), c.size() - 1);
      b.push_back(c.bytes_sent());
      std::vector<float> contribution(m, 1.0f), total(c.rank() == 0 ? m : 0);
      c.reduce(std::span<const float>(contribution), std::span<float>(total), reduce_op::sum, 0);
      b.push_back(c.bytes_sent());
    });
    std::size_t all_reduce_total = 0;
    for (std::size_t r = 0; r < ud; ++r) {
      // This rank's chunk of the all_reduce: n/d, plus one for the first n%d ranks.
      const std::size_t chunk = n / ud + (r < n % ud ? 1 : 0);
      const std::size_t ar = d == 1 ? 0 : (n + (ud - 2) * chunk) * sizeof(float);
      const std::size_t rs = (ud - 1) * m * sizeof(float);
      const std::size_t ag = (ud - 1) * g * sizeof(double);
      const std::size_t bc = (r == ud - 1 && d > 1) ? n * sizeof(bf16) : 0;
      const std::size_t re = r == 0 ? 0 : m * sizeof(float);  // every rank but the root sends its part
      const std::vector<std::size_t> expected = {0, ar, ar + rs, ar + rs + ag, ar + rs + ag + bc, ar + rs + ag + bc + re};
      BOOST_TEST(bytes[r] == expected, boost::test_tools::per_element());
      all_reduce_total += ar;
    }
    // Summed over ranks, all_reduce sends exactly 2 (d-1) N bytes, like a ring.
    BOOST_TEST(all_reduce_total == 2 * (ud - 1) * n * sizeof(float));
  }
}

BOOST_AUTO_TEST_CASE(a_rank_that_throws_fails_the_others_fast) {
  for (int when : {0, 1}) {  // 0: before the others arrive; 1: while they wait
    constexpr int d = 4;
    std::vector<std::string> messages(d);
    std::vector<int> named(d, -1);
    const auto t0 = clock_type::now();
    bool caught = false;
    try {
      run_ranks(d, [&](threads& c) {
        if (c.rank() == 2) {
          if (when == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          throw std::runtime_error("boom");
        }
        try {
          for (int i = 0; i < 3; ++i) {
            float x = 1;
            c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
          }
        } catch (const rank_failure& e) {
          messages[static_cast<std::size_t>(c.rank())] = e.what();
          named[static_cast<std::size_t>(c.rank())] = e.rank();
          throw;
        }
      });
    } catch (const rank_failure& e) {
      caught = true;
      BOOST_TEST(std::string(e.what()) == "rank 2 failed: boom");
      BOOST_TEST(e.rank() == 2);
    }
    BOOST_TEST(caught);
    BOOST_TEST(seconds_since(t0) < 2.0);
    for (int r : {0, 1, 3}) {
      BOOST_TEST(named[static_cast<std::size_t>(r)] == 2);
      BOOST_TEST(contains(messages[static_cast<std::size_t>(r)], "all_reduce"));
      BOOST_TEST(contains(messages[static_cast<std::size_t>(r)], "rank 2 failed: boom"));
    }
  }
}

BOOST_AUTO_TEST_CASE(a_failure_reaches_ranks_waiting_in_a_sub_group) {
  // Rank 5 throws; its row (4, 6, 7) waits in a row collective, row 0 in a world one
  // after some large row all_reduces, which the failure may interrupt only between calls
  // (under ASan and TSan this also checks that no buffer is read after its rank left).
  const auto t0 = clock_type::now();
  std::string what;
  try {
    run_ranks(8, [&](threads& world) {
      threads rows = world.split(world.rank() / 4, world.rank() % 4);
      if (world.rank() == 5) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        throw 42;  // not a std::exception
      }
      float x = 1;
      if (world.rank() >= 4) rows.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
      for (int i = 0; i < 20 && world.rank() < 4; ++i) {
        std::vector<float> big(100000, 1.0f);
        rows.all_reduce(std::span<float>(big), reduce_op::sum);
      }
      world.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
    });
  } catch (const rank_failure& e) {
    what = e.what();
  }
  BOOST_TEST(what == "rank 5 failed: an exception not derived from std::exception");
  BOOST_TEST(seconds_since(t0) < 2.0);
}

BOOST_AUTO_TEST_CASE(mismatched_calls_throw_invalid_argument_on_every_rank) {
  constexpr int d = 4;
  std::vector<std::vector<std::string>> messages(d);
  std::vector<float> after(d);
  run_ranks(d, [&](threads& c) {
    auto& mine = messages[static_cast<std::size_t>(c.rank())];
    const auto attempt = [&](auto&& call) {
      try {
        call();
        mine.push_back("");
      } catch (const std::invalid_argument& e) {
        mine.push_back(e.what());
      }
    };
    // Rank 3 passes 5 elements, the others 4.
    attempt([&] {
      std::vector<float> v(c.rank() == 3 ? 5 : 4, 1.0f);
      c.all_reduce(std::span<float>(v), reduce_op::sum);
    });
    // Rank 0 broadcasts while the others all_reduce.
    attempt([&] {
      std::vector<float> v(4, 1.0f);
      if (c.rank() == 0) c.broadcast(std::span<float>(v), 0);
      else c.all_reduce(std::span<float>(v), reduce_op::sum);
    });
    // Every rank's all_gather output is one element short.
    attempt([&] {
      std::vector<float> in(3), out(3 * d - 1);
      c.all_gather(std::span<const float>(in), std::span<float>(out));
    });
    // Rank 1 reduces doubles, the others floats.
    attempt([&] {
      std::vector<float> f(2);
      std::vector<double> g(2);
      if (c.rank() == 1) c.all_reduce(std::span<double>(g), reduce_op::sum);
      else c.all_reduce(std::span<float>(f), reduce_op::sum);
    });
    // A root that does not exist.
    attempt([&] {
      std::vector<float> v(2);
      c.broadcast(std::span<float>(v), d);
    });
    // reduce: the ranks name different roots.
    attempt([&] {
      std::vector<float> in(3), out(3);
      c.reduce(std::span<const float>(in), std::span<float>(out), reduce_op::sum, c.rank() == 2 ? 1 : 0);
    });
    // reduce: the root's out is short (the others' out does not matter).
    attempt([&] {
      std::vector<float> in(3), out(c.rank() == 1 ? 2 : 0);
      c.reduce(std::span<const float>(in), std::span<float>(out), reduce_op::max, 1);
    });
    // The group still works after all of that.
    float x = static_cast<float>(c.rank());
    c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
    after[static_cast<std::size_t>(c.rank())] = x;
  });
  const std::vector<std::string>& m = messages[0];
  BOOST_TEST_REQUIRE(m.size() == 7u);
  for (int r = 1; r < d; ++r)
    BOOST_TEST(messages[static_cast<std::size_t>(r)] == m, boost::test_tools::per_element());
  for (const std::string& s : m) BOOST_TEST_MESSAGE(s);
  BOOST_TEST(contains(m[0], "all_reduce"));
  BOOST_TEST(contains(m[0], "rank 0: all_reduce<float>(4, sum)"));
  BOOST_TEST(contains(m[0], "rank 3: all_reduce<float>(5, sum)"));
  BOOST_TEST(contains(m[1], "different collectives"));
  BOOST_TEST(contains(m[1], "rank 0: broadcast<float>(4, root 0)"));
  BOOST_TEST(contains(m[1], "rank 1: all_reduce<float>(4, sum)"));
  BOOST_TEST(contains(m[2], "all_gather"));
  BOOST_TEST(contains(m[2], "out has 11 elements but size() * in = 4 * 3 = 12"));
  BOOST_TEST(contains(m[3], "rank 1: all_reduce<double>(2, sum)"));
  BOOST_TEST(contains(m[4], "root 4 does not exist"));
  BOOST_TEST(contains(m[5], "rank 2: reduce<float>(in 3, out 3, sum, root 1)"));
  BOOST_TEST(contains(m[6], "out has 2 elements on the root (rank 1) but in has 3"));
  for (float v : after) BOOST_TEST(v == 6.0f);
}

BOOST_AUTO_TEST_CASE(a_rank_that_never_arrives_times_out) {
  constexpr int d = 3;
  std::vector<std::string> messages(d);
  const auto t0 = clock_type::now();
  std::string what;
  try {
    run_ranks(
        d,
        [&](threads& c) {
          try {
            // Rank 2 is late far beyond the timeout; then it finds the group failed.
            if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(400));
            float x = 1;
            c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
          } catch (const rank_failure& e) {
            messages[static_cast<std::size_t>(c.rank())] = e.what();
            throw;
          }
        },
        std::chrono::milliseconds(100));
  } catch (const rank_failure& e) {
    what = e.what();
  }
  BOOST_TEST_MESSAGE(what);
  BOOST_TEST(contains(what, "threads communicator: all_reduce on rank "));
  BOOST_TEST(contains(what, "timed out after 100 ms waiting for rank(s) 2"));
  BOOST_TEST(contains(messages[2], "aborted because rank "));
  BOOST_TEST(seconds_since(t0) < 2.0);
}

BOOST_AUTO_TEST_CASE(a_rank_that_returns_early_fails_the_others_fast) {
  std::string what;
  const auto t0 = clock_type::now();
  try {
    run_ranks(3, [&](threads& c) {
      if (c.rank() == 1) return;
      float x = 1;
      c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);  // default timeout: 60 s
    });
  } catch (const rank_failure& e) {
    what = e.what();
  }
  BOOST_TEST(contains(what, "rank 1 returned without calling it"));
  BOOST_TEST(seconds_since(t0) < 2.0);
}

BOOST_AUTO_TEST_CASE(run_ranks_checks_its_arguments) {
  BOOST_CHECK_THROW(run_ranks(0, [](threads&) {}), std::invalid_argument);
  BOOST_CHECK_THROW(run_ranks(2, [](threads&) {}, std::chrono::milliseconds(0)), std::invalid_argument);
  std::vector<int> ranks(5, -1), sizes_seen(5, -1);
  run_ranks(5, [&](threads& c) {
    ranks[static_cast<std::size_t>(c.rank())] = c.rank();
    sizes_seen[static_cast<std::size_t>(c.rank())] = c.size();
  });
  BOOST_TEST(ranks == (std::vector<int>{0, 1, 2, 3, 4}), boost::test_tools::per_element());
  BOOST_TEST(sizes_seen == std::vector<int>(5, 5), boost::test_tools::per_element());
}

// ---------------------------------------------------------------------------------------
// Asynchronous forms
// ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE_TEMPLATE(async_forms_give_the_blocking_bits, T, all_types) {
  for (int d = 1; d <= max_ranks; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    struct seen {
      std::vector<std::vector<T>> blocking, async;
      std::size_t blocking_bytes = 0, async_bytes = 0;
    };
    std::vector<seen> got(ud);
    run_ranks(d, [&](threads& c) {
      const int r = c.rank();
      seen& g = got[static_cast<std::size_t>(r)];
      std::vector<std::vector<T>> fulls, pieces;  // read-only inputs, alive until every request is waited
      for (std::size_t s = 0; s < std::size(sizes); ++s) {
        fulls.push_back(make_input<T>(r, ud * sizes[s], 200 + s));
        pieces.push_back(make_input<T>(r, sizes[s], 300 + s));
      }
      // Every collective, op, size and root: blocking, or as i-forms all in flight at once.
      const auto issue = [&](std::vector<std::vector<T>>& outs, std::vector<comm_request>* requests) {
        outs.reserve(std::size(sizes) * (2 * std::size(ops) + 1 + ud));  // no reallocation in flight
        for (std::size_t s = 0; s < std::size(sizes); ++s) {
          const std::size_t m = sizes[s];
          for (reduce_op op : ops) {
            const std::span<T> data(outs.emplace_back(make_input<T>(r, m, 100 + s)));
            if (requests) requests->push_back(c.iall_reduce(data, op));
            else c.all_reduce(data, op);
          }
          for (reduce_op op : ops) {
            const std::span<T> out(outs.emplace_back(m));
            const std::span<const T> in(fulls[s]);
            if (requests) requests->push_back(c.ireduce_scatter(in, out, op));
            else c.reduce_scatter(in, out, op);
          }
          const std::span<T> gathered(outs.emplace_back(ud * m));
          if (requests) requests->push_back(c.iall_gather(std::span<const T>(pieces[s]), gathered));
          else c.all_gather(std::span<const T>(pieces[s]), gathered);
          for (int root = 0; root < d; ++root) {
            const std::span<T> data(outs.emplace_back(make_input<T>(r, m, 400 + 16 * s + static_cast<std::size_t>(root))));
            if (requests) requests->push_back(c.ibroadcast(data, root));
            else c.broadcast(data, root);
          }
        }
      };
      issue(g.blocking, nullptr);
      g.blocking_bytes = c.bytes_sent();
      std::vector<comm_request> requests;
      issue(g.async, &requests);
      for (comm_request& q : requests) q.wait();
      g.async_bytes = c.bytes_sent() - g.blocking_bytes;
    });
    for (std::size_t r = 0; r < ud; ++r) {
      const seen& g = got[r];
      BOOST_TEST_REQUIRE(g.async.size() == g.blocking.size());
      for (std::size_t k = 0; k < g.async.size(); ++k)
        BOOST_CHECK_MESSAGE(same_bits(g.async[k], g.blocking[k]),
                            "call " << k << ", d=" << d << ", rank " << r << ": the i-form differs from the blocking form");
      BOOST_TEST(g.async_bytes == g.blocking_bytes, "bytes_sent, d=" << d << ", rank " << r);
    }
  }
}

BOOST_AUTO_TEST_CASE(outstanding_requests_waited_in_reverse_order) {
  constexpr std::size_t n = 1000, m = 37;
  for (int d : {2, 3, 5, 8}) {
    const auto ud = static_cast<std::size_t>(d);
    std::vector<std::vector<float>> sums_in, fulls, pieces, bcast;
    std::vector<std::vector<double>> avgs_in;
    for (int r = 0; r < d; ++r) {
      sums_in.push_back(make_input<float>(r, n, 1));
      fulls.push_back(make_input<float>(r, ud * m, 2));
      pieces.push_back(make_input<float>(r, m, 3));
      bcast.push_back(make_input<float>(r, n, 4));
      avgs_in.push_back(make_input<double>(r, n, 5));
    }
    struct seen {
      std::vector<float> sum, scattered, gathered, broadcast;
      std::vector<double> avg;
      bool earlier_done = false;
    };
    std::vector<seen> got(ud);
    run_ranks(d, [&](threads& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      seen& g = got[r];
      g.sum = sums_in[r];
      g.scattered.resize(m);
      g.gathered.resize(ud * m);
      g.broadcast = bcast[r];
      g.avg = avgs_in[r];
      comm_request q[] = {
          c.iall_reduce(std::span<float>(g.sum), reduce_op::sum),
          c.ireduce_scatter(std::span<const float>(fulls[r]), std::span<float>(g.scattered), reduce_op::max),
          c.iall_gather(std::span<const float>(pieces[r]), std::span<float>(g.gathered)),
          c.ibroadcast(std::span<float>(g.broadcast), d - 1),
          c.iall_reduce(std::span<double>(g.avg), reduce_op::avg)};
      q[4].wait();
      // One queue per handle, run in call order: once the last is complete, all are.
      g.earlier_done = q[0].test() && q[1].test() && q[2].test() && q[3].test();
      for (int k = 3; k >= 0; --k) q[k].wait();
    });
    std::vector<float> sum(n), gathered;
    std::vector<double> avg(n);
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] = reduce_reference(sums_in, 0, i, reduce_op::sum);
      avg[i] = reduce_reference(avgs_in, 0, i, reduce_op::avg);
    }
    for (const auto& p : pieces) gathered.insert(gathered.end(), p.begin(), p.end());
    for (std::size_t r = 0; r < ud; ++r) {
      const seen& g = got[r];
      std::vector<float> scattered(m);
      for (std::size_t i = 0; i < m; ++i) scattered[i] = reduce_reference(fulls, r * m, i, reduce_op::max);
      BOOST_TEST_CONTEXT("d=" << d << ", rank " << r) {
        BOOST_TEST(g.earlier_done);
        BOOST_TEST(same_bits(g.sum, sum));
        BOOST_TEST(same_bits(g.scattered, scattered));
        BOOST_TEST(same_bits(g.gathered, gathered));
        BOOST_TEST(same_bits(g.broadcast, bcast[ud - 1]));
        BOOST_TEST(same_bits(g.avg, avg));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(blocking_and_async_calls_mix) {
  // Step k is an all_reduce, reduce_scatter, all_gather or broadcast (k % 4). Rank r makes
  // it an i-form unless (r + k) % 3 == 0, so at most steps some ranks block while others
  // do not, and a blocking call follows requests still in flight on the same handle.
  constexpr int steps = 12;
  constexpr std::size_t n = 33, m = 5;
  const auto input = [](int r, int k, std::size_t len) {
    return make_input<float>(r, len, 1000 + static_cast<std::uint64_t>(k));
  };
  for (int d : {2, 3, 4, 7}) {
    const auto ud = static_cast<std::size_t>(d);
    struct seen {
      std::vector<std::vector<float>> out;
      bool drained = true;  // every earlier request was complete when a blocking call returned
      int blocking_calls = 0;
    };
    std::vector<seen> got(ud);
    run_ranks(d, [&](threads& c) {
      const int r = c.rank();
      seen& g = got[static_cast<std::size_t>(r)];
      g.out.resize(steps);
      std::vector<std::vector<float>> ins(steps);
      std::vector<comm_request> in_flight;
      for (int k = 0; k < steps; ++k) {
        const bool async = (r + k) % 3 != 0;
        std::vector<float>& out = g.out[static_cast<std::size_t>(k)];
        std::vector<float>& in = ins[static_cast<std::size_t>(k)];
        comm_request q;
        switch (k % 4) {
        case 0:
          out = input(r, k, n);
          if (async) q = c.iall_reduce(std::span<float>(out), reduce_op::sum);
          else c.all_reduce(std::span<float>(out), reduce_op::sum);
          break;
        case 1:
          in = input(r, k, ud * m);
          out.resize(m);
          if (async) q = c.ireduce_scatter(std::span<const float>(in), std::span<float>(out), reduce_op::avg);
          else c.reduce_scatter(std::span<const float>(in), std::span<float>(out), reduce_op::avg);
          break;
        case 2:
          in = input(r, k, m);
          out.resize(ud * m);
          if (async) q = c.iall_gather(std::span<const float>(in), std::span<float>(out));
          else c.all_gather(std::span<const float>(in), std::span<float>(out));
          break;
        default:
          out = input(r, k, n);
          if (async) q = c.ibroadcast(std::span<float>(out), k % d);
          else c.broadcast(std::span<float>(out), k % d);
          break;
        }
        if (async) {
          in_flight.push_back(std::move(q));
        } else {
          ++g.blocking_calls;
          for (comm_request& p : in_flight) g.drained = g.drained && p.test();
        }
      }
      for (comm_request& p : in_flight) p.wait();
    });
    for (std::size_t r = 0; r < ud; ++r) {
      const seen& g = got[r];
      BOOST_TEST_CONTEXT("d=" << d << ", rank " << r) {
        BOOST_TEST(g.drained);
        BOOST_TEST(g.blocking_calls == 4);
        for (int k = 0; k < steps; ++k) {
          std::vector<std::vector<float>> all;
          std::vector<float> expected;
          switch (k % 4) {
          case 0:
            for (int q = 0; q < d; ++q) all.push_back(input(q, k, n));
            for (std::size_t i = 0; i < n; ++i) expected.push_back(reduce_reference(all, 0, i, reduce_op::sum));
            break;
          case 1:
            for (int q = 0; q < d; ++q) all.push_back(input(q, k, ud * m));
            for (std::size_t i = 0; i < m; ++i) expected.push_back(reduce_reference(all, r * m, i, reduce_op::avg));
            break;
          case 2:
            for (int q = 0; q < d; ++q) {
              const std::vector<float> p = input(q, k, m);
              expected.insert(expected.end(), p.begin(), p.end());
            }
            break;
          default: expected = input(k % d, k, n); break;
          }
          BOOST_TEST(same_bits(g.out[static_cast<std::size_t>(k)], expected), "step " << k);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(async_collectives_overlap_with_the_callers_work) {
  // Rank 1 enters each collective only after rank 0 has started its i-form and seen it
  // incomplete. Rank 0 then computes, polling test() but never calling wait(), until the
  // collective completes on its own. An i-form that blocked would never reach the
  // handshake, and one whose work ran inside wait() would never test complete.
  constexpr std::size_t n = 4097;
  constexpr int kinds = 4;  // all_reduce, reduce_scatter, all_gather, broadcast from rank 1
  struct seen {
    bool let_in[kinds] = {}, incomplete_before[kinds] = {}, completed_unwaited[kinds] = {};
    std::uint64_t polls = 0, work = 0;
    std::vector<float> out[kinds];
  };
  std::vector<seen> got(2);
  gate go[kinds];
  const std::vector<std::vector<float>> fulls = {make_input<float>(0, 2 * n, 7), make_input<float>(1, 2 * n, 7)};
  run_ranks(
      2,
      [&](threads& c) {
        const int r = c.rank();
        seen& g = got[static_cast<std::size_t>(r)];
        const std::span<const float> full(fulls[static_cast<std::size_t>(r)]);
        const std::span<const float> piece = full.first(n);
        for (int k = 0; k < kinds; ++k) {
          std::vector<float>& out = g.out[k];
          if (k == 0 || k == 3) out = make_input<float>(r, n, 10 + static_cast<std::uint64_t>(k));
          else out.resize(k == 1 ? n : 2 * n);
          const std::span<float> o(out);
          if (r == 1) {
            g.let_in[k] = go[k].wait();
            if (k == 0) c.all_reduce(o, reduce_op::sum);
            else if (k == 1) c.reduce_scatter(full, o, reduce_op::sum);
            else if (k == 2) c.all_gather(piece, o);
            else c.broadcast(o, 1);
            continue;
          }
          comm_request q = k == 0   ? c.iall_reduce(o, reduce_op::sum)
                           : k == 1 ? c.ireduce_scatter(full, o, reduce_op::sum)
                           : k == 2 ? c.iall_gather(piece, o)
                                    : c.ibroadcast(o, 1);
          g.incomplete_before[k] = !q.test();  // rank 1 has not entered yet
          go[k].open();
          std::uint64_t h = g.work;
          g.completed_unwaited[k] = poll_until([&] {
            for (int i = 0; i < 256; ++i) h = splitmix(h);  // the work that overlaps
            ++g.polls;
            (void)c.bytes_sent();  // safe to read while a collective is in flight
            return q.test();
          });
          g.work = h;
          q.wait();
        }
      },
      std::chrono::seconds(20));
  for (int k = 0; k < kinds; ++k) {
    BOOST_TEST_CONTEXT("collective " << k) {
      BOOST_TEST(got[1].let_in[k]);
      BOOST_TEST(got[0].incomplete_before[k]);
      BOOST_TEST(got[0].completed_unwaited[k]);
    }
  }
  BOOST_TEST_MESSAGE("rank 0 polled " << got[0].polls << " times while its collectives ran");
  std::vector<std::vector<float>> ar = {make_input<float>(0, n, 10), make_input<float>(1, n, 10)};
  for (std::size_t r = 0; r < 2; ++r) {
    std::vector<float> sum(n), scattered(n);
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] = reduce_reference(ar, 0, i, reduce_op::sum);
      scattered[i] = reduce_reference(fulls, r * n, i, reduce_op::sum);
    }
    std::vector<float> gathered(fulls[0].begin(), fulls[0].begin() + n);
    gathered.insert(gathered.end(), fulls[1].begin(), fulls[1].begin() + n);
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(same_bits(got[r].out[0], sum));
      BOOST_TEST(same_bits(got[r].out[1], scattered));
      BOOST_TEST(same_bits(got[r].out[2], gathered));
      BOOST_TEST(same_bits(got[r].out[3], make_input<float>(1, n, 13)));
    }
  }
}

BOOST_AUTO_TEST_CASE(a_failing_rank_makes_wait_throw) {
  for (int how : {0, 1}) {  // rank 2, once rank 0's iall_reduce is in flight: 0 throws, 1 returns
    constexpr int d = 4;
    gate started;
    std::string waited_what, what;
    int waited_rank = -1, named = -1;
    bool started_in_time = false;
    const auto t0 = clock_type::now();
    try {
      run_ranks(d, [&](threads& c) {
        float x = 1;
        if (c.rank() == 2) {
          started_in_time = started.wait();
          if (how == 0) throw std::runtime_error("boom");
          return;
        }
        if (c.rank() != 0) {
          c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
          return;
        }
        comm_request q = c.iall_reduce(std::span<float>(&x, 1), reduce_op::sum);
        started.open();
        try {
          q.wait();
        } catch (const rank_failure& e) {
          waited_what = e.what();
          waited_rank = e.rank();
          throw;
        }
      });
    } catch (const rank_failure& e) {
      what = e.what();
      named = e.rank();
    }
    BOOST_TEST_CONTEXT((how == 0 ? "rank 2 throws" : "rank 2 returns")) {
      BOOST_TEST_MESSAGE(waited_what);
      BOOST_TEST(started_in_time);
      BOOST_TEST(seconds_since(t0) < 2.0);
      BOOST_TEST(contains(waited_what, "all_reduce"));
      if (how == 0) {
        BOOST_TEST(waited_rank == 2);
        BOOST_TEST(contains(waited_what, "rank 2 failed: boom"));
        BOOST_TEST(what == "rank 2 failed: boom");
        BOOST_TEST(named == 2);
      } else {
        BOOST_TEST(contains(waited_what, "rank 2 returned without calling it"));
        BOOST_TEST(contains(what, "rank 2 returned without calling it"));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(an_async_collective_times_out) {
  // Rank 1 enters only after rank 0's wait() has given up, far beyond the 100 ms timeout.
  gate waited;
  std::string waited_what, late_what, what;
  const auto t0 = clock_type::now();
  try {
    run_ranks(
        2,
        [&](threads& c) {
          float x = 1;
          if (c.rank() == 1) {
            waited.wait();
            try {
              c.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
            } catch (const rank_failure& e) {
              late_what = e.what();
              throw;
            }
            return;
          }
          comm_request q = c.iall_reduce(std::span<float>(&x, 1), reduce_op::sum);
          try {
            q.wait();
          } catch (const rank_failure& e) {
            waited_what = e.what();
            waited.open();
            throw;
          }
          waited.open();
        },
        std::chrono::milliseconds(100));
  } catch (const rank_failure& e) {
    what = e.what();
  }
  BOOST_TEST_MESSAGE(waited_what);
  BOOST_TEST(contains(waited_what, "threads communicator: all_reduce on rank 0 timed out after 100 ms waiting for rank(s) 1"));
  BOOST_TEST(contains(late_what, "aborted because rank 0 failed"));
  BOOST_TEST(contains(what, "timed out after 100 ms"));
  BOOST_TEST(seconds_since(t0) < 2.0);
}

BOOST_AUTO_TEST_CASE(async_mismatches_throw_from_wait_on_every_rank) {
  constexpr int d = 4;
  std::vector<std::vector<std::string>> messages(d);
  std::vector<float> after(d);
  run_ranks(d, [&](threads& c) {
    auto& mine = messages[static_cast<std::size_t>(c.rank())];
    const auto attempt = [&](auto&& call) {
      try {
        call();
        mine.push_back("");
      } catch (const std::invalid_argument& e) {
        mine.push_back(e.what());
      }
    };
    // Every rank's all_gather output is one element short.
    std::vector<float> in(3), out(3 * d - 1);
    attempt([&] { c.iall_gather(std::span<const float>(in), std::span<float>(out)).wait(); });
    // Rank 3 passes 5 elements, the others 4; ranks 0 and 1 use the i-form, 2 and 3 block.
    std::vector<float> v(c.rank() == 3 ? 5 : 4, 1.0f);
    attempt([&] {
      if (c.rank() < 2) c.iall_reduce(std::span<float>(v), reduce_op::sum).wait();
      else c.all_reduce(std::span<float>(v), reduce_op::sum);
    });
    // A root that does not exist.
    std::vector<double> w(2);
    attempt([&] { c.ibroadcast(std::span<double>(w), d).wait(); });
    // The group still works after all of that.
    float x = static_cast<float>(c.rank());
    comm_request q = c.iall_reduce(std::span<float>(&x, 1), reduce_op::sum);
    q.wait();
    after[static_cast<std::size_t>(c.rank())] = x;
  });
  const std::vector<std::string>& m = messages[0];
  BOOST_TEST_REQUIRE(m.size() == 3u);
  for (int r = 1; r < d; ++r)
    BOOST_TEST(messages[static_cast<std::size_t>(r)] == m, boost::test_tools::per_element());
  BOOST_TEST(contains(m[0], "out has 11 elements but size() * in = 4 * 3 = 12"));
  BOOST_TEST(contains(m[1], "rank 0: all_reduce<float>(4, sum)"));
  BOOST_TEST(contains(m[1], "rank 3: all_reduce<float>(5, sum)"));
  BOOST_TEST(contains(m[2], "root 4 does not exist"));
  for (float v : after) BOOST_TEST(v == 6.0f);
}

BOOST_AUTO_TEST_CASE(requests_left_unwaited_when_a_rank_returns) {
  // Rank 0 keeps a series of requests outside its function and returns at once; the
  // others enter only after that. Its queued collectives still act for it, so nobody may
  // take rank 0 for gone (a rank that reaches collective k + 1 before rank 0's worker does
  // would otherwise fail with "rank 0 returned without calling it"), and run_ranks
  // returns with all of them complete.
  constexpr int d = 3, calls = 16;
  constexpr std::size_t n = 100;
  const auto op = [](int k) { return ops[static_cast<std::size_t>(k) % std::size(ops)]; };
  std::vector<std::vector<std::vector<float>>> in(calls), data(calls, std::vector<std::vector<float>>(d));
  for (int k = 0; k < calls; ++k)
    for (int r = 0; r < d; ++r) in[static_cast<std::size_t>(k)].push_back(make_input<float>(r, n, 50 + static_cast<std::uint64_t>(k)));
  std::vector<comm_request> kept;
  gate returned;
  std::vector<char> returned_in_time(d, 0);
  std::string failure;
  try {
    run_ranks(d, [&](threads& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      for (int k = 0; k < calls; ++k) data[static_cast<std::size_t>(k)][r] = in[static_cast<std::size_t>(k)][r];
      if (r == 0) {
        for (int k = 0; k < calls; ++k)
          kept.push_back(c.iall_reduce(std::span<float>(data[static_cast<std::size_t>(k)][0]), op(k)));
        returned.open();
        return;
      }
      returned_in_time[r] = returned.wait();
      // Not needed for correctness: gives rank 0's function time to be well gone.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (int k = 0; k < calls; ++k) c.all_reduce(std::span<float>(data[static_cast<std::size_t>(k)][r]), op(k));
    });
  } catch (const rank_failure& e) {
    failure = e.what();
  }
  BOOST_TEST(failure.empty(), failure);
  BOOST_TEST(returned_in_time[1]);
  BOOST_TEST(returned_in_time[2]);
  BOOST_TEST_REQUIRE(kept.size() == static_cast<std::size_t>(calls));
  for (int k = calls - 1; k >= 0; --k) {
    comm_request& q = kept[static_cast<std::size_t>(k)];
    BOOST_TEST(q.test(), "request " << k << " still pending after run_ranks");
    try {
      q.wait();
    } catch (const std::exception& e) {
      BOOST_TEST(false, "request " << k << ": " << e.what());
    }
  }
  for (int k = 0; k < calls; ++k) {
    std::vector<float> expected(n);
    for (std::size_t i = 0; i < n; ++i) expected[i] = reduce_reference(in[static_cast<std::size_t>(k)], 0, i, op(k));
    for (std::size_t r = 0; r < d; ++r)
      BOOST_TEST(same_bits(data[static_cast<std::size_t>(k)][r], expected), "call " << k << ", rank " << r);
  }
}

BOOST_AUTO_TEST_CASE(requests_left_unwaited_when_a_peer_never_comes) {
  for (int how : {0, 1}) {  // rank 0 keeps a request and then 0 returns, 1 throws; rank 1 never calls
    comm_request kept;
    std::vector<float> data(10, 1.0f);
    std::string what;
    const auto t0 = clock_type::now();
    try {
      run_ranks(2, [&](threads& c) {
        if (c.rank() == 1) return;
        kept = c.iall_reduce(std::span<float>(data), reduce_op::sum);
        if (how == 1) throw std::runtime_error("boom");
      });
    } catch (const rank_failure& e) {
      what = e.what();
    }
    BOOST_TEST_CONTEXT((how == 0 ? "rank 0 returns" : "rank 0 throws")) {
      BOOST_TEST_MESSAGE(what);
      BOOST_TEST(!what.empty());
      BOOST_TEST(kept.test());
      bool threw = false;
      try {
        kept.wait();
      } catch (const rank_failure&) {
        threw = true;
      }
      BOOST_TEST(threw);
      BOOST_TEST(seconds_since(t0) < 2.0);
    }
  }
}

BOOST_AUTO_TEST_CASE(handles_go_or_move_with_collectives_in_flight) {
  constexpr int d = 4;
  struct seen {
    float dropped = 0, after_handle = 0, after_assign = 0, after_move = 0, moved = 0;
    bool done_when_handle_gone = false, done_before_blocking_returned = false;
  };
  std::vector<seen> got(d);
  run_ranks(d, [&](threads& c) {
    seen& g = got[static_cast<std::size_t>(c.rank())];
    // A request never waited: its destructor waits.
    float x = 1;
    { comm_request q = c.iall_reduce(std::span<float>(&x, 1), reduce_op::sum); }
    g.dropped = x;
    // A handle destroyed with its collective in flight waits for it; the request outlives it.
    float y = 1;
    comm_request q1;
    {
      threads sub = c.split(0, c.rank());
      q1 = sub.iall_reduce(std::span<float>(&y, 1), reduce_op::sum);
    }
    g.done_when_handle_gone = q1.test();
    q1.wait();
    g.after_handle = y;
    // Move-assigning over a handle with work in flight: the old rank state finishes first.
    float z = 1;
    threads sub = c.split(0, c.rank());
    comm_request q2 = sub.iall_reduce(std::span<float>(&z, 1), reduce_op::sum);
    sub = c.split(c.rank() % 2, c.rank());
    q2.wait();
    g.after_assign = z;
    // A moved handle keeps its queue: the blocking call runs after the queued one.
    float w = 1, v = 1;
    comm_request q3 = sub.iall_reduce(std::span<float>(&w, 1), reduce_op::sum);
    threads moved = std::move(sub);
    moved.all_reduce(std::span<float>(&v, 1), reduce_op::sum);
    g.done_before_blocking_returned = q3.test();
    q3.wait();
    g.after_move = w;
    g.moved = v;
  });
  for (const seen& g : got) {
    BOOST_TEST(g.dropped == 4.0f);
    BOOST_TEST(g.done_when_handle_gone);
    BOOST_TEST(g.after_handle == 4.0f);
    BOOST_TEST(g.after_assign == 4.0f);
    BOOST_TEST(g.done_before_blocking_returned);
    BOOST_TEST(g.after_move == 2.0f);
    BOOST_TEST(g.moved == 2.0f);
  }
}

BOOST_AUTO_TEST_SUITE_END()
