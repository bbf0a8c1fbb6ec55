#include "backend/cpu/blas_kernels.hpp"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

namespace trellis {

namespace {

// OpenBLAS's kernel families (openblas_get_corename) that use AVX2: what it picks for a CPU it
// recognises as new enough. Any other name on a CPU with AVX2 means it did not recognise it.
bool uses_avx2(const std::string& core) {
  for (const char* name : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "Excavator"})
    if (core == name) return true;
  return false;
}

}  // namespace

SimdSupport this_cpu_simd() {
  __builtin_cpu_init();  // also checks that the OS saves the AVX and AVX-512 registers
  SimdSupport s;
  s.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  s.avx512 = s.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  return s;
}

std::string better_blas_core(const std::string& detected, SimdSupport cpu) {
  if (uses_avx2(detected) || !cpu.avx2_fma) return "";
  return cpu.avx512 ? "SkylakeX" : "Haswell";
}

void use_best_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;  // the user's choice (or ours, after the exec)
  const std::string detected = openblas_get_corename();
  const std::string better = better_blas_core(detected, this_cpu_simd());
  if (better.empty()) return;
  setenv("TRELLIS_BLAS_DETECTED", detected.c_str(), 1);
  setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  execv("/proc/self/exe", argv);
  // Still here: the exec failed. Go on with OpenBLAS's choice, and say nothing false in the log.
  unsetenv("TRELLIS_BLAS_DETECTED");
  unsetenv("OPENBLAS_CORETYPE");
}

std::string blas_description() {
  std::istringstream config(openblas_get_config());  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  std::string name, version;
  config >> name >> version;
  const std::string core = openblas_get_corename();
  std::string out = name + " " + version + ", " + core + " kernels";
  const char* detected = std::getenv("TRELLIS_BLAS_DETECTED");
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (detected && coretype && core == coretype)
    out += std::string(" (chosen by trellis: OpenBLAS detected ") + detected + " on this CPU)";
  else if (coretype)
    out += std::string(" (OPENBLAS_CORETYPE=") + coretype + ")";
  const std::string better = better_blas_core(core, this_cpu_simd());
  if (!better.empty())
    out += "; this CPU allows " + better + ": OPENBLAS_CORETYPE=" + better + " would be faster";
  return out;
}

}  // namespace trellis
