// The parameter table: every tensor of the GPT with its name, its global shape (as a single
// device holds it), the part of it this tensor-parallel rank holds, where that part sits in the
// flat parameter buffer, and how it is initialised. Parameters are laid out layer by layer
// (embeddings, block 0, block 1, …, final LayerNorm) so that a block's tensors are one contiguous
// range — what ZeRO-3 gathers and a pipeline stage owns.
//
// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over tp ranks:
//   wte                 vocab-parallel: a contiguous block of vocab_rows_per_rank rows, ⌈V/tp⌉
//                       rounded up (rows past V are padding)
//   attn.c_attn         column-parallel by heads: this rank's heads/tp query heads' rows, then its
//                       key heads' rows, then its value heads' rows (kv_heads < tp: one key/value
//                       head, replicated on tp/kv_heads ranks)
//   attn.c_proj.weight  row-parallel: the input columns of this rank's heads
//   mlp.c_fc            column-parallel: d_ff/tp rows
//   mlp.c_proj.weight   row-parallel: d_ff/tp input columns
//   everything else     replicated (LayerNorms, wpe, the row-parallel layers' biases)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace trellis {

/// Rows [begin, end) of a tensor's global first dimension; rows ≥ shape[0] are padding.
struct RowRange {
  int64_t begin, end;
};

enum class TpSplit {
  Replicated,     // every tp rank holds all of it
  Sharded,        // each tp rank holds its own part
  KvReplicated,   // c_attn with kv_heads < tp: the key/value rows repeat on tp/kv_heads ranks
};

struct ParamInfo {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // global shape, e.g. {(H+2KV)·hd, C}
  std::vector<RowRange> rows;  // the global rows this rank holds, in local order
  int64_t col_begin = 0, col_end = 1;  // the global columns it holds (1-D tensors: 0, 1)
  TpSplit split = TpSplit::Replicated;
  int layer = -1;              // block index, -1 for embeddings and the final LayerNorm
  bool decay = false;          // AdamW weight decay applies (matrices and embeddings)
  double init_std = 0;         // N(0, init_std); 0 means constant init_value
  float init_value = 0;
  int64_t offset = 0;          // first element in the flat buffer
  int64_t numel() const;        // elements held locally
  int64_t global_numel() const;
  /// The global flat index of local element i, or -1 for padding.
  int64_t global_index(int64_t i) const;
};

/// Offsets of one block's tensors in the flat buffer (element indices); shapes are local.
struct BlockOffsets {
  int64_t ln1_w, ln1_b;      // (C), (C)
  int64_t qkv_w, qkv_b;      // ((Hl+2KVl)·hd, C), ((Hl+2KVl)·hd)   Hl = H/tp heads here
  int64_t attproj_w, attproj_b;  // (C, Hl·hd), (C)
  int64_t ln2_w, ln2_b;      // (C), (C)
  int64_t fc_w, fc_b;        // (Fl, C), (Fl)   Fl = F/tp
  int64_t fcproj_w, fcproj_b;    // (C, Fl), (C)
  int64_t begin, end;        // the block's whole range
};

/// A contiguous range of the flat buffer that the model uses as a whole: the embeddings, one block,
/// or the final LayerNorm.
struct Unit {
  int64_t begin, end;
};

/// What a pipeline stage holds: blocks [first_layer, end_layer) (end_layer −1: all), the
/// embeddings on the first stage, the final LayerNorm and LM head on the last. The LM head is tied
/// to wte, which the first stage owns: a last stage that is not also the first keeps a copy of it
/// outside this table (lib/parallel/pipeline.hpp).
struct StageSpec {
  int first_layer = 0, end_layer = -1;
  bool first = true, last = true;
  /// Interleaved schedule: the rank holds `chunks` model chunks, chunk k being layers
  /// [first_layer + k·chunk_stride, end_layer + k·chunk_stride).
  int chunks = 1, chunk_stride = 0;
};

/// The layers pipeline stage `stage` holds under cfg's layout: parallel.stage_layers or an even
/// split; with the interleaved schedule, chunk k of the stage is the (k·pp + stage)-th of pp·v
/// equal slices.
StageSpec stage_spec(const Config& cfg, int stage);

/// The vocabulary rows each of tp ranks holds (wte's and the LM head's; logits (N, this)): ⌈V/tp⌉
/// rounded up to a multiple of m.vocab_multiple, or, where that is more than an eighth of the
/// share, of the largest power of two up to an eighth of it — so that the LM head's GEMMs write
/// aligned rows (GPT-2's 50257 → 50304, an odd row length costs a GPU's tensor-core GEMMs their
/// 16-byte loads) while a small vocabulary is padded by at most 1/8.
int vocab_rows_per_rank(const ModelConfig& m, int tp);

class ParamTable {
 public:
  /// The table for tensor-parallel rank tp_rank of tp (tp = 1: the whole model), on one
  /// pipeline stage (default: all of the model).
  explicit ParamTable(const ModelConfig& m, int tp = 1, int tp_rank = 0, StageSpec stage = {});
  StageSpec stage;

  // Local sizes on this rank: heads, key/value heads, d_ff, vocabulary rows (with padding).
  int heads_local, kv_heads_local, d_ff_local, vocab_local;
  int vocab_begin;   // first vocabulary row this rank holds
  int vocab_padded;  // tp · vocab_rows_per_rank(m, tp): the rows of all ranks, padding included

  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t total() const { return total_; }
  const ParamInfo& find(const std::string& name) const;  // throws if absent

  int64_t wte = -1, wpe = -1;  // (Vl, C) this rank's vocabulary rows, (maxT, C); first stage
  std::vector<BlockOffsets> blocks;  // one per layer of this stage, in order
  int64_t lnf_w = -1, lnf_b = -1;  // (C), (C); last stage
  /// The embeddings (first stage), each block of the stage, the final LayerNorm (last stage).
  std::vector<Unit> units;
  /// The model chunk each unit belongs to (interleaved schedule; all 0 otherwise): backward runs
  /// chunk by chunk, so gradient buckets never mix units of two chunks.
  std::vector<int> unit_chunk;
  /// Local flat ranges of the tensors every tp rank holds whole (LayerNorms, wpe, row-parallel
  /// biases): under sequence parallelism each rank's gradient of them is partial.
  std::vector<Unit> replicated_ranges() const;
  /// Local flat ranges of key/value rows repeated on tp/kv_heads ranks (kv_heads < tp): their
  /// gradient is summed over the ranks that share them.
  std::vector<Unit> kv_replicated_ranges() const;
  int embedding_unit() const { return stage.first ? 0 : -1; }
  /// The unit of this stage's block `local` (0 = its first block).
  int block_unit(int local) const { return (stage.first ? 1 : 0) + local; }
  int final_unit() const { return stage.last ? int(units.size()) - 1 : -1; }

 private:
  int64_t add(const std::string& name, std::vector<int64_t> shape, std::vector<RowRange> rows,
              int64_t col_begin, int64_t col_end, TpSplit split, int layer, bool decay,
              double init_std, float init_value = 0.f);
  std::vector<ParamInfo> params_;
  int64_t total_ = 0;
};

/// Fills params (the flat buffer) as GPT-2 does, from `seed`: matrices and embeddings N(0, std),
/// residual projections std/√(2·layers), biases 0, LayerNorm weights 1. Each element is a pure
/// function of (seed, tensor name, element index), so any slice of any layout gets the same values.
/// `out` receives elements [begin, end) of the flat buffer (all of it by default).
void init_parameters(const ParamTable& table, uint64_t seed, float* out, int64_t begin = 0,
                     int64_t end = -1);

}  // namespace trellis
