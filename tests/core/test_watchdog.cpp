// The hang watchdog (lib/core/watchdog.hpp): a process whose progress stops ends with status 4 and
// a line naming the key and what it was last doing; one that keeps beating, or whose watchdog is
// off, goes on. (End to end, a stopped rank in a real job: tests/cli/test_killed_rank.sh.)
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.hpp"
#include "core/watchdog.hpp"

namespace trellis {
namespace {

using namespace std::chrono_literals;

TEST(Watchdog, NoProgressEndsTheProcessWithStatus4NamingTheKey) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Watchdog w(0.4, 3);
        watchdog_beat("a test step");
        std::this_thread::sleep_for(5s);  // (ended well before)
      },
      ::testing::ExitedWithCode(kExitHang),
      "rank 3: error: no progress for [0-9]+ s \\(last: a test step\\).*system.hang_timeout_s = "
      "0.4");
}

TEST(Watchdog, BeatsKeepItQuietAndZeroTurnsItOff) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        {
          Watchdog w(0.4, 0);
          for (int i = 0; i < 12; ++i) {  // 1.2 s of work, a beat every 0.1 s
            std::this_thread::sleep_for(100ms);
            watchdog_beat("a test step");
          }
        }
        {
          Watchdog off(0, 0);
          std::this_thread::sleep_for(800ms);
          watchdog_beat("nothing watches this");  // (no watchdog running: a no-op)
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace trellis
