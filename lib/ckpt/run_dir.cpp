// Checkpoint directories: file names by step, the atomically replaced `latest`, retention, and
// the order in which a run tries checkpoints when it resumes.
#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/error.hpp"

namespace fs = std::filesystem;

namespace trellis {

using namespace ckpt_impl;

// ---- run directories -----------------------------------------------------------------------------

std::string checkpoint_file_name(int64_t step) {
  return strfmt("step_%08lld.h5", (long long)step);
}

int64_t checkpoint_step(const std::string& name) {
  const std::string pre = "step_", suf = ".h5";
  if (name.size() <= pre.size() + suf.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - suf.size(), suf.size(), suf) != 0)
    return -1;
  const std::string digits = name.substr(pre.size(), name.size() - pre.size() - suf.size());
  if (digits.size() > 18) return -1;
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

namespace {

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw UserError("cannot read checkpoint directory " + dir + ": " + errno_text(errno));
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

/// The step files of dir, newest first.
std::vector<std::pair<int64_t, std::string>> step_files(const std::vector<std::string>& names) {
  std::vector<std::pair<int64_t, std::string>> v;
  for (const std::string& n : names)
    if (const int64_t s = checkpoint_step(n); s >= 0) v.emplace_back(s, n);
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return v;
}

/// The file name `latest` holds (a bare name, no directories), or "".
std::string read_latest(const std::string& dir) {
  // (Only a regular file: opening a FIFO there would wait for a writer that never comes.)
  struct stat st;
  if (::stat((dir + "/latest").c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return {};
  std::FILE* f = std::fopen((dir + "/latest").c_str(), "r");
  if (!f) return {};
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t'))
    s.pop_back();
  // (A name with a control byte — a NUL, a newline inside — is none a run writes: damage.)
  const bool control = std::any_of(s.begin(), s.end(), [](char c) { return (unsigned char)c < 32; });
  if (s.empty() || control || s.find('/') != std::string::npos || s == "." || s == "..") return {};
  return s;
}

}  // namespace

StagedFile::StagedFile(const std::string& path, const std::function<bool(std::FILE*)>& fill)
    : path_(path), tmp_(path + ".tmp-" + random_suffix(::getpid())) {
  std::FILE* f = std::fopen(tmp_.c_str(), "wb");
  if (!f) fail("create " + tmp_, errno);
  errno = 0;
  bool ok = fill(f) && std::fflush(f) == 0;
  int e = errno;
  if (ok && ::fsync(::fileno(f)) != 0) ok = false, e = errno;
  if (std::fclose(f) != 0 && ok) ok = false, e = errno;
  if (!ok) fail("write", e);
}

StagedFile::~StagedFile() {
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void StagedFile::fail(const std::string& what, int e) {
  ::unlink(tmp_.c_str());
  tmp_.clear();
  throw UserError("cannot write " + path_ + ": " + what + (e ? ": " + errno_text(e) : ""));
}

void StagedFile::commit() {
  if (tmp_.empty()) throw std::logic_error("StagedFile::commit: " + path_ + " committed twice");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("rename", errno);
  tmp_.clear();
  const std::string err = fsync_file(dir_of(path_), true);
  if (!err.empty()) throw UserError("cannot write " + path_ + ": " + err);
}

std::string regular_file_target(const std::string& path) {
  // A symbolic link is followed (a deck linked to a shared file: the file is written, the link
  // stays). Anything else that is no regular file — a device, a FIFO, a socket — is refused:
  // the rename of an atomic write would put a file in its place (run as root: /dev/null itself).
  fs::path target = path;
  struct stat st;
  for (int links = 0; ::lstat(target.c_str(), &st) == 0 && S_ISLNK(st.st_mode); ++links) {
    std::error_code ec;
    const fs::path to = fs::read_symlink(target, ec);  // (a dangling link's too: made there)
    if (ec || links == 40)
      throw UserError(path + ": a symbolic link that cannot be followed" +
                      (ec ? ": " + ec.message() : std::string(" (a loop)")));
    // (Not normalised: "dirlink/.." is where the link's own directory's parent is, which the
    // kernel resolves and the path's text does not say.)
    target = to.is_absolute() ? to : target.parent_path() / to;
  }
  if (::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw UserError(path + ": " + file_kind(st.st_mode) +
                    ", which a written file would replace; name a file");
  return target.string();
}

std::string file_kind(unsigned mode) {
  return S_ISDIR(mode)    ? "a directory"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISBLK(mode)  ? "a block device"
         : S_ISFIFO(mode) ? "a FIFO"
         : S_ISSOCK(mode) ? "a socket"
                          : "not a regular file";
}

void refuse_blocking_file(const std::string& path, const std::string& who,
                          const std::string& advice) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode))
    throw UserError(who + path + ": " + file_kind(st.st_mode) + "; " + advice);
}

void write_file_atomically(const std::string& path, const std::function<bool(std::FILE*)>& fill) {
  StagedFile(regular_file_target(path), fill).commit();
}

StagedFile stage_latest(const std::string& dir, const std::string& file_name) {
  if (file_name.empty() || file_name.find('/') != std::string::npos)
    throw std::logic_error("publish_latest: '" + file_name + "' is not a bare file name");
  const std::string content = file_name + "\n";
  return StagedFile(dir + "/latest", [&](std::FILE* f) {
    return std::fwrite(content.data(), 1, content.size(), f) == content.size();
  });
}

namespace ckpt_impl {
void remove_staged_latest(const std::string& dir) noexcept {
  try {
    for (const std::string& n : list_dir(dir))
      if (n.rfind("latest.tmp-", 0) == 0) ::unlink((dir + "/" + n).c_str());
  } catch (const UserError&) {
    // (a directory that cannot be read: the next job's start removes them)
  }
}
}  // namespace ckpt_impl

void publish_latest(const std::string& dir, const std::string& file_name) {
  stage_latest(dir, file_name).commit();
}

void remove_dead_writers_temporaries(const std::string& dir, const std::vector<std::string>& names) {
  for (const std::string& n : list_dir(dir))
    for (const std::string& name : names) {
      const std::string prefix = name + ".tmp-";  // then random_suffix's "PID-HEX"
      if (n.rfind(prefix, 0) != 0) continue;
      char* end = nullptr;
      const long pid = std::strtol(n.c_str() + prefix.size(), &end, 10);
      if (pid <= 0 || *end != '-' || ::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;
      struct stat st;
      const std::string p = dir + "/" + n;
      if (::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(p.c_str());
    }
}

std::vector<std::string> remove_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::string err;
  for (const std::string& n : list_dir(dir)) {
    if (n.find(".tmp-") == std::string::npos) continue;
    const std::string p = dir + "/" + n;
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // (ours are files)
    if (::unlink(p.c_str()) == 0)
      removed.push_back(n);
    else if (errno != ENOENT && err.empty())
      err = "cannot remove " + p + ": " + errno_text(errno);
  }
  if (!err.empty()) throw UserError(err);
  return removed;
}

void apply_retention(const std::string& dir, int keep) {
  std::string err;
  try {
    remove_temporaries(dir);
  } catch (const UserError& e) {
    err = e.what();  // (said after the pruning, which goes on)
  }
  const std::vector<std::string> names = list_dir(dir);
  const std::string latest = read_latest(dir);
  auto remove = [&](const std::string& n) {
    const std::string p = dir + "/" + n;
    if (::unlink(p.c_str()) != 0 && errno != ENOENT && err.empty())
      err = "cannot remove " + p + ": " + errno_text(errno);
  };
  if (keep > 0) {
    const auto steps = step_files(names);
    for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i)
      if (steps[i].second != latest) remove(steps[i].second);
  }
  if (!err.empty()) throw UserError(err);
}

std::string move_aside(const std::string& dir, const std::vector<std::string>& names) {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "superseded-%Y%m%d-%H%M%S", &utc);
  std::string into;
  for (int n = 1; into.empty(); ++n) {
    std::string candidate = stamp;
    if (n > 1) candidate += '-' + std::to_string(n);
    if (::mkdir((dir + "/" + candidate).c_str(), 0755) == 0)
      into = candidate;
    else if (errno != EEXIST)
      throw UserError("cannot create " + dir + "/" + candidate + ": " + errno_text(errno));
  }
  for (const std::string& n : names) {
    const std::string from = dir + "/" + n, to = dir + "/" + into + "/" + n;
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw UserError("cannot move " + from + " to " + dir + "/" + into + ": " +
                      errno_text(errno));
  }
  const std::string err = fsync_file(dir, true);
  if (!err.empty()) throw UserError("cannot move files out of " + dir + ": " + err);
  return into;
}

std::vector<int64_t> set_aside_checkpoints(const std::string& dir, int64_t after_step,
                                           std::string& into) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return {};  // no checkpoints yet
  const auto all = step_files(list_dir(dir));  // newest first
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  for (const auto& [step, n] : all)
    if (step > after_step) names.push_back(n), steps.insert(steps.begin(), step);
  if (names.empty()) return {};
  // `latest` first where it names a file that goes: a crash between the moves then leaves no
  // pointer to a file that is no longer there.
  const std::string latest = read_latest(dir);
  struct stat lst;
  if ((names.size() == all.size() ||
       std::find(names.begin(), names.end(), latest) != names.end()) &&
      ::lstat((dir + "/latest").c_str(), &lst) == 0)
    names.insert(names.begin(), "latest");
  into = move_aside(dir, names);
  return steps;
}

