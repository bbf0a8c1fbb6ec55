// The NCCL device link on GPUs (built where nvcc and NCCL exist; skips cleanly without enough
// devices: one per rank). In unit_tests, so that scripts/gpu-check.sh runs it from the GPU
// bundle: alone (np 1) every operation runs through NCCL on a communicator of one rank (which a
// run's groups of one rank do without: GroupOfOneRankNeedsNoCommunicator); under
// `mpirun -np N unit_tests --gtest_filter='NcclLink*'` with N GPUs, also between ranks,
// point-to-point included (gpu-check.sh does so where it finds two GPUs or more). The checks are
// the staged link's (device_comm_checks.hpp), on the CUDA backend's memory.
#ifdef TRELLIS_HAVE_NCCL
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.hpp"
#include "backend/cuda/cuda_factory.hpp"
#include "comm/comm.hpp"
#include "comm/nccl_link.hpp"
#include "device_comm_checks.hpp"
#include "mpi_util.hpp"
#include "scoped_env.hpp"

namespace trellis {
namespace {

using namespace trellis::testing;

/// The emulated NCCL's function counting this process's communicators (emu_nccl_lib.cpp), or
/// null where the NCCL loaded is a real one.
int (*emulated_nccl_counter())() {
  return reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "trellis_emu_nccl_communicators"));
}

class NcclLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Every rank decides alike: skip unless each rank has a GPU of its own.
    if (!all_ranks_ok(cuda_device_count() >= world_size()))
      GTEST_SKIP() << "needs one CUDA device per rank";
    std::string why;
    if (!all_ranks_ok(nccl_available(&why))) GTEST_SKIP() << "no usable NCCL: " << why;
    be = make_backend("cuda", world_rank(), world_size());
    comm = std::make_unique<Comm>(MPI_COMM_WORLD, "world");
    comm->set_device_link(make_nccl_link(MPI_COMM_WORLD, "world", be->device_index(),
                                         be->native_stream(), /*point_to_point=*/true,
                                         /*communicator_of_one=*/true));
  }
  void TearDown() override {
    comm.reset();  // the link's communicators go before the backend
    be.reset();
  }
  std::unique_ptr<Backend> be;
  std::unique_ptr<Comm> comm;
};

TEST_F(NcclLinkTest, AllReduceSumAndMax) { check_device_all_reduce(*comm, *be); }
TEST_F(NcclLinkTest, ReduceScatterEqualAndUnequalCounts) { check_device_reduce_scatter(*comm, *be); }
TEST_F(NcclLinkTest, AllGatherEqualAndUnequalCounts) { check_device_all_gather(*comm, *be); }
TEST_F(NcclLinkTest, Broadcast) { check_device_broadcast(*comm, *be); }
TEST_F(NcclLinkTest, SendAndReceiveBothWays) { check_device_send_recv(*comm, *be); }
TEST_F(NcclLinkTest, StatisticsCountDeviceOperations) { check_device_stats(*comm, *be); }
TEST_F(NcclLinkTest, Bf16WireMatchesTheHostReference) { check_device_bf16(*comm, *be); }
TEST_F(NcclLinkTest, Bf16BuffersEveryOperation) { check_device_bf16_buffers(*comm, *be); }
// The link itself, whatever the number of ranks (Comm never hands it a bf16 reduction over one
// rank, so at np 1 this is what runs the two conversion kernels): NCCL's bf16 sum over p ranks
// of the same input x is p · bf16(x) rounded, and exactly bf16(x) at p = 1.
TEST_F(NcclLinkTest, Bf16ConversionKernelsRoundToNearestEven) {
  const int p = world_size();
  std::vector<float> x = {1.0f, 1.00390625f, 1.01171875f, -3.1415926f, 1e-30f, 3e30f, 0.f, 65504.5f};
  for (int i = 0; i < 1000; ++i) x.push_back(float(i) * 0.0123f - 5.f);
  const int64_t n = int64_t(x.size());
  DeviceVec d(*be, x);
  comm->device_link()->all_reduce(d.data(), n, ReduceOp::sum, true, Wire::bf16);
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i) {
    float acc = round_to_bf16(x[i]);
    for (int r = 1; r < p; ++r) acc = round_to_bf16(acc + round_to_bf16(x[i]));
    want[i] = acc;
  }
  const std::vector<float> got = d.host();
  if (p <= 2) {
    EXPECT_EQ(got, want);
  } else {
    for (int64_t i = 0; i < n; ++i)
      EXPECT_LE(std::fabs(double(got[i]) - double(p) * x[i]),
                bf16_sum_bound(std::vector<float>(p, x[i])))
          << i;
  }
  // reduce_scatter of equal blocks, every block x: this rank's block is the same sum.
  std::vector<float> blocks;
  for (int r = 0; r < p; ++r) blocks.insert(blocks.end(), x.begin(), x.end());
  DeviceVec in(*be, blocks), out(*be, std::vector<float>(n, 0.f));
  comm->device_link()->reduce_scatter(in.data(), out.data(), std::vector<int64_t>(p, n), true,
                                      Wire::bf16);
  if (p <= 2) {
    EXPECT_EQ(out.host(), want);
  }
}
TEST_F(NcclLinkTest, MixedHostAndDeviceBuffersAreRefused) { check_device_mixed_refused(*comm, *be); }

