// The CUDA backend's norms and AdamW against the CPU backend, and its one launch over a run of
// ranges (Backend::adamw_ranges) against one adamw call a range. Skips when no CUDA device is
// present.
#include <cstring>

#include "cuda_test_util.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaOptim : public CudaKernelTest {};

// AdamW on a count that is a multiple of nothing (a value at a time) and on one of 16-byte chunks.
TEST_F(CudaOptim, SumSquaresAndAdamW) {
  for (const int64_t n : {int64_t(1234567), int64_t(100000)}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    auto x = random_vec(n, 60), g = random_vec(n, 61), m = random_vec(n, 62, -0.1f, 0.1f),
         v = random_vec(n, 63, 0.f, 0.01f);
    const double want = cpu->sum_squares(x.data(), n);
    float *d_x = up(x), *d_g = up(g), *d_m = up(m), *d_v = up(v);
    const double got = gpu->sum_squares(d_x, n);
    EXPECT_NEAR(got, want, 1e-10 * want);
    EXPECT_EQ(got, gpu->sum_squares(d_x, n)) << "the same bits every time";
    cpu->adamw(x.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f,
               0.0975f, 0.5f);
    gpu->adamw(d_x, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f, 0.5f);
    expect_close(down(d_x, n), x, 1e-5, "param");
    expect_close(down(d_m, n), m, 1e-5, "m");
    expect_close(down(d_v, n), v, 1e-5, "v");
  }
}

// adamw_ranges — the optimizer's one call a step over its tensors, decaying or not — against
// one adamw call a range on the same device, bit for bit: 300 ranges of 0 to 96 values with a
// gap after the 280th (launches of 256, 24 and 20 ranges; the gap's values untouched), values
// before the first and after the last untouched. From a 16-byte aligned start (16-byte chunks,
// which cross from range to range, then the last values one at a time), and from an odd one (a
// value at a time).
TEST_F(CudaOptim, AdamwRangesAreOneAdamwCallARange) {
  for (const bool aligned : {true, false}) {
    SCOPED_TRACE(aligned ? "16-byte chunks" : "a value at a time");
    std::vector<DecayRange> ranges;
    int64_t at = aligned ? 8 : 3;
    for (int r = 0; r < 300; ++r) {
      if (r == 280) at += 5;  // the gap
      const int64_t len = r * 37 % 97;  // 0 at r = 0 and 97
      ranges.push_back({at, at + len, r % 3 != 1});
      at += len;
    }
    const int64_t n = at + 7;
    const auto x = random_vec(n, 70), g = random_vec(n, 71), m = random_vec(n, 72, -0.1f, 0.1f),
               v = random_vec(n, 73, 0.f, 0.01f);
    float *a_x = up(x), *a_m = up(m), *a_v = up(v), *b_x = up(x), *b_m = up(m), *b_v = up(v);
    const float* d_g = up(g);
    for (const DecayRange& r : ranges)
      gpu->adamw(a_x + r.begin, d_g + r.begin, a_m + r.begin, a_v + r.begin, r.end - r.begin,
                 1e-3f, 0.9f, 0.95f, 1e-8f, r.decay ? 0.1f : 0.0f, 0.19f, 0.0975f, 0.5f);
    gpu->adamw_ranges(b_x, d_g, b_m, b_v, ranges, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f,
                      0.5f);
    for (auto [a, b, what] : {std::tuple{a_x, b_x, "param"}, std::tuple{a_m, b_m, "m"},
                              std::tuple{a_v, b_v, "v"}}) {
      const std::vector<float> want = down(a, n), got = down(b, n);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), sizeof(float) * n), 0) << what;
    }
    const std::vector<float> got = down(b_x, n);
    EXPECT_EQ(std::memcmp(got.data(), x.data(), sizeof(float) * ranges[0].begin), 0)
        << "values before the first range";
    EXPECT_EQ(std::memcmp(got.data() + ranges[279].end, x.data() + ranges[279].end,
                          sizeof(float) * (ranges[280].begin - ranges[279].end)),
              0)
        << "the gap";
  }
}

}  // namespace

#endif  // TRELLIS_HAVE_CUDA
