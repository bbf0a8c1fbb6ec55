// CPU backend on several threads: the WorkerPool runs every index once (nested calls serially), cuts
// the work in proportion to the threads' measured speeds, and every kernel gives bitwise the same
// results on 1, 2 and 3 threads, with equal or uneven shares. (Small GEMMs take OpenBLAS's
// small-matrix path, which may round differently with the size of a call, so of the tiny linear
// layers only the bias gradient is compared bitwise; products large enough to be split unevenly
// are compared in full.)
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend_test_util.hpp"

namespace trellis::test {
namespace {

TEST(CpuWorkerPool, RunsEachPartOnceAndNestsSerially) {
  cpu::WorkerPool pool;
  for (int threads : {1, 3, 2}) {
    pool.resize(threads);
    ASSERT_EQ(pool.size(), threads);
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<std::atomic<int>> hits(threads);
      std::atomic<int> inner{0};
      pool.run([&](int p) {
        hits[p].fetch_add(1);
        pool.run([&](int) { inner.fetch_add(1); });  // nested: runs on this thread
      });
      for (int p = 0; p < threads; ++p) EXPECT_EQ(hits[p].load(), 1) << threads << " " << p;
      EXPECT_EQ(inner.load(), threads * threads);
    }
    std::vector<int> owner(1000, -1);
    cpu::parallel_for(pool, "test", int64_t(owner.size()), [&](int64_t i) { owner[i] += 1; });
    for (int v : owner) EXPECT_EQ(v, 0);
  }
}

/// Busy for `us` microseconds (a sleep would free the core and measure nothing).
void spin_for(double us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < until) {
  }
}

TEST(CpuWorkerPool, SharesFollowTheThreadsSpeeds) {
  cpu::WorkerPool pool;
  pool.resize(2);
  EXPECT_EQ(pool.cut(0, 1000), 0);
  EXPECT_EQ(pool.cut(1, 1000), 500);
  EXPECT_EQ(pool.cut(2, 1000), 1000);
  // Part 0's indices cost three times part 1's: the pool learns that thread 0 does a third as
  // much per second and gives it less (at most the cap of 1.6× below an equal share).
  for (int job = 0; job < 30; ++job)
    cpu::parallel_parts(pool, "test", 200, [](int part, int64_t lo, int64_t hi) {
      spin_for(double(hi - lo) * (part == 0 ? 15.0 : 5.0));
    });
  const int64_t first = pool.cut(1, 1000);
  EXPECT_LT(first, 450);
  EXPECT_GE(first, 1000 / (1 + 1.6 * 1.6) - 1);
  // Aligned cuts, and every part keeps at least one block however skewed the speeds.
  pool.fix_speeds({1.0, 1000.0});
  EXPECT_EQ(pool.cut(1, 1000, 64), 64);
  EXPECT_EQ(pool.cut(1, 3), 1);
  pool.fix_speeds({1.0, 3.0});
  EXPECT_EQ(pool.cut(1, 1024, 64), 256);
  EXPECT_EQ(pool.cut(2, 1024, 64), 1024);
  pool.reset_speeds();
  EXPECT_EQ(pool.cut(1, 1000), 500);
}

TEST(CpuThreads, DefaultThreadsShareTheNodeAmongUnboundRanks) {
  // With no BLAS thread count in the environment, a rank uses the cores it may run on, or, when
  // it may run on all of the node's (started unbound), its share of them.
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) saved.emplace_back(var, v);
    unsetenv(var);
  }
  cpu_set_t mask;
  ASSERT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
  const int mine = CPU_COUNT(&mask), node = int(std::thread::hardware_concurrency());
  for (int ranks : {1, 2, 4}) {
    auto be = make_backend("cpu", 0, ranks);
    const int want = ranks > 1 && mine >= node ? std::max(1, mine / ranks) : mine;
    EXPECT_EQ(dynamic_cast<CpuBackend&>(*be).worker_pool().size(), want) << ranks << " ranks";
    be->set_threads(0);  // the deck's default keeps it
    EXPECT_EQ(dynamic_cast<CpuBackend&>(*be).worker_pool().size(), want) << ranks << " ranks";
  }
  for (const auto& [var, value] : saved) setenv(var.c_str(), value.c_str(), 1);
}

