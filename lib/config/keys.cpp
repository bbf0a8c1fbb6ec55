#include "config/keys.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace trellis::config {

// Unary + turns the captureless lambda into the function pointer FieldRef holds; `auto&` makes
// the field's own type pick the variant alternative.
#define FIELD(path) +[](Config& c) -> auto& { return c.path; }

const std::vector<KeyEntry>& key_table() {
  static const std::vector<KeyEntry> table = {
      // [model]
      {.section = "model",
       .key = "layers",
       .field = FIELD(model.layers),
       .bound = at_least(1),
       .help = "transformer blocks"},
      {.section = "model",
       .key = "d_model",
       .field = FIELD(model.d_model),
       .bound = at_least(1),
       .help = "width of the residual stream"},
      {.section = "model",
       .key = "heads",
       .field = FIELD(model.heads),
       .bound = at_least(1),
       .help = "attention (query) heads; must divide d_model"},
      {.section = "model",
       .key = "kv_heads",
       .field = FIELD(model.kv_heads),
       .bound = at_least(0),
       .derived = true,
       .help = "key/value heads (grouped-query attention); 0 = heads"},
      {.section = "model",
       .key = "d_ff",
       .field = FIELD(model.d_ff),
       .bound = at_least(0),
       .derived = true,
       .help = "hidden width of the MLP; 0 = 4 * d_model"},
      {.section = "model",
       .key = "seq_len",
       .field = FIELD(model.seq_len),
       .bound = between(1, 1 << 24),  // seq_len + 1 (a window with its target) fits an int
       .help = "tokens per sequence"},
      {.section = "model",
       .key = "vocab",
       .field = FIELD(model.vocab),
       .bound = at_least(2),
       .help = "vocabulary size"},
      {.section = "model",
       .key = "vocab_multiple",
       .field = FIELD(model.vocab_multiple),
       .bound = between(1, 1 << 16),
       .help = "each tensor-parallel rank's vocabulary rows are padded up to a multiple of this "
               "(of the largest power of two up to 1/8 of its share, where that is less: never "
               "more than 1/8 padding), so that the LM head's GEMM rows are aligned (64: 128 "
               "bytes in bf16, as Megatron-LM pads; GPT-2's 50257 becomes 50304); the padding is "
               "masked out of the loss and never sampled, checkpoints and exports hold the "
               "model.vocab rows only; 1: only what parallel.tp needs"},
      {.section = "model",
       .key = "init_std",
       .field = FIELD(model.init_std),
       .bound = above(0),
       .help = "standard deviation of the initial weights"},
      {.section = "model",
       .key = "seed",
       .field = FIELD(model.seed),
       .help = "seed of the weight initialization"},
      // [parallel]
      {.section = "parallel",
       .key = "dp",
       .field = FIELD(parallel.dp),
       .bound = at_least(0),
       .derived = true,
       .help = "data-parallel ranks; 0 = world size / (tp * pp)"},
      {.section = "parallel",
       .key = "tp",
       .field = FIELD(parallel.tp),
       .bound = at_least(1),
       .help = "tensor-parallel ranks; must divide heads"},
      {.section = "parallel",
       .key = "pp",
       .field = FIELD(parallel.pp),
       .bound = at_least(1),
       .help = "pipeline stages; at most layers"},
      {.section = "parallel",
       .key = "zero",
       .field = FIELD(parallel.zero),
       .bound = between(0, 3),
       .help = "ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +weights"},
      {.section = "parallel",
       .key = "stage_layers",
       .field = FIELD(parallel.stage_layers),
       .help = "layers per pipeline stage, e.g. 3,2 (empty: as even as possible, earlier stages "
               "first)"},
      {.section = "parallel",
       .key = "schedule",
       .field = FIELD(parallel.schedule),
       .check = Check::Choice,
       .choices = "gpipe|1f1b|interleaved",
       .help = "pipeline schedule"},
      {.section = "parallel",
       .key = "virtual_stages",
       .field = FIELD(parallel.virtual_stages),
       .bound = at_least(1),
       .help = "model chunks per pipeline rank (interleaved schedule)"},
      {.section = "parallel",
       .key = "sequence_parallel",
       .field = FIELD(parallel.sequence_parallel),
       .help = "split layer norms and dropout along the sequence across tp ranks"},
      {.section = "parallel",
       .key = "order",
       .field = FIELD(parallel.order),
       .check = Check::Order,
       .help = "rank order of the groups, fastest-varying first"},
      {.section = "parallel",
       .key = "bucket_mb",
       .field = FIELD(parallel.bucket_mb),
       .bound = above(0),
       .help = "gradient all-reduce bucket size in MiB"},
      // [train]
      {.section = "train",
       .key = "on_nan",
       .field = FIELD(train.on_nan),
       .check = Check::Choice,
       .choices = "abort|skip",
       .help = "a non-finite loss or gradient: abort the run, or skip the update and go on"},
      {.section = "train",
       .key = "max_skips",
       .field = FIELD(train.max_skips),
       .bound = at_least(0),
       .help = "with on_nan = skip: abort after this many skipped updates in a row"},
      {.section = "train",
       .key = "recompute",
       .field = FIELD(train.recompute),
       .check = Check::Choice,
       .choices = "none|full|selective",
       .help = "activation recomputation: full keeps only block inputs, selective recomputes "
               "attention"},
      {.section = "train",
       .key = "steps",
       .field = FIELD(train.steps),
       .bound = at_least(1),
       .help = "optimizer steps of the whole run"},
      {.section = "train",
       .key = "global_batch",
       .field = FIELD(train.global_batch),
       .bound = at_least(1),
       .help = "sequences per optimizer step, over all dp ranks"},
      {.section = "train",
       .key = "micro_batch",
       .field = FIELD(train.micro_batch),
       .bound = at_least(1),
       .help = "sequences per forward pass on one dp rank"},
      {.section = "train",
       .key = "lr",
       .field = FIELD(train.lr),
       .bound = above(0),
       .help = "peak learning rate"},
      {.section = "train",
       .key = "min_lr",
       .field = FIELD(train.min_lr),
       .bound = at_least(0),
       .help = "learning rate at the end of the decay; at most lr"},
      {.section = "train",
       .key = "warmup_steps",
       .field = FIELD(train.warmup_steps),
       .bound = at_least(0),
       .help = "steps of linear warm-up from 0 to lr"},
      {.section = "train",
       .key = "decay",
       .field = FIELD(train.decay),
       .check = Check::Choice,
       .choices = "cosine|linear|constant",
       .help = "learning-rate decay after warm-up"},
      {.section = "train",
       .key = "weight_decay",
       .field = FIELD(train.weight_decay),
       .bound = at_least(0),
       .help = "AdamW decoupled weight decay"},
      {.section = "train",
       .key = "beta1",
       .field = FIELD(train.beta1),
       .bound = below_one_from(0),
       .help = "AdamW first-moment decay"},
      {.section = "train",
       .key = "beta2",
       .field = FIELD(train.beta2),
       .bound = below_one_from(0),
       .help = "AdamW second-moment decay"},
      {.section = "train",
       .key = "eps",
       .field = FIELD(train.eps),
       .bound = above(0),
       .help = "AdamW epsilon"},
      {.section = "train",
       .key = "grad_clip",
       .field = FIELD(train.grad_clip),
       .bound = at_least(0),
       .help = "global gradient-norm clip; 0 turns clipping off"},
      {.section = "train",
       .key = "seed",
       .field = FIELD(train.seed),
       .help = "seed of data order and dropout"},
      // [data]
      {.section = "data",
       .key = "source",
       .field = FIELD(data.source),
       .check = Check::Choice,
       .choices = "synthetic|text|tokens",
       .help = "where training tokens come from"},
      {.section = "data",
       .key = "path",
       .field = FIELD(data.path),
       .help = "text: a file; tokens: a glob of shards (unused for synthetic)"},
      {.section = "data",
       .key = "synthetic_tokens",
       .field = FIELD(data.synthetic_tokens),
       .bound = at_least(1024),
       .help = "length of the generated synthetic corpus"},
      {.section = "data",
       .key = "synthetic_order",
       .field = FIELD(data.synthetic_order),
       .bound = at_least(1),
       .help = "context length of the synthetic Markov source"},
      {.section = "data",
       .key = "synthetic_branching",
       .field = FIELD(data.synthetic_branching),
       .bound = at_least(1),
       .help = "successors per context of the Markov source; at most vocab"},
      {.section = "data",
       .key = "synthetic_alpha",
       .field = FIELD(data.synthetic_alpha),
       .bound = above(0),
       .help = "Dirichlet concentration of the successor probabilities"},
      // [eval]
      {.section = "eval",
       .key = "every",
       .field = FIELD(eval.every),
       .bound = at_least(0),
       .help = "steps between held-out evaluations, and the last step; 0 = none"},
      {.section = "eval",
       .key = "batches",
       .field = FIELD(eval.batches),
       .bound = at_least(1),
       .help = "held-out sequences per evaluation, in global batches (train.global_batch each)"},
      {.section = "eval",
       .key = "path",
       .field = FIELD(eval.path),
       .help = "held-out data in data.source's format (text: a file; tokens: a glob); unused "
               "for synthetic, which holds out a walk of its own"},
      // [checkpoint]
      {.section = "checkpoint",
       .key = "dir",
       .field = FIELD(checkpoint.dir),
       .derived = true,
       .help = "checkpoint directory; empty = RUN_DIR/ckpt"},
      {.section = "checkpoint",
       .key = "every",
       .field = FIELD(checkpoint.every),
       .bound = at_least(0),
       .help = "steps between checkpoints; 0 = only at the end"},
      {.section = "checkpoint",
       .key = "keep",
       .field = FIELD(checkpoint.keep),
       .bound = at_least(1),
       .help = "checkpoints kept; older ones are deleted"},
      {.section = "checkpoint",
       .key = "resume",
       .field = FIELD(checkpoint.resume),
       .check = Check::NonEmpty,
       .help = "auto (latest in dir, if any) | never | a checkpoint to start from: a file, "
               "a `latest` pointer, or a checkpoint or run directory (its newest)"},
      // [run]
      {.section = "run",
       .key = "dir",
       .field = FIELD(run.dir),
       .derived = true,
       .help = "run directory (logs, effective deck); empty = runs/DECK_NAME"},
      // [log]
      {.section = "log",
       .key = "every",
       .field = FIELD(log.every),
       .bound = at_least(1),
       .help = "steps between log lines"},
      // [system]
      {.section = "system",
       .key = "backend",
       .field = FIELD(system.backend),
       .check = Check::Choice,
       .choices = "cpu|cuda",
       .help = "where tensors live"},
      {.section = "system",
       .key = "precision",
       .field = FIELD(system.precision),
       .check = Check::Choice,
       .choices = "fp32|bf16",
       .help = "bf16: activations and the weights the model reads in bf16, fp32 master weights, "
               "gradients and optimizer state (cpu: widened to fp32 per kernel, for checking)"},
      {.section = "system",
       .key = "grad_reduce",
       .field = FIELD(system.grad_reduce),
       .check = Check::Choice,
       .choices = "fp32|bf16",
       .help = "dp gradient reduction on the wire; bf16: half the bytes (fp32 sums, any backend)"},
      {.section = "system",
       .key = "threads",
       .field = FIELD(system.threads),
       .bound = at_least(0),
       .help =
           "BLAS threads per rank; 0 = the rank's cores (its share of the node's when unbound)"},
      {.section = "system",
       .key = "stop_signal",
       .field = FIELD(system.stop_signal),
       .check = Check::Choice,
       .choices = "USR1|TERM",
       .help = "the signal that asks for a checkpoint and a stop (Slurm: --signal=B:USR1@lead)"},
      {.section = "system",
       .key = "max_hours",
       .field = FIELD(system.max_hours),
       .bound = at_least(0),
       .help = "stop with a checkpoint before this much wall time (0: no limit)"},
      {.section = "system",
       .key = "hang_timeout_s",
       .field = FIELD(system.hang_timeout_s),
       .bound = at_least(0),
       .help = "end the job (status 4) when a rank makes no progress this long: a stopped "
               "rank, a collective or device kernel that never completes (0: never)"},
      {.section = "system",
       .key = "peak_gflops",
       .field = FIELD(system.peak_gflops),
       .bound = at_least(0),
       .help = "peak GFLOP/s per rank for MFU; 0 = unknown"},
      {.section = "system",
       .key = "device_comm",
       .field = FIELD(system.device_comm),
       .check = Check::Choice,
       .choices = "auto|nccl|staged",
       .help = "device buffers between ranks (cuda): NCCL, or staged through host memory and "
               "MPI; auto = nccl where built"},
  };
  return table;
}
#undef FIELD

