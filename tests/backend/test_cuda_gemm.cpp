// The CUDA backend's GEMMs (cuBLASLt) against the CPU backend on fresh random inputs: fp32, and the
// bf16 cases of the GELU epilogue and of unaligned pointers; the fused bias-gradient and GELU
// epilogues; the ways round where cuBLASLt refuses (the emulated cuBLASLt's refusals). The other
// fp32 kernels are in test_cuda_kernels.cpp, the bf16 GEMMs in test_cuda_bf16_kernels.cpp, the
// bounds of all in cuda_test_util.hpp. Each test skips when no CUDA device is present and prints
// what it measured.
#include <algorithm>
#include <cstdlib>
#include <tuple>

#include "cuda_test_util.hpp"
#include "scoped_env.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaGemm : public CudaKernelTest {};

// Also with TRELLIS_GEMM_TUNE=1: each GEMM's first call times the heuristic's candidates on its
// own operands (the accumulating dweight GEMM's D put back between trials) and keeps the fastest —
// the same results either way (and the profile says what timing changed). dbias comes from the
// dweight GEMM's bias-gradient epilogue (BGRADB, written to scratch, then added), and with
// TRELLIS_BGRAD_EPILOGUE=0 from the column-sum kernels.
TEST_F(CudaGemm, MatmulForwardAndBackward) {
  for (auto [tune, bgrad] : {std::pair{"0", "1"}, std::pair{"1", "1"}, std::pair{"0", "0"}}) {
    fresh_gpu({{"TRELLIS_GEMM_TUNE", tune},
               {"TRELLIS_CUDA_PROFILE", tune},
               {"TRELLIS_BGRAD_EPILOGUE", bgrad}});
    SCOPED_TRACE(std::string("TRELLIS_GEMM_TUNE=") + tune + ", TRELLIS_BGRAD_EPILOGUE=" + bgrad);
    // Odd sizes: no dimension a multiple of the GEMM tiles.
    for (auto [N, C, OC] : {std::tuple{37, 29, 53}, std::tuple{256, 64, 192}}) {
      SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << OC);
      auto inp = random_vec(size_t(N) * C, 1), w = random_vec(size_t(OC) * C, 2),
           b = random_vec(OC, 3), dout = random_vec(size_t(N) * OC, 4);
      auto dw0 = random_vec(size_t(OC) * C, 5), db0 = random_vec(OC, 6);  // accumulated into
      std::vector<float> out(size_t(N) * OC), dinp(size_t(N) * C), dw = dw0, db = db0;
      cpu->matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
      cpu->matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N,
                           C, OC);
      float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_dout = up(dout);
      float *d_out = up(std::vector<float>(out.size(), 9.f)),
            *d_dinp = up(std::vector<float>(dinp.size(), 9.f));
      float *d_dw = up(dw0), *d_db = up(db0);
      gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
      gpu->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC);
      expect_close(down(d_out, out.size()), out, gemm_rtol(), "out");
      expect_close(down(d_dinp, dinp.size()), dinp, gemm_rtol(), "dinp");
      expect_close(down(d_dw, dw.size()), dw, gemm_rtol(), "dweight");
      expect_close(down(d_db, db.size()), db, dbias_rtol(), "dbias");
      // Without a bias, and dinp skipped.
      cpu->matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
      gpu->matmul_forward(d_out, d_inp, d_w, nullptr, N, C, OC);
      expect_close(down(d_out, out.size()), out, gemm_rtol(), "out without bias");
      // Ending in a residual add (the residual as the GEMM's C), with and without the bias.
      const auto res = random_vec(out.size(), 7);
      float* d_res = up(res);
      for (const bool with_bias : {true, false}) {
        cpu->matmul_residual_forward(out.data(), res.data(), inp.data(), w.data(),
                                     with_bias ? b.data() : nullptr, N, C, OC);
        gpu->matmul_residual_forward(d_out, d_res, d_inp, d_w, with_bias ? d_b : nullptr, N, C, OC);
        expect_close(down(d_out, out.size()), out, gemm_rtol(), "out with a residual");
      }
      EXPECT_ANY_THROW(gpu->matmul_residual_forward(d_res, d_res, d_inp, d_w, d_b, N, C, OC))
          << "out aliasing the residual";
      // A second backward: dweight accumulates again from the first's (tuned plans are not timed
      // twice, and the first call's trials left D as the GEMM alone makes it).
      cpu->matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), N,
                           C, OC);
      gpu->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC);
      expect_close(down(d_dw, dw.size()), dw, gemm_rtol(), "dweight, twice");
    }
    if (std::string(tune) == "1") {
      const std::string report = gpu->profile_report();
      std::printf("%s", report.c_str());
      EXPECT_NE(report.find("GEMM algorithms changed by timing"), std::string::npos) << report;
      // The per-plan table: the 256x64x192 forward's plan (column-major D (192 x 256), k 64).
      EXPECT_NE(report.find("GEMMs by shape"), std::string::npos) << report;
      EXPECT_NE(report.find("192x256x64 TN"), std::string::npos) << report;
      // Every backward's dbias from its GEMM (4: two shapes, twice each).
      const size_t row = report.find("bias gradients fused into GEMMs");
      ASSERT_NE(row, std::string::npos) << report;
      EXPECT_NE(report.substr(row, report.find('\n', row) - row).find("4 of 4"), std::string::npos)
          << report;
    }
  }
}

