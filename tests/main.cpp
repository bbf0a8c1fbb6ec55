// GoogleTest main for every test binary: MPI and Kokkos are started once for the process.
// Under mpirun each rank runs the same tests; MPI tests agree on their result collectively
// (tests/mpi_util.hpp) so that a failure on one rank cannot leave the others waiting.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>

#include "core/log.hpp"
#include "mpi_util.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  trellis::set_log_rank(rank);
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {  // one rank reports (console and --gtest_output file); the others only fail loudly
#ifdef GTEST_FLAG_SET
    GTEST_FLAG_SET(output, "");
#else
    ::testing::GTEST_FLAG(output) = "";
#endif
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    // InitGoogleTest already created the report writer from the flag: remove it too.
    delete listeners.Release(listeners.default_xml_generator());
  }
  trellis::testing::install_mpi_listeners(rank);
  int status;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    status = RUN_ALL_TESTS();
  }
  MPI_Finalize();
  return status;
}