std::vector<std::string> sections() {
  std::vector<std::string> out;
  for (const auto& e : key_table())
    if (out.empty() || out.back() != e.section) out.push_back(e.section);
  return out;
}

const KeyEntry* find_key(std::string_view name) {
  for (const auto& e : key_table())
    if (e.name() == name) return &e;
  return nullptr;
}

namespace {

// Shortest text that parses back to the same double, so the effective deck round-trips exactly.
std::string double_text(double v) {
  // to_chars' shortest form writes 3e-4 as "3e-04"; the fewest %g digits that round-trip read
  // the way people write decks ("0.0003", "1e-08").
  // A whole number as people write one: 1800, not 1.8e+03; 16777216, not 1.67772e+07.
  char buf[64];
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    double back = 0;
    std::from_chars(buf, buf + std::strlen(buf), back);
    if (back == v) break;
  }
  return buf;
}

std::string bound_number(double v) { return double_text(v); }

std::vector<std::string> split_choices(const char* choices) {
  std::vector<std::string> out;
  std::stringstream ss(choices ? choices : "");
  for (std::string s; std::getline(ss, s, '|');) out.push_back(s);
  return out;
}

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

bool in_bound(const Bound& b, double v) {
  if (b.lo_open ? !(v > b.lo) : !(v >= b.lo)) return false;
  if (b.hi_open ? !(v < b.hi) : !(v <= b.hi)) return false;
  return true;
}