// The MLP's GELU on its GEMMs: matmul_gelu_forward (pre = inp·Wᵀ + b, out = gelu(pre)) and the
// next layer's matmul_backward_gelu (dpre = gelu'(pre) ∘ (dout·W2)), which the CUDA backend fuses
// into cuBLASLt's GELU_AUX_BIAS and DGELU epilogues where it has an algorithm, against the CPU.
// fp32: pre to the GEMMs' bound; out, dpre and dweight (which reads out) as relative L2 errors
// ≤ 1e-3, which any slip of layout, bias or aux breaks by far. cuBLASLt's GELU should be the tanh
// approximation, as GPT-2's, evaluated its own way (a fast tanh may cost ~1e-4); the erf form
// differs from it by only ≈ 2e-4 here, so the test prints the GPU's out against both forms to
// tell. pre is about unit-sized (std ≈ 1.1, |pre| ≤ 5), as in a trained model. Widths that are
// multiples of 8 may take the fused path; 53 cannot (the epilogue's ld must be) and goes through
// the fallback.
// bf16, with the epilogue and with TRELLIS_GELU_EPILOGUE=0, against the CPU's widening reference
// (out and dpre from the fp32 pre-activation and the fp32 dout·W2, each rounded once); the
// backward reads the CPU's pre and out, so that it is judged on its own. Where this backend's
// GELU kernels run (epilogue off, or width 53), they compute the CPU's function on the GEMM's
// fp32 output: the bf16 bounds of the GEMMs (5e-4; the GELU passes its input's relative error on
// at most ×1.13: 1e-3 for out and dpre). cuBLASLt's own GELU: relative L2 ≤ 1e-3 as in fp32,
// plus 2⁻⁸ for the two sides' roundings. One CUDA backend at a time; the profile's last row
// counts the fused passes.
// The first layer's bias gradient (dbias_pre += dpre's column sums): with
// TRELLIS_BGRAD_EPILOGUE=dgelu out of the same GEMM (DGELU_BGRAD, fp32 sums of the products before
// their rounding) where cuBLASLt takes it — then the call says so, and the sums match the GPU's
// own dpre summed on the host (fp32: to the GEMMs' bound; bf16: relative L2 ≤ 2⁻⁸, the terms'
// roundings) and the CPU's (as dpre: 1e-3, plus 2⁻⁸ in bf16) — else, as by default and on the CPU,
// dbias_pre is left untouched for the caller. The profile counts the calls either way.
TEST_F(CudaGemm, MatmulWithGeluMatchesTheCpu) {
  for (auto [N, C, OC, OC2] : {std::tuple{256, 64, 192, 40}, std::tuple{37, 24, 53, 16}}) {
    SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << OC << "x" << OC2);
    auto inp = random_vec(size_t(N) * C, 11, -2.f, 2.f), w = random_vec(size_t(OC) * C, 12, -0.2f, 0.2f),
         b = random_vec(OC, 13, -0.5f, 0.5f), w2 = random_vec(size_t(OC2) * OC, 14),
         dout = random_vec(size_t(N) * OC2, 15);
    auto dw0 = random_vec(size_t(OC2) * OC, 16), db0 = random_vec(OC2, 17);  // accumulated into
    const auto dbp0 = random_vec(OC, 18);  // the first layer's bias gradient, accumulated into
    struct Run {
      std::vector<float> pre, out, dpre, dw, db, dbp;
      bool summed = false;  // dbp += dpre's column sums, by the call
      std::string profile;
    };
    const size_t n1 = size_t(N) * OC;
    auto run_on = [&](Backend& be) {
      Run r{std::vector<float>(n1, 9.f), std::vector<float>(n1, 9.f), std::vector<float>(n1, 9.f), dw0, db0, dbp0, false, {}};
      std::vector<float> scratch(n1, 9.f);
      if (&be == cpu.get()) {
        be.matmul_gelu_forward(r.pre.data(), r.out.data(), inp.data(), w.data(), b.data(), N, C, OC);
        r.summed = be.matmul_backward_gelu(r.dpre.data(), scratch.data(), r.dw.data(), r.db.data(),
                                           r.dbp.data(), dout.data(), r.out.data(), r.pre.data(),
                                           w2.data(), N, OC, OC2);
        return r;
      }
      float *d_pre = up(r.pre), *d_out = up(r.out), *d_dpre = up(r.dpre), *d_scratch = up(scratch),
            *d_dw = up(dw0), *d_db = up(db0), *d_dbp = up(dbp0);
      be.matmul_gelu_forward(d_pre, d_out, up(inp), up(w), up(b), N, C, OC);
      r.summed = be.matmul_backward_gelu(d_dpre, d_scratch, d_dw, d_db, d_dbp, up(dout), d_out,
                                         d_pre, up(w2), N, OC, OC2);
      r.pre = down(d_pre, n1);
      r.out = down(d_out, n1);
      r.dpre = down(d_dpre, n1);
      r.dw = down(d_dw, dw0.size());
      r.db = down(d_db, db0.size());
      r.dbp = down(d_dbp, dbp0.size());
      r.profile = be.profile_report();
      std::printf("%s", r.profile.c_str());
      return r;
    };
    // The first layer's bias gradient against dpre's column sums (dbp0 + Σ over the N rows).
    auto check_dbias_pre = [&](const std::vector<float>& got_dbp, bool summed,
                               const std::vector<float>& got_dpre,
                               const std::vector<float>& want_dpre, double tol, bool bf16,
                               const std::string& profile, bool asked) {
      const auto sums = [&](const std::vector<float>& dpre) {
        std::vector<double> s(dbp0.begin(), dbp0.end());
        for (int n = 0; n < N; ++n)
          for (int c = 0; c < OC; ++c) s[size_t(c)] += dpre[size_t(n) * OC + size_t(c)];
        return s;
      };
      if (!summed) std::printf("  dbias_pre left to the caller\n");
      if (summed) {
        const auto own = sums(got_dpre), cpu_sums = sums(want_dpre);
        std::printf("  dbias_pre summed by the dpre GEMM (DGELU_BGRAD): rel. L2 error %.2e against "
                    "the GPU's dpre summed, %.2e against the CPU's\n",
                    relative_l2(got_dbp, own), relative_l2(got_dbp, cpu_sums));
        if (bf16) {
          EXPECT_LE(relative_l2(got_dbp, own), 1.0 / 256) << "dbias_pre against the GPU's dpre";
        } else {
          expect_close(got_dbp, own, tol, "dbias_pre against the GPU's dpre");
        }
        EXPECT_LE(relative_l2(got_dbp, cpu_sums), std::max(1e-3, tol) + (bf16 ? 1.0 / 256 : 0.0))
            << "dbias_pre against the CPU's dpre";
      } else {
        EXPECT_EQ(got_dbp, dbp0) << "dbias_pre untouched where the call did not sum it";
      }
      const size_t row = profile.find("MLP first bias gradients in the DGELU GEMM");
      if (!asked) {
        EXPECT_FALSE(summed) << "summed without TRELLIS_BGRAD_EPILOGUE";
        EXPECT_EQ(row, std::string::npos) << profile;
        return;
      }
      ASSERT_NE(row, std::string::npos) << profile;
      const std::string line = profile.substr(row, profile.find('\n', row) - row);
      // (summed: from the GEMM, or from the column sums where the plan's check dropped it)
      const bool counted = line.find(summed ? "1 of 1" : "0 of 1") != std::string::npos ||
                           (summed && line.find("0 of 1") != std::string::npos &&
                            line.find("dropped") != std::string::npos);
      EXPECT_TRUE(counted) << line;
    };
    auto compare = [&](const Run& got, const Run& want, double gemm_tol, const char* what,
                       bool asked) {
      SCOPED_TRACE(what);
      const double bound = std::max(1e-3, gemm_tol);
      expect_close(got.pre, want.pre, gemm_tol, "pre");
      EXPECT_LE(relative_l2(got.out, want.out), bound) << "out = gelu(pre)";
      EXPECT_LE(relative_l2(got.dpre, want.dpre), bound) << "dpre";
      EXPECT_LE(relative_l2(got.dw, want.dw), bound) << "dweight";
      expect_close(got.db, want.db, dbias_rtol(), "dbias");
      check_dbias_pre(got.dbp, got.summed, got.dpre, want.dpre, gemm_tol, false, got.profile, asked);
      // The GPU's GELU of its own pre against the tanh and the erf forms, in double.
      std::vector<double> tanh_form(n1), erf_form(n1);
      for (size_t i = 0; i < n1; ++i) {
        const double x = got.pre[i];
        tanh_form[i] = 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
        erf_form[i] = 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
      }
      std::printf("MLP GELU %dx%dx%dx%d, %s: rel. L2 error out %.2e, dpre %.2e; out against "
                  "tanh-GELU(pre) %.2e, erf-GELU(pre) %.2e\n", N, C, OC, OC2, what,
                  relative_l2(got.out, want.out), relative_l2(got.dpre, want.dpre),
                  relative_l2(got.out, tanh_form), relative_l2(got.out, erf_form));
    };
    const Run reference = run_on(*cpu);
    EXPECT_FALSE(reference.summed) << "the CPU leaves dpre's column sums to the caller";
    EXPECT_EQ(reference.dbp, dbp0);
    fresh_gpu({{"TRELLIS_GELU_EPILOGUE", "1"},
               {"TRELLIS_BGRAD_EPILOGUE", "0"},
               {"TRELLIS_CUDA_PROFILE", "1"}});
    compare(run_on(*gpu), reference, gemm_rtol(), "fp32, epilogue", false);
    fresh_gpu({{"TRELLIS_GELU_EPILOGUE", "1"},
               {"TRELLIS_BGRAD_EPILOGUE", "dgelu"},
               {"TRELLIS_CUDA_PROFILE", "1"}});
    compare(run_on(*gpu), reference, gemm_rtol(), "fp32, epilogue with the bias gradient", true);
    {  // cuBLASLt without DGELU_BGRAD (the emulated one on request): DGELU, dbias_pre left over
      const ScopedEnv refuse("TRELLIS_EMU_LT_REFUSE", "dgelu-bgrad");
      fresh_gpu({{"TRELLIS_GELU_EPILOGUE", "1"},
                 {"TRELLIS_BGRAD_EPILOGUE", "1"},
                 {"TRELLIS_CUDA_PROFILE", "1"}});
      compare(run_on(*gpu), reference, gemm_rtol(),
              "fp32, DGELU_BGRAD refused (by the emulated cuBLASLt; a GPU's may take it)", true);
    }
    fresh_gpu({{"TRELLIS_GELU_EPILOGUE", "0"},
               {"TRELLIS_BGRAD_EPILOGUE", "0"},
               {"TRELLIS_CUDA_PROFILE", "1"}});
    compare(run_on(*gpu), reference, gemm_rtol(), "fp32, two passes", false);

    // bf16: the same values rounded, in bf16 tensors.
    const Bits inp16 = bits_of(inp), w16 = bits_of(w), b16 = bits_of(b), w2_16 = bits_of(w2),
               dout16 = bits_of(dout);
    struct Run16 {
      Bits pre, out, dpre;        // (N,OC) each
      std::vector<float> dw, db;  // (OC2,OC), (OC2)
    };
    Run16 want{Bits(n1), Bits(n1), Bits(n1), dw0, db0};
    Bits scratch16(n1);  // (N,OC)
    cpu->matmul_gelu_forward(want.pre.data(), want.out.data(), inp16.data(), w16.data(), b16.data(),
                             N, C, OC);
    cpu->matmul_backward_gelu(want.dpre.data(), scratch16.data(), want.dw.data(), want.db.data(),
                              nullptr, dout16.data(), want.out.data(), want.pre.data(),
                              w2_16.data(), N, OC, OC2);
    // (the last: a cuBLASLt that takes DGELU_BGRAD's fp32 bias type and writes bf16 — the emulated
    // one on request —, caught by the backend's first check of the plan: the column sums added)
    for (auto [epilogue, bgrad, refuse] :
         {std::tuple{"1", "0", ""}, std::tuple{"1", "dgelu", ""}, std::tuple{"0", "0", ""},
          std::tuple{"0", "dgelu", ""}, std::tuple{"1", "dgelu", "dgelu-bgrad-dtype"}}) {
      const ScopedEnv emu_refuse("TRELLIS_EMU_LT_REFUSE", *refuse ? refuse : nullptr);
      fresh_gpu({{"TRELLIS_GELU_EPILOGUE", epilogue},
                 {"TRELLIS_BGRAD_EPILOGUE", bgrad},
                 {"TRELLIS_CUDA_PROFILE", "1"}});
      gpu->set_precision("bf16");
      bf16_t *d_pre = up(bf16_nan(n1)), *d_out = up(bf16_nan(n1)), *d_dpre = up(bf16_nan(n1));
      float *d_dw = up(dw0), *d_db = up(db0), *d_dbp = up(dbp0);
      gpu->matmul_gelu_forward(d_pre, d_out, up(inp16), up(w16), up(b16), N, C, OC);
      const bool summed =
          gpu->matmul_backward_gelu(d_dpre, up(bf16_nan(n1)), d_dw, d_db, d_dbp, up(dout16),
                                    up(want.out), up(want.pre), up(w2_16), N, OC, OC2);
      const Run16 got{down_bits(d_pre, n1), down_bits(d_out, n1), down_bits(d_dpre, n1),
                      down(d_dw, dw0.size()), down(d_db, db0.size())};
      const std::string profile = gpu->profile_report();
      std::printf("%sMLP GELU bf16 %dx%dx%dx%d, TRELLIS_GELU_EPILOGUE=%s, TRELLIS_BGRAD_EPILOGUE=%s%s%s:\n",
                  profile.c_str(), N, C, OC, OC2, epilogue, bgrad,
                  *refuse ? ", TRELLIS_EMU_LT_REFUSE=" : "", refuse);
      SCOPED_TRACE(std::string("bf16, TRELLIS_GELU_EPILOGUE=") + epilogue +
                   ", TRELLIS_BGRAD_EPILOGUE=" + bgrad + ", TRELLIS_EMU_LT_REFUSE=" + refuse);
      const bool asked = std::string(bgrad) == "dgelu";
      check_dbias_pre(down(d_dbp, dbp0.size()), summed, widen(got.dpre), widen(want.dpre),
                      gemm_rtol(), true, profile, asked);
      // (the epilogue off leaves the GELU, and so the bias gradient, to kernels of their own)
      EXPECT_TRUE(std::string(epilogue) == "1" || !summed) << "summed without the GELU epilogue";
      expect_bf16(got.pre, want.pre, 5e-4, "pre");
      const bool our_gelu = std::string(epilogue) == "0" || OC % 8 != 0;
      if (our_gelu) {
        expect_bf16(got.out, want.out, 1e-3, "out = gelu(pre), our kernel");
        expect_bf16(got.dpre, want.dpre, 1e-3, "dpre, our kernel");
      } else {
        const Bf16Diff o = bf16_diff(got.out, want.out, 1e-3),
                       d = bf16_diff(got.dpre, want.dpre, 1e-3);
        print_bf16("out = gelu(pre), epilogue if taken", o, 1e-3, n1);
        print_bf16("dpre, epilogue if taken", d, 1e-3, n1);
        EXPECT_LE(o.rel_l2, 1e-3 + 1.0 / 256) << "out = gelu(pre)";
        EXPECT_LE(d.rel_l2, 1e-3 + 1.0 / 256) << "dpre";
      }
      expect_f32(got.dw, want.dw, 5e-4, "dweight (+=)");
      expect_f32(got.db, want.db, dbias_rtol(), "dbias (+=)");
    }
  }
}

