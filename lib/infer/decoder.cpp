#include "infer/decoder.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace trellis {

Decoder::Decoder(const ModelConfig& cfg, const ParamTable& table, const float* params,
                 Backend& backend, Comm* tp)
    : cfg_(cfg), table_(table), params_(params), be_(backend), tp_(tp) {
  TRELLIS_CHECK(table.stage.first && table.stage.last && int(table.blocks.size()) == cfg.layers,
                "the decoder needs the whole model's table (one pipeline stage)");
  if (tp_) {
    tp_size_ = tp_->size();
    tp_rank_ = tp_->rank();
  }
  L_ = cfg.layers;
  T_ = cfg.seq_len;
  C_ = cfg.d_model;
  hd_ = cfg.d_model / cfg.heads;
  Hl_ = table.heads_local;
  KVl_ = table.kv_heads_local;
  Fl_ = table.d_ff_local;
  Vl_ = table.vocab_local;
  QKVl_ = (Hl_ + 2 * KVl_) * hd_;
  Arena measure = Arena::measuring();
  allocate(measure);
  arena_ = Arena(MemKind::Activations, measure.used());
  allocate(arena_);
}

void Decoder::allocate(Arena& a) {
  const int64_t T = T_;
  k_cache_ = a.take_f32(int64_t(L_) * T * KVl_ * hd_);
  v_cache_ = a.take_f32(int64_t(L_) * T * KVl_ * hd_);
  tokens_ = a.take_i32(T);
  x_ = a.take_f32(T * C_);
  ln_ = a.take_f32(T * C_);
  mean_ = a.take_f32(T);
  rstd_ = a.take_f32(T);
  qkv_ = a.take_f32(T * QKVl_);
  atty_ = a.take_f32(T * Hl_ * hd_);
  partial_ = a.take_f32(T * C_);
  fch_ = a.take_f32(T * Fl_);
  fch_gelu_ = a.take_f32(T * Fl_);
  logits_local_ = a.take_f32(T * Vl_);
  gathered_ = tp_size_ > 1 ? a.take_f32(int64_t(tp_size_) * T * Vl_) : nullptr;
  logits_ = a.take_f32(T * cfg_.vocab);
}

void Decoder::sum_over_tp(float* partial, int M) {
  if (tp_size_ > 1) tp_->all_reduce(partial, int64_t(M) * C_);
}

const float* Decoder::forward(const int32_t* tokens, int n, bool all_rows) {
  TRELLIS_CHECK(n >= 1 && pos_ + n <= T_, "positions [%d, %d) outside the model's context %d",
                pos_, pos_ + n, T_);
  const int M = n, p0 = pos_;
  const float* p = params_;
  std::memcpy(tokens_, tokens, sizeof(int32_t) * M);

  // Vocab-parallel embedding, summed over tp, then the positions [p0, p0 + M).
  be_.embedding_forward(x_, tokens_, p + table_.wte, M, C_, table_.vocab_begin, Vl_);
  sum_over_tp(x_, M);
  be_.position_forward(x_, p + table_.wpe, M, T_, C_, p0);

  // A row-parallel layer's bias is added once: by tp rank 0, before the sum over the group.
  const bool adds_bias = tp_rank_ == 0;
  const int64_t cache_layer = int64_t(T_) * KVl_ * hd_;
  for (int l = 0; l < L_; ++l) {
    const BlockOffsets& o = table_.blocks[l];
    // attention half: x += proj(attention(qkv(ln1(x))))
    be_.layernorm_forward(ln_, mean_, rstd_, x_, p + o.ln1_w, p + o.ln1_b, M, C_);
    be_.matmul_forward(qkv_, ln_, p + o.qkv_w, p + o.qkv_b, M, C_, QKVl_);
    be_.attention_cached(atty_, k_cache_ + l * cache_layer, v_cache_ + l * cache_layer, qkv_, M,
                         p0, Hl_, KVl_, hd_);
    be_.matmul_forward(partial_, atty_, p + o.attproj_w, adds_bias ? p + o.attproj_b : nullptr, M,
                       Hl_ * hd_, C_);
    sum_over_tp(partial_, M);
    be_.add(x_, x_, partial_, int64_t(M) * C_);
    // MLP half: x += fcproj(gelu(fc(ln2(x))))
    be_.layernorm_forward(ln_, mean_, rstd_, x_, p + o.ln2_w, p + o.ln2_b, M, C_);
    be_.matmul_gelu_forward(fch_, fch_gelu_, ln_, p + o.fc_w, p + o.fc_b, M, C_, Fl_);
    be_.matmul_forward(partial_, fch_gelu_, p + o.fcproj_w, adds_bias ? p + o.fcproj_b : nullptr,
                       M, Fl_, C_);
    sum_over_tp(partial_, M);
    be_.add(x_, x_, partial_, int64_t(M) * C_);
  }
  pos_ += M;

  // Final LayerNorm and the LM head (tied to wte) on the rows wanted: logits (rows, Vl).
  const int rows = all_rows ? M : 1;
  const float* last = x_ + int64_t(M - rows) * C_;
  be_.layernorm_forward(ln_, mean_, rstd_, last, p + table_.lnf_w, p + table_.lnf_b, rows, C_);
  be_.matmul_forward(logits_local_, ln_, p + table_.wte, nullptr, rows, C_, Vl_);

  // Every rank's vocabulary columns, in rank order, without the padding past V.
  const int V = cfg_.vocab;
  if (tp_size_ == 1 && Vl_ == V) return logits_local_;
  const float* gathered = logits_local_;  // (tp, rows, Vl)
  if (tp_size_ > 1) {
    tp_->all_gather(logits_local_, gathered_, std::vector<int64_t>(tp_size_, int64_t(rows) * Vl_));
    gathered = gathered_;
  }
  for (int r = 0; r < tp_size_; ++r) {
    const int begin = r * Vl_, count = std::clamp(V - begin, 0, Vl_);
    for (int i = 0; i < rows; ++i)
      std::memcpy(logits_ + int64_t(i) * V + begin,
                  gathered + (int64_t(r) * rows + i) * Vl_, sizeof(float) * count);
  }
  return logits_;
}

}  // namespace trellis
