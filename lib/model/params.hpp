// The parameter table: every tensor of the GPT with its name, its global shape (as a single
// device holds it), where it sits in the flat parameter buffer, and how it is initialised.
// Parameters are laid out layer by layer (embeddings, block 0, block 1, …, final LayerNorm) so that
// a block's tensors are one contiguous range — what ZeRO-3 gathers and a pipeline stage owns.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace trellis {

struct ParamInfo {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // global shape, e.g. {(H+2KV)·hd, C}
  int layer = -1;              // block index, -1 for embeddings and the final LayerNorm
  bool decay = false;          // AdamW weight decay applies (matrices and embeddings)
  double init_std = 0;         // N(0, init_std); 0 means constant init_value
  float init_value = 0;
  int64_t offset = 0;          // first element in the flat buffer
  int64_t numel() const;
};

/// Offsets of one block's tensors in the flat buffer (element indices).
struct BlockOffsets {
  int64_t ln1_w, ln1_b;      // (C), (C)
  int64_t qkv_w, qkv_b;      // ((H+2KV)·hd, C), ((H+2KV)·hd)
  int64_t attproj_w, attproj_b;  // (C, H·hd), (C)
  int64_t ln2_w, ln2_b;      // (C), (C)
  int64_t fc_w, fc_b;        // (F, C), (F)
  int64_t fcproj_w, fcproj_b;    // (C, F), (C)
  int64_t begin, end;        // the block's whole range
};

/// A contiguous range of the flat buffer that the model uses as a whole: the embeddings, one block,
/// or the final LayerNorm.
struct Unit {
  int64_t begin, end;
};

class ParamTable {
 public:
  explicit ParamTable(const ModelConfig& m);

  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t total() const { return total_; }
  const ParamInfo& find(const std::string& name) const;  // throws if absent

  int64_t wte, wpe;        // (V, C), (maxT, C)
  std::vector<BlockOffsets> blocks;  // one per layer
  int64_t lnf_w, lnf_b;    // (C), (C)
  /// units[0] = embeddings, units[1 + l] = block l, units.back() = final LayerNorm.
  std::vector<Unit> units;
  int embedding_unit() const { return 0; }
  int block_unit(int layer) const { return 1 + layer; }
  int final_unit() const { return int(units.size()) - 1; }

 private:
  int64_t add(const std::string& name, std::vector<int64_t> shape, int layer, bool decay,
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