/// The backend's pool on `threads` threads; `speeds` (one per thread) fixes uneven shares.
std::unique_ptr<Backend> cpu_backend(int threads, const std::vector<double>& speeds = {}) {
  auto be = make_backend("cpu");
  be->set_threads(threads);
  auto& pool = dynamic_cast<CpuBackend&>(*be).worker_pool();
  if (!speeds.empty()) pool.fix_speeds(speeds);
  else pool.fix_speeds(std::vector<double>(pool.size(), 1.0));
  return be;
}

/// Every kernel once on `threads` threads, all outputs concatenated.
std::vector<float> run_all(int threads, const std::vector<double>& speeds = {}) {
  auto be = cpu_backend(threads, speeds);
  const int B = 3, T = 70, C = 40, V = 29, H = 4, KV = 2, hd = 10, OC = 130;
  const int N = B * T;
  const int CE = 200;  // embedding width: 4 channel blocks, so 2 and 3 threads both split them
  const int R = (H + 2 * KV) * hd;
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 7) % (V - 2);  // real columns only (2 pad)
  tok[5] = -1;  // one ignored target
  auto wte = random_vec(size_t(V) * CE, 1), wpe = random_vec(size_t(T) * CE, 2);
  auto x = random_vec(size_t(N) * C, 3, -2.0f, 2.0f), w = random_vec(C, 4), bias = random_vec(C, 5);
  auto dout = random_vec(size_t(N) * C, 6), dembed = random_vec(size_t(N) * CE, 15);
  auto W = random_vec(size_t(OC) * C, 7), bo = random_vec(OC, 8), dO = random_vec(size_t(N) * OC, 9);
  auto qkv = random_vec(size_t(N) * R, 10, -2.0f, 2.0f), datt = random_vec(size_t(N) * H * hd, 11);
  auto big = random_vec(100003, 12, -3.0f, 3.0f), big2 = random_vec(100003, 13);
  auto logits = random_vec(size_t(N) * V, 14, -4.0f, 4.0f);

  std::vector<float> out;
  auto append = [&](const std::vector<float>& v) { out.insert(out.end(), v.begin(), v.end()); };
  // Embeddings of vocabulary rows [5, 25) (other tokens give zero rows); positions of rows
  // [7, N) of the batch, which start mid-sequence.
  const int vb = 5, vc = 20, first = 7, rows = N - first;
  std::vector<float> enc(size_t(N) * CE), dwte(size_t(vc) * CE, 0.5f), dwpe(wpe.size(), 0.25f);
  be->embedding_forward(enc.data(), tok.data(), wte.data() + vb * CE, N, CE, vb, vc);
  be->position_forward(enc.data() + first * CE, wpe.data(), rows, T, CE, first);
  be->embedding_backward(dwte.data(), dembed.data(), tok.data(), N, CE, vb, vc);
  be->position_backward(dwpe.data(), dembed.data() + first * CE, rows, T, CE, first);
  append(enc), append(dwte), append(dwpe);
  std::vector<float> ln(size_t(N) * C), mean(N), rstd(N), dx(size_t(N) * C, 1.0f), dw(C, 0.5f),
      db(C, 0.5f);
  be->layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), N, C);
  be->layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
  append(ln), append(mean), append(rstd), append(dx), append(dw), append(db);
  std::vector<float> rsum(size_t(N) * C), rln(size_t(N) * C), rmean(N), rrstd(N);
  be->residual_layernorm_forward(rsum.data(), rln.data(), rmean.data(), rrstd.data(), x.data(),
                                 dout.data(), w.data(), bias.data(), N, C);
  append(rsum), append(rln), append(rmean), append(rrstd);
  std::vector<float> mo(size_t(N) * OC), mdx(size_t(N) * C), mdw(W.size(), 0.5f), mdb(OC, 0.5f);
  be->matmul_forward(mo.data(), x.data(), W.data(), bo.data(), N, C, OC);
  be->matmul_backward(mdx.data(), mdw.data(), mdb.data(), dO.data(), x.data(), W.data(), N, C, OC);
  append(mo), append(mdx), append(mdw), append(mdb);
  std::vector<float> ao(size_t(N) * H * hd), att(size_t(B) * H * T * T), dqkv(qkv.size(), 7.0f);
  be->attention_forward(ao.data(), att.data(), qkv.data(), B, T, H, KV, hd);
  be->attention_backward(dqkv.data(), datt.data(), qkv.data(), ao.data(), att.data(), B, T, H, KV,
                         hd);
  append(ao), append(att), append(dqkv);
  std::vector<float> g(big.size()), dg(big.size()), s(big.size());
  be->gelu_forward(g.data(), big.data(), int64_t(big.size()));
  be->gelu_backward(dg.data(), big.data(), big2.data(), int64_t(big.size()));
  be->add(s.data(), big.data(), big2.data(), int64_t(big.size()));
  be->scale(s.data(), 0.5f, int64_t(big.size()));
  append(g), append(dg), append(s);
  // Cross-entropy over V columns of which the last 2 are padding.
  std::vector<float> losses(N), row_max(N), sumexp(N), target_logit(N);
  be->crossentropy_max(logits.data(), row_max.data(), N, V, V - 2);
  be->crossentropy_sums(logits.data(), tok.data(), row_max.data(), sumexp.data(),
                        target_logit.data(), N, V, V - 2, 0);
  be->crossentropy_finish(logits.data(), losses.data(), tok.data(), row_max.data(), sumexp.data(),
                          target_logit.data(), N, V, V - 2, 0, 0.01f);
  append(logits), append(losses), append(row_max), append(sumexp), append(target_logit);
  const double ss = be->sum_squares(big.data(), int64_t(big.size()));
  out.push_back(float(ss)), out.push_back(float(ss - double(float(ss))));
  std::vector<float> p(big), m(big.size(), 0.1f), v(big.size(), 0.2f);
  be->adamw(p.data(), big2.data(), m.data(), v.data(), int64_t(p.size()), 1e-3f, 0.9f, 0.95f, 1e-8f,
            0.1f, 0.1f, 0.05f, 0.5f);
  append(p), append(m), append(v);
  be->set_threads(1);
  return out;
}

