#include "parallel/pipeline.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"

namespace trellis {

Pipeline::Pipeline(const ParallelConfig& parallel, const ModelConfig& model, int micro_batches,
                   Comm& pp, GPT& gpt, ShardedParams& store, const ParamTable& full_table)
    : schedule_(parallel.schedule),
      micro_batches_(micro_batches),
      chunks_(parallel.schedule == "interleaved" ? parallel.virtual_stages : 1),
      pp_(pp),
      gpt_(gpt),
      store_(store) {
  first_ = pp_.rank() == 0;
  last_ = pp_.rank() == pp_.size() - 1;
  // Activations and their gradients are tagged by micro-batch and chunk; the tied weight's two
  // messages take the largest tags this MPI allows (MPI_TAG_UB: the standard promises only
  // 32767; Open MPI over UCX gives 2^23 - 1), above all of those.
  int* ub = nullptr;
  int have_ub = 0;
  // (Read on MPI_COMM_WORLD: Open MPI 4.1 does not carry it to communicators made by a split.)
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &have_ub);
  tied_tag_ = have_ub && ub ? *ub - 1 : 32766;
  const int64_t largest = 2 * (int64_t(micro_batches_) * chunks_ + chunks_) + 1;
  if (pp_.size() > 1 && largest >= tied_tag_)
    throw UserError(strfmt(
        "parallel.pp = %d: this MPI's message tags end at %d (MPI_TAG_UB) and the pipeline needs "
        "%lld for %d micro-batches per step x %d chunks: use fewer micro-batches (a larger "
        "train.micro_batch) or fewer parallel.virtual_stages",
        pp_.size(), tied_tag_ + 1, (long long)largest, micro_batches_, chunks_));
  const int slots = gpt_.num_slots();
  grad_out_.resize(slots * chunks_);
  act_sends_.resize(slots * chunks_);
  grad_sends_.resize(slots * chunks_);
  rows_count_ = gpt_.activation_elems();
  // Every buffer here lives in the backend's memory (device memory for cuda): the host touches
  // it only through the backend's copies and kernels.
  Backend& be = gpt_.backend();
  // The tied LM head: a last stage that is not the first keeps its own copy of wte.
  // It is of the model's type (the bf16 rounding of the first stage's master wte in a bf16 run);
  // its gradient is fp32.
  if (last_ && !first_) {
    const ParamInfo& wte = full_table.find("wte");
    const DType t = gpt_.dtype();
    head_count_ = wte.numel();
    head_wte_ = Buffer(MemKind::Params, dtype_bytes(t) * head_count_, be.allocator());
    head_dwte_ = Buffer(MemKind::Grads, sizeof(float) * head_count_, be.allocator());
    std::vector<float> init(head_count_);  // (Vl, C) initialised on the host, then copied over
    init_parameters(full_table, model.seed, init.data(), wte.offset, wte.offset + wte.numel());
    be.copy_from_host_as(head_wte_.as(t), init.data(), head_count_);
    gpt_.set_head_copy(head_wte_.as(t), head_dwte_.f32());
  }
  if (first_ && !last_) {
    head_count_ = full_table.find("wte").numel();
    tied_in_ = Buffer(MemKind::Comm, sizeof(float) * head_count_, be.allocator());
    // On the step's last micro-batch, before the embeddings' gradient goes to the dp reduction,
    // add the last stage's LM-head gradient of the same tied weight.
    gpt_.set_before_embedding_release([this](float* dwte) {
      if (!last_micro_batch_) return;
      pp_.recv(tied_in_.f32(), head_count_, pp_.size() - 1, tied_tag_);
      gpt_.backend().add(dwte, dwte, tied_in_.f32(), head_count_);  // dwte (Vl, C) += LM head's
    });
  }
}

void Pipeline::poll_sends() {
  for (auto& r : act_sends_) r.test();
  for (auto& r : grad_sends_) r.test();
}

void Pipeline::wait_receive(Request& r, Timers& timers) {
  const double t0 = now_seconds();
  r.wait();
  const double dt = now_seconds() - t0;
  timers.add("pipeline wait", dt);
}

