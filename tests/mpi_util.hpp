// MPI helpers for tests. Every rank runs every test; the listener installed by tests/main.cpp
// makes them agree on each result, so a test that fails on one rank fails on all and the report
// written by rank 0 is the job's.
//
// Rules for MPI tests: decide GTEST_SKIP() identically on every rank (e.g. from the world size);
// do not let an ASSERT_* on one rank skip a collective the other ranks enter — run the
// communication first and check afterwards with EXPECT_*, or agree first with all_ranks_ok().
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

namespace trellis::testing {

/// Adds the cross-rank listener (and, on ranks other than 0, a printer of that rank's failures
/// to stderr). Call once after InitGoogleTest, with MPI initialised.
void install_mpi_listeners(int world_rank);

/// Collective over MPI_COMM_WORLD: true when `ok` holds on every rank.
bool all_ranks_ok(bool ok);

int world_rank();
int world_size();

/// Writes `text` to a deck file private to this process and rank, named after `tag`, and returns
/// its path (the same path for the same tag on later calls).
std::string write_deck(const std::string& tag, const char* text);

}  // namespace trellis::testing