/// Index of the first element where a and b differ bitwise (a.size() when none).
size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size();
}

TEST(CpuThreads, EveryKernelBitwiseIndependentOfThreadCount) {
  const auto one = run_all(1);
  for (int threads : {2, 3}) {
    const auto many = run_all(threads);
    EXPECT_EQ(first_difference(one, many), one.size()) << threads << " threads";
  }
  // Uneven shares (as on a machine where one core is slower) change nothing either.
  EXPECT_EQ(first_difference(one, run_all(2, {1.0, 1.6})), one.size()) << "2 threads, uneven";
  EXPECT_EQ(first_difference(one, run_all(3, {1.5, 1.0, 0.7})), one.size()) << "3 threads, uneven";
}

/// A linear layer's forward (with and without a residual) and backward, large enough for its GEMMs
/// to be cut unevenly (the weight gradient has fewer rows than columns: split by columns), all
/// outputs concatenated.
std::vector<float> linear_layer(int threads, const std::vector<double>& speeds = {}) {
  auto be = cpu_backend(threads, speeds);
  const int N = 512, C = 512, OC = 256;
  auto x = random_vec(size_t(N) * C, 21), W = random_vec(size_t(OC) * C, 22), b = random_vec(OC, 23);
  auto dO = random_vec(size_t(N) * OC, 24);
  std::vector<float> out(size_t(N) * OC), dx(size_t(N) * C), dW(W.size(), 0.5f), db(OC, 0.25f);
  be->matmul_forward(out.data(), x.data(), W.data(), b.data(), N, C, OC);
  be->matmul_backward(dx.data(), dW.data(), db.data(), dO.data(), x.data(), W.data(), N, C, OC);
  // A forward product with fewer rows than columns, split by columns: y (N/2, C) = dO[:N/2]·W'ᵀ
  // with W read as (C, OC).
  std::vector<float> y(size_t(N / 2) * C);
  be->matmul_forward(y.data(), dO.data(), W.data(), nullptr, N / 2, OC, C);
  // The forward ending in a residual add: each part's rows start at residual + bias.
  std::vector<float> res_out(out.size());
  be->matmul_residual_forward(res_out.data(), dO.data(), x.data(), W.data(), b.data(), N, C, OC);
  out.insert(out.end(), dx.begin(), dx.end());
  out.insert(out.end(), y.begin(), y.end());
  out.insert(out.end(), res_out.begin(), res_out.end());
  out.insert(out.end(), dW.begin(), dW.end());
  out.insert(out.end(), db.begin(), db.end());
  return out;
}

