// Comm's device path through the staged link, on the fake device (tests/fake_device.hpp: device
// pointers the host cannot dereference). Run at 1, 2 and 4 ranks: every operation, blocking and
// not, with equal, uneven and zero counts, in place and not; host and device buffers mixed in one
// call refused; receives matched in send order (as NCCL matches them), out-of-order tags caught.
#include <gtest/gtest.h>
#include <mpi.h>

#include <stdexcept>
#include <vector>

#include "comm/comm.hpp"
#include "device_comm_checks.hpp"
#include "fake_device.hpp"
#include "mpi_util.hpp"

namespace trellis {
namespace {

using namespace trellis::testing;

class DeviceComm : public ::testing::Test {
 protected:
  DeviceComm() : comm(MPI_COMM_WORLD, "world") {
    comm.set_device_link(fake_staged_link(MPI_COMM_WORLD, "world"));
  }
  FakeDeviceBackend be;
  Comm comm;
};

TEST_F(DeviceComm, AllReduceSumAndMax) { check_device_all_reduce(comm, be); }
TEST_F(DeviceComm, ReduceScatterEveryCountSet) { check_device_reduce_scatter(comm, be); }
TEST_F(DeviceComm, AllGatherEveryCountSet) { check_device_all_gather(comm, be); }
TEST_F(DeviceComm, Broadcast) { check_device_broadcast(comm, be); }
TEST_F(DeviceComm, SendAndReceiveBothWays) { check_device_send_recv(comm, be); }
TEST_F(DeviceComm, StatisticsCountDeviceOperations) { check_device_stats(comm, be); }
TEST_F(DeviceComm, Bf16WireMatchesTheHostReference) { check_device_bf16(comm, be); }
TEST_F(DeviceComm, MixedHostAndDeviceBuffersAreRefused) { check_device_mixed_refused(comm, be); }
TEST_F(DeviceComm, Bf16BuffersEveryOperation) { check_device_bf16_buffers(comm, be); }

// The same on host memory (the CPU backend's buffers): the plain MPI path.
TEST(HostComm, Bf16BuffersEveryOperation) {
  Comm plain(MPI_COMM_WORLD, "plain");
  auto cpu = make_backend("cpu");
  check_device_bf16_buffers(plain, *cpu);
}

// Split into MPI calls of at most 3 values (every rank the same limit): the chunked paths of every
// operation on bf16 buffers, host and staged.
TEST_F(DeviceComm, Bf16BuffersBeyondTheCountLimit) {
  const int64_t old = detail::set_max_mpi_count(3);
  Comm plain(MPI_COMM_WORLD, "plain");
  auto cpu = make_backend("cpu");
  check_device_bf16_buffers(plain, *cpu);
  check_device_bf16_buffers(comm, be);
  detail::set_max_mpi_count(old);
}

TEST_F(DeviceComm, WithoutALinkEveryBufferIsHostMemory) {
  Comm plain(MPI_COMM_WORLD, "plain");
  EXPECT_EQ(plain.device_link(), nullptr);
  std::vector<float> h(3, 1.f);
  plain.all_reduce(h.data(), 3);
  EXPECT_EQ(h[2], float(plain.size()));
}

TEST_F(DeviceComm, MessagesOutOfSendOrderAreCaught) {
  // NCCL has no tags: a receive takes the peer's next message. Rank 0 sends tags 5 then 6; the
  // last rank receives expecting 6 first: the staged link sees tag 5 and says so.
  const int n = comm.size();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  DeviceVec a(be, std::vector<float>(8, 1.f)), b(be, std::vector<float>(8, 2.f));
  bool caught = true;
  if (comm.rank() == 0) {
    Request s1 = comm.isend(a.data(), 8, n - 1, 5), s2 = comm.isend(b.data(), 8, n - 1, 6);
    s1.wait();
    s2.wait();
  } else if (comm.rank() == n - 1) {
    caught = false;
    try {
      comm.recv(b.data(), 8, 0, 6);
    } catch (const std::logic_error&) {
      caught = true;
    }
    comm.recv(a.data(), 8, 0, 6);  // the second message, in order
  }
  EXPECT_TRUE(all_ranks_ok(caught));
}

}  // namespace
}  // namespace trellis
