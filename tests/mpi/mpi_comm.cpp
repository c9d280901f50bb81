// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The `mpi` communicator under mpiexec (ctest runs it with 2, 3 and 4 processes): every
// collective x element type x op against values each rank computes itself from every
// rank's inputs (the inputs are a function of rank and index), in-place and async forms,
// split into a DP x TP grid and into the groups of a mixture-of-experts mesh, the byte
// model of threads.hpp, and the errors.
//
// Two input families. "exact": multiples of 1/4 in [-4, 4], whose sums and averages
// are exact in every type and order, so every result is known bit for bit. "rounding":
// bf16/fp16 numbers with full mantissas spread over a few binades, whose float sums are
// still exact in any order but whose rounding back to bf16/fp16 is not trivial: the
// result must be the exact sum rounded once (a pairwise-rounding reduction fails).
//
// Every rank runs the same checks on its own results; a failure on one rank does not
// change the sequence of collectives, so the others do not hang.

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mesh.hpp>
#include <distopt/comm/mpi.hpp>
#include <distopt/types/bf16.hpp>
#include <distopt/types/fp16.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mesh_groups.hpp"

namespace {

using distopt::bf16;
using distopt::fp16;
using distopt::mpi;
using distopt::reduce_op;

static_assert(distopt::communicator<mpi>, "distopt::mpi must model distopt::communicator");
static_assert(distopt::async_communicator<mpi>, "distopt::mpi must model distopt::async_communicator");
static_assert(!std::is_copy_constructible_v<mpi> && !std::is_copy_assignable_v<mpi>);
static_assert(std::is_nothrow_move_constructible_v<mpi> && std::is_nothrow_move_assignable_v<mpi>);

// Boost.Test's main (tests/support/main.cpp) runs the test cases after this fixture is
// set up, so MPI is initialised before the first and finalised after the last.
struct mpi_environment {
  distopt::mpi_session session;
};

constexpr reduce_op ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max};

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t hash(int rank, std::size_t i, std::uint64_t seed) {
  return splitmix(seed * 1000003u + static_cast<std::uint64_t>(rank) * 7919u + i);
}

// `v` in T; v is representable in T wherever this is used.
template <class T>
T make(double v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else if constexpr (std::is_same_v<T, float>) return static_cast<float>(v);
  else return T(static_cast<float>(v));
}

template <class T>
double load(T x) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) return static_cast<double>(x);
  else return static_cast<double>(static_cast<float>(x));
}

// Multiples of 1/4 in [-4, 4]: sums of four and their averages are exact in every type.
double exact_value(int rank, std::size_t i, std::uint64_t seed) {
  return (static_cast<double>(hash(rank, i, seed) % 33) - 16.0) / 4.0;
}

// Full-mantissa bf16 (8 bits) or fp16 (11 bits) numbers over 11 binades: a float sum of
// four is exact (at most 20 resp. 23 significant bits) but rarely a bf16/fp16 number.
template <class T>
double rounding_value(int rank, std::size_t i, std::uint64_t seed) {
  const std::uint64_t h = hash(rank, i, seed);
  const int bits = std::is_same_v<T, fp16> ? 11 : 8;
  const double mant = static_cast<double>((1u << (bits - 1)) + (h >> 8) % (1u << (bits - 1)));
  const int e = static_cast<int>(h % 11) + (std::is_same_v<T, fp16> ? -14 : -10);
  return ((h >> 40) & 1 ? -1.0 : 1.0) * std::ldexp(mant, e);
}

template <class T>
std::vector<T> exact_input(int rank, std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(exact_value(rank, i, seed));
  return v;
}

template <class T>
std::vector<T> rounding_input(int rank, std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(rounding_value<T>(rank, i, seed));
  return v;
}

// The result the spec defines from the d ranks' values of one element: the exact sum
// (every sum here is exact in the accumulator), divided by d in the accumulator (float,
// or double for double) for avg, rounded once to T; or the largest value for max.
template <class T>
T expected(const std::vector<double>& values, reduce_op op) {
  double s = op == reduce_op::max ? -std::numeric_limits<double>::infinity() : 0.0;
  for (double v : values) s = op == reduce_op::max ? std::max(s, v) : s + v;
  const auto d = static_cast<double>(values.size());
  if constexpr (std::is_same_v<T, double>) {
    return op == reduce_op::avg ? s / d : s;
  } else {
    float a = static_cast<float>(s);
    if (op == reduce_op::avg) a /= static_cast<float>(d);
    if constexpr (std::is_same_v<T, float>) return a;
    else return T(a);
  }
}