// Tensors inside the flat parameter buffer sit at any element offset: cuBLASLt must be told, and
// an unaligned bias cannot go through its epilogue (fp32: a kernel adds it to the GEMM's output;
// bf16: it goes through the epilogue from an aligned copy, since adding it to the rounded output
// would round twice). bf16: every tensor starts an odd number of elements (2 bytes off) into its
// buffer, and the element before each output keeps its poison; bf16 tensors that are not 16-byte
// aligned go to the widening default (fp32 copies, 64-byte aligned: cuda_backend.cu, aligned16),
// so this checks that path on the device. Bounds as in Bf16MatmulMatchesTheCpu and
// MatmulWithGeluMatchesTheCpu.
// The model ends a block's halves in the projection GEMMs' residual add unless the backend says
// otherwise: TRELLIS_RESIDUAL_EPILOGUE=0 (gpu-check.sh's "-res" row) turns it off.
TEST_F(CudaGemm, ResidualEpilogueSwitch) {
  fresh_gpu({{"TRELLIS_RESIDUAL_EPILOGUE", "0"}});
  EXPECT_FALSE(gpu->fuses_residual_into_matmul());
  fresh_gpu({{"TRELLIS_RESIDUAL_EPILOGUE", "1"}});
  EXPECT_TRUE(gpu->fuses_residual_into_matmul());
}