std::vector<std::string> resume_candidates(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return {};  // no checkpoints yet
  const std::vector<std::string> names = list_dir(dir);
  const std::string latest = read_latest(dir);
  // By step, newest first: `latest` lags behind the newest file only when a job died between
  // renaming that file into place (complete, synced) and publishing it, and going back to it
  // would redo those steps (and set the newer checkpoint aside as another course). A `latest`
  // naming a file outside the step_*.h5 names comes first.
  std::vector<std::string> out;
  const auto steps = step_files(names);
  const bool latest_is_step =
      std::any_of(steps.begin(), steps.end(), [&](const auto& s) { return s.second == latest; });
  if (!latest.empty() && !latest_is_step && check_regular(dir + "/" + latest).empty())
    out.push_back(dir + "/" + latest);
  for (const auto& [step, n] : steps) out.push_back(dir + "/" + n);
  return out;
}

std::string resolve_checkpoint(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return path;  // (opening it says what is wrong)
  if (!S_ISDIR(st.st_mode)) {
    // A `latest` pointer (ckpt/latest, as a newcomer types it): the step file it names, beside
    // the pointer itself (a symbolic link to one: beside its target). A checkpoint that was
    // merely named `latest` (a link to a step file, a copy: no HDF5 file is this small) is one.
    if (fs::path(path).filename() != "latest" || st.st_size > 511) return path;
    std::error_code ec;
    const fs::path real = fs::canonical(path, ec);
    const std::string dir = (ec ? fs::path(path) : real).parent_path().string();
    const std::string name = read_latest(dir.empty() ? "." : dir);
    if (name.empty())
      throw UserError("checkpoint " + path +
                      ": a `latest` pointer that names no step file (give the step file, or the "
                      "directory: its highest step)");
    return dir.empty() ? name : dir + "/" + name;
  }
  for (const std::string& dir : {path, path + "/ckpt"}) {
    const std::vector<std::string> c = resume_candidates(dir);
    if (!c.empty()) return c.front();
  }
  throw UserError("checkpoint " + path + ": a directory without step_*.h5 files (give a "
                  "checkpoint file, a checkpoint directory or a run directory)");
}

