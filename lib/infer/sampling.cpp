#include "infer/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"

namespace trellis {

TokenSampler::TokenSampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {
  TRELLIS_CHECK(options.temperature >= 0 && options.top_k >= 0, "temperature %g, top_k %d",
                options.temperature, options.top_k);
}

int32_t TokenSampler::sample(const float* logits, int V) {
  if (opt_.temperature == 0 || opt_.top_k == 1) {  // greedy; the first maximum wins
    return int32_t(std::max_element(logits, logits + V) - logits);
  }
  const int k = opt_.top_k > 0 ? std::min(opt_.top_k, V) : V;
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  // The k most likely ids, in a fixed order (by logit, then id) so that the draw is reproducible.
  auto more_likely = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  if (k < V) std::nth_element(order_.begin(), order_.begin() + (k - 1), order_.end(), more_likely);
  std::sort(order_.begin(), order_.begin() + k, more_likely);
  // softmax(logit / temperature) over the candidates, in double.
  const double top = logits[order_[0]];
  weight_.resize(k);
  double total = 0;
  for (int i = 0; i < k; ++i) {
    weight_[i] = std::exp((double(logits[order_[i]]) - top) / opt_.temperature);
    total += weight_[i];
  }
  const double u = data_rng::uniform(rng_) * total;
  double acc = 0;
  for (int i = 0; i < k; ++i) {
    acc += weight_[i];
    if (u < acc) return order_[i];
  }
  return order_[k - 1];  // u within rounding of the total
}

}  // namespace trellis