// Element-wise expectation for inputs made by `input(rank, n)`, over elements [b, b + n).
template <class T, class Input>
std::vector<T> expected_reduction(int d, std::size_t b, std::size_t n, reduce_op op, Input input) {
  std::vector<std::vector<T>> in;
  for (int q = 0; q < d; ++q) in.push_back(input(q, b + n));
  std::vector<T> out(n);
  std::vector<double> values(static_cast<std::size_t>(d));
  for (std::size_t i = 0; i < n; ++i) {
    for (int q = 0; q < d; ++q) values[static_cast<std::size_t>(q)] = load(in[static_cast<std::size_t>(q)][b + i]);
    out[i] = expected<T>(values, op);
  }
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Every digit of `v` (%a would be exact too, but is harder to read).
std::string exact_text(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

// The first index where the two differ, for failure messages.
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return "[" + std::to_string(i) + "] = " + exact_text(load(got[i])) + ", expected " + exact_text(load(want[i]));
  return "none";
}

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else return "fp16";
}

const char* op_name(reduce_op op) { return op == reduce_op::sum ? "sum" : op == reduce_op::avg ? "avg" : "max"; }

// What `f` throws as std::invalid_argument, or "" when it does not.
template <class F>
std::string invalid_argument_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

using all_types = std::tuple<float, double, bf16, fp16>;

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(mpi_environment);

BOOST_AUTO_TEST_SUITE(mpi_comm)

BOOST_AUTO_TEST_CASE(wraps_an_existing_communicator) {
  int wr = -1, ws = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &ws);
  mpi world(MPI_COMM_WORLD);
  BOOST_TEST(world.rank() == wr);
  BOOST_TEST(world.size() == ws);
  BOOST_TEST(world.bytes_sent() == 0u);
  BOOST_TEST((world.native() == MPI_COMM_WORLD));
  // Errors come back as codes, which distopt throws.
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &handler);
  BOOST_TEST((handler == MPI_ERRORS_RETURN));
  MPI_Errhandler_free(&handler);
  // A move hands the communicator over; a wrapped one is never freed.
  mpi moved = std::move(world);
  BOOST_TEST((world.native() == MPI_COMM_NULL));
  BOOST_TEST((moved.native() == MPI_COMM_WORLD));
  float x = 1;
  moved.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
  BOOST_TEST(x == static_cast<float>(ws));
  world = std::move(moved);
  BOOST_TEST((world.native() == MPI_COMM_WORLD));
  // A second session finds MPI running and leaves it running.
  {
    distopt::mpi_session again;
    BOOST_TEST(!again.owns_mpi());
    BOOST_TEST(again.thread_level() >= MPI_THREAD_FUNNELED);
  }
  int initialized = 0, finalized = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  BOOST_TEST(initialized == 1);
  BOOST_TEST(finalized == 0);
  BOOST_CHECK_THROW(static_cast<void>(mpi(MPI_COMM_NULL)), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE_TEMPLATE(all_reduce_every_op, T, all_types) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4097}})
    for (const reduce_op op : ops)
      for (const bool rounding : {false, true}) {
        const auto input = [&](int q, std::size_t len) {
          return rounding ? rounding_input<T>(q, len, 7 + n) : exact_input<T>(q, len, 5 + n);
        };
        std::vector<T> data = input(r, n);
        world.all_reduce(std::span<T>(data), op);
        const std::vector<T> want = expected_reduction<T>(d, 0, n, op, input);
        BOOST_CHECK_MESSAGE(same_bits(data, want), "all_reduce<" << type_name<T>() << "> " << op_name(op)
                                                                  << (rounding ? " rounding" : " exact") << " n=" << n
                                                                  << " on rank " << r << " of " << d << ": "
                                                                  << first_difference(data, want));
        if (rounding && n == 4097 && op == reduce_op::sum && !std::is_same_v<T, float> && !std::is_same_v<T, double>) {
          // The rounding family must round: most exact sums are no bf16/fp16 number.
          std::size_t rounded = 0;
          std::vector<std::vector<T>> in;
          for (int q = 0; q < d; ++q) in.push_back(input(q, n));
          for (std::size_t i = 0; i < n; ++i) {
            double s = 0;
            for (const auto& v : in) s += load(v[i]);
            rounded += load(want[i]) != s;
          }
          BOOST_TEST(rounded > n / 4);
        }
      }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(max_propagates_nan, T, all_types) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const T nan = make<T>(std::numeric_limits<double>::quiet_NaN());
  const T minus_inf = make<T>(-std::numeric_limits<double>::infinity());
  // A NaN on the last rank and one on the first, so that neither operand order drops it.
  const std::vector<T> pattern = {r == d - 1 ? nan : make<T>(1), r == 0 ? nan : make<T>(2), minus_inf, make<T>(r)};
  const auto check = [&](const std::vector<T>& v, const char* what) {
    BOOST_TEST_REQUIRE(v.size() == 4u);
    BOOST_CHECK_MESSAGE(std::isnan(load(v[0])) && std::isnan(load(v[1])),
                        what << "<" << type_name<T>() << "> max lost a NaN on rank " << r);
    BOOST_CHECK_MESSAGE(load(v[2]) == -std::numeric_limits<double>::infinity() && load(v[3]) == d - 1,
                        what << "<" << type_name<T>() << "> max on rank " << r << ": " << load(v[2]) << ", " << load(v[3]));
  };
  std::vector<T> v = pattern;
  world.all_reduce(std::span<T>(v), reduce_op::max);
  check(v, "all_reduce");
  std::vector<T> w = pattern;
  world.iall_reduce(std::span<T>(w), reduce_op::max).wait();
  check(w, "iall_reduce");
  std::vector<T> full;
  for (int q = 0; q < d; ++q) full.insert(full.end(), pattern.begin(), pattern.end());
  std::vector<T> out(4);
  world.reduce_scatter(std::span<const T>(full), std::span<T>(out), reduce_op::max);
  check(out, "reduce_scatter");
}

