// Every CUDA kernel against the CPU backend on fresh random inputs. Built where nvcc exists; each
// test skips when no CUDA device is present (cudaGetDeviceCount reports none).
//
// Relative error bounds (|gpu − cpu| ≤ rtol·max(|cpu|, 1% of the tensor's largest |value|)),
// fp32 storage and arithmetic on both sides, so only the order of summation differs:
//   GEMMs (cuBLASLt, fp32 compute)       1e-4;  with TRELLIS_TF32=1 (10-bit mantissa)  2e-2
//   attention out / dqkv                 1e-4 / 1e-3 (online softmax vs two-pass)
//   layer norm, GELU, element-wise       1e-5
//   cross-entropy losses / dlogits       1e-5
//   sum of squares (double accumulate)   1e-10
//   AdamW                                1e-5
// system.precision = bf16 (GEMM operands rounded to bf16 on the device, fp32 accumulation):
//   against the CPU's sgemm on the same operands rounded by the host helper (backend/bf16.hpp)
//     5e-4 per entry: a product of two bf16 values is exact in fp32 and both sides accumulate in
//     fp32, so only the order of summation and the tensor cores' accumulator rounding differ —
//     an order of magnitude below what rounding the operands costs;
//   against full fp32 on the unrounded inputs   ‖gpu − cpu‖₂ / ‖cpu‖₂ ≤ 1e-2 (the rounding of the
//     operands, 2⁻⁹ relative each, is ≈ 2e-3 of the result), and > 1e-4 (it really is bf16);
//   rounding itself: a GEMM with an identity weight returns each input rounded, bit for bit as
//     the host helper rounds it (ties to even, carries; subnormals, Inf and NaN only on the host:
//     a GEMM turns 0·Inf into NaN and the tensor cores' handling of subnormals is not ours).
#ifdef TRELLIS_HAVE_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/bf16.hpp"
#include "backend/cuda/cuda_factory.hpp"
#include "backend_test_util.hpp"
#include "core/error.hpp"

using namespace trellis;
using trellis::test::expect_close;
using trellis::test::random_vec;
using trellis::test::relative_l2;

namespace {

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    gpu = make_backend("cuda");
    cpu = make_backend("cpu");
  }
  /// A device copy of v (kept alive by the fixture).
  template <class T>
  T* up(const std::vector<T>& v) {
    buffers.emplace_back(MemKind::Scratch, sizeof(T) * v.size(), gpu->allocator());
    gpu->copy_from_host(buffers.back().data(), v.data(), sizeof(T) * v.size());
    return static_cast<T*>(buffers.back().data());
  }
  std::vector<float> down(const float* d, size_t n) {
    std::vector<float> h(n);
    gpu->copy_to_host(h.data(), d, sizeof(float) * n);
    return h;
  }
  struct AttentionShape {
    int B, T, H, KV, hd;
    std::string name() const {
      return "B" + std::to_string(B) + " T" + std::to_string(T) + " H" + std::to_string(H) +
             " KV" + std::to_string(KV) + " hd" + std::to_string(hd);
    }
  };
  struct AttentionRun {
    std::vector<float> qkv, dout;  // (B,T,(H+2KV)·hd), (B,T,H·hd): the inputs
    std::vector<float> out, state, dqkv;  // (B,T,H·hd), attention_state_elems, like qkv
  };
  /// Attention forward and backward on `be`: on random inputs drawn from `seed`, or on `inputs`'
  /// when given; outputs start as `poison` (9 by default: a value no attention produces here).
  AttentionRun attention_on(Backend& be, const AttentionShape& s, uint32_t seed,
                            const AttentionRun* inputs, float poison = 9.f) {
    const size_t nqkv = size_t(s.B) * s.T * (s.H + 2 * s.KV) * s.hd,
                 nout = size_t(s.B) * s.T * s.H * s.hd,
                 nstate = size_t(be.attention_state_elems(s.B, s.T, s.H));
    AttentionRun r;
    r.qkv = inputs ? inputs->qkv : random_vec(nqkv, seed, -2.f, 2.f);
    r.dout = inputs ? inputs->dout : random_vec(nout, seed + 1);
    r.out.assign(nout, poison);
    r.state.assign(nstate, poison);
    r.dqkv.assign(nqkv, poison);
    if (&be == cpu.get()) {
      be.attention_forward(r.out.data(), r.state.data(), r.qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
      be.attention_backward(r.dqkv.data(), r.dout.data(), r.qkv.data(), r.out.data(),
                            r.state.data(), s.B, s.T, s.H, s.KV, s.hd);
      return r;
    }
    float *d_qkv = up(r.qkv), *d_dout = up(r.dout), *d_out = up(r.out), *d_state = up(r.state),
          *d_dqkv = up(r.dqkv);
    be.attention_forward(d_out, d_state, d_qkv, s.B, s.T, s.H, s.KV, s.hd);
    be.attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_state, s.B, s.T, s.H, s.KV, s.hd);
    r.out = down(d_out, nout);
    r.state = down(d_state, nstate);
    r.dqkv = down(d_dqkv, nqkv);
    return r;
  }
  static double gemm_rtol() {
    const char* tf32 = std::getenv("TRELLIS_TF32");
    return tf32 && std::strcmp(tf32, "0") != 0 ? 2e-2 : 1e-4;
  }
  std::unique_ptr<Backend> gpu, cpu;
  std::vector<Buffer> buffers;
};

