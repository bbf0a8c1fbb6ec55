#include "config/config.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "config/keys.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis {

namespace po = boost::program_options;
using config::KeyEntry;
using config::key_table;

namespace {

const char* const kCommandLine = "command line";

// A raw value and where it came from, so a bad value is blamed on the deck or the command line
// (or the layout a stored deck is read under: load_config_text).
struct Source {
  std::string text;
  std::string where;
  bool overridden = false;  // set after the deck (the command line, a stored deck's layout)
};
using Sources = std::map<std::string, Source>;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw UserError(where + ": " + what);
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

/// The layer counts of parallel.stage_layers ("4,3,3"), each between 1 and `layers`; empty where
/// the list is malformed (an empty item, as a trailing comma leaves, or anything not a count).
std::vector<int> stage_layer_counts(const std::string& list, int layers) {
  std::vector<int> counts;
  size_t begin = 0;
  while (true) {
    const size_t comma = list.find(',', begin);
    const std::string item = trim(list.substr(begin, comma == std::string::npos ? std::string::npos
                                                                                : comma - begin));
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != 0 || item.find_first_not_of("0123456789") != std::string::npos ||
        v < 1 || v > layers)
      return {};
    counts.push_back(int(v));
    if (comma == std::string::npos) return counts;
    begin = comma + 1;
  }
}

// What Boost sees of a line: comments cut at '#', whitespace trimmed.
std::string significant(const std::string& line) { return trim(line.substr(0, line.find('#'))); }

// A name or value far longer than any key or sensible value (a pasted line, a file read as a
// deck) is shown cut, and no name is suggested for it: the edit distances would take seconds.
constexpr size_t kLongest = 80;

// `text` as a message shows it: whole up to kLongest bytes, else its first ones (not splitting a
// UTF-8 character), "…' (N characters" — the caller closes the parenthesis.
std::string quoted_cut(const std::string& text) {
  if (text.size() <= kLongest) return "'" + text + "'";
  size_t end = kLongest;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  size_t characters = 0;  // (UTF-8: every byte but a continuation byte starts one)
  for (const char c : text) characters += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return "'" + text.substr(0, end) + "…' (" + std::to_string(characters) + " characters";
}

std::string unknown_key_message(const std::string& raw_name) {
  if (raw_name.size() > kLongest)
    return "unknown key " + quoted_cut(raw_name) + ": no deck key is that long)";
  const std::string& name = raw_name;
  const auto dot = name.find('.');
  if (dot != std::string::npos) {
    const std::string section = name.substr(0, dot);
    const auto known = config::sections();
    if (std::find(known.begin(), known.end(), section) == known.end()) {
      const std::string best = config::closest_name(section, true);
      return "unknown section [" + section + "] in '" + name + "'" +
             (best.empty() ? "" : " (did you mean [" + best + "]?)");
    }
  }
  const std::string best = config::closest_name(name);
  return "unknown key '" + name + "'" + (best.empty() ? "" : " (did you mean '" + best + "'?)");
}

// Boost accepts any [section] without complaint and drops empty ones silently; a misspelt
// section header is worth a message with its line, before Boost reports its keys one by one.
void check_sections(const std::string& path, const std::string& text) {
  const auto known = config::sections();
  std::istringstream in(text);
  int lineno = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineno;
    const std::string s = significant(line);
    if (s.size() < 2 || s.front() != '[' || s.back() != ']') continue;
    const std::string section = s.substr(1, s.size() - 2);
    if (std::find(known.begin(), known.end(), section) != known.end()) continue;
    if (section.size() > kLongest)
      fail(path + ":" + std::to_string(lineno),
           "unknown section " + quoted_cut(section) + ": no section is that long)");
    const std::string best = config::closest_name(section, true);
    fail(path + ":" + std::to_string(lineno),
         "unknown section [" + section + "]" +
             (best.empty() ? "" : " (did you mean [" + best + "]?)"));
  }
}

