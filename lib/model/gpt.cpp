#include "model/gpt.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "core/fault.hpp"

namespace trellis {

GPT::GPT(const ModelConfig& cfg, const ParamTable& table, ParamStore& store, Backend& backend,
         int micro_batch, Comm* tp, bool sequence_parallel, int slots, const std::string& recompute)
    : cfg_(cfg),
      table_(table),
      store_(store),
      be_(backend),
      dt_(backend.dtype()),
      tp_(tp),
      recompute_(recompute) {
  chunks_ = table.stage.chunks;
  slots_per_chunk_ = slots;
  blocks_per_chunk_ = int(table.blocks.size()) / chunks_;
  slots_.resize(chunks_ * slots);
  if (tp_) {
    tp_size_ = tp_->size();
    tp_rank_ = tp_->rank();
  }
  sp_ = sequence_parallel && tp_size_ > 1;
  B_ = micro_batch;
  T_ = cfg.seq_len;
  C_ = cfg.d_model;
  hd_ = cfg.d_model / cfg.heads;
  N_ = B_ * T_;
  TRELLIS_CHECK(!sp_ || N_ % tp_size_ == 0, "B*T = %d rows do not split over tp = %d", N_, tp_size_);
  R_ = sp_ ? N_ / tp_size_ : N_;
  row0_ = sp_ ? tp_rank_ * R_ : 0;
  Hl_ = table.heads_local;
  KVl_ = table.kv_heads_local;
  Fl_ = table.d_ff_local;
  Vl_ = table.vocab_local;
  QKVl_ = (Hl_ + 2 * KVl_) * hd_;
  vocab_begin_ = table.vocab_begin;
  vocab_valid_ = std::clamp(cfg.vocab - vocab_begin_, 0, Vl_);

  // Two passes over the same list: the first adds up the sizes, the second hands out slices of
  // one allocation.
  Arena measure = Arena::measuring();
  allocate_activations(measure);
  act_arena_ = Arena(MemKind::Activations, measure.used(), be_.allocator());
  allocate_activations(act_arena_);
}

void GPT::allocate_activations(Arena& a) {
  const int64_t N = N_, R = R_;
  const bool last = table_.stage.last;
  const bool full = recompute_ == "full", selective = recompute_ == "selective";
  auto act = [&](int64_t count) { return a.take(count, dt_); };  // of the run's type
  auto take_block = [&](BlockActivations& b, bool with_att, bool with_output) {
    b.ln1 = act(R * C_);
    b.ln1_mean = a.take_f32(R);
    b.ln1_rstd = a.take_f32(R);
    b.qkv = act(N * QKVl_);
    b.atty = act(N * Hl_ * hd_);
    b.att = with_att ? a.take_f32(be_.attention_state_elems(B_, T_, Hl_)) : nullptr;
    b.res2 = act(R * C_);
    b.ln2 = act(R * C_);
    b.ln2_mean = a.take_f32(R);
    b.ln2_rstd = a.take_f32(R);
    b.fch = act(N * Fl_);
    b.fch_gelu = act(N * Fl_);
    b.res3 = with_output ? act(R * C_) : Ptr();
  };
  // What recomputation does not keep per micro-batch lives once, in shared_.
  shared_ = BlockActivations{};
  if (full) take_block(shared_, true, false);
  if (selective) shared_.att = a.take_f32(be_.attention_state_elems(B_, T_, Hl_));
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    const bool head = last && int(i) / slots_per_chunk_ == chunks_ - 1;
    s.inputs = a.take_i32(N);
    s.targets = a.take_i32(N);
    s.x = act(R * C_);
    s.blocks.assign(blocks_per_chunk_, BlockActivations{});
    for (auto& b : s.blocks) {
      if (full) {
        b = shared_;
        b.res3 = act(R * C_);  // the next block's input: kept
      } else {
        take_block(b, !selective, true);
        if (selective) b.att = shared_.att;
      }
    }
    if (head) {
      s.lnf = act(R * C_);
      s.lnf_mean = a.take_f32(R);
      s.lnf_rstd = a.take_f32(R);
      s.logits = act(N * Vl_);
      s.losses = a.take_f32(N);
      s.row_max = a.take_f32(N);
      s.row_sums = a.take_f32(2 * N);
    }
  }
  full_ = sp_ ? act(N * C_) : Ptr();
  partial_ = sp_ ? act(N * C_) : Ptr();
  dres_ = act(R * C_);
  dchunk_ = sp_ ? act(R * C_) : Ptr();
  dbtc_ = act(N * C_);
  dqkv_ = act(N * QKVl_);
  dfch_gelu_ = act(N * Fl_);
  dfch_ = act(N * Fl_);
}

