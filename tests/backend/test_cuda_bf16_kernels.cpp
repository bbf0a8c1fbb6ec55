// Every CUDA kernel on bf16 tensors (system.precision = bf16) against the CPU backend's widened
// reference on the same bf16 inputs: GEMMs, the bias gradients' column sums, element-wise,
// embeddings, cross-entropy, conversions (layer norm: test_cuda_bf16_layernorm.cpp; attention:
// test_cuda_bf16_attention.cpp). The bounds are in cuda_test_util.hpp.
// Each test skips when no CUDA device is present and prints what it measured.
#include <bit>

#include "cuda_test_util.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaBf16Kernels : public CudaKernelTest {};

// bf16 GEMMs (cuBLASLt: bf16 A and B, fp32 accumulation; out and dinp bf16, the bias bf16 added
// in fp32 by the epilogue before out is rounded; dweight and dbias fp32, accumulated into) against
// the CPU's widening reference on the same bf16 values: 5e-4 for the GEMMs' fp32 part, plus one
// bf16 unit for bf16 outputs (the top of the file); dbias (column sums of dout) 1e-5. Shapes with
// no dimension a multiple of the GEMM tiles, and one with C = 768. Then without a bias, dweight
// alone (dinp null), and a call with an fp32 bias among bf16 tensors (a mix: the Backend's
// widening default on both sides, so the fp32 GEMM's bound).
TEST_F(CudaBf16Kernels, Bf16MatmulMatchesTheCpu) {
  gpu->set_precision("bf16");
  for (auto [N, C, OC] :
       {std::tuple{37, 29, 53}, std::tuple{256, 64, 192}, std::tuple{96, 768, 80}}) {
    SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << OC);
    std::printf("bf16 matmul %dx%dx%d:\n", N, C, OC);
    const Bits inp = bf16_random(size_t(N) * C, 1), w = bf16_random(size_t(OC) * C, 2),
               b = bf16_random(OC, 3), dout = bf16_random(size_t(N) * OC, 4);
    const auto dw0 = random_vec(size_t(OC) * C, 5), db0 = random_vec(OC, 6);  // fp32, += into
    Bits out(size_t(N) * OC), dinp(size_t(N) * C);
    std::vector<float> dw = dw0, db = db0;
    cpu->matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
    cpu->matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N, C,
                         OC);
    bf16_t *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_dout = up(dout);
    bf16_t *d_out = up(bf16_nan(out.size())), *d_dinp = up(bf16_nan(dinp.size()));
    float *d_dw = up(dw0), *d_db = up(db0);
    gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
    gpu->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC);
    expect_bf16(down_bits(d_out, out.size()), out, 5e-4, "out");
    expect_bf16(down_bits(d_dinp, dinp.size()), dinp, 5e-4, "dinp");
    expect_f32(down(d_dw, dw.size()), dw, 5e-4, "dweight (+=)");
    expect_f32(down(d_db, db.size()), db, 1e-5, "dbias (+=)");
    // Without a bias (no epilogue), and dweight alone.
    cpu->matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
    gpu->matmul_forward(d_out, d_inp, d_w, nullptr, N, C, OC);
    expect_bf16(down_bits(d_out, out.size()), out, 5e-4, "out without bias");
    // Ending in a residual add: the residual is the GEMM's C, so out is rounded once, from the
    // fp32 sum — against the fp32 function of the same bf16 values, rounded once.
    const Bits res = bf16_random(out.size(), 8);
    std::vector<float> ref(out.size());
    cpu->matmul_residual_forward(ref.data(), widen(res).data(), widen(inp).data(), widen(w).data(),
                                 widen(b).data(), N, C, OC);
    gpu->matmul_residual_forward(d_out, up(res), d_inp, d_w, d_b, N, C, OC);
    expect_bf16(down_bits(d_out, out.size()), bits_of(ref), 5e-4, "out with a residual");
    dw = dw0;
    cpu->matmul_backward(nullptr, dw.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
    gpu->copy_from_host(d_dw, dw0.data(), dw0.size() * sizeof(float));
    gpu->matmul_backward(nullptr, d_dw, nullptr, d_dout, d_inp, d_w, N, C, OC);
    expect_f32(down(d_dw, dw.size()), dw, 5e-4, "dweight without dinp");
    // An fp32 bias with bf16 tensors: widened, the fp32 GEMM (TF32 where TRELLIS_TF32=1, whose
    // error changes many roundings: no bound on how many then).
    const std::vector<float> b32 = random_vec(OC, 7);
    cpu->matmul_forward(out.data(), inp.data(), w.data(), b32.data(), N, C, OC);
    gpu->matmul_forward(d_out, d_inp, d_w, up(b32), N, C, OC);
    expect_bf16(down_bits(d_out, out.size()), out, gemm_rtol(), "out with an fp32 bias (widened)",
                gemm_rtol() > 1e-3 ? 1.0 : 0.1);
  }
}

