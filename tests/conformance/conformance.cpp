// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Conformance: the library's types model the four concepts, and look-alikes that miss one
// piece do not. Compile-time only (static_assert); the one test case exists so that the
// executable links and ctest runs it.

#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>

#include <cstddef>
#include <span>
#include <string_view>

namespace conformance {

// ---- archetypes that miss exactly one piece ----------------------------------------------

/// A complete policy; the look-alikes below each drop one part of it.
struct good_policy {
  static constexpr std::string_view name = "good";
  static constexpr int max_state_slots = 0;
  struct hyper_params {
    void validate() const {}
  };
  static int state_slots(const hyper_params&) { return 0; }
  struct scalars {
    float lr;
  };
  static scalars prepare(const hyper_params&, const distopt::step_info&) { return {0.1f}; }
  static void update(const scalars& s, float& p, float g, float*) { p -= s.lr * g; }
};

struct policy_without_update {
  static constexpr std::string_view name = "no_update";
  static constexpr int max_state_slots = 0;
  using hyper_params = good_policy::hyper_params;
  using scalars = good_policy::scalars;
  static int state_slots(const hyper_params&) { return 0; }
  static scalars prepare(const hyper_params&, const distopt::step_info&) { return {0.1f}; }
};

struct policy_without_hyper_params {
  static constexpr std::string_view name = "no_hyper_params";
  static constexpr int max_state_slots = 0;
  using scalars = good_policy::scalars;
  static void update(const scalars&, float&, float, float*) {}
};

struct policy_with_too_many_slots : good_policy {
  static constexpr int max_state_slots = 5;
};

struct hyper_params_without_validate {};
struct policy_without_validate : good_policy {
  using hyper_params = hyper_params_without_validate;
  static int state_slots(const hyper_params&) { return 0; }
  static scalars prepare(const hyper_params&, const distopt::step_info&) { return {0.1f}; }
};

struct storage_without_tag {
  using encoding = float;
  static constexpr bool is_sharded = false;
};
struct storage_with_int_encoding {
  using storage_concept = distopt::storage_tag;
  using encoding = int;
  static constexpr bool is_sharded = false;
};
struct storage_with_wrong_tag {
  using storage_concept = distopt::executor_tag;
  using encoding = float;
  static constexpr bool is_sharded = false;
};

/// distopt::single without all_reduce.
struct communicator_without_all_reduce {
  using communicator_concept = distopt::communicator_tag;
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_gather(std::span<const float>, std::span<float>) {}
  void reduce_scatter(std::span<const float>, std::span<float>, distopt::reduce_op) {}
  void reduce(std::span<const float>, std::span<float>, distopt::reduce_op, int) {}
  void broadcast(std::span<float>, int) {}
  std::size_t bytes_sent() const { return 0; }
};

/// distopt::single without its opt-in tag.
struct communicator_without_tag : distopt::single {
  using communicator_concept = void;
};

/// A complete executor but for parallel_for.
struct executor_without_parallel_for {
  using executor_concept = distopt::executor_tag;
  using memory_space = distopt::host_space;
  void* allocate_bytes(std::size_t) { return nullptr; }
  void deallocate_bytes(void*, std::size_t) {}
  int concurrency() const { return 1; }
};

struct executor_without_memory_space {
  using executor_concept = distopt::executor_tag;
  void* allocate_bytes(std::size_t) { return nullptr; }
  void deallocate_bytes(void*, std::size_t) {}
  template <class F>
  void parallel_for(std::size_t n, F f) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }
  int concurrency() const { return 1; }
};

// ---- optimizer_policy ----------------------------------------------------------------------

static_assert(distopt::optimizer_policy<distopt::sgd>);
static_assert(distopt::optimizer_policy<distopt::adam>);
static_assert(distopt::optimizer_policy<distopt::adamw>);
static_assert(distopt::optimizer_policy<distopt::lion>);
static_assert(distopt::optimizer_policy<good_policy>);

static_assert(!distopt::optimizer_policy<int>);
static_assert(!distopt::optimizer_policy<void>);
static_assert(!distopt::optimizer_policy<policy_without_update>);
static_assert(!distopt::policy_updates_elements<policy_without_update>);
static_assert(distopt::policy_has_hyper_params<policy_without_update>);  // only update is missing
static_assert(!distopt::optimizer_policy<policy_without_hyper_params>);
static_assert(!distopt::policy_has_hyper_params<policy_without_hyper_params>);
static_assert(!distopt::optimizer_policy<policy_with_too_many_slots>);
static_assert(!distopt::policy_declares_state<policy_with_too_many_slots>);
static_assert(!distopt::optimizer_policy<policy_without_validate>);
static_assert(!distopt::optimizer_policy<distopt::replicated<distopt::fp32>>);

// ---- state_storage -------------------------------------------------------------------------

static_assert(distopt::state_storage<distopt::replicated<distopt::fp32>>);
static_assert(distopt::state_storage<distopt::replicated<distopt::bf16>>);
static_assert(distopt::state_storage_for<distopt::replicated<distopt::fp32>, distopt::adam>);
static_assert(distopt::state_storage_for<distopt::replicated<distopt::bf16>, distopt::lion>);

static_assert(!distopt::state_storage<int>);
static_assert(!distopt::state_storage<float>);
static_assert(!distopt::state_storage<storage_without_tag>);
static_assert(!distopt::state_storage<storage_with_int_encoding>);
static_assert(!distopt::state_storage<storage_with_wrong_tag>);
static_assert(!distopt::state_storage_for<distopt::replicated<distopt::fp32>, int>);

// ---- communicator --------------------------------------------------------------------------

static_assert(distopt::communicator<distopt::single>);
static_assert(!distopt::communicator<int>);
static_assert(!distopt::communicator<communicator_without_all_reduce>);
static_assert(!distopt::communicator<communicator_without_tag>);
static_assert(!distopt::communicator<distopt::cpu>);

// ---- executor ------------------------------------------------------------------------------

static_assert(distopt::executor<distopt::cpu>);
static_assert(!distopt::executor<int>);
static_assert(!distopt::executor<executor_without_parallel_for>);
static_assert(!distopt::executor<executor_without_memory_space>);
static_assert(!distopt::executor<distopt::single>);

}  // namespace conformance

BOOST_AUTO_TEST_CASE(conformance_is_checked_at_compile_time) {
  BOOST_TEST(true);  // every check above is a static_assert
}