// from_chars rejects a leading '+', which people do write; accept exactly one.
std::string_view strip_plus(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '-' && s[1] != '+') s.remove_prefix(1);
  return s;
}

// Integers are parsed as the widest type of their signedness, so "too large for an int" is told
// apart from "not a number" before narrowing.
template <class T>
std::string set_integer(const KeyEntry& e, T& field, std::string_view text) {
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  text = strip_plus(text);
  Wide v{};
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  bool too_big = ec == std::errc::result_out_of_range;
  if (ec == std::errc() && ptr == text.data() + text.size()) {
    if constexpr (!std::is_same_v<T, Wide>)
      too_big = v > static_cast<Wide>(std::numeric_limits<T>::max()) ||
                v < static_cast<Wide>(std::numeric_limits<T>::min());
  }
  if (too_big)
    return expectation(e) + " (at most " + std::to_string(std::numeric_limits<T>::max()) + ")";
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    return expectation(e);
  if (!in_bound(e.bound, static_cast<double>(v))) return expectation(e);
  field = static_cast<T>(v);
  return "";
}

std::string set_double(const KeyEntry& e, double& field, std::string_view text) {
  text = strip_plus(text);
  double v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // from_chars accepts "inf" and "nan"; a deck never means either.
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty() || !std::isfinite(v))
    return expectation(e);
  if (!in_bound(e.bound, v)) return expectation(e);
  field = v;
  return "";
}

