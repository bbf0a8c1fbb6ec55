// CPU backend: vocab-parallel embeddings and positions, layer norm, linear layers, GELU, add,
// scale, make_backend — forward kernels against plain double-precision loops, backward kernels
// against central finite differences of the forward, and the overwrite / accumulate contract of
// each output.
#include <cstring>

#include "backend_test_util.hpp"
#include "core/error.hpp"

namespace trellis::test {
namespace {

class CpuKernels : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST(MakeBackend, NamesAndErrors) {
  auto be = make_backend("cpu");
  ASSERT_TRUE(be);
  EXPECT_EQ(be->name(), "cpu");
  be->set_threads(0);  // leaves OpenBLAS's default
  be->set_threads(2);
  try {
    make_backend("tpu");
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "system.backend: unknown backend 'tpu' (expected cpu or cuda)");
  }
  try {
    auto gpu = make_backend("cuda");
#ifdef TRELLIS_HAVE_CUDA
    EXPECT_EQ(gpu->name(), "cuda");  // this machine has a GPU
#else
    FAIL() << "a build without nvcc made a cuda backend";
#endif
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("system.backend: ", 0), 0u) << m;
#ifdef TRELLIS_HAVE_CUDA
    EXPECT_NE(m.find("no CUDA device"), std::string::npos) << m;
#else
    EXPECT_NE(m.find("no CUDA backend"), std::string::npos) << m;
#endif
  }
}

// ---- embeddings ----

// Vocabulary ranges [vocab_begin, vocab_begin + vocab_count) of a 7-token vocabulary: the whole
// table (tp = 1), a middle slice and the last rows. Tokens outside a range give zero rows and no
// gradient.
constexpr int kVocab = 7;
constexpr std::pair<int, int> kRanges[] = {{0, kVocab}, {2, 3}, {5, 2}};

TEST_F(CpuKernels, EmbeddingForwardMatchesReferenceOverVocabRanges) {
  const int N = 10, C = 13;
  const std::vector<int32_t> tokens = {4, 0, 4, 2, 6, 1, 3, 3, 5, 0};  // (N), repeats
  const auto wte = random_vec(kVocab * C, 1);                          // (kVocab,C), global
  std::vector<float> sum(N * C, 0.0f);
  for (auto [begin, count] : kRanges) {
    // this rank's slice of the table: rows [begin, begin + count)
    const std::vector<float> local(wte.begin() + begin * C, wte.begin() + (begin + count) * C);
    std::vector<float> out(N * C, 99.0f);  // overwritten
    be->embedding_forward(out.data(), tokens.data(), local.data(), N, C, begin, count);
    for (int n = 0; n < N; ++n) {
      const bool mine = tokens[n] >= begin && tokens[n] < begin + count;
      for (int c = 0; c < C; ++c)
        ASSERT_EQ(out[n * C + c], mine ? wte[tokens[n] * C + c] : 0.0f)
            << "range " << begin << "+" << count << " n " << n << " c " << c;
    }
    if (count != kVocab)
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += out[i];
  }
  // The two slices {2..4} and {5,6} and the rest {0,1} (run below) add up to the full embedding.
  const std::vector<float> rest(wte.begin(), wte.begin() + 2 * C);
  std::vector<float> out(N * C);
  be->embedding_forward(out.data(), tokens.data(), rest.data(), N, C, 0, 2);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c)
      ASSERT_EQ(sum[n * C + c] + out[n * C + c], wte[tokens[n] * C + c]) << n << " " << c;
}

