# Rewrites a CUDA source for the emulated GPU (cuda_emu.hpp), line by line.
# A launch of a kernel named with its template arguments, `k<D><<<grid, block, smem, stream>>>(`
# (configuration on one line): the kernel's address goes with it (cudaFuncSetAttribute's limit).
s/\([A-Za-z_][A-Za-z0-9_:]*<[A-Za-z0-9_, ]*>\)<<<\(.*\)>>>(/::trellis_emu::Launch(\1, \2)(/
# Any other launch, `k<<<...>>>(`: a call of k, so that its template arguments are deduced from the
# arguments as nvcc deduces them.
s/\([A-Za-z_][A-Za-z0-9_:]*\)<<<\(.*\)>>>(/::trellis_emu::Launch(\2)([](auto... a) { \1(a...); })(/
# The block's dynamic shared memory `extern __shared__ [__align__(n)] T name[];`:
s/extern __shared__ \(__align__([0-9]*) \)\{0,1\}\([A-Za-z_][A-Za-z0-9_ ]*[A-Za-z0-9_]\) \([A-Za-z_][A-Za-z0-9_]*\)\[\];/\2* \3 = static_cast<\2*>(::trellis_emu::dynamic_shared());/
# A block's static shared array `__shared__ [__align__(n)] T name[...];`: filled with NaN bits at
# each block's first arrival (cuda_emu.hpp, fresh_shared).
s/^\( *\)__shared__ \(__align__([0-9]*) \)\{0,1\}\([A-Za-z_][A-Za-z0-9_:]*\) \([A-Za-z_][A-Za-z0-9_]*\)\(\[[^;]*\]\);/\1static \2\3 \4\5; ::trellis_emu::fresh_shared(\4, sizeof(\4));/
# The NCCL link opens the emulated NCCL (emu_nccl_lib.cpp) unless TRELLIS_NCCL_LIBRARY names another.
s/: "libnccl\.so\.2");/: TRELLIS_EMU_NCCL_LIBRARY);/
# cuDNN's attention opens the emulated cuDNN (emu_cudnn_lib.cpp) unless TRELLIS_CUDNN_LIBRARY names another.
s/: "libcudnn_graph\.so\.9";/: TRELLIS_EMU_CUDNN_LIBRARY;/