double Pipeline::run_step(const BatchFn& batch, int tokens_per_micro_batch, float dloss,
                          Timers& timers) {
  const int slots = gpt_.num_slots();
  inputs_.resize(tokens_per_micro_batch);
  targets_.resize(tokens_per_micro_batch);
  Backend& be = gpt_.backend();
  if (head_dwte_.data()) be.zero(head_dwte_.data(), head_dwte_.bytes());

  // Where a chunk's activations come from and go to: the neighbouring rank, and round the ring
  // (last rank → first) from one chunk to the next.
  const int p = pp_.size(), r = pp_.rank(), v = chunks_;
  auto tag = [&](int mb, int chunk_of_receiver, bool grad) { return 2 * (mb * v + chunk_of_receiver) + grad; };
  double loss_sum = 0;
  int live = 0;
  for (const PipelineOp& op : pipeline_schedule(schedule_, p, r, micro_batches_, v)) {
    const int mb = op.micro_batch, k = op.chunk, slot = mb % slots, buf = k * slots + slot;
    const bool has_embedding = first_ && k == 0, has_head = last_ && k == v - 1;
    const int from = r > 0 ? r - 1 : p - 1, from_chunk = r > 0 ? k : k - 1;  // forward input
    const int to = r < p - 1 ? r + 1 : 0, to_chunk = r < p - 1 ? k : k + 1;   // forward output
    poll_sends();
    // ZeRO-3's gather of the op's first parameters runs while the stage waits for its input.
    gpt_.prefetch(op.forward, k);
    if (op.forward) {
      batch(mb, inputs_.data(), targets_.data());
      act_sends_[buf].wait();  // the slot's output buffer is about to be rewritten
      if (!has_embedding) {
        Request req = pp_.irecv(gpt_.input(slot, k), rows_count_, from, tag(mb, k, false));
        wait_receive(req, timers);
      }
      {
        ScopedTimer t(timers, "forward");
        loss_sum += gpt_.forward(slot, inputs_.data(), targets_.data(), dloss, k);
      }
      if (!has_head)
        act_sends_[buf] = pp_.isend(gpt_.output(slot, k), rows_count_, to, tag(mb, to_chunk, false));
      max_live_ = std::max(max_live_, ++live);
    } else {
      last_micro_batch_ = mb == micro_batches_ - 1;
      store_.set_last_micro_batch(last_micro_batch_);
      if (!has_head) {
        Request req = pp_.irecv(gpt_.output_grad(), rows_count_, to, tag(mb, k, true));
        wait_receive(req, timers);
      }
      {
        ScopedTimer t(timers, "backward");
        gpt_.backward(slot, k);
      }
      --live;
      if (!has_embedding) {
        grad_sends_[buf].wait();
        const DType t = gpt_.dtype();
        if (!grad_out_[buf].data())
          grad_out_[buf] = Buffer(MemKind::Comm, dtype_bytes(t) * rows_count_, be.allocator());
        be.copy(grad_out_[buf].data(), gpt_.input_grad().data, dtype_bytes(t) * rows_count_);
        grad_sends_[buf] =
            pp_.isend(grad_out_[buf].as(t), rows_count_, from, tag(mb, from_chunk, true));
      }
    }
  }
  // The last stage's LM-head gradient goes to the first stage, which adds it to wte's.
  if (last_ && !first_) pp_.send(head_dwte_.f32(), head_count_, 0, tied_tag_);
  for (auto& r : act_sends_) r.wait();
  for (auto& r : grad_sends_) r.wait();
  return loss_sum;
}

double Pipeline::run_forward(const BatchFn& batch, int micro_batches, int tokens_per_micro_batch) {
  inputs_.resize(tokens_per_micro_batch);
  targets_.resize(tokens_per_micro_batch);
  // Every rank walks (micro-batch, chunk) in the same order and waits only for what it receives
  // from a rank earlier in that order, so nothing can deadlock; the sends stay non-blocking, so
  // the stages still overlap across micro-batches. Tags: as in run_step (micro-batch 0: in one
  // slot the messages between two ranks arrive in order, and the tags stay small).
  const int p = pp_.size(), r = pp_.rank(), v = chunks_, slot = 0;
  double loss_sum = 0;
  for (int mb = 0; mb < micro_batches; ++mb) {
    batch(mb, inputs_.data(), targets_.data());
    for (int k = 0; k < v; ++k) {
      const bool has_embedding = first_ && k == 0, has_head = last_ && k == v - 1;
      const int from = r > 0 ? r - 1 : p - 1, to = r < p - 1 ? r + 1 : 0;
      const int to_chunk = r < p - 1 ? k : k + 1;
      poll_sends();
      Request& send = act_sends_[k * gpt_.num_slots() + slot];
      send.wait();  // the chunk's output buffer is about to be rewritten
      gpt_.prefetch(/*forward=*/true, k);
      if (!has_embedding) pp_.irecv(gpt_.input(slot, k), rows_count_, from, 2 * k).wait();
      loss_sum += gpt_.forward(slot, inputs_.data(), targets_.data(), /*dloss=*/0.f, k);
      if (!has_head) send = pp_.isend(gpt_.output(slot, k), rows_count_, to, 2 * to_chunk);
    }
  }
  for (auto& s : act_sends_) s.wait();
  return loss_sum;
}

void Pipeline::sync_tied_weights() {
  if (pp_.size() == 1) return;
  if (first_) {
    const int emb = gpt_.table().embedding_unit();
    CPtr p = store_.acquire_params(emb);  // gathers under ZeRO-3
    pp_.send(p.at(gpt_.table().wte - gpt_.table().units[emb].begin), head_count_, pp_.size() - 1,
             tied_tag_ + 1);
    store_.release_params(emb);
  } else if (last_) {
    pp_.recv(head_wte_.as(gpt_.dtype()), head_count_, 0, tied_tag_ + 1);
  }
}

}  // namespace trellis
