#include "model/gpt.hpp"

#include <cstring>

#include "core/error.hpp"

namespace trellis {

GPT::GPT(const ModelConfig& cfg, const ParamTable& table, ParamStore& store, Backend& backend,
         int micro_batch)
    : cfg_(cfg), table_(table), store_(store), be_(backend) {
  B_ = micro_batch;
  T_ = cfg.seq_len;
  C_ = cfg.d_model;
  H_ = cfg.heads;
  KV_ = cfg.kv_heads;
  hd_ = cfg.d_model / cfg.heads;
  F_ = cfg.d_ff;
  V_ = cfg.vocab;
  QKV_ = (H_ + 2 * KV_) * hd_;

  // Two passes over the same list: the first adds up the sizes, the second hands out slices of
  // one allocation.
  Arena measure = Arena::measuring();
  allocate_activations(measure);
  act_arena_ = Arena(MemKind::Activations, measure.used());
  allocate_activations(act_arena_);
}

void GPT::allocate_activations(Arena& a) {
  const int64_t N = int64_t(B_) * T_;
  inputs_ = a.take_i32(N);
  targets_ = a.take_i32(N);
  encoded_ = a.take_f32(N * C_);
  blocks_.assign(cfg_.layers, BlockActivations{});
  for (auto& b : blocks_) {
    b.ln1 = a.take_f32(N * C_);
    b.ln1_mean = a.take_f32(N);
    b.ln1_rstd = a.take_f32(N);
    b.qkv = a.take_f32(N * QKV_);
    b.atty = a.take_f32(N * H_ * hd_);
    b.att = a.take_f32(int64_t(B_) * H_ * T_ * T_);
    b.res2 = a.take_f32(N * C_);
    b.ln2 = a.take_f32(N * C_);
    b.ln2_mean = a.take_f32(N);
    b.ln2_rstd = a.take_f32(N);
    b.fch = a.take_f32(N * F_);
    b.fch_gelu = a.take_f32(N * F_);
    b.res3 = a.take_f32(N * C_);
  }
  lnf_ = a.take_f32(N * C_);
  lnf_mean_ = a.take_f32(N);
  lnf_rstd_ = a.take_f32(N);
  logits_ = a.take_f32(N * V_);
  losses_ = a.take_f32(N);
  dres_ = a.take_f32(N * C_);
  dbtc_ = a.take_f32(N * C_);
  dqkv_ = a.take_f32(N * QKV_);
  dfch_gelu_ = a.take_f32(N * F_);
  dfch_ = a.take_f32(N * F_);
}

// ---------------------------------------------------------------------------------------------
// forward. Offsets in ParamTable are flat-buffer indices; a unit's memory starts at its first
// element, so a tensor sits at (offset − unit.begin) in it.

void GPT::block_forward(int l, const float* x, const float* p) {
  const int N = B_ * T_;
  BlockOffsets o = table_.blocks[l];
  auto at = [&](int64_t offset) { return p + (offset - o.begin); };
  BlockActivations& a = blocks_[l];

  // attention half: res2 = x + proj(attention(qkv(ln1(x))))
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, at(o.ln1_w), at(o.ln1_b), N, C_);
  be_.matmul_forward(a.qkv, a.ln1, at(o.qkv_w), at(o.qkv_b), N, C_, QKV_);
  be_.attention_forward(a.atty, a.att, a.qkv, B_, T_, H_, KV_, hd_);
  be_.matmul_forward(a.res2, a.atty, at(o.attproj_w), at(o.attproj_b), N, H_ * hd_, C_);
  be_.add(a.res2, a.res2, x, int64_t(N) * C_);

  // MLP half: res3 = res2 + fcproj(gelu(fc(ln2(res2))))
  be_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, at(o.ln2_w), at(o.ln2_b), N, C_);
  be_.matmul_forward(a.fch, a.ln2, at(o.fc_w), at(o.fc_b), N, C_, F_);
  be_.gelu_forward(a.fch_gelu, a.fch, int64_t(N) * F_);
  be_.matmul_forward(a.res3, a.fch_gelu, at(o.fcproj_w), at(o.fcproj_b), N, F_, C_);
  be_.add(a.res3, a.res3, a.res2, int64_t(N) * C_);
}

float GPT::forward(const int32_t* inputs, const int32_t* targets, float dloss) {
  const int N = B_ * T_;
  const int emb = table_.embedding_unit(), fin = table_.final_unit();
  const int64_t wte = table_.wte - table_.units[emb].begin, wpe = table_.wpe - table_.units[emb].begin;
  std::memcpy(inputs_, inputs, sizeof(int32_t) * N);
  std::memcpy(targets_, targets, sizeof(int32_t) * N);

  const float* pe = store_.acquire_params(emb);
  store_.prefetch_params(table_.block_unit(0));
  be_.encoder_forward(encoded_, inputs_, pe + wte, pe + wpe, B_, T_, C_);
  store_.release_params(emb);

  const float* x = encoded_;
  for (int l = 0; l < cfg_.layers; ++l) {
    const float* p = store_.acquire_params(table_.block_unit(l));
    store_.prefetch_params(table_.block_unit(l) + 1);  // the next block, or the final LayerNorm
    block_forward(l, x, p);
    store_.release_params(table_.block_unit(l));
    x = blocks_[l].res3;
  }

  const float* pf = store_.acquire_params(fin);
  store_.prefetch_params(emb);
  be_.layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, x, pf + (table_.lnf_w - table_.units[fin].begin),
                        pf + (table_.lnf_b - table_.units[fin].begin), N, C_);
  store_.release_params(fin);

  // LM head tied to the token embedding: logits (N, V) = lnf (N, C) · wteᵀ.
  pe = store_.acquire_params(emb);
  be_.matmul_forward(logits_, lnf_, pe + wte, nullptr, N, C_, V_);
  store_.release_params(emb);
  be_.softmax_crossentropy(logits_, losses_, targets_, N, V_, dloss);

  double sum = 0;
  for (int i = 0; i < N; ++i) sum += losses_[i];
  return static_cast<float>(sum / N);
}

