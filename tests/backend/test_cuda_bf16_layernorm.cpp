// The CUDA backend's layer norm on bf16 tensors (system.precision = bf16) against the CPU
// backend's widened reference on the same bf16 inputs, and its ways to the same bits (rows held in
// registers or read again; the backward's ways of waiting on memory) against each other, in fp32
// and bf16. The bounds are in cuda_test_util.hpp; the fp32 layer norm is in test_cuda_kernels.cpp.
// Each test skips when no CUDA device is present and prints what it measured.
#include <bit>

#include "cuda_test_util.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaBf16LayerNorm : public CudaKernelTest {};

// bf16 layer norm: out (N,C) bf16 from bf16 inp, weight and bias; mean and rstd fp32; backward's
// dinp bf16 (+=: it reads its old bf16 values), dweight and dbias fp32 (+=). The fp32 bound 1e-5,
// plus one bf16 unit for bf16 outputs (dweight and dbias, column sums: 1e-4, as for fp32); the
// backward reads the CPU's mean and rstd, so that it is judged on its own. The fused residual add
// writes its sum over a (res aliasing a), then norms the rounded sum: the sum is the same single
// fp32 addition on both sides, rounded alike — the same bits; the norm as the plain one.
TEST_F(CudaBf16LayerNorm, Bf16LayerNorm) {
  for (const char* sms : {"132", "1"}) {  // (as CudaKernels.LayerNorm: the fused backward's rows)
    fresh_gpu({{"TRELLIS_EMU_SMS", sms}});
    gpu->set_precision("bf16");
    SCOPED_TRACE(std::string("TRELLIS_EMU_SMS=") + sms);
    // 16-byte chunks at 96, 768 and 1600 (the fused backward with 2, 4 and 8 chunks a lane), one
    // value at a time at 100; 2056 is wider than the fused backward's registers: its two passes.
    // The forward holds the row in registers at 96, 768 and 1600 (2, 4 and 8 chunks a lane); at
    // 2056 it reads the row again for each of its sums.
    for (const int C : {96, 100, 768, 1600, 2056}) {
      SCOPED_TRACE("C = " + std::to_string(C));
      const int N = 67;
      const Bits x = bf16_random(size_t(N) * C, 10, -3.f, 3.f), w = bf16_random(C, 11),
                 b = bf16_random(C, 12), dout = bf16_random(size_t(N) * C, 13),
                 dinp0 = bf16_random(size_t(N) * C, 14);  // accumulated into
      const auto dw0 = random_vec(C, 15), db0 = random_vec(C, 16);
      Bits out(x.size()), dinp = dinp0;
      std::vector<float> mean(N), rstd(N), dw = dw0, db = db0;
      cpu->layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                             C);
      cpu->layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), N, C);
      bf16_t *d_x = up(x), *d_w = up(w), *d_b = up(b), *d_dout = up(dout),
             *d_out = up(bf16_nan(x.size())), *d_dinp = up(dinp0);
      float *d_mean = up(std::vector<float>(N, NAN)), *d_rstd = up(std::vector<float>(N, NAN)),
            *d_dw = up(dw0), *d_db = up(db0);
      std::printf("bf16 layer norm %dx%d (%s):\n", N, C,
                  C % 8 == 0 ? "16-byte chunks" : "one value at a time");
      gpu->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C);
      expect_bf16(down_bits(d_out, out.size()), out, 1e-5, "out");
      expect_f32(down(d_mean, N), mean, 1e-5, "mean");
      expect_f32(down(d_rstd, N), rstd, 1e-5, "rstd");
      gpu->layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, up(mean), up(rstd), N, C);
      expect_bf16(down_bits(d_dinp, dinp.size()), dinp, 1e-5, "dinp (+=)");
      // (Sums over N rows in another order: as in CudaKernels.LayerNorm, an entry that cancels is
      // off by more than 1e-5 of itself — dweight[444] at C = 1600, Σ|terms| 33.7 for a sum of
      // 0.197: the CPU 9.6e-7 and the GPU 1.25e-6 from the exact sum, on either side of it.)
      expect_f32(down(d_dw, C), dw, 1e-4, "dweight (+=)");
      expect_f32(down(d_db, C), db, 1e-4, "dbias (+=)");
      // The fused residual add + layer norm, the sum written over its first operand.
      Bits sum = x, rout(x.size());
      std::vector<float> rmean(N), rrstd(N);
      cpu->residual_layernorm_forward(sum.data(), rout.data(), rmean.data(), rrstd.data(),
                                      sum.data(), dout.data(), w.data(), b.data(), N, C);
      bf16_t *d_a = up(x), *d_rout = up(bf16_nan(x.size()));
      gpu->residual_layernorm_forward(d_a, d_rout, d_mean, d_rstd, d_a, d_dout, d_w, d_b, N, C);
      expect_same_bits(down_bits(d_a, sum.size()), sum, "residual sum (over a)");
      expect_bf16(down_bits(d_rout, rout.size()), rout, 1e-5, "residual layer norm out");
      expect_f32(down(d_mean, N), rmean, 1e-5, "residual layer norm mean");
      expect_f32(down(d_rstd, N), rrstd, 1e-5, "residual layer norm rstd");
    }
  }
}

