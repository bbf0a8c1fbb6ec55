// The hang watchdog (lib/core/watchdog.hpp): no progress for the timeout fires it once, with a
// message naming the rank, what it last did and the key; beats keep it quiet, and a timeout of 0
// turns it off. (Its default action — the message on stderr, then exit status 4 — in a real job,
// a stopped rank's peer ending it: tests/cli/test_killed_rank.sh.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "core/watchdog.hpp"

namespace trellis {
namespace {

using namespace std::chrono_literals;

struct Fired {
  std::mutex mutex;
  std::string message;
  std::atomic<int> times{0};
  Watchdog::HangAction action() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      message = m;
      ++times;
    };
  }
};

TEST(Watchdog, NoProgressFiresOnceNamingTheRankWhatItDidAndTheKey) {
  Fired fired;
  {
    Watchdog w(0.4, 3, fired.action());
    watchdog_beat("a test step");
    for (int i = 0; i < 30 && fired.times == 0; ++i) std::this_thread::sleep_for(100ms);
    std::this_thread::sleep_for(500ms);  // (once only)
  }
  EXPECT_EQ(fired.times, 1);
  EXPECT_NE(fired.message.find("rank 3: error: no progress for"), std::string::npos)
      << fired.message;
  EXPECT_NE(fired.message.find("(last: a test step)"), std::string::npos) << fired.message;
  EXPECT_NE(fired.message.find("status 4 (system.hang_timeout_s = 0.4)"), std::string::npos)
      << fired.message;
}

TEST(Watchdog, BeatsKeepItQuietAndZeroTurnsItOff) {
  Fired fired;
  {
    Watchdog w(1.0, 0, fired.action());
    for (int i = 0; i < 20; ++i) {  // 2 s of work, a beat every 0.1 s (a 1 s stall needed)
      std::this_thread::sleep_for(100ms);
      watchdog_beat("a test step");
    }
  }
  EXPECT_EQ(fired.times, 0) << fired.message;
  {
    Watchdog off(0, 0, fired.action());
    std::this_thread::sleep_for(800ms);
    watchdog_beat("nothing watches this");  // (no watchdog running: a no-op)
  }
  EXPECT_EQ(fired.times, 0) << fired.message;
}

}  // namespace
}  // namespace trellis
