// The CUDA backend's kernels other than the GEMMs against the CPU backend on fresh random inputs,
// fp32 tensors: layer norm, attention, element-wise, embeddings, cross-entropy; the profile, and
// the device memory's accounting. The GEMMs are in test_cuda_gemm.cpp, the bf16 kernels in
// test_cuda_bf16_kernels.cpp, the bounds of all in cuda_test_util.hpp. Each test skips when no
// CUDA device is present and prints what it measured.
#include <cctype>
#include <sstream>

#include "core/log.hpp"
#include "cuda_test_util.hpp"
#include "scoped_env.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaKernels : public CudaKernelTest {};

// Widths C = 96 and 768 (GPT-2's) take 16-byte chunks, C = 37 and 201 one value at a time (the
// fused backward with 2 and 8 values a lane); C = 1100 is wider than the fused backward's
// registers hold (1024 fp32 values a warp), so its backward takes the two passes (dinp, then the
// column sums). The forward holds each row in registers at 96 and 768 (2 and 8 chunks a lane);
// at 1100 and 2052 it reads the row again for each sum. N = 2200 rows make 35 blocks' partial
// sums: more than the 32 rows of threads that add them up, so that some add two.
TEST_F(CudaKernels, LayerNorm) {
  // The fused backward's rows a block follow the device's multiprocessors (8 rows for these N on
  // 132); on the emulated GPU, TRELLIS_EMU_SMS=1 makes it 16 and 64 (several rows a warp).
  for (const char* sms : {"132", "1"}) {
    fresh_gpu({{"TRELLIS_EMU_SMS", sms}});
    SCOPED_TRACE(std::string("TRELLIS_EMU_SMS=") + sms);
    for (const auto& [C, N] : {std::pair{96, 67}, std::pair{37, 67}, std::pair{768, 67},
                               std::pair{1100, 67}, std::pair{201, 67}, std::pair{2052, 67},
                               std::pair{96, 2200}}) {
      SCOPED_TRACE("C = " + std::to_string(C) + ", N = " + std::to_string(N));
      auto x = random_vec(size_t(N) * C, 10, -3.f, 3.f), w = random_vec(C, 11),
           b = random_vec(C, 12);
      auto dout = random_vec(size_t(N) * C, 13), dinp0 = random_vec(size_t(N) * C, 14);
      auto dw0 = random_vec(C, 15), db0 = random_vec(C, 16);
      std::vector<float> out(x.size()), mean(N), rstd(N), dinp = dinp0, dw = dw0, db = db0;
      cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                             C);
      cpu->layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), N, C);
      float *d_x = up(x), *d_w = up(w), *d_b = up(b), *d_dout = up(dout), *d_out = up(out),
            *d_mean = up(mean), *d_rstd = up(rstd), *d_dinp = up(dinp0), *d_dw = up(dw0),
            *d_db = up(db0);
      gpu->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C);
      gpu->layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_mean, d_rstd, N, C);
      // (out = (x − mean)·rstd·w + b cancels near zero; the mean of 1100 values summed in
      // another order moves such an entry by a few 1e-7: on an H200, 2.7e-7 at C = 1100 where
      // 1e-5 of a hundredth of the tensor's scale allowed 2.66e-7. Judged against a tenth of it.)
      // (Likewise a row's mean that cancels, judged against a tenth of the largest: at C = 2052 the
      // residual sum's mean[11], -9.3e-4, came out 1.1e-8 off on the emulated GPU — 5.6e-9 of the
      // row's Σ|x| — where a hundredth allowed 1.0e-8.)
      expect_close(down(d_out, out.size()), out, 1e-5, "out", /*floor_frac=*/0.1);
      expect_close(down(d_mean, N), mean, 1e-5, "mean", /*floor_frac=*/0.1);
      expect_close(down(d_rstd, N), rstd, 1e-5, "rstd");
      expect_close(down(d_dinp, dinp.size()), dinp, 1e-5, "dinp");
      // (Σ over N rows in another order — the GPU's warps take every 8th row, then add their sums —
      // so an entry that cancels is off by more than 1e-5 of the tensor's scale: dweight 1.5e-5 at
      // C = 37, dbias 1.2e-5 at C = 768.)
      expect_close(down(d_dw, C), dw, 1e-4, "dweight");
      expect_close(down(d_db, C), db, 1e-4, "dbias");
      // The fused residual add + layer norm, the sum written over its first operand.
      std::vector<float> sum(x.size()), rout(x.size()), rmean(N), rrstd(N);
      cpu->residual_layernorm_forward(sum.data(), rout.data(), rmean.data(), rrstd.data(), x.data(),
                                      dout.data(), w.data(), b.data(), N, C);
      float* d_a = up(x);
      gpu->residual_layernorm_forward(d_a, d_out, d_mean, d_rstd, d_a, d_dout, d_w, d_b, N, C);
      expect_close(down(d_a, sum.size()), sum, 1e-6, "residual sum");
      expect_close(down(d_out, rout.size()), rout, 1e-5, "residual layernorm out", 0.1);
      expect_close(down(d_mean, N), rmean, 1e-5, "residual layernorm mean", 0.1);
      expect_close(down(d_rstd, N), rrstd, 1e-5, "residual layernorm rstd");
    }
  }
}

