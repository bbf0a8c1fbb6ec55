// cuDNN's fused attention (lib/backend/cuda/cudnn_attention.cu) against the CPU backend: bf16's
// default attention where libcudnn_graph.so.9 loads and the check against the fp32 kernels passes.
// Skips without a CUDA device, and where no cuDNN is found (the backend's details say why). On
// the emulated GPU it runs on the emulated cuDNN (tests/cuda_emu/emu_cudnn_lib.cpp: the backend
// API with an interpreter of the graphs), which also plays the faults a real one may have.
#include <cstring>
#include <regex>

#include "cuda_test_util.hpp"
#include "scoped_env.hpp"
#ifdef TRELLIS_HAVE_CUDA

namespace {

class CudaCudnn : public CudaKernelTest {
 protected:
  void expect_fused(const AttentionShape& s, uint64_t seed);
  /// A fresh backend in bf16 with attention as by default (TRELLIS_TC_ATTENTION and
  /// TRELLIS_CUDNN unset) and `det` as TRELLIS_CUDNN_DETERMINISTIC, after its check at head size
  /// 64: its details, with nothing widened and no warning; "" where no cuDNN is found.
  std::string checked_default(const char* det) {
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr},
               {"TRELLIS_CUDNN", nullptr},
               {"TRELLIS_CUDNN_DETERMINISTIC", det}});
    gpu->set_precision("bf16");
    testing::internal::CaptureStderr();
    const Widening w = gpu->widened_calls(64);
    const std::string said = testing::internal::GetCapturedStderr();
    const std::string details = gpu->details();
    std::printf("%sdetails: %s\n", said.c_str(), details.c_str());
    if (details.find("no cuDNN") != std::string::npos) return "";
    EXPECT_EQ(w, Widening::none);
    EXPECT_NE(details.find("head size 64 on cuDNN"), std::string::npos) << details;
    EXPECT_EQ(said.find("warning"), std::string::npos) << said;
    return details;
  }
  /// A fresh backend in bf16 with attention as by default: whether its cuDNN, once checked, is
  /// the emulated one (whose variables play what a GPU's cuDNN may do).
  bool on_emulated_cudnn() {
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr}, {"TRELLIS_CUDNN", nullptr}});
    gpu->set_precision("bf16");
    gpu->widened_calls(64);
    return gpu->details().find("libcudnn-emu.so") != std::string::npos;
  }
};

/// The checks of the tensor-core attention (Bf16AttentionOnTensorCores): cuDNN also rounds P and
/// dS to bf16 for their products — out within 1e-2 of the CPU's in relative L2, dqkv 2e-2, the
/// logsumexp 2e-3 of a double reference — and, that it ran, at least 3% of out's and dqkv's
/// bf16 entries differ from the CPU's (the fp32 kernels: well under 1%).
void CudaCudnn::expect_fused(const AttentionShape& s, uint64_t seed) {
  SCOPED_TRACE(s.name());
  const Bits qkv = bf16_random(s.qkv_elems(), seed, -2.f, 2.f),
             dout = bf16_random(s.out_elems(), seed + 1);
  const Bf16AttentionRun want = attention_bf16_on(*cpu, s, qkv, dout);
  const Bf16AttentionRun got = attention_bf16_on(*gpu, s, qkv, dout);
  const Bf16Diff out = bf16_diff(got.out, want.out, 0.0),
                 dqkv = bf16_diff(got.dqkv, want.dqkv, 0.0);
  const double e_lse = relative_l2(got.state, lse_reference(widen(qkv), s));
  std::printf("fused attention, %s:\n", s.name().c_str());
  print_bf16("out", out, 0.0, got.out.size());
  print_bf16("dqkv", dqkv, 0.0, got.dqkv.size());
  std::printf("  %-38s fp32: rel. L2 error %.2e against double\n", "logsumexp", e_lse);
  EXPECT_LE(out.rel_l2, 1e-2);
  EXPECT_LE(dqkv.rel_l2, 2e-2);
  EXPECT_LE(e_lse, 2e-3);
  EXPECT_GE(out.differ, 0.03) << "as close as the fp32 kernels: did the forward run?";
  EXPECT_GE(dqkv.differ, 0.03) << "as close as the fp32 kernels: did the backward run?";
}

// The default (TRELLIS_TC_ATTENTION and TRELLIS_CUDNN unset): at each head size cuDNN is checked
// against the fp32 kernels and, agreeing, takes it (the details say so). Grouped heads (2 and 1
// query heads a key/value head, and none grouped), head sizes 32, 64 and 128, T a multiple of
// 128 and not (cuDNN before 9.15.1 refuses that one: the mma.sync kernels run it, which the
// same bounds judge).
TEST_F(CudaCudnn, FusedAttentionIsTheDefaultWhereItAgreesWithTheFp32Kernels) {
  const std::string details = checked_default(nullptr);
  if (details.empty()) GTEST_SKIP() << "no cuDNN: " << gpu->details();
  EXPECT_EQ(details.find("deterministic"), std::string::npos) << details;
  for (const AttentionShape& s :
       {AttentionShape{2, 256, 4, 2, 64}, AttentionShape{2, 128, 4, 4, 32},
        AttentionShape{1, 130, 2, 1, 64}, AttentionShape{1, 128, 2, 1, 128}})
    expect_fused(s, 7 + s.T + s.hd);
  EXPECT_NE(gpu->details().find("head size 32 on cuDNN"), std::string::npos) << gpu->details();
}

