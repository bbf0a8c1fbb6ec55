// The process grid: the world's ranks laid out as dp × pp × tp, one communicator per group.
//
// `parallel.order` names the groups from fastest-varying to slowest ("tp-dp-pp", the default:
// ranks 0..tp-1 form the first tensor group, then the next dp index, and pp varies slowest).
// With order (a, b, c) a rank's world rank is  coord[a] + size[a] * (coord[b] + size[b] * coord[c]).
// Inside each group communicator the rank equals the coordinate along that group
// (dp_comm's rank == dp_rank(), and so on).
#pragma once
#include <mpi.h>

#include <array>
#include <string>

#include "config/config.hpp"

namespace trellis {

/// The three kinds of group, in the order of GridCoord's fields.
enum class GridAxis : int { dp = 0, pp = 1, tp = 2 };

struct GridCoord {
  int dp = 0, pp = 0, tp = 0;
  bool operator==(const GridCoord&) const = default;
};

/// Parses "tp-dp-pp" (fastest-varying first). Throws UserError naming parallel.order when the text
/// is not a permutation of tp, dp and pp separated by '-'.
std::array<GridAxis, 3> parse_grid_order(const std::string& order);

class Grid {
 public:
  /// Collective over `world` (MPI_Comm_split three times). p.dp * p.tp * p.pp must equal the size
  /// of `world` (config validation guarantees it; a mismatch here is a logic_error).
  explicit Grid(const ParallelConfig& p, MPI_Comm world = MPI_COMM_WORLD);
  ~Grid();  // frees the three communicators (unless MPI is already finalised)
  Grid(const Grid&) = delete;
  Grid& operator=(const Grid&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  int dp_rank() const { return me_.dp; }
  int pp_rank() const { return me_.pp; }
  int tp_rank() const { return me_.tp; }
  int dp_size() const { return size_.dp; }
  int pp_size() const { return size_.pp; }
  int tp_size() const { return size_.tp; }

  MPI_Comm dp_comm() const { return dp_comm_; }
  MPI_Comm pp_comm() const { return pp_comm_; }
  MPI_Comm tp_comm() const { return tp_comm_; }

  /// The order as given ("tp-dp-pp") and parsed, fastest-varying first.
  const std::string& order() const { return order_text_; }

  /// World rank at coordinates (dp, pp, tp); each must be in range (logic_error otherwise).
  int world_rank_of(int dp, int pp, int tp) const;
  /// Coordinates of a world rank in [0, world_size).
  GridCoord coord_of(int world_rank) const;

  /// Boxed table "world rank | dp | pp | tp" for every rank (the first 64 and a "…" row beyond).
  std::string layout_table() const;

 private:
  int world_rank_ = 0, world_size_ = 1;
  std::string order_text_;
  std::array<GridAxis, 3> order_{};
  GridCoord size_{1, 1, 1};
  GridCoord me_{};
  MPI_Comm dp_comm_ = MPI_COMM_NULL, pp_comm_ = MPI_COMM_NULL, tp_comm_ = MPI_COMM_NULL;
};

}  // namespace trellis