BOOST_AUTO_TEST_CASE_TEMPLATE(all_gather_in_rank_order, T, all_types) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const auto ud = static_cast<std::size_t>(d), ur = static_cast<std::size_t>(r);
  for (const std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4097}}) {
    std::vector<T> want;
    for (int q = 0; q < d; ++q) {
      const std::vector<T> p = rounding_input<T>(q, m, 3);
      want.insert(want.end(), p.begin(), p.end());
    }
    const std::vector<T> piece = rounding_input<T>(r, m, 3);
    std::vector<T> out(ud * m);
    world.all_gather(std::span<const T>(piece), std::span<T>(out));
    BOOST_CHECK_MESSAGE(same_bits(out, want), "all_gather<" << type_name<T>() << "> m=" << m << " on rank " << r
                                                            << ": " << first_difference(out, want));
    // In place: this rank's piece already sits in its slice of the output.
    std::vector<T> buf(ud * m, make<T>(-1));
    std::copy(piece.begin(), piece.end(), buf.begin() + static_cast<std::ptrdiff_t>(ur * m));
    world.all_gather(std::span<const T>(buf).subspan(ur * m, m), std::span<T>(buf));
    BOOST_CHECK_MESSAGE(same_bits(buf, want), "in-place all_gather<" << type_name<T>() << "> m=" << m << " on rank "
                                                                     << r << ": " << first_difference(buf, want));
  }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(reduce_scatter_every_op, T, all_types) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const auto ud = static_cast<std::size_t>(d), ur = static_cast<std::size_t>(r);
  for (const std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1025}})
    for (const reduce_op op : ops)
      for (const bool rounding : {false, true}) {
        const auto input = [&](int q, std::size_t len) {
          return rounding ? rounding_input<T>(q, len, 9 + m) : exact_input<T>(q, len, 8 + m);
        };
        const std::vector<T> full = input(r, ud * m);
        const std::vector<T> want = expected_reduction<T>(d, ur * m, m, op, input);
        std::vector<T> out(m);
        world.reduce_scatter(std::span<const T>(full), std::span<T>(out), op);
        BOOST_CHECK_MESSAGE(same_bits(out, want), "reduce_scatter<" << type_name<T>() << "> " << op_name(op)
                                                                    << (rounding ? " rounding" : " exact") << " m=" << m
                                                                    << " on rank " << r << ": "
                                                                    << first_difference(out, want));
        // In place: out is this rank's slice of in; the other slices are left as they were.
        std::vector<T> buf = full;
        world.reduce_scatter(std::span<const T>(buf), std::span<T>(buf).subspan(ur * m, m), op);
        std::vector<T> mine(buf.begin() + static_cast<std::ptrdiff_t>(ur * m),
                            buf.begin() + static_cast<std::ptrdiff_t>((ur + 1) * m));
        BOOST_CHECK_MESSAGE(same_bits(mine, want), "in-place reduce_scatter<" << type_name<T>() << "> "
                                                                              << op_name(op) << " m=" << m
                                                                              << " on rank " << r << ": "
                                                                              << first_difference(mine, want));
        std::copy(full.begin() + static_cast<std::ptrdiff_t>(ur * m),
                  full.begin() + static_cast<std::ptrdiff_t>((ur + 1) * m),
                  buf.begin() + static_cast<std::ptrdiff_t>(ur * m));
        BOOST_CHECK_MESSAGE(same_bits(buf, full), "in-place reduce_scatter<" << type_name<T>()
                                                                             << "> wrote outside its slice on rank " << r);
        if (op == reduce_op::sum && !rounding) {
          // The sharded step's path (reduce-scatter, then all-gather) gives all_reduce's bits.
          std::vector<T> composed(ud * m), reduced = full;
          world.all_gather(std::span<const T>(out), std::span<T>(composed));
          world.all_reduce(std::span<T>(reduced), reduce_op::sum);
          BOOST_CHECK_MESSAGE(same_bits(composed, reduced), "reduce_scatter + all_gather != all_reduce<"
                                                                << type_name<T>() << "> m=" << m << " on rank " << r);
        }
      }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(reduce_to_every_root, T, all_types) {
  // The root gets the reduction (exact inputs: any order gives these bits); the others'
  // out is not written; in place on the root; blocking and started.
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1025}})
    for (const reduce_op op : ops)
      for (int root = 0; root < d; ++root)
        for (const bool async : {false, true}) {
          const auto input = [&](int q, std::size_t len) { return exact_input<T>(q, len, 31 + n); };
          const std::vector<T> in = input(r, n);
          const std::vector<T> want = expected_reduction<T>(d, 0, n, op, input);
          const T marker = T(-5.0f);
          std::vector<T> out(n, marker);  // full size on every rank: only the root's is written
          const auto run = [&](std::span<const T> a, std::span<T> b) {
            if (async) world.ireduce(a, b, op, root).wait();
            else world.reduce(a, b, op, root);
          };
          run(std::span<const T>(in), std::span<T>(out));
          const std::vector<T> expect_out = r == root ? want : std::vector<T>(n, marker);
          BOOST_CHECK_MESSAGE(same_bits(out, expect_out), (async ? "ireduce<" : "reduce<")
                                                              << type_name<T>() << "> " << op_name(op) << " n=" << n
                                                              << " root " << root << " on rank " << r << ": "
                                                              << first_difference(out, expect_out));
          std::vector<T> buf = in;
          run(std::span<const T>(buf), std::span<T>(buf));
          const std::vector<T> expect_buf = r == root ? want : in;
          BOOST_CHECK_MESSAGE(same_bits(buf, expect_buf), "in-place " << (async ? "ireduce<" : "reduce<")
                                                                      << type_name<T>() << "> " << op_name(op)
                                                                      << " n=" << n << " root " << root << " on rank "
                                                                      << r << ": " << first_difference(buf, expect_buf));
        }
}

