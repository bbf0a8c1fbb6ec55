// Training data: a token source (synthetic Markov text, a byte-level file, or pre-tokenized
// shards) and the deterministic sampler that turns (step, sequence index) into a window of it.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"

namespace trellis {

/// A read-only stream of tokens, possibly in several pieces (shards); a window never crosses
/// the end of a piece.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  /// One line for the log: what it is, how many tokens, where from.
  virtual std::string describe() const = 0;
  /// Largest token id + 1 this source can produce.
  virtual int vocab() const = 0;
  /// Total tokens over all pieces.
  virtual int64_t size() const = 0;
  /// How many distinct windows of `len` tokens exist (each inside one piece).
  virtual int64_t num_windows(int len) const = 0;
  /// Copies window k (0 ≤ k < num_windows(len)) of `len` tokens into out. The windows are
  /// numbered piece by piece: a piece of n tokens holds max(0, n − len + 1) of them.
  virtual void window(int64_t k, int len, int32_t* out) const = 0;
  /// Tokens in each piece, in order (one piece: size()).
  virtual std::vector<int64_t> piece_sizes() const { return {size()}; }
  /// The lowest reachable loss in nats/token, where known (the synthetic source's entropy rate).
  virtual std::optional<double> entropy_floor() const { return std::nullopt; }
  /// The files it reads, by path and identity (none for the synthetic source).
  struct File {
    std::string path;
    std::pair<uint64_t, uint64_t> id;  // (device, inode)
  };
  virtual std::vector<File> files() const { return {}; }
};

/// A hash of what the source holds: its vocabulary, its pieces' sizes and 1024 of its tokens
/// spread evenly over them, the first and the last among them (1024 page reads at most, at
/// start-up). Ranks that each read the files themselves compare it: a copy on one node's local
/// disk, stale or cut short, differs.
uint64_t content_fingerprint(const TokenSource& source);

/// "" when no file of `held_out` is one of `training`'s (under any name), else what is shared,
/// naming eval.path and data.path.
std::string held_out_overlap(const TokenSource& training, const TokenSource& held_out);
std::string held_out_overlap(const std::vector<TokenSource::File>& training,
                             const TokenSource& held_out);
/// The files `data`.path names (the tokens source's glob, the text source's file) with their
/// identities, without opening them (a corpus of many GB is not read to compare names); none for
/// the synthetic source or where nothing matches.
std::vector<TokenSource::File> files_named(const DataConfig& data);

/// The individual sources (make_token_source chooses among them by data.source). `key` names
/// data.path in messages (eval.path for the held-out data).
/// Synthetic: data.synthetic_tokens tokens of a random order-k Markov source seeded by
/// data.synthetic_seed;
/// with `skip` > 0 the walk's tokens [skip, skip + data.synthetic_tokens) instead of its first
/// ones (the held-out data: the training corpus' walk continued, in the same stationary regime).
std::unique_ptr<TokenSource> make_synthetic_source(const DataConfig& data, const ModelConfig& model,
                                                   int64_t skip = 0);
/// Text: the bytes of the file data.path (vocab 256; model.vocab must be ≥ 256).
std::unique_ptr<TokenSource> make_text_source(const DataConfig& data, const ModelConfig& model,
                                              const std::string& key = "data.path");
/// Tokens: the shards matching the glob data.path (llm.c format or raw uint16), sorted by name.
std::unique_ptr<TokenSource> make_tokens_source(const DataConfig& data, const ModelConfig& model,
                                                const std::string& key = "data.path");

/// The synthetic source's law, exposed for tests: the successors of one context and their
/// probabilities (a Dirichlet(alpha) draw), a pure function of (seed, vocab, order, branching,
/// alpha, context). `context` holds `order` tokens, oldest first.
struct SyntheticSuccessors {
  std::vector<int32_t> tokens;  // (branching,) distinct, in [0, vocab)
  std::vector<double> probs;    // (branching,) sums to 1
};
SyntheticSuccessors synthetic_successors(uint64_t seed, int vocab, int order, int branching,
                                         double alpha, const int32_t* context);

/// Builds the source the [data] section asks for. Throws UserError naming data.path / the file
/// when a file is missing, unreadable, empty, malformed, or holds tokens ≥ model.vocab.
std::unique_ptr<TokenSource> make_token_source(const DataConfig& data, const ModelConfig& model,
                                               const std::string& key = "data.path");

