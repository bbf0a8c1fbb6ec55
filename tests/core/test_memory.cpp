// Memory accounting and what running out of memory says (core/memory.hpp, comm/world.hpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <new>
#include <string>

#include "comm/world.hpp"
#include "core/memory.hpp"

namespace trellis {
namespace {

TEST(Memory, BuffersAreCountedByKindUntilFreed) {
  const int64_t before = memory_stats().current[int(MemKind::Activations)];
  {
    Buffer b(MemKind::Activations, 3 << 20);
    EXPECT_EQ(memory_stats().current[int(MemKind::Activations)], before + (3 << 20));
    EXPECT_GE(memory_stats().total_peak, memory_stats().total_current);
  }
  EXPECT_EQ(memory_stats().current[int(MemKind::Activations)], before);
}

/// This process's resident bytes (/proc/self/statm).
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * double(sysconf(_SC_PAGESIZE));
}

// Large buffers taken and given back again and again, as ZeRO 3's gathered units are, leave
// nothing resident once given back (with malloc, glibc's heap kept them: its mmap threshold rises
// to a freed mapping's size), and come zeroed on a 2 MiB boundary.
TEST(Memory, LargeHostBuffersGoBackToTheSystemWhenFreed) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's build takes every buffer from malloc";
#endif
  constexpr size_t kMiB = size_t(1) << 20;
  const double before = resident_bytes();
  for (int round = 0; round < 4; ++round) {
    Buffer a(MemKind::Params, 24 * kMiB), b(MemKind::Params, 20 * kMiB + 12345);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(b.data()) % (2 * kMiB), 0u);
    const auto* bytes = static_cast<const unsigned char*>(b.data());
    for (size_t i = 0; i < b.bytes(); i += 4096) ASSERT_EQ(bytes[i], 0) << i;
    std::memset(a.data(), 1, a.bytes());
    a.reset();
    Buffer c(MemKind::Params, 16 * kMiB);  // (under the size just given back)
    std::memset(c.data(), 1, c.bytes());
  }
  EXPECT_LT(resident_bytes() - before, 4.0 * kMiB)
      << "resident before " << before / kMiB << " MiB, after " << resident_bytes() / kMiB << " MiB";
}

TEST(Memory, HostOutOfMemorySaysHowMuchWasAskedFor) {
  const int64_t before = memory_stats().total_current;
  try {
    Buffer b(MemKind::Scratch, size_t(1) << 62);  // more than any address space
    FAIL() << "4 EiB allocated";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(std::string(e.what()), "out of host memory: a request for 4194304.0 TiB") << e.what();
  }
  EXPECT_EQ(memory_stats().total_current, before);  // nothing counted for a failed request
}

TEST(Memory, OutOfMemoryMessagesNameTheKeysThatSizeARank) {
  const std::string gpu =
      out_of_memory_message(OutOfMemory("out of GPU memory on device 0: a request for 1.0 GiB"));
  EXPECT_EQ(gpu.rfind("out of GPU memory on device 0: a request for 1.0 GiB: ", 0), 0u) << gpu;
  EXPECT_NE(gpu.find("train.micro_batch"), std::string::npos) << gpu;
  EXPECT_NE(gpu.find("--gpu-mem"), std::string::npos) << gpu;
  const std::string host = out_of_memory_message(std::bad_alloc());  // a std::vector's, say
  EXPECT_EQ(host.rfind("out of host memory: ", 0), 0u) << host;
  EXPECT_NE(host.find("data.synthetic_tokens"), std::string::npos) << host;
}

}  // namespace
}  // namespace trellis