TEST_F(CpuKernels, EmbeddingBackwardMatchesReferenceAndFiniteDifferencesAndAccumulates) {
  const int N = 10, C = 150;  // several channel blocks
  const std::vector<int32_t> tokens = {4, 0, 4, 2, 6, 1, 4, 3, 5, 2};  // token 4 three times
  const auto w = random_vec(N * C, 5);                                 // dout (N,C)
  for (auto [begin, count] : kRanges) {
    auto local = random_vec(size_t(count) * C, 3);  // (count,C)
    std::vector<float> out(N * C);
    auto loss = [&] {
      be->embedding_forward(out.data(), tokens.data(), local.data(), N, C, begin, count);
      return weighted_sum(out, w);
    };
    const auto fd = finite_diff(local, loss, 1e-2);
    std::vector<double> ref(size_t(count) * C, 0.0);  // naive scatter in double
    for (int n = 0; n < N; ++n)
      if (tokens[n] >= begin && tokens[n] < begin + count)
        for (int c = 0; c < C; ++c) ref[(tokens[n] - begin) * C + c] += w[n * C + c];
    const auto dwte0 = random_vec(size_t(count) * C, 6);
    auto dwte = dwte0;
    be->embedding_backward(dwte.data(), w.data(), tokens.data(), N, C, begin, count);
    expect_close(diff(dwte, dwte0), ref, 1e-5, "dwte");
    expect_close(diff(dwte, dwte0), fd, 1e-3, "dwte (finite differences)");
    const auto dwte1 = dwte;
    be->embedding_backward(dwte.data(), w.data(), tokens.data(), N, C, begin, count);
    expect_close(diff(dwte, dwte1), diff(dwte1, dwte0), 1e-5, "dwte second call");
  }
  // No token in the range: the gradient is left exactly as it was.
  const std::vector<int32_t> low = {0, 1, 1, 0};
  const auto dwte0 = random_vec(3 * C, 7);
  auto dwte = dwte0;
  be->embedding_backward(dwte.data(), w.data(), low.data(), 4, C, 2, 3);
  EXPECT_EQ(0, std::memcmp(dwte.data(), dwte0.data(), dwte.size() * sizeof(float)));
}

// Rows [first_row, first_row + rows) of a (B,T) batch, T = 4: the slice starts mid-sequence and
// spans three sequences, so positions repeat and wrap.
TEST_F(CpuKernels, PositionForwardAddsByPosition) {
  const int T = 4, C = 13, rows = 11, first_row = 5;
  const auto wpe = random_vec(T * C, 8);                 // (T,C)
  const auto out0 = random_vec(size_t(rows) * C, 9);     // (rows,C), accumulated into
  auto out = out0;
  be->position_forward(out.data(), wpe.data(), rows, T, C, first_row);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c)
      ASSERT_EQ(out[r * C + c], out0[r * C + c] + wpe[((first_row + r) % T) * C + c]) << r;
}

TEST_F(CpuKernels, PositionBackwardMatchesReferenceAndFiniteDifferencesAndAccumulates) {
  const int T = 4, C = 150, rows = 11, first_row = 5;
  auto wpe = random_vec(T * C, 10);
  const auto w = random_vec(size_t(rows) * C, 11);  // dout (rows,C)
  std::vector<float> out(size_t(rows) * C);
  auto loss = [&] {
    std::fill(out.begin(), out.end(), 0.0f);
    be->position_forward(out.data(), wpe.data(), rows, T, C, first_row);
    return weighted_sum(out, w);
  };
  const auto fd = finite_diff(wpe, loss, 1e-2);
  std::vector<double> ref(T * C, 0.0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c) ref[((first_row + r) % T) * C + c] += w[r * C + c];
  const auto dwpe0 = random_vec(T * C, 12);
  auto dwpe = dwpe0;
  be->position_backward(dwpe.data(), w.data(), rows, T, C, first_row);
  expect_close(diff(dwpe, dwpe0), ref, 1e-5, "dwpe");
  expect_close(diff(dwpe, dwpe0), fd, 1e-3, "dwpe (finite differences)");
  const auto dwpe1 = dwpe;
  be->position_backward(dwpe.data(), w.data(), rows, T, C, first_row);
  expect_close(diff(dwpe, dwpe1), diff(dwpe1, dwpe0), 1e-5, "dwpe second call");
}

// ---- layer norm ----