BOOST_AUTO_TEST_CASE_TEMPLATE(broadcast_from_every_root, T, all_types) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  for (const std::size_t n : {std::size_t{0}, std::size_t{1000}})
    for (int root = 0; root < d; ++root) {
      std::vector<T> data = rounding_input<T>(r, n, 11 + static_cast<std::uint64_t>(root));
      world.broadcast(std::span<T>(data), root);
      const std::vector<T> want = rounding_input<T>(root, n, 11 + static_cast<std::uint64_t>(root));
      BOOST_CHECK_MESSAGE(same_bits(data, want), "broadcast<" << type_name<T>() << "> n=" << n << " root " << root
                                                              << " on rank " << r);
      std::vector<T> again = rounding_input<T>(r, n, 12 + static_cast<std::uint64_t>(root));
      world.ibroadcast(std::span<T>(again), root).wait();
      BOOST_CHECK_MESSAGE(same_bits(again, rounding_input<T>(root, n, 12 + static_cast<std::uint64_t>(root))),
                          "ibroadcast<" << type_name<T>() << "> n=" << n << " root " << root << " on rank " << r);
    }
}

BOOST_AUTO_TEST_CASE(async_forms_complete_in_any_wait_order) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const auto ud = static_cast<std::size_t>(d), ur = static_cast<std::size_t>(r);
  constexpr std::size_t n = 4097, m = 513;
  const auto a_in = [](int q, std::size_t len) { return exact_input<float>(q, len, 21); };
  const auto b_in = [](int q, std::size_t len) { return rounding_input<bf16>(q, len, 22); };
  const auto s_in = [](int q, std::size_t len) { return rounding_input<fp16>(q, len, 24); };
  const auto x_in = [](int q, std::size_t len) { return exact_input<float>(q, len, 25); };
  const auto e_in = [](int q, std::size_t len) { return exact_input<double>(q, len, 27); };
  std::vector<float> a = a_in(r, n);
  std::vector<bf16> b = b_in(r, n);
  std::vector<double> g(ud * m, -1.0);
  const std::vector<double> piece = exact_input<double>(r, m, 23);
  std::copy(piece.begin(), piece.end(), g.begin() + static_cast<std::ptrdiff_t>(ur * m));
  std::vector<fp16> s = s_in(r, ud * m);
  const std::vector<float> xfull = x_in(r, ud * m);
  std::vector<float> xout(m);
  std::vector<bf16> c = rounding_input<bf16>(r, n, 26);
  std::vector<double> e = e_in(r, n);

  std::vector<distopt::comm_request> requests;
  requests.push_back(world.iall_reduce(std::span<float>(a), reduce_op::sum));
  requests.push_back(world.iall_reduce(std::span<bf16>(b), reduce_op::avg));
  requests.push_back(world.iall_gather(std::span<const double>(g).subspan(ur * m, m), std::span<double>(g)));
  requests.push_back(world.ireduce_scatter(std::span<const fp16>(s), std::span<fp16>(s).subspan(ur * m, m),
                                           reduce_op::sum));
  requests.push_back(world.ireduce_scatter(std::span<const float>(xfull), std::span<float>(xout), reduce_op::max));
  requests.push_back(world.ibroadcast(std::span<bf16>(c), d - 1));
  requests.push_back(world.iall_reduce(std::span<double>(e), reduce_op::avg));
  for (auto& q : requests) BOOST_TEST(q.pending());
  // Poll the last one to completion (test() drives MPI's progress), then wait from the back.
  while (!requests.back().test()) {
  }
  for (auto it = requests.rbegin(); it != requests.rend(); ++it) it->wait();
  for (auto& q : requests) BOOST_TEST(!q.pending());

  BOOST_CHECK_MESSAGE(same_bits(a, expected_reduction<float>(d, 0, n, reduce_op::sum, a_in)),
                      "iall_reduce<float> sum on rank " << r);
  BOOST_CHECK_MESSAGE(same_bits(b, expected_reduction<bf16>(d, 0, n, reduce_op::avg, b_in)),
                      "iall_reduce<bf16> avg on rank " << r << ": "
                                                       << first_difference(b, expected_reduction<bf16>(d, 0, n, reduce_op::avg, b_in)));
  std::vector<double> gathered;
  for (int q = 0; q < d; ++q) {
    const std::vector<double> p = exact_input<double>(q, m, 23);
    gathered.insert(gathered.end(), p.begin(), p.end());
  }
  BOOST_CHECK_MESSAGE(same_bits(g, gathered), "in-place iall_gather<double> on rank " << r);
  const std::vector<fp16> smine(s.begin() + static_cast<std::ptrdiff_t>(ur * m),
                                s.begin() + static_cast<std::ptrdiff_t>((ur + 1) * m));
  BOOST_CHECK_MESSAGE(same_bits(smine, expected_reduction<fp16>(d, ur * m, m, reduce_op::sum, s_in)),
                      "in-place ireduce_scatter<fp16> sum on rank " << r);
  BOOST_CHECK_MESSAGE(same_bits(xout, expected_reduction<float>(d, ur * m, m, reduce_op::max, x_in)),
                      "ireduce_scatter<float> max on rank " << r);
  BOOST_CHECK_MESSAGE(same_bits(c, rounding_input<bf16>(d - 1, n, 26)), "ibroadcast<bf16> on rank " << r);
  BOOST_CHECK_MESSAGE(same_bits(e, expected_reduction<double>(d, 0, n, reduce_op::avg, e_in)),
                      "iall_reduce<double> avg on rank " << r);

  // wait_all, and a request dropped without wait() completes in its destructor.
  std::vector<float> p = a_in(r, n), q2 = a_in(r, n);
  {
    distopt::comm_request first = world.iall_reduce(std::span<float>(p), reduce_op::sum);
    distopt::comm_request second = world.iall_reduce(std::span<float>(q2), reduce_op::max);
    distopt::wait_all(second, first);
  }
  BOOST_TEST(same_bits(p, a));
  BOOST_TEST(same_bits(q2, expected_reduction<float>(d, 0, n, reduce_op::max, a_in)));
  std::vector<float> dropped = a_in(r, n);
  { distopt::comm_request ignored = world.iall_reduce(std::span<float>(dropped), reduce_op::sum); }
  BOOST_TEST(same_bits(dropped, a));
}

