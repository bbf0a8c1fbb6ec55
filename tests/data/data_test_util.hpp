// What the data module's tests share: a synthetic source of given settings, every token of a
// source, and the check that a call fails with a UserError naming what it should.
#pragma once
#include <gtest/gtest.h>

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