TEST_F(CpuKernels, LayernormForwardMatchesReference) {
  for (auto [N, C] : {std::pair{7, 13}, std::pair{5, 256}}) {
    auto inp = random_vec(N * C, 10, -2.0f, 3.0f), wt = random_vec(C, 11), bs = random_vec(C, 12);
    std::vector<float> out(N * C), mean(N), rstd(N);
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), wt.data(), bs.data(),
                          N, C);
    std::vector<double> rout(N * C), rmean(N), rrstd(N);
    for (int n = 0; n < N; ++n) {
      double m = 0, v = 0;
      for (int c = 0; c < C; ++c) m += inp[n * C + c];
      m /= C;
      for (int c = 0; c < C; ++c) v += (inp[n * C + c] - m) * (inp[n * C + c] - m);
      v /= C;
      const double s = 1.0 / std::sqrt(v + 1e-5);
      for (int c = 0; c < C; ++c) rout[n * C + c] = (inp[n * C + c] - m) * s * wt[c] + bs[c];
      rmean[n] = m;
      rrstd[n] = s;
    }
    expect_close(out, rout, 1e-5, "layernorm out");
    expect_close(mean, rmean, 1e-5, "layernorm mean");
    expect_close(rstd, rrstd, 1e-5, "layernorm rstd");
  }
}

TEST_F(CpuKernels, ResidualLayernormIsAddThenLayernormBitwise) {
  // The fused kernel against the two calls it replaces (the Backend's default), with the sum
  // written to its own buffer, over a, and over b.
  for (auto [N, C] : {std::pair{7, 13}, std::pair{9, 256}}) {
    const auto a = random_vec(N * C, 20, -2.0f, 3.0f), b = random_vec(N * C, 21);
    const auto wt = random_vec(C, 22), bs = random_vec(C, 23);
    std::vector<float> res(N * C), out(N * C), mean(N), rstd(N);
    be->add(res.data(), a.data(), b.data(), int64_t(N) * C);
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), res.data(), wt.data(), bs.data(), N, C);
    for (int alias = 0; alias < 3; ++alias) {
      std::vector<float> fa = a, fb = b, fres(N * C), fout(N * C), fmean(N), frstd(N);
      float* r = alias == 0 ? fres.data() : alias == 1 ? fa.data() : fb.data();
      be->residual_layernorm_forward(r, fout.data(), fmean.data(), frstd.data(), fa.data(),
                                     fb.data(), wt.data(), bs.data(), N, C);
      EXPECT_EQ(0, std::memcmp(r, res.data(), sizeof(float) * N * C)) << "sum, alias " << alias;
      EXPECT_EQ(fout, out) << "out, alias " << alias;
      EXPECT_EQ(fmean, mean) << "mean, alias " << alias;
      EXPECT_EQ(frstd, rstd) << "rstd, alias " << alias;
    }
  }
}

TEST_F(CpuKernels, LayernormBackwardMatchesFiniteDifferencesAndAccumulates) {
  const int N = 7, C = 13;
  auto inp = random_vec(N * C, 20, -2.0f, 2.0f), wt = random_vec(C, 21, 0.5f, 1.5f),
       bs = random_vec(C, 22), w = random_vec(N * C, 23);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    be->layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), wt.data(), bs.data(),
                          N, C);
    return weighted_sum(out, w);
  };
  auto fd_inp = finite_diff(inp, loss, 1e-2), fd_w = finite_diff(wt, loss, 1e-2),
       fd_b = finite_diff(bs, loss, 1e-2);
  loss();  // mean, rstd at the unperturbed point
  const auto di0 = random_vec(N * C, 24), dw0 = random_vec(C, 25), db0 = random_vec(C, 26);
  auto di = di0, dw = dw0, db = db0;
  be->layernorm_backward(di.data(), dw.data(), db.data(), w.data(), inp.data(), wt.data(),
                         mean.data(), rstd.data(), N, C);
  expect_close(diff(di, di0), fd_inp, 2e-3, "layernorm dinp");
  expect_close(diff(dw, dw0), fd_w, 2e-3, "layernorm dweight");
  expect_close(diff(db, db0), fd_b, 2e-3, "layernorm dbias");
  const auto di1 = di, dw1 = dw, db1 = db;
  be->layernorm_backward(di.data(), dw.data(), db.data(), w.data(), inp.data(), wt.data(),
                         mean.data(), rstd.data(), N, C);
  expect_close(diff(di, di1), diff(di1, di0), 1e-5, "dinp second call");
  expect_close(diff(dw, dw1), diff(dw1, dw0), 1e-5, "dweight second call");
  expect_close(diff(db, db1), diff(db1, db0), 1e-5, "dbias second call");
}