BOOST_AUTO_TEST_CASE(sums_are_identical_on_every_rank_and_every_run) {
  // Values whose float sum depends on the order: the same bits everywhere all the same
  // (replicated parameters must not drift apart), if not those of a rank-order sum.
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const auto ud = static_cast<std::size_t>(d), ur = static_cast<std::size_t>(r);
  const auto random_input = [](int q, std::size_t len) {
    std::vector<float> v(len);
    for (std::size_t i = 0; i < len; ++i) {
      const std::uint64_t h = hash(q, i, 99);
      const double mant = static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
      v[i] = static_cast<float>(std::ldexp(mant, static_cast<int>(h % 9) - 6));
    }
    return v;
  };
  for (const std::size_t n : {std::size_t{4097}, std::size_t{1} << 18}) {
    const std::vector<float> in = random_input(r, n);
    std::vector<float> blocking = in, again = in, started = in;
    world.all_reduce(std::span<float>(blocking), reduce_op::sum);
    world.all_reduce(std::span<float>(again), reduce_op::sum);
    world.iall_reduce(std::span<float>(started), reduce_op::sum).wait();
    BOOST_CHECK_MESSAGE(same_bits(blocking, again), "all_reduce<float> differs between two runs, n=" << n);
    std::vector<bf16> half(n);
    for (std::size_t i = 0; i < n; ++i) half[i] = bf16(in[i]);
    world.all_reduce(std::span<bf16>(half), reduce_op::sum);
    for (const auto* result : {&blocking, &started}) {
      std::vector<float> all(ud * n);
      world.all_gather(std::span<const float>(*result), std::span<float>(all));
      for (int q = 0; q < d; ++q)
        BOOST_CHECK_MESSAGE(std::memcmp(all.data() + static_cast<std::size_t>(q) * n, result->data(),
                                        n * sizeof(float)) == 0,
                            (result == &blocking ? "all_reduce" : "iall_reduce")
                                << "<float> sum n=" << n << ": rank " << q << " differs from rank " << r);
    }
    std::vector<bf16> halves(ud * n);
    world.all_gather(std::span<const bf16>(half), std::span<bf16>(halves));
    for (int q = 0; q < d; ++q)
      BOOST_CHECK_MESSAGE(std::memcmp(halves.data() + static_cast<std::size_t>(q) * n, half.data(), n * sizeof(bf16)) == 0,
                          "all_reduce<bf16> sum n=" << n << ": rank " << q << " differs from rank " << r);
    // For the record (--log_level=message): how far MPI's order is from rank order.
    std::vector<std::vector<float>> ins;
    for (int q = 0; q < d; ++q) ins.push_back(random_input(q, n));
    std::size_t off_rank_order = 0, off_blocking = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float s = ins[0][i];
      for (std::size_t q = 1; q < ud; ++q) s += ins[q][i];
      off_rank_order += std::memcmp(&s, &blocking[i], sizeof(float)) != 0;
      off_blocking += std::memcmp(&started[i], &blocking[i], sizeof(float)) != 0;
    }
    if (ur == 0)
      BOOST_TEST_MESSAGE("d=" << d << " n=" << n << ": all_reduce<float> sum differs from the rank-order sum in "
                              << off_rank_order << " elements; iall_reduce from all_reduce in " << off_blocking);
  }
}