// The layer norm forward holding each lane's share of a row in registers (TRELLIS_LAYERNORM_HELD=1,
// where the row fits: C ≤ 2048 in bf16, 1024 in fp32) against the kernels that read the row again
// for each sum (=0; unset, the two are timed and the faster kept: test_cuda_kernel_ways.cpp): the
// same bits — out, mean, rstd, and the residual sum written
// over a and over b — in fp32 and bf16, at C = 96, 768 and 1024 (bf16: 2, 4 and 4 chunks a lane;
// fp32: 2, 8 and 8).
TEST_F(CudaBf16LayerNorm, LayerNormForwardHeldInRegistersIsBitForBitTheSame) {
  const int N = 67;
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const bool bf16 = std::string(precision) == "bf16";
    for (const int C : {96, 768, 1024}) {
      SCOPED_TRACE("C = " + std::to_string(C));
      const std::vector<float> x = random_vec(size_t(N) * C, 20, -3.f, 3.f),
                               y = random_vec(size_t(N) * C, 21), w = random_vec(C, 22),
                               b = random_vec(C, 23);
      // Every output of both forwards, in one vector of bits: out, mean, rstd (plain), then for
      // the residual forward over a and over b: res, out, mean, rstd.
      const auto run = [&](const char* held) {
        fresh_gpu({{"TRELLIS_LAYERNORM_HELD", held}});
        gpu->set_precision(precision);
        std::vector<uint32_t> bits;
        const auto keep = [&](Ptr p, size_t n) {
          if (p.is_f32()) {
            for (float v : down(p.f32(), n)) bits.push_back(std::bit_cast<uint32_t>(v));
          } else {
            for (bf16_t v : down_bits(p.bf16(), n)) bits.push_back(v.bits);
          }
        };
        const auto tensor = [&](const std::vector<float>& v) {
          return bf16 ? Ptr(up(bits_of(v))) : Ptr(up(v));
        };
        const size_t n = size_t(N) * C;
        float *mean = up(std::vector<float>(N, NAN)), *rstd = up(std::vector<float>(N, NAN));
        Ptr in = tensor(x), out = tensor(std::vector<float>(n, NAN)), pw = tensor(w),
            pb = tensor(b);
        gpu->layernorm_forward(out, mean, rstd, in, pw, pb, N, C);
        keep(out, n), keep(Ptr(mean), N), keep(Ptr(rstd), N);
        for (const bool over_a : {true, false}) {
          Ptr a = tensor(x), bb = tensor(y);
          Ptr res = over_a ? a : bb;
          gpu->residual_layernorm_forward(res, out, mean, rstd, a, bb, pw, pb, N, C);
          keep(res, n), keep(out, n), keep(Ptr(mean), N), keep(Ptr(rstd), N);
        }
        return bits;
      };
      const std::vector<uint32_t> held = run("1"), reread = run("0");
      size_t differ = 0;
      for (size_t i = 0; i < held.size(); ++i) differ += held[i] != reread[i];
      std::printf("layer norm forward %dx%d %s: %zu of %zu values differ held against re-read\n",
                  N, C, precision, differ, held.size());
      EXPECT_EQ(differ, 0u);
    }
  }
}