// A run's groups of one rank (tp = 1, pp = 1, ...) get no NCCL communicator, whose buffers would
// only take device memory: their operations stay on the device, with the same results. Each rank
// alone, on MPI_COMM_SELF.
TEST_F(NcclLinkTest, GroupOfOneRankNeedsNoCommunicator) {
  auto counter = emulated_nccl_counter();
  const int before = counter ? counter() : -1;
  if (counter) {
    EXPECT_GE(before, 1);  // the fixture's, communicator_of_one: the count works
  }
  Comm self(MPI_COMM_SELF, "self");
  self.set_device_link(make_nccl_link(MPI_COMM_SELF, "self", be->device_index(),
                                      be->native_stream(), /*point_to_point=*/true));
  if (counter) {
    EXPECT_EQ(counter(), before);
  }
  check_device_all_reduce(self, *be);
  check_device_reduce_scatter(self, *be);
  check_device_all_gather(self, *be);
  check_device_broadcast(self, *be);
  check_device_bf16_buffers(self, *be);
}

// Unequal counts go the way that moves fewer values (nccl_link.cu: by_roots): blocks on one or
// two ranks (a ZeRO bucket inside one shard, or across two) as one reduce or broadcast per rank
// with values; near-equal blocks (a model's shards), and a tie between several roots, by NCCL's
// reduce-scatter or all-gather over padded slots. The emulated NCCL counts which function ran;
// the values (which depend on the rank and the index) are checked too.
TEST_F(NcclLinkTest, UnequalCountsTakeTheWayThatMovesLess) {
  auto calls = reinterpret_cast<long (*)(const char*)>(
      dlsym(RTLD_DEFAULT, "trellis_emu_nccl_calls"));
  if (!calls) GTEST_SKIP() << "needs the emulated NCCL, which counts the calls";
  const int p = world_size(), me = world_rank();
  if (p == 1) GTEST_SKIP() << "needs two ranks";
  struct Case {
    std::vector<int64_t> counts;  // (p)
    bool roots;
  };
  std::vector<Case> cases;
  cases.push_back({std::vector<int64_t>(p, 0), true});  // the last rank holds every value
  cases.back().counts[p - 1] = 1000;
  cases.push_back({shard_counts(4 * p - 1, p), false});  // 4, …, 4, 3
  if (p > 2) {
    cases.push_back({std::vector<int64_t>(p, 0), true});  // two roots, the second at offset 3
    cases.back().counts[1] = 3;
    cases.back().counts[p - 1] = 1000;
    cases.push_back({std::vector<int64_t>(p, 5), false});  // 5, …, 5, 0: a tie, p − 1 roots
    cases.back().counts[p - 1] = 0;
  }
  auto x = [](int r, int64_t i) { return float(r + i % 7); };  // small integers: exact in bf16
  for (const Case& c : cases)
    for (Wire wire : {Wire::fp32, Wire::bf16}) {
      const std::vector<int64_t>& counts = c.counts;
      SCOPED_TRACE(::testing::Message() << "counts[0] " << counts[0] << " counts[1] " << counts[1]
                                        << " bf16 wire " << (wire == Wire::bf16));
      const std::vector<int64_t> displ = displacements(counts);
      const int64_t n = displ.back() + counts.back(), mine = counts[me], off = displ[me];
      const long nonzero =
          std::count_if(counts.begin(), counts.end(), [](int64_t k) { return k > 0; });
      const long reduces = calls("ncclReduce"), scatters = calls("ncclReduceScatter");
      std::vector<float> values(n), want(mine, 0.f);
      for (int64_t i = 0; i < n; ++i) values[i] = x(me, i);
      for (int r = 0; r < p; ++r)
        for (int64_t i = 0; i < mine; ++i) want[i] += x(r, off + i);
      DeviceVec in(*be, values), out(*be, std::vector<float>(mine, -9.f));
      comm->device_link()->reduce_scatter(in.data(), out.data(), counts, true, wire);
      EXPECT_EQ(out.host(), want);
      EXPECT_EQ(calls("ncclReduce") - reduces, c.roots ? nonzero : 0);
      EXPECT_EQ(calls("ncclReduceScatter") - scatters, c.roots ? 0 : 1);
      if (wire == Wire::bf16) continue;  // (all-gathers move the buffer's own type)
      const long broadcasts = calls("ncclBroadcast"), gathers = calls("ncclAllGather");
      std::vector<float> part(mine), all_want(n);
      for (int64_t i = 0; i < mine; ++i) part[i] = x(10 * me, i);
      for (int r = 0; r < p; ++r)
        for (int64_t i = 0; i < counts[r]; ++i) all_want[displ[r] + i] = x(10 * r, i);
      DeviceVec mine_in(*be, part), all(*be, std::vector<float>(n, -9.f));
      comm->device_link()->all_gather(mine_in.data(), all.data(), counts, true);
      EXPECT_EQ(all.host(), all_want);
      EXPECT_EQ(calls("ncclBroadcast") - broadcasts, c.roots ? nonzero : 0);
      EXPECT_EQ(calls("ncclAllGather") - gathers, c.roots ? 0 : 1);
    }
}