// TRELLIS_CUDNN_DETERMINISTIC=1: the backward's graph without the dQ accumulator, which cuDNN's
// engines run with dP in a workspace of their own (the frontend's set_deterministic_algorithm):
// checked and taken like the default (the details say so), within the same bounds, and two
// backwards of the same inputs alike to the bit (on a GPU the check; on the emulated cuDNN,
// which computes in one order, by construction).
TEST_F(CudaCudnn, DeterministicBackwardAgreesAndRepeatsBitForBit) {
  const std::string details = checked_default("1");
  if (details.empty()) GTEST_SKIP() << "no cuDNN: " << gpu->details();
  EXPECT_NE(details.find("deterministic backward"), std::string::npos) << details;
  for (const AttentionShape& s :
       {AttentionShape{2, 256, 4, 2, 64}, AttentionShape{1, 128, 2, 1, 128}}) {
    expect_fused(s, 11 + s.T + s.hd);
    const Bits qkv = bf16_random(s.qkv_elems(), 5, -2.f, 2.f),
               dout = bf16_random(s.out_elems(), 6);
    const Bf16AttentionRun a = attention_bf16_on(*gpu, s, qkv, dout),
                           b = attention_bf16_on(*gpu, s, qkv, dout);
    ASSERT_EQ(a.dqkv.size(), b.dqkv.size());
    EXPECT_EQ(std::memcmp(a.dqkv.data(), b.dqkv.data(), sizeof(bf16_t) * a.dqkv.size()), 0)
        << s.name() << ": two backwards differ";
  }
}

// TRELLIS_CUDNN_TUNE=1: each engine configuration the heuristics offer that builds is timed at
// its pass's first call at a shape (the details give each one's time), one of them kept, the
// results within the same bounds; without it the first, untimed. On the emulated cuDNN, which
// offers two that compute alike (TRELLIS_EMU_CUDNN_ENGINES=2); a GPU's offers what it offers.
TEST_F(CudaCudnn, TuningTimesEachEngineConfiguration) {
  if (!on_emulated_cudnn()) GTEST_SKIP() << "not the emulated cuDNN: " << gpu->details();
  ScopedEnv two("TRELLIS_EMU_CUDNN_ENGINES", "2");
  const std::string ms = "[0-9.e+-]+";
  for (const char* tune : {"1", "0"}) {
    SCOPED_TRACE(std::string("TRELLIS_CUDNN_TUNE=") + tune);
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr},
               {"TRELLIS_CUDNN", nullptr},
               {"TRELLIS_CUDNN_TUNE", tune}});
    gpu->set_precision("bf16");
    expect_fused(AttentionShape{2, 128, 4, 2, 64}, 60);
    const std::string timed = " \\(timed: " + ms + ", " + ms + " ms\\)";
    const std::string want = std::string("B 2 T 128 H 4/2 hd 64: ") +
                             (std::strcmp(tune, "1") == 0
                                  ? "forward mode A #[01] of 2" + timed +
                                        ", backward mode A #[01] of 2" + timed
                                  : "forward mode A #0 of 2, backward mode A #0 of 2(;|$| )");
    EXPECT_TRUE(std::regex_search(gpu->details(), std::regex(want))) << want << "\n"
                                                                     << gpu->details();
  }
  // A configuration that builds but fails to run (TRELLIS_EMU_CUDNN_FAULT=6, the first of two):
  // tuning times it as no choice ("inf") and takes the other, which computes as before.
  ScopedEnv fault("TRELLIS_EMU_CUDNN_FAULT", "6");
  fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr},
             {"TRELLIS_CUDNN", nullptr},
             {"TRELLIS_CUDNN_TUNE", "1"}});
  gpu->set_precision("bf16");
  expect_fused(AttentionShape{2, 128, 4, 2, 64}, 61);
  EXPECT_NE(gpu->details().find("B 2 T 128 H 4/2 hd 64: forward mode A #1 of 2 (timed: inf, "),
            std::string::npos)
      << gpu->details();
}

