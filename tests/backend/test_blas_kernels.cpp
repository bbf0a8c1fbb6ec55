// Which OpenBLAS kernels a run uses: the choice of a better family than OpenBLAS's fallback. The
// re-execution that applies it runs whole programs: tests/cli/test_blas_kernels.sh.
#include <gtest/gtest.h>
#include <cblas.h>

#include <cstdio>
#include <string>

#include "backend/cpu/blas_kernels.hpp"

using namespace trellis;

TEST(BlasKernels, BetterFamilyOnlyWhenOpenBlasFellBackBelowAvx2) {
  const SimdSupport none{}, avx2{true, false}, avx512{true, true};
  // OpenBLAS 0.3.21 on an Emerald Rapids VM: Prescott (SSE3).
  EXPECT_EQ(better_blas_core("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(better_blas_core("Prescott", avx2), "Haswell");
  EXPECT_EQ(better_blas_core("Nehalem", avx2), "Haswell");
  EXPECT_EQ(better_blas_core("Sandybridge", avx512), "SkylakeX");
  // A CPU without AVX2: OpenBLAS's choice is already the best it can run.
  EXPECT_EQ(better_blas_core("Prescott", none), "");
  EXPECT_EQ(better_blas_core("Sandybridge", none), "");
  // A family OpenBLAS chose knowingly stays, even where another would run (Zen on an AVX-512 Zen 4).
  for (const char* core : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "Excavator"})
    EXPECT_EQ(better_blas_core(core, avx512), "") << core;
}

TEST(BlasKernels, ThisCpusFlagsAreConsistent) {
  const SimdSupport cpu = this_cpu_simd();
  if (cpu.avx512) {
    EXPECT_TRUE(cpu.avx2_fma);  // the SkylakeX kernels also use AVX2 and FMA
  }
  const std::string better = better_blas_core(openblas_get_corename(), cpu);
  std::printf("this CPU: AVX2+FMA %d, AVX-512 %d; OpenBLAS chose %s; trellis would use %s\n",
              cpu.avx2_fma, cpu.avx512, openblas_get_corename(),
              better.empty() ? "OpenBLAS's choice" : better.c_str());
}