TEST_F(CudaKernels, Attention) {
  // Grouped heads, T not a multiple of the 32-row tiles, head sizes for each kernel variant.
  for (AttentionShape s : {AttentionShape{2, 70, 4, 2, 16}, AttentionShape{1, 33, 2, 1, 64},
                           AttentionShape{1, 40, 2, 2, 100}, AttentionShape{2, 64, 4, 4, 32}}) {
    SCOPED_TRACE(s.name());
    const AttentionRun cpu_run = attention_on(*cpu, s, 20, nullptr);
    const AttentionRun gpu_run = attention_on(*gpu, s, 20, &cpu_run);
    expect_close(gpu_run.out, cpu_run.out, 1e-4, "attention out");
    expect_close(gpu_run.dqkv, cpu_run.dqkv, 1e-3, "attention dqkv");
  }
}

// More (sequence, head) pairs than a grid's y takes (65535 on a GPU, the backend reads it from the
// device; on the emulated one TRELLIS_EMU_GRID_Y makes it 10, so that a small shape reaches it —
// at a GPU's, 65600 pairs took 35 s emulated): launched in runs of sequences, each the same as
// alone. 5 sequences × 4 heads: runs of 2, 2 and 1 (the fp32 kernels).
TEST_F(CudaKernels, AttentionOverMoreSequencesAndHeadsThanAGridRow) {
  ScopedEnv limit("TRELLIS_EMU_GRID_Y", "10");  // (the launches' limit, and the device's)
  fresh_gpu({});
  for (AttentionShape s : {AttentionShape{5, 70, 4, 2, 16}, AttentionShape{3, 40, 8, 8, 32}}) {
    SCOPED_TRACE(s.name());
    const AttentionRun cpu_run = attention_on(*cpu, s, 21, nullptr);
    const AttentionRun gpu_run = attention_on(*gpu, s, 21, &cpu_run);
    expect_close(gpu_run.out, cpu_run.out, 1e-4, "attention out");
    expect_close(gpu_run.dqkv, cpu_run.dqkv, 1e-3, "attention dqkv");
  }
}

// A count that is a multiple of nothing (one value at a time), and one of 16-byte chunks (add).
TEST_F(CudaKernels, ElementWise) {
  for (const int64_t n : {int64_t(100003), int64_t(100000)}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    auto x = random_vec(n, 30, -6.f, 6.f), y = random_vec(n, 31), d = random_vec(n, 32);
    std::vector<float> g(n), dg(n), sum(n), sc = x;
    cpu->gelu_forward(g.data(), x.data(), n);
    cpu->gelu_backward(dg.data(), x.data(), d.data(), n);
    cpu->add(sum.data(), x.data(), y.data(), n);
    cpu->scale(sc.data(), 0.37f, n);
    float *d_x = up(x), *d_y = up(y), *d_d = up(d), *d_g = up(g), *d_dg = up(dg), *d_sum = up(sum),
          *d_sc = up(x);
    gpu->gelu_forward(d_g, d_x, n);
    gpu->gelu_backward(d_dg, d_x, d_d, n);
    gpu->add(d_sum, d_x, d_y, n);
    gpu->scale(d_sc, 0.37f, n);
    expect_close(down(d_g, n), g, 1e-5, "gelu");
    expect_close(down(d_dg, n), dg, 1e-5, "gelu backward");
    expect_close(down(d_sum, n), sum, 1e-6, "add");
    expect_close(down(d_sc, n), sc, 1e-6, "scale");
  }
}

