// content_fingerprint: what ranks that each read the data files compare (a stale copy on one
// node's disk must not train that rank on other data).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "data/data.hpp"
#include "data_test_util.hpp"

using namespace trellis;
using namespace trellis::data_test;

namespace {

/// Tokens held in memory, in pieces (as shards are).
class Pieces : public TokenSource {
 public:
  Pieces(std::vector<std::vector<int32_t>> pieces, int vocab)
      : pieces_(std::move(pieces)), vocab_(vocab) {}
  std::string describe() const override { return "pieces"; }
  int vocab() const override { return vocab_; }
  int64_t size() const override {
    int64_t n = 0;
    for (const auto& p : pieces_) n += int64_t(p.size());
    return n;
  }
  int64_t num_windows(int len) const override {
    int64_t n = 0;
    for (const auto& p : pieces_) n += std::max<int64_t>(0, int64_t(p.size()) - len + 1);
    return n;
  }
  void window(int64_t k, int len, int32_t* out) const override {
    for (const auto& p : pieces_) {
      const int64_t here = std::max<int64_t>(0, int64_t(p.size()) - len + 1);
      if (k < here) {
        std::copy(p.begin() + k, p.begin() + k + len, out);
        return;
      }
      k -= here;
    }
    FAIL() << "window past the end";
  }
  std::vector<int64_t> piece_sizes() const override {
    std::vector<int64_t> n;
    for (const auto& p : pieces_) n.push_back(int64_t(p.size()));
    return n;
  }

 private:
  std::vector<std::vector<int32_t>> pieces_;
  int vocab_;
};

std::vector<int32_t> counting(int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = (i * 7) % 50;
  return v;
}

TEST(ContentFingerprint, TheSameTokensGiveTheSameFingerprint) {
  EXPECT_EQ(content_fingerprint(Pieces({counting(10000)}, 50)),
            content_fingerprint(Pieces({counting(10000)}, 50)));
  EXPECT_EQ(content_fingerprint(*synthetic(3, 64, 2, 4, 20000)),
            content_fingerprint(*synthetic(3, 64, 2, 4, 20000)));
}

TEST(ContentFingerprint, ACopyCutShortOrOfOtherTokensDiffers) {
  const uint64_t whole = content_fingerprint(Pieces({counting(10000)}, 50));
  EXPECT_NE(whole, content_fingerprint(Pieces({counting(9999)}, 50)));  // cut short
  EXPECT_NE(whole, content_fingerprint(Pieces({counting(10000)}, 51)));  // another vocabulary
  // The same tokens cut into other pieces (shards).
  std::vector<int32_t> a = counting(10000), b(a.begin() + 4000, a.end());
  a.resize(4000);
  EXPECT_NE(whole, content_fingerprint(Pieces({a, b}, 50)));
  // One token changed: the first, the last, and one in the middle that is sampled.
  for (size_t at : {size_t(0), size_t(9999), size_t(9999) * 512 / 1023}) {
    std::vector<int32_t> t = counting(10000);
    t[at] = (t[at] + 1) % 50;
    EXPECT_NE(whole, content_fingerprint(Pieces({t}, 50))) << "token " << at;
  }
  // Whole other text of the same length.
  EXPECT_NE(content_fingerprint(*synthetic(3, 64, 2, 4, 20000)),
            content_fingerprint(*synthetic(4, 64, 2, 4, 20000)));
}

TEST(ContentFingerprint, FewTokensAreEachSampled) {
  const uint64_t whole = content_fingerprint(Pieces({counting(100)}, 50));
  for (size_t at = 0; at < 100; ++at) {
    std::vector<int32_t> t = counting(100);
    t[at] = (t[at] + 1) % 50;
    EXPECT_NE(whole, content_fingerprint(Pieces({t}, 50))) << "token " << at;
  }
  EXPECT_NE(content_fingerprint(Pieces({{}}, 50)), content_fingerprint(Pieces({{1}}, 50)));
}

}  // namespace
