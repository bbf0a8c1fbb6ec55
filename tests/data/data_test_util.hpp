// What the data module's tests share: a synthetic source of given settings, text and token-shard
// sources of files they write, every token of a source, and the check that a call fails with a
// UserError naming what it should.
#pragma once
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/data.hpp"

namespace trellis::data_test {

inline std::vector<int32_t> all_tokens(const TokenSource& src) {
  std::vector<int32_t> v(size_t(src.size()));
  src.window(0, int(src.size()), v.data());
  return v;
}

inline std::unique_ptr<TokenSource> synthetic(uint64_t seed, int vocab, int order, int branching,
                                              int64_t tokens, double alpha = 0.5) {
  DataConfig d;
  d.source = "synthetic";
  d.synthetic_tokens = tokens;
  d.synthetic_order = order;
  d.synthetic_branching = branching;
  d.synthetic_alpha = alpha;
  d.synthetic_seed = seed;
  ModelConfig m;
  m.vocab = vocab;
  return make_token_source(d, m);
}

inline void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(n));
}

inline void write_raw(const std::string& path, const std::vector<uint16_t>& toks) {
  write_bytes(path, toks.data(), toks.size() * 2);
}

/// data.source = `source` ("tokens", "text") reading data.path = `path`.
inline std::unique_ptr<TokenSource> file_source(const char* source, const std::string& path,
                                                int vocab) {
  DataConfig d;
  d.source = source;
  d.path = path;
  ModelConfig m;
  m.vocab = vocab;
  return make_token_source(d, m);
}
inline std::unique_ptr<TokenSource> tokens_source(const std::string& glob, int vocab = 1000) {
  return file_source("tokens", glob, vocab);
}
inline std::unique_ptr<TokenSource> text_source(const std::string& path, int vocab = 256) {
  return file_source("text", path, vocab);
}

/// Expects a UserError whose message contains every one of `parts`.
template <class F>
void expect_user_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "'" << e.what() << "' does not name '" << p << "'";
  }
}

}  // namespace trellis::data_test