// A collective whose peer has died never ends on the device, and cudaEventSynchronize would wait
// for it forever: the link's waits ask the communicator for its asynchronous error and throw with
// NCCL's reason, blocking or not (the emulated NCCL reports one on request). The process's links
// then stop waiting for NCCL in their destructors (they leak their communicators, as a failing
// run ends anyway): no NCCL link test may come after this one in the file.
TEST_F(NcclLinkTest, AsynchronousErrorEndsTheWait) {
  if (!emulated_nccl_counter()) GTEST_SKIP() << "needs the emulated NCCL, which fakes the error";
  DeviceVec d(*be, std::vector<float>(16, 1.f));
  ScopedEnv fault("TRELLIS_EMU_NCCL_ASYNC_ERROR", "1");
  try {
    comm->device_link()->all_reduce(d.data(), 16, ReduceOp::sum, true, Wire::fp32);
    ADD_FAILURE() << "a blocking all_reduce ignored the asynchronous error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL link on 'world': remote process exited"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("asynchronous error"), std::string::npos) << e.what();
  }
  auto started = comm->device_link()->all_reduce(d.data(), 16, ReduceOp::sum, false, Wire::fp32);
  ASSERT_TRUE(started);
  EXPECT_THROW(started->test(), std::exception);
  EXPECT_THROW(started->wait(), std::exception);
}

// The library is opened at run time: what a missing or wrong one says (no GPU needed).
TEST(NcclLibrary, MissingOrWrongLibraryIsNamed) {
  std::string why;
  EXPECT_FALSE(nccl_library_usable("/nonexistent/libnccl.so.2", &why));
  EXPECT_NE(why.find("cannot load /nonexistent/libnccl.so.2"), std::string::npos) << why;
  EXPECT_FALSE(nccl_library_usable("libc.so.6", &why));  // loads, but is not NCCL
  EXPECT_NE(why.find("libc.so.6 has no ncclGetErrorString"), std::string::npos) << why;
}

// NCCL before 2.10 has no ncclBfloat16: refused at load (device_comm = auto then takes the staged
// link), its version named. NCCL_VERSION_CODE changed its spelling at 2.9. Needs a library whose
// version can be set: the emulated NCCL.
TEST(NcclLibrary, OlderThan2_10IsRefusedNamingItsVersion) {
  nccl_available();  // loads the process's NCCL
  auto counter = emulated_nccl_counter();
  if (!counter) GTEST_SKIP() << "needs the emulated NCCL (TRELLIS_EMU_NCCL_VERSION)";
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(counter), &info), 0);
  const std::string file = info.dli_fname;
  std::string why;
  for (const auto& [code, name] : {std::pair{"2804", "2.8.4"}, std::pair{"20903", "2.9.3"}}) {
    ScopedEnv version("TRELLIS_EMU_NCCL_VERSION", code);
    EXPECT_FALSE(nccl_library_usable(file, &why)) << code;
    EXPECT_NE(why.find(file + " is NCCL " + name + ", older than 2.10"), std::string::npos) << why;
  }
  ScopedEnv version("TRELLIS_EMU_NCCL_VERSION", "21000");
  EXPECT_TRUE(nccl_library_usable(file, &why)) << why;
}

TEST(NcclLibrary, ToolkitCopyIsUsable) {
  const std::string file = "/usr/local/cuda/lib64/libnccl.so.2";
  if (FILE* f = std::fopen(file.c_str(), "rb")) std::fclose(f);
  else GTEST_SKIP() << file << " is not installed";
  std::string why;
  EXPECT_TRUE(nccl_library_usable(file, &why)) << why;
  EXPECT_TRUE(why.empty());
}

}  // namespace
}  // namespace trellis
#endif
