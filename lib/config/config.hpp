// The input deck: INI sections read with Boost.Program_options, overridden on the command line
// with --section.key=value, validated, and turned into a plain Config. The key table
// (key_table.cpp) is the one place that names every key, its type, default and meaning.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trellis {

struct ModelConfig {
  int layers = 4;
  int d_model = 256;
  int heads = 4;
  int kv_heads = 0;   // 0 in the deck means "= heads"; after validation always set
  int d_ff = 0;       // 0 in the deck means "= 4 * d_model"; after validation always set
  int seq_len = 256;
  int vocab = 256;
  // Each tensor-parallel rank's vocabulary rows padded up to a multiple of this, or of less where
  // the share is small (vocab_rows_per_rank, model/params.hpp): the LM head's GEMMs want aligned
  // rows. Changes no result: the padding is masked out of the loss and kept out of checkpoints.
  int vocab_multiple = 64;
  double init_std = 0.02;
  uint64_t seed = 1234;
};

struct ParallelConfig {
  int dp = 0;  // 0 in the deck means "world size / (tp * pp)"; after validation always set
  int tp = 1;
  int pp = 1;
  std::string stage_layers;  // "3,2": layers per stage; empty: even split
  int zero = 0;
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved
  int virtual_stages = 1;
  bool sequence_parallel = false;
  std::string order = "tp-dp-pp";  // fastest-varying group first
  double bucket_mb = 25.0;
  // ZeRO 1-2: the parameter all-gather after each step runs bucket by bucket while the next
  // forward goes on (parallel/zero.hpp); false: one all-gather, waited for in the step.
  bool overlap_param_gather = true;
};

struct TrainConfig {
  int64_t steps = 100;
  int global_batch = 8;  // sequences per optimizer step
  int micro_batch = 8;   // sequences per forward pass on one dp rank
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 10;
  std::string decay = "cosine";  // cosine | linear | constant
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0 turns clipping off
  std::string recompute = "none";  // none | full | selective
  std::string on_nan = "abort";    // abort | skip
  int max_skips = 5;
  uint64_t seed = 42;
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | text | tokens
  std::string path;                  // text: a file; tokens: a glob of shards
  std::string sampling = "random";   // random | epochs (data/data.hpp: Sampling)
  int64_t synthetic_tokens = 1 << 20;
  int synthetic_order = 2;      // context length of the Markov source
  int synthetic_branching = 4;  // successors per context
  double synthetic_alpha = 0.5; // Dirichlet concentration of the successor probabilities
  // The Markov source's law and walk. Its own key, so that model.seed changes only the initial
  // weights (a seed study trains one corpus); decks stored before it existed drew the source from
  // model.seed, which stored_deck_config gives it then.
  uint64_t synthetic_seed = 1234;
};

// Held-out evaluation: the mean loss over a fixed set of sequences the model never trains on.
struct EvalConfig {
  int64_t every = 0;  // steps between evaluations (and the last step); 0 = none
  int batches = 4;    // held-out sequences per evaluation, in units of train.global_batch
  std::string path;   // text: a file; tokens: a glob of shards (synthetic: its own held-out walk)
};

struct CheckpointConfig {
  std::string dir;  // default RUN/ckpt
  int64_t every = 0;
  int keep = 3;
  std::string resume = "auto";  // auto | never | a path
};

struct RunConfig {
  std::string dir;  // default runs/<deck name>
};

struct LogConfig {
  int64_t every = 1;
};

struct SystemConfig {
  std::string backend = "cpu";     // cpu | cuda
  std::string precision = "fp32";  // fp32 | bf16
  std::string grad_reduce = "fp32";  // fp32 | bf16: dtype of the data-parallel gradient reduction
  int threads = 0;                 // BLAS threads; 0 = all cores of this rank
  double peak_gflops = 0;          // for MFU; 0 = unknown (MFU shown as "-")
  std::string stop_signal = "USR1";  // USR1 | TERM
  double max_hours = 0;            // 0 = no wall-time budget
  double hang_timeout_s = 1800;    // no progress this long ends the job (status 4); 0 = never
  std::string device_comm = "auto";  // auto | nccl | staged: how device buffers cross ranks
};

struct Config {
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  EvalConfig eval;
  CheckpointConfig checkpoint;
  RunConfig run;
  LogConfig log;
  SystemConfig system;

  std::string deck_path;  // as given
  /// Every key with its effective value as text ("section.key", "value"), in key-table order.
  std::vector<std::pair<std::string, std::string>> effective;
  /// Keys the deck left 0/empty that were filled from other keys ("model.kv_heads", ...).
  std::vector<std::string> derived;

  int micro_batches_per_step() const {
    return train.global_batch / (parallel.dp * train.micro_batch);
  }
};

/// Layers [first, end) of pipeline stage `stage` of `pp`: the deck's parallel.stage_layers, or
/// as even as possible with earlier stages taking the extra layers.
struct StageLayers {
  int first, end;
};
StageLayers stage_layers(const ModelConfig& m, const ParallelConfig& p, int stage);

/// Reads the deck, applies `overrides` ("--section.key=value" or "section.key=value"), validates
/// against `world_size` ranks (0: as many as the deck's layout needs, dp = 0 counting as 1).
/// Throws UserError (exit status 2) naming the key, value or file. `require_built_backend`
/// false accepts a system.backend this build lacks (trellis plan only reads the deck).
Config load_config(const std::string& deck_path, const std::vector<std::string>& overrides,
                   int world_size, bool require_built_backend = true);

/// The same from a deck's text (e.g. the deck stored in a checkpoint); `deck_name` names it in
/// messages and stands for the deck's path (run.dir's default). `layout` (section.key=value, as
/// overrides) is applied before the command line's `overrides`, and a message about its keys
/// names `layout_where` (a stored deck read under this job's layout, not the user's overrides).
Config load_config_text(const std::string& deck_text, const std::string& deck_name,
                        const std::vector<std::string>& overrides, int world_size,
                        const std::vector<std::string>& layout = {},
                        const std::string& layout_where = "");

/// Refuses an output file that is the deck itself (`trellis plan --json`, `trellis tune --out`):
/// written first, the deck would be lost and the run that reads it next would fail. Throws
/// UserError naming `option`, checked before anything is written. `what`: what the file is for.
void check_not_the_deck(const std::string& path, const std::string& deck_path,
                        const std::string& option, const std::string& what);

/// Whether the deck's text gives the key `name` ("section.key") a line, read as the parser does
/// (comments dropped; a dotted name outside any section counts). A stored deck lists every key of
/// the build that wrote it: one it lacks is younger than the file.
bool deck_sets_key(const std::string& deck_text, const std::string& name);

/// Rejects system.backend = cuda in a build without CUDA, and system.device_comm = nccl in one
/// without NCCL. Throws UserError naming the key.
void check_supported_backend(const Config& cfg);

/// Every key with its value in `cfg` as text, in key-table order (what Config::effective holds
/// as loaded).
std::vector<std::pair<std::string, std::string>> effective_values(const Config& cfg);

/// The effective deck as INI text: a valid deck that reproduces this Config.
std::string effective_deck_ini(const Config& cfg);

/// A key whose value differs between two Configs (the values as a deck writes them).
struct KeyChange {
  std::string key;  // "section.key"
  std::string before, after;
};
/// The keys whose values differ, in the key table's order.
std::vector<KeyChange> changed_keys(const Config& before, const Config& after);

/// The boxed table printed at start: section, key, value, and a mark where it differs from the default.
std::string config_table(const Config& cfg);

/// Every key with its type, default and one line of meaning, by section (for --help).
std::string keys_help();

}  // namespace trellis