// Boost's syntax errors carry the offending line's text but not its number; find it.
std::string line_of(const std::string& text, const std::string& bad) {
  std::istringstream in(text);
  int lineno = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineno;
    if (significant(line) == trim(bad)) return ":" + std::to_string(lineno);
  }
  return "";
}

// The line of each `key = value` of the deck by its full name (section.key), in order: a key
// given twice has two. Boost's parsed options carry no line numbers.
std::map<std::string, std::vector<int>> key_lines(const std::string& text) {
  std::map<std::string, std::vector<int>> lines;
  std::istringstream in(text);
  std::string section;
  int lineno = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineno;
    const std::string s = significant(line);
    if (s.size() >= 2 && s.front() == '[' && s.back() == ']') {
      section = trim(s.substr(1, s.size() - 2));
      continue;
    }
    const auto eq = s.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = trim(s.substr(0, eq));
    lines[section.empty() ? key : section + "." + key].push_back(lineno);
  }
  return lines;
}

void parse_deck_text(const std::string& path, const std::string& text, Sources& sources);

void read_deck(const std::string& path, Sources& sources) {
  if (path.empty()) fail(kCommandLine, "no deck given");
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) fail(path, "cannot read the deck: no such file");
  if (std::filesystem::is_directory(status)) fail(path, "cannot read the deck: it is a directory");
  // Every rank reads the deck, and trellis plan reads it twice: a pipe (one without a writer
  // would keep the job waiting) or a device is no deck.
  if (!std::filesystem::is_regular_file(status))
    fail(path, "cannot read the deck: not a regular file (a pipe or a device?); write the deck "
               "to a file");
  std::ifstream file(path);
  std::stringstream buf;
  buf << file.rdbuf();
  if (!file) fail(path, "cannot read the deck: permission denied or I/O error");
  parse_deck_text(path, buf.str(), sources);
}

// `path` only names the deck in messages.
void parse_deck_text(const std::string& path, const std::string& raw, Sources& sources) {
  // Some editors start a UTF-8 file with a byte-order mark: it is not part of the first line.
  const std::string text = raw.rfind("\xEF\xBB\xBF", 0) == 0 ? raw.substr(3) : raw;
  // A deck without a single key (blank, only comments or section headers) is almost surely the
  // wrong file (or a truncated one): say so rather than train a default model.
  const auto no_key = [&] {
    fail(path, "the deck is empty: give at least one [section] with a key (trellis train --help "
               "lists them)");
  };
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) no_key();
  // A NUL byte ends every C string the message passes through: say where it is instead.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    fail(path + ":" + std::to_string(1 + std::count(text.begin(), text.begin() + nul, '\n')),
         "the deck holds a NUL byte (a binary file, or one an editor saved as UTF-16?)");

  check_sections(path, text);

  po::options_description desc;
  for (const auto& e : key_table()) desc.add_options()(e.name().c_str(), po::value<std::string>());
  po::parsed_options parsed(&desc);
  try {
    std::istringstream in(text);
    // Unregistered keys are let through and reported here, with a suggestion Boost cannot make.
    parsed = po::parse_config_file(in, desc, /*allow_unregistered=*/true);
  } catch (const po::invalid_config_file_syntax& e) {
    // Not e.what(): Boost 1.74 builds it by replacing "%invalid_line%" with the line until none is
    // left, which never ends when the line itself contains that text (found by fuzzing).
    fail(path + line_of(text, e.tokens()),
         "syntax error: the deck contains an invalid line '" + e.tokens() +
             "' (expected `key = value`, a [section] or a # comment)");
  } catch (const po::error_with_option_name& e) {
    // the same substitution of the option's name and value: the name only
    fail(path, "syntax error at key '" + e.get_option_name() + "'");
  } catch (const po::error& e) {
    fail(path, std::string("syntax error: ") + e.what());
  }

  if (parsed.options.empty()) no_key();

  // Each key's place in messages: the deck and its line (the second where it is given twice).
  const std::map<std::string, std::vector<int>> lines = key_lines(text);
  const auto at = [&](const std::string& key, size_t nth) {
    const auto it = lines.find(key);
    return it == lines.end() || it->second.size() <= nth
               ? path
               : path + ":" + std::to_string(it->second[nth]);
  };
  for (const auto& opt : parsed.options) {
    if (opt.unregistered) fail(at(opt.string_key, 0), unknown_key_message(opt.string_key));
    if (sources.count(opt.string_key))
      fail(at(opt.string_key, 1), "key '" + opt.string_key + "' is given more than once");
    sources[opt.string_key] = {opt.value.empty() ? "" : opt.value.front(), at(opt.string_key, 0)};
  }
}

