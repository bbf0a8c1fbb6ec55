// The tokens source: pre-tokenized uint16 shards matching a glob, sorted by name. Each shard is
// either llm.c format (a 256 × int32 header: magic 20240520, version 1, token count; then the
// tokens) or nanoGPT's raw uint16 .bin (no header). Windows never cross a shard boundary.
#include <glob.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "core/error.hpp"
#include "core/watchdog.hpp"
#include "data/data.hpp"
#include "data/mapped_file.hpp"

namespace trellis {
namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

struct Shard {
  MappedFile file;
  const uint16_t* tokens;  // (n,)
  int64_t n;
  bool llmc;
};

int32_t read_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

Shard open_shard(const std::string& path, int vocab, const std::string& key) {
  MappedFile f(path, key);
  const uint8_t* d = f.data();
  const size_t bytes = f.size();
  Shard s{std::move(f), nullptr, 0, false};
  if (bytes >= sizeof(int32_t) && read_i32(d) == kLlmcMagic) {
    s.llmc = true;
    if (bytes < kLlmcHeaderBytes)
      throw UserError(
          strfmt("%s: shard '%s' is truncated: %zu bytes, shorter than the "
                 "%zu-byte llm.c header",
                 key.c_str(), path.c_str(), bytes, kLlmcHeaderBytes));
    const int32_t version = read_i32(d + 4);
    if (version != kLlmcVersion)
      throw UserError(
          strfmt("%s: shard '%s' has llm.c version %d; only version %d "
                 "(uint16 tokens) is supported",
                 key.c_str(), path.c_str(), version, kLlmcVersion));
    const int32_t count = read_i32(d + 8);
    if (count < 0 || bytes != kLlmcHeaderBytes + 2 * size_t(count))
      throw UserError(
          strfmt("%s: shard '%s' is malformed or truncated: its header says "
                 "%d tokens (%zu bytes in all) but the file has %zu bytes",
                 key.c_str(), path.c_str(), count,
                 kLlmcHeaderBytes + 2 * size_t(std::max(count, 0)), bytes));
    s.tokens = reinterpret_cast<const uint16_t*>(d + kLlmcHeaderBytes);
    s.n = count;
  } else {
    if (bytes % 2 != 0)
      throw UserError(
          strfmt("%s: shard '%s' has an odd size (%zu bytes): neither an "
                 "llm.c shard (magic %d) nor raw uint16 tokens",
                 key.c_str(), path.c_str(), bytes, kLlmcMagic));
    s.tokens = reinterpret_cast<const uint16_t*>(d);
    s.n = int64_t(bytes / 2);
  }
  // Every token is read once here (a shard of billions, from a parallel file system, takes a
  // while): progress for the hang watchdog chunk by chunk.
  uint16_t mx = 0;
  constexpr int64_t kChunk = int64_t(1) << 24;
  for (int64_t begin = 0; begin < s.n; begin += kChunk) {
    watchdog_beat("reading the token shards");
    const int64_t end = std::min(s.n, begin + kChunk);
    for (int64_t i = begin; i < end; ++i) mx = std::max(mx, s.tokens[i]);
  }
  if (int(mx) >= vocab) {
    const int64_t at = std::find(s.tokens, s.tokens + s.n, mx) - s.tokens;
    throw UserError(
        strfmt("%s: shard '%s' holds token %d (at position %lld), which is not "
               "below model.vocab = %d",
               key.c_str(), path.c_str(), int(mx), static_cast<long long>(at), vocab));
  }
  return s;
}

class TokensSource final : public TokenSource {
 public:
  TokensSource(const std::string& pattern, int vocab, const std::string& key)
      : pattern_(pattern), vocab_(vocab) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
    std::vector<std::string> paths;
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
      throw UserError(strfmt("%s: no file matches '%s'", key.c_str(), pattern.c_str()));
    if (rc != 0)
      throw UserError(
          strfmt("%s: cannot read the files matching '%s'", key.c_str(), pattern.c_str()));
    std::sort(paths.begin(), paths.end());  // byte order, not the locale's
    shards_.reserve(paths.size());
    for (const auto& p : paths) {
      shards_.push_back(open_shard(p, vocab, key));
      total_ += shards_.back().n;
    }
  }

  std::vector<File> files() const override {
    std::vector<File> out;
    for (const Shard& s : shards_) out.push_back({s.file.path(), s.file.id()});
    return out;
  }
  std::string describe() const override {
    int llmc = 0;
    for (const auto& s : shards_) llmc += s.llmc;
    return strfmt("token shards '%s': %zu file%s (%d llm.c, %zu raw uint16), %lld tokens, "
                  "vocab %d",
                  pattern_.c_str(), shards_.size(), shards_.size() == 1 ? "" : "s", llmc,
                  shards_.size() - size_t(llmc), static_cast<long long>(total_), vocab_);
  }
  int vocab() const override { return vocab_; }
  int64_t size() const override { return total_; }
  int64_t num_windows(int len) const override {
    int64_t w = 0;
    for (const auto& s : shards_) w += std::max<int64_t>(0, s.n - len + 1);
    return w;
  }
  void window(int64_t k, int len, int32_t* out) const override {
    size_t shard;
    int64_t offset;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (prefix_len_ != len) {  // prefix_[i] = windows of len in shards [0, i)
        prefix_.assign(shards_.size() + 1, 0);
        for (size_t i = 0; i < shards_.size(); ++i)
          prefix_[i + 1] = prefix_[i] + std::max<int64_t>(0, shards_[i].n - len + 1);
        prefix_len_ = len;
      }
      TRELLIS_CHECK(k >= 0 && k < prefix_.back() && len >= 0, "window %lld of %d tokens",
                    static_cast<long long>(k), len);
      shard = size_t(std::upper_bound(prefix_.begin(), prefix_.end(), k) - prefix_.begin()) - 1;
      offset = k - prefix_[shard];
    }
    const uint16_t* p = shards_[shard].tokens + offset;
    int32_t mx = 0;
    for (int i = 0; i < len; ++i) mx = std::max(mx, out[i] = p[i]);
    // Every id was below the vocabulary when the shard was opened; one past it now means the
    // file changed under the run, and it would index past the embedding table.
    if (mx >= vocab_) {
      const int at = int(std::find(out, out + len, mx) - out);  // (what was read: not p again)
      throw RankInputError(strfmt(
          "data file '%s' holds token %d at token %lld, not below model.vocab = %d, though "
          "every token was when the run opened it: the file changed under the run (rewritten "
          "in place); leave the files of data.path and eval.path as they are during a run",
          shards_[shard].file.path().c_str(), mx, static_cast<long long>(offset + at), vocab_));
    }
  }

 private:
  std::string pattern_;
  int vocab_;
  std::vector<Shard> shards_;
  int64_t total_ = 0;
  mutable std::mutex mu_;
  mutable int prefix_len_ = -1;
  mutable std::vector<int64_t> prefix_;
};

}  // namespace

std::unique_ptr<TokenSource> make_tokens_source(const DataConfig& data, const ModelConfig& model,
                                                const std::string& key) {
  if (data.path.empty())
    throw UserError(key + ": data.source = tokens needs a glob of shard files in " + key);
  return std::make_unique<TokensSource>(data.path, model.vocab, key);
}

}  // namespace trellis