// C = 24 rows go 16 bytes at a time through the forward passes, C = 22 one value at a time.
TEST_F(CudaKernels, Embeddings) {
  for (const int C : {24, 22}) {
  SCOPED_TRACE("C = " + std::to_string(C));
  const int N = 50, T = 10, vocab_begin = 5, vocab_count = 12, first_row = 3;
  std::vector<int32_t> tokens(N);
  for (int i = 0; i < N; ++i) tokens[i] = (i * 7 + 3) % 20;  // some outside this rank's rows
  auto wte = random_vec(size_t(vocab_count) * C, 40), wpe = random_vec(size_t(T) * C, 41);
  auto dout = random_vec(size_t(N) * C, 42), dwte0 = random_vec(wte.size(), 43),
       dwpe0 = random_vec(wpe.size(), 44);
  std::vector<float> out(size_t(N) * C), dwte = dwte0, dwpe = dwpe0;
  cpu->embedding_forward(out.data(), tokens.data(), wte.data(), N, C, vocab_begin, vocab_count);
  cpu->position_forward(out.data(), wpe.data(), N, T, C, first_row);
  cpu->embedding_backward(dwte.data(), dout.data(), tokens.data(), N, C, vocab_begin, vocab_count);
  cpu->position_backward(dwpe.data(), dout.data(), N, T, C, first_row);
  int32_t* d_tok = up(tokens);
  float *d_wte = up(wte), *d_wpe = up(wpe), *d_dout = up(dout), *d_out = up(out),
        *d_dwte = up(dwte0), *d_dwpe = up(dwpe0);
  gpu->embedding_forward(d_out, d_tok, d_wte, N, C, vocab_begin, vocab_count);
  gpu->position_forward(d_out, d_wpe, N, T, C, first_row);
  gpu->embedding_backward(d_dwte, d_dout, d_tok, N, C, vocab_begin, vocab_count);
  gpu->position_backward(d_dwpe, d_dout, N, T, C, first_row);
  expect_close(down(d_out, out.size()), out, 1e-6, "embedding + position");
  expect_close(down(d_dwte, dwte.size()), dwte, 1e-5, "dwte");
  expect_close(down(d_dwpe, dwpe.size()), dwpe, 1e-5, "dwpe");
  }
}

TEST_F(CudaKernels, CrossEntropyVocabParallel) {
  // A rank's slice: 40 columns from global column 20, the last 7 padding; targets inside, outside
  // the slice and ignored (−1).
  const int N = 31, V = 40, valid = 33, vocab_begin = 20;
  auto logits = random_vec(size_t(N) * V, 50, -8.f, 8.f);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i % 9 == 0 ? -1 : (i * 5) % 60;
  std::vector<float> row_max(N), sums(2 * N), losses(N), work = logits;
  const float dloss = 1.0f / N;
  crossentropy_on(*cpu, work.data(), targets.data(), row_max.data(), sums.data(), losses.data(), N,
                  V, valid, vocab_begin, dloss);
  float* d_logits = up(logits);
  int32_t* d_t = up(targets);
  float *d_max = up(row_max), *d_sums = up(sums), *d_losses = up(losses);
  crossentropy_on(*gpu, d_logits, d_t, d_max, d_sums, d_losses, N, V, valid, vocab_begin, dloss);
  expect_close(down(d_max, N), row_max, 1e-6, "row max");
  expect_close(down(d_sums, 2 * N), sums, 1e-5, "sumexp, target logit");
  expect_close(down(d_losses, N), losses, 1e-5, "losses");
  expect_close(down(d_logits, work.size()), work, 1e-5, "dlogits");
}

