// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// GaLore-AdamW inside the optimizer: the projected matrices under data parallelism
// (bit-identical params, element states and low-rank states for d = 1..8 and thread
// counts, across projection refreshes), the communication it adds, the memory report and
// the refusals.
#include <boost/test/unit_test.hpp>

#include <distopt/distopt.hpp>
#include <distopt/policy/galore_adamw.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "galore_cases.hpp"
#include "muon_cases.hpp"
#include "sharded_harness.hpp"

using namespace distopt;

namespace {

/// Matrices in the GaLore group (1), biases and a vector in the plain group (0); tensors
/// straddle shard cuts, and with `bucket` small there are several buckets.
layout make_layout(dtype t) { return harness::matrices_and_vectors(t); }

struct result {
  harness::outcome out;
  std::vector<std::vector<float>> projected;  // [matrix * 2 + slot]
  std::size_t bytes_sent = 0;                  // rank 0's
  bool operator==(const result& o) const { return out == o.out && projected == o.projected; }
};

template <class Opt>
void collect_projected(Opt& opt, result& r) {
  for (const char* name : {"w0", "w1", "w2", "w3"})
    for (int k = 0; k < 2; ++k) {
      const auto s = opt.projected_state(name, k);
      r.projected.emplace_back(s.begin(), s.end());
    }
}

template <class Prec, class Enc = fp32>
result run_single(galore_proj type, int threads, std::size_t min_8bit_size = 4096) {
  const layout l = make_layout(dtype_of<typename Prec::param_type>);
  optimizer_options o;
  o.min_8bit_size = min_8bit_size;
  optimizer<galore_adamw, replicated<Enc>, single, cpu, Prec> opt(l, harness::galore_groups(type), o, cpu(threads));
  result r;
  r.out = harness::blank<decltype(opt)>(l, 2);
  harness::run_options ro;
  harness::drive(opt, 0, ro, &r.out);
  harness::collect(opt, 0, r.out);
  collect_projected(opt, r);
  return r;
}

template <class Prec, class Enc = fp32>
result run_ranks_(int d, galore_proj type, std::size_t bucket, std::size_t min_8bit_size = 4096) {
  using opt_t = optimizer<galore_adamw, sharded<Enc>, threads, cpu, Prec>;
  const layout l = make_layout(dtype_of<typename Prec::param_type>);
  result r;
  r.out = harness::blank<opt_t>(l, 2);
  optimizer_options o;
  o.grad_reduce = reduce_op::sum;
  o.bucket_elems = bucket;
  o.min_8bit_size = min_8bit_size;
  std::vector<result> per(static_cast<std::size_t>(d));
  run_ranks(d, [&](threads& comm) {
    const int rank = comm.rank();
    opt_t opt(l, harness::galore_groups(type), o, cpu(1), std::move(comm));
    harness::run_options ro;
    harness::drive(opt, rank, ro, rank == 0 ? &r.out : nullptr);
    harness::collect(opt, rank, r.out);
    // Every rank holding part of a matrix keeps its low-rank states: rank 0 holds w0.
    if (rank == 0) {
      for (const char* name : {"w0", "w1", "w2", "w3"})
        for (int k = 0; k < 2; ++k) {
          const auto s = opt.projected_state(name, k);
          per[0].projected.emplace_back(s.begin(), s.end());
        }
      per[0].bytes_sent = opt.communicator().bytes_sent();
    }
  });
  r.bytes_sent = per[0].bytes_sent;
  r.projected = per[0].projected;
  return r;
}

}  // namespace

BOOST_AUTO_TEST_CASE(bit_identical_for_d_1_to_8_across_refreshes) {
  for (const galore_proj type : {galore_proj::std_, galore_proj::reverse_std, galore_proj::full}) {
    const result one = run_single<precision<float>>(type, 1);
    BOOST_TEST((run_single<precision<float>>(type, 3) == one), "3 threads");
    for (int d = 1; d <= 8; ++d) {
      const result r = run_ranks_<precision<float>>(d, type, std::size_t{1} << 22);
      BOOST_TEST((r.out == one.out), "params/states, d = " << d << ", proj " << galore_proj_name(type));
    }
    // Several buckets (a matrix per bucket): the rank holding each matrix has the same
    // low-rank states as the single rank.
    const result b = run_ranks_<precision<float>>(3, type, 512);
    BOOST_TEST((b.out == one.out), "buckets");
  }
  // bf16 params with fp32 master weights.
  const result one = run_single<precision<bf16>>(galore_proj::std_, 1);
  for (int d : {2, 5, 8})
    BOOST_TEST((run_ranks_<precision<bf16>>(d, galore_proj::std_, std::size_t{1} << 22).out == one.out), "bf16, d = " << d);
}

