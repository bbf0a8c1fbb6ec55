#include "infer/generate.hpp"

#include <boost/program_options.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

#include "backend/backend.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/stored_config.hpp"
#include "config/config.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"

namespace po = boost::program_options;

namespace trellis {

namespace {

const char* kGenerateUsage =
    R"(usage: mpirun -np TP trellis generate CKPT (--prompt TEXT | --prompt-ids IDS) [options]

  CKPT                 a checkpoint file, a `latest` pointer, or a checkpoint/run directory
                       (its newest checkpoint)
  --prompt TEXT        the prompt as text: byte-level models (trained with data.source = text)
  --prompt-ids IDS     the prompt as token ids, e.g. 50256,318 (any model; token-id models have no
                       tokenizer in Trellis, so their output is printed as ids too)
  --tokens N           tokens to generate (default 64, or what the context leaves after the
                       prompt); prompt + N must fit in model.seq_len
  --temperature T      0 = greedy; otherwise sample from softmax(logits / T) (default 1)
  --top-k K            sample among the K most likely tokens only (default 0: all)
  --seed S             the sampler's seed (default 1234): the same seed gives the same text
  --blas-threads N     BLAS threads per rank (default: the deck's system.threads; 0 = all)
  --logits-out FILE    write the logits after every token fed to the model: float32,
                       little-endian, (rows, vocab): one row per prompt token, then one per
                       generated token but the last (--tokens 0: the prompt's rows)

The np ranks split the model tensor-parallel (np must divide model.heads and model.d_ff, and
model.kv_heads or be divided by it); any layout's checkpoint loads. Generation stops at the
model's context: the learned position embeddings have model.seq_len rows, so --tokens larger than
what is left after the prompt is an error (exit 2), not a sliding window.
)";

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt, prompt_ids;
  bool has_prompt = false, has_prompt_ids = false;
  int tokens = 64;  // unless given: at most what the context leaves after the prompt
  bool has_tokens = false;
  SamplingOptions sampling;
  std::string logits_out;
  int threads = -1;  // BLAS threads per rank; -1: the checkpoint deck's system.threads
  bool help = false;
};

GenerateOptions parse_options(const std::vector<std::string>& args) {
  GenerateOptions o;
  po::options_description desc;
  std::string seed;  // (read as text: Boost would wrap "-1" round to 2^64 - 1)
  // clang-format off
  desc.add_options()
      ("checkpoint", po::value<std::string>(&o.checkpoint))
      ("prompt", po::value<std::string>(&o.prompt))
      ("prompt-ids", po::value<std::string>(&o.prompt_ids))
      ("tokens", po::value<int>(&o.tokens))
      ("temperature", po::value<double>(&o.sampling.temperature))
      ("top-k", po::value<int>(&o.sampling.top_k))
      ("seed", po::value<std::string>(&seed))
      ("logits-out", po::value<std::string>(&o.logits_out))
      ("blas-threads", po::value<int>(&o.threads))
      ("help,h", po::bool_switch(&o.help));
  // clang-format on
  po::positional_options_description positional;
  positional.add("checkpoint", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(desc).positional(positional).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UserError(std::string(e.what()) + " (trellis generate --help)");
  }
  if (o.help) return o;
  o.has_prompt = vm.count("prompt") > 0;
  o.has_prompt_ids = vm.count("prompt-ids") > 0;
  o.has_tokens = vm.count("tokens") > 0;
  if (o.checkpoint.empty()) throw UserError("which checkpoint? (trellis generate --help)");
  if (o.has_prompt == o.has_prompt_ids)
    throw UserError("give exactly one of --prompt and --prompt-ids");
  if (o.tokens < 0) throw UserError("--tokens " + std::to_string(o.tokens) + ": expected ≥ 0");
  if (vm.count("logits-out") && o.logits_out.empty())
    throw UserError("--logits-out: an empty path; give the file to write");
  if (!std::isfinite(o.sampling.temperature) || o.sampling.temperature < 0)
    throw UserError(strfmt("--temperature %g: expected a number ≥ 0 (0 = greedy)", o.sampling.temperature));
  if (vm.count("blas-threads") && o.threads < 0)
    throw UserError("--blas-threads " + std::to_string(o.threads) + ": expected ≥ 0 (0 = all cores)");
  if (o.sampling.top_k < 0)
    throw UserError("--top-k " + std::to_string(o.sampling.top_k) + ": expected ≥ 0 (0 = all)");
  if (vm.count("seed")) {
    size_t used = 0;
    try {
      if (!seed.empty() && std::isdigit(static_cast<unsigned char>(seed[0])))
        o.sampling.seed = std::stoull(seed, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != seed.size())
      throw UserError("--seed " + seed + ": expected an integer in [0, 2^64)");
  }
  return o;
}

/// The prompt's token ids, checked against the model.
std::vector<int32_t> prompt_tokens(GenerateOptions& o, const Config& cfg) {
  std::vector<int32_t> ids;
  if (o.has_prompt) {
    if (cfg.data.source != "text")
      throw UserError("--prompt: the checkpoint's model was trained on data.source = " +
                      cfg.data.source + ", not bytes of text; give its token ids with --prompt-ids");
    for (unsigned char c : o.prompt) ids.push_back(c);
    if (ids.empty()) throw UserError("--prompt: empty; give at least one character");
    // (A text model's vocab holds every byte, which training checks; a checkpoint whose stored
    // deck says otherwise would have each byte past it embedded as zeros, silently.)
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] >= cfg.model.vocab)
        throw UserError(strfmt("--prompt: byte %zu is %d, not a token id of the model's vocabulary "
                               "[0, %d) (model.vocab of the checkpoint's deck)",
                               i, ids[i], cfg.model.vocab));
  } else {
    // getline drops a last empty item: "3,1," would pass as "3,1", though ",3" and "3,,1" do not.
    if (!o.prompt_ids.empty() && o.prompt_ids.back() == ',')
      throw UserError("--prompt-ids: '" + o.prompt_ids + "' ends in a comma: a missing id?");
    std::stringstream list(o.prompt_ids);
    for (std::string item; std::getline(list, item, ',');) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || item.find_first_not_of(" \t", used) != std::string::npos || v < 0 ||
          v >= cfg.model.vocab)
        throw UserError("--prompt-ids: '" + item + "' is not a token id in [0, " +
                        std::to_string(cfg.model.vocab) + ") (model.vocab)");
      ids.push_back(int32_t(v));
    }
    if (ids.empty()) throw UserError("--prompt-ids: empty; give at least one id, e.g. 50256");
  }
  const int T = cfg.model.seq_len, P = int(ids.size());
  if (P > T)
    throw UserError(strfmt("%s: %d tokens, longer than the model's context model.seq_len = %d",
                           o.has_prompt ? "--prompt" : "--prompt-ids", P, T));
  if (!o.has_tokens) o.tokens = std::min(o.tokens, T - P);
  if (int64_t(P) + o.tokens > T)
    throw UserError(strfmt("--tokens %d: the prompt's %d tokens + %d exceed the model's context "
                           "model.seq_len = %d; at most --tokens %d",
                           o.tokens, P, o.tokens, T, T - P));
  return ids;
}

