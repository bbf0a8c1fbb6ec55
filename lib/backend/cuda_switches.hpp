// The CUDA backend's environment switches that change what it holds in device memory, read in one
// place for the backend (lib/backend/cuda/) and for `trellis plan`'s figures of it (lib/plan/),
// which runs without a GPU and must not drift from what the backend does. Each is "0" or "1"
// (core/env.hpp warns of any other value and takes it as unset).
#pragma once

namespace trellis {

struct CudaSwitches {
  /// TRELLIS_TC_ATTENTION: -1 unset (the tensor-core attention where its check against the fp32
  /// kernels passes), 0 off (the fp32 kernels behind widened copies), 1 on without the check.
  int tc_attention = -1;
  bool cudnn = true;                 // TRELLIS_CUDNN=0: cuDNN's fused attention not tried
  bool cudnn_deterministic = false;  // TRELLIS_CUDNN_DETERMINISTIC=1: its backward without dQ's
                                     // accumulator, bit for bit run to run
  bool gelu_epilogue = true;         // TRELLIS_GELU_EPILOGUE=0: the MLP's GELU in its own kernels
};
/// The switches as the environment sets them now.
CudaSwitches cuda_switches();

}  // namespace trellis