TEST_F(CudaKernels, MatmulForwardAndBackward) {
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
    float *d_out = up(std::vector<float>(out.size(), 9.f)), *d_dinp = up(std::vector<float>(dinp.size(), 9.f));
    float *d_dw = up(dw0), *d_db = up(db0);
    gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
    gpu->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC);
    expect_close(down(d_out, out.size()), out, gemm_rtol(), "out");
    expect_close(down(d_dinp, dinp.size()), dinp, gemm_rtol(), "dinp");
    expect_close(down(d_dw, dw.size()), dw, gemm_rtol(), "dweight");
    expect_close(down(d_db, db.size()), db, 1e-5, "dbias");
    // Without a bias, and dinp skipped.
    cpu->matmul_forward(out.data(), inp.data(), w.data(), nullptr, N, C, OC);
    gpu->matmul_forward(d_out, d_inp, d_w, nullptr, N, C, OC);
    expect_close(down(d_out, out.size()), out, gemm_rtol(), "out without bias");
  }
}

// The MLP's GELU on its GEMMs: matmul_gelu_forward (pre = inp·Wᵀ + b, out = gelu(pre)) and the
// next layer's matmul_backward_gelu (dpre = gelu'(pre) ∘ (dout·W2)), which the CUDA backend fuses
// into cuBLASLt's GELU_AUX_BIAS and DGELU epilogues where it has an algorithm, against the CPU's
// two passes: pre to the GEMMs' bound; out, dpre and dweight (which reads out) as relative L2
// errors ≤ 1e-3, which any slip of layout, bias or aux breaks by far. cuBLASLt's GELU should be
// the tanh approximation, as GPT-2's, evaluated its own way (a fast tanh may cost ~1e-4); the erf
// form differs from it by only ≈ 2e-4 here, so the test prints the GPU's out against both forms
// to tell. pre is about unit-sized (std ≈ 1.1, |pre| ≤ 5), as in a trained model. Widths that are multiples of 8 may take the fused path; 53 cannot (the
// epilogue's ld must be) and goes through the fallback. With bf16: fused against
// TRELLIS_GELU_EPILOGUE=0 (the same rounded operands both ways). One CUDA backend at a time (each
// has its own stream; device memory is allocated on the newest one's). The profile's last row
// counts the fused passes.
TEST_F(CudaKernels, MatmulWithGeluMatchesTheCpu) {
  auto fresh_gpu = [&](const char* gelu_epilogue, const char* precision) {
    buffers.clear();
    gpu.reset();
    const char* vars[2] = {"TRELLIS_GELU_EPILOGUE", "TRELLIS_CUDA_PROFILE"};
    const char* values[2] = {gelu_epilogue, "1"};
    std::string saved[2];
    bool had[2];
    for (int i = 0; i < 2; ++i) {
      const char* v = std::getenv(vars[i]);
      had[i] = v != nullptr, saved[i] = v ? v : "";
      setenv(vars[i], values[i], 1);  // read when a backend is made
    }
    gpu = make_backend("cuda");
    for (int i = 0; i < 2; ++i) had[i] ? setenv(vars[i], saved[i].c_str(), 1) : unsetenv(vars[i]);
    gpu->set_precision(precision);
  };
  for (auto [N, C, OC, OC2] : {std::tuple{256, 64, 192, 40}, std::tuple{37, 24, 53, 16}}) {
    SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << OC << "x" << OC2);
    auto inp = random_vec(size_t(N) * C, 11, -2.f, 2.f), w = random_vec(size_t(OC) * C, 12, -0.2f, 0.2f),
         b = random_vec(OC, 13, -0.5f, 0.5f), w2 = random_vec(size_t(OC2) * OC, 14),
         dout = random_vec(size_t(N) * OC2, 15);
    auto dw0 = random_vec(size_t(OC2) * OC, 16), db0 = random_vec(OC2, 17);  // accumulated into
    struct Run {
      std::vector<float> pre, out, dpre, dw, db;
    };
    const size_t n1 = size_t(N) * OC;
    auto run_on = [&](Backend& be) {
      Run r{std::vector<float>(n1, 9.f), std::vector<float>(n1, 9.f), std::vector<float>(n1, 9.f), dw0, db0};
      std::vector<float> scratch(n1, 9.f);
      if (&be == cpu.get()) {
        be.matmul_gelu_forward(r.pre.data(), r.out.data(), inp.data(), w.data(), b.data(), N, C, OC);
        be.matmul_backward_gelu(r.dpre.data(), scratch.data(), r.dw.data(), r.db.data(), dout.data(),
                                r.out.data(), r.pre.data(), w2.data(), N, OC, OC2);
        return r;
      }
      float *d_pre = up(r.pre), *d_out = up(r.out), *d_dpre = up(r.dpre), *d_scratch = up(scratch),
            *d_dw = up(dw0), *d_db = up(db0);
      be.matmul_gelu_forward(d_pre, d_out, up(inp), up(w), up(b), N, C, OC);
      be.matmul_backward_gelu(d_dpre, d_scratch, d_dw, d_db, up(dout), d_out, d_pre, up(w2), N, OC, OC2);
      r.pre = down(d_pre, n1);
      r.out = down(d_out, n1);
      r.dpre = down(d_dpre, n1);
      r.dw = down(d_dw, dw0.size());
      r.db = down(d_db, db0.size());
      std::printf("%s", be.profile_report().c_str());
      return r;
    };
    auto compare = [&](const Run& got, const Run& want, double gemm_tol, const char* what) {
      SCOPED_TRACE(what);
      const double bound = std::max(1e-3, gemm_tol);
      expect_close(got.pre, want.pre, gemm_tol, "pre");
      EXPECT_LE(relative_l2(got.out, want.out), bound) << "out = gelu(pre)";
      EXPECT_LE(relative_l2(got.dpre, want.dpre), bound) << "dpre";
      EXPECT_LE(relative_l2(got.dw, want.dw), bound) << "dweight";
      expect_close(got.db, want.db, 1e-5, "dbias");
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
    fresh_gpu("1", "fp32");
    compare(run_on(*gpu), reference, gemm_rtol(), "fp32, epilogue");
    fresh_gpu("0", "fp32");
    compare(run_on(*gpu), reference, gemm_rtol(), "fp32, two passes");
    fresh_gpu("0", "bf16");
    const Run apart = run_on(*gpu);
    fresh_gpu("1", "bf16");
    compare(run_on(*gpu), apart, 1e-4, "bf16, epilogue against two passes");
  }
}

