// Checkpoints: one HDF5 file per checkpoint, written and read collectively with parallel HDF5
// (DESIGN.md, "Checkpoints (HDF5)"). Every tensor is one float32 dataset with its global shape,
// chunked along rows (≤ 1 MiB a chunk) with the Fletcher32 checksum filter; each rank writes and
// reads the hyperslab it holds, so a checkpoint written by one layout loads into any other.
// Small metadata (step, deck, layout, …) are attributes on the root group.
//
// Run directories hold step_XXXXXXXX.h5 files and a `latest` file naming the newest one.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "model/params.hpp"  // RowRange

namespace trellis {

/// One tensor, this rank's part of it.
struct CkptSlab {
  std::string name;                    // dataset path in the file, e.g. "model/wte", "optim/m/wte"
  std::vector<int64_t> global_shape;   // 1-D or 2-D
  std::vector<RowRange> rows;          // global rows held, in local order; rows ≥ global_shape[0]
                                       // are padding (never written, read as 0). Any order; a
                                       // row may appear twice (read: both copies filled).
  int64_t col_begin = 0, col_end = 1;  // global columns held (1-D: 0..1)
  float* data = nullptr;               // Σrows × (col_end − col_begin), row-major, in `rows` order
  bool writer = true;                  // false: another rank writes identical data
};

/// The version of what a Trellis checkpoint holds (tensor names, metadata keys): written as the
/// "format_version" attribute; readers refuse any other.
constexpr int64_t kCheckpointFormat = 1;

/// Small metadata, stored as attributes on the root group ("/"). Names must be distinct across
/// the three maps.
struct CkptMeta {
  std::map<std::string, std::string> text;  // e.g. "deck", "layout"
  std::map<std::string, int64_t> integers;  // e.g. "format_version", "step", "tokens_seen"
  std::map<std::string, double> reals;
};

/// What is wrong with a checkpoint's counters ("" where nothing is): no step (or one not an
/// integer), a step below 0, AdamW's
/// update count outside 0..step, tokens_seen below 0. No run writes such values: the file is
/// damaged or edited, and a resume that took them as they stand would train on from there (a
/// negative step: negative learning rates).
std::string counter_problem(const CkptMeta& meta);

struct CkptIO {
  double bytes;    // size of the checkpoint file
  double seconds;  // wall time, the slowest rank's
  // (read_checkpoint) datasets whose digest needed the file read again: the ranks' reads did
  // not hold all their values.
  int64_t digests_read_again = 0;
};

/// Collective over comm. Writes final_path atomically: to final_path + ".tmp-<id>", closed on every
/// rank, fsync'd, renamed by rank 0, directory fsync'd. Slab lists must name the same tensors in
/// the same order on every rank (checked). The metadata written is rank 0's `meta`.
/// Any I/O failure → UserError naming the path on every rank; the temporary file is removed and a
/// previous file at final_path is left as it was. Inconsistent slabs → std::logic_error everywhere.
CkptIO write_checkpoint(MPI_Comm comm, const std::string& final_path,
                        const std::vector<CkptSlab>& slabs, const CkptMeta& meta);

/// Collective over comm. Reads each slab's part into slab.data (padding rows set to 0) after
/// checking each dataset exists, is float32 and has global_shape; reads the root attributes into
/// meta. Missing file / not HDF5 / truncated / missing dataset / wrong shape or type / checksum
/// failure → UserError naming the file (and the dataset) on every rank.
CkptIO read_checkpoint(MPI_Comm comm, const std::string& path, const std::vector<CkptSlab>& slabs,
                       CkptMeta& meta);

/// The root attributes only. Serial (default HDF5 driver): needs no MPI and may be called on one
/// rank. Errors → UserError.
CkptMeta read_checkpoint_meta(const std::string& path);

// ---- run directories (serial unless given a comm) ---------------------------------------------

/// "step_00001000.h5".
std::string checkpoint_file_name(int64_t step);
/// The step of a file name checkpoint_file_name made (a bare name), or -1.
int64_t checkpoint_step(const std::string& file_name);
/// The next content of `path`, written now to a temporary of its own beside it (a name no other
/// process writing the same path picks) and synced; commit() renames it into place and syncs the
/// directory — which needs no room on the disk, so a file staged before a big write can still
/// be put in place on the disk that write filled. A reader sees the old file or the whole new
/// one. `fill` writes the content and returns false on an I/O error. Any failure removes the
/// temporary and throws UserError("cannot write PATH: ..."); destruction uncommitted removes it.
class StagedFile {
 public:
  StagedFile(const std::string& path, const std::function<bool(std::FILE*)>& fill);
  StagedFile(StagedFile&& o) noexcept : path_(std::move(o.path_)), tmp_(std::move(o.tmp_)) {
    o.tmp_.clear();
  }
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;
  StagedFile& operator=(StagedFile&&) = delete;
  ~StagedFile();
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what, int e);
  std::string path_, tmp_;
};
/// dir/latest's next content, file_name + "\n", staged (commit() publishes it).
StagedFile stage_latest(const std::string& dir, const std::string& file_name);
/// Replaces dir/latest atomically (temp file, fsync, rename, fsync dir) with file_name + "\n".
void publish_latest(const std::string& dir, const std::string& file_name);
/// The file a write to `path` replaces: `path`, or the file a symbolic link there names.
/// UserError where that is something else than a regular file (a device, a FIFO, a directory).
std::string regular_file_target(const std::string& path);
/// What a file of this st_mode is, for a message: "a FIFO", "a directory", "a character device",
/// "a block device", "a socket", or "not a regular file" (a regular file too: for others only).
std::string file_kind(unsigned mode);
/// For a file opened in place (no atomic write): UserError "`who` PATH: KIND; `advice`" where
/// `path` is a FIFO, a socket, a directory or a block device — opening a FIFO would block until
/// another process opens its other end. A regular file, a character device (/dev/null) or no
/// file at all passes.
void refuse_blocking_file(const std::string& path, const std::string& who,
                          const std::string& advice);
