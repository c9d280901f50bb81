// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// `owned` placement: the plan's owners against a brute-force optimum, Muon and GaLore on
// owned storage bit-identical to one rank for d = 1..8 and thread counts, the bytes each
// step sends against the model, and the memory the owners alone hold.
#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>
#include <distopt/policy/galore_adamw.hpp>
#include <distopt/policy/muon.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "galore_cases.hpp"
#include "muon_cases.hpp"
#include "sharded_harness.hpp"

using namespace distopt;
using distopt::detail::shard_plan;

namespace {

/// Matrices of uneven cost in group 1 (Muon / GaLore), vectors in group 0. Costs
/// m n min(m, n): w0 36000, w1 9537, w2 16384, w3 729, w4 4900000 (at d >= 2 it owns a
/// rank alone), w5 2880.
layout uneven_layout(dtype t = dtype::f32) {
  layout l = harness::matrices_and_vectors(t);
  l.add("w4", {140, 250}, t, 1);
  l.add("b4", {250}, t, 0);
  l.add("w5", {12, 20}, t, 1);
  return l;
}

std::vector<char> matrices_of_group_1(const layout& l) {
  std::vector<char> owned;
  for (const auto& t : l.tensors()) owned.push_back(t.group == 1 && t.shape.size() == 2);
  return owned;
}

/// The least largest run cost over every split of `cost` into at most d consecutive runs
/// (dynamic programming, independent of the plan's bisection).
std::uint64_t best_cap(const std::vector<std::uint64_t>& cost, int d) {
  const std::size_t n = cost.size();
  constexpr std::uint64_t inf = std::numeric_limits<std::uint64_t>::max();
  // best[k][i]: the first i items in at most k runs.
  std::vector<std::vector<std::uint64_t>> best(static_cast<std::size_t>(d) + 1, std::vector<std::uint64_t>(n + 1, inf));
  for (std::size_t k = 0; k <= static_cast<std::size_t>(d); ++k) best[k][0] = 0;
  for (std::size_t k = 1; k <= static_cast<std::size_t>(d); ++k)
    for (std::size_t i = 1; i <= n; ++i) {
      std::uint64_t run = 0;
      for (std::size_t j = i; j-- > 0;) {  // the last run is [j, i)
        run += cost[j];
        if (best[k - 1][j] != inf) best[k][i] = std::min(best[k][i], std::max(best[k - 1][j], run));
      }
    }
  return best[static_cast<std::size_t>(d)][n];
}

/// Every rank's bytes sent by three steps of Opt on d ranks as threads (buckets of 512
/// elements, no finite check).
template <class Opt>
std::vector<std::size_t> three_steps_sent(const layout& l, const std::vector<typename Opt::hyper_params>& h, int d) {
  optimizer_options o;
  o.check_finite = false;
  o.bucket_elems = 512;
  std::vector<std::size_t> sent(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    Opt opt(l, h, o, cpu(1), std::move(comm));
    const std::size_t made = opt.communicator().bytes_sent();  // the constructor's layout check
    for (int s = 0; s < 3; ++s) {
      for (const auto& t : opt.tensors().tensors())
        for (auto& g : opt.grad(t.name)) g = rank == 0 ? 0.01f : 0.0f;
      opt.step();
    }
    sent[static_cast<std::size_t>(rank)] = opt.communicator().bytes_sent() - made;
  });
  return sent;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(owned_placement)

BOOST_AUTO_TEST_CASE(owners_are_consecutive_balanced_and_cover_every_matrix_once) {
  const layout l = uneven_layout();
  const auto owned = matrices_of_group_1(l);
  std::vector<std::uint64_t> cost;
  for (std::size_t i = 0; i < owned.size(); ++i)
    if (owned[i]) cost.push_back(shard_plan::owned_cost(l.tensors()[i]));
  BOOST_TEST(cost.front() == 36000u);  // 40 x 30 x 30
  for (int d = 1; d <= 8; ++d) {
    const std::vector<int> owner = shard_plan::assign_owners(l, d, owned);
    std::vector<std::uint64_t> load(static_cast<std::size_t>(d), 0);
    int last = 0;
    for (std::size_t i = 0; i < owner.size(); ++i) {
      if (!owned[i]) {
        BOOST_TEST(owner[i] == -1);
        continue;
      }
      BOOST_TEST_REQUIRE(owner[i] >= last, "owners never decrease along the layout");
      BOOST_TEST_REQUIRE(owner[i] < d);
      last = owner[i];
      load[static_cast<std::size_t>(owner[i])] += shard_plan::owned_cost(l.tensors()[i]);
    }
    BOOST_TEST(*std::max_element(load.begin(), load.end()) == best_cap(cost, d), "d = " << d);
    // Every rank's plan: owned tensors whole on their owner, nothing of them elsewhere; all
    // elements held exactly once.
    std::size_t held = 0;
    for (int r = 0; r < d; ++r) {
      const shard_plan p(l, d, r, 512, 1u << 14, owned);
      held += p.local_numel();
      for (std::size_t i = 0; i < owner.size(); ++i) {
        BOOST_TEST(p.owner(i) == owner[i]);
        if (!owned[i]) continue;
        BOOST_TEST(!p.straddles(i));
        BOOST_TEST(p.local_count(i) == (owner[i] == r ? l.tensors()[i].numel : 0u), "d = " << d << " rank " << r << " tensor " << i);
      }
      for (const auto& b : p.buckets()) {
        bool any = false, all = true;
        for (std::size_t i = b.first_tensor; i < b.end_tensor; ++i) {
          any = any || owned[i];
          all = all && owned[i];
        }
        BOOST_TEST((any == all), "a bucket holds owned and cut tensors together");
        BOOST_TEST(b.owned() == all);
        if (b.owned()) BOOST_TEST(b.padded() == b.layout_end - b.layout_begin, "owned buckets are not padded");
      }
    }
    BOOST_TEST(held == l.numel(), "d = " << d);
  }
  // Without owned tensors the plan is sharded's.
  const shard_plan flat(l, 3, 1, 512, 1u << 14), none(l, 3, 1, 512, 1u << 14, std::vector<char>(l.tensors().size(), 0));
  BOOST_TEST(flat.buckets().size() == none.buckets().size());
  BOOST_TEST(flat.local_numel() == none.local_numel());
  BOOST_TEST(none.owner(0) == -1);
}

BOOST_AUTO_TEST_CASE(owners_of_equal_matrices_take_equal_shares) {
  layout l;
  for (int i = 0; i < 12; ++i) l.add(std::string("w").append(std::to_string(i)), {32, 32}, dtype::f32, 1);
  const auto owned = matrices_of_group_1(l);
  for (int d : {2, 3, 4, 6, 12}) {
    const auto owner = shard_plan::assign_owners(l, d, owned);
    std::vector<int> count(static_cast<std::size_t>(d), 0);
    for (int o : owner) ++count[static_cast<std::size_t>(o)];
    for (int c : count) BOOST_TEST(c == 12 / d, "d = " << d);
  }
  // More ranks than matrices: some own nothing, none owns two.
  const auto owner = shard_plan::assign_owners(l, 16, owned);
  for (std::size_t i = 0; i < owner.size(); ++i) BOOST_TEST(owner[i] == static_cast<int>(i));
}

BOOST_AUTO_TEST_CASE(muon_bit_identical_for_d_1_to_8_and_threads) {
  const layout l = uneven_layout();
  for (const auto adjust : {muon_adjust_lr::original, muon_adjust_lr::match_rms_adamw}) {
    const auto h = harness::muon_groups(true, adjust);
    harness::run_options ro;
    ro.steps = 100;
    const harness::outcome one = harness::run_single<muon, fp32, precision<float>>(l, h, ro);
    harness::run_options three = ro;
    three.threads = 3;
    BOOST_TEST((harness::run_single<muon, fp32, precision<float>>(l, h, three) == one), "3 threads");
    for (int d = 1; d <= 8; ++d)
      BOOST_TEST((harness::run_threads<muon, owned<fp32>, precision<float>>(d, l, h, ro) == one), "d = " << d);
    three.options.bucket_elems = 512;  // several buckets, owned and cut ones
    BOOST_TEST((harness::run_threads<muon, owned<fp32>, precision<float>>(3, l, h, three) == one), "d = 3, 3 threads");
  }
  // bf16 params with fp32 master weights, bf16 states, bf16 grads reduced in fp32.
  const auto h = harness::muon_groups();
  harness::run_options ro;
  const harness::outcome one = harness::run_single<muon, fp32, precision<bf16>>(uneven_layout(dtype::bf16), h, ro);
  for (int d : {2, 5})
    BOOST_TEST((harness::run_threads<muon, owned<fp32>, precision<bf16>>(d, uneven_layout(dtype::bf16), h, ro) == one),
               "bf16 params, d = " << d);
  const harness::outcome s16 = harness::run_single<muon, bf16, precision<float>>(l, h, ro);
  for (int d : {3, 7})
    BOOST_TEST((harness::run_threads<muon, owned<bf16>, precision<float>>(d, l, h, ro) == s16), "bf16 states, d = " << d);
  harness::run_options wide;
  wide.options.grad_reduce_in_fp32 = true;
  const harness::outcome g16 = harness::run_single<muon, fp32, precision<bf16, bf16>>(uneven_layout(dtype::bf16), h, wide);
  for (int d : {2, 4})
    BOOST_TEST((harness::run_threads<muon, owned<fp32>, precision<bf16, bf16>>(d, uneven_layout(dtype::bf16), h, wide) == g16),
               "fp32 reduce, d = " << d);
}

BOOST_AUTO_TEST_CASE(galore_bit_identical_for_d_1_to_8_and_one_svd_per_matrix) {
  const layout l = uneven_layout();
  const auto h = harness::galore_groups();
  harness::run_options ro;
  ro.steps = 100;  // 20 refreshes
  const harness::outcome one = harness::run_single<galore_adamw, fp32, precision<float>>(l, h, ro);
  for (int d = 1; d <= 8; ++d)
    BOOST_TEST((harness::run_threads<galore_adamw, owned<fp32>, precision<float>>(d, l, h, ro) == one), "d = " << d);
  harness::run_options three = ro;
  three.threads = 3;
  three.options.bucket_elems = 512;
  BOOST_TEST((harness::run_single<galore_adamw, fp32, precision<float>>(l, h, three) == one), "3 threads");
  BOOST_TEST((harness::run_threads<galore_adamw, owned<fp32>, precision<float>>(3, l, h, three) == one), "d = 3, 3 threads");
  harness::run_options q = ro;
  q.options.min_8bit_size = 100;
  const harness::outcome q8one = harness::run_single<galore_adamw, q8, precision<float>>(l, h, q);
  for (int d : {2, 5})
    BOOST_TEST((harness::run_threads<galore_adamw, owned<q8>, precision<float>>(d, l, h, q) == q8one), "q8, d = " << d);
  // The low-rank states and projections live on the owner alone: summed over the ranks they
  // are one copy per matrix (sharded keeps one per rank holding part of a matrix).
  for (const int d : {3, 4}) {
    std::vector<std::size_t> owned_bytes(static_cast<std::size_t>(d)), sharded_bytes(owned_bytes.size());
    const auto run = [&]<class Storage>(std::vector<std::size_t>& bytes) {
      run_ranks(d, [&](threads& comm) {
        const int rank = comm.rank();
        optimizer_options o;
        o.grad_reduce = reduce_op::sum;
        optimizer<galore_adamw, Storage, threads> opt(l, h, o, cpu(1), std::move(comm));
        harness::drive(opt, rank, {}, nullptr);
        const memory_report m = opt.memory();
        bytes[static_cast<std::size_t>(rank)] = m.bytes("state projected") + m.bytes("projections");
      });
    };
    run.template operator()<owned<fp32>>(owned_bytes);
    run.template operator()<sharded<fp32>>(sharded_bytes);
    optimizer<galore_adamw> single_rank(l, h);
    harness::drive(single_rank, 0, {}, nullptr);
    const memory_report m1 = single_rank.memory();
    std::size_t total = 0, total_sharded = 0;
    for (std::size_t r = 0; r < owned_bytes.size(); ++r) {
      total += owned_bytes[r];
      total_sharded += sharded_bytes[r];
    }
    BOOST_TEST(total == m1.bytes("state projected") + m1.bytes("projections"), "d = " << d);
    BOOST_TEST(total_sharded > total, "d = " << d << ": sharded holds matrices on several ranks");
  }
}

BOOST_AUTO_TEST_CASE(bytes_of_the_owned_step_match_the_model) {
  // Per step: a cut bucket reduce-scatters the grads and all-gathers the params,
  // (d - 1) shards of 4 bytes each way; an owned bucket reduces each owner's run to it
  // (every other rank sends the run: 4 bytes an element) and the owner broadcasts it
  // (4 bytes an element, from the owner). Muon adds nothing else on owned buckets.
  const layout l = uneven_layout();
  const auto h = harness::muon_groups();
  for (int d : {2, 3, 4, 8}) {
    const auto sent = three_steps_sent<optimizer<muon, owned<fp32>, threads>>(l, h, d);
    const auto sent_sharded = three_steps_sent<optimizer<muon, sharded<fp32>, threads>>(l, h, d);
    std::size_t total = 0, total_sharded = 0;
    for (int r = 0; r < d; ++r) {
      const shard_plan p(l, d, r, 512, 1u << 14, matrices_of_group_1(l));
      std::size_t model = 0;
      for (const auto& b : p.buckets()) {
        if (!b.owned()) {
          model += 2 * static_cast<std::size_t>(d - 1) * b.shard_elems * 4;
          continue;
        }
        for (int q = 0; q < d; ++q)
          model += b.shard_size(static_cast<std::size_t>(q)) * 4;  // reduce to q (sent unless r == q) or broadcast from r == q
      }
      BOOST_TEST(sent[static_cast<std::size_t>(r)] == 3 * model, "d = " << d << " rank " << r << ": " << sent[static_cast<std::size_t>(r)] << " vs " << 3 * model);
      total += sent[static_cast<std::size_t>(r)];
      total_sharded += sent_sharded[static_cast<std::size_t>(r)];
    }
    // Over all ranks, owned sends less than sharded (which also all-gathers the Muon stage).
    BOOST_TEST(total < total_sharded, "d = " << d);
  }
}

BOOST_AUTO_TEST_CASE(momentum_and_stage_live_on_the_owner) {
  // The momentum of the matrices a rank owns, and a stage of its own run of matrices in
  // one bucket (none on a rank that owns nothing): the default bucket and buckets of 512.
  const layout l = uneven_layout();
  const auto whole = matrices_of_group_1(l);
  for (const std::size_t bucket : {optimizer_options{}.bucket_elems, std::size_t{512}})
    for (int d : {2, 5, 8}) {
      const auto owner = shard_plan::assign_owners(l, d, whole);
      std::vector<std::size_t> momentum(static_cast<std::size_t>(d)), stage(momentum.size());
      run_ranks(d, [&](threads& comm) {
        const int rank = comm.rank();
        optimizer_options o;
        o.bucket_elems = bucket;
        optimizer<muon, owned<fp32>, threads> opt(l, harness::muon_groups(), o, cpu(1), std::move(comm));
        momentum[static_cast<std::size_t>(rank)] = opt.memory().bytes("state momentum");
        stage[static_cast<std::size_t>(rank)] = opt.memory().bytes("orthogonalization stage");
      });
      for (int r = 0; r < d; ++r) {
        std::size_t expected = 0, run = 0;
        for (std::size_t i = 0; i < owner.size(); ++i)
          if (owner[i] == r) expected += l.tensors()[i].numel * 4;
        const shard_plan plan(l, d, r, bucket, 1u << 14, whole);
        for (const auto& b : plan.buckets())
          if (b.owned()) run = std::max(run, b.shard_size(static_cast<std::size_t>(r)) * 4);
        BOOST_TEST(momentum[static_cast<std::size_t>(r)] == expected, "d = " << d << " rank " << r);
        BOOST_TEST(stage[static_cast<std::size_t>(r)] == run, "d = " << d << " rank " << r);
        if (expected == 0) BOOST_TEST(run == 0u);
      }
    }
}

BOOST_AUTO_TEST_SUITE_END()