TEST(CpuThreads, LargeLinearLayerBitwiseIndependentOfShares) {
  const auto one = linear_layer(1);
  for (const auto& speeds : std::vector<std::vector<double>>{{1.0, 1.0}, {1.0, 1.6}, {1.6, 1.0}}) {
    EXPECT_EQ(first_difference(one, linear_layer(2, speeds)), one.size())
        << "speeds " << speeds[0] << " " << speeds[1];
  }
  EXPECT_EQ(first_difference(one, linear_layer(3, {1.0, 1.4, 0.8})), one.size()) << "3 threads";
}

/// A tiny model's layer on `threads` threads — N rows of width C, a hidden width OC, a
/// vocabulary of V columns (the first `valid` real), heads of C/4 channels over sequences of 32 —
/// every kernel of its step once, all outputs concatenated. Its products are small (M·N·K of
/// 10^5 to a few 10^6), where OpenBLAS's small-matrix kernels add otherwise for other rows.
std::vector<float> tiny_layer(int threads, int N, int C, int OC, int V, int valid) {
  auto be = cpu_backend(threads);
  auto x = random_vec(size_t(N) * C, 3), W = random_vec(size_t(OC) * C, 7), b = random_vec(OC, 8);
  auto dO = random_vec(size_t(N) * OC, 9), res = random_vec(size_t(N) * OC, 10);
  std::vector<float> out;
  auto append = [&](const std::vector<float>& v) { out.insert(out.end(), v.begin(), v.end()); };
  // Forward: with a GELU, with a residual, plain, and without a bias (the LM head's).
  std::vector<float> pre(size_t(N) * OC), g(size_t(N) * OC), ro(size_t(N) * OC), mo(size_t(N) * OC);
  be->matmul_gelu_forward(pre.data(), g.data(), x.data(), W.data(), b.data(), N, C, OC);
  be->matmul_residual_forward(ro.data(), res.data(), x.data(), W.data(), b.data(), N, C, OC);
  be->matmul_forward(mo.data(), x.data(), W.data(), nullptr, N, C, OC);
  append(pre), append(g), append(ro), append(mo);
  // Backward: plain (with and without a bias), and through the GELU from a projection back to C.
  std::vector<float> dx(size_t(N) * C), dW(W.size(), 0.5f), db(OC, 0.5f);
  be->matmul_backward(dx.data(), dW.data(), db.data(), dO.data(), x.data(), W.data(), N, C, OC);
  append(dx), append(dW), append(db);
  be->matmul_backward(dx.data(), dW.data(), nullptr, dO.data(), x.data(), W.data(), N, C, OC);
  append(dx), append(dW);
  auto W2 = random_vec(size_t(C) * OC, 12), dout = random_vec(size_t(N) * C, 13);
  std::vector<float> dpre(size_t(N) * OC), scratch(size_t(N) * OC), dW2(W2.size(), 0.5f), db2(C, 0.5f),
      dbpre(OC, 0.25f);
  be->matmul_backward_gelu(dpre.data(), scratch.data(), dW2.data(), db2.data(), dbpre.data(),
                           dout.data(), g.data(), pre.data(), W2.data(), N, OC, C);
  append(dpre), append(dW2), append(db2), append(dbpre);
  // Attention over sequences of 32, and a layer norm.
  const int T = 32, B = N / T, H = 4, hd = C / H, R = 3 * H * hd;
  auto qkv = random_vec(size_t(N) * R, 14, -2.0f, 2.0f), datt = random_vec(size_t(N) * C, 15);
  std::vector<float> ao(size_t(N) * C), att(size_t(B) * H * T * T), dqkv(qkv.size(), 0.0f);
  be->attention_forward(ao.data(), att.data(), qkv.data(), B, T, H, H, hd);
  be->attention_backward(dqkv.data(), datt.data(), qkv.data(), ao.data(), att.data(), B, T, H, H, hd);
  append(ao), append(att), append(dqkv);
  auto w = random_vec(C, 4), bias = random_vec(C, 5);
  std::vector<float> ln(size_t(N) * C), mean(N), rstd(N), dln(size_t(N) * C, 1.0f), dw(C, 0.5f),
      dbl(C, 0.5f);
  be->layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), N, C);
  be->layernorm_backward(dln.data(), dw.data(), dbl.data(), dout.data(), x.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
  append(ln), append(dln), append(dw), append(dbl);
  // The fused cross-entropy over a padded vocabulary.
  auto logits = random_vec(size_t(N) * V, 16, -4.0f, 4.0f);
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 7) % valid;
  std::vector<float> losses(N), row_max(N), sumexp(N), target_logit(N);
  be->crossentropy(logits.data(), losses.data(), tok.data(), row_max.data(), sumexp.data(),
                   target_logit.data(), N, V, valid, 0.01f);
  append(logits), append(losses);
  be->set_threads(1);
  return out;
}

