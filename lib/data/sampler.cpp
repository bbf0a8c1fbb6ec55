// The deterministic sampler (data.hpp: random or epochs), whatever the layout or restart. The
// held-out set: sequence i is window i·seq_len, every evaluation.
#include <algorithm>
#include <string>
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

Sampling sampling_from(const std::string& name) {
  if (name == "random") return Sampling::random;
  if (name == "epochs") return Sampling::epochs;
  throw UserError(strfmt("data.sampling: '%s' is neither random nor epochs", name.c_str()));
}

// Windows at offsets k·seq_len of the W at every offset: k·seq_len ≤ W − 1.
static int64_t strided_windows(int64_t windows, int seq_len) {
  return windows > 0 ? (windows - 1) / seq_len + 1 : 0;
}

Sampler::Sampler(const TokenSource& source, int seq_len, uint64_t seed, Sampling how,
                 int64_t global_batch)
    : source_(source), seq_len_(seq_len), seed_(seed), how_(how), global_batch_(global_batch),
      windows_(0) {
  if (seq_len < 1) throw UserError(strfmt("model.seq_len must be ≥ 1 (got %d)", seq_len));
  TRELLIS_CHECK(global_batch >= 1, "Sampler: global batch %lld", (long long)global_batch);
  windows_ = source.num_windows(seq_len + 1);
  if (windows_ <= 0)
    throw UserError(strfmt("data: the source has fewer than seq_len+1 = %d tokens (in any one "
                           "piece) for model.seq_len = %d: %s",
                           seq_len + 1, seq_len, source.describe().c_str()));
  if (how_ != Sampling::epochs) return;
  // Each piece's windows at offsets 0, seq_len, 2·seq_len, … (a window never crosses pieces).
  int64_t before = 0;
  strided_before_.push_back(0);
  for (int64_t n : source.piece_sizes()) {
    const int64_t windows = std::max<int64_t>(0, n - seq_len);  // of seq_len + 1 tokens
    first_window_.push_back(before);
    before += windows;
    strided_before_.push_back(strided_before_.back() + strided_windows(windows, seq_len));
  }
  TRELLIS_CHECK(before == windows_, "the pieces hold %lld windows, the source %lld",
                (long long)before, (long long)windows_);
  epoch_windows_ = strided_before_.back();
}

void Sampler::start_at(int64_t step, int64_t sequences_before) {
  TRELLIS_CHECK(step >= 0 && sequences_before >= 0, "Sampler::start_at(%lld, %lld)",
                (long long)step, (long long)sequences_before);
  start_step_ = step;
  start_sequence_ = sequences_before;
}

int64_t Sampler::stream_position(int64_t step, int64_t index) const {
  return start_sequence_ + (step - start_step_) * global_batch_ + index;
}

int64_t Sampler::epoch(int64_t step, int64_t index) const {
  return how_ == Sampling::epochs ? stream_position(step, index) / epoch_windows_ : 0;
}

void Sampler::sequence(int64_t step, int64_t index, int32_t* out) const {
  using namespace data_rng;
  if (how_ == Sampling::epochs) {
    const int64_t g = stream_position(step, index);
    TRELLIS_CHECK(g >= 0, "sequence %lld of step %lld before the stream's start (step %lld)",
                  (long long)index, (long long)step, (long long)start_step_);
    const int64_t epoch = g / epoch_windows_;
    const Permutation order(uint64_t(epoch_windows_),
                            hash_combine(mix64(seed_ ^ 0x45504F4348ull), uint64_t(epoch)));
    const int64_t k = int64_t(order(uint64_t(g % epoch_windows_)));  // strided window k
    const auto after = std::upper_bound(strided_before_.begin(), strided_before_.end(), k);
    const size_t piece = size_t(after - strided_before_.begin()) - 1;
    const int64_t offset = (k - strided_before_[piece]) * seq_len_;
    source_.window(first_window_[piece] + offset, seq_len_ + 1, out);
    return;
  }
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
  const int64_t held = strided_windows(source.num_windows(seq_len + 1), seq_len);
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
