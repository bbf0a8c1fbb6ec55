#include "train/run_dir.hpp"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"

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

RunDir::RunDir(const std::string& path) : path_(path) {
  std::error_code ec;
  fs::create_directories(path_, ec);
  if (ec || !fs::is_directory(path_))
    throw UserError(strfmt("run.dir = '%s': cannot create the run directory: %s", path.c_str(),
                           ec ? ec.message().c_str() : "not a directory"));
}

RunDir::~RunDir() {
  for (auto& [name, f] : tables_) std::fclose(f);
}

void RunDir::write_file(const std::string& name, const std::string& content) const {
  fs::path target = fs::path(path_) / name;
  fs::path tmp = target;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << content;
    if (!out) throw UserError("run.dir: cannot write " + tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) throw UserError("run.dir: cannot write " + target.string() + ": " + ec.message());
}

void RunDir::open_table(const std::string& name, const std::vector<std::string>& columns,
                        int64_t resumed_at) {
  fs::path file = fs::path(path_) / name;
  bool continuing = resumed_at > 0 && fs::exists(file);
  if (continuing) {
    // The header, then the rows of steps 1..resumed_at (the first field), via a rename.
    std::ifstream in(file);
    std::string kept, line;
    for (bool header = true; std::getline(in, line); header = false) {
      char* end = nullptr;
      const long long step = std::strtoll(line.c_str(), &end, 10);
      if (header || (end != line.c_str() && *end == ',' && step <= resumed_at)) kept += line + "\n";
    }
    if (in.bad()) throw UserError("run.dir: cannot read " + file.string());
    if (kept.empty())
      continuing = false;  // an empty file (cut before its header): start it anew
    else
      write_file(name, kept);
  }
  std::FILE* f = std::fopen(file.c_str(), continuing ? "a" : "w");
  if (!f) throw UserError("run.dir: cannot write " + file.string() + ": " + std::strerror(errno));
  if (std::FILE* old = tables_[name]) std::fclose(old);
  tables_[name] = f;
  if (!continuing) append_row(name, columns);
}

void RunDir::append_row(const std::string& name, const std::vector<std::string>& values) {
  auto it = tables_.find(name);
  if (it == tables_.end() || !it->second) return;
  for (size_t i = 0; i < values.size(); ++i)
    std::fprintf(it->second, "%s%s", i ? "," : "", values[i].c_str());
  std::fputc('\n', it->second);
  std::fflush(it->second);
}

static std::string json_escape(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += strfmt("\\u%04x", c);
        else out += c;
    }
  }
  return out + "\"";
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
  items_.emplace_back(key, json_escape(v));
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
    out += pad + json_escape(items_[i].first) + ": " + items_[i].second +
           (i + 1 < items_.size() ? ",\n" : "\n");
  return out + close + "}";
}

}  // namespace trellis