BOOST_AUTO_TEST_CASE(split_into_a_dp_x_tp_grid) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), w = world.rank();
  // rank = dp * tp_size + tp, as in threads.hpp; an odd world gets TP groups of one.
  const int tp_size = d % 2 == 0 ? 2 : 1, dp_size = d / tp_size;
  const int dp = w / tp_size, tp = w % tp_size;
  mpi tp_group = world.split(dp, tp);
  mpi dp_group = world.split(tp, dp);
  BOOST_TEST(tp_group.size() == tp_size);
  BOOST_TEST(tp_group.rank() == tp);
  BOOST_TEST(dp_group.size() == dp_size);
  BOOST_TEST(dp_group.rank() == dp);
  // Every TP group reduces at once, then every DP group.
  float x = static_cast<float>(w);
  tp_group.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
  BOOST_TEST(x == static_cast<float>(dp * tp_size * tp_size + tp_size * (tp_size - 1) / 2));
  float y = static_cast<float>(w);
  dp_group.all_reduce(std::span<float>(&y, 1), reduce_op::sum);
  BOOST_TEST(y == static_cast<float>(tp_size * dp_size * (dp_size - 1) / 2 + dp_size * tp));
  const double me = w;
  std::vector<double> tp_members(static_cast<std::size_t>(tp_size)), dp_members(static_cast<std::size_t>(dp_size));
  tp_group.all_gather(std::span<const double>(&me, 1), std::span<double>(tp_members));
  dp_group.all_gather(std::span<const double>(&me, 1), std::span<double>(dp_members));
  for (int t = 0; t < tp_size; ++t) BOOST_TEST(tp_members[static_cast<std::size_t>(t)] == dp * tp_size + t);
  for (int p = 0; p < dp_size; ++p) BOOST_TEST(dp_members[static_cast<std::size_t>(p)] == p * tp_size + tp);
  // Collectives in flight on both kinds of group at once.
  float u = 1, v = 1;
  distopt::comm_request on_tp = tp_group.iall_reduce(std::span<float>(&u, 1), reduce_op::sum);
  distopt::comm_request on_dp = dp_group.iall_reduce(std::span<float>(&v, 1), reduce_op::sum);
  on_dp.wait();
  on_tp.wait();
  BOOST_TEST(u == static_cast<float>(tp_size));
  BOOST_TEST(v == static_cast<float>(dp_size));
  // Keys order a group; a split of a split; a moved handle keeps working.
  BOOST_TEST(world.split(0, -w).rank() == d - 1 - w);
  mpi parity = dp_group.split(dp % 2, 0);
  BOOST_TEST(parity.size() == (dp_size + 1 - dp % 2) / 2);
  BOOST_TEST(parity.rank() == dp / 2);
  mpi moved = std::move(tp_group);
  BOOST_TEST((tp_group.native() == MPI_COMM_NULL));
  float z = 1;
  moved.all_reduce(std::span<float>(&z, 1), reduce_op::avg);
  BOOST_TEST(z == 1.0f);
  // Each handle counts its own traffic; splits cost nothing.
  BOOST_TEST(world.bytes_sent() == 0u);
  const auto ut = static_cast<std::size_t>(tp_size);
  // TP: three 1-float all_reduces (rank 0 holds the element: (1 + (d-2)) * 4, others 4), one 1-double all_gather.
  const std::size_t ar1 = ut > 1 ? (tp == 0 ? (1 + (ut - 2)) * 4 : 4) : 0;
  BOOST_TEST(moved.bytes_sent() == 3 * ar1 + (ut - 1) * 8);
  BOOST_TEST(invalid_argument_of([&] { static_cast<void>(world.split(-1, 0)); }) ==
             "distopt::mpi::split: color must be >= 0, got -1 on rank " + std::to_string(w));
}

