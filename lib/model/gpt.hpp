// The GPT: a walk over the layers, forward and backward, written by hand on top of the Backend's
// kernels. Parameters and gradients come unit by unit from a ParamStore (resident buffers, or
// ZeRO's shards); activations for one micro-batch live in one arena sized up front.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "model/param_store.hpp"
#include "model/params.hpp"

namespace trellis {

/// Activations one block keeps from forward for backward. Shapes for a micro-batch of B
/// sequences of T tokens; N = B·T.
struct BlockActivations {
  float* ln1;       // (B, T, C)   LayerNorm 1 output
  float* ln1_mean;  // (B, T)
  float* ln1_rstd;  // (B, T)
  float* qkv;       // (B, T, (H+2KV)·hd)
  float* atty;      // (B, T, H·hd) attention output before the projection
  float* att;       // (B, H, T, T) softmax probabilities
  float* res2;      // (B, T, C)   residual after attention
  float* ln2;       // (B, T, C)
  float* ln2_mean;  // (B, T)
  float* ln2_rstd;  // (B, T)
  float* fch;       // (B, T, F)   MLP hidden before GELU
  float* fch_gelu;  // (B, T, F)
  float* res3;      // (B, T, C)   residual after the MLP: the block's output
};

class GPT {
 public:
  /// Allocates the activations of one micro-batch of `micro_batch` sequences. Parameters and
  /// gradients live in `store`, laid out by `table`.
  GPT(const ModelConfig& cfg, const ParamTable& table, ParamStore& store, Backend& backend,
      int micro_batch);

  /// Forward over one micro-batch: inputs, targets (B, T). Returns the mean loss over its B·T
  /// tokens. With dloss ≠ 0 the loss gradient (dloss per token) is left ready for backward().
  float forward(const int32_t* inputs, const int32_t* targets, float dloss);
  /// Backward of the last forward; gradients accumulate (+=) into the store's gradients.
  void backward();

  const ParamTable& table() const { return table_; }
  int64_t num_params() const { return table_.total(); }
  const float* losses() const { return losses_; }  // (B, T) per-token losses of the last forward

 private:
  // p and g point at the block's first parameter / gradient (unit 1 + l).
  void block_forward(int l, const float* x, const float* p);
  void block_backward(int l, const float* x, const float* p, float* g, float* dres);
  void allocate_activations(Arena& arena);

  ModelConfig cfg_;
  const ParamTable& table_;
  ParamStore& store_;
  Backend& be_;
  int B_, T_, C_, H_, KV_, hd_, F_, V_, QKV_;

  Arena act_arena_;  // every activation below lives here

  // ---- activations (one micro-batch) ----
  int32_t* inputs_;   // (B, T)
  int32_t* targets_;  // (B, T)
  float* encoded_;    // (B, T, C)
  std::vector<BlockActivations> blocks_;
  float* lnf_;        // (B, T, C)
  float* lnf_mean_;   // (B, T)
  float* lnf_rstd_;   // (B, T)
  float* logits_;     // (B, T, V) — replaced by dlogits in forward when a gradient is wanted
  float* losses_;     // (B, T)
  // ---- gradient scratch, reused by every block ----
  float* dres_;       // (B, T, C) gradient flowing down the residual stream
  float* dbtc_;       // (B, T, C) gradient of a LayerNorm output / the attention output
  float* dqkv_;       // (B, T, (H+2KV)·hd)
  float* dfch_gelu_;  // (B, T, F)
  float* dfch_;       // (B, T, F)
};

}  // namespace trellis
