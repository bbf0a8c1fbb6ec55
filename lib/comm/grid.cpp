#include "comm/grid.hpp"

#include <sstream>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis {

namespace {

int& field(GridCoord& c, GridAxis a) {
  switch (a) {
    case GridAxis::dp: return c.dp;
    case GridAxis::pp: return c.pp;
    case GridAxis::tp: return c.tp;
  }
  return c.dp;
}
int field(const GridCoord& c, GridAxis a) { return field(const_cast<GridCoord&>(c), a); }

MPI_Comm split(MPI_Comm world, int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  int rc = MPI_Comm_split(world, color, key, &out);
  TRELLIS_CHECK(rc == MPI_SUCCESS, "MPI_Comm_split failed (%d)", rc);
  return out;
}

}  // namespace

std::array<GridAxis, 3> parse_grid_order(const std::string& order) {
  std::vector<std::string> parts;
  std::stringstream ss(order);
  for (std::string p; std::getline(ss, p, '-');) parts.push_back(p);
  std::array<GridAxis, 3> axes{};
  bool seen[3] = {false, false, false};
  bool ok = !order.empty() && order.back() != '-' && parts.size() == 3;
  for (size_t i = 0; ok && i < 3; ++i) {
    GridAxis a;
    if (parts[i] == "dp") a = GridAxis::dp;
    else if (parts[i] == "pp") a = GridAxis::pp;
    else if (parts[i] == "tp") a = GridAxis::tp;
    else { ok = false; break; }
    if (seen[static_cast<int>(a)]) { ok = false; break; }
    seen[static_cast<int>(a)] = true;
    axes[i] = a;
  }
  if (!ok)
    throw UserError("parallel.order = '" + order +
                    "': expected tp, dp and pp once each, separated by '-', fastest-varying "
                    "first (e.g. tp-dp-pp)");
  return axes;
}

Grid::Grid(const ParallelConfig& p, MPI_Comm world) : order_text_(p.order) {
  order_ = parse_grid_order(p.order);
  MPI_Comm_rank(world, &world_rank_);
  MPI_Comm_size(world, &world_size_);
  TRELLIS_CHECK(p.dp >= 1 && p.tp >= 1 && p.pp >= 1, "grid sizes dp=%d tp=%d pp=%d", p.dp, p.tp,
                p.pp);
  TRELLIS_CHECK(static_cast<long>(p.dp) * p.tp * p.pp == world_size_,
                "dp=%d * tp=%d * pp=%d != world size %d", p.dp, p.tp, p.pp, world_size_);
  size_ = GridCoord{p.dp, p.pp, p.tp};
  me_ = coord_of(world_rank_);
  // Color: the coordinates along the other two axes; key: the coordinate along this one.
  dp_comm_ = split(world, me_.pp * size_.tp + me_.tp, me_.dp);
  pp_comm_ = split(world, me_.dp * size_.tp + me_.tp, me_.pp);
  tp_comm_ = split(world, me_.dp * size_.pp + me_.pp, me_.tp);
}

Grid::~Grid() {
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (finalised) return;
  for (MPI_Comm* c : {&dp_comm_, &pp_comm_, &tp_comm_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

int Grid::world_rank_of(int dp, int pp, int tp) const {
  TRELLIS_CHECK(dp >= 0 && dp < size_.dp && pp >= 0 && pp < size_.pp && tp >= 0 && tp < size_.tp,
                "grid coordinate (dp=%d, pp=%d, tp=%d) outside %d x %d x %d", dp, pp, tp, size_.dp,
                size_.pp, size_.tp);
  GridCoord c{dp, pp, tp};
  int rank = 0;
  for (int i = 2; i >= 0; --i) rank = rank * field(size_, order_[i]) + field(c, order_[i]);
  return rank;
}

GridCoord Grid::coord_of(int world_rank) const {
  TRELLIS_CHECK(world_rank >= 0 && world_rank < world_size_, "world rank %d outside [0, %d)",
                world_rank, world_size_);
  GridCoord c;
  int r = world_rank;
  for (int i = 0; i < 3; ++i) {
    int n = field(size_, order_[i]);
    field(c, order_[i]) = r % n;
    r /= n;
  }
  return c;
}

std::string Grid::layout_table() const {
  constexpr int kMaxRows = 64;
  std::vector<std::vector<std::string>> rows;
  for (int r = 0; r < world_size_ && r < kMaxRows; ++r) {
    GridCoord c = coord_of(r);
    rows.push_back({std::to_string(r), std::to_string(c.dp), std::to_string(c.pp),
                    std::to_string(c.tp)});
  }
  if (world_size_ > kMaxRows) rows.push_back({"…", "…", "…", "…"});
  std::string title = strfmt("grid dp %d, pp %d, tp %d; order %s", size_.dp, size_.pp, size_.tp,
                             order_text_.c_str());
  return format_table(title, {"world rank", "dp", "pp", "tp"}, rows);
}

}  // namespace trellis