// system.precision names the type of the run's tensors (dtype(): the model allocates its
// activations and parameter copies in it); the kernels go by the types of the tensors they are
// handed, so fp32 tensors run the fp32 kernels whatever the setting (there is no more "bf16 GEMM
// operands on fp32 tensors"): with precision bf16 an fp32 GEMM meets the fp32 bound, 1e-4 per
// entry, which rounding its operands to bf16 would break (2⁻⁹ on both operands of every product:
// ≈ 2e-3 relative per entry).
TEST_F(CudaBf16Kernels, PrecisionNamesTheTypeAndFp32TensorsStayFp32) {
  EXPECT_EQ(gpu->precision(), "fp32");
  EXPECT_EQ(gpu->dtype(), DType::f32);
  gpu->set_precision("bf16");
  EXPECT_EQ(gpu->precision(), "bf16");
  EXPECT_EQ(gpu->dtype(), DType::bf16);
  EXPECT_THROW(gpu->set_precision("fp16"), UserError);
  const int N = 64, C = 256, OC = 96;
  auto inp = random_vec(size_t(N) * C, 80), w = random_vec(size_t(OC) * C, 81),
       b = random_vec(OC, 82);
  std::vector<float> out(size_t(N) * OC);
  cpu->matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
  float* d_out = up(std::vector<float>(out.size(), NAN));
  gpu->matmul_forward(d_out, up(inp), up(w), up(b), N, C, OC);
  const auto got = down(d_out, out.size());
  expect_f32(got, out, gemm_rtol(), "fp32 out with precision bf16");
  std::printf("  rel. L2 error %.2e (bf16 operands would give ≈ 2e-3)\n", relative_l2(got, out));
  gpu->set_precision("fp32");
  EXPECT_EQ(gpu->dtype(), DType::f32);
}