CPtr GPT::output(int slot, int chunk) const {
  const Slot& s = at(slot, chunk);
  return s.blocks.empty() ? s.x : s.blocks.back().res3;
}

// ---------------------------------------------------------------------------------------------
// tensor-parallel communication

CPtr GPT::gather_rows(CPtr chunk, Ptr full) {
  if (!sp_) return chunk;
  tp_->all_gather(chunk, full, std::vector<int64_t>(tp_size_, int64_t(R_) * C_));
  return full;
}

Ptr GPT::reduce_rows(Ptr partial, Ptr chunk) {
  if (tp_size_ == 1) return partial;
  if (!sp_) {
    tp_->all_reduce(partial, int64_t(N_) * C_);  // Megatron's all-reduce: every rank, every row
    return partial;
  }
  tp_->reduce_scatter(partial, chunk, std::vector<int64_t>(tp_size_, int64_t(R_) * C_));
  return chunk;
}

// ---------------------------------------------------------------------------------------------
// forward. Offsets in ParamTable are flat-buffer indices; a unit's memory starts at its first
// element, so a tensor sits at (offset − unit.begin) in it.

void GPT::block_forward(BlockActivations& a, int l, CPtr x, CPtr p) {
  BlockOffsets o = table_.blocks[l];
  auto at = [&](int64_t offset) { return p.at(offset - o.begin); };
  // A row-parallel layer's bias is added once: by tp rank 0, before the sum over the group.
  const bool adds_bias = tp_rank_ == 0;

  // attention half: res2 = x + proj(attention(qkv(ln1(x))))
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, at(o.ln1_w), at(o.ln1_b), R_, C_);
  CPtr in = gather_rows(a.ln1, full_);
  be_.matmul_forward(a.qkv, in, at(o.qkv_w), at(o.qkv_b), N_, C_, QKVl_);
  be_.attention_forward(a.atty, a.att, a.qkv, B_, T_, Hl_, KVl_, hd_);
  // Each half's residual add: without tensor parallelism the projection's own (the GEMM adds the
  // residual as it writes: no pass of its own over the rows); with it, after the sum over the
  // group — the attention half's fused with ln2, the MLP half's alone.
  const bool residual_in_gemm = tp_size_ == 1 && be_.fuses_residual_into_matmul();
  if (residual_in_gemm) {
    be_.matmul_residual_forward(a.res2, x, a.atty, at(o.attproj_w), at(o.attproj_b), N_,
                                Hl_ * hd_, C_);
    be_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, at(o.ln2_w), at(o.ln2_b), R_, C_);
  } else {
    Ptr partial = sp_ ? partial_ : a.res2;
    be_.matmul_forward(partial, a.atty, at(o.attproj_w), adds_bias ? at(o.attproj_b) : CPtr(), N_,
                       Hl_ * hd_, C_);
    Ptr sum = reduce_rows(partial, a.res2);
    // res2's sum and ln2 in one pass
    be_.residual_layernorm_forward(a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, sum, x, at(o.ln2_w),
                                   at(o.ln2_b), R_, C_);
  }

  // MLP half: res3 = res2 + fcproj(gelu(fc(ln2(res2))))
  in = gather_rows(a.ln2, full_);
  be_.matmul_gelu_forward(a.fch, a.fch_gelu, in, at(o.fc_w), at(o.fc_b), N_, C_, Fl_);
  if (residual_in_gemm) {
    be_.matmul_residual_forward(a.res3, a.res2, a.fch_gelu, at(o.fcproj_w), at(o.fcproj_b), N_,
                                Fl_, C_);
  } else {
    Ptr partial = sp_ ? partial_ : a.res3;
    be_.matmul_forward(partial, a.fch_gelu, at(o.fcproj_w), adds_bias ? at(o.fcproj_b) : CPtr(),
                       N_, Fl_, C_);
    Ptr sum = reduce_rows(partial, a.res3);
    be_.add(a.res3, sum, a.res2, int64_t(R_) * C_);
  }
}

