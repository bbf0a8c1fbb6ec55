// The kernels whose ways to the same bits the CUDA backend times and chooses among
// (lib/backend/cuda/kernel_ways.hpp): the fused cross-entropy, the layer norm forwards, the fused
// layer norm backward, the column sums (a linear layer's bias gradient). By default each shape's first calls take every way in turn; whichever a
// call takes, its outputs must be the same bits, and once the trials are over the profile names
// the way kept. Skips without a CUDA device (the emulated GPU runs it on every build with nvcc).
#include <bit>

#include "cuda_test_util.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaKernelWays : public CudaKernelTest {
 protected:
  /// Every bit of a device tensor of n values (fp32 or bf16).
  std::vector<uint32_t> bits(CPtr p, size_t n) {
    std::vector<uint32_t> out;
    if (p.is_f32()) {
      for (float v : down(p.f32(), n)) out.push_back(std::bit_cast<uint32_t>(v));
    } else {
      for (bf16_t v : down_bits(p.bf16(), n)) out.push_back(v.bits);
    }
    return out;
  }
  Ptr tensor(const std::vector<float>& v, bool bf16) {
    return bf16 ? Ptr(up(bits_of(v))) : Ptr(up(v));
  }
  /// The profile's table of ways: the row naming `kernel`, or "" where there is none.
  static std::string way_row(const std::string& report, const std::string& kernel) {
    const size_t table = report.find("ways to the same bits");
    if (table == std::string::npos) return "";
    const size_t at = report.find("│ " + kernel + " ", table);
    if (at == std::string::npos) return "";
    return report.substr(at, report.find('\n', at) - at);
  }
};