// The linear layers' bias gradients (matmul_backward's dbias by the column-sum kernels, the
// default) bit for bit against their order written out on the host: per chunk of 256 rows each
// column summed in row order (fp32, from 0), the chunks' sums added by 32 rows of threads (chunk
// k by row k mod 32, in order), those 32 sums in order, then added to dbias. N = 1003: 4 chunks,
// the last partial, 3 rows past the kernel's batches of 8. OC = 776 takes 16-byte chunks of
// columns (fp32 and bf16), 770 one value a thread, as does dout one element off alignment.
TEST_F(CudaBf16Kernels, BiasGradientsAreColumnSumsInAFixedOrder) {
  const int N = 1003, C = 8, kRows = 256, kThreadRows = 32;
  fresh_gpu({{"TRELLIS_BGRAD_EPILOGUE", "0"}});
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    gpu->set_precision(precision);
    const bool bf16 = std::string(precision) == "bf16";
    for (const int OC : {776, 770}) {
      for (const int offset : {0, 1}) {
        SCOPED_TRACE("OC = " + std::to_string(OC) + ", offset " + std::to_string(offset));
        const std::vector<float> dout_f = random_vec(size_t(N) * OC + 1, 40);
        const Bits dout_b = bits_of(dout_f);
        const std::vector<float> dout = bf16 ? widen(dout_b) : dout_f;  // as the GPU reads it
        const std::vector<float> db0 = random_vec(OC, 41);
        std::vector<float> want(OC);
        const int chunks = (N + kRows - 1) / kRows;
        for (int c = 0; c < OC; ++c) {
          std::vector<float> partial(chunks, 0.0f);
          for (int r = 0; r < N; ++r)
            partial[r / kRows] += dout[size_t(offset) + size_t(r) * OC + c];
          float total = 0.0f;
          for (int y = 0; y < kThreadRows; ++y) {
            float acc = 0.0f;
            for (int k = y; k < chunks; k += kThreadRows) acc += partial[k];
            total += acc;
          }
          want[c] = db0[c] + total;
        }
        float *d_dw = up(std::vector<float>(size_t(OC) * C, 0.0f)), *d_db = up(db0);
        if (bf16) {
          bf16_t *d_dout = up(dout_b), *d_inp = up(bf16_random(size_t(N) * C, 42)),
                 *d_w = up(bf16_random(size_t(OC) * C, 43));
          gpu->matmul_backward(nullptr, d_dw, d_db, d_dout + offset, d_inp, d_w, N, C, OC);
        } else {
          float *d_dout = up(dout_f), *d_inp = up(random_vec(size_t(N) * C, 42)),
                *d_w = up(random_vec(size_t(OC) * C, 43));
          gpu->matmul_backward(nullptr, d_dw, d_db, d_dout + offset, d_inp, d_w, N, C, OC);
        }
        const std::vector<float> got = down(d_db, OC);
        int differ = 0;
        for (int c = 0; c < OC; ++c)
          differ += std::bit_cast<uint32_t>(got[c]) != std::bit_cast<uint32_t>(want[c]);
        std::printf("bias gradient %dx%d %s, dout %d off: %d of %d differ from the fixed order\n",
                    N, OC, precision, offset, differ, OC);
        EXPECT_EQ(differ, 0);
      }
    }
  }
}

// bf16 GELU (forward; backward in place of dout, as the model calls it) and add (in place of a) on
// a count that is a multiple of nothing, and one of 8: the GELU to the fp32 bound 1e-5 plus one
// bf16 unit; add is one fp32 addition of the same two values on both sides, rounded alike: the
// same bits.
TEST_F(CudaBf16Kernels, Bf16ElementWise) {
  gpu->set_precision("bf16");
  for (const int64_t n : {int64_t(100003), int64_t(100000)}) {  // (the second: 16-byte chunks)
    SCOPED_TRACE("n = " + std::to_string(n));
    const Bits x = bf16_random(n, 30, -6.f, 6.f), y = bf16_random(n, 31), d = bf16_random(n, 32);
    Bits g(n), dg = d, sum = x;
    cpu->gelu_forward(g.data(), x.data(), n);
    cpu->gelu_backward(dg.data(), x.data(), dg.data(), n);
    cpu->add(sum.data(), sum.data(), y.data(), n);
    bf16_t *d_x = up(x), *d_y = up(y), *d_g = up(bf16_nan(n)), *d_dg = up(d), *d_sum = up(x);
    gpu->gelu_forward(d_g, d_x, n);
    gpu->gelu_backward(d_dg, d_x, d_dg, n);
    gpu->add(d_sum, d_sum, d_y, n);
    std::printf("bf16 element-wise, n = %lld:\n", (long long)n);
    expect_bf16(down_bits(d_g, n), g, 1e-5, "gelu");
    expect_bf16(down_bits(d_dg, n), dg, 1e-5, "gelu backward (in place of dout)");
    expect_same_bits(down_bits(d_sum, n), sum, "add (in place of a)");
  }
}

