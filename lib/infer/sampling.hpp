// Drawing the next token from the logits over the whole vocabulary: greedy (temperature 0), or
// from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all), with a
// seeded generator (xoshiro256**) so that a run is reproducible bit for bit.
#pragma once
#include <cstdint>
#include <vector>

#include "data/rng.hpp"

namespace trellis {

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (the most likely token; ties go to the lowest id)
  int top_k = 0;             // 0: the whole vocabulary
  uint64_t seed = 1234;
};

class TokenSampler {
 public:
  explicit TokenSampler(const SamplingOptions& options);
  /// The next token from logits (V).
  int32_t sample(const float* logits, int V);

 private:
  SamplingOptions opt_;
  data_rng::Xoshiro256 rng_;
  std::vector<int32_t> order_;  // (V) candidate ids, most likely first
  std::vector<double> weight_;  // (k) unnormalised probabilities of the candidates
};

}  // namespace trellis