TEST_F(CudaGemm, MatmulOnUnalignedPointers) {
  const int N = 40, C = 24, OC = 36;
  {
    gpu->set_precision("fp32");
    auto inp = random_vec(size_t(N) * C + 1, 70), w = random_vec(size_t(OC) * C + 3, 71),
         b = random_vec(OC + 1, 72);
    std::vector<float> out(size_t(N) * OC + 1);
    cpu->matmul_forward(out.data() + 1, inp.data() + 1, w.data() + 3, b.data() + 1, N, C, OC);
    float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_out = up(std::vector<float>(out.size()));
    gpu->matmul_forward(d_out + 1, d_inp + 1, d_w + 3, d_b + 1, N, C, OC);
    expect_f32(tail(down(d_out, out.size())), tail(out), gemm_rtol(), "fp32 out, unaligned");
  }
  gpu->set_precision("bf16");
  const Bits inp = bf16_random(size_t(N) * C + 1, 73), w = bf16_random(size_t(OC) * C + 3, 74),
             b = bf16_random(OC + 1, 75), dout = bf16_random(size_t(N) * OC + 1, 76);
  const auto dw0 = random_vec(size_t(OC) * C + 1, 77), db0 = random_vec(OC + 1, 78);  // fp32
  const size_t n_out = size_t(N) * OC + 1, n_inp = size_t(N) * C + 1;  // with the poisoned first
  Bits out = bf16_nan(n_out), pre = bf16_nan(n_out), act = bf16_nan(n_out), dinp = bf16_nan(n_inp);
  std::vector<float> dw = dw0, db = db0;
  cpu->matmul_forward(out.data() + 1, inp.data() + 1, w.data() + 3, b.data() + 1, N, C, OC);
  cpu->matmul_gelu_forward(pre.data() + 1, act.data() + 1, inp.data() + 1, w.data() + 3,
                           b.data() + 1, N, C, OC);
  cpu->matmul_backward(dinp.data() + 1, dw.data() + 1, db.data() + 1, dout.data() + 1,
                       inp.data() + 1, w.data() + 3, N, C, OC);
  bf16_t *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_dout = up(dout);
  bf16_t *d_out = up(bf16_nan(n_out)), *d_pre = up(bf16_nan(n_out)), *d_act = up(bf16_nan(n_out)),
         *d_dinp = up(bf16_nan(n_inp));
  float *d_dw = up(dw0), *d_db = up(db0);
  gpu->matmul_forward(d_out + 1, d_inp + 1, d_w + 3, d_b + 1, N, C, OC);
  gpu->matmul_gelu_forward(d_pre + 1, d_act + 1, d_inp + 1, d_w + 3, d_b + 1, N, C, OC);
  gpu->matmul_backward(d_dinp + 1, d_dw + 1, d_db + 1, d_dout + 1, d_inp + 1, d_w + 3, N, C, OC);
  std::printf("bf16 matmul %dx%dx%d on unaligned pointers:\n", N, C, OC);
  for (auto [what, d, want, rtol] :
       {std::tuple{"out", d_out, &out, 5e-4}, std::tuple{"pre", d_pre, &pre, 5e-4},
        std::tuple{"gelu(pre)", d_act, &act, 1e-3}, std::tuple{"dinp", d_dinp, &dinp, 5e-4}}) {
    const Bits got = down_bits(d, want->size());
    EXPECT_EQ(got[0].bits, kNaN16) << what << ": written before its start";
    expect_bf16(tail(got), tail(*want), rtol, what);
  }
  const auto got_dw = down(d_dw, dw.size()), got_db = down(d_db, db.size());
  EXPECT_EQ(got_dw[0], dw0[0]) << "dweight: written before its start";
  EXPECT_EQ(got_db[0], db0[0]) << "dbias: written before its start";
  expect_f32(tail(got_dw), tail(dw), 5e-4, "dweight (+=)");
  expect_f32(tail(got_db), tail(db), dbias_rtol(), "dbias (+=)");
}

