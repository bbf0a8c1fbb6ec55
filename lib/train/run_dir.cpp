#include "train/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "core/log.hpp"

namespace fs = std::filesystem;

namespace trellis {

void check_writable_dir(const std::string& dir, const std::string& key) {
  // Walk up to the first existing ancestor: that is where a directory would be created.
  std::error_code ec;
  fs::path p = fs::absolute(dir.empty() ? "." : dir, ec);  // ("": libstdc++'s absolute throws)
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  if (!fs::is_directory(p, ec))
    throw UserError(strfmt("%s = '%s': '%s' is not a directory", key.c_str(), dir.c_str(),
                           p.c_str()));
  fs::path probe = p / (".trellis-write-probe-" + std::to_string(::getpid()));
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (!f)
    throw UserError(strfmt("%s = '%s': cannot write in '%s': %s", key.c_str(), dir.c_str(),
                           p.c_str(), std::strerror(errno)));
  std::fclose(f);
  fs::remove(probe, ec);
}

DirLock::DirLock(const std::string& dir, const std::string& key, double wait_s) {
  std::error_code ec;
  created_ = !fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw UserError(strfmt("%s = '%s': cannot create the directory: %s", key.c_str(), dir.c_str(),
                           ec ? ec.message().c_str() : "not a directory"));
  const std::string file = (fs::path(dir) / ".trellis.lock").string();
  dir_ = dir;
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UserError(strfmt("%s = '%s': cannot open %s: %s", key.c_str(), dir.c_str(),
                           file.c_str(), std::strerror(errno)));
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) break;
    const int e = errno;
    if (e == EINTR) continue;
    if (e != EWOULDBLOCK) {  // ENOLCK, ENOSYS, EOPNOTSUPP: a filesystem without locks
      ::close(fd_);
      fd_ = -1;
      log(strfmt("warning: %s = '%s': cannot lock %s (%s): a second job in this directory "
                 "would not be stopped",
                 key.c_str(), dir.c_str(), file.c_str(), std::strerror(e)));
      return;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= wait_s) {
      char holder[512] = {};
      const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
      std::string who = n > 0 ? std::string(holder, size_t(n)) : "";
      while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
      ::close(fd_);
      fd_ = -1;
      throw UserError(strfmt(
          "%s = '%s' is in use by another trellis job (%s): two runs in one directory would "
          "overwrite each other's checkpoints and metrics; wait for it to end, or give this run "
          "a directory of its own",
          key.c_str(), dir.c_str(), who.empty() ? "its lock file names no process" : who.c_str()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  // Who holds it, for the error another job gets.
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const char* job = std::getenv("SLURM_JOB_ID");
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  const std::string who = strfmt("pid %d on %s%s%s, since %s\n", int(::getpid()), host,
                                 job ? ", Slurm job " : "", job ? job : "", when);
  // (Where this fails the lock holds all the same; only the other job's message names no one.)
  const bool named = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, who.data(), who.size(), 0) > 0;
  (void)named;
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  // A directory this lock made and the run then left empty (bad input found after: an explicit
  // checkpoint that does not load) goes again, so that bad input leaves nothing behind.
  if (created_) {
    std::error_code ec;
    bool only_the_lock = true;
    for (const auto& entry : fs::directory_iterator(dir_, ec))
      if (entry.path().filename() != ".trellis.lock") only_the_lock = false;
    if (!ec && only_the_lock) {
      fs::remove(fs::path(dir_) / ".trellis.lock", ec);
      fs::remove(dir_, ec);
    }
  }
  ::close(fd_);  // (releases the lock; a file left behind means nothing once no one holds it)
}

std::vector<std::string> set_aside_run_files(const std::string& run_dir, std::string& into) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const char* name : {"metrics.csv", "eval.csv", "summary.json", "deck.ini"})
    if (fs::exists(fs::path(run_dir) / name, ec)) names.push_back(name);
  if (!names.empty()) into = move_aside(run_dir, names);
  return names;
}

RunDir::RunDir(const std::string& path) : path_(path) {
  std::error_code ec;
  fs::create_directories(path_, ec);
  if (ec || !fs::is_directory(path_))
    throw UserError(strfmt("run.dir = '%s': cannot create the run directory: %s", path.c_str(),
                           ec ? ec.message().c_str() : "not a directory"));
}

RunDir::~RunDir() {
  for (auto& [name, f] : tables_)
    if (f) std::fclose(f);  // (null: closed at a write error)
}

void RunDir::write_file(const std::string& name, const std::string& content) const {
  // (A full disk or a quota shows at the flush or the close: write_file_atomically checks both.)
  write_file_atomically((fs::path(path_) / name).string(), [&](std::FILE* f) {
    return std::fwrite(content.data(), 1, content.size(), f) == content.size();
  });
}

