// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// `any_comm`, the communicator chosen at run time, against the communicator it holds:
// - every collective, blocking and asynchronous, for each of its four number types and
//   d = 1..4 ranks as threads, gives the same bits (and the same byte count) as the same
//   call on a bare `threads` handle of the same group;
// - a communicator without asynchronous forms still serves the i-forms (completed requests);
// - the held communicator's errors reach the caller unchanged;
// - a sharded optimizer over any_comm gives the params, master weights and states of the
//   same optimizer over bare `threads`, and of the single-rank run, bit for bit.

#include "sharded_harness.hpp"

#include <boost/test/unit_test.hpp>

#include <distopt/comm/any.hpp>

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace distopt;

static_assert(communicator<any_comm>, "any_comm must model distopt::communicator");
static_assert(async_communicator<any_comm>, "any_comm must model distopt::async_communicator");
static_assert(!std::is_copy_constructible_v<any_comm>);
static_assert(!std::is_constructible_v<any_comm, int>, "only communicators convert to any_comm");

/// `f` as a T (bf16 and fp16 round to nearest even).
template <class T>
T make(float f) {
  return static_cast<T>(f);
}

/// A communicator with the blocking forms only (one rank; what a user's minimal one has).
class blocking_only {
 public:
  using communicator_concept = communicator_tag;
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  template <class T>
  void all_reduce(std::span<T> data, reduce_op) {
    for (auto& x : data) x = make<T>(static_cast<float>(x) * 2.0f);  // visible: a real one would not change it
    ++calls;
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    std::copy(in.begin(), in.end(), out.begin());
    ++calls;
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, reduce_op) {
    std::copy(in.begin(), in.end(), out.begin());
    ++calls;
  }
  template <class T>
  void reduce(std::span<const T> in, std::span<T> out, reduce_op, int) {
    std::copy(in.begin(), in.end(), out.begin());
    ++calls;
  }
  template <class T>
  void broadcast(std::span<T>, int) {
    ++calls;
  }
  std::size_t bytes_sent() const noexcept { return calls; }
  std::size_t calls = 0;
};
static_assert(communicator<blocking_only> && !async_communicator<blocking_only>);

/// Rank r's value i: distinct per (rank, element), exact in every carried type.
template <class T>
T value(int rank, std::size_t i) {
  return make<T>(static_cast<float>((rank + 1) * 3 + static_cast<int>(i % 29)) * 0.25f -
                       static_cast<float>(i % 7));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// Runs every collective twice on each rank, once on a bare `threads` handle and once
/// through any_comm (a handle of the same group), and records per rank whether they agreed.
template <class T>
void check_type(int d, bool async) {
  constexpr std::size_t n = 37;  // not a multiple of d: reduce_scatter gets n * d in
  std::vector<std::string> failures(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& world) {
    const int r = world.rank();
    threads bare = world.split(0, r);
    any_comm any(std::move(world));
    std::string& fail = failures[static_cast<std::size_t>(r)];
    const auto note = [&](const char* what, bool ok) {
      if (!ok) fail += std::string(what) + " ";
    };
    const auto run = [&](auto&& sync, auto&& start) {
      if (async) start().wait();
      else sync();
    };
    if (any.rank() != bare.rank() || any.size() != bare.size()) fail += "rank/size ";

    for (const reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
      std::vector<T> a(n), b(n);
      for (std::size_t i = 0; i < n; ++i) a[i] = b[i] = value<T>(r, i);
      bare.all_reduce(std::span<T>(a), op);
      run([&] { any.all_reduce(std::span<T>(b), op); }, [&] { return any.iall_reduce(std::span<T>(b), op); });
      note("all_reduce", same_bits(a, b));

      std::vector<T> in(n * static_cast<std::size_t>(d)), a2(n), b2(n);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = value<T>(r, i);
      bare.reduce_scatter(std::span<const T>(in), std::span<T>(a2), op);
      run([&] { any.reduce_scatter(std::span<const T>(in), std::span<T>(b2), op); },
          [&] { return any.ireduce_scatter(std::span<const T>(in), std::span<T>(b2), op); });
      note("reduce_scatter", same_bits(a2, b2));

      // reduce to the last rank, the others passing no out.
      const int to = d - 1;
      std::vector<T> a3(r == to ? n : 0), b3(a3.size());
      bare.reduce(std::span<const T>(in).first(n), std::span<T>(a3), op, to);
      run([&] { any.reduce(std::span<const T>(in).first(n), std::span<T>(b3), op, to); },
          [&] { return any.ireduce(std::span<const T>(in).first(n), std::span<T>(b3), op, to); });
      note("reduce", same_bits(a3, b3));
    }
    std::vector<T> mine(n), a(n * static_cast<std::size_t>(d)), b(a.size());
    for (std::size_t i = 0; i < n; ++i) mine[i] = value<T>(r, i);
    bare.all_gather(std::span<const T>(mine), std::span<T>(a));
    run([&] { any.all_gather(std::span<const T>(mine), std::span<T>(b)); },
        [&] { return any.iall_gather(std::span<const T>(mine), std::span<T>(b)); });
    note("all_gather", same_bits(a, b));

    const int root = d - 1;
    std::vector<T> c(n), e(n);
    for (std::size_t i = 0; i < n; ++i) c[i] = e[i] = value<T>(r, i);
    bare.broadcast(std::span<T>(c), root);
    run([&] { any.broadcast(std::span<T>(e), root); }, [&] { return any.ibroadcast(std::span<T>(e), root); });
    note("broadcast", same_bits(c, e));
    // The same sequence of calls on both handles: the same bytes sent.
    note("bytes_sent", any.bytes_sent() == bare.bytes_sent());
  });
  for (int r = 0; r < d; ++r)
    BOOST_TEST(failures[static_cast<std::size_t>(r)].empty(),
               "d=" << d << " rank " << r << (async ? " async" : " blocking") << ": differs in "
                    << failures[static_cast<std::size_t>(r)]);
}

}  // namespace