// On the emulated cuDNN only (a GPU's cuDNN ignores the variables): an engine that computes
// wrongly (TRELLIS_EMU_CUDNN_FAULT=1) fails the check — a warning naming what differed — and the
// mma.sync kernels take the head size; a cuDNN with no engine for the graphs (=2) likewise; one
// whose engines know only the backward's earlier spelling (=3) is given that, and runs, as does
// one whose heuristics offer engines only in the fallback list (=4) or whose first configuration
// does not build (=5); a cuDNN 9.13 (TRELLIS_EMU_CUDNN_VERSION) takes T = 256 but refuses
// T = 130, said once, and that call runs on the mma.sync kernels; TRELLIS_CUDNN=0 leaves cuDNN
// untried. (A library that is not there: tests/cli/test_emulated_gpu.sh, since a process loads
// cuDNN once.)
TEST_F(CudaCudnn, FaultsLeaveAttentionToTheMmaKernels) {
  if (!on_emulated_cudnn()) GTEST_SKIP() << "not the emulated cuDNN: " << gpu->details();
  const AttentionShape s{1, 130, 2, 1, 64};
  for (const char* fault : {"1", "2"}) {
    SCOPED_TRACE(std::string("TRELLIS_EMU_CUDNN_FAULT=") + fault);
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr}, {"TRELLIS_CUDNN", nullptr}});
    gpu->set_precision("bf16");
    ScopedEnv on("TRELLIS_EMU_CUDNN_FAULT", fault);
    testing::internal::CaptureStderr();
    EXPECT_EQ(gpu->widened_calls(64), Widening::none) << "the mma.sync kernels";
    gpu->widened_calls(64);
    const std::string warning = testing::internal::GetCapturedStderr();
    std::printf("%s", warning.c_str());
    EXPECT_NE(warning.find("fused attention at head size 64 is not used"), std::string::npos);
    EXPECT_NE(warning.find(std::string(fault) == "1" ? "relative L2 error" : "no engine"),
              std::string::npos);
    EXPECT_EQ(warning.find("trellis: warning"), warning.rfind("trellis: warning")) << "said once";
    EXPECT_NE(gpu->details().find("head size 64 on the tensor cores (mma.sync"), std::string::npos)
        << gpu->details();
    expect_fused(s, 40);
  }
  for (const char* fault : {"3", "4", "5"}) {
    // Engines that know only the backward masked before the statistics are subtracted (=3): the
    // second spelling builds. Heuristics that offer nothing in mode A (=4): the fallback list's
    // engines. A first configuration that does not build (=5): the next. Each time cuDNN runs.
    SCOPED_TRACE(std::string("TRELLIS_EMU_CUDNN_FAULT=") + fault);
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr}, {"TRELLIS_CUDNN", nullptr}});
    gpu->set_precision("bf16");
    ScopedEnv on("TRELLIS_EMU_CUDNN_FAULT", fault);
    testing::internal::CaptureStderr();
    expect_fused(AttentionShape{2, 130, 4, 2, 64}, 45);
    const std::string said = testing::internal::GetCapturedStderr();
    EXPECT_EQ(said.find("warning"), std::string::npos) << said;
    EXPECT_NE(gpu->details().find("head size 64 on cuDNN"), std::string::npos) << gpu->details();
    // The details name the engine configuration each pass took, of how many the heuristics
    // offered: the fallback list's where mode A offers none, the second where the first fails.
    const std::string took = std::string(fault) == "4"   ? "fallback #0 of 1"
                             : std::string(fault) == "5" ? "mode A #1 of 2"
                                                         : "mode A #0 of 1";
    EXPECT_NE(gpu->details().find("B 2 T 130 H 4/2 hd 64: forward " + took + ", backward " + took),
              std::string::npos)
        << gpu->details();
  }
  {
    SCOPED_TRACE("cuDNN 9.13");
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr}, {"TRELLIS_CUDNN", nullptr}});
    gpu->set_precision("bf16");
    ScopedEnv old("TRELLIS_EMU_CUDNN_VERSION", "91300");
    testing::internal::CaptureStderr();
    expect_fused(AttentionShape{1, 256, 2, 1, 64}, 50);
    expect_fused(s, 51);
    expect_fused(s, 52);
    const std::string warning = testing::internal::GetCapturedStderr();
    std::printf("%s", warning.c_str());
    EXPECT_NE(warning.find("has no plan for attention at B=1 T=130"), std::string::npos);
    EXPECT_NE(warning.find("no multiple of 128"), std::string::npos);
    EXPECT_EQ(warning.find("trellis: warning"), warning.rfind("trellis: warning")) << "said once";
    EXPECT_NE(gpu->details().find("head size 64 on cuDNN 9.13.0"), std::string::npos)
        << gpu->details();
  }
  {
    SCOPED_TRACE("TRELLIS_CUDNN=0");
    fresh_gpu({{"TRELLIS_TC_ATTENTION", nullptr}, {"TRELLIS_CUDNN", "0"}});
    gpu->set_precision("bf16");
    EXPECT_EQ(gpu->widened_calls(64), Widening::none);
    std::printf("TRELLIS_CUDNN=0: %s\n", gpu->details().c_str());
    EXPECT_NE(gpu->details().find("cuDNN not tried (TRELLIS_CUDNN=0)"), std::string::npos);
    EXPECT_NE(gpu->details().find("head size 64 on the tensor cores (mma.sync"), std::string::npos);
  }
}

}  // namespace

#endif  // TRELLIS_HAVE_CUDA