// ---- linear layers ----

TEST_F(CpuKernels, MatmulForwardMatchesReference) {
  for (auto [N, C, OC] : {std::tuple{7, 13, 5}, std::tuple{64, 96, 80}, std::tuple{1, 1, 1}}) {
    auto inp = random_vec(N * C, 30), wt = random_vec(OC * C, 31), bs = random_vec(OC, 32);
    for (bool with_bias : {false, true}) {
      std::vector<float> out(N * OC, 42.0f);
      be->matmul_forward(out.data(), inp.data(), wt.data(), with_bias ? bs.data() : nullptr, N, C,
                         OC);
      std::vector<double> ref(N * OC);
      for (int n = 0; n < N; ++n)
        for (int o = 0; o < OC; ++o) {
          double s = with_bias ? bs[o] : 0.0;
          for (int c = 0; c < C; ++c) s += double(inp[n * C + c]) * wt[o * C + c];
          ref[n * OC + o] = s;
        }
      // sums of C products: entries near zero carry the rounding of the large terms
      expect_close(out, ref, 1e-5, with_bias ? "matmul out (bias)" : "matmul out", 0.2);
      // Ending in a residual add: out = residual + the same layer.
      const auto res = random_vec(N * OC, 33);
      be->matmul_residual_forward(out.data(), res.data(), inp.data(), wt.data(),
                                  with_bias ? bs.data() : nullptr, N, C, OC);
      for (int i = 0; i < N * OC; ++i) ref[i] += res[i];
      expect_close(out, ref, 1e-5, with_bias ? "residual + matmul (bias)" : "residual + matmul",
                   0.2);
    }
  }
  std::vector<float> x(6, 1.0f), w(6, 1.0f);
  EXPECT_THROW(be->matmul_residual_forward(x.data(), x.data(), x.data(), w.data(), nullptr, 2, 3,
                                           3),
               std::logic_error)
      << "out aliasing the residual";
}

TEST_F(CpuKernels, MatmulBackwardMatchesFiniteDifferencesAndContract) {
  const int N = 7, C = 13, OC = 5;
  auto inp = random_vec(N * C, 40), wt = random_vec(OC * C, 41), bs = random_vec(OC, 42),
       w = random_vec(N * OC, 43);
  std::vector<float> out(N * OC);
  auto loss = [&] {
    be->matmul_forward(out.data(), inp.data(), wt.data(), bs.data(), N, C, OC);
    return weighted_sum(out, w);
  };
  auto fd_inp = finite_diff(inp, loss, 1e-2), fd_w = finite_diff(wt, loss, 1e-2),
       fd_b = finite_diff(bs, loss, 1e-2);
  std::vector<float> di(N * C, 7.0f);  // overwritten
  const auto dw0 = random_vec(OC * C, 44), db0 = random_vec(OC, 45);
  auto dw = dw0, db = db0;
  be->matmul_backward(di.data(), dw.data(), db.data(), w.data(), inp.data(), wt.data(), N, C, OC);
  expect_close(di, fd_inp, 1e-3, "matmul dinp");
  expect_close(diff(dw, dw0), fd_w, 1e-3, "matmul dweight");
  expect_close(diff(db, db0), fd_b, 1e-3, "matmul dbias");
  // Second call: dinp overwritten (same value), dweight and dbias accumulate again.
  const auto di1 = di, dw1 = dw, db1 = db;
  be->matmul_backward(di.data(), dw.data(), db.data(), w.data(), inp.data(), wt.data(), N, C, OC);
  EXPECT_EQ(0, std::memcmp(di.data(), di1.data(), di.size() * sizeof(float)));
  expect_close(diff(dw, dw1), diff(dw1, dw0), 1e-5, "dweight second call");
  expect_close(diff(db, db1), diff(db1, db0), 1e-5, "dbias second call");
  // Null dinp and dbias are skipped.
  auto dw2 = dw0;
  be->matmul_backward(nullptr, dw2.data(), nullptr, w.data(), inp.data(), wt.data(), N, C, OC);
  expect_close(diff(dw2, dw0), fd_w, 1e-3, "matmul dweight (no dinp, dbias)");
}

