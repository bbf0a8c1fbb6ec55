// Model FLOPs, for MFU and the benchmark. Counted as the matrix multiplies a training step must
// do (PaLM's convention, Chowdhery et al. 2022, appendix B): 6 FLOPs per token per weight of every
// matmul (2 forward, 4 backward; the tied LM head counts, position embeddings do not), plus
// attention's QKᵀ and P·V over the full T×T square, 12·L·T·C per token. Recomputation is not
// counted (it is "hardware FLOPs", not model FLOPs).
#pragma once
#include <cstdint>

#include "config/config.hpp"

namespace trellis {

/// Weights that take part in matrix multiplies: every block's four linears and the LM head.
int64_t matmul_params(const ModelConfig& m);
/// Training FLOPs (forward + backward) per token.
double train_flops_per_token(const ModelConfig& m);

}  // namespace trellis