// TRELLIS_CUDA_PROFILE=1: each kernel class's time, and its rate on the least work its calls must
// do — a GEMM's 2·m·n·k FLOPs, a layer norm's bytes (input read, output written once, statistics):
// the rate column says TFLOP/s for GEMMs, GB/s for layer norms, and the counted work itself is
// what the shapes say (rate × time, read back from the report, within its printed rounding).
TEST_F(CudaKernels, ProfileReportsRatesOnTheLeastWork) {
  fresh_gpu({{"TRELLIS_CUDA_PROFILE", "1"}});
  const int N = 64, C = 96, OC = 80;
  float *d_out = up(std::vector<float>(size_t(N) * OC)),
        *d_ln = up(std::vector<float>(size_t(N) * C));
  float *d_mean = up(std::vector<float>(N)), *d_rstd = up(std::vector<float>(N));
  const auto x = random_vec(size_t(N) * C, 70), w = random_vec(size_t(OC) * C, 71),
             g = random_vec(C, 72), b = random_vec(C, 73);
  float *d_x = up(x), *d_w = up(w), *d_g = up(g), *d_b = up(b);
  for (int i = 0; i < 3; ++i) {
    gpu->matmul_forward(d_out, d_x, d_w, nullptr, N, C, OC);
    gpu->layernorm_forward(d_ln, d_mean, d_rstd, d_x, d_g, d_b, N, C);
  }
  const std::string report = gpu->profile_report();
  std::printf("%s", report.c_str());
  auto row = [&](const std::string& name) {
    const size_t at = report.find(name);
    return at == std::string::npos ? std::string() : report.substr(at, report.find('\n', at) - at);
  };
  const std::string gemm = row("GEMM (cuBLASLt)"), ln = row("layer norm");
  ASSERT_FALSE(gemm.empty() || ln.empty()) << report;
  EXPECT_NE(gemm.find("TFLOP/s"), std::string::npos) << gemm;
  EXPECT_NE(ln.find("GB/s"), std::string::npos) << ln;
  // Work = rate × time, from the row's numbers: ms, share, calls, rate.
  auto work = [](std::string r, double unit) {
    r = r.substr(r.find("│ ", 4));  // past the class's name
    for (char& c : r)
      if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == '-'))
        c = ' ';
    std::istringstream in(r);
    double ms = 0, share = 0, calls = 0, rate = 0;
    in >> ms >> share >> calls >> rate;
    return std::pair<double, double>(rate * unit * ms / 1e3, ms);
  };
  const auto [gemm_flops, gemm_ms] = work(gemm, 1e12);
  const auto [ln_bytes, ln_ms] = work(ln, 1e9);
  const double want_flops = 3 * 2.0 * N * C * OC, want_bytes = 3 * (2.0 * N * C * 4 + 8.0 * N);
  std::printf("counted work: GEMM %.3g FLOPs (shapes: %.3g), layer norm %.3g bytes (%.3g)\n",
              gemm_flops, want_flops, ln_bytes, want_bytes);
  if (gemm_ms >= 0.1) {
    EXPECT_NEAR(gemm_flops / want_flops, 1.0, 0.5);
  }
  if (ln_ms >= 0.1) {
    EXPECT_NEAR(ln_bytes / want_bytes, 1.0, 0.5);
  }
}

// A benchmark's profile is of its timed steps: reset_profile drops the warm-up (its calls' times
// and its counts of fused or cached calls), pause_profile leaves the reference GEMMs between the
// steps out.
TEST_F(CudaKernels, ProfileResetAndPause) {
  fresh_gpu({{"TRELLIS_CUDA_PROFILE", "1"}});
  const int N = 32, C = 48, OC = 40;
  float *d_out = up(std::vector<float>(size_t(N) * OC)),
        *d_ln = up(std::vector<float>(size_t(N) * C));
  float *d_mean = up(std::vector<float>(N)), *d_rstd = up(std::vector<float>(N));
  float *d_x = up(random_vec(size_t(N) * C, 80)), *d_w = up(random_vec(size_t(OC) * C, 81)),
        *d_g = up(random_vec(C, 82)), *d_b = up(random_vec(C, 83));
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i % OC;
  int32_t* d_t = up(targets);
  float *d_loss = up(std::vector<float>(N)), *d_stats = up(std::vector<float>(3 * N));
  const auto loss = [&] {  // the fused cross-entropy over d_out as logits (N, OC)
    gpu->crossentropy(d_out, d_loss, d_t, d_stats, d_stats + N, d_stats + 2 * N, N, OC, OC, 0.f);
  };
  gpu->matmul_forward(d_out, d_x, d_w, nullptr, N, C, OC);  // the warm-up
  gpu->layernorm_forward(d_ln, d_mean, d_rstd, d_x, d_g, d_b, N, C);
  loss(), loss();
  gpu->reset_profile();
  loss();
  gpu->pause_profile(true);
  gpu->matmul_forward(d_out, d_x, d_w, nullptr, N, C, OC);  // a reference GEMM
  gpu->pause_profile(false);
  gpu->layernorm_forward(d_ln, d_mean, d_rstd, d_x, d_g, d_b, N, C);
  gpu->layernorm_forward(d_ln, d_mean, d_rstd, d_x, d_g, d_b, N, C);
  const std::string report = gpu->profile_report();
  std::printf("%s", report.c_str());
  EXPECT_EQ(report.find("GEMM (cuBLASLt)"), std::string::npos) << report;
  const size_t at = report.find("layer norm");
  ASSERT_NE(at, std::string::npos) << report;
  std::string ln =
      report.substr(at, report.find('\n', at) - at);  // name │ ms │ share │ calls │ rate
  for (int bar = 0; bar < 3; ++bar) ln = ln.substr(ln.find("│") + std::string("│").size());
  EXPECT_EQ(std::stoi(ln), 2) << "calls: " << ln;
  const size_t cached = report.find("cross-entropy calls with rows in shared memory");
  ASSERT_NE(cached, std::string::npos) << report;
  EXPECT_NE(report.substr(cached, report.find('\n', cached) - cached).find(" of 1 "),
            std::string::npos)
      << report;
}