// Sets key e of cfg from its source's text; a bad value → UserError naming where it was given.
void set_from(const config::KeyEntry& e, Config& cfg, const Source& source) {
  const std::string expected = config::set_value(e, cfg, source.text);
  if (!expected.empty())
    fail(source.where,
         "bad value " + quoted_cut(source.text) + (source.text.size() > kLongest ? ")" : "") +
             " for " + e.name() + ": expected " + expected);
}

void apply_overrides(const std::vector<std::string>& overrides, Sources& sources,
                     const std::string& where = kCommandLine) {
  for (const auto& raw : overrides) {
    std::string s = raw;
    if (s.rfind("--", 0) == 0) s = s.substr(2);
    const auto eq = s.find('=');
    const std::string name = eq == std::string::npos ? "" : trim(s.substr(0, eq));
    if (name.empty())
      fail(where, "malformed override '" + raw + "': expected --section.key=value");
    const config::KeyEntry* key = config::find_key(name);
    if (!key) fail(where, unknown_key_message(name));
    // A bad value in the deck is one even where the command line overrides it: the deck is
    // wrong for the next run that does not.
    if (const auto given = sources.find(name);
        given != sources.end() && !given->second.overridden) {
      Config scratch;
      set_from(*key, scratch, given->second);
    }
    // The effective deck is stored (run.dir/deck.ini, every checkpoint) and read back by each
    // resume, eval, generate and export: a value must read back as given. In a deck a '#' starts a
    // comment, a line break ends the value, and the edges' blanks are trimmed.
    const std::string value = trim(s.substr(eq + 1));
    if (value.find_first_of("#\r\n") != std::string::npos)
      fail(kCommandLine, "--" + name + ": its value holds " +
                             (value.find('#') != std::string::npos ? "a '#'" : "a line break") +
                             ", which the deck each run stores (deck.ini, every checkpoint) cannot "
                             "hold: resumes and trellis eval would read it cut short (rename the "
                             "file or directory, or reach it through a symbolic link)");
    sources[name] = {value, where, true};  // a later override wins over an earlier
  }
}

// Cross-key checks and derived values. A message names every key involved and is blamed on the
// command line when one of those keys came from there.
class Validator {
 public:
  Validator(Config& cfg, const Sources& sources, int world_size)
      : c_(cfg), sources_(sources), world_(world_size) {}

  void run() {
    model();
    layout();
    training();
    data_and_system();
  }

 private:
  std::string where(std::initializer_list<const char*> keys) const {
    for (const char* k : keys) {
      const auto it = sources_.find(k);
      if (it != sources_.end() && it->second.where == kCommandLine) return kCommandLine;
    }
    for (const char* k : keys)  // (a stored deck's layout, load_config_text's)
      if (const auto it = sources_.find(k); it != sources_.end() && it->second.overridden)
        return it->second.where;
    return c_.deck_path;
  }
  static std::string n(int64_t v) { return std::to_string(v); }