void GPT::prefetch(bool forward, int chunk) {
  const bool first = table_.stage.first && chunk == 0;
  const bool last = table_.stage.last && chunk == chunks_ - 1;
  const int l0 = chunk * blocks_per_chunk_;
  int unit = -1;  // none: a chunk without blocks on a middle stage
  if (forward)
    unit = first                   ? table_.embedding_unit()
           : blocks_per_chunk_ > 0 ? table_.block_unit(l0)
           : last                  ? table_.final_unit()
                                   : -1;
  else if (last)  // the LM head's backward: wte's rows on a first stage, else the final LayerNorm
    unit = first ? table_.embedding_unit() : table_.final_unit();
  else if (blocks_per_chunk_ > 0)
    unit = table_.block_unit(l0 + blocks_per_chunk_ - 1);
  store_.prefetch_params(unit);
}

float GPT::forward(int slot, const int32_t* inputs, const int32_t* targets, float dloss, int chunk) {
  fault_point("forward");  // robustness tests: TRELLIS_FAULT_KILL=forward:STEP
  Slot& s = at(slot, chunk);
  // The embeddings come before the rank's first chunk, the head after its last.
  const bool first = table_.stage.first && chunk == 0;
  const bool last = table_.stage.last && chunk == chunks_ - 1;
  const int emb = table_.embedding_unit(), fin = table_.final_unit();
  be_.copy_from_host(s.inputs, inputs, sizeof(int32_t) * N_);
  be_.copy_from_host(s.targets, targets, sizeof(int32_t) * N_);

  if (first) {
    // Vocab-parallel embedding: each rank fills the rows of the tokens it holds; their sum over
    // the tensor group is the embedding. Positions are added to this rank's rows after the sum.
    const int64_t wte = table_.wte - table_.units[emb].begin, wpe = table_.wpe - table_.units[emb].begin;
    CPtr pe = store_.acquire_params(emb);
    if (blocks_per_chunk_ > 0) store_.prefetch_params(table_.block_unit(0));
    Ptr looked_up = sp_ ? partial_ : s.x;
    be_.embedding_forward(looked_up, s.inputs, pe.at(wte), N_, C_, vocab_begin_, Vl_);
    Ptr sum = reduce_rows(looked_up, s.x);
    if (sum.data != s.x.data) be_.copy(s.x.data, sum.data, s.x.bytes(int64_t(R_) * C_));
    be_.position_forward(s.x, pe.at(wpe), R_, T_, C_, row0_);
    store_.release_params(emb);
  }

  CPtr x = s.x;
  for (int i = 0; i < blocks_per_chunk_; ++i) {
    const int l = chunk * blocks_per_chunk_ + i;
    const int unit = table_.block_unit(l);
    CPtr p = store_.acquire_params(unit);
    // ZeRO-3 gathers the unit used next meanwhile: the chunk's next block, or after the last
    // chunk's last block the final LayerNorm. Another chunk's first block is not next: an
    // interleaved schedule runs this chunk for its other micro-batches first, and holding that
    // block through them would make three gathered units where the plan counts two.
    if (i + 1 < blocks_per_chunk_ || last) store_.prefetch_params(unit + 1);
    block_forward(s.blocks[i], l, x, p);
    store_.release_params(unit);
    x = s.blocks[i].res3;
  }
  if (!last) return 0.f;

  CPtr pf = store_.acquire_params(fin);
  if (first) store_.prefetch_params(emb);
  be_.layernorm_forward(s.lnf, s.lnf_mean, s.lnf_rstd, x,
                        pf.at(table_.lnf_w - table_.units[fin].begin),
                        pf.at(table_.lnf_b - table_.units[fin].begin), R_, C_);
  store_.release_params(fin);

  // LM head tied to the token embedding: logits (N, Vl) = lnf (N, C) · wteᵀ, this rank's columns.
  CPtr lnf = gather_rows(s.lnf, full_);
  CPtr head =
      first ? store_.acquire_params(emb).at(table_.wte - table_.units[emb].begin) : head_wte_;
  be_.matmul_forward(s.logits, lnf, head, nullptr, N_, C_, Vl_);
  if (first) store_.release_params(emb);
  loss(s, dloss);

  host_losses_.resize(N_);
  be_.copy_to_host(host_losses_.data(), s.losses, sizeof(float) * N_);
  double total = 0;
  for (int i = 0; i < N_; ++i) total += host_losses_[i];
  return static_cast<float>(total / N_);
}