// The fused layer norm backward's ways, where rows take 16-byte chunks: copying each row's dinp
// into shared memory while it loads the row's dout and inp (TRELLIS_LAYERNORM_PREFETCH=1), its
// warps copying the next row's dout, inp and dinp while they compute on this one
// (TRELLIS_LAYERNORM_AHEAD=1), against loading dinp after the row's means (both 0; unset, every
// way timed): the same bits — dinp (added to), dweight and dbias (added to) — in fp32 and bf16,
// at C = 96, 768 and 1024 (bf16: 2, 4 and 4 chunks a lane; fp32: 2, 8 and 8), and at C = 201 (one
// value a chunk: no copy any way). With one
// multiprocessor (TRELLIS_EMU_SMS=1), so that a warp takes several rows and reuses its copies'
// shared memory, and with 132 (a row a warp).
TEST_F(CudaBf16LayerNorm, LayerNormBackwardWaysAreBitForBitTheSame) {
  const int N = 67;
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const bool bf16 = std::string(precision) == "bf16";
    for (const int C : {96, 768, 1024, 201}) {
      SCOPED_TRACE("C = " + std::to_string(C));
      const size_t n = size_t(N) * C;
      const std::vector<float> x = random_vec(n, 40, -3.f, 3.f), d = random_vec(n, 41),
                               di = random_vec(n, 42), w = random_vec(C, 43),
                               mean = random_vec(N, 44, -0.5f, 0.5f),
                               rstd = random_vec(N, 45, 0.5f, 2.f), dw = random_vec(C, 46),
                               db = random_vec(C, 47);
      for (const char* sms : {"1", "132"}) {
        SCOPED_TRACE(std::string("TRELLIS_EMU_SMS=") + sms);
        // dinp, then dweight and dbias, as bits.
        const auto run = [&](const char* prefetch, const char* ahead) {
          fresh_gpu({{"TRELLIS_LAYERNORM_PREFETCH", prefetch}, {"TRELLIS_LAYERNORM_AHEAD", ahead},
                     {"TRELLIS_EMU_SMS", sms}});
          gpu->set_precision(precision);
          const auto tensor = [&](const std::vector<float>& v) {
            return bf16 ? Ptr(up(bits_of(v))) : Ptr(up(v));
          };
          Ptr pdi = tensor(di);
          float *pdw = up(dw), *pdb = up(db);
          gpu->layernorm_backward(pdi, pdw, pdb, tensor(d), tensor(x), tensor(w), up(mean),
                                  up(rstd), N, C);
          std::vector<uint32_t> bits;
          if (bf16) {
            for (bf16_t v : down_bits(pdi.bf16(), n)) bits.push_back(v.bits);
          } else {
            for (float v : down(pdi.f32(), n)) bits.push_back(std::bit_cast<uint32_t>(v));
          }
          for (float* p : {pdw, pdb})
            for (float v : down(p, C)) bits.push_back(std::bit_cast<uint32_t>(v));
          return bits;
        };
        const std::vector<uint32_t> late = run("0", "0");
        // (a way asked for where it does not apply gives the late loads: here only where this
        // device's shared memory cannot hold the rows ahead — an A100's fp32 rows of 1024 — which
        // says so rather than compare late with late)
        const bool ahead = cuda_layernorm_rows_ahead_fit(C, bf16 ? 2 : 4) || C % 8 != 0;
        if (!ahead)
          std::printf("layer norm backward %dx%d %s: rows a row ahead do not fit this device\n",
                      N, C, precision);
        for (const auto& [way, bits] :
             {std::pair{"dinp copied early", run("1", nullptr)},
              std::pair{"rows a row ahead", ahead ? run(nullptr, "1") : late}}) {
          size_t differ = 0;
          for (size_t i = 0; i < late.size(); ++i) differ += bits[i] != late[i];
          std::printf("layer norm backward %dx%d %s, %s SMs: %zu of %zu values differ with %s "
                      "against dinp loaded late\n",
                      N, C, precision, sms, differ, late.size(), way);
          EXPECT_EQ(differ, 0u) << way;
        }
      }
    }
  }
}

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
