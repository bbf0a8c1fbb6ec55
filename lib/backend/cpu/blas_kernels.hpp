// Which of OpenBLAS's kernels this process uses. An OpenBLAS built for many CPUs (DYNAMIC_ARCH,
// as Debian's) picks its kernels from the CPU's model number when the library loads, and on a
// model it does not know — Debian 12's 0.3.21 on Sapphire and Emerald Rapids, or a virtual
// machine that hides the model — falls back to its oldest (Prescott, SSE3): sgemm about 8 times
// slower on an AVX-512 core (measured here: 29 against 190–315 GFLOP/s). OpenBLAS reads
// OPENBLAS_CORETYPE only while it loads, before main(), so the way to a better choice is to start
// again: use_best_blas_kernels() re-executes the program with OPENBLAS_CORETYPE set to the best
// kernel family the CPU's instruction sets allow, when OpenBLAS chose one that lacks AVX2. A
// user's own OPENBLAS_CORETYPE is always kept (set it to the detected name to keep OpenBLAS's
// choice).
#pragma once
#include <string>

namespace trellis {

/// The vector instruction sets OpenBLAS's faster kernel families need (and the OS supports).
struct SimdSupport {
  bool avx2_fma = false;  // Haswell's kernels
  bool avx512 = false;    // AVX-512 F, CD, BW, DQ and VL: SkylakeX's kernels
};
SimdSupport this_cpu_simd();

/// The kernel family `cpu` allows (SkylakeX, else Haswell) when `detected` (OpenBLAS's choice) is
/// a family without AVX2 and the CPU has AVX2 and FMA; "" when OpenBLAS's choice stands.
std::string better_blas_core(const std::string& detected, SimdSupport cpu);

/// Call first thing in main(): when OPENBLAS_CORETYPE is unset and better_blas_core() names a
/// family, sets OPENBLAS_CORETYPE to it (and TRELLIS_BLAS_DETECTED to OpenBLAS's choice, for the
/// log) and re-executes /proc/self/exe with the same arguments. Returns when there is nothing to
/// do, or when the exec failed (the run goes on with OpenBLAS's own choice).
void use_best_blas_kernels(char** argv);

/// For the log: "OpenBLAS 0.3.21, SkylakeX kernels (chosen by trellis: OpenBLAS detected
/// Prescott)".
std::string blas_description();

}  // namespace trellis
