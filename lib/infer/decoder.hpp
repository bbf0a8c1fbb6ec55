// The GPT for generation: the same function as lib/model/gpt.cpp's forward, for one sequence,
// with a key/value cache so that each new token costs one row through the model instead of the
// whole prefix. Parameters are this tensor-parallel rank's part of the whole model (one pipeline
// stage: generation runs with pp = dp = 1), laid out by its ParamTable in one flat buffer.
//
// Tensor parallelism as in training (Megatron-LM): each rank holds its heads, MLP columns and
// vocabulary rows; one all-reduce after each row-parallel projection and after the vocab-parallel
// embedding; the logits of the last row are all-gathered so every rank sees the full vocabulary.
#pragma once
#include <cstdint>

#include "backend/backend.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "model/params.hpp"

namespace trellis {

class Decoder {
 public:
  /// `table`: this tp rank's parameter table of the whole model (ParamTable(cfg, tp, tp_rank));
  /// `params`: its flat buffer (table.total() floats), not owned, must outlive the decoder.
  /// `tp`: the tensor group (null: one rank). Allocates the caches for cfg.seq_len positions.
  Decoder(const ModelConfig& cfg, const ParamTable& table, const float* params, Backend& backend,
          Comm* tp = nullptr);

  /// Runs tokens[0, n) at positions [position(), position() + n) — the prompt in one call (the
  /// prefill), then one token per call — and appends them to the cache. Returns the logits over
  /// the whole vocabulary (padding dropped), the same on every tp rank: of every new row
  /// ((n, V), all_rows) or of the last one only ((1, V)). Valid until the next call.
  /// Collective over tp. position() + n must not exceed cfg.seq_len (checked).
  const float* forward(const int32_t* tokens, int n, bool all_rows = false);

  int position() const { return pos_; }   // tokens in the cache
  int context() const { return T_; }       // the most positions the model has (seq_len)
  int vocab() const { return cfg_.vocab; }
  void reset() { pos_ = 0; }               // forget the sequence (the caches are overwritten)
  size_t bytes() const { return arena_.capacity(); }  // caches and scratch
  size_t cache_bytes() const { return size_t(2) * L_ * T_ * KVl_ * hd_ * sizeof(float); }

 private:
  void allocate(Arena& a);
  /// The sum over tp of a row-parallel layer's partial output (M, C), in place.
  void sum_over_tp(float* partial, int M);

  ModelConfig cfg_;
  const ParamTable& table_;
  const float* params_;
  Backend& be_;
  Comm* tp_;
  int tp_size_ = 1, tp_rank_ = 0;
  int L_, T_, C_, hd_, Hl_, KVl_, Fl_, Vl_, QKVl_;
  int pos_ = 0;

  Arena arena_;
  float* k_cache_;   // (L, T, KVl·hd) this rank's key heads, row t = position t
  float* v_cache_;   // (L, T, KVl·hd)
  int32_t* tokens_;  // (T)
  float* x_;         // (T, C) the residual stream of the new rows
  float* ln_;        // (T, C) a LayerNorm's output
  float* mean_;      // (T)
  float* rstd_;      // (T)
  float* qkv_;       // (T, (Hl+2KVl)·hd)
  float* atty_;      // (T, Hl·hd) attention output before the projection
  float* partial_;   // (T, C) a row-parallel layer's output (partial over tp before the sum)
  float* fch_;       // (T, Fl) MLP hidden before GELU
  float* fch_gelu_;  // (T, Fl)
  float* logits_local_;  // (T, Vl) this rank's vocabulary columns
  float* gathered_;      // (tp, T, Vl) every rank's columns (tp > 1)
  float* logits_;        // (T, V) the whole vocabulary
};

}  // namespace trellis