BOOST_AUTO_TEST_CASE(collectives_match_the_held_communicator) {
  for (int d = 1; d <= 4; ++d)
    for (const bool async : {false, true}) {
      check_type<float>(d, async);
      check_type<double>(d, async);
      check_type<bf16>(d, async);
      check_type<fp16>(d, async);
    }
}

BOOST_AUTO_TEST_CASE(default_holds_single) {
  any_comm c;
  BOOST_TEST(c.rank() == 0);
  BOOST_TEST(c.size() == 1);
  std::vector<float> in{1.5f, -2.0f}, out(2);
  c.all_gather(std::span<const float>(in), std::span<float>(out));
  BOOST_TEST((out == in));
}

BOOST_AUTO_TEST_CASE(blocking_communicator_serves_the_async_forms) {
  any_comm c{blocking_only{}};
  std::vector<float> x{1.0f, 3.0f};
  comm_request req = c.iall_reduce(std::span<float>(x), reduce_op::sum);
  BOOST_TEST(!req.pending());  // the work was done before the request came back
  BOOST_TEST(x[0] == 2.0f);
  BOOST_TEST(x[1] == 6.0f);
  std::vector<bf16> y{bf16(0.5f)}, z(1);
  c.ireduce_scatter(std::span<const bf16>(y), std::span<bf16>(z), reduce_op::sum).wait();
  BOOST_TEST(static_cast<float>(z[0]) == 0.5f);
  BOOST_TEST(c.bytes_sent() == 2u);
}

BOOST_AUTO_TEST_CASE(errors_of_the_held_communicator_pass_through) {
  any_comm c;
  std::vector<double> in(3), out(2);
  try {
    c.all_gather(std::span<const double>(in), std::span<double>(out));
    BOOST_FAIL("a size mismatch was accepted");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("distopt::single::all_gather") != std::string::npos, what);
  }
}

BOOST_AUTO_TEST_CASE(sharded_optimizer_matches_bare_threads) {
  using namespace harness;
  // bf16 params and grads with fp32 master weights: the optimizer's reduce-scatter and
  // all-gather carry bf16, its norm all-reduce double.
  using prec = precision<bf16, bf16>;
  run_options ro;
  ro.steps = 6;
  ro.options.master_weights = true;
  ro.options.bucket_elems = 512;
  ro.clip = 1.0;
  const std::vector<adamw::hyper_params> h{adamw::hyper_params{}};
  const layout l = make_layout(awkward_layouts()[3], dtype::bf16);
  const outcome ref = run_single<adamw, float, prec>(l, h, ro);
  for (int d = 1; d <= 4; ++d) {
    BOOST_TEST_CONTEXT("d=" << d) {
      const outcome bare = run_threads<adamw, sharded<float>, prec>(d, l, h, ro);
      const outcome any = run_threads<adamw, sharded<float>, prec, cpu, any_comm>(d, l, h, ro);
      BOOST_TEST((any == bare));
      BOOST_TEST((any.params == ref.params));
      BOOST_TEST((any.master == ref.master));
      BOOST_TEST((any.states == ref.states));
    }
  }
}