// Tensors inside the flat parameter buffer sit at any float offset: cuBLASLt must be told, and
// an unaligned bias cannot go through its epilogue. With bf16 the operands are cast into aligned
// copies, but the output and the bias stay where they are.
TEST_F(CudaKernels, MatmulOnUnalignedPointers) {
  const int N = 40, C = 24, OC = 36;
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const bool bf16 = std::string(precision) == "bf16";
    gpu->set_precision(precision);
    auto inp = random_vec(size_t(N) * C + 1, 70), w = random_vec(size_t(OC) * C + 3, 71),
         b = random_vec(OC + 1, 72);
    const auto inp_ref = bf16 ? round_to_bf16(inp) : inp, w_ref = bf16 ? round_to_bf16(w) : w;
    std::vector<float> out(size_t(N) * OC + 1);
    cpu->matmul_forward(out.data() + 1, inp_ref.data() + 1, w_ref.data() + 3, b.data() + 1, N, C, OC);
    float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_out = up(std::vector<float>(out.size()));
    gpu->matmul_forward(d_out + 1, d_inp + 1, d_w + 3, d_b + 1, N, C, OC);
    auto got = down(d_out, out.size());
    expect_close(std::vector<float>(got.begin() + 1, got.end()),
                 std::vector<float>(out.begin() + 1, out.end()), bf16 ? 5e-4 : gemm_rtol(), "out");
  }
}