// bf16 embeddings: the token rows copied (other ranks' tokens: 0) into a poisoned out, then the
// position rows added in fp32 and rounded — the same copy and the same single addition on both
// sides: the same bits; dwte and dwpe fp32 (+=) from bf16 dout: 1e-5 (repeated token rows added
// in another order than the CPU's: test_cuda_embedding.cpp).
TEST_F(CudaBf16Kernels, Bf16Embeddings) {
  gpu->set_precision("bf16");
  for (const int C : {24, 20}) {  // (the forward passes 16 bytes at a time, then one value)
  SCOPED_TRACE("C = " + std::to_string(C));
  const int N = 50, T = 10, vocab_begin = 5, vocab_count = 12, first_row = 3;
  std::vector<int32_t> tokens(N);
  for (int i = 0; i < N; ++i) tokens[i] = (i * 7 + 3) % 20;  // some outside this rank's rows
  const Bits wte = bf16_random(size_t(vocab_count) * C, 40), wpe = bf16_random(size_t(T) * C, 41),
             dout = bf16_random(size_t(N) * C, 42);
  const auto dwte0 = random_vec(wte.size(), 43), dwpe0 = random_vec(wpe.size(), 44);
  Bits out(size_t(N) * C);
  std::vector<float> dwte = dwte0, dwpe = dwpe0;
  cpu->embedding_forward(out.data(), tokens.data(), wte.data(), N, C, vocab_begin, vocab_count);
  cpu->position_forward(out.data(), wpe.data(), N, T, C, first_row);
  cpu->embedding_backward(dwte.data(), dout.data(), tokens.data(), N, C, vocab_begin, vocab_count);
  cpu->position_backward(dwpe.data(), dout.data(), N, T, C, first_row);
  int32_t* d_tok = up(tokens);
  bf16_t *d_wte = up(wte), *d_wpe = up(wpe), *d_dout = up(dout), *d_out = up(bf16_nan(out.size()));
  float *d_dwte = up(dwte0), *d_dwpe = up(dwpe0);
  gpu->embedding_forward(d_out, d_tok, d_wte, N, C, vocab_begin, vocab_count);
  gpu->position_forward(d_out, d_wpe, N, T, C, first_row);
  gpu->embedding_backward(d_dwte, d_dout, d_tok, N, C, vocab_begin, vocab_count);
  gpu->position_backward(d_dwpe, d_dout, N, T, C, first_row);
  std::printf("bf16 embeddings:\n");
  expect_same_bits(down_bits(d_out, out.size()), out, "embedding + position");
  expect_f32(down(d_dwte, dwte.size()), dwte, 1e-5, "dwte (+=)");
  expect_f32(down(d_dwpe, dwpe.size()), dwpe, 1e-5, "dwpe (+=)");
  }
}

// The loss on bf16 logits (a rank's slice: 40 columns from global column 20, the last 7 padding;
// targets inside, outside the slice and ignored): row max of the same bf16 values — the same
// value; sumexp, the target logit and the losses fp32, 1e-5; dlogits written over the logits in
// bf16, 1e-5 plus one bf16 unit (padding columns 0). With dloss = 0 (evaluation) only the losses:
// the logits keep their bits.
TEST_F(CudaBf16Kernels, Bf16CrossEntropyVocabParallel) {
  gpu->set_precision("bf16");
  const int N = 31, V = 40, valid = 33, vocab_begin = 20;
  const Bits logits = bf16_random(size_t(N) * V, 50, -8.f, 8.f);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i % 9 == 0 ? -1 : (i * 5) % 60;
  Bits work = logits;
  std::vector<float> row_max(N), sums(2 * N), losses(N);
  const float dloss = 1.0f / N;
  crossentropy_on(*cpu, work.data(), targets.data(), row_max.data(), sums.data(), losses.data(), N,
                  V, valid, vocab_begin, dloss);
  bf16_t* d_logits = up(logits);
  int32_t* d_t = up(targets);
  float *d_max = up(std::vector<float>(N, NAN)), *d_sums = up(std::vector<float>(2 * N, NAN)),
        *d_losses = up(std::vector<float>(N, NAN));
  std::printf("bf16 cross-entropy %dx%d (%d valid):\n", N, V, valid);
  crossentropy_on(*gpu, d_logits, d_t, d_max, d_sums, d_losses, N, V, valid, vocab_begin, dloss);
  EXPECT_EQ(down(d_max, N), row_max) << "row max";
  expect_f32(down(d_sums, 2 * N), sums, 1e-5, "sumexp, target logit");
  expect_f32(down(d_losses, N), losses, 1e-5, "losses");
  expect_bf16(down_bits(d_logits, work.size()), work, 1e-5, "dlogits (in place)");
  // dloss = 0, from the CPU's statistics.
  gpu->copy_from_host(d_logits, logits.data(), logits.size() * sizeof(bf16_t));
  float *d_losses0 = up(std::vector<float>(N, NAN)), *d_cpu_sums = up(sums);
  gpu->crossentropy_finish(d_logits, d_losses0, d_t, up(row_max), d_cpu_sums, d_cpu_sums + N, N, V,
                           valid, vocab_begin, 0.0f);
  expect_f32(down(d_losses0, N), losses, 1e-5, "losses with dloss = 0");
  expect_same_bits(down_bits(d_logits, logits.size()), logits, "logits with dloss = 0");
}