  void model() {
    auto& m = c_.model;
    if (m.kv_heads == 0) m.kv_heads = m.heads, c_.derived.push_back("model.kv_heads");
    if (m.d_ff == 0) {
      if (int64_t{4} * m.d_model > std::numeric_limits<int>::max())
        fail(where({"model.d_model"}), "model.d_ff = 4 * model.d_model = " +
                                           n(int64_t{4} * m.d_model) +
                                           " is too large; set model.d_ff explicitly");
      m.d_ff = 4 * m.d_model, c_.derived.push_back("model.d_ff");
    }
    if (m.d_model % m.heads != 0)
      fail(where({"model.d_model", "model.heads"}),
           "model.d_model = " + n(m.d_model) + " is not divisible by model.heads = " +
               n(m.heads) + ": choose d_model a multiple of heads");
    if (m.heads % m.kv_heads != 0)
      fail(where({"model.heads", "model.kv_heads"}),
           "model.heads = " + n(m.heads) + " is not divisible by model.kv_heads = " +
               n(m.kv_heads) + ": kv_heads must divide heads (0 means kv_heads = heads)");
    // The parameter count, in floating point: each size is an int, their products past int64
    // would wrap round into negative sizes and plans.
    const double C = m.d_model, kv = double(m.kv_heads) * m.d_model / m.heads;
    const double params = double(m.layers) * (C * (C + 2 * kv) + C * C + 2 * C * m.d_ff) +
                          (double(m.vocab) + m.seq_len) * C;
    if (params > 0x1p50)
      fail(where({"model.layers", "model.d_model", "model.d_ff", "model.vocab"}),
           strfmt("model.layers, model.d_model, model.d_ff and model.vocab make about %.2g "
                  "parameters, more than Trellis counts (2^50 = %.2g; GPT-3 has 1.75e11)",
                  params, 0x1p50));
  }