/// Writes `path` (regular_file_target's) atomically: a StagedFile committed at once.
void write_file_atomically(const std::string& path, const std::function<bool(std::FILE*)>& fill);
/// Removes dir's NAME.tmp-PID-* files, for each of `names`, whose writer (process PID on this
/// host) is gone: an atomic write of NAME cut short by a kill (`trellis export` into an OUTDIR
/// again). A live writer's stays. Unremovable ones stay too (nothing depends on them).
void remove_dead_writers_temporaries(const std::string& dir, const std::vector<std::string>& names);
/// Removes the *.tmp-* files of dir (checkpoint writes and their set-aside room, cut short by a
/// kill); returns their names. Only for a job that holds dir's lock. Errors → UserError.
std::vector<std::string> remove_temporaries(const std::string& dir);
/// Keeps the newest `keep` step_*.h5 files of dir (by step; keep ≤ 0 keeps all) and the one
/// `latest` names; removes the others and any stale *.tmp-* files.
void apply_retention(const std::string& dir, int keep);
/// Moves the step_*.h5 files of dir past `after_step` (-1: every one), and `latest` where it
/// names one of them or none is left, into a new directory of dir (move_aside): the checkpoints of a course the run leaves (a start over, a step gone back
/// to, a damaged newest one fallen back from), kept but out of the way of retention and of
/// later resumes. Renames within dir only. Returns the steps moved, ascending, and sets `into`
/// to the directory's name (untouched where nothing moved). Errors → UserError naming the file.
std::vector<int64_t> set_aside_checkpoints(const std::string& dir, int64_t after_step,
                                           std::string& into);
/// Moves the files `names` of dir (in that order) into a new directory of dir that was not there,
/// superseded-UTC time (superseded-20261203-113701, then -2, -3, … within one second), then
/// syncs dir. Returns the new directory's name. Errors → UserError naming the file.
std::string move_aside(const std::string& dir, const std::vector<std::string>& names);
/// Paths (dir/NAME) to try for a resume, newest first: the step_*.h5 files by step, descending
/// (a `latest` one behind is a job that died before publishing its newest); a file `latest`
/// names that is not a step file, first.
std::vector<std::string> resume_candidates(const std::string& dir);
/// The same, collective: rank 0 lists dir and every rank gets its list (or its UserError), so
/// that all ranks try the same files even where the directory reads differently on each.
std::vector<std::string> resume_candidates(MPI_Comm comm, const std::string& dir);

