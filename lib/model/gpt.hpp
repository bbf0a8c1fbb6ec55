// The GPT: a walk over the layers, forward and backward, written by hand on top of the Backend's
// kernels. Parameters and gradients come unit by unit from a ParamStore (resident buffers, or
// ZeRO's shards); activations for one micro-batch live in one arena sized up front.
//
// Tensor parallelism (Megatron-LM): each tp rank holds the heads, MLP columns and vocabulary rows
// its ParamTable says. Per block half there is one all-reduce in forward (after the row-parallel
// projection) and one in backward (after the column-parallel input projection) — Megatron's g and
// f. With sequence parallelism the LayerNorm/residual regions hold only this rank's 1/tp of the
// B·T rows, and each all-reduce becomes an all-gather before the column-parallel layer and a
// reduce-scatter after the row-parallel one.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "model/param_store.hpp"
#include "model/params.hpp"

namespace trellis {

/// Activations one block keeps from forward for backward, for a micro-batch of B sequences of T
/// tokens, N = B·T rows. R = N rows in the LayerNorm/residual region (N/tp with sequence
/// parallelism); Hl, KVl, Fl: this tp rank's heads, key/value heads, MLP width.
struct BlockActivations {
  float* ln1;       // (R, C)   LayerNorm 1 output
  float* ln1_mean;  // (R)
  float* ln1_rstd;  // (R)
  float* qkv;       // (N, (Hl+2KVl)·hd)
  float* atty;      // (N, Hl·hd) attention output before the projection
  float* att;       // (B, Hl, T, T) softmax probabilities
  float* res2;      // (R, C)   residual after attention
  float* ln2;       // (R, C)
  float* ln2_mean;  // (R)
  float* ln2_rstd;  // (R)
  float* fch;       // (N, Fl)  MLP hidden before GELU
  float* fch_gelu;  // (N, Fl)
  float* res3;      // (R, C)   residual after the MLP: the block's output
};

class GPT {
 public:
  /// Allocates the activations of one micro-batch of `micro_batch` sequences. Parameters and
  /// gradients live in `store`, laid out by `table` (this tp rank's part). `tp` is the tensor
  /// group (null: no tensor parallelism).
  GPT(const ModelConfig& cfg, const ParamTable& table, ParamStore& store, Backend& backend,
      int micro_batch, Comm* tp = nullptr, bool sequence_parallel = false);

  /// Forward over one micro-batch: inputs, targets (B, T), the same on every tp rank. Returns the
  /// mean loss over its B·T tokens. With dloss ≠ 0 the loss gradient (dloss per token) is left
  /// ready for backward().
  float forward(const int32_t* inputs, const int32_t* targets, float dloss);
  /// Backward of the last forward; gradients accumulate (+=) into the store's gradients.
  void backward();

  const ParamTable& table() const { return table_; }
  const float* losses() const { return losses_; }  // (B, T) per-token losses of the last forward
  /// Bytes of activations kept for backward plus scratch, per micro-batch (the arena's size).
  size_t activation_bytes() const { return act_arena_.capacity(); }

 private:
  void block_forward(int l, const float* x, const float* p);
  void block_backward(int l, const float* x, const float* p, float* g, float* dres);
  void allocate_activations(Arena& arena);
  void loss(float dloss);
  // Sequence parallelism: the full (N, C) rows from this rank's (R, C) chunk (returns `chunk`
  // itself without SP), and the sum over tp of a partial (N, C) into this rank's rows.
  const float* gather_rows(const float* chunk, float* full);
  float* reduce_rows(float* partial, float* chunk);

  ModelConfig cfg_;
  const ParamTable& table_;
  ParamStore& store_;
  Backend& be_;
  Comm* tp_;
  bool sp_;
  int tp_size_ = 1, tp_rank_ = 0;
  int B_, T_, C_, hd_, N_, R_, row0_;
  int Hl_, KVl_, Fl_, Vl_, QKVl_;
  int vocab_begin_, vocab_valid_;  // this rank's first vocabulary row; how many are not padding

  Arena act_arena_;  // every activation below lives here

  // ---- activations (one micro-batch) ----
  int32_t* inputs_;   // (B, T)
  int32_t* targets_;  // (B, T)
  float* encoded_;    // (R, C)
  std::vector<BlockActivations> blocks_;
  float* lnf_;        // (R, C)
  float* lnf_mean_;   // (R)
  float* lnf_rstd_;   // (R)
  float* logits_;     // (N, Vl) — replaced by dlogits in forward when a gradient is wanted
  float* losses_;     // (N)
  float* row_max_;    // (N)    cross-entropy: max logit per row
  float* row_sums_;   // (2, N) cross-entropy: Σexp, then the target's logit (one all-reduce)
  // ---- scratch, reused by every block ----
  float* full_;       // (N, C) sequence parallelism: a gathered LayerNorm output
  float* partial_;    // (N, C) sequence parallelism: a row-parallel layer's partial sums, or a
                      //        gathered residual gradient
  float* dres_;       // (R, C) gradient flowing down the residual stream
  float* dchunk_;     // (R, C) this rank's rows of a reduced gradient
  float* dbtc_;       // (N, C) gradient of a LayerNorm output (partial) / the attention output
  float* dqkv_;       // (N, (Hl+2KVl)·hd)
  float* dfch_gelu_;  // (N, Fl)
  float* dfch_;       // (N, Fl)
};

}  // namespace trellis