// The fused cross-entropy (Backend::crossentropy: one rank, the whole vocabulary) against the
// three steps it fuses, on the GPU: the same bits for the statistics, the losses and the dlogits
// (they run the same device code), fp32 and bf16 logits, dloss 1/N and 0 (logits untouched), with
// ignored targets and padding columns; and against the CPU's fused default (the three steps):
// 1e-5 (fp32 sums in other orders; bf16 outputs one rounding apart). Rows of 50304 columns, as
// GPT-2's padded vocabulary, and of 20000: the fused kernel caches each row in shared memory where
// two such blocks fit a multiprocessor (on an H100/H200, and the emulated GPU: bf16 rows of both,
// 100 and 40 KB, and fp32 rows of 20000, 80 KB; an fp32 row of 50304, 201 KB, is read from memory
// in each pass), and with TRELLIS_LOSS_ROW_CACHE=0 never; with TRELLIS_LOSS_PIPELINE=1
// double-buffered, a block taking several rows, and with =0 a block a row (both unset: every way
// timed, the fastest kept — test_cuda_kernel_ways.cpp); the profile's rows count
// the cached calls and the double-buffered ones. The exponentials by exp2f (the default) and by
// expf (TRELLIS_LOSS_EXP2=0), each to the CPU's bounds.
TEST_F(CudaBf16Kernels, FusedCrossEntropyIsTheThreeSteps) {
  for (const auto& [V, valid] : {std::pair{50304, 50257}, std::pair{20000, 19993}}) {
  SCOPED_TRACE("V = " + std::to_string(V));
  const int N = 19;
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i == 3 ? -1 : (i * 7919) % valid;
  targets[5] = valid - 1;
  struct Mode {
    const char *cache, *pipeline, *exp2;
  };
  for (const auto& [cache, pipeline, exp2] :
       {Mode{"1", "1", "1"}, Mode{"1", "0", "1"}, Mode{"0", "1", "1"}, Mode{"1", "1", "0"}}) {
  SCOPED_TRACE(std::string("TRELLIS_LOSS_ROW_CACHE=") + cache + " TRELLIS_LOSS_PIPELINE=" +
               pipeline + " TRELLIS_LOSS_EXP2=" + exp2);
  // One multiprocessor: the double-buffered kernel's 4 or 8 blocks (4 for each of the one or two
  // an SM holds) take 2 to 5 of the 19 rows each, uneven.
  fresh_gpu({{"TRELLIS_LOSS_ROW_CACHE", cache}, {"TRELLIS_LOSS_PIPELINE", pipeline},
             {"TRELLIS_LOSS_EXP2", exp2}, {"TRELLIS_EMU_SMS", "1"},
             {"TRELLIS_CUDA_PROFILE", "1"}});
  int32_t* d_t = up(targets);
  int cached = 0;  // the calls that should cache their rows
  for (const char* precision : {"fp32", "bf16"}) {
    gpu->set_precision(precision);
    const bool bf16 = std::string(precision) == "bf16";
    SCOPED_TRACE(precision);
    for (float dloss : {1.0f / N, 0.0f}) {
      std::printf(
          "cross-entropy %dx%d (%d valid), %s logits, dloss %g: fused against three steps\n", N, V,
          valid, precision, dloss);
      cached += std::string(cache) == "1" && cuda_loss_rows_cached(V, bf16 ? 2 : 4);
      const std::vector<float> x = random_vec(size_t(N) * V, 60, -6.f, 6.f);
      const Bits xb = bits_of(x);
      // Each run: its own copy of the logits (overwritten by dlogits) and statistics.
      auto run = [&](bool fused, Backend& be, std::vector<float>& out, Bits& out_b,
                     std::vector<float>& stats, std::vector<float>& losses) {
        const bool dev = &be == gpu.get();
        std::vector<float> row_max(N, NAN), sums(2 * N, NAN), loss(N, NAN);
        std::vector<float> xf = x;
        Bits xbf = xb;
        float *p_max = row_max.data(), *p_sums = sums.data(), *p_loss = loss.data();
        int32_t* p_t = targets.data();
        Ptr logits = bf16 ? Ptr(xbf.data()) : Ptr(xf.data());
        if (dev) {
          p_max = up(row_max), p_sums = up(sums), p_loss = up(loss), p_t = d_t;
          logits = bf16 ? Ptr(up(xb)) : Ptr(up(x));
        }
        if (fused)
          be.crossentropy(logits, p_loss, p_t, p_max, p_sums, p_sums + N, N, V, valid, dloss);
        else
          crossentropy_on(be, logits, p_t, p_max, p_sums, p_loss, N, V, valid, 0, dloss);
        if (dev) {
          row_max = down(p_max, N), sums = down(p_sums, 2 * N), loss = down(p_loss, N);
          if (bf16)
            xbf = down_bits(logits.bf16(), xb.size());
          else
            xf = down(logits.f32(), x.size());
        }
        stats = row_max;
        stats.insert(stats.end(), sums.begin(), sums.end());
        losses = loss;
        out = xf, out_b = xbf;
      };
      std::vector<float> fused_out, steps_out, cpu_out, fs, ss, cs, fl, sl, cl;
      Bits fused_b, steps_b, cpu_b;
      run(true, *gpu, fused_out, fused_b, fs, fl);
      run(false, *gpu, steps_out, steps_b, ss, sl);
      run(true, *cpu, cpu_out, cpu_b, cs, cl);
      EXPECT_EQ(fs, ss) << "statistics";
      EXPECT_EQ(fl, sl) << "losses";
      if (bf16) {
        expect_same_bits(fused_b, steps_b, "dlogits, fused against three steps");
        if (dloss == 0.0f)
          expect_same_bits(fused_b, xb, "logits with dloss = 0");
        else
          expect_bf16(fused_b, cpu_b, 1e-5, "dlogits against the CPU");
      } else {
        EXPECT_EQ(fused_out, steps_out) << "dlogits, fused against three steps";
        if (dloss == 0.0f)
          EXPECT_EQ(fused_out, x) << "logits with dloss = 0";
        else
          expect_f32(fused_out, cpu_out, 1e-5, "dlogits against the CPU");
      }
      expect_f32(fs, cs, 1e-5, "statistics against the CPU");
      expect_f32(fl, cl, 1e-5, "losses against the CPU");
    }
  }
  const std::string report = gpu->profile_report();
  const size_t row = report.find("cross-entropy calls with rows in shared memory");
  ASSERT_NE(row, std::string::npos) << report;
  if (std::string(cache) == "1" && V == 20000) {
    EXPECT_GT(cached, 0) << "no call takes the cached kernel on this device";
  }
  const std::string counts = std::to_string(cached) + " of 4";
  EXPECT_NE(report.substr(row, report.find('\n', row) - row).find(counts), std::string::npos)
      << "expected " << counts << "\n" << report;
  // Every cached call double-buffered with TRELLIS_LOSS_PIPELINE=1 (the rows here fit both).
  const size_t piped = report.find("of which double-buffered");
  if (std::string(pipeline) == "1" && cached > 0) {
    ASSERT_NE(piped, std::string::npos) << report;
    const std::string all = std::to_string(cached) + " of " + std::to_string(cached);
    EXPECT_NE(report.substr(piped, report.find('\n', piped) - piped).find(all),
              std::string::npos) << "expected " << all << "\n" << report;
  } else {
    EXPECT_EQ(piped, std::string::npos) << report;
  }
  }
  }
}