// What cuBLASLt may refuse on some device, library version or memory state, which the emulated
// one refuses on request (TRELLIS_EMU_LT_REFUSE, tests/cuda_emu/emu_cublaslt.cpp): a bias epilogue
// on an fp32 D (the bias then added by a kernel), an output apart from its C — the residual — for
// the heuristic's first algorithm or for every one (another candidate, or the residual copied into
// the output first), the heuristic failing once for want of memory (asked again after the pool
// gives its spare memory back). The results must not change, with the heuristic's choice or with
// the candidates timed (TRELLIS_GEMM_TUNE=1: a candidate that cannot write apart from C is not
// timed for a residual). On a real GPU the variable does nothing: the usual ways are checked again.
TEST_F(CudaGemm, GemmsTakeAnotherWayWhereCublasLtRefuses) {
  const int N = 40, C = 24, OC = 36;
  const auto inp = random_vec(size_t(N) * C, 80), w = random_vec(size_t(OC) * C, 81),
             b = random_vec(OC, 82), res = random_vec(size_t(N) * OC, 83);
  const Bits inp16 = bf16_random(size_t(N) * C, 84), w16 = bf16_random(size_t(OC) * C, 85),
             b16 = bf16_random(OC, 86), res16 = bf16_random(size_t(N) * OC, 87);
  std::vector<float> out(size_t(N) * OC), rout(out.size());
  Bits rout16(out.size());
  cpu->matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
  cpu->matmul_residual_forward(rout.data(), res.data(), inp.data(), w.data(), b.data(), N, C, OC);
  cpu->matmul_residual_forward(rout16.data(), res16.data(), inp16.data(), w16.data(), b16.data(), N,
                               C, OC);
  for (const char* tune : {"0", "1"})
    for (const char* refuse : {"fp32-bias", "out-of-place", "out-of-place-first", "alloc-once"}) {
      SCOPED_TRACE(std::string("TRELLIS_EMU_LT_REFUSE=") + refuse + ", TRELLIS_GEMM_TUNE=" + tune);
      const char* before = std::getenv("TRELLIS_EMU_LT_REFUSE");
      const std::string saved = before ? before : "";
      setenv("TRELLIS_EMU_LT_REFUSE", refuse, 1);
      fresh_gpu({{"TRELLIS_GEMM_TUNE", tune}});
      gpu->set_precision("fp32");
      float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_res = up(res);
      float* d_out = up(std::vector<float>(out.size(), 9.f));
      gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
      expect_close(down(d_out, out.size()), out, gemm_rtol(), "fp32 out");
      gpu->matmul_residual_forward(d_out, d_res, d_inp, d_w, d_b, N, C, OC);
      expect_close(down(d_out, out.size()), rout, gemm_rtol(), "fp32 out with a residual");
      EXPECT_EQ(down(d_res, res.size()), res) << "fp32 residual, untouched";
      gpu->set_precision("bf16");
      bf16_t *d_inp16 = up(inp16), *d_w16 = up(w16), *d_b16 = up(b16), *d_res16 = up(res16),
             *d_out16 = up(bf16_nan(out.size()));
      gpu->matmul_residual_forward(d_out16, d_res16, d_inp16, d_w16, d_b16, N, C, OC);
      expect_bf16(down_bits(d_out16, out.size()), rout16, 5e-4, "bf16 out with a residual");
      const Bits kept = down_bits(d_res16, res16.size());
      EXPECT_TRUE(std::equal(kept.begin(), kept.end(), res16.begin(), [](bf16_t x, bf16_t y) {
        return x.bits == y.bits;
      })) << "bf16 residual, untouched";
      before ? setenv("TRELLIS_EMU_LT_REFUSE", saved.c_str(), 1)
             : unsetenv("TRELLIS_EMU_LT_REFUSE");
    }
}

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