  void layout() {
    auto& p = c_.parallel;
    const int64_t tp_pp = int64_t{p.tp} * p.pp;
    if (world_ == 0) world_ = (p.dp > 0 ? p.dp : 1) * tp_pp;  // the deck's own layout (plan)
    if (p.dp == 0) {
      if (world_ % tp_pp != 0)
        fail(where({"parallel.tp", "parallel.pp"}),
             "parallel.tp*pp = " + n(tp_pp) + " does not divide the world size " + n(world_) +
                 ": choose parallel.tp and parallel.pp whose product divides " + n(world_));
      p.dp = static_cast<int>(world_ / tp_pp), c_.derived.push_back("parallel.dp");
    }
    const int64_t ranks = p.dp * tp_pp;
    if (ranks != world_)
      fail(where({"parallel.dp", "parallel.tp", "parallel.pp"}),
           "parallel.dp*tp*pp = " + n(ranks) + " but " + n(world_) +
               " ranks were started: start " + n(ranks) +
               " ranks or change parallel.dp/tp/pp (dp = 0 derives dp from the world size)");
    const auto& m = c_.model;
    if (m.heads % p.tp != 0)
      fail(where({"model.heads", "parallel.tp"}),
           "model.heads = " + n(m.heads) + " is not divisible by parallel.tp = " + n(p.tp) +
               ": tensor parallelism splits the heads evenly over tp ranks");
    if (m.kv_heads % p.tp != 0 && p.tp % m.kv_heads != 0)
      fail(where({"model.kv_heads", "parallel.tp"}),
           "model.kv_heads = " + n(m.kv_heads) + " and parallel.tp = " + n(p.tp) +
               ": one must divide the other so kv heads can be split or replicated over tp");
    if (m.d_ff % p.tp != 0)
      fail(where({"model.d_ff", "parallel.tp"}),
           "model.d_ff = " + n(m.d_ff) + " is not divisible by parallel.tp = " + n(p.tp) +
               ": the MLP's columns split evenly over tp ranks");
    if (!p.stage_layers.empty()) {
      const std::vector<int> counts = stage_layer_counts(p.stage_layers, m.layers);
      if (counts.empty())
        fail(where({"parallel.stage_layers"}),
             "parallel.stage_layers = '" + p.stage_layers +
                 "': expected a comma-separated list of layer counts, each at least 1");
      const int sum = std::accumulate(counts.begin(), counts.end(), 0);
      if (int(counts.size()) != p.pp || sum != m.layers)
        fail(where({"parallel.stage_layers", "parallel.pp", "model.layers"}),
             "parallel.stage_layers = '" + p.stage_layers + "' must list parallel.pp = " + n(p.pp) +
                 " counts adding up to model.layers = " + n(m.layers));
    }
    if (p.pp > m.layers)
      fail(where({"parallel.pp", "model.layers"}),
           "parallel.pp = " + n(p.pp) + " exceeds model.layers = " + n(m.layers) +
               ": every pipeline stage needs at least one layer");
    if (p.schedule == "interleaved") {
      if (p.virtual_stages < 2)
        fail(where({"parallel.schedule", "parallel.virtual_stages"}),
             "parallel.schedule = interleaved needs parallel.virtual_stages > 1 "
             "(or use schedule = 1f1b)");
      if (p.pp < 2)
        fail(where({"parallel.schedule", "parallel.pp"}),
             "parallel.schedule = interleaved needs parallel.pp > 1: one stage has no pipeline to "
             "interleave (use schedule = 1f1b)");
      const int64_t chunks = int64_t{p.pp} * p.virtual_stages;
      if (m.layers % chunks != 0)
        fail(where({"model.layers", "parallel.pp", "parallel.virtual_stages"}),
             "model.layers = " + n(m.layers) +
                 " is not divisible by parallel.pp * parallel.virtual_stages = " + n(chunks) +
                 ": the interleaved schedule needs equal model chunks");
      if (!p.stage_layers.empty())
        fail(where({"parallel.stage_layers", "parallel.schedule"}),
             "parallel.stage_layers cannot be combined with schedule = interleaved, whose chunks "
             "are equal");
      const int64_t dp = p.dp > 0 ? p.dp : 1;
      const int64_t micro = c_.train.global_batch / std::max<int64_t>(1, dp * c_.train.micro_batch);
      if (p.pp > 1 && micro % p.pp != 0)
        fail(where({"parallel.schedule", "train.global_batch", "train.micro_batch", "parallel.pp"}),
             "parallel.schedule = interleaved needs the micro-batches per step (" + n(micro) +
                 " = global_batch / (dp * micro_batch)) to be a multiple of parallel.pp = " +
                 n(p.pp));
    } else if (p.virtual_stages != 1) {
      // Silently ignoring it would let someone believe they run an interleaved pipeline.
      fail(where({"parallel.schedule", "parallel.virtual_stages"}),
           "parallel.virtual_stages = " + n(p.virtual_stages) +
               " only applies to parallel.schedule = interleaved (schedule is " + p.schedule +
               ")");
    }
    if (p.sequence_parallel && m.seq_len % p.tp != 0)
      fail(where({"parallel.sequence_parallel", "model.seq_len", "parallel.tp"}),
           "parallel.sequence_parallel needs model.seq_len = " + n(m.seq_len) +
               " divisible by parallel.tp = " + n(p.tp));
  }

