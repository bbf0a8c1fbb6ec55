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
#include <functional>
#include <string>
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
/// parallelism); Hl, KVl, Fl: this tp rank's heads, key/value heads, MLP width. A Ptr is of the
/// run's type (fp32, or bf16 with system.precision = bf16); a float* is fp32 in every run.
struct BlockActivations {
  Ptr ln1;          // (R, C)   LayerNorm 1 output
  float* ln1_mean;  // (R)
  float* ln1_rstd;  // (R)
  Ptr qkv;          // (N, (Hl+2KVl)·hd)
  Ptr atty;         // (N, Hl·hd) attention output before the projection
  float* att;       // attention_state_elems(B, T, Hl): CPU the softmax probabilities
                    // (B, Hl, T, T); CUDA each row's logsumexp (B, Hl, T)
  Ptr res2;         // (R, C)   residual after attention
  Ptr ln2;          // (R, C)
  float* ln2_mean;  // (R)
  float* ln2_rstd;  // (R)
  Ptr fch;          // (N, Fl)  MLP hidden before GELU
  Ptr fch_gelu;     // (N, Fl)
  Ptr res3;         // (R, C)   residual after the MLP: the block's output
};

/// One micro-batch's activations on this stage, in the backend's memory (device memory for cuda).
/// A pipeline keeps several in flight (slots).
struct Slot {
  int32_t* inputs;    // (B, T) token ids (first stage)
  int32_t* targets;   // (B, T) next-token ids (last stage)
  Ptr x;              // (R, C) the stage's input: embeddings (first stage) or a received activation
  std::vector<BlockActivations> blocks;  // this stage's blocks
  Ptr lnf;                               // (R, C)                       last stage
  float* lnf_mean;    // (R)
  float* lnf_rstd;    // (R)
  Ptr logits;         // (N, Vl) — replaced by dlogits in forward when a gradient is wanted
  float* losses;      // (N)
  float* row_max;     // (N)    cross-entropy: max logit per row
  float* row_sums;    // (2, N) cross-entropy: Σexp, then the target's logit (one all-reduce)
};

class GPT {
 public:
  /// Allocates the activations of `slots` micro-batches (per model chunk, interleaved schedule) of `micro_batch` sequences (a pipeline
  /// keeps several in flight). Parameters and gradients live in `store`, laid out by `table`
  /// (this tp rank's part of this pipeline stage). `tp` is the tensor group (null: none).
  /// `recompute`: "none"; "selective" keeps no attention probabilities (recomputed in backward);
  /// "full" keeps only each block's output and recomputes the block in backward.
  GPT(const ModelConfig& cfg, const ParamTable& table, ParamStore& store, Backend& backend,
      int micro_batch, Comm* tp = nullptr, bool sequence_parallel = false, int slots = 1,
      const std::string& recompute = "none");

  /// Forward over one micro-batch in `slot`: inputs, targets (B, T), the same on every tp rank;
  /// a stage other than the first reads its input from input(slot). Returns the mean loss over
  /// the B·T tokens on the last stage (0 elsewhere). With dloss ≠ 0 the loss gradient (dloss per
  /// token) is left ready for backward().
  float forward(int slot, const int32_t* inputs, const int32_t* targets, float dloss, int chunk = 0);
  /// Backward of the micro-batch in `slot`; gradients accumulate (+=) into the store's. A stage
  /// other than the last reads ∂L/∂output from output_grad() first.
  void backward(int slot, int chunk = 0);
  /// ZeRO-3: starts gathering the first parameters that forward (or backward) of `chunk` will
  /// read, so that the gather overlaps what comes before the call (a pipeline stage's wait for
  /// its input). No unit is gathered between two such calls: with the call's own prefetches
  /// that makes the two units at once that the plan counts.
  void prefetch(bool forward, int chunk = 0);

  // Pipeline plumbing, (R, C) each, of the activations' type.
  int64_t activation_elems() const { return int64_t(R_) * C_; }
  /// The type of the activations and of the parameters the model reads (the backend's dtype()).
  DType dtype() const { return dt_; }
  Ptr input(int slot, int chunk = 0) { return at(slot, chunk).x; }
  CPtr output(int slot, int chunk = 0) const;
  Ptr output_grad() { return dres_; }
  /// The backend the model runs on: whatever shares its memory (the pipeline's buffers) uses it.
  Backend& backend() { return be_; }
  CPtr input_grad() const { return dres_; }  // after backward: ∂L/∂input