std::string set_bool(const KeyEntry& e, bool& field, const std::string& text) {
  const std::string t = lower(text);
  if (t == "true" || t == "1" || t == "yes" || t == "on") {
    field = true;
  } else if (t == "false" || t == "0" || t == "no" || t == "off") {
    field = false;
  } else {
    return expectation(e);
  }
  return "";
}

bool is_order(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  for (std::string p; std::getline(ss, p, '-');) parts.push_back(p);
  if (s.empty() || s.back() == '-' || parts.size() != 3) return false;
  std::sort(parts.begin(), parts.end());
  return parts == std::vector<std::string>{"dp", "pp", "tp"};
}

std::string set_string(const KeyEntry& e, std::string& field, const std::string& text) {
  switch (e.check) {
    case Check::Choice: {
      const auto allowed = split_choices(e.choices);
      if (std::find(allowed.begin(), allowed.end(), text) == allowed.end()) return expectation(e);
      break;
    }
    case Check::Order:
      if (!is_order(text)) return expectation(e);
      break;
    case Check::NonEmpty:
      if (text.empty()) return expectation(e);
      break;
    case Check::None:
      break;
  }
  field = text;
  return "";
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string value_text(const KeyEntry& e, const Config& cfg) {
  // The accessors take a mutable Config so one pointer serves reading and writing; nothing is
  // written here.
  Config& c = const_cast<Config&>(cfg);
  return std::visit(
      [&](auto get) -> std::string {
        const auto& v = get(c);
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
        else if constexpr (std::is_same_v<T, double>) return double_text(v);
        else if constexpr (std::is_same_v<T, std::string>) return v;
        else return std::to_string(v);
      },
      e.field);
}

std::string default_text(const KeyEntry& e) {
  static const Config defaults;
  return value_text(e, defaults);
}

std::string type_name(const KeyEntry& e) {
  return std::visit(
      [&](auto get) -> std::string {
        using T = std::decay_t<decltype(get(std::declval<Config&>()))>;
        if constexpr (std::is_same_v<T, bool>) return "bool";
        else if constexpr (std::is_same_v<T, double>) return "float";
        else if constexpr (std::is_same_v<T, std::string>)
          return e.check == Check::Choice ? "choice" : "string";
        else if constexpr (std::is_same_v<T, int>) return "int";
        else if constexpr (std::is_same_v<T, int64_t>) return "int64";
        else return "uint64";
      },
      e.field);
}

std::string expectation(const KeyEntry& e) {
  const std::string type = type_name(e);
  if (type == "bool") return "true or false (also 1/0, yes/no, on/off)";
  if (type == "choice") {
    std::string s = "one of ";
    const auto allowed = split_choices(e.choices);
    for (size_t i = 0; i < allowed.size(); ++i) s += (i ? ", " : "") + allowed[i];
    return s;
  }
  if (type == "string") {
    if (e.check == Check::Order) return "a permutation of tp, dp, pp such as tp-dp-pp";
    if (e.check == Check::NonEmpty) return "a non-empty value";
    return "text";
  }
  const bool integer = type != "float";
  std::string s = integer ? "an integer" : "a number";
  const Bound& b = e.bound;
  const bool has_lo = std::isfinite(b.lo), has_hi = std::isfinite(b.hi);
  if (has_lo && has_hi) {
    if (integer && !b.lo_open && !b.hi_open)
      s += " in " + bound_number(b.lo) + ".." + bound_number(b.hi);
    else
      s += std::string(" in ") + (b.lo_open ? "(" : "[") + bound_number(b.lo) + ", " +
           bound_number(b.hi) + (b.hi_open ? ")" : "]");
  } else if (has_lo) {
    s += std::string(b.lo_open ? " > " : " ≥ ") + bound_number(b.lo);
  } else if (has_hi) {
    s += std::string(b.hi_open ? " < " : " ≤ ") + bound_number(b.hi);
  } else if (type == "uint64") {
    s += " ≥ 0";
  }
  return s;
}

std::string set_value(const KeyEntry& e, Config& cfg, const std::string& text) {
  return std::visit(
      [&](auto get) -> std::string {
        auto& field = get(cfg);
        using T = std::decay_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) return set_bool(e, field, text);
        else if constexpr (std::is_same_v<T, double>) return set_double(e, field, text);
        else if constexpr (std::is_same_v<T, std::string>) return set_string(e, field, text);
        else return set_integer(e, field, text);
      },
      e.field);
}

std::string closest_name(std::string_view name, bool sections_only) {
  std::vector<std::string> candidates;
  if (sections_only) {
    candidates = sections();
  } else {
    for (const auto& e : key_table()) candidates.push_back(e.name());
  }
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    // A key put in the wrong section ("train.init_std") or outside any ("layers") is a
    // plausible slip too: compare the key parts, at the cost of one edit for the section.
    if (!sections_only) {
      const auto key_part = [](std::string_view s) {
        const auto dot = s.find('.');
        return dot == std::string_view::npos ? s : s.substr(dot + 1);
      };
      d = std::min(d, edit_distance(key_part(name), key_part(c)) + 1);
    }
    if (d < best_d) best_d = d, best = c;
  }
  // Beyond a third of the name the "suggestion" would be noise rather than a typo fix.
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  return best_d <= limit ? best : "";
}

}  // namespace trellis::config