  void training() {
    const auto& t = c_.train;
    // A micro-batch's tokens index the activations as 32-bit counts (B·T rows of every tensor),
    // and so do the held-out set's sequences.
    constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
    if (int64_t{t.micro_batch} * c_.model.seq_len > kMaxCount)
      fail(where({"train.micro_batch", "model.seq_len"}),
           "train.micro_batch * model.seq_len = " + n(int64_t{t.micro_batch} * c_.model.seq_len) +
               " tokens exceeds " + n(kMaxCount) + ": use a smaller micro_batch");
    if (c_.eval.every > 0 && int64_t{c_.eval.batches} * t.global_batch > kMaxCount)
      fail(where({"eval.batches", "train.global_batch"}),
           "eval.batches * train.global_batch = " + n(int64_t{c_.eval.batches} * t.global_batch) +
               " held-out sequences exceeds " + n(kMaxCount) + ": use fewer eval.batches");
    const int64_t per_step = int64_t{c_.parallel.dp} * t.micro_batch;
    if (t.global_batch % per_step != 0) {
      std::string fix = "use a global_batch that is a multiple of " + n(per_step);
      if (t.global_batch % c_.parallel.dp == 0) {  // (a smaller micro-batch fits as well)
        const int64_t each = t.global_batch / c_.parallel.dp;  // sequences a dp rank takes a step
        int64_t micro = std::min<int64_t>(t.micro_batch, each);
        while (each % micro != 0) --micro;
        fix += ", or train.micro_batch = " + n(micro) +
               " (the largest that divides global_batch / parallel.dp = " + n(each) + ")";
      }
      fail(where({"train.global_batch", "train.micro_batch", "parallel.dp"}),
           "train.global_batch = " + n(t.global_batch) +
               " is not divisible by parallel.dp * train.micro_batch = " + n(per_step) + ": " +
               fix);
    }
    if (t.min_lr > t.lr)
      fail(where({"train.min_lr", "train.lr"}),
           "train.min_lr = " + config::value_text(*config::find_key("train.min_lr"), c_) +
               " exceeds train.lr = " + config::value_text(*config::find_key("train.lr"), c_) +
               ": min_lr must be at most lr");
  }

  void data_and_system() {
    const auto& d = c_.data;
    if (d.source != "synthetic" && trim(d.path).empty())
      fail(where({"data.source", "data.path"}),
           "data.source = " + d.source + " needs data.path (" +
               (d.source == "text" ? "a text file" : "a glob of token shards") + ")");
    if (d.source == "synthetic" && d.synthetic_branching > c_.model.vocab)
      fail(where({"data.synthetic_branching", "model.vocab"}),
           "data.synthetic_branching = " + n(d.synthetic_branching) +
               " exceeds model.vocab = " + n(c_.model.vocab) +
               ": a context cannot have more successors than there are tokens");
    const auto& e = c_.eval;
    if (e.every > 0 && d.source != "synthetic" && trim(e.path).empty())
      fail(where({"eval.every", "eval.path", "data.source"}),
           "eval.every = " + n(e.every) + " with data.source = " + d.source +
               " needs held-out data in eval.path (" +
               (d.source == "text" ? "a text file" : "a glob of token shards") +
               " the run does not train on)");
    if (d.source != "synthetic" && !trim(e.path).empty() && trim(e.path) == trim(d.path)) {
      const std::string what = "eval.path is data.path ('" + e.path + "')";
      fail(where({"eval.path", "data.path"}),
           what + ": the held-out loss would be measured on the training data");
    }
    // A timeout under a second ends every run in its set-up (a unit mistaken: milliseconds?).
    const double hang = c_.system.hang_timeout_s;
    if (hang > 0 && hang < 1)
      fail(where({"system.hang_timeout_s"}),
           strfmt("system.hang_timeout_s = %g: under a second, no run would get through its "
                  "set-up; it is in seconds (0: never)",
                  hang));
    // Each run writes its effective deck to run.dir/deck.ini (and a start over moves the earlier
    // one aside): the deck given must not be that file, or the user's own would be lost.
    std::error_code ec;
    if (!c_.deck_path.empty() &&
        std::filesystem::equivalent(c_.deck_path, std::filesystem::path(c_.run.dir) / "deck.ini",
                                    ec))
      fail(where({"run.dir"}), "run.dir = '" + c_.run.dir + "' would overwrite the deck " +
                                   c_.deck_path +
                                   " with the effective deck each run writes there as deck.ini: "
                                   "copy the deck elsewhere, or give another run.dir");
    // system.precision = bf16 runs on any backend (the CPU widens bf16 to fp32 in each kernel).
    // system.grad_reduce = bf16 is a communication choice (comm.hpp, "The bf16 wire"): any
    // backend, any precision.
  }

  Config& c_;
  const Sources& sources_;
  int64_t world_;
};

}  // namespace

