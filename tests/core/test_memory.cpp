// Memory accounting and what running out of memory says (core/memory.hpp, comm/world.hpp).
#include <gtest/gtest.h>

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