// convert() on the device, both ways, bit for bit as the host reference (core/bf16.hpp). fp32
// → bf16 through the kernel taking four values a thread (16-byte aligned source and 8-byte
// aligned destination; a count that leaves 3 for its tail) and through the one-a-thread kernel
// (source 4 bytes, or destination 2 bytes, off): on ties (to even, both ways), just off a tie,
// carries into the exponent and into Inf, ±Inf, ±0, subnormals (kept, not flushed: the build has
// no -ftz), NaNs (which must stay NaNs; the device makes its own quiet NaN, so only that is
// checked) and random bit patterns of every magnitude; the element before a shifted destination
// is left alone. bf16 → fp32 on all 65536 bit patterns (exact), and back.
TEST_F(CudaBf16Kernels, Bf16ConvertBitForBit) {
  auto from_bits = [](uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
  };
  std::vector<float> x;
  for (uint32_t u :
       {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0x3FFF8000u, 0xBF818000u, 0xBF808001u,
        0x7E7F8000u, 0x7F7F7FFFu, 0x7F7F8000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u,
        0x00000000u, 0x80000000u, 0x00000001u, 0x00008000u, 0x00018000u, 0x007FFFFFu, 0x80018000u,
        0x00808000u, 0x7FC00000u, 0x7F800001u, 0xFFC00001u, 0x0F123456u, 0xC0490FDBu, 0x3EAAAAABu})
    x.push_back(from_bits(u));
  std::mt19937 rng(99);
  const size_t n = 4 * 1024 + 3;
  while (x.size() < n) x.push_back(from_bits(uint32_t(rng())));
  for (auto [src_off, dst_off] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 1}}) {
    SCOPED_TRACE(::testing::Message() << "source " << src_off << " float(s) and destination "
                                      << dst_off << " bf16 off alignment");
    std::vector<float> src(src_off, 0.f);
    src.insert(src.end(), x.begin(), x.end());
    const float* d_src = up(src) + src_off;
    bf16_t* d_dst = up(Bits(n + dst_off, bf16_t{0xABCD}));
    gpu->convert(Ptr(d_dst + dst_off), CPtr(d_src), int64_t(n));
    const Bits got = down_bits(d_dst, n + dst_off);
    if (dst_off) {
      EXPECT_EQ(got[0].bits, 0xABCD) << "written before its start";
    }
    int bad = 0, nans = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint16_t g = got[i + dst_off].bits, want = float_to_bf16_bits(x[i]);
      const bool ok = std::isnan(x[i]) ? (g & 0x7FFF) > 0x7F80 : g == want;
      nans += std::isnan(x[i]);
      if (!ok && ++bad <= 5) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        ADD_FAILURE() << "fp32 0x" << std::hex << u << " → device 0x" << g << ", host 0x" << want;
      }
    }
    std::printf("bf16 conversion, offsets %d/%d: %d of %zu values differ from the host (%d NaNs)\n",
                src_off, dst_off, bad, n, nans);
    EXPECT_EQ(bad, 0);
  }
  // Every bf16 bit pattern widened, and rounded back.
  Bits all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i].bits = uint16_t(i);
  float* d_wide = up(std::vector<float>(all.size(), 0.f));
  gpu->convert(Ptr(d_wide), CPtr(up(all)), int64_t(all.size()));
  const std::vector<float> wide = down(d_wide, all.size());
  bf16_t* d_back = up(Bits(all.size()));
  gpu->convert(Ptr(d_back), CPtr(d_wide), int64_t(all.size()));
  const Bits back = down_bits(d_back, all.size());
  int bad_wide = 0, bad_back = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = bf16_bits_to_float(uint16_t(i));
    uint32_t g, w;
    std::memcpy(&g, &wide[i], 4);
    std::memcpy(&w, &want, 4);
    const bool nan = std::isnan(want);
    if (!(nan ? std::isnan(wide[i]) : g == w) && ++bad_wide <= 5)
      ADD_FAILURE() << "bf16 0x" << std::hex << i << " → device fp32 0x" << g << ", host 0x" << w;
    if (!(nan ? (back[i].bits & 0x7FFF) > 0x7F80 : back[i].bits == uint16_t(i)) && ++bad_back <= 5)
      ADD_FAILURE() << "bf16 0x" << std::hex << i << " widened and rounded back: 0x"
                    << back[i].bits;
  }
  std::printf(
      "bf16 widening of all 65536 patterns: %d differ from the host; rounded back: %d "
      "differ\n",
      bad_wide, bad_back);
  EXPECT_EQ(bad_wide, 0);
  EXPECT_EQ(bad_back, 0);
}

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
