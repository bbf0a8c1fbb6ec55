#include "backend/cuda_switches.hpp"

#include "core/env.hpp"

namespace trellis {

CudaSwitches cuda_switches() {
  CudaSwitches s;
  s.tc_attention = env_switch("TRELLIS_TC_ATTENTION");
  s.cudnn = env_switch_on("TRELLIS_CUDNN", true);
  s.cudnn_deterministic = env_switch_on("TRELLIS_CUDNN_DETERMINISTIC", false);
  s.gelu_epilogue = env_switch_on("TRELLIS_GELU_EPILOGUE", true);
  return s;
}

}  // namespace trellis