// 8 calls of each kernel on the same inputs, in bf16 and in fp32, with the ways timed (the
// default), on one emulated multiprocessor so that the double-buffered cross-entropy's blocks take
// several rows: every call's outputs are the first call's bits, every way was timed (no "-" among
// the times), and the profile names a way chosen. With TRELLIS_KERNEL_WAYS=0, no trials: no
// table, and every cached cross-entropy call double-buffered (the first way).
TEST_F(CudaKernelWays, EveryWayGivesTheSameBitsAndOneIsKept) {
  const int N = 19, C = 768, OC = 96, V = 20000, valid = 19993, calls = 8;
  const std::vector<float> logits = random_vec(size_t(N) * V, 70, -6.f, 6.f),
                           x = random_vec(size_t(N) * C, 71, -3.f, 3.f),
                           y = random_vec(size_t(N) * C, 72), w = random_vec(C, 73),
                           b = random_vec(C, 74), d = random_vec(size_t(N) * C, 75),
                           dw = random_vec(C, 76), db = random_vec(C, 77),
                           wproj = random_vec(size_t(OC) * C, 79);
  // dout of a linear layer, each row at another scale (2^0 to 2^19): fp32 sums of its bf16
  // values round, so that a column summed in another order gives other bits.
  std::vector<float> dproj = random_vec(size_t(N) * OC, 78);
  for (size_t i = 0; i < dproj.size(); ++i) dproj[i] *= std::ldexp(1.0f, int(i / OC * 7 % 20));
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i == 3 ? -1 : (i * 7919) % valid;
  const size_t n = size_t(N) * C;
  for (const char* timed : {"1", "0"}) {
    SCOPED_TRACE(std::string("TRELLIS_KERNEL_WAYS=") + timed);
    fresh_gpu({{"TRELLIS_KERNEL_WAYS", timed}, {"TRELLIS_EMU_SMS", "1"},
               {"TRELLIS_CUDA_PROFILE", "1"}, {"TRELLIS_LOSS_ROW_CACHE", nullptr},
               {"TRELLIS_LOSS_PIPELINE", nullptr}, {"TRELLIS_LAYERNORM_HELD", nullptr},
               {"TRELLIS_LAYERNORM_PREFETCH", nullptr}, {"TRELLIS_LAYERNORM_AHEAD", nullptr}});
    const int32_t* d_t = up(targets);
    for (const char* precision : {"bf16", "fp32"}) {
      SCOPED_TRACE(precision);
      gpu->set_precision(precision);
      const bool bf16 = std::string(precision) == "bf16";
      std::vector<std::vector<uint32_t>> first;  // the first call's outputs, kernel by kernel
      size_t differ = 0, compared = 0;
      for (int call = 0; call < calls; ++call) {
        std::vector<std::vector<uint32_t>> outs;
        // The fused cross-entropy: dlogits over the logits, the losses and the row statistics.
        Ptr pl = tensor(logits, bf16);
        float *loss = up(std::vector<float>(N, NAN)),
              *stats = up(std::vector<float>(3 * N, NAN));
        gpu->crossentropy(pl, loss, d_t, stats, stats + N, stats + 2 * N, N, V, valid, 1.0f / N);
        outs.push_back(bits(pl, logits.size()));
        outs.push_back(bits(Ptr(loss), N));
        outs.push_back(bits(Ptr(stats), 3 * N));
        // The layer norm forward, and the residual one writing the sum over its first input.
        float *mean = up(std::vector<float>(N, NAN)), *rstd = up(std::vector<float>(N, NAN));
        Ptr out = tensor(std::vector<float>(n, NAN), bf16), pw = tensor(w, bf16),
            pb = tensor(b, bf16);
        gpu->layernorm_forward(out, mean, rstd, tensor(x, bf16), pw, pb, N, C);
        outs.push_back(bits(out, n));
        outs.push_back(bits(Ptr(mean), N));
        outs.push_back(bits(Ptr(rstd), N));
        Ptr a = tensor(x, bf16);
        gpu->residual_layernorm_forward(a, out, mean, rstd, a, tensor(y, bf16), pw, pb, N, C);
        outs.push_back(bits(a, n));
        outs.push_back(bits(out, n));
        // The layer norm backward, adding into dinp, dweight and dbias.
        Ptr dinp = tensor(y, bf16);
        float *pdw = up(dw), *pdb = up(db);
        gpu->layernorm_backward(dinp, pdw, pdb, tensor(d, bf16), tensor(x, bf16), pw, mean, rstd,
                                N, C);
        outs.push_back(bits(dinp, n));
        outs.push_back(bits(Ptr(pdw), C));
        outs.push_back(bits(Ptr(pdb), C));
        // A linear layer's bias gradient: the column sums of dout (N, OC), added into dbias.
        float* pbias = up(db);
        gpu->matmul_backward(Ptr(), up(std::vector<float>(size_t(OC) * C, 0.f)), pbias,
                             tensor(dproj, bf16), tensor(x, bf16), tensor(wproj, bf16), N, C, OC);
        outs.push_back(bits(Ptr(pbias), OC));
        if (call == 0) {
          first = outs;
          continue;
        }
        for (size_t k = 0; k < outs.size(); ++k)
          for (size_t i = 0; i < outs[k].size(); ++i)
            differ += outs[k][i] != first[k][i], ++compared;
      }
      std::printf("kernel ways %s, %s: %zu of %zu values differ from the first call's over %d "
                  "calls\n",
                  std::string(timed) == "1" ? "timed" : "untimed", precision, differ, compared,
                  calls);
      EXPECT_EQ(differ, 0u);
    }
    const std::string report = gpu->profile_report();
    std::printf("%s", report.c_str());
    for (const std::string precision : {"bf16", "fp32"}) {
      for (const std::string kernel :
           {"cross-entropy ", "layer norm forward ", "residual + layer norm forward ",
            "layer norm backward ", "column sums "}) {
        SCOPED_TRACE(kernel + precision);
        const std::string row = way_row(report, kernel + precision);
        if (std::string(timed) == "0") {
          EXPECT_EQ(row, "");
          continue;
        }
        ASSERT_NE(row, "") << report;
        EXPECT_EQ(row.find(" -"), std::string::npos) << "a way not timed, or none chosen: " << row;
      }
      if (std::string(timed) == "0") continue;
      // (rows of 20000 logits and of 768 values fit every way on the emulated GPU, fp32 too)
      const std::string ce = way_row(report, "cross-entropy " + precision),
                        lnb = way_row(report, "layer norm backward " + precision),
                        sums = way_row(report, "column sums " + precision);
      for (const char* way : {"double-buffered", "a row a block", "uncached"})
        EXPECT_NE(ce.find(way), std::string::npos) << ce;
      for (const char* way : {"dinp copied early", "rows a row ahead", "dinp loaded late"})
        EXPECT_NE(lnb.find(way), std::string::npos) << lnb;
      for (const char* way : {"16 B × 8 rows", "16 B × 16 rows", "a value × 8 rows"})
        EXPECT_NE(sums.find(way), std::string::npos) << sums;
    }
    if (std::string(timed) == "0") {
      const size_t piped = report.find("of which double-buffered");
      ASSERT_NE(piped, std::string::npos) << report;
      const std::string all = std::to_string(2 * calls) + " of " + std::to_string(2 * calls);
      EXPECT_NE(report.substr(piped, report.find('\n', piped) - piped).find(all),
                std::string::npos)
          << report;
    }
    EXPECT_FALSE(gpu->settling());
  }
}

}  // namespace

#endif  // TRELLIS_HAVE_CUDA