BOOST_AUTO_TEST_CASE(q8_states_low_rank_and_elementwise) {
  // 8-bit GaLore: with min_8bit_size 100 the low-rank states of w0 (160), w1 (132) and
  // w2 (256) and the element states of norm (700) are 8-bit, w3's (36) and b0's fp32.
  const result one = run_single<precision<float>, q8>(galore_proj::std_, 1, 100);
  BOOST_TEST((run_single<precision<float>, q8>(galore_proj::std_, 3, 100) == one), "3 threads");
  for (int d : {1, 2, 3, 5, 8})
    BOOST_TEST((run_ranks_<precision<float>, q8>(d, galore_proj::std_, std::size_t{1} << 22, 100).out == one.out),
               "d = " << d);
  // Quantized: the low-rank states differ from the fp32 run's, by a few percent.
  const result f = run_single<precision<float>>(galore_proj::std_, 1);
  double diff = 0, norm = 0;
  for (std::size_t e = 0; e < f.projected[0].size(); ++e) {
    diff += std::abs(double(f.projected[0][e]) - one.projected[0][e]);
    norm += std::abs(double(f.projected[0][e]));
  }
  BOOST_TEST(diff > 0.0);
  BOOST_TEST(diff < 0.1 * norm);
  // w3's low-rank states (36 < 100 elements) stay fp32, and the test's gradients do not
  // depend on the params: they equal the fp32 run's bit for bit.
  BOOST_TEST(f.projected[6] == one.projected[6]);
  BOOST_TEST(f.projected[7] == one.projected[7]);
  layout l = make_layout(dtype::f32);
  optimizer_options o;
  o.min_8bit_size = 100;
  optimizer<galore_adamw, replicated<q8>> opt(l, harness::galore_groups(galore_proj::std_), o);
  // codes + absmax of w0, w1, w2 (2 slots) plus fp32 states of w3.
  const std::size_t q = 2 * ((160 + 132 + 256) + 4 * (1 + 1 + 1)) + 2 * 36 * 4;
  BOOST_TEST(opt.memory().bytes("state projected") == q);
  BOOST_TEST(opt.state_is_quantized("norm"));
  BOOST_TEST(!opt.state_is_quantized("b0"));
}

BOOST_AUTO_TEST_CASE(low_rank_states_move_and_match_single_rank) {
  const result one = run_single<precision<float>>(galore_proj::std_, 1);
  const result d4 = run_ranks_<precision<float>>(4, galore_proj::std_, std::size_t{1} << 22);
  // Rank 0 holds w0 (the first 1200 elements) at d = 4: its low-rank states are the same.
  BOOST_TEST(d4.projected[0] == one.projected[0]);
  BOOST_TEST(d4.projected[1] == one.projected[1]);
  double moved = 0;
  for (float v : one.projected[1]) moved += v;
  BOOST_TEST(moved > 0.0);
  // The projected states are [40, 30] -> std projects onto the right: 40 x 4.
  BOOST_TEST(one.projected[0].size() == 160u);
  BOOST_TEST(one.projected[6].size() == 36u);  // w3 [9, 9]: 9 x 4
}

BOOST_AUTO_TEST_CASE(communication_adds_the_gathered_grads_of_projected_buckets) {
  // With the matrices in a plain group (no rank) the step is ZeRO's; with a rank each
  // bucket holding a projected matrix also all-gathers its reduced grads: (d - 1) shards.
  for (int d : {2, 3, 4}) {
    const layout l = make_layout(dtype::f32);
    using opt_t = optimizer<galore_adamw, sharded<fp32>, threads>;
    auto plain = harness::galore_groups(galore_proj::std_);
    plain[1].rank.reset();
    const std::size_t sent = harness::three_steps_sent<opt_t>(l, harness::galore_groups(galore_proj::std_), d);
    // Expected: per step, for each bucket holding a matrix, (d - 1) * shard * 4 bytes.
    const std::size_t extra = harness::gathered_bucket_bytes(l, d, [](const auto& t) { return t.shape.size() == 2; });
    BOOST_TEST(sent - harness::three_steps_sent<opt_t>(l, plain, d) == 3 * extra, "d = " << d);
  }
}

BOOST_AUTO_TEST_CASE(memory_report_counts_low_rank_states_not_full_ones) {
  const layout l = make_layout(dtype::f32);
  optimizer<galore_adamw> opt(l, harness::galore_groups(galore_proj::std_));
  const memory_report m = opt.memory();
  // Element states only for b0 (30) and norm (700); low-rank states 2 x (40*4 + 4*33 + 4*64 + 9*4).
  BOOST_TEST(m.bytes("state 0") == 730u * 4u);
  BOOST_TEST(m.bytes("state projected") == 2u * (160u + 132u + 256u + 36u) * 4u);
  BOOST_TEST(opt.local_state("w0", 0).values.empty());
  BOOST_TEST(opt.local_state("norm", 1).values.size() == 700u);
  // After a step, state() reads the compact buffers: the plain AdamW moments of b0.
  for (auto& g : opt.grad("b0")) g = 0.5f;
  opt.step();
  BOOST_TEST(opt.state("b0", 0).size() == 30u);
  BOOST_TEST(opt.state("b0", 0)[7] == 0.05f, boost::test_tools::tolerance(1e-6f));  // (1 - 0.9) * 0.5
  BOOST_TEST(opt.state("w0", 0).empty());
}

BOOST_AUTO_TEST_CASE(refusals) {
  auto h = harness::galore_groups(galore_proj::std_);
  layout vec;
  vec.add("v", {100}, dtype::f32, 1);
  BOOST_CHECK_EXCEPTION((optimizer<galore_adamw>(vec, h)), std::invalid_argument, [](const std::invalid_argument& e) {
    return std::string(e.what()).find("'v' is 1-D, in a group with a rank") != std::string::npos;
  });
  layout small;
  small.add("w", {3, 20}, dtype::f32, 1);
  BOOST_CHECK_THROW((optimizer<galore_adamw>(small, h)), std::invalid_argument);  // rank 4 > 3
  layout tp;
  tp.add("w", {16, 16}, dtype::f32, 1, tp_split::rows);
  BOOST_CHECK_EXCEPTION((optimizer<galore_adamw>(tp, h)), std::invalid_argument, [](const std::invalid_argument& e) {
    return std::string(e.what()).find("tensor-parallel") != std::string::npos;
  });
}