BOOST_AUTO_TEST_CASE(a_mixture_of_experts_mesh) {
  // The five groups of make_mesh between processes, for each shape this world divides
  // (tp, etp in {1, 2}, ep in {1, 2, 3, 4}): each holds the ranks its axis formula names.
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), w = world.rank();
  int shapes = 0;
  for (int tp : {1, 2})
    for (int ep : {1, 2, 3, 4})
      for (int etp : {1, 2}) {
        const distopt::mesh_shape s{tp, ep, etp};
        if (d % tp != 0 || d % (ep * etp) != 0) continue;
        ++shapes;
        distopt::mesh<mpi> m = distopt::make_mesh(world, s);
        const std::array<int, 5> index{m.at.tp, m.at.dp, m.at.etp, m.at.ep, m.at.edp};
        mpi* groups[] = {&m.tp, &m.dp, &m.etp, &m.ep, &m.edp};
        for (int axis = 0; axis < 5; ++axis) {
          BOOST_TEST_CONTEXT("tp " << tp << " ep " << ep << " etp " << etp << " axis " << axis) {
            const mesh_test::seen g = mesh_test::look_at(*groups[axis], w);
            BOOST_TEST(g.members == mesh_test::expected_group(d, s, w, axis), boost::test_tools::per_element());
            BOOST_TEST(g.rank == index[static_cast<std::size_t>(axis)]);
          }
        }
      }
  BOOST_TEST(shapes >= 2);  // at least tp = 1 with ep = 1, and ep = d or tp = 2
}

BOOST_AUTO_TEST_CASE(bytes_sent_follows_the_ring_model) {
  constexpr std::size_t n = 10, m = 5, g = 3;
  mpi world(MPI_COMM_WORLD);
  const auto ud = static_cast<std::size_t>(world.size()), ur = static_cast<std::size_t>(world.rank());
  // This rank's chunk of an n-element all_reduce: n/d, plus one for the first n%d ranks.
  const std::size_t chunk = n / ud + (ur < n % ud ? 1 : 0);
  std::vector<std::size_t> expected{0}, got{world.bytes_sent()};
  const auto step = [&](std::size_t bytes) {
    expected.push_back(expected.back() + bytes);
    got.push_back(world.bytes_sent());
  };
  const std::size_t ar = ud == 1 ? 0 : (n + (ud - 2) * chunk);  // elements
  std::vector<float> f(n, 1.0f);
  world.all_reduce(std::span<float>(f), reduce_op::sum);
  step(ar * sizeof(float));
  std::vector<float> in(ud * m, 1.0f), out(m);
  world.reduce_scatter(std::span<const float>(in), std::span<float>(out), reduce_op::avg);
  step((ud - 1) * m * sizeof(float));
  std::vector<double> piece(g, 2.0), all(ud * g);
  world.all_gather(std::span<const double>(piece), std::span<double>(all));
  step((ud - 1) * g * sizeof(double));
  std::vector<bf16> h(n, bf16(1.0f));
  world.broadcast(std::span<bf16>(h), world.size() - 1);
  step(ur == ud - 1 && ud > 1 ? n * sizeof(bf16) : 0);
  // The i-forms count when they start; bf16/fp16 sums count 2 bytes an element, as modelled.
  std::vector<fp16> hf(n, fp16(1.0f));
  distopt::comm_request r1 = world.iall_reduce(std::span<fp16>(hf), reduce_op::sum);
  step(ar * sizeof(fp16));
  std::vector<bf16> hin(ud * m, bf16(1.0f)), hout(m);
  distopt::comm_request r2 = world.ireduce_scatter(std::span<const bf16>(hin), std::span<bf16>(hout), reduce_op::max);
  step((ud - 1) * m * sizeof(bf16));
  std::vector<float> fpiece(g, 1.0f), fall(ud * g);
  distopt::comm_request r3 = world.iall_gather(std::span<const float>(fpiece), std::span<float>(fall));
  step((ud - 1) * g * sizeof(float));
  std::vector<double> dd(n, 3.0);
  distopt::comm_request r4 = world.ibroadcast(std::span<double>(dd), 0);
  step(ur == 0 && ud > 1 ? n * sizeof(double) : 0);
  std::vector<float> part(m, 1.0f), sum(ur == 0 ? m : 0);
  distopt::comm_request r5 = world.ireduce(std::span<const float>(part), std::span<float>(sum), reduce_op::sum, 0);
  step(ur == 0 || ud == 1 ? 0 : m * sizeof(float));  // every rank but the root sends its part
  distopt::wait_all(r1, r2, r3, r4, r5);
  BOOST_TEST(got == expected, boost::test_tools::per_element());
  // Summed over ranks, all_reduce sends exactly 2 (d-1) N s, like a ring.
  const double mine = static_cast<double>(ar * sizeof(float));
  std::vector<double> totals(ud);
  world.all_gather(std::span<const double>(&mine, 1), std::span<double>(totals));
  double total = 0;
  for (double t : totals) total += t;
  BOOST_TEST(total == static_cast<double>(2 * (ud - 1) * n * sizeof(float)));
}

