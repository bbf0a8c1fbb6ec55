// The deterministic sampler: sequence j of step s is window hash(seed, s, j) mod W of the
// source, W = num_windows(seq_len + 1), whatever the layout or restart. The held-out set:
// sequence i is window i·seq_len, every evaluation.
#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data/rng.hpp"

namespace trellis {

// A window of T + 1 tokens: its first T are the inputs, its last T the targets.
static void split_window(const int32_t* window, int T, int32_t* inputs, int32_t* targets) {
  std::copy_n(window, T, inputs);
  std::copy_n(window + 1, T, targets);
}

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
    split_window(buf.data(), T, inputs + int64_t(i) * T, targets + int64_t(i) * T);
  }
}

HeldOutSet::HeldOutSet(const TokenSource& source, int seq_len, int64_t sequences)
    : source_(source), seq_len_(seq_len), sequences_(sequences) {
  const int64_t windows = source.num_windows(seq_len + 1);
  const int64_t held = windows > 0 ? (windows - 1) / seq_len + 1 : 0;
  if (held < sequences)
    throw UserError(strfmt(
        "eval.batches: an evaluation takes %lld held-out sequences of %d "
        "tokens (one every %d), but the held-out data holds %lld: %s (lower "
        "eval.batches or give more held-out data)",
        (long long)sequences, seq_len + 1, seq_len, (long long)held, source.describe().c_str()));
}

void HeldOutSet::batch(int64_t first, int count, int32_t* inputs, int32_t* targets) const {
  const int T = seq_len_;
  std::vector<int32_t> buf(size_t(T) + 1);  // (T + 1,)
  for (int i = 0; i < count; ++i) {
    TRELLIS_CHECK(first + i < sequences_, "held-out sequence %lld of %lld", (long long)(first + i),
                  (long long)sequences_);
    source_.window((first + i) * T, T + 1, buf.data());
    split_window(buf.data(), T, inputs + int64_t(i) * T, targets + int64_t(i) * T);
  }
}

}  // namespace trellis