TEST_F(CpuKernels, MatmulDbiasWideOutput) {  // several channel blocks in the bias sum
  const int N = 9, C = 3, OC = 150;
  auto inp = random_vec(N * C, 46), wt = random_vec(OC * C, 47), dout = random_vec(N * OC, 48);
  std::vector<float> dw(OC * C, 0.0f), db(OC, 0.5f);
  be->matmul_backward(nullptr, dw.data(), db.data(), dout.data(), inp.data(), wt.data(), N, C, OC);
  std::vector<double> ref(OC, 0.5);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) ref[o] += dout[n * OC + o];
  expect_close(db, ref, 1e-5, "dbias");
}

// ---- GELU ----

double gelu_ref(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}

TEST_F(CpuKernels, GeluForwardMatchesReference) {
  auto x = random_vec(10007, 50, -8.0f, 8.0f);
  for (float e : {0.0f, -0.0f, 1e-8f, -1e-8f, 30.0f, -30.0f, 200.0f, -200.0f, 1e30f, -1e30f})
    x.push_back(e);
  std::vector<float> out(x.size());
  be->gelu_forward(out.data(), x.data(), int64_t(x.size()));
  std::vector<double> ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) ref[i] = gelu_ref(x[i]);
  // relative to each value, with an absolute floor of 1e-7·|x| (where gelu(x) ≈ 0 for x ≪ 0)
  int bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double tol = 2e-6 * std::fabs(ref[i]) + 1e-7 * std::fabs(x[i]) + 1e-30;
    if (!(std::fabs(out[i] - ref[i]) <= tol) && ++bad <= 5)
      ADD_FAILURE() << "gelu(" << x[i] << ") = " << out[i] << ", want " << ref[i];
  }
  EXPECT_EQ(bad, 0);
}

TEST_F(CpuKernels, GeluBackwardMatchesFiniteDifferencesAndOverwrites) {
  auto x = random_vec(301, 51, -5.0f, 5.0f), w = random_vec(301, 52);
  std::vector<float> out(x.size());
  auto loss = [&] {
    be->gelu_forward(out.data(), x.data(), int64_t(x.size()));
    return weighted_sum(out, w);
  };
  auto fd = finite_diff(x, loss, 1e-3);
  std::vector<float> dx(x.size(), 3.0f);
  be->gelu_backward(dx.data(), x.data(), w.data(), int64_t(x.size()));
  expect_close(dx, fd, 2e-3, "gelu dinp");
  // and against the analytic derivative in double, tightly
  std::vector<double> ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double X = x[i], k = std::sqrt(2.0 / M_PI);
    const double u = k * (X + 0.044715 * X * X * X), t = std::tanh(u);
    ref[i] = (0.5 * (1 + t) + 0.5 * X * (1 - t * t) * k * (1 + 3 * 0.044715 * X * X)) * w[i];
  }
  expect_close(dx, ref, 1e-5, "gelu dinp (analytic)");
}

// ---- add, scale ----

TEST_F(CpuKernels, AddAndScale) {
  const int64_t n = 10001;
  auto a = random_vec(n, 60), b = random_vec(n, 61);
  std::vector<float> out(n);
  be->add(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  auto a2 = a;
  be->add(a2.data(), a2.data(), b.data(), n);  // out aliases a
  EXPECT_EQ(0, std::memcmp(a2.data(), out.data(), n * sizeof(float)));
  auto b2 = b;
  be->add(b2.data(), a.data(), b2.data(), n);  // out aliases b
  EXPECT_EQ(0, std::memcmp(b2.data(), out.data(), n * sizeof(float)));
  be->scale(out.data(), -0.25f, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], (a[i] + b[i]) * -0.25f);
}

}  // namespace
}  // namespace trellis::test
