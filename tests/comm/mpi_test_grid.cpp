// Grid under MPI (run at np 2 and 4): every layout and rank order gives each rank the coordinates
// and the dp/tp/pp groups it should have, whatever the world size.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <vector>

#include "comm/grid.hpp"
#include "core/error.hpp"
#include "mpi_util.hpp"

namespace trellis {
namespace {

using trellis::testing::world_rank;
using trellis::testing::world_size;

struct Layout {
  int dp, tp, pp;
};

std::vector<Layout> layouts_of(int world) {
  std::vector<Layout> out;
  for (int dp = 1; dp <= world; ++dp)
    for (int tp = 1; tp <= world; ++tp)
      if (world % (dp * tp) == 0) out.push_back({dp, tp, world / (dp * tp)});
  return out;
}

const std::vector<std::string> kOrders = {"tp-dp-pp", "dp-tp-pp", "tp-pp-dp",
                                          "pp-dp-tp", "dp-pp-tp", "pp-tp-dp"};

/// World ranks of `comm`'s members, in the order of their rank in `comm`.
std::vector<int> members(MPI_Comm comm) {
  int n = 0, me = world_rank();
  MPI_Comm_size(comm, &n);
  std::vector<int> all(n);
  MPI_Allgather(&me, 1, MPI_INT, all.data(), 1, MPI_INT, comm);
  return all;
}

int comm_rank(MPI_Comm comm) {
  int r = -1;
  MPI_Comm_rank(comm, &r);
  return r;
}

TEST(Grid, CoordinatesAndGroupsForEveryLayoutAndOrder) {
  const int world = world_size(), me = world_rank();
  for (const Layout& l : layouts_of(world))
    for (const std::string& order : kOrders) {
      ParallelConfig p;
      p.dp = l.dp;
      p.tp = l.tp;
      p.pp = l.pp;
      p.order = order;
      SCOPED_TRACE("dp " + std::to_string(l.dp) + " tp " + std::to_string(l.tp) + " pp " +
                   std::to_string(l.pp) + " order " + order);
      Grid g(p);
      EXPECT_EQ(g.world_rank(), me);
      EXPECT_EQ(g.world_size(), world);
      EXPECT_EQ(g.dp_size(), l.dp);
      EXPECT_EQ(g.tp_size(), l.tp);
      EXPECT_EQ(g.pp_size(), l.pp);

      // Expected rank from the order, computed independently: fastest-varying first.
      auto expected_rank = [&](int dp, int pp, int tp) {
        int rank = 0, stride = 1;
        size_t pos = 0;
        while (pos <= order.size()) {
          size_t dash = order.find('-', pos);
          std::string axis = order.substr(pos, dash == std::string::npos ? std::string::npos : dash - pos);
          int coord = axis == "dp" ? dp : axis == "pp" ? pp : tp;
          int size = axis == "dp" ? l.dp : axis == "pp" ? l.pp : l.tp;
          rank += coord * stride;
          stride *= size;
          if (dash == std::string::npos) break;
          pos = dash + 1;
        }
        return rank;
      };
      EXPECT_EQ(expected_rank(g.dp_rank(), g.pp_rank(), g.tp_rank()), me);
      EXPECT_EQ(g.world_rank_of(g.dp_rank(), g.pp_rank(), g.tp_rank()), me);

      // Every rank's coordinates: unique, and what coord_of says.
      std::array<int, 3> mine = {g.dp_rank(), g.pp_rank(), g.tp_rank()};
      std::vector<int> all(3 * world);
      MPI_Allgather(mine.data(), 3, MPI_INT, all.data(), 3, MPI_INT, MPI_COMM_WORLD);
      std::set<std::array<int, 3>> seen;
      for (int r = 0; r < world; ++r) {
        std::array<int, 3> c = {all[3 * r], all[3 * r + 1], all[3 * r + 2]};
        seen.insert(c);
        EXPECT_EQ(g.coord_of(r), (GridCoord{c[0], c[1], c[2]})) << "rank " << r;
        EXPECT_EQ(g.world_rank_of(c[0], c[1], c[2]), r);
      }
      EXPECT_EQ(static_cast<int>(seen.size()), world);

      // Each communicator holds exactly the ranks that differ only along its axis, ordered by it.
      std::vector<int> want_dp, want_pp, want_tp;
      for (int d = 0; d < l.dp; ++d) want_dp.push_back(g.world_rank_of(d, g.pp_rank(), g.tp_rank()));
      for (int s = 0; s < l.pp; ++s) want_pp.push_back(g.world_rank_of(g.dp_rank(), s, g.tp_rank()));
      for (int t = 0; t < l.tp; ++t) want_tp.push_back(g.world_rank_of(g.dp_rank(), g.pp_rank(), t));
      EXPECT_EQ(members(g.dp_comm()), want_dp);
      EXPECT_EQ(members(g.pp_comm()), want_pp);
      EXPECT_EQ(members(g.tp_comm()), want_tp);
      EXPECT_EQ(comm_rank(g.dp_comm()), g.dp_rank());
      EXPECT_EQ(comm_rank(g.pp_comm()), g.pp_rank());
      EXPECT_EQ(comm_rank(g.tp_comm()), g.tp_rank());

      std::string table = g.layout_table();
      EXPECT_NE(table.find("world rank"), std::string::npos);
      EXPECT_NE(table.find(order), std::string::npos);
    }
}

TEST(Grid, DefaultOrderPutsTensorGroupsOnConsecutiveRanks) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even world size";
  ParallelConfig p;  // order tp-dp-pp
  p.tp = 2;
  p.dp = world_size() / 2;
  p.pp = 1;
  Grid g(p);
  EXPECT_EQ(g.tp_rank(), world_rank() % 2);
  EXPECT_EQ(g.dp_rank(), world_rank() / 2);
  EXPECT_EQ(members(g.tp_comm()), (std::vector<int>{world_rank() / 2 * 2, world_rank() / 2 * 2 + 1}));
}

TEST(Grid, FourRankLayoutsNamedInTheBrief) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  struct Case {
    int dp, tp, pp;
    const char* order;
    std::array<int, 3> coord_of_rank1;  // dp, pp, tp of world rank 1
  };
  for (const Case& k : {Case{4, 1, 1, "tp-dp-pp", {1, 0, 0}}, Case{2, 2, 1, "tp-dp-pp", {0, 0, 1}},
                        Case{2, 2, 1, "dp-tp-pp", {1, 0, 0}}, Case{1, 2, 2, "tp-dp-pp", {0, 0, 1}},
                        Case{1, 2, 2, "pp-tp-dp", {0, 1, 0}}, Case{2, 1, 2, "tp-dp-pp", {1, 0, 0}},
                        Case{2, 1, 2, "pp-dp-tp", {0, 1, 0}}}) {
    ParallelConfig p;
    p.dp = k.dp;
    p.tp = k.tp;
    p.pp = k.pp;
    p.order = k.order;
    Grid g(p);
    GridCoord c = g.coord_of(1);
    EXPECT_EQ((std::array<int, 3>{c.dp, c.pp, c.tp}), k.coord_of_rank1)
        << k.dp << "x" << k.tp << "x" << k.pp << " " << k.order;
  }
}

TEST(Grid, RejectsBadOrderNamingTheKey) {
  for (const char* bad : {"", "tp-dp", "tp-dp-pp-", "tp-tp-pp", "tp-dp-xx", "tp,dp,pp", "-tp-dp"}) {
    ParallelConfig p;
    p.dp = world_size();
    p.order = bad;
    try {
      Grid g(p);
      ADD_FAILURE() << "order '" << bad << "' accepted";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.order"), std::string::npos) << e.what();
    }
  }
}

TEST(Grid, LayoutTableListsEveryRank) {
  ParallelConfig p;
  p.dp = world_size();
  Grid g(p);
  std::string t = g.layout_table();
  for (int r = 0; r < world_size(); ++r)
    EXPECT_NE(t.find("│ " + std::to_string(r) + " "), std::string::npos) << t;
  EXPECT_EQ(t.find("…"), std::string::npos);
}

}  // namespace
}  // namespace trellis