  /// A last stage that is not the first keeps its own copy of the tied LM head (Vl, C) (of the
  /// activations' type) and accumulates its gradient (fp32) apart; the pipeline keeps both in
  /// step with the first stage's wte.
  void set_head_copy(CPtr wte, float* dwte) { head_wte_ = wte, head_dwte_ = dwte; }
  /// Called on the first stage just before the embeddings' gradient is released, with that
  /// gradient's wte part (Vl, C): the pipeline adds the last stage's LM-head gradient there.
  void set_before_embedding_release(std::function<void(float*)> f) { before_release_ = std::move(f); }

  const ParamTable& table() const { return table_; }
  /// (B, T), last chunk; in the backend's memory (device memory for cuda).
  const float* losses(int slot = 0) const { return slots_[slot].losses; }
  /// (B·T, Vl) this rank's vocabulary columns, after a forward with dloss = 0 (last stage); in the
  /// backend's memory, of the activations' type.
  CPtr logits(int slot = 0) const { return slots_[slot].logits; }
  int vocab_rows() const { return Vl_; }  // Vl: this rank's vocabulary rows, padding included
  /// Bytes of activations and scratch, all slots (the arena's size).
  size_t activation_bytes() const { return act_arena_.capacity(); }
  int num_slots() const { return slots_per_chunk_; }  // per model chunk

 private:
  // l: the block's index in the table; a: its activations in the slot.
  void block_forward(BlockActivations& a, int l, CPtr x, CPtr p);
  void block_backward(BlockActivations& a, int l, CPtr x, CPtr p, float* g, Ptr dres);
  Slot& at(int slot, int chunk) { return slots_[chunk * slots_per_chunk_ + slot]; }
  const Slot& at(int slot, int chunk) const { return slots_[chunk * slots_per_chunk_ + slot]; }
  void allocate_activations(Arena& arena);
  void loss(Slot& s, float dloss);
  // Sequence parallelism: the full (N, C) rows from this rank's (R, C) chunk (returns `chunk`
  // itself without SP), and the sum over tp of a partial (N, C) into this rank's rows.
  CPtr gather_rows(CPtr chunk, Ptr full);
  Ptr reduce_rows(Ptr partial, Ptr chunk);

  ModelConfig cfg_;
  const ParamTable& table_;
  ParamStore& store_;
  Backend& be_;
  DType dt_;  // of activations and the parameters read
  Comm* tp_;
  bool sp_;
  int tp_size_ = 1, tp_rank_ = 0;
  int B_, T_, C_, hd_, N_, R_, row0_;
  int Hl_, KVl_, Fl_, Vl_, QKVl_;
  int vocab_begin_, vocab_valid_;  // this rank's first vocabulary row; how many are not padding

  Arena act_arena_;  // every activation below lives here
  std::vector<Slot> slots_;  // (chunks, slots per chunk)
  int slots_per_chunk_ = 1, chunks_ = 1, blocks_per_chunk_ = 0;
  std::string recompute_;
  BlockActivations shared_;  // recomputation: the activations of the block being recomputed
  CPtr head_wte_;            // (Vl, C) last stage's copy of the tied LM head
  float* head_dwte_ = nullptr;       // (Vl, C)
  std::function<void(float*)> before_release_;
  // ---- scratch, reused by every block and slot (the activations' type) ----
  Ptr full_;       // (N, C) sequence parallelism: a gathered LayerNorm output
  Ptr partial_;    // (N, C) sequence parallelism: a row-parallel layer's partial sums, or a
                   //        gathered residual gradient
  Ptr dres_;       // (R, C) gradient flowing down the residual stream
  Ptr dchunk_;     // (R, C) this rank's rows of a reduced gradient
  Ptr dbtc_;       // (N, C) gradient of a LayerNorm output (partial) / the attention output
  Ptr dqkv_;       // (N, (Hl+2KVl)·hd)
  Ptr dfch_gelu_;  // (N, Fl)
  Ptr dfch_;       // (N, Fl)
  std::vector<float> host_losses_;  // (N) the losses copied out of the backend's memory
};

}  // namespace trellis