TEST_F(CudaKernels, PrecisionSetting) {
  EXPECT_EQ(gpu->precision(), "fp32");
  gpu->set_precision("bf16");
  EXPECT_EQ(gpu->precision(), "bf16");
  EXPECT_THROW(gpu->set_precision("fp16"), UserError);
  gpu->set_precision("fp32");
  EXPECT_EQ(gpu->precision(), "fp32");
}

// bf16 GEMMs (forward, dinp, dweight +=) against the CPU's sgemm on operands rounded to bf16 by
// the host helper: 5e-4 (see the top of the file). The bias, dbias (column sums of the fp32
// dout) and the dweight accumulated into are fp32 on both sides.
TEST_F(CudaKernels, Bf16MatmulMatchesTheCpuOnRoundedOperands) {
  gpu->set_precision("bf16");
  for (auto [N, C, OC] : {std::tuple{37, 29, 53}, std::tuple{256, 64, 192}, std::tuple{96, 768, 80}}) {
    SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << OC);
    auto inp = random_vec(size_t(N) * C, 1), w = random_vec(size_t(OC) * C, 2),
         b = random_vec(OC, 3), dout = random_vec(size_t(N) * OC, 4);
    auto dw0 = random_vec(size_t(OC) * C, 5), db0 = random_vec(OC, 6);  // accumulated into
    const auto inp16 = round_to_bf16(inp), w16 = round_to_bf16(w), dout16 = round_to_bf16(dout);
    std::vector<float> out(size_t(N) * OC), dinp(size_t(N) * C), dw = dw0, db = db0, dw_unused = dw0;
    cpu->matmul_forward(out.data(), inp16.data(), w16.data(), b.data(), N, C, OC);
    cpu->matmul_backward(dinp.data(), dw.data(), nullptr, dout16.data(), inp16.data(), w16.data(),
                         N, C, OC);
    cpu->matmul_backward(nullptr, dw_unused.data(), db.data(), dout.data(), inp.data(), w.data(),
                         N, C, OC);  // dbias from the fp32 dout
    float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_dout = up(dout);
    float *d_out = up(std::vector<float>(out.size(), 9.f)), *d_dinp = up(std::vector<float>(dinp.size(), 9.f));
    float *d_dw = up(dw0), *d_db = up(db0);
    gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
    gpu->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC);
    expect_close(down(d_out, out.size()), out, 5e-4, "out");
    expect_close(down(d_dinp, dinp.size()), dinp, 5e-4, "dinp");
    expect_close(down(d_dw, dw.size()), dw, 5e-4, "dweight");
    expect_close(down(d_db, db.size()), db, 1e-5, "dbias");
    // Without a bias (no epilogue), and with dinp skipped.
    cpu->matmul_forward(out.data(), inp16.data(), w16.data(), nullptr, N, C, OC);
    gpu->matmul_forward(d_out, d_inp, d_w, nullptr, N, C, OC);
    expect_close(down(d_out, out.size()), out, 5e-4, "out without bias");
    dw = dw0;
    cpu->matmul_backward(nullptr, dw.data(), nullptr, dout16.data(), inp16.data(), w16.data(), N, C, OC);
    gpu->copy_from_host(d_dw, dw0.data(), dw0.size() * sizeof(float));
    gpu->matmul_backward(nullptr, d_dw, nullptr, d_dout, d_inp, d_w, N, C, OC);
    expect_close(down(d_dw, dw.size()), dw, 5e-4, "dweight without dinp");
  }
}

