// The hang watchdog (lib/core/watchdog.hpp): no progress for the timeout fires it once, with a
// message naming the rank, what it last did and the key; beats keep it quiet, and a timeout of 0
// turns it off. (Its default action — the message on stderr, then exit status 4 — in a real job,
// a stopped rank's peer ending it: tests/cli/test_killed_rank.sh.) The set-up's long loops —
// generating a synthetic corpus, reading every token of the shards — beat as they go.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config/config.hpp"
#include "core/watchdog.hpp"
#include "data/data.hpp"

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

// A synthetic corpus of billions of tokens takes minutes to generate, and a low
// system.hang_timeout_s must not take that for a hang: the generator beats every 2^20 tokens,
// whether its successors are cached (small vocab^order) or computed on the fly (large).
TEST(Watchdog, GeneratingASyntheticCorpusIsProgress) {
  for (const int vocab : {29, 50000}) {
    Watchdog w(3600, 0);
    watchdog_beat("a test step");
    DataConfig d;
    d.source = "synthetic";
    d.synthetic_tokens = (int64_t(1) << 20) + 16;
    ModelConfig m;
    m.vocab = vocab;
    make_token_source(d, m);
    EXPECT_STREQ(w.last_seen(), "generating the synthetic corpus") << "vocab " << vocab;
  }
}

// Opening token shards reads every token (for ids at or past model.vocab): progress too.
TEST(Watchdog, ReadingTokenShardsIsProgress) {
  const std::string path =  // (per process: unit tests may run under mpirun)
      ::testing::TempDir() + "trellis_watchdog_shard_" + std::to_string(getpid()) + ".bin";
  {
    const std::vector<uint16_t> tokens(4096, 7);
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 2));
  }
  Watchdog w(3600, 0);
  watchdog_beat("a test step");
  DataConfig d;
  d.source = "tokens";
  d.path = path;
  ModelConfig m;
  m.vocab = 100;
  make_token_source(d, m);
  EXPECT_STREQ(w.last_seen(), "reading the token shards");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace trellis