/// A linear layer's forward on rows too few to cut (a generation step, a short prompt's prefill):
/// by chunks of columns that the threads share. With a GELU, with a residual, plain; all outputs
/// concatenated.
std::vector<float> few_rows(int threads, int N, int C, int OC, const std::vector<double>& speeds = {}) {
  auto be = cpu_backend(threads, speeds);
  auto x = random_vec(size_t(N) * C, 31), W = random_vec(size_t(OC) * C, 32), b = random_vec(OC, 33);
  auto res = random_vec(size_t(N) * OC, 34);
  std::vector<float> pre(size_t(N) * OC), g(size_t(N) * OC), ro(size_t(N) * OC), mo(size_t(N) * OC);
  be->matmul_gelu_forward(pre.data(), g.data(), x.data(), W.data(), b.data(), N, C, OC);
  be->matmul_residual_forward(ro.data(), res.data(), x.data(), W.data(), b.data(), N, C, OC);
  be->matmul_forward(mo.data(), x.data(), W.data(), nullptr, N, C, OC);
  std::vector<float> out;
  for (const auto* v : {&pre, &g, &ro, &mo}) out.insert(out.end(), v->begin(), v->end());
  be->set_threads(1);
  return out;
}

TEST(CpuThreads, FewRowsBitwiseIndependentOfThreadCount) {
  // (N, C, OC): a few rows and a tile's worth (sgemm by chunks, the last chunk short: 600 = 256 +
  // 256 + 88), and one row (a generation step: one sgemv, OpenBLAS's own threads).
  for (const auto& s : std::vector<std::vector<int>>{
           {1, 512, 600}, {2, 64, 600}, {3, 512, 1030}, {17, 96, 600}, {48, 128, 777}}) {
    const auto one = few_rows(1, s[0], s[1], s[2]);
    for (int threads : {2, 3, 5})
      EXPECT_EQ(first_difference(one, few_rows(threads, s[0], s[1], s[2])), one.size())
          << "N " << s[0] << ", C " << s[1] << ", OC " << s[2] << ": " << threads << " threads";
    EXPECT_EQ(first_difference(one, few_rows(2, s[0], s[1], s[2], {1.0, 1.7})), one.size())
        << "N " << s[0] << ": 2 threads, uneven";
  }
}

TEST(CpuThreads, TinyModelsKernelsBitwiseIndependentOfThreadCount) {
  // (N, C, OC, V, valid): the default deck's and smaller models' layers, rows that end in a
  // short tile of 48 (N = 128: 48 + 48 + 32) or fill whole ones (N = 96). At 5 and 8 threads
  // some products are cut in fewer parts than threads (N = 512: 8.4e6 multiply-adds in 5 parts,
  // one part per thread leaving a part of 32 rows on the small-matrix path).
  const std::vector<std::vector<int>> shapes = {
      {128, 64, 192, 64, 32}, {128, 64, 256, 64, 32}, {64, 32, 128, 32, 29}, {96, 40, 160, 64, 50},
      {512, 64, 256, 64, 32}, {1024, 64, 256, 64, 32}};
  for (const auto& s : shapes) {
    const auto one = tiny_layer(1, s[0], s[1], s[2], s[3], s[4]);
    for (int threads : {2, 3, 5, 8})
      EXPECT_EQ(first_difference(one, tiny_layer(threads, s[0], s[1], s[2], s[3], s[4])),
                one.size())
          << "N " << s[0] << ", C " << s[1] << ", OC " << s[2] << ": " << threads << " threads";
  }
}

}  // namespace
}  // namespace trellis::test