// Vocab-parallel cross-entropy: the max and the sums travel, never the logits.
void GPT::loss(Slot& s, float dloss) {
  float* sumexp = s.row_sums;
  float* target_logit = s.row_sums + N_;
  if (tp_size_ == 1)  // the whole vocabulary here: nothing travels, the backend may fuse the steps
    return be_.crossentropy(s.logits, s.losses, s.targets, s.row_max, sumexp, target_logit, N_,
                            Vl_, vocab_valid_, dloss);
  be_.crossentropy_max(s.logits, s.row_max, N_, Vl_, vocab_valid_);
  if (tp_size_ > 1) tp_->all_reduce_max(s.row_max, N_);
  be_.crossentropy_sums(s.logits, s.targets, s.row_max, sumexp, target_logit, N_, Vl_, vocab_valid_,
                        vocab_begin_);
  if (tp_size_ > 1) tp_->all_reduce(s.row_sums, 2 * int64_t(N_));
  be_.crossentropy_finish(s.logits, s.losses, s.targets, s.row_max, sumexp, target_logit, N_, Vl_,
                          vocab_valid_, vocab_begin_, dloss);
}

// ---------------------------------------------------------------------------------------------
// backward: the same walk in reverse. dres_ holds the gradient of the residual stream (R rows).

void GPT::block_backward(BlockActivations& a, int l, CPtr x, CPtr p, float* g, Ptr dres) {
  BlockOffsets o = table_.blocks[l];
  auto at = [&](int64_t offset) { return p.at(offset - o.begin); };
  auto grad = [&](int64_t offset) { return g + (offset - o.begin); };
  // A row-parallel bias's gradient: with sequence parallelism every rank sees all rows of the
  // gathered gradient, so one rank counts it (the replicated gradients are summed over tp later).
  const bool bias_grad = !sp_ || tp_rank_ == 0;

  // Recomputation: run the block (full) or its attention core (selective) again first.
  if (recompute_ == "full") block_forward(a, l, x, p);

  // MLP half. On entry dres = ∂L/∂res3; the residual passes it straight to res2.
  CPtr dout = gather_rows(dres, partial_);
  // The first layer's bias gradient (column sums of dfch_) may come out of the GEMM that makes
  // dfch_ (a backend's choice); else from that layer's own backward.
  const bool fc_bias_summed = be_.matmul_backward_gelu(
      dfch_, dfch_gelu_, grad(o.fcproj_w), bias_grad ? grad(o.fcproj_b) : nullptr, grad(o.fc_b),
      dout, a.fch_gelu, a.fch, at(o.fcproj_w), N_, Fl_, C_);
  CPtr in = gather_rows(a.ln2, full_);
  be_.matmul_backward(dbtc_, grad(o.fc_w), fc_bias_summed ? nullptr : grad(o.fc_b), dfch_, in,
                      at(o.fc_w), N_, C_, Fl_);
  CPtr dln = reduce_rows(dbtc_, dchunk_);
  be_.layernorm_backward(dres, grad(o.ln2_w), grad(o.ln2_b), dln, a.res2, at(o.ln2_w), a.ln2_mean,
                         a.ln2_rstd, R_, C_);

  // Now dres = ∂L/∂res2. Attention half; dbtc_ holds ∂L/∂atty (N, Hl·hd) for a moment.
  dout = gather_rows(dres, partial_);
  be_.matmul_backward(dbtc_, grad(o.attproj_w), bias_grad ? grad(o.attproj_b) : nullptr, dout,
                      a.atty, at(o.attproj_w), N_, Hl_ * hd_, C_);
  if (recompute_ == "selective")  // the saved attention state again; the output goes to dqkv_, unused
    be_.attention_forward(dqkv_, a.att, a.qkv, B_, T_, Hl_, KVl_, hd_);
  be_.attention_backward(dqkv_, dbtc_, a.qkv, a.atty, a.att, B_, T_, Hl_, KVl_, hd_);
  in = gather_rows(a.ln1, full_);
  be_.matmul_backward(dbtc_, grad(o.qkv_w), grad(o.qkv_b), dqkv_, in, at(o.qkv_w), N_, C_, QKVl_);
  dln = reduce_rows(dbtc_, dchunk_);
  be_.layernorm_backward(dres, grad(o.ln1_w), grad(o.ln1_b), dln, x, at(o.ln1_w), a.ln1_mean,
                         a.ln1_rstd, R_, C_);
  // On exit dres = ∂L/∂x, the block's input.
}