/// A checkpoint named on the command line: a file as it is; a `latest` pointer → the step file it
/// names; a checkpoint directory or a run directory (with ckpt/) → its newest checkpoint
/// (`latest`, else the highest step). A directory without any, or an empty pointer → UserError.
std::string resolve_checkpoint(const std::string& path);
/// The same, collective: rank 0 resolves and every rank gets its answer (or its UserError), so
/// that all open one file even while a run publishes a newer checkpoint.
std::string resolve_checkpoint(MPI_Comm comm, const std::string& path);

/// Whether `error` is about the checkpoint `chosen` that `given` (a directory or a `latest`
/// pointer) resolved to, which has been removed since — a run publishing there keeps only its
/// newest checkpoint.keep: the reader may choose again.
bool chosen_checkpoint_gone(const std::string& error, const std::string& given,
                            const std::string& chosen);
/// `error` with what happened where that is so; otherwise `error` as it is.
std::string with_chosen_checkpoint_gone(const std::string& error, const std::string& given,
                                        const std::string& chosen);

/// A checkpoint a reader was given (a file, a `latest` pointer, a checkpoint or run directory) and
/// the file chosen for it. A directory's newest checkpoint may be removed while it is read, by a
/// run publishing there (its retention keeps only checkpoint.keep): the reader then chooses again,
/// up to kMaxChoices in all. With a communicator, every step is collective (rank 0 resolves, so
/// that every rank opens one file); with MPI_COMM_NULL, serial (export).
class ChosenCheckpoint {
 public:
  static constexpr int kMaxChoices = 4;
  /// Where a new choice is said: the log (stdout), or stderr where stdout is the product.
  enum class Say { on_stdout, on_stderr };
  /// Resolves `given` (UserError where it names no checkpoint). `who` prefixes what is said.
  ChosenCheckpoint(std::string given, MPI_Comm comm, std::string who, Say say = Say::on_stdout);
  const std::string& given() const { return given_; }
  const std::string& path() const { return path_; }
  /// After a read of path() failed on this rank with `error` (empty where this rank's did not):
  /// true on every rank when some rank's error is about the chosen file, removed since, and
  /// fewer than kMaxChoices were made — path() is then the next choice, and rank 0 says so.
  bool choose_again(const std::string& error);
  /// `error`, with what happened where the chosen file was removed since.
  std::string explained(const std::string& error) const;
  /// Test only (TRELLIS_FAULT_REMOVE_CHOSEN = POINT, core/fault.hpp): removes path() once, at the
  /// first reader's point of that name, as a run's retention may meanwhile. Collective.
  void fault_point(const char* point) const;

 private:
  std::string given_, path_, who_;
  MPI_Comm comm_;
  Say say_;
  int choices_ = 1;
};

/// `trellis inspect CKPT` (serial): prints the metadata (step, layout, deck, …) and every dataset
/// with its shape, reading each fully so that HDF5 verifies its Fletcher32 checksums.
/// With `expected`, the file is also held to the model its attributes describe: `expected` fills
/// in the datasets a sound file of it holds (name → global shape), or says why it cannot (a
/// problem too), and each of those missing or of another shape, and each dataset not among them,
/// is a problem, as a resume would refuse the file. (The I/O layer knows no model:
/// stored_model_datasets in ckpt/stored_config.hpp is the one `trellis inspect` passes.)
/// Returns 0 if the file is sound, 1 if not (with what is wrong printed). No file at `path` (or
/// not a regular one) → UserError naming it.
using ExpectedDatasets = std::function<std::string(
    const CkptMeta& meta, std::map<std::string, std::vector<int64_t>>& datasets)>;
int inspect_checkpoint(const std::string& path, std::FILE* out,
                       const ExpectedDatasets& expected = {});

extern const char* const kInspectUsage;  // trellis inspect --help

}  // namespace trellis