/// The checkpoint's model for tp = world size ranks (pp = dp = 1).
Config checkpoint_config(const std::string& path, int tp) {
  Config cfg = stored_config(path);
  const ModelConfig& m = cfg.model;
  const std::string np = "-np " + std::to_string(tp) + " (tensor-parallel ranks)";
  if (m.heads % tp != 0)
    throw UserError(strfmt("%s does not divide model.heads = %d", np.c_str(), m.heads));
  if (m.kv_heads % tp != 0 && tp % m.kv_heads != 0)
    throw UserError(strfmt("%s and model.kv_heads = %d: one must divide the other", np.c_str(),
                           m.kv_heads));
  if (m.d_ff % tp != 0)
    throw UserError(strfmt("%s does not divide model.d_ff = %d", np.c_str(), m.d_ff));
  return cfg;
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

/// Length of the well-formed UTF-8 sequence starting at t[i] (multi-byte only), or 0.
size_t utf8_length(const std::vector<int32_t>& t, size_t i) {
  const int b = t[i];
  size_t n = b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
  if (n == 0 || i + n > t.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if (t[i + k] < 0x80 || t[i + k] > 0xBF) return 0;
  // Overlong three- and four-byte forms, surrogates and code points past U+10FFFF.
  if ((b == 0xE0 && t[i + 1] < 0xA0) || (b == 0xED && t[i + 1] > 0x9F) ||
      (b == 0xF0 && t[i + 1] < 0x90) || (b == 0xF4 && t[i + 1] > 0x8F))
    return 0;
  return n;
}

}  // namespace

const char* generate_usage() { return kGenerateUsage; }

std::string bytes_as_text(const std::vector<int32_t>& t) {
  std::string s;
  for (size_t i = 0; i < t.size();) {
    const int b = t[i];
    if (b == '\\') {
      s += "\\\\";
    } else if ((b >= 0x20 && b < 0x7F) || b == '\n' || b == '\t') {
      s += char(b);
    } else if (const size_t n = b >= 0x80 && b <= 0xFF ? utf8_length(t, i) : 0; n > 0) {
      for (size_t k = 0; k < n; ++k) s += char(t[i + k]);
      i += n;
      continue;
    } else if (b >= 0 && b <= 0xFF) {
      s += strfmt("\\x%02x", unsigned(b));
    } else {  // not a byte (a text model with model.vocab > 256 may sample one): the id
      s += strfmt("\\id{%d}", b);
    }
    ++i;
  }
  return s;
}

void load_model_parameters(MPI_Comm comm, const std::string& path, const ParamTable& table,
                           float* params) {
  std::vector<CkptSlab> slabs;
  for (const ParamInfo& p : table.params()) {
    CkptSlab s;
    s.name = "model/" + p.name;
    s.global_shape = p.shape;
    s.rows = p.rows;
    s.col_begin = p.col_begin;
    s.col_end = p.col_end;
    s.data = params + p.offset;
    slabs.push_back(std::move(s));
  }
  CkptMeta meta;
  read_checkpoint(comm, path, slabs, meta);
  // Counters no run writes: a damaged or edited file, refused as eval and export refuse it.
  if (const std::string problem = counter_problem(meta); !problem.empty())
    throw UserError(path + ": " + problem + " (damaged or edited)");
}

Generation generate(Decoder& decoder, Comm* tp, const std::vector<int32_t>& prompt, int count,
                    TokenSampler& sampler, bool keep_logits) {
  const int P = int(prompt.size()), V = decoder.vocab();
  TRELLIS_CHECK(P >= 1 && count >= 0 && P + count <= decoder.context(),
                "prompt %d + %d tokens, context %d", P, count, decoder.context());
  Generation g;
  const bool root = !tp || tp->rank() == 0;
  auto keep = [&](const float* logits, int rows) {
    if (keep_logits) g.logits.insert(g.logits.end(), logits, logits + int64_t(rows) * V);
  };
  // Rank 0 draws; the others take its token, so every rank feeds the same sequence. Logits that
  // are not finite (weights that are not: a foreign or hand-made checkpoint) have no
  // distribution to draw from: -1 tells every rank to stop with the same error.
  auto next = [&](const float* logits_row) {
    int32_t token = 0;
    if (root)
      token = std::all_of(logits_row, logits_row + V, [](float x) { return std::isfinite(x); })
                  ? sampler.sample(logits_row, V)
                  : -1;
    if (tp && tp->size() > 1) tp->broadcast(&token, sizeof token, 0);
    if (token < 0)
      throw UserError(
          "the model's logits are not finite (NaN or Inf): so are some of the "
          "checkpoint's weights (trellis inspect CKPT counts them)");
    return token;
  };

  decoder.reset();
  if (tp) tp->barrier();
  const double t0 = now_seconds();
  const float* logits = decoder.forward(prompt.data(), P, keep_logits);
  keep(logits, keep_logits ? P : 0);
  if (count == 0) {
    g.first_token_s = now_seconds() - t0;
    return g;
  }
  g.tokens.push_back(next(logits + (keep_logits ? int64_t(P - 1) * V : 0)));
  const double t1 = now_seconds();
  g.first_token_s = t1 - t0;
  while (int(g.tokens.size()) < count) {
    fault_step_delay();  // (tests: a generation that lasts; counted in its time)
    logits = decoder.forward(&g.tokens.back(), 1);
    keep(logits, 1);
    g.tokens.push_back(next(logits));
  }
  g.decode_s = now_seconds() - t1;
  return g;
}

int generate_main(const std::vector<std::string>& args, World& world) {
  const int tp_size = world.size(), rank = world.rank();
  // Phase 1: everything bad input can break; the ranks agree before any collective work.
  GenerateOptions opt;
  Config cfg;
  std::vector<int32_t> prompt;
  std::unique_ptr<Backend> backend;
  std::string error;
  std::optional<ChosenCheckpoint> chosen;  // (a directory's newest may be removed meanwhile)
  try {
    // (Every rank has the same arguments: app/trellis.cpp compared them.)
    opt = parse_options(args);
    if (!opt.help) {
      // (One file for all ranks; a new choice said on stderr: stdout is the text.)
      chosen.emplace(opt.checkpoint, world.comm(), "trellis generate",
                     ChosenCheckpoint::Say::on_stderr);
      chosen->fault_point("setup");
      for (;;) {
        std::string read_error;
        try {
          cfg = checkpoint_config(chosen->path(), tp_size);
        } catch (const UserError& e) {
          read_error = e.what();
        }
        if (chosen->choose_again(read_error)) continue;
        if (!read_error.empty()) throw UserError(read_error);
        break;
      }
      opt.checkpoint = chosen->path();
      prompt = prompt_tokens(opt, cfg);
      if (!opt.logits_out.empty() && rank == 0) {
        // (A FIFO would block rank 0 in the open while the others wait for it.)
        refuse_blocking_file(opt.logits_out, "--logits-out ", "name a file to write");
        std::ofstream probe(opt.logits_out, std::ios::binary);
        if (!probe) throw UserError("--logits-out " + opt.logits_out + ": cannot write this file");
      }
      // The decoder keeps its cache and activations in host memory: it decodes on the CPU
      // backend whatever backend trained the model (checkpoints are backend-free).
      backend = make_backend("cpu");
      backend->set_threads(opt.threads >= 0 ? opt.threads : cfg.system.threads);
    }
  } catch (const UserError& e) {
    error = e.what();
  }
  if (!error.empty() && chosen) error = chosen->explained(error);
  if (failed_together(world.comm(), error, "trellis generate")) return kExitBadInput;
  if (opt.help) {
    if (rank == 0) std::fputs(kGenerateUsage, stdout);
    return kExitOk;
  }

  // The model: this rank's tensor-parallel part, read from the checkpoint (collective; a damaged
  // file is the same UserError on every rank).
  Comm tp(world.comm(), "tp");
  const ParamTable table(cfg.model, tp_size, rank);
  Buffer params(MemKind::Params, size_t(table.total()) * sizeof(float));
  const double load_t0 = now_seconds();
  chosen->fault_point("load");
  try {
    for (;;) {
      try {
        load_model_parameters(world.comm(), chosen->path(), table, params.f32());
        break;
      } catch (const UserError& e) {
        if (chosen->choose_again(e.what())) continue;  // (the run's: the same model)
        throw UserError(chosen->explained(e.what()));
      }
    }
  } catch (const UserError& e) {  // (every rank's: a new choice that fails fails on all)
    if (rank == 0) log_error("trellis generate: error: " + std::string(e.what()));
    return kExitBadInput;
  }
  opt.checkpoint = chosen->path();
  const double load_s = now_seconds() - load_t0;

  try {
    Decoder decoder(cfg.model, table, params.f32(), *backend, &tp);
    TokenSampler sampler(opt.sampling);
    const bool dump = !opt.logits_out.empty();
    Generation g = generate(decoder, &tp, prompt, opt.tokens, sampler, dump);
    if (rank != 0) return kExitOk;

    const bool bytes = cfg.data.source == "text";
    if (bytes) {
      // The prompt, then what the model made of it, as one text.
      std::printf("%s%s\n", bytes_as_text(prompt).c_str(), bytes_as_text(g.tokens).c_str());
    } else {
      std::printf("prompt ids:    %s\ngenerated ids: %s\n", ids_text(prompt).c_str(),
                  ids_text(g.tokens).c_str());
    }
    if (dump) {
      // (stdio, not a stream: a full disk shows at the close, and errno says why)
      int failed = 0;  // errno of the first failure
      if (std::FILE* out = std::fopen(opt.logits_out.c_str(), "wb"); !out) {
        failed = errno;
      } else {
        const size_t n = g.logits.size();
        errno = 0;
        if (std::fwrite(g.logits.data(), sizeof(float), n, out) != n) failed = errno ? errno : EIO;
        if (std::fclose(out) != 0 && !failed) failed = errno;
        // No regular file cut short, to be read later as whole (a device is left alone).
        struct stat st;
        if (failed && ::stat(opt.logits_out.c_str(), &st) == 0 && S_ISREG(st.st_mode))
          std::remove(opt.logits_out.c_str());
      }
      if (failed) {
        log_error("trellis generate: error: --logits-out " + opt.logits_out + ": write failed: " +
                  std::strerror(failed) +
                  " (the tokens above were generated; no logits file was written)");
        return kExitBadInput;
      }
    }
    const int n = int(g.tokens.size());
    auto f = [](const char* fmt, double v) { return strfmt(fmt, v); };
    std::vector<std::vector<std::string>> rows = {
        {"checkpoint", opt.checkpoint},
        {"tensor-parallel ranks", std::to_string(tp_size)},
        {"sampling", opt.sampling.temperature == 0
                         ? std::string("greedy")
                         : strfmt("temperature %g, top-k %s, seed %llu", opt.sampling.temperature,
                                  opt.sampling.top_k ? std::to_string(opt.sampling.top_k).c_str() : "all",
                                  (unsigned long long)opt.sampling.seed)},
        {"prompt tokens", std::to_string(prompt.size())},
        {"generated tokens", std::to_string(n)},
        {"checkpoint load (s)", f("%.2f", load_s)},
        {"time to first token (ms)", f("%.1f", g.first_token_s * 1e3)},
        {"prefill tokens/s", f("%.0f", double(prompt.size()) / std::max(g.first_token_s, 1e-9))},
        {"decode tokens/s", n > 1 ? f("%.1f", (n - 1) / std::max(g.decode_s, 1e-9)) : "-"},
        {"KV cache per rank", format_bytes(double(decoder.cache_bytes()))},
    };
    std::printf("%s", format_table("Generation", {"what", "value"}, rows).c_str());
    std::fflush(stdout);
  } catch (const UserError& e) {  // thrown on every rank together (generate's `next`)
    if (rank == 0) log_error("trellis generate: error: " + std::string(e.what()));
    return kExitBadInput;
  } catch (const std::exception& e) {
    log_error(strfmt("trellis generate: rank %d: error: %s", rank, e.what()));
    MPI_Abort(world.comm(), kExitFailure);
  }
  return kExitOk;
}

}  // namespace trellis