/// The held-out data of [eval]: eval.path read as data.source says (errors name eval.path), or
/// for the synthetic source the continuation of the training corpus' walk, just long enough for
/// `sequences` held-out sequences of model.seq_len + 1 tokens.
std::unique_ptr<TokenSource> make_held_out_source(const DataConfig& data, const EvalConfig& eval,
                                                  const ModelConfig& model, int64_t sequences);

/// The fixed held-out sequences of an evaluation: sequence i is window i·seq_len of the source,
/// so that consecutive sequences do not overlap (each token is a target once). The same
/// sequences every evaluation, for every layout and restart. Throws UserError naming eval.batches
/// and the source when it holds fewer than `sequences`.
class HeldOutSet {
 public:
  HeldOutSet(const TokenSource& source, int seq_len, int64_t sequences);
  int64_t sequences() const { return sequences_; }
  /// Sequences first..first+count-1 as inputs (count, T) and targets (count, T).
  void batch(int64_t first, int count, int32_t* inputs, int32_t* targets) const;

 private:
  const TokenSource& source_;
  int seq_len_;
  int64_t sequences_;
};

/// How training sequences are drawn (data.sampling).
///   random  sequence j of step s is window hash(train.seed, s, j) mod W of the W windows of
///           seq_len + 1 tokens at every offset: drawn with replacement, as nanoGPT does (after a
///           corpus' worth of sequences about 1/e of its tokens have not been a target yet).
///   epochs  the windows at offsets k·seq_len from each piece's (shard's) start, E of them, in a
///           new order each epoch: sequence number g of the run's stream is strided window
///           perm_e(g mod E), e = g / E, perm_e a keyed bijection of (seed, e). Every token is a
///           target once an epoch, but a piece's first and its last (n − 1) mod seq_len.
/// Either way a sequence depends on no layout, so every layout and restart trains on the same.
enum class Sampling { random, epochs };
Sampling sampling_from(const std::string& name);  // data.sampling's value

/// Sequence j of the global batch of step s: the same window for every layout and restart.
class Sampler {
 public:
  /// `global_batch`: sequences a step (epochs: a step's sequences follow on in the stream).
  Sampler(const TokenSource& source, int seq_len, uint64_t seed,
          Sampling how = Sampling::random, int64_t global_batch = 1);
  /// Epochs: step `step` begins at sequence number `sequences_before` of the stream — a resumed
  /// run's tokens seen / seq_len, so that a run resumed with another train.global_batch goes on
  /// where the epoch stood. Without a call, step 0 begins at sequence 0.
  void start_at(int64_t step, int64_t sequences_before);
  /// Windows an epoch (epochs), or of the whole source at every offset (random).
  int64_t windows() const { return how_ == Sampling::epochs ? epoch_windows_ : windows_; }
  /// The epoch (from 0) that sequence j of step s falls in (epochs; 0 with random).
  int64_t epoch(int64_t step, int64_t index = 0) const;
  /// Writes seq_len + 1 tokens: inputs are [0, seq_len), targets are [1, seq_len].
  void sequence(int64_t step, int64_t index, int32_t* out) const;
  /// A micro-batch: sequences first..first+count-1 of step s, as inputs (count, T) and
  /// targets (count, T).
  void batch(int64_t step, int64_t first, int count, int32_t* inputs, int32_t* targets) const;

 private:
  /// Sequence j of step s as a number of the run's stream (epochs).
  int64_t stream_position(int64_t step, int64_t index) const;

  const TokenSource& source_;
  int seq_len_;
  uint64_t seed_;
  Sampling how_;
  int64_t global_batch_;
  int64_t windows_;            // windows of seq_len + 1 tokens at every offset
  int64_t epoch_windows_ = 0;  // those at offsets k·seq_len of each piece (epochs)
  // (pieces + 1,) strided windows in pieces [0, p); (pieces,) the number of piece p's first
  // window among all windows (TokenSource::window's numbering)
  std::vector<int64_t> strided_before_, first_window_;
  int64_t start_step_ = 0, start_sequence_ = 0;
};

}  // namespace trellis