bool chosen_checkpoint_gone(const std::string& error, const std::string& given,
                            const std::string& chosen) {
  struct stat st;
  return !chosen.empty() && given != chosen && error.find(chosen) != std::string::npos &&
         ::stat(chosen.c_str(), &st) != 0 && errno == ENOENT;
}

std::string with_chosen_checkpoint_gone(const std::string& error, const std::string& given,
                                        const std::string& chosen) {
  if (!chosen_checkpoint_gone(error, given, chosen)) return error;
  // (open_failure has said it was removed, and why: only which choice it was is left to say.)
  if (error.find("removed since it was chosen") != std::string::npos)
    return error + " (it was the newest checkpoint of " + given + ")";
  return error + " (the newest checkpoint of " + given + " when it was chosen, removed since: a " +
         "run publishing there keeps only its newest checkpoint.keep; try again, or name a step " +
         "file it keeps)";
}

namespace {

/// Runs `work` on rank 0 only and gives every rank its strings, or its UserError: one answer
/// for all ranks even where a directory reads differently on each (a run publishing a newer
/// checkpoint meanwhile, or node-local storage).
std::vector<std::string> strings_of_rank0(MPI_Comm comm,
                                          const std::function<std::vector<std::string>()>& work) {
  std::vector<std::string> out;
  std::string error;
  if (comm_rank(comm) == 0) {
    try {
      out = work();
    } catch (const UserError& e) {
      error = e.what();
    }
  }
  bcast_string(comm, error, 0);
  if (!error.empty()) throw UserError(error);
  int64_t n = static_cast<int64_t>(out.size());
  MPI_Bcast(&n, 1, MPI_INT64_T, 0, comm);
  out.resize(static_cast<size_t>(n));
  for (std::string& s : out) bcast_string(comm, s, 0);
  return out;
}

}  // namespace

std::vector<std::string> resume_candidates(MPI_Comm comm, const std::string& dir) {
  return strings_of_rank0(comm, [&] { return resume_candidates(dir); });
}

std::string resolve_checkpoint(MPI_Comm comm, const std::string& path) {
  return strings_of_rank0(comm, [&] { return std::vector<std::string>{resolve_checkpoint(path)}; })
      .front();
}

}  // namespace trellis
