// The model a checkpoint holds, from the effective deck stored in it: what `generate` and
// `export` need to rebuild the GPT without the deck file or the training layout.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "config/config.hpp"

namespace trellis {

/// The precision a stored deck is rebuilt in: fp32 (the checkpoint's own, for generate and
/// export), or the one that trained it, with its gradient reduction (eval: so that it measures
/// the loss the run logged; a resume: to tell whether the course changes).
enum class StoredPrecision { fp32, as_trained };

/// Serial (no MPI). The checkpoint's deck as a Config for one rank (dp = tp = pp = 1; the layout
/// that wrote it does not matter: checkpoints hold global tensors). Not a Trellis checkpoint of
/// the format version lib/train/checkpointing.hpp writes, unreadable, or a deck that no longer
/// parses → UserError naming the file.
Config stored_config(const std::string& path);
/// The same deck with `overrides` (as on a command line; they win) for a job of `world_size`
/// ranks, whose layout starts from dp = world_size, tp = pp = 1, ZeRO 0, on the CPU, in fp32 or
/// in the precision that trained it.
Config stored_config(const std::string& path, const std::vector<std::string>& overrides,
                     int world_size, StoredPrecision precision = StoredPrecision::fp32);
/// The deck text a checkpoint stores (`where` names it in messages) as such a Config for one rank.
Config stored_deck_config(const std::string& deck, const std::string& where,
                          const std::vector<std::string>& overrides = {}, int world_size = 1,
                          StoredPrecision precision = StoredPrecision::fp32);

/// inspect_checkpoint's ExpectedDatasets for a Trellis checkpoint: the datasets of the model its
/// stored deck describes — each parameter, AdamW's m and v, at its global shape — or why that
/// deck does not load.
std::string stored_model_datasets(const CkptMeta& meta,
                                  std::map<std::string, std::vector<int64_t>>& datasets);

}  // namespace trellis