void check_supported_backend(const Config& cfg) {
  if (cfg.system.backend != "cuda") return;
#ifndef TRELLIS_HAVE_CUDA
  fail(cfg.deck_path, "system.backend=cuda: this build has no CUDA backend (nvcc was not found "
                      "when it was built)");
#else
  // Any layout: device buffers cross ranks through NCCL or staged through MPI (lib/comm/).
#ifndef TRELLIS_HAVE_NCCL
  if (cfg.system.device_comm == "nccl")
    fail(cfg.deck_path, "system.device_comm = nccl: this build has no NCCL (it was not found when "
                        "it was built; use auto or staged)");
#endif
#endif
}

bool deck_sets_key(const std::string& deck_text, const std::string& name) {
  return key_lines(deck_text).count(name) > 0;
}

StageLayers stage_layers(const ModelConfig& m, const ParallelConfig& p, int stage) {
  std::vector<int> counts;
  if (!p.stage_layers.empty()) {
    counts = stage_layer_counts(p.stage_layers, m.layers);  // validated: pp counts
  } else {
    for (int s = 0; s < p.pp; ++s) counts.push_back(m.layers / p.pp + (s < m.layers % p.pp ? 1 : 0));
  }
  TRELLIS_CHECK(int(counts.size()) == p.pp && stage >= 0 && stage < p.pp,
                "parallel.stage_layers = '%s' for pp %d, stage %d: not a validated deck",
                p.stage_layers.c_str(), p.pp, stage);
  StageLayers r{0, 0};
  for (int s = 0; s <= stage; ++s) {
    r.first = r.end;
    r.end += counts[s];
  }
  return r;
}

namespace {
Config config_from_sources(const std::string& deck_path, Sources& sources,
                           const std::vector<std::string>& overrides, int world_size,
                           bool require_built_backend);
}

Config load_config(const std::string& deck_path, const std::vector<std::string>& overrides,
                   int world_size, bool require_built_backend) {
  TRELLIS_CHECK(world_size >= 0, "world size %d", world_size);
  Sources sources;
  read_deck(deck_path, sources);
  return config_from_sources(deck_path, sources, overrides, world_size, require_built_backend);
}

void check_not_the_deck(const std::string& path, const std::string& deck_path,
                        const std::string& option, const std::string& what) {
  // equivalent: the same file by any name (./deck, a link); false where either is missing.
  if (std::error_code ec; std::filesystem::equivalent(path, deck_path, ec))
    throw UserError(option + " " + path + ": the deck given; name another file for " + what);
}

Config load_config_text(const std::string& deck_text, const std::string& deck_name,
                        const std::vector<std::string>& overrides, int world_size,
                        const std::vector<std::string>& layout, const std::string& layout_where) {
  TRELLIS_CHECK(world_size >= 1, "world size %d", world_size);
  Sources sources;
  parse_deck_text(deck_name, deck_text, sources);
  apply_overrides(layout, sources, layout_where);
  return config_from_sources(deck_name, sources, overrides, world_size, true);
}

namespace {
Config config_from_sources(const std::string& deck_path, Sources& sources,
                           const std::vector<std::string>& overrides, int world_size,
                           bool require_built_backend) {
  apply_overrides(overrides, sources);

  Config cfg;
  cfg.deck_path = deck_path;
  for (const auto& e : key_table()) {
    const auto it = sources.find(e.name());
    if (it != sources.end()) set_from(e, cfg, it->second);
  }

  if (cfg.run.dir.empty()) {
    cfg.run.dir = "runs/" + std::filesystem::path(deck_path).stem().string();
    cfg.derived.push_back("run.dir");
  }
  if (cfg.checkpoint.dir.empty()) {
    cfg.checkpoint.dir = (std::filesystem::path(cfg.run.dir) / "ckpt").string();
    cfg.derived.push_back("checkpoint.dir");
  }
  Validator(cfg, sources, world_size).run();
  if (require_built_backend) check_supported_backend(cfg);

  cfg.effective = effective_values(cfg);
  return cfg;
}
}  // namespace

}  // namespace trellis
