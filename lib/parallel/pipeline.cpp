#include "parallel/pipeline.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"

namespace trellis {

std::vector<PipelineOp> pipeline_schedule(const std::string& schedule, int stages, int stage,
                                          int micro_batches) {
  std::vector<PipelineOp> ops;
  const int m = micro_batches;
  if (schedule == "gpipe") {
    for (int i = 0; i < m; ++i) ops.push_back({true, i});
    for (int i = 0; i < m; ++i) ops.push_back({false, i});
    return ops;
  }
  // 1F1B: warm up with the forwards the later stages need before the first backward returns.
  const int warmup = std::min(stages - stage - 1, m);
  for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
  for (int i = 0; i < m - warmup; ++i) {
    ops.push_back({true, warmup + i});
    ops.push_back({false, i});
  }
  for (int i = m - warmup; i < m; ++i) ops.push_back({false, i});
  return ops;
}

int pipeline_slots(const std::string& schedule, int stages, int stage, int micro_batches) {
  if (schedule == "gpipe") return micro_batches;
  return std::min(stages - stage, micro_batches);
}

double bubble_theory(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

Pipeline::Pipeline(const ParallelConfig& parallel, const ModelConfig& model, int micro_batches,
                   Comm& pp, GPT& gpt, ShardedParams& store, const ParamTable& full_table)
    : schedule_(parallel.schedule), micro_batches_(micro_batches), pp_(pp), gpt_(gpt), store_(store) {
  first_ = pp_.rank() == 0;
  last_ = pp_.rank() == pp_.size() - 1;
  const int slots = gpt_.num_slots();
  grad_out_.resize(slots);
  act_sends_.resize(slots);
  grad_sends_.resize(slots);
  rows_count_ = gpt_.activation_elems();
  // The tied LM head: a last stage that is not the first keeps its own copy of wte.
  if (last_ && !first_) {
    const ParamInfo& wte = full_table.find("wte");
    head_count_ = wte.numel();
    head_wte_ = Buffer(MemKind::Params, sizeof(float) * head_count_);
    head_dwte_ = Buffer(MemKind::Grads, sizeof(float) * head_count_);
    init_parameters(full_table, model.seed, head_wte_.f32(), wte.offset, wte.offset + wte.numel());
    gpt_.set_head_copy(head_wte_.f32(), head_dwte_.f32());
  }
  if (first_ && !last_) {
    head_count_ = full_table.find("wte").numel();
    tied_in_ = Buffer(MemKind::Comm, sizeof(float) * head_count_);
    // On the step's last micro-batch, before the embeddings' gradient goes to the dp reduction,
    // add the last stage's LM-head gradient of the same tied weight.
    gpt_.set_before_embedding_release([this](float* dwte) {
      if (!last_micro_batch_) return;
      pp_.recv(tied_in_.f32(), head_count_, pp_.size() - 1, /*tag=*/1 << 24);
      for (int64_t i = 0; i < head_count_; ++i) dwte[i] += tied_in_.f32()[i];
    });
  }
}

void Pipeline::wait_receive(Request& r, Timers& timers) {
  const double t0 = now_seconds();
  r.wait();
  const double dt = now_seconds() - t0;
  waiting_ += dt;
  timers.add("pipeline wait", dt);
}

double Pipeline::run_step(const BatchFn& batch, int tokens_per_micro_batch, float dloss,
                          Timers& timers) {
  const int prev = pp_.rank() - 1, next = pp_.rank() + 1;
  const int slots = gpt_.num_slots();
  inputs_.resize(tokens_per_micro_batch);
  targets_.resize(tokens_per_micro_batch);
  if (head_dwte_.data()) std::memset(head_dwte_.data(), 0, head_dwte_.bytes());

  double loss_sum = 0;
  int live = 0;
  for (const PipelineOp& op : pipeline_schedule(schedule_, pp_.size(), pp_.rank(), micro_batches_)) {
    const int mb = op.micro_batch, slot = mb % slots;
    if (op.forward) {
      batch(mb, inputs_.data(), targets_.data());
      act_sends_[slot].wait();  // the slot's output buffer is about to be rewritten
      if (!first_) {
        Request r = pp_.irecv(gpt_.input(slot), rows_count_, prev, 2 * mb);
        wait_receive(r, timers);
      }
      {
        ScopedTimer t(timers, "forward");
        loss_sum += gpt_.forward(slot, inputs_.data(), targets_.data(), dloss);
      }
      if (!last_) act_sends_[slot] = pp_.isend(gpt_.output(slot), rows_count_, next, 2 * mb);
      max_live_ = std::max(max_live_, ++live);
    } else {
      last_micro_batch_ = mb == micro_batches_ - 1;
      store_.set_last_micro_batch(last_micro_batch_);
      if (!last_) {
        Request r = pp_.irecv(gpt_.output_grad(), rows_count_, next, 2 * mb + 1);
        wait_receive(r, timers);
      }
      {
        ScopedTimer t(timers, "backward");
        gpt_.backward(slot);
      }
      --live;
      if (!first_) {
        grad_sends_[slot].wait();
        if (!grad_out_[slot].data()) grad_out_[slot] = Buffer(MemKind::Comm, sizeof(float) * rows_count_);
        std::memcpy(grad_out_[slot].data(), gpt_.input_grad(), sizeof(float) * rows_count_);
        grad_sends_[slot] = pp_.isend(grad_out_[slot].f32(), rows_count_, prev, 2 * mb + 1);
      }
    }
  }
  // The last stage's LM-head gradient goes to the first stage, which adds it to wte's.
  if (last_ && !first_) pp_.send(head_dwte_.f32(), head_count_, 0, 1 << 24);
  for (auto& r : act_sends_) r.wait();
  for (auto& r : grad_sends_) r.wait();
  return loss_sum;
}

void Pipeline::sync_tied_weights() {
  if (pp_.size() == 1) return;
  if (first_) {
    const int emb = gpt_.table().embedding_unit();
    const float* p = store_.acquire_params(emb);  // gathers under ZeRO-3
    pp_.send(p + (gpt_.table().wte - gpt_.table().units[emb].begin), head_count_, pp_.size() - 1,
             (1 << 24) + 1);
    store_.release_params(emb);
  } else if (last_) {
    pp_.recv(head_wte_.f32(), head_count_, 0, (1 << 24) + 1);
  }
}

}  // namespace trellis
