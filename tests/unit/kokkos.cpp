// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// The Kokkos executor: its contract (each index once, zeroed allocations, exceptions
// brought back to the caller, a clear error before Kokkos is initialised), and the
// optimizer run through it giving the CPU executor's bits: every element-wise policy with
// fp32, bf16 and 8-bit states and fp32, bf16 and fp16 params, one rank and d = 1..4 ranks
// as threads with sharded state. The layer-wise policies are in kokkos_layerwise.cpp.

#include "executor_harness.hpp"

#include <boost/test/unit_test.hpp>
#include <distopt/exec/kokkos.hpp>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// Made before Kokkos::initialize, an allocation must fail with a message naming the fix.
std::string before_initialise_message;

struct kokkos_scope {
  kokkos_scope() {
    try {
      distopt::kokkos<> e;
      e.deallocate_bytes(e.allocate_bytes(8), 8);
    } catch (const std::logic_error& err) {
      before_initialise_message = err.what();
    }
    Kokkos::initialize();
  }
  ~kokkos_scope() { Kokkos::finalize(); }
};

}  // namespace

BOOST_TEST_GLOBAL_FIXTURE(kokkos_scope);

using namespace distopt;
using namespace harness;

BOOST_AUTO_TEST_SUITE(kokkos_executor)

BOOST_AUTO_TEST_CASE(models_the_executor_concept) {
  static_assert(executor<kokkos<>>);
  static_assert(executor<kokkos<Kokkos::Serial>>);
  // Not from a thread count (Kokkos 4's OpenMP space converts from an int): make_executor
  // gives the space's default instance.
  static_assert(!std::is_constructible_v<kokkos<>, int>);
  BOOST_TEST(kokkos<>{}.concurrency() >= 1);
}

BOOST_AUTO_TEST_CASE(refuses_to_allocate_before_kokkos_is_initialised) {
  BOOST_TEST(before_initialise_message.find("before Kokkos is initialised") != std::string::npos,
             before_initialise_message);
  BOOST_TEST(before_initialise_message.find("Kokkos::ScopeGuard") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(allocations_are_zeroed_and_aligned) {
  kokkos<> e;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20}) {
    auto* p = static_cast<unsigned char*>(e.allocate_bytes(bytes));
    BOOST_TEST((reinterpret_cast<std::uintptr_t>(p) % 16 == 0), "bytes " << bytes);
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    BOOST_TEST(nonzero == 0u);
    e.deallocate_bytes(p, bytes);
  }
}

BOOST_AUTO_TEST_CASE(visits_each_index_once) {
  kokkos<Kokkos::Serial> e{Kokkos::Serial()};
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{10007}}) {
    std::vector<std::atomic<int>> seen(n);
    e.parallel_for(n, [&](std::size_t i) { seen[i].fetch_add(1); });
    std::size_t wrong = 0;
    for (auto& s : seen) wrong += s.load() != 1;
    BOOST_TEST(wrong == 0u, "n = " << n);
  }
}

BOOST_AUTO_TEST_CASE(an_exception_in_an_item_reaches_the_caller_after_all_items_ran) {
  kokkos<> e;
  std::atomic<int> ran{0};
  try {
    e.parallel_for(100, [&](std::size_t i) {
      ran.fetch_add(1);
      if (i == 17 || i == 60) throw std::runtime_error("item " + std::to_string(i) + " failed");
    });
    BOOST_FAIL("no exception");
  } catch (const std::runtime_error& err) {
    BOOST_TEST(std::string(err.what()).find("failed") != std::string::npos);
  }
  BOOST_TEST(ran.load() == 100);
  // The executor is usable afterwards.
  std::atomic<int> again{0};
  e.parallel_for(5, [&](std::size_t) { again.fetch_add(1); });
  BOOST_TEST(again.load() == 5);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(kokkos_equals_cpu)

BOOST_AUTO_TEST_CASE(sgd_momentum_and_nesterov) {
  check_executor<kokkos<>, sgd, fp32, precision<float>>(cases::sgd_momentum_and_nesterov(), run_options{});
}

BOOST_AUTO_TEST_CASE(adam_amsgrad_bf16_states) {
  check_executor<kokkos<>, adam, bf16, precision<float>>({cases::adam_amsgrad()}, run_options{});
}

BOOST_AUTO_TEST_CASE(adamw_clipped) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.clip = 1.0;
  check_executor<kokkos<>, adamw, fp32, precision<float>>({h}, ro);
}

BOOST_AUTO_TEST_CASE(adamw_bf16_params_with_master) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  run_options ro;
  ro.clip = 2.0;
  check_executor<kokkos<>, adamw, fp32, precision<bf16, bf16>>({h}, ro, dtype::bf16);
}

BOOST_AUTO_TEST_CASE(lion_bf16_stochastic_rounding) {
  check_executor<kokkos<>, lion, fp32, precision<bf16, float>>({cases::lion_decayed()}, cases::stochastic_rounding(),
                                                               dtype::bf16);
}

BOOST_AUTO_TEST_CASE(adam_fp16_dynamic_loss_scaling) {
  check_executor<kokkos<>, adam, fp32, precision<fp16, fp16>>({adam::hyper_params{}}, cases::fp16_loss_scaling(),
                                                              dtype::f16);
}

BOOST_AUTO_TEST_CASE(q8_adamw_with_percentile_clipping) {
  adamw::hyper_params h;
  h.lr = 1e-2;
  check_executor<kokkos<>, adamw, q8, precision<float>>({h}, cases::q8_percentile_clipping());
}

BOOST_AUTO_TEST_SUITE_END()
