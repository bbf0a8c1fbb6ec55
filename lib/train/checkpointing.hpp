// Checkpoints of a training run: what goes into a file (every parameter and AdamW's m and v with
// its global shape, written by the ranks that hold it; the step, the effective deck, the layout)
// and how a run resumes from one under any layout. The HDF5 side is lib/ckpt/.
//
// Each rank of a dp group writes and reads its own part of the stage's rows (checkpoint_parts.hpp:
// the rows that begin in its ZeRO shard), the shard's values moved to the part and back over the
// group: a checkpoint costs a rank its part of the weights, m and v (12 B a value of its stage's
// Ψ_rank/dp) and one of them of its shard (4 B) in host memory, at any ZeRO stage. Tensors that tensor ranks
// hold alike (replicated, and key/value heads shared) are written by the first of them.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "comm/grid.hpp"
#include "config/config.hpp"
#include "model/params.hpp"
#include "parallel/zero.hpp"

namespace trellis {

class Checkpointer {
 public:
  Checkpointer(const Config& cfg, const Grid& grid, const ParamTable& full, const ParamTable& staged,
               ShardedParams& store, MPI_Comm world);

  /// Collective: writes RUN/ckpt/step_NNNNNNNN.h5 for `step` completed steps, publishes it as
  /// `latest` and applies retention. Logs the size and bandwidth.
  void save(int64_t step);
  /// Collective: loads per checkpoint.resume (auto: the newest sound checkpoint, falling back to
  /// older ones with a warning; never; or a path). Returns the number of completed steps, or
  /// nothing when starting fresh (auto and no checkpoint yet). A bad explicit path, another
  /// model's checkpoint, or an auto resume where none of the checkpoints loads throw UserError.
  /// `training` (not an evaluation): warn of changed training keys, and once checkpoint.dir holds
  /// checkpoints prefer them to an explicit path outside it (a requeued job's command); then move
  /// the checkpoints of checkpoint.dir past the step resumed at (every one when starting over)
  /// into checkpoint.dir/superseded-TIME/, and with a start over run.dir's logs likewise.
  /// `logs_too`: this run writes run.dir's logs, which a start over moves aside as well.
  std::optional<int64_t> resume(bool training = true, bool logs_too = false);
  /// An evaluation's load of `path` rather than checkpoint.resume's (collective): the steps it
  /// holds. A file that does not load throws UserError on every rank.
  int64_t load_for_evaluation(const std::string& path) {
    training_ = false;
    return load(path, false);
  }
  /// An evaluation's (rank 0's, after its load): what makes its held-out set another than the
  /// run's evaluations measured — eval.path's files holding other tokens than when the checkpoint
  /// was written, or the synthetic source's keys changed ("" when nothing: the loss is eval.csv's
  /// for that step).
  const std::string& held_out_changes() const { return held_out_changes_; }
  /// Seconds the resume's read took (0 without one): the first estimate of a checkpoint's cost.
  double resumed_seconds() const { return resumed_seconds_; }
  /// Tokens the run had trained on at the checkpoint the resume loaded (0 without one).
  int64_t resumed_tokens() const { return resumed_tokens_; }
  /// The checkpoint the resume loaded (empty without one).
  const std::string& resumed_path() const { return resumed_path_; }
  /// What the token files hold (content_fingerprint and "N tokens in M file(s)"), stored in each
  /// checkpoint; a resume whose files hold other tokens says so (the keys alone do not tell a
  /// shard added, replaced or rewritten in place). Empty: drawn from the deck's keys (synthetic).
  struct DataIdentity {
    std::string fingerprint, holds;
  };
  void set_data_identity(const DataIdentity& training, const DataIdentity& held_out) {
    data_ = training;
    held_out_data_ = held_out;
  }

 private:
  /// One slab per tensor of the whole model, in the same order on every rank; tensors this rank
  /// does not hold have no rows.
  /// `part_data`: this rank's part (`part`, checkpoint_parts) of one of the three states, whose
  /// rows of each tensor the slab names; a writer of each value once.
  std::vector<CkptSlab> slabs(const std::string& prefix, float* part_data, ShardRange part,
                              bool for_writing) const;
  struct Part;
  /// The slabs of the weights, then AdamW's m and v.
  std::vector<CkptSlab> slabs(Part& part, bool for_writing) const;
  /// Collective, before any tensor is read: the file's format and its stored deck against this
  /// run's. Another model → UserError naming each differing key. Returns the changed training
  /// keys (lr, steps, data, …; rank 0's text, empty elsewhere) for load's warning once the file
  /// has loaded.
  std::string check_compatible(const std::string& path, bool say_changes);
  /// (Rank 0, in check_compatible.) With run.dir derived from the deck's name and an auto resume:
  /// a checkpoint another deck file wrote → IncompatibleCheckpoint naming both files.
  void check_same_deck(const CkptMeta& meta, const std::string& path) const;
  /// (Rank 0, in check_compatible.) "; data.path holds other tokens …" for the token files
  /// whose content differs from the checkpoint's record of them (set_data_identity), else "":
  /// only where the path is the same (another one is said as a changed key) and, for eval.path,
  /// where this run evaluates.
  std::string data_changes(const CkptMeta& meta, bool same_eval_path, bool same_data_path) const;
  /// "N tokens in M file(s) there, … here" where `meta`'s record `key`_fingerprint of the files
  /// differs from `here`, else "" (also where either has no record).
  static std::string content_change(const CkptMeta& meta, const std::string& key,
                                    const DataIdentity& here);
  int64_t load(const std::string& path, bool say_changes);
  /// resume() without what follows a training run's resume (set_aside_past).
  std::optional<int64_t> resume_from(bool training);
  /// What a start over does with the run directory's logs: keeps them (this run writes none),
  /// sets them aside, or sets them aside where metrics.csv holds a step.
  enum class Logs { keep, set_aside, set_aside_if_trained };
  /// Collective, after a training run's resume at `step` (-1: starting over): moves the
  /// checkpoints past it (and with a start over the run directory's logs, as `logs`) aside,
  /// saying so.
  void set_aside_past(int64_t step, Logs logs);

  const Config& cfg_;
  const Grid& grid_;
  const ParamTable& full_;
  const ParamTable& staged_;
  ShardedParams& store_;
  MPI_Comm world_;
  bool training_ = true;  // resume()'s: a training run goes on, an evaluation only loads
  bool never_goes_on_ = false;  // resume = never on a later start of its batch job: as auto
  // TRELLIS_JOB (rank 0's; slurm/train.sbatch: its job or chain): the batch job whose starts
  // write these checkpoints, stored in each one.
  std::string job_;
  int64_t resumed_step_ = 0, resumed_tokens_ = 0;  // the checkpoint loaded: its step, tokens_seen
  double resumed_seconds_ = 0;                     // and the time its read took
  std::string resumed_path_;                        // and its file
  DataIdentity data_, held_out_data_;               // set_data_identity
  std::string held_out_changes_;                    // an evaluation's (check_compatible)
  Comm dp_;  // the dp group, for the shards' values to and from the parts: checkpoint traffic is
             // counted apart from training's
};

}  // namespace trellis
