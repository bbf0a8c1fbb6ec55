// The deterministic sampler: sequence j of step s is window hash(seed, s, j) mod W of the
// source, W = num_windows(seq_len + 1), whatever the layout or restart.
#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data/rng.hpp"

namespace trellis {

Sampler::Sampler(const TokenSource& source, int seq_len, uint64_t seed)
    : source_(source), seq_len_(seq_len), seed_(seed), windows_(0) {
  if (seq_len < 1) throw UserError(strfmt("model.seq_len must be ≥ 1 (got %d)", seq_len));
  windows_ = source.num_windows(seq_len + 1);
  if (windows_ <= 0)
    throw UserError(strfmt("data: the source has fewer than seq_len+1 = %d tokens (in any one "
                           "piece) for model.seq_len = %d: %s",
                           seq_len + 1, seq_len, source.describe().c_str()));
}

void Sampler::sequence(int64_t step, int64_t index, int32_t* out) const {
  using namespace data_rng;
  uint64_t h = hash_combine(mix64(seed_ ^ 0x53414D504C4552ull), uint64_t(step));
  h = hash_combine(h, uint64_t(index));
  source_.window(int64_t(h % uint64_t(windows_)), seq_len_ + 1, out);
}

void Sampler::batch(int64_t step, int64_t first, int count, int32_t* inputs,
                    int32_t* targets) const {
  const int T = seq_len_;
  std::vector<int32_t> buf(size_t(T) + 1);  // (T + 1,)
  for (int i = 0; i < count; ++i) {
    sequence(step, first + i, buf.data());
    std::copy_n(buf.data(), T, inputs + int64_t(i) * T);       // inputs  (count, T)
    std::copy_n(buf.data() + 1, T, targets + int64_t(i) * T);  // targets (count, T)
  }
}

}  // namespace trellis
