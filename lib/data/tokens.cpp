// The tokens source: pre-tokenized shards matching a glob, sorted by name. Each shard is either
// llm.c format (a 256 × int32 header: magic, version, token count; then the tokens — magic
// 20240520 version 1 for GPT-2's uint16 tokens, 20240801 version 7 for Llama 3's uint32 ones) or
// nanoGPT's raw uint16 .bin (no header). Windows never cross a shard boundary.
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

// llm.c's shard formats (its dev/data/data_common.py): the header's first two int32 name one.
struct LlmcFormat {
  int32_t magic, version;
  int token_bytes;
  const char* what;
};
constexpr LlmcFormat kLlmcFormats[] = {{20240520, 1, 2, "GPT-2's uint16 tokens"},
                                       {20240801, 7, 4, "Llama 3's uint32 tokens"}};
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

struct Shard {
  MappedFile file;
  const uint8_t* tokens;  // (n,) of token_bytes each: uint16 or uint32
  int64_t n;
  int token_bytes;
  bool llmc;
  uint32_t at(int64_t i) const {
    if (token_bytes == 2) return reinterpret_cast<const uint16_t*>(tokens)[i];
    return reinterpret_cast<const uint32_t*>(tokens)[i];
  }
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
  Shard s{std::move(f), nullptr, 0, 2, false};
  const LlmcFormat* format = nullptr;
  if (bytes >= sizeof(int32_t))
    for (const LlmcFormat& candidate : kLlmcFormats)
      if (read_i32(d) == candidate.magic) format = &candidate;
  if (format) {
    s.llmc = true;
    s.token_bytes = format->token_bytes;
    if (bytes < kLlmcHeaderBytes)
      throw UserError(
          strfmt("%s: shard '%s' is truncated: %zu bytes, shorter than the "
                 "%zu-byte llm.c header",
                 key.c_str(), path.c_str(), bytes, kLlmcHeaderBytes));
    const int32_t version = read_i32(d + 4);
    if (version != format->version)
      throw UserError(
          strfmt("%s: shard '%s' has llm.c magic %d with version %d; only version %d "
                 "(%s) is known",
                 key.c_str(), path.c_str(), format->magic, version, format->version,
                 format->what));
    const int32_t count = read_i32(d + 8);
    const size_t width = size_t(s.token_bytes);
    if (count < 0)
      throw UserError(strfmt("%s: shard '%s' is malformed: its header's token count is %d",
                             key.c_str(), path.c_str(), count));
    if (bytes != kLlmcHeaderBytes + width * size_t(count))
      throw UserError(
          strfmt("%s: shard '%s' is malformed or truncated: its header says "
                 "%d tokens (%zu bytes in all) but the file has %zu bytes",
                 key.c_str(), path.c_str(), count,
                 kLlmcHeaderBytes + width * size_t(count), bytes));
    s.tokens = d + kLlmcHeaderBytes;
    s.n = count;
  } else {
    // An llm.c header whose magic alone is damaged (one flipped bit) would read as raw uint16
    // tokens — its 1024 header bytes trained on as 512 tokens — and at a vocabulary past 65535
    // pass every check: a header whose version and token count match a format and the file's
    // size is one (raw tokens that happen to read so are not to be expected).
    for (const LlmcFormat& f : kLlmcFormats) {
      const int32_t count = bytes >= kLlmcHeaderBytes ? read_i32(d + 8) : -1;
      if (count >= 0 && read_i32(d + 4) == f.version &&
          bytes == kLlmcHeaderBytes + size_t(f.token_bytes) * size_t(count))
        throw UserError(strfmt("%s: shard '%s' has an llm.c header (version %d, %d tokens, as "
                               "its size says) whose magic is %d, not %d (%s): damaged",
                               key.c_str(), path.c_str(), f.version, count, read_i32(d),
                               f.magic, f.what));
    }
    if (bytes % 2 != 0)
      throw UserError(
          strfmt("%s: shard '%s' has an odd size (%zu bytes): neither an "
                 "llm.c shard (magic %d or %d) nor raw uint16 tokens",
                 key.c_str(), path.c_str(), bytes, kLlmcFormats[0].magic,
                 kLlmcFormats[1].magic));
    s.tokens = d;
    s.n = int64_t(bytes / 2);
  }
  // Every token is read once here (a shard of billions, from a parallel file system, takes a
  // while): progress for the hang watchdog chunk by chunk.
  // (The width chosen once a chunk, not a token: a plain loop over one type vectorises.)
  uint32_t mx = 0;
  const auto chunk_max = [](const auto* tokens, int64_t begin, int64_t end, uint32_t m) {
    for (int64_t i = begin; i < end; ++i) m = std::max<uint32_t>(m, tokens[i]);
    return m;
  };
  constexpr int64_t kChunk = int64_t(1) << 24;
  for (int64_t begin = 0; begin < s.n; begin += kChunk) {
    watchdog_beat("reading the token shards");
    const int64_t end = std::min(s.n, begin + kChunk);
    mx = s.token_bytes == 2
             ? chunk_max(reinterpret_cast<const uint16_t*>(s.tokens), begin, end, mx)
             : chunk_max(reinterpret_cast<const uint32_t*>(s.tokens), begin, end, mx);
  }
  if (s.n > 0 && int64_t(mx) >= vocab) {
    int64_t at = 0;
    while (s.at(at) != mx) ++at;
    throw UserError(
        strfmt("%s: shard '%s' holds token %u (at position %lld), which is not "
               "below model.vocab = %d",
               key.c_str(), path.c_str(), mx, static_cast<long long>(at), vocab));
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
    int llmc = 0, wide = 0;
    for (const auto& s : shards_) llmc += s.llmc, wide += s.token_bytes == 4;
    return strfmt("token shards '%s': %zu file%s (%d llm.c%s, %zu raw uint16), %lld tokens, "
                  "vocab %d",
                  pattern_.c_str(), shards_.size(), shards_.size() == 1 ? "" : "s", llmc,
                  wide ? strfmt(" of which %d uint32", wide).c_str() : "",
                  shards_.size() - size_t(llmc), static_cast<long long>(total_), vocab_) +
           // (Read together as one vocabulary, which the ids of one tokenizer are.)
           (wide > 0 && size_t(wide) < shards_.size()
                ? "; warning: uint32 and uint16 shards together (llm.c writes Llama 3's ids as "
                  "uint32, GPT-2's as uint16): make sure they are one tokenizer's"
                : "");
  }
  int vocab() const override { return vocab_; }
  int64_t size() const override { return total_; }
  int64_t num_windows(int len) const override {
    int64_t w = 0;
    for (const auto& s : shards_) w += std::max<int64_t>(0, s.n - len + 1);
    return w;
  }
  std::vector<int64_t> piece_sizes() const override {
    std::vector<int64_t> sizes;
    for (const auto& s : shards_) sizes.push_back(s.n);
    return sizes;
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
    const Shard& s = shards_[shard];
    uint32_t mx = 0;
    for (int i = 0; i < len; ++i) {
      const uint32_t token = s.at(offset + i);
      mx = std::max(mx, token);
      out[i] = int32_t(token);  // (below the vocabulary, so below INT32_MAX: checked next)
    }
    // Every id was below the vocabulary when the shard was opened; one past it now means the
    // file changed under the run, and it would index past the embedding table.
    if (int64_t(mx) >= vocab_) {
      int at = 0;  // (what was read, not the file again)
      while (uint32_t(out[at]) != mx) ++at;
      throw RankInputError(strfmt(
          "data file '%s' holds token %lld at token %lld, not below model.vocab = %d, though "
          "every token was when the run opened it: the file changed under the run (rewritten "
          "in place); leave the files of data.path and eval.path as they are during a run",
          s.file.path().c_str(), static_cast<long long>(mx), static_cast<long long>(offset + at),
          vocab_));
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
