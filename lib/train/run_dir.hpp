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
  /// Writes `name` inside the run directory (via a temporary file and a rename).
  void write_file(const std::string& name, const std::string& content) const;

  /// A CSV file inside the run directory (metrics.csv, eval.csv): the header once, then one row
  /// per append_row; flushed each time so that a killed run keeps what it logged. A run resumed
  /// after `resumed_at` steps (> 0) continues an existing file, first dropping the rows of later
  /// steps (logged before a crash, or after an older checkpoint it fell back to), which it is
  /// about to log again. Errors → UserError naming the file.
  void open_table(const std::string& name, const std::vector<std::string>& columns,
                  int64_t resumed_at = 0);
  void append_row(const std::string& name, const std::vector<std::string>& values);

 private:
  std::string path_;
  std::map<std::string, std::FILE*> tables_;  // by file name
};

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