// bf16 GEMMs against full fp32 on the unrounded inputs: the whole error of the operands' rounding,
// ‖·‖₂-relative ≤ 1e-2; and above 1e-4, which fp32 GEMMs (≈ 1e-7) never reach.
TEST_F(CudaKernels, Bf16MatmulTracksFp32) {
  gpu->set_precision("bf16");
  const int N = 256, C = 256, OC = 384;
  auto inp = random_vec(size_t(N) * C, 80), w = random_vec(size_t(OC) * C, 81),
       b = random_vec(OC, 82), dout = random_vec(size_t(N) * OC, 83);
  std::vector<float> out(size_t(N) * OC), dinp(size_t(N) * C), dw(size_t(OC) * C, 0.f);
  cpu->matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
  cpu->matmul_backward(dinp.data(), dw.data(), nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
  float *d_inp = up(inp), *d_w = up(w), *d_b = up(b), *d_dout = up(dout), *d_out = up(out),
        *d_dinp = up(dinp), *d_dw = up(std::vector<float>(dw.size(), 0.f));
  gpu->matmul_forward(d_out, d_inp, d_w, d_b, N, C, OC);
  gpu->matmul_backward(d_dinp, d_dw, nullptr, d_dout, d_inp, d_w, N, C, OC);
  for (auto [what, got, want] : {std::tuple{"out", down(d_out, out.size()), out},
                                 std::tuple{"dinp", down(d_dinp, dinp.size()), dinp},
                                 std::tuple{"dweight", down(d_dw, dw.size()), dw}}) {
    const double err = relative_l2(got, want);
    EXPECT_LE(err, 1e-2) << what;
    EXPECT_GT(err, 1e-4) << what << ": as close as fp32 — were the operands rounded at all?";
  }
}

// The device's rounding, bit for bit: out = inp · Iᵀ with an identity weight (exact in bf16) is
// each input rounded to bf16 — every product but one is an exact 0, and the one is exact in fp32.
// Also with a count that is not a multiple of 4 and an input 4 bytes off 16-byte alignment: the
// cast takes four values a thread only when aligned, and the last n mod 4 on their own.
TEST_F(CudaKernels, Bf16RoundsToNearestEvenOnTheDevice) {
  gpu->set_precision("bf16");
  auto from_bits = [](uint32_t u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
  };
  for (auto [C, rows, shift] : {std::tuple{8, 32, 0}, std::tuple{7, 33, 0}, std::tuple{7, 33, 1}}) {
    SCOPED_TRACE(::testing::Message() << "C " << C << ", " << rows << " rows, shift " << shift);
    // Ties (to even, both ways), just off a tie, a carry into the exponent, negative values,
    // large and small normal magnitudes; then random values.
    std::vector<float> inp;
    for (uint32_t u : {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0x3FFF8000u,
                       0xBF818000u, 0xBF808001u, 0x7E7F8000u, 0x7E7E8000u, 0x00808000u,
                       0x00818000u, 0x0F123456u, 0xC0490FDBu, 0x3EAAAAABu, 0x42F6E979u,
                       0x3DCCCCCDu})
      inp.push_back(from_bits(u));
    for (float x : random_vec(size_t(rows) * C - inp.size(), 90 + C, -100.f, 100.f)) inp.push_back(x);
    std::vector<float> eye(size_t(C) * C, 0.f);
    for (int c = 0; c < C; ++c) eye[size_t(c) * C + c] = 1.f;
    std::vector<float> shifted(shift, 0.f);
    shifted.insert(shifted.end(), inp.begin(), inp.end());
    float *d_inp = up(shifted) + shift, *d_eye = up(eye), *d_out = up(std::vector<float>(inp.size()));
    gpu->matmul_forward(d_out, d_inp, d_eye, nullptr, rows, C, C);
    const auto got = down(d_out, inp.size());
    int bad = 0;
    for (size_t i = 0; i < inp.size(); ++i) {
      uint32_t g, w, x;
      const float want = round_to_bf16(inp[i]);
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want, 4);
      std::memcpy(&x, &inp[i], 4);
      if (g != w && ++bad <= 5)
        ADD_FAILURE() << "input " << inp[i] << " (bits 0x" << std::hex << x << "): device "
                      << got[i] << ", host " << want;
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST_F(CudaKernels, LayerNorm) {
  const int N = 67, C = 96;
  auto x = random_vec(size_t(N) * C, 10, -3.f, 3.f), w = random_vec(C, 11), b = random_vec(C, 12);
  auto dout = random_vec(size_t(N) * C, 13), dinp0 = random_vec(size_t(N) * C, 14);
  auto dw0 = random_vec(C, 15), db0 = random_vec(C, 16);
  std::vector<float> out(x.size()), mean(N), rstd(N), dinp = dinp0, dw = dw0, db = db0;
  cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  cpu->layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
  float *d_x = up(x), *d_w = up(w), *d_b = up(b), *d_dout = up(dout), *d_out = up(out),
        *d_mean = up(mean), *d_rstd = up(rstd), *d_dinp = up(dinp0), *d_dw = up(dw0),
        *d_db = up(db0);
  gpu->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C);
  gpu->layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_mean, d_rstd, N, C);
  expect_close(down(d_out, out.size()), out, 1e-5, "out");
  expect_close(down(d_mean, N), mean, 1e-5, "mean");
  expect_close(down(d_rstd, N), rstd, 1e-5, "rstd");
  expect_close(down(d_dinp, dinp.size()), dinp, 1e-5, "dinp");
  expect_close(down(d_dw, C), dw, 1e-5, "dweight");
  expect_close(down(d_db, C), db, 1e-5, "dbias");
  // The fused residual add + layer norm, the sum written over its first operand.
  std::vector<float> sum(x.size()), rout(x.size()), rmean(N), rrstd(N);
  cpu->residual_layernorm_forward(sum.data(), rout.data(), rmean.data(), rrstd.data(), x.data(),
                                  dout.data(), w.data(), b.data(), N, C);
  float* d_a = up(x);
  gpu->residual_layernorm_forward(d_a, d_out, d_mean, d_rstd, d_a, d_dout, d_w, d_b, N, C);
  expect_close(down(d_a, sum.size()), sum, 1e-6, "residual sum");
  expect_close(down(d_out, rout.size()), rout, 1e-5, "residual layernorm out");
  expect_close(down(d_mean, N), rmean, 1e-5, "residual layernorm mean");
  expect_close(down(d_rstd, N), rrstd, 1e-5, "residual layernorm rstd");
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

// system.precision = bf16 with TRELLIS_TC_ATTENTION=1: head sizes 32, 64 and 128 run on the
// tensor cores (bf16 operands of Q·Kᵀ, P·V and the backward products, fp32 softmax and
// accumulation; hd 128 only where a block may have 120.5 KiB of shared memory: not sm_86/sm_89);
// others keep the fp32 kernels. Against the CPU in fp32: ‖gpu − cpu‖₂/‖cpu‖₂ ≤ 1e-2 for out, 2e-2
// for dqkv (dS is rounded too), 2e-3 for the logsumexp (a tile-level emulation of the kernels'
// roundings on these shapes gives ≈ 3e-3, 4e-3 and 2e-4), and above 1e-5 for out and dqkv (the
// tensor cores did run, forward and backward). T crosses the 64-row tiles, or is below one tile
// (down to one row); groups of 1, 2 and 4 query heads per key/value head; outputs poisoned with
// NaN first.
TEST_F(CudaKernels, AttentionBf16OnTensorCores) {
  const char* before = std::getenv("TRELLIS_TC_ATTENTION");
  const std::string saved = before ? before : "";
  setenv("TRELLIS_TC_ATTENTION", "1", 1);  // read when a backend is made
  buffers.clear();
  gpu = make_backend("cuda");
  if (before) setenv("TRELLIS_TC_ATTENTION", saved.c_str(), 1);
  else unsetenv("TRELLIS_TC_ATTENTION");
  gpu->set_precision("bf16");
  const bool hd128 = cuda_tc_attention_takes(128);
  EXPECT_TRUE(cuda_tc_attention_takes(32) && cuda_tc_attention_takes(64)) << "fits every sm_80+ device";
  for (auto [s, tensor_cores] :
       {std::pair{AttentionShape{2, 130, 4, 2, 64}, true}, std::pair{AttentionShape{1, 200, 2, 1, 128}, hd128},
        std::pair{AttentionShape{2, 64, 4, 4, 32}, true}, std::pair{AttentionShape{1, 257, 3, 3, 64}, true},
        std::pair{AttentionShape{1, 37, 4, 1, 32}, true}, std::pair{AttentionShape{2, 1, 2, 2, 64}, true},
        std::pair{AttentionShape{1, 40, 2, 2, 48}, false}}) {
    SCOPED_TRACE(s.name());
    const AttentionRun cpu_run = attention_on(*cpu, s, 90, nullptr);
    const AttentionRun gpu_run = attention_on(*gpu, s, 90, &cpu_run, NAN);
    // The GPU's state is each row's logsumexp (the CPU keeps probabilities): a reference in double.
    std::vector<double> lse(size_t(s.B) * s.H * s.T);
    const int64_t R = int64_t(s.H + 2 * s.KV) * s.hd;
    for (int b = 0; b < s.B; ++b)
      for (int h = 0; h < s.H; ++h)
        for (int t = 0; t < s.T; ++t) {
          const float* q = &cpu_run.qkv[(int64_t(b) * s.T + t) * R + int64_t(h) * s.hd];
          std::vector<double> dots(t + 1);
          double mx = -INFINITY, sum = 0.0;
          for (int j = 0; j <= t; ++j) {
            const float* k =
                &cpu_run.qkv[(int64_t(b) * s.T + j) * R + int64_t(s.H + h / (s.H / s.KV)) * s.hd];
            double dot = 0.0;
            for (int d = 0; d < s.hd; ++d) dot += double(q[d]) * k[d];
            dots[j] = dot / std::sqrt(double(s.hd));
            mx = std::max(mx, dots[j]);
          }
          for (double x : dots) sum += std::exp(x - mx);
          lse[(size_t(b) * s.H + h) * s.T + t] = mx + std::log(sum);
        }
    const double e_out = relative_l2(gpu_run.out, cpu_run.out);
    const double e_dqkv = relative_l2(gpu_run.dqkv, cpu_run.dqkv);
    const double e_lse = relative_l2(gpu_run.state, lse);
    EXPECT_LE(e_out, 1e-2);
    EXPECT_LE(e_dqkv, 2e-2);
    EXPECT_LE(e_lse, 2e-3);
    if (tensor_cores) {
      EXPECT_GT(e_out, 1e-5) << "as close as fp32: did the tensor-core forward run?";
      EXPECT_GT(e_dqkv, 1e-5) << "as close as fp32: did the tensor-core backward run?";
    } else {
      EXPECT_LE(e_out, 1e-4) << "head size " << s.hd << " keeps the fp32 kernels";
      EXPECT_LE(e_dqkv, 1e-3);
    }
    std::printf("attention bf16 %s: rel. error out %.2e, dqkv %.2e, lse %.2e\n", s.name().c_str(),
                e_out, e_dqkv, e_lse);
  }
}

TEST_F(CudaKernels, ElementWise) {
  const int64_t n = 100003;
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

TEST_F(CudaKernels, Embeddings) {
  const int N = 50, C = 24, T = 10, vocab_begin = 5, vocab_count = 12, first_row = 3;
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

TEST_F(CudaKernels, CrossEntropyVocabParallel) {
  // A rank's slice: 40 columns from global column 20, the last 7 padding; targets inside, outside
  // the slice and ignored (−1).
  const int N = 31, V = 40, valid = 33, vocab_begin = 20;
  auto logits = random_vec(size_t(N) * V, 50, -8.f, 8.f);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i % 9 == 0 ? -1 : (i * 5) % 60;
  std::vector<float> row_max(N), sums(2 * N), losses(N), work = logits;
  const float dloss = 1.0f / N;
  cpu->crossentropy_max(work.data(), row_max.data(), N, V, valid);
  cpu->crossentropy_sums(work.data(), targets.data(), row_max.data(), sums.data(), sums.data() + N,
                         N, V, valid, vocab_begin);
  cpu->crossentropy_finish(work.data(), losses.data(), targets.data(), row_max.data(), sums.data(),
                           sums.data() + N, N, V, valid, vocab_begin, dloss);
  float* d_logits = up(logits);
  int32_t* d_t = up(targets);
  float *d_max = up(row_max), *d_sums = up(sums), *d_losses = up(losses);
  gpu->crossentropy_max(d_logits, d_max, N, V, valid);
  gpu->crossentropy_sums(d_logits, d_t, d_max, d_sums, d_sums + N, N, V, valid, vocab_begin);
  expect_close(down(d_max, N), row_max, 1e-6, "row max");
  expect_close(down(d_sums, 2 * N), sums, 1e-5, "sumexp, target logit");
  gpu->crossentropy_finish(d_logits, d_losses, d_t, d_max, d_sums, d_sums + N, N, V, valid,
                           vocab_begin, dloss);
  expect_close(down(d_losses, N), losses, 1e-5, "losses");
  expect_close(down(d_logits, work.size()), work, 1e-5, "dlogits");
}

TEST_F(CudaKernels, SumSquaresAndAdamW) {
  const int64_t n = 1234567;
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

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