TEST_F(CudaKernels, MemoryIsOnTheDeviceAndCounted) {
  EXPECT_TRUE(gpu->on_device());
  const int64_t before = memory_stats().current[int(MemKind::Scratch)];
  {
    Buffer b(MemKind::Scratch, 1 << 20, gpu->allocator());
    EXPECT_EQ(memory_stats().current[int(MemKind::Scratch)], before + (1 << 20));
    std::vector<float> zeros(1 << 18, 1.f);
    gpu->copy_to_host(zeros.data(), b.data(), b.bytes());
    for (float z : zeros) ASSERT_EQ(z, 0.f);  // zero-filled, as host Buffers
  }
  EXPECT_EQ(memory_stats().current[int(MemKind::Scratch)], before);
}

// cuBLASLt's workspace is the backend's own counted allocation (trellis plan counts it too), the
// driver's figures are the device's, and a request beyond the device says so: which device, how
// much was asked for, what was free.
TEST_F(CudaKernels, WorkspaceIsCountedAndRunningOutOfMemorySaysSo) {
  EXPECT_GE(memory_stats().current[int(MemKind::Scratch)], int64_t(kGemmWorkspaceBytes));
  const Backend::MemoryInfo info = gpu->memory_info();
  ASSERT_GT(info.total, 0u);
  EXPECT_LE(info.free, info.total);
  const int64_t before = memory_stats().total_current;
  try {
    Buffer b(MemKind::Scratch, info.total + 1, gpu->allocator());
    FAIL() << "more than the device's memory allocated";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("out of GPU memory on device ", 0), 0u) << what;
    EXPECT_NE(what.find("a request for " + format_bytes(double(info.total + 1))), std::string::npos)
        << what;
    EXPECT_NE(what.find(" free of "), std::string::npos) << what;
  }
  EXPECT_EQ(memory_stats().total_current, before);
  // The device is usable after the failure: the error is not left for the next kernel launch's
  // check (cudaGetLastError) to report.
  Buffer ok(MemKind::Scratch, 1 << 20, gpu->allocator());
  gpu->scale(ok.f32(), 2.f, (1 << 20) / 4);
  gpu->synchronize();
}

// An event query that finds the device still busy returns cudaErrorNotReady, and some runtimes
// leave that as the thread's last error too (the emulated GPU's does), where a kernel launch's
// check (cudaGetLastError) would take it for its own failure: every launch check lets it pass
// (cuda_util.cuh, launch_error) — the NCCL link's waits and the kernel ways' timing query events
// while the device works. Which a real runtime does is printed for docs/gpus.md.
TEST_F(CudaKernels, ALaunchRightAfterAQueryThatFoundTheDeviceBusyPasses) {
  const std::vector<float> x = random_vec(1000, 21);
  float* d_x = up(x);
  CudaQueryProbe probe;
  ASSERT_NO_THROW(probe = cuda_query_probe(*gpu, d_x, int64_t(x.size())));
  EXPECT_TRUE(probe.busy) << "an event recorded behind 200 ms of held stream was reached already";
  std::printf("an event query's \"not ready\": %s the thread's last error on this runtime\n",
              probe.last_error_set ? "left as" : "not left as");
  EXPECT_EQ(down(d_x, x.size()), x);
}

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