void GPT::backward(int slot, int chunk) {
  Slot& s = at(slot, chunk);
  const bool first = table_.stage.first && chunk == 0;
  const bool last = table_.stage.last && chunk == chunks_ - 1;
  const int emb = table_.embedding_unit(), fin = table_.final_unit();
  const int nblocks = blocks_per_chunk_, l0 = chunk * blocks_per_chunk_;
  CPtr last_x = nblocks > 0 ? s.blocks[nblocks - 1].res3 : s.x;
  const int64_t wte = first ? table_.wte - table_.units[emb].begin : 0;
  // The embeddings' gradient stays open until the embedding's backward, this stage's last step.
  float* ge = first ? store_.acquire_grads(emb) : nullptr;

  if (last) {
    const int64_t lnf_w = table_.lnf_w - table_.units[fin].begin;
    const int64_t lnf_b = table_.lnf_b - table_.units[fin].begin;
    CPtr head = first ? store_.acquire_params(emb).at(wte) : head_wte_;
    float* dhead = first ? ge + wte : head_dwte_;
    store_.prefetch_params(fin);
    // s.logits holds dlogits (written in forward). ∂L/∂lnf is partial over the vocabulary shards.
    CPtr lnf = gather_rows(s.lnf, full_);
    be_.matmul_backward(dbtc_, dhead, nullptr, s.logits, lnf, head, N_, C_, Vl_);
    if (first) store_.release_params(emb);
    CPtr dlnf = reduce_rows(dbtc_, dchunk_);

    CPtr pf = store_.acquire_params(fin);
    float* gf = store_.acquire_grads(fin);
    if (nblocks > 0) store_.prefetch_params(table_.block_unit(l0 + nblocks - 1));
    be_.zero(dres_.data, dres_.bytes(int64_t(R_) * C_));
    be_.layernorm_backward(dres_, gf + lnf_w, gf + lnf_b, dlnf, last_x, pf.at(lnf_w), s.lnf_mean,
                           s.lnf_rstd, R_, C_);
    store_.release_params(fin);
    store_.release_grads(fin);
  }
  // Otherwise dres_ holds ∂L/∂output, received from the next stage.

  for (int i = nblocks - 1; i >= 0; --i) {
    const int unit = table_.block_unit(l0 + i);
    CPtr p = store_.acquire_params(unit);
    if (i > 0) store_.prefetch_params(unit - 1);
    float* g = store_.acquire_grads(unit);
    block_backward(s.blocks[i], l0 + i, i > 0 ? s.blocks[i - 1].res3 : s.x, p, g, dres_);
    store_.release_params(unit);
    store_.release_grads(unit);
  }
  // A device backend runs asynchronously: wait, so that the phase timers measure its work.
  be_.synchronize();
  if (!first) return;  // dres_ = ∂L/∂input, for the previous stage

  // The embeddings' backward needs no parameters, only the token ids.
  const int64_t wpe = table_.wpe - table_.units[emb].begin;
  be_.position_backward(ge + wpe, dres_, R_, T_, C_, row0_);
  CPtr dembedded = gather_rows(dres_, partial_);
  be_.embedding_backward(ge + wte, dembedded, s.inputs, N_, C_, vocab_begin_, Vl_);
  if (before_release_) before_release_(ge + wte);
  store_.release_grads(emb);
}

}  // namespace trellis