BOOST_AUTO_TEST_CASE(bad_sizes_throw_invalid_argument_on_the_rank) {
  mpi world(MPI_COMM_WORLD);
  const int d = world.size(), r = world.rank();
  const auto ud = static_cast<std::size_t>(d);
  const std::string sd = std::to_string(d);
  std::vector<float> in(3), out(3 * ud - 1);
  const std::string gather_msg = "out has " + std::to_string(3 * d - 1) + " elements but size() * in = " + sd +
                                 " * 3 = " + std::to_string(3 * d);
  BOOST_TEST(invalid_argument_of([&] { world.all_gather(std::span<const float>(in), std::span<float>(out)); }) ==
             "distopt::mpi::all_gather: " + gather_msg);
  BOOST_TEST(invalid_argument_of([&] {
               world.iall_gather(std::span<const float>(in), std::span<float>(out)).wait();
             }) == "distopt::mpi::iall_gather: " + gather_msg);
  std::vector<double> big(2 * ud + 1), small(2);
  const std::string scatter_msg = "in has " + std::to_string(2 * d + 1) + " elements but size() * out = " + sd +
                                  " * 2 = " + std::to_string(2 * d);
  BOOST_TEST(invalid_argument_of([&] {
               world.reduce_scatter(std::span<const double>(big), std::span<double>(small), reduce_op::sum);
             }) == "distopt::mpi::reduce_scatter: " + scatter_msg);
  BOOST_TEST(invalid_argument_of([&] {
               world.ireduce_scatter(std::span<const double>(big), std::span<double>(small), reduce_op::max).wait();
             }) == "distopt::mpi::ireduce_scatter: " + scatter_msg);
  std::vector<bf16> h(2);
  BOOST_TEST(invalid_argument_of([&] { world.broadcast(std::span<bf16>(h), d); }) ==
             "distopt::mpi::broadcast: root " + sd + " does not exist in a group of " + sd + " ranks");
  BOOST_TEST(invalid_argument_of([&] { world.ibroadcast(std::span<bf16>(h), -1).wait(); }) ==
             "distopt::mpi::ibroadcast: root -1 does not exist in a group of " + sd + " ranks");
  BOOST_TEST(invalid_argument_of([&] {
               world.reduce(std::span<const double>(small), std::span<double>(big), reduce_op::sum, r);
             }) == "distopt::mpi::reduce: out has " + std::to_string(2 * d + 1) + " elements on the root but in has 2");
  BOOST_TEST(invalid_argument_of([&] {
               world.ireduce(std::span<const double>(small), std::span<double>(small), reduce_op::sum, d).wait();
             }) == "distopt::mpi::ireduce: root " + sd + " does not exist in a group of " + sd + " ranks");
  // Overlapping buffers other than the one allowed aliasing.
  std::vector<float> buf(2 * ud);
  const std::size_t wrong = r == 0 ? 1 : 0;  // never this rank's slice
  BOOST_TEST(invalid_argument_of([&] {
               world.all_gather(std::span<const float>(buf).subspan(wrong, 2), std::span<float>(buf));
             }) == "distopt::mpi::all_gather: in overlaps out but is not this rank's slice of it");
  BOOST_TEST(invalid_argument_of([&] {
               world.reduce_scatter(std::span<const float>(buf), std::span<float>(buf).subspan(wrong, 2),
                                    reduce_op::sum);
             }) == "distopt::mpi::reduce_scatter: out overlaps in but is not this rank's slice of it");
  // Every rank threw before communicating: nothing was sent and the communicator works.
  BOOST_TEST(world.bytes_sent() == 0u);
  float x = static_cast<float>(r);
  world.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
  BOOST_TEST(x == static_cast<float>(d * (d - 1) / 2));
}

BOOST_AUTO_TEST_CASE(mpi_errors_throw_runtime_error_naming_call_rank_and_cause) {
  std::string what;
  try {
    distopt::detail::mpi_check(MPI_ERR_COUNT, "all_reduce", 3);
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(MPI_ERR_COUNT, text, &len);
  BOOST_TEST(what == "distopt::mpi::all_reduce: MPI error on rank 3: " + std::string(text, static_cast<std::size_t>(len)));
  // A real error: in a pair of ranks, the receiver of a broadcast offers half the room.
  mpi world(MPI_COMM_WORLD);
  const int w = world.rank();
  {
    mpi pair = world.split(w < 2 ? 0 : 1, w);
    if (w < 2) {
      std::vector<float> data(w == 0 ? 4 : 2, 1.0f);
      std::string error;
      try {
        pair.broadcast(std::span<float>(data), 0);
      } catch (const std::runtime_error& e) {
        error = e.what();
      }
      BOOST_TEST_MESSAGE("rank " << w << ": " << error);
      if (w == 1) {
        BOOST_TEST(error.rfind("distopt::mpi::broadcast: MPI error on rank 1: ", 0) == 0u);
        BOOST_TEST(error.find("truncated") != std::string::npos);
      }
    }
  }
  float x = 1;
  world.all_reduce(std::span<float>(&x, 1), reduce_op::sum);
  BOOST_TEST(x == static_cast<float>(world.size()));
}

BOOST_AUTO_TEST_SUITE_END()
