// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// make_mesh (distopt/comm/mesh.hpp) on worlds of 1..8 ranks as threads, for every shape
// that divides the world (tp, etp in {1, 2, 4}, ep in {1, 2, 4, 8}): each of the five groups
// holds exactly the ranks that agree with this one on the other axes of its grid (found by
// enumerating the world here, from the rank formulas alone), ordered along its own axis,
// and is a working communicator (a sum over it). Shapes that do not divide the world, and
// expert counts that ep does not divide, are refused on every rank, naming the sizes.
//
// Rank functions only record what they see; the checks run on the main thread.

#include <boost/test/unit_test.hpp>

#include <distopt/comm/mesh.hpp>
#include <distopt/comm/threads.hpp>

#include "../support/mesh_groups.hpp"

#include <array>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using distopt::mesh_shape;
using mesh_test::expected_group;
using mesh_test::look_at;
using mesh_test::seen;

BOOST_AUTO_TEST_SUITE(mesh)

BOOST_AUTO_TEST_CASE(every_group_holds_the_ranks_its_axis_formula_names) {
  static_assert(distopt::splittable_communicator<distopt::threads>);
  int shapes = 0;
  for (int world = 1; world <= 8; ++world)
    for (int tp : {1, 2, 4})
      for (int ep : {1, 2, 4, 8})
        for (int etp : {1, 2, 4}) {
          const mesh_shape s{tp, ep, etp};
          if (world % tp != 0 || world % (ep * etp) != 0) continue;
          ++shapes;
          std::vector<std::array<seen, 5>> got(static_cast<std::size_t>(world));
          std::vector<distopt::mesh_coords> coords(got.size());
          std::vector<std::array<int, 2>> sizes(got.size());
          distopt::run_ranks(world, [&](distopt::threads& w) {
            const int r = w.rank();
            distopt::mesh<distopt::threads> m = distopt::make_mesh(w, s);
            auto& mine = got[static_cast<std::size_t>(r)];
            mine[0] = look_at(m.tp, r);
            mine[1] = look_at(m.dp, r);
            mine[2] = look_at(m.etp, r);
            mine[3] = look_at(m.ep, r);
            mine[4] = look_at(m.edp, r);
            coords[static_cast<std::size_t>(r)] = m.at;
            sizes[static_cast<std::size_t>(r)] = {m.dp_size(), m.edp_size()};
          });
          for (int r = 0; r < world; ++r) {
            const auto& c = coords[static_cast<std::size_t>(r)];
            const std::array<int, 5> index{c.tp, c.dp, c.etp, c.ep, c.edp};
            for (int axis = 0; axis < 5; ++axis) {
              BOOST_TEST_CONTEXT("world " << world << " tp " << tp << " ep " << ep << " etp " << etp << " rank " << r
                                          << " axis " << axis) {
                const seen& g = got[static_cast<std::size_t>(r)][static_cast<std::size_t>(axis)];
                const std::vector<int> want = expected_group(world, s, r, axis);
                BOOST_TEST(g.members == want, boost::test_tools::per_element());
                BOOST_TEST(g.size == static_cast<int>(want.size()));
                BOOST_TEST(g.rank == index[static_cast<std::size_t>(axis)]);
                BOOST_TEST(want[static_cast<std::size_t>(g.rank)] == r);
              }
            }
            BOOST_TEST(sizes[static_cast<std::size_t>(r)][0] == world / tp);
            BOOST_TEST(sizes[static_cast<std::size_t>(r)][1] == world / (ep * etp));
          }
        }
  BOOST_TEST(shapes == 61);
}

BOOST_AUTO_TEST_CASE(expert_tensor_parallel_groups_are_the_dense_ones_when_etp_equals_tp) {
  // 8 ranks, tp = etp = 2, ep = 2: the expert's TP group is the dense TP group, and the
  // experts' data-parallel group is half the dense one.
  std::vector<std::array<seen, 3>> got(8);
  distopt::run_ranks(8, [&](distopt::threads& w) {
    auto m = distopt::make_mesh(w, {.tp = 2, .ep = 2, .etp = 2});
    const int r = w.rank();
    got[static_cast<std::size_t>(r)] = {look_at(m.tp, r), look_at(m.etp, r), look_at(m.edp, r)};
  });
  for (int r = 0; r < 8; ++r) {
    const auto& g = got[static_cast<std::size_t>(r)];
    BOOST_TEST(g[0].members == g[1].members, boost::test_tools::per_element());
    BOOST_TEST(g[2].size == 2);
  }
}

BOOST_AUTO_TEST_CASE(experts_are_dealt_whole_in_order) {
  BOOST_TEST(distopt::experts_of(8, 4, 0).first == 0);
  BOOST_TEST(distopt::experts_of(8, 4, 3).first == 6);
  BOOST_TEST(distopt::experts_of(8, 4, 3).count == 2);
  BOOST_TEST(distopt::experts_of(8, 1, 0).count == 8);
  const auto says = [](std::string what) {
    return [what](const std::invalid_argument& e) { return std::string(e.what()).find(what) != std::string::npos; };
  };
  BOOST_CHECK_EXCEPTION(distopt::experts_of(6, 4, 0), std::invalid_argument,
                        says("6 experts do not split into ep = 4 equal parts"));
  BOOST_CHECK_EXCEPTION(distopt::experts_of(8, 4, 4), std::invalid_argument, says("index 4 is not in 0..3"));
  // A rank's experts from its mesh: 8 experts over ep = 4 of 4 ranks, one rank per slice.
  std::vector<distopt::expert_range> held(4);
  distopt::run_ranks(4, [&](distopt::threads& w) {
    auto m = distopt::make_mesh(w, {.ep = 4});
    held[static_cast<std::size_t>(w.rank())] = m.experts(8);
  });
  for (int r = 0; r < 4; ++r) {
    BOOST_TEST(held[static_cast<std::size_t>(r)].first == 2 * r);
    BOOST_TEST(held[static_cast<std::size_t>(r)].count == 2);
  }
}

BOOST_AUTO_TEST_CASE(shapes_that_do_not_divide_the_world_are_refused_on_every_rank) {
  const auto refused = [](int world, mesh_shape s, const std::string& what) {
    std::vector<std::string> msg(static_cast<std::size_t>(world));
    distopt::run_ranks(world, [&](distopt::threads& w) {
      try {
        (void)distopt::make_mesh(w, s);
      } catch (const std::invalid_argument& e) {
        msg[static_cast<std::size_t>(w.rank())] = e.what();
      }
    });
    for (const auto& m : msg) BOOST_TEST(m.find(what) != std::string::npos, "got: " << m);
  };
  refused(6, {.tp = 4}, "tp = 4 does not divide the world (world of 6 ranks");
  refused(4, {.ep = 2, .etp = 4}, "etp * ep = 8 does not divide the world");
  refused(2, {.tp = 0}, "tp, ep and etp must be at least 1");
  BOOST_CHECK_THROW(distopt::mesh_coords_of(4, 4, {}), std::invalid_argument);
}

BOOST_AUTO_TEST_SUITE_END()
