// The memory model of `trellis plan`: bytes per rank for one layout, by the same kinds the trainer
// measures (core/memory.hpp: parameters, gradients, optimizer, activations, comm buffers, scratch).
//
// What it counts depends on where the run computes and in what precision:
//   fp32 / bf16 (this code, buffer by buffer)  the flat parameter and gradient buffers and their
//         ZeRO shards, AdamW's m and v, the activation arena of lib/model/gpt.cpp (every slot a
//         pipeline schedule keeps in flight, recomputation, sequence parallelism), ZeRO's
//         gradient buckets and stage-3 gathers, the pipeline's message buffers and tied LM-head
//         copy, and the backend's own buffers. fp32: 4 bytes everywhere. bf16 (lib/parallel/
//         zero.hpp): the model's parameters and activations 2 bytes, gradients 4, and the fp32
//         master weights next to AdamW's m and v (12 bytes a parameter, sharded alike: 2Ψ + 4Ψ +
//         12Ψ at ZeRO 0, as Megatron-LM without its distributed optimizer), plus the backend's
//         widening arena (backend.hpp, Widened: the fp32 copies of the largest widened call's bf16
//         tensors — every kernel on the CPU, attention on a GPU without the tensor-core kernels).
//         On the CPU: attention keeps its probabilities (B,H,T,T) and the attention backward has
//         a (T,T) scratch per thread. On a GPU (system.backend = cuda, `device`): attention keeps
//         one logsumexp per row (B,H,T), plus the cuBLASLt workspace and the backend's scratch.
//         Whole-program checks: tests/cli/test_plan.sh holds the CPU figure (fp32 and bf16) to
//         within 10 % of the measured peak; tests/plan/test_plan.cpp holds the GPU fp32 figure to
//         within 3 % of a peak measured on an H200, and every bf16 part to what the code
//         allocates.
//   bf16-full  a full bf16 GPU run as ZeRO and Megatron-LM count it: bf16 parameters and
//         gradients, fp32 master weights and Adam moments (ZeRO's 2Ψ + 2Ψ + 12Ψ), activations by
//         Megatron's per-layer formula (Korthikanti et al. 2022), cuBLASLt workspace and
//         communication buckets.
//
// Everything here is arithmetic on the deck: no MPI, no allocation of the model itself.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.hpp"  // Widening
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
/// 16Ψ/N_d at 3. fp32: 4Ψ, 4Ψ, 8Ψ (m, v). This code's bf16: 2Ψ, 4Ψ (fp32 gradients), 12Ψ (fp32
/// master weights, m, v). Shards are unpadded Ψ/N_d here.
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
  int64_t stage_params = 0;  // Ψ_rank: the parameters a tp rank of this stage holds
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
  bool device = false;                // a GPU run (system.backend = cuda); bf16-full implies it
  bool tc_attention = false;          // GPU bf16: attention on the tensor cores (not widened)
  bool cudnn_attention = false;       // GPU bf16: on cuDNN's (its backward's fp32 scratch)
  bool cudnn_deterministic = false;   // ... its deterministic backward (dP in its workspace)
  bool gelu_epilogue = true;          // GPU bf16: the MLP's GELU in cuBLASLt's epilogue
  int sm_count = 132;                 // GPU: multiprocessors (an H100/H200 SXM's), for scratch
  ParamTableCache* tables = nullptr;  // optional; one model only
  int threads = 1;                    // CPU: threads of the attention backward (its scratch)
  double workspace_bytes = kGemmWorkspaceBytes;  // GPU: cuBLASLt workspace
};

/// The memory model of a run of cfg as this process would start it: cfg's system.precision, a
/// GPU where system.backend is cuda (tc_attention, cudnn_attention and gelu_epilogue as that
/// backend chooses its kernels from the environment: TRELLIS_TC_ATTENTION, TRELLIS_CUDNN — cuDNN
/// taken to be there —, TRELLIS_CUDNN_DETERMINISTIC, TRELLIS_GELU_EPILOGUE), the CPU attention
/// scratch of system.threads (else the count OpenBLAS takes from $OPENBLAS_NUM_THREADS,
/// $GOTO_NUM_THREADS or $OMP_NUM_THREADS, at most the cores, else the node's cores shared among
/// its `ranks_on_node` ranks, as a rank started unbound takes them).
MemoryOptions run_memory_options(const Config& cfg, int ranks_on_node = 1);
/// The same for a run on `backend` as it is: its host threads (the CPU's attention scratch), its
/// device's multiprocessors (the layer norm's partial sums) and where its bf16 attention runs
/// (cuDNN, the tensor cores, or widened to the fp32 kernels where its checks found them
/// disagreeing).
MemoryOptions run_memory_options(const Config& cfg, const Backend& backend);

/// The rank of pipeline stage `stage` under cfg's layout (cfg.parallel, cfg.train.micro_batch,
/// cfg.train.recompute; validated by load_config).
RankMemory rank_memory(const Config& cfg, int stage, const MemoryOptions& opt);
/// Every stage's rank; the plan's figure for the layout is the largest total.
std::vector<RankMemory> layout_memory(const Config& cfg, const MemoryOptions& opt);
const RankMemory& largest(const std::vector<RankMemory>& stages);

/// The activation arena of lib/model/gpt.cpp (GPT::allocate_activations), in bytes, for one
/// stage: `blocks` blocks per chunk, `chunks` model chunks, `slots` micro-batches in flight per
/// chunk, this tp rank's heads/kv heads/d_ff/vocab rows; activations of act_bytes (4 fp32, 2
/// bf16) and fp32 statistics; attention's saved state per layer as the backend keeps it
/// (Backend::attention_state_elems: (B,H,T,T) on the CPU, (B,H,T) on a GPU). Mirrors the
/// allocation list exactly.
struct ArenaShape {
  int micro_batch, seq_len, d_model, head_dim;
  int heads_local, kv_heads_local, d_ff_local, vocab_local;
  int tp = 1;
  bool sequence_parallel = false;
  int blocks_per_chunk = 0, chunks = 1, slots = 1;
  bool first_stage = true, last_stage = true;
  std::string recompute = "none";
  bool attention_state_per_row = false;  // GPU: a logsumexp per row instead of (T,T) probabilities
  int act_bytes = 4;                     // of an activation: fp32 4, bf16 2
};
/// The shape of one stage's arena under cfg's layout (stage `stage`, tp rank 0's table).
ArenaShape arena_shape(const Config& cfg, const ParamTable& table, int stage, bool device);
int64_t activation_arena_bytes(const ArenaShape& s);

/// Bytes of the widening arena a bf16 run of this shape ends with: the largest total of the fp32
/// copies (64-byte aligned each) any one widened call of the model takes — the calls of
/// lib/model/gpt.cpp, each bf16 tensor counted once (in place: one copy).
double widening_arena_bytes(const ArenaShape& s, Widening w);

/// Parameters of the whole model (no tp padding of the vocabulary), as the checkpoint counts them.
int64_t model_parameter_count(const ModelConfig& m);

}  // namespace trellis
