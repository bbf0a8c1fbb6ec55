// The run directory (run.dir): the effective deck, one CSV row per step (and per held-out
// evaluation), and a JSON summary at the end. Only the printing rank writes here.
#pragma once
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trellis {

class RunDir {
 public:
  /// Creates the directory (and parents). Throws UserError naming run.dir when it cannot.
  explicit RunDir(const std::string& path);
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  const std::string& path() const { return path_; }
  /// Writes `name` inside the run directory (via a temporary file and a rename). Errors
  /// (a full disk included) → UserError naming the file.
  void write_file(const std::string& name, const std::string& content) const;

  /// A CSV file inside the run directory (metrics.csv, eval.csv): the header once, then one row
  /// per append_row; flushed each time so that a killed run keeps what it logged. A run resumed
  /// after `resumed_at` steps (> 0) continues an existing file, first dropping the rows of later
  /// steps (logged before a crash, or after an older checkpoint it fell back to), which it is
  /// about to log again. Errors → UserError naming the file.
  void open_table(const std::string& name, const std::vector<std::string>& columns,
                  int64_t resumed_at = 0);
  /// Appends a row. A failed write (a full disk, a quota) is warned of once and kept for
  /// check_written: the run goes on; the table keeps its whole rows only (the failed row's part
  /// cut off) and takes no more.
  void append_row(const std::string& name, const std::vector<std::string>& values);
  /// Throws UserError naming the file where an append_row failed.
  void check_written() const;
  /// The step (first field) of the table's last whole row, or -1 (no such file, no rows).
  int64_t last_row_step(const std::string& name) const;

 private:
  std::string path_;
  std::string write_error_;  // the first failed append_row's, or empty
  std::map<std::string, std::FILE*> tables_;  // by file name
};

/// A run's hold on a directory it writes (run.dir, checkpoint.dir) for as long as the object
/// lives: `flock` on DIR/.trellis.lock, which the kernel releases when the process ends however
/// it ends, so a killed job leaves nothing to clean up. Two jobs in one directory would
/// overwrite each other's checkpoints, `latest` and metrics, each finishing with status 0.
/// Creates the directory (and removes it again at the end where it was not there and nothing
/// but the lock was put in it). Held by another process (after waiting up to `wait_s` for it, as a
/// job that is still ending): UserError naming `key`, the directory and the holder (host, pid,
/// Slurm job, since when). A filesystem without locks (Lustre mounted without `flock`, NFS
/// without a lock manager): a warning that says so, and no lock.
class DirLock {
 public:
  DirLock(const std::string& dir, const std::string& key, double wait_s = 5.0);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  std::string dir_;
  bool created_ = false;  // the directory was not there: removed again if the run left it empty
  int fd_ = -1;
};

/// Moves the logs an earlier run left in run_dir (metrics.csv, eval.csv, summary.json, deck.ini)
/// into a new directory of run_dir (move_aside, where one is there to move). Returns the names moved and sets `into` to the directory's name. Errors → UserError
/// naming the file.
std::vector<std::string> set_aside_run_files(const std::string& run_dir, std::string& into);

/// Throws UserError naming `key` when `dir` cannot be created or written. Creates nothing that
/// was not there (a probe file is removed again).
void check_writable_dir(const std::string& dir, const std::string& key);

/// A tiny JSON writer for flat objects with nested objects: enough for summary.json.
class JsonObject {
 public:
  JsonObject& num(const std::string& key, double v);
  JsonObject& integer(const std::string& key, long long v);
  JsonObject& str(const std::string& key, const std::string& v);
  JsonObject& null(const std::string& key);
  JsonObject& obj(const std::string& key, const JsonObject& v);
  std::string dump(int indent = 0) const;

 private:
  std::vector<std::pair<std::string, std::string>> items_;  // key, already-encoded value
};

}  // namespace trellis