int64_t RunDir::last_row_step(const std::string& name) const {
  std::ifstream in(fs::path(path_) / name);
  std::string line;
  int64_t last = -1;
  for (bool header = true; std::getline(in, line); header = false) {
    char* end = nullptr;
    const long long step = std::strtoll(line.c_str(), &end, 10);
    if (!header && end != line.c_str() && *end == ',') last = step;
  }
  return last;
}

void RunDir::open_table(const std::string& name, const std::vector<std::string>& columns,
                        int64_t resumed_at) {
  const fs::path file = fs::path(path_) / name;
  // A FIFO, a socket or a directory in its place is refused: opening it would block the run, or
  // fail. (A character device is written to: /dev/null, /dev/full; only a regular file is read.)
  refuse_blocking_file(file.string(), "run.dir: ",
                       "not the table the run writes there: remove it, or give another run.dir");
  std::error_code ec;
  bool continuing = resumed_at > 0 && fs::is_regular_file(file, ec);
  if (continuing) {
    // The header, then the rows of steps 1..resumed_at (the first field), via a rename.
    // A row cut short (a full disk, a kill mid-write) has fewer fields than the header: dropped.
    std::ifstream in(file);
    std::string kept, line;
    size_t fields = 0;
    for (bool header = true; std::getline(in, line); header = false) {
      const size_t n = size_t(std::count(line.begin(), line.end(), ',')) + 1;
      if (header) fields = n;
      char* end = nullptr;
      const long long step = std::strtoll(line.c_str(), &end, 10);
      if (header || (end != line.c_str() && *end == ',' && step <= resumed_at && n == fields))
        kept += line + "\n";
    }
    if (in.bad()) throw UserError("run.dir: cannot read " + file.string());
    if (kept.empty())
      continuing = false;  // an empty file (cut before its header): start it anew
    else
      write_file(name, kept);
  }
  std::FILE* f = std::fopen(file.c_str(), continuing ? "a" : "w");
  if (!f) throw UserError("run.dir: cannot write " + file.string() + ": " + std::strerror(errno));
  // Unbuffered: a row is one write(2), so that a row that fails leaves no remainder in a buffer
  // to land later, spliced into a row the disk then has room for.
  std::setvbuf(f, nullptr, _IONBF, 0);
  if (std::FILE* old = tables_[name]) std::fclose(old);
  tables_[name] = f;
  if (!continuing) append_row(name, columns);
}

void RunDir::append_row(const std::string& name, const std::vector<std::string>& values) {
  auto it = tables_.find(name);
  if (it == tables_.end() || !it->second) return;
  std::string row;
  for (size_t i = 0; i < values.size(); ++i) row += (i ? "," : "") + values[i];
  row += '\n';
  std::FILE* f = it->second;
  const long before = std::ftell(f);
  errno = 0;
  const bool written = std::fwrite(row.data(), 1, row.size(), f) == row.size();
  if (written) return;
  const int error = errno;
  // A full disk or a quota: the table keeps whole rows only — what part of this one reached the
  // file is cut off — and takes no more (a row written once the disk has room again would say
  // the rows between were never there). The run goes on (its checkpoints may well live
  // elsewhere), says so now, once, and ends with status 2 (check_written) rather than 0.
  if (before >= 0) (void)!ftruncate(fileno(f), before);  // (failing: a resume drops the part)
  std::fclose(f);
  it->second = nullptr;
  if (!write_error_.empty()) return;
  write_error_ = strfmt("cannot write %s (%s)", (fs::path(path_) / name).c_str(),
                        error ? std::strerror(error) : "write failed");
  log("warning: " + write_error_ + ": the run goes on; its rows from here are missing");
}

void RunDir::check_written() const {
  if (!write_error_.empty())
    throw UserError("run.dir: " + write_error_ +
                    " during the run: its rows from there on are missing (the checkpoints are "
                    "written apart, and whole); make room before the next run");
}

JsonObject& JsonObject::num(const std::string& key, double v) {
  items_.emplace_back(key, std::isfinite(v) ? strfmt("%.10g", v) : "null");
  return *this;
}
JsonObject& JsonObject::integer(const std::string& key, long long v) {
  items_.emplace_back(key, std::to_string(v));
  return *this;
}
JsonObject& JsonObject::str(const std::string& key, const std::string& v) {
  items_.emplace_back(key, json_string(v));
  return *this;
}
JsonObject& JsonObject::null(const std::string& key) {
  items_.emplace_back(key, "null");
  return *this;
}
JsonObject& JsonObject::obj(const std::string& key, const JsonObject& v) {
  items_.emplace_back(key, v.dump(1));
  return *this;
}

std::string JsonObject::dump(int indent) const {
  std::string pad(2 * (indent + 1), ' '), close(2 * indent, ' ');
  std::string out = "{\n";
  for (size_t i = 0; i < items_.size(); ++i)
    out += pad + json_string(items_[i].first) + ": " + items_[i].second +
           (i + 1 < items_.size() ? ",\n" : "\n");
  return out + close + "}";
}

}  // namespace trellis