// ---------------------------------------------------------------------------------------------
// backward: the same walk in reverse. dres_ holds the gradient of the residual stream.

void GPT::block_backward(int l, const float* x, const float* p, float* g, float* dres) {
  const int N = B_ * T_;
  BlockOffsets o = table_.blocks[l];
  auto at = [&](int64_t offset) { return p + (offset - o.begin); };
  auto grad = [&](int64_t offset) { return g + (offset - o.begin); };
  BlockActivations& a = blocks_[l];

  // MLP half. On entry dres = ∂L/∂res3; the residual passes it straight to res2.
  be_.matmul_backward(dfch_gelu_, grad(o.fcproj_w), grad(o.fcproj_b), dres, a.fch_gelu,
                      at(o.fcproj_w), N, F_, C_);
  be_.gelu_backward(dfch_, a.fch, dfch_gelu_, int64_t(N) * F_);
  be_.matmul_backward(dbtc_, grad(o.fc_w), grad(o.fc_b), dfch_, a.ln2, at(o.fc_w), N, C_, F_);
  be_.layernorm_backward(dres, grad(o.ln2_w), grad(o.ln2_b), dbtc_, a.res2, at(o.ln2_w),
                         a.ln2_mean, a.ln2_rstd, N, C_);
  // Now dres = ∂L/∂res2. Attention half.
  be_.matmul_backward(dbtc_, grad(o.attproj_w), grad(o.attproj_b), dres, a.atty, at(o.attproj_w),
                      N, H_ * hd_, C_);
  be_.attention_backward(dqkv_, dbtc_, a.qkv, a.att, B_, T_, H_, KV_, hd_);
  be_.matmul_backward(dbtc_, grad(o.qkv_w), grad(o.qkv_b), dqkv_, a.ln1, at(o.qkv_w), N, C_, QKV_);
  be_.layernorm_backward(dres, grad(o.ln1_w), grad(o.ln1_b), dbtc_, x, at(o.ln1_w), a.ln1_mean,
                         a.ln1_rstd, N, C_);
  // On exit dres = ∂L/∂x, the block's input.
}

void GPT::backward() {
  const int N = B_ * T_;
  const int emb = table_.embedding_unit(), fin = table_.final_unit();
  const int64_t wte = table_.wte - table_.units[emb].begin, wpe = table_.wpe - table_.units[emb].begin;
  const int64_t lnf_w = table_.lnf_w - table_.units[fin].begin;
  const int64_t lnf_b = table_.lnf_b - table_.units[fin].begin;
  const float* last = cfg_.layers > 0 ? blocks_[cfg_.layers - 1].res3 : encoded_;

  // The embeddings' gradient stays open until the encoder's backward, the last step.
  float* ge = store_.acquire_grads(emb);
  const float* pe = store_.acquire_params(emb);
  store_.prefetch_params(fin);
  // logits_ holds dlogits (written by softmax_crossentropy in forward).
  be_.matmul_backward(dbtc_, ge + wte, nullptr, logits_, lnf_, pe + wte, N, C_, V_);
  store_.release_params(emb);

  const float* pf = store_.acquire_params(fin);
  float* gf = store_.acquire_grads(fin);
  if (cfg_.layers > 0) store_.prefetch_params(table_.block_unit(cfg_.layers - 1));
  std::memset(dres_, 0, sizeof(float) * N * C_);
  be_.layernorm_backward(dres_, gf + lnf_w, gf + lnf_b, dbtc_, last, pf + lnf_w, lnf_mean_,
                         lnf_rstd_, N, C_);
  store_.release_params(fin);
  store_.release_grads(fin);

  for (int l = cfg_.layers - 1; l >= 0; --l) {
    const int unit = table_.block_unit(l);
    const float* p = store_.acquire_params(unit);
    if (l > 0) store_.prefetch_params(unit - 1);
    float* g = store_.acquire_grads(unit);
    block_backward(l, l > 0 ? blocks_[l - 1].res3 : encoded_, p, g, dres_);
    store_.release_params(unit);
    store_.release_grads(unit);
  }
  // The encoder's backward needs no parameters, only the token ids.
  be_.encoder_backward(ge + wte, ge + wpe, dres_, inputs_, B_, T_, C_);
  store_.release_grads(emb);
}

}  // namespace trellis
