// The memory model of `trellis plan`: bytes per rank for one layout, by the same kinds the trainer
// measures (core/memory.hpp: parameters, gradients, optimizer, activations, comm buffers, scratch).
//
// What it counts depends on where the run computes and in what precision:
//   fp32 / bf16 (this code, buffer by buffer)  the flat parameter and gradient buffers and their
//         ZeRO shards, AdamW's m and v, the activation arena of lib/model/gpt.cpp (every slot a
//         pipeline schedule keeps in flight, recomputation, sequence parallelism), ZeRO's
//         gradient buckets and stage-3 gathers, the pipeline's message buffers and tied LM-head
//         copy, and the backend's own buffers. On the CPU (fp32 only): attention keeps its
//         probabilities (B,H,T,T) and the attention backward has a (T,T) scratch per thread. On a
//         GPU (system.backend = cuda, `device`): attention keeps one logsumexp per row (B,H,T),
//         plus the cuBLASLt workspace and the backend's scratch; with system.precision = bf16 also
//         the bf16 copies of the largest GEMM's operands (fp32 storage otherwise: this code's
//         bf16 rounds GEMM operands only). Whole-program checks: tests/cli/test_plan.sh holds the
//         CPU figure to within 10 % of the measured peak; tests/plan/test_plan.cpp holds the GPU
//         figures to within 3 % of peaks measured on an H200.
//   bf16-full  a full bf16 GPU run as ZeRO and Megatron-LM count it — where this code's bf16 is
//         heading, and what Megatron-LM or DeepSpeed would need: bf16 parameters and gradients,
//         fp32 master weights and Adam moments (ZeRO's 2Ψ + 2Ψ + 12Ψ), activations by Megatron's
//         per-layer formula (Korthikanti et al. 2022), cuBLASLt workspace and communication
//         buckets.
//
// Everything here is arithmetic on the deck: no MPI, no allocation of the model itself.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "config/config.hpp"
#include "model/params.hpp"

namespace trellis {

enum class Precision { FP32, BF16, BF16_FULL };
/// "fp32" | "bf16" | "bf16-full"; throws UserError naming --precision.
Precision parse_precision(const std::string& text);
const char* precision_name(Precision p);

// ---- the textbook formulas, exposed for tests and for the explanations the plan prints ----

/// Model-state bytes per rank for Ψ parameters over N_d data-parallel ranks at ZeRO `stage`
/// (Rajbhandari et al. 2020, §5.1). bf16-full with fp32 Adam: parameters 2Ψ, gradients 2Ψ,
/// optimizer 12Ψ (fp32 copy, m, v) — 16Ψ at stage 0, 4Ψ + 12Ψ/N_d at 1, 2Ψ + 14Ψ/N_d at 2,
/// 16Ψ/N_d at 3. fp32 and this code's bf16: 4Ψ, 4Ψ, 8Ψ (m, v). Shards are unpadded Ψ/N_d here.
struct ModelStates {
  double params, grads, optim;
  double total() const { return params + grads + optim; }
};
ModelStates zero_model_states(double psi, int dp, int zero_stage, Precision precision);

/// Activation bytes one transformer layer keeps for backward, per micro-batch, as Megatron-LM
/// counts them with 16-bit activations and 1-byte dropout masks (Korthikanti et al. 2022, §4):
/// s·b·h·(34 + 5·a·s/h) for one device; s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism t;
/// s·b·h/t·(34 + 5·a·s/h) with sequence parallelism too; selective recomputation drops the
/// 5·a·s/h attention term; full recomputation keeps only the layer's input, 2·s·b·h (/t with
/// sequence parallelism). Generalised to d_ff ≠ 4h and grouped key/value heads: the MLP terms
/// scale with d_ff/(4h), the key and value terms with kv_heads/heads.
double megatron_layer_activation_bytes(int64_t seq, int64_t micro_batch, const ModelConfig& m,
                                       int tp, bool sequence_parallel,
                                       const std::string& recompute);

// ---- one layout ----

/// What one kind of memory holds on a rank, and how the number came about (one line).
struct MemoryItem {
  double bytes = 0;
  std::string how;
};

/// Peak bytes per kind on one rank (the rank of pipeline stage `stage` with the largest shards).
/// The kinds peak at different moments; their sum is the plan's peak per rank (the transient
/// parts — buckets, gathers, scratch — all live during backward, so the sum is close).
struct RankMemory {
  int stage = 0;
  MemoryItem params, grads, optim, activations, comm, workspace;
  double total() const {
    return params.bytes + grads.bytes + optim.bytes + activations.bytes + comm.bytes + workspace.bytes;
  }
};

/// Parameter tables of one model's pipeline stages, kept for reuse: a layout search asks for the
/// same (tp, stage) tables thousands of times, and GPT-3's have a thousand tensors each.
class ParamTableCache {
 public:
  const ParamTable& get(const ModelConfig& m, int tp, const StageSpec& spec);

 private:
  using Key = std::tuple<int, int, int, bool, bool, int, int>;
  std::map<Key, std::unique_ptr<ParamTable>> tables_;
};

struct MemoryOptions {
  Precision precision = Precision::FP32;
  bool device = false;                // a GPU run (system.backend = cuda); bf16 implies it
  ParamTableCache* tables = nullptr;  // optional; one model only
  int threads = 1;                    // CPU: threads of the attention backward (its scratch)
  double workspace_bytes = 32 << 20;  // GPU: cuBLASLt workspace
};

/// The rank of pipeline stage `stage` under cfg's layout (cfg.parallel, cfg.train.micro_batch,
/// cfg.train.recompute; validated by load_config).
RankMemory rank_memory(const Config& cfg, int stage, const MemoryOptions& opt);
/// Every stage's rank; the plan's figure for the layout is the largest total.
std::vector<RankMemory> layout_memory(const Config& cfg, const MemoryOptions& opt);
const RankMemory& largest(const std::vector<RankMemory>& stages);

/// The fp32 activation arena of lib/model/gpt.cpp (GPT::allocate_activations), in bytes, for one
/// stage: `blocks` blocks per chunk, `chunks` model chunks, `slots` micro-batches in flight per
/// chunk, this tp rank's heads/kv heads/d_ff/vocab rows; attention's saved state per layer as
/// the backend keeps it (Backend::attention_state_elems: (B,H,T,T) on the CPU, (B,H,T) on a GPU).
/// Mirrors the allocation list exactly.
struct ArenaShape {
  int micro_batch, seq_len, d_model, head_dim;
  int heads_local, kv_heads_local, d_ff_local, vocab_local;
  int tp = 1;
  bool sequence_parallel = false;
  int blocks_per_chunk = 0, chunks = 1, slots = 1;
  bool last_stage = true;
  std::string recompute = "none";
  bool attention_state_per_row = false;  // GPU: a logsumexp per row instead of (T,T) probabilities
};

/// GPU, system.precision = bf16: bytes of the bf16 copies of the largest GEMM's operands (the
/// backend's workspace, grown to the largest call: for GPT-2 the LM head's backward, dlogits
/// (N,V), its input (N,C) and weight (V,C)), each rounded up to 256 bytes as the backend does.
double bf16_operand_workspace_bytes(const ArenaShape& s);
int64_t cpu_activation_arena_bytes(const ArenaShape& s);

/// Parameters of the whole model (no tp padding of the vocabulary), as the checkpoint counts them.
int64_t model_parameter_count(const ModelConfig& m);

}  // namespace trellis
