// The end-of-run tables reduce over the ranks: each row's share is of the ranks' average total,
// so the total row reads 100 % whatever the rank printing it spent.
#include <gtest/gtest.h>
#include <mpi.h>

#include <sstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/timer.hpp"
#include "mpi_util.hpp"
#include "train/report.hpp"

using namespace trellis;

namespace {

// The cells of the table row whose first cell is `name` (empty when there is none).
std::vector<std::string> row_cells(const std::string& table, const std::string& name) {
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> cells;
    std::string cell;
    for (size_t i = 0; i < line.size();) {
      if (line.compare(i, 3, "│") == 0) {  // the column rule (3 bytes in UTF-8)
        cells.push_back(cell);
        cell.clear();
        i += 3;
        continue;
      }
      if (line[i] != ' ') cell += line[i];
      ++i;
    }
    if (cells.size() > 1 && cells[1] == name) return {cells.begin() + 1, cells.end()};
  }
  return {};
}

}  // namespace

TEST(Report, TimeSharesAreOfTheAverageTotal) {
  const int rank = trellis::testing::world_rank(), n = trellis::testing::world_size();
  // Rank r: compute r + 1 s of a total 2(r + 1) s; the average total is n + 1.
  Timers timers;
  timers.add("compute", rank + 1.0);
  timers.add("total", 2.0 * (rank + 1));
  const std::string table = time_table(MPI_COMM_WORLD, timers, {"compute"});

  const std::vector<std::string> total = row_cells(table, "total");
  const std::vector<std::string> compute = row_cells(table, "compute");
  ASSERT_EQ(total.size(), 5u) << table;
  ASSERT_EQ(compute.size(), 5u) << table;
  EXPECT_EQ(total[1], "2.000");
  EXPECT_EQ(total[3], strfmt("%.3f", 2.0 * n));
  EXPECT_EQ(total[4], "100.0") << table;
  EXPECT_EQ(compute[4], "50.0") << table;  // avg (n+1)/2 of avg total n+1
}
