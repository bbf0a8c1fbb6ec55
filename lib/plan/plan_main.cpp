#include "plan/plan_main.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/log.hpp"
#include "plan/flops.hpp"
#include "plan/layouts.hpp"

namespace trellis {

const char* kPlanUsage = R"(usage: trellis plan DECK [options] [--section.key=value ...]

Memory per rank of the deck's own layout, then every valid layout of its model on N devices,
ranked by whether it fits and by estimated step time, with one line of advice each. Needs no MPI.

options (defaults in brackets):
  --gpus N               devices to plan for [the deck's dp*tp*pp]
  --gpus-per-node G      devices per node: tp/dp/pp groups inside a node use the fast link [8]
  --gpu-mem SIZE         memory per device, e.g. 80GiB, 141GiB, 96GB [80GiB]
  --precision P          what this code allocates, buffer by buffer: fp32, or bf16 (bf16
                         weights and activations, fp32 gradients, master weights and Adam:
                         2+4+12 bytes per parameter); or bf16-full, a full bf16 GPU run as ZeRO
                         and Megatron-LM count it (bf16 gradients too: 2+2+12)
                         [the deck's system.precision; CPU or GPU by system.backend; a GPU's
                         bf16 attention on the tensor cores unless TRELLIS_TC_ATTENTION=0, its
                         scratch as TRELLIS_GELU_EPILOGUE says]
  --peak-tflops X        dense peak per device [989 for bf16 on a GPU (H100/H200 SXM);
                         otherwise the deck's system.peak_gflops, else 494 (TF32)]
  --efficiency F         fraction of the peak the step's matrix multiplies reach [0.5]
  --layer-overhead-us X  fixed time per layer and micro-batch that a larger micro-batch does
                         not lengthen (kernel launches, GEMM tails) [30]
  --intra-node-gbs X     per-device bandwidth inside a node, GB/s one way [450: NVLink 4]
  --inter-node-gbs X     per-device bandwidth between nodes, GB/s [50: 400 Gb/s InfiniBand NDR]
  --intra-latency-us X   per ring step inside a node [3]
  --inter-latency-us X   per ring step between nodes [10]
  --reserve SIZE         memory per device that is not the plan's (CUDA context, NCCL, allocator)
                         [2GiB on GPUs, 0 on the CPU]
  --threads N            fp32: threads of the CPU attention backward (its scratch) [system.threads,
                         else OpenBLAS's from $OPENBLAS_NUM_THREADS, $GOTO_NUM_THREADS or
                         $OMP_NUM_THREADS (at most the cores), else the cores over the ranks a node]
  --top N                layouts shown [20]
  --json PATH            also write the deck layout's plan as JSON (peak bytes per rank and kind)
)";

namespace {

struct Options {
  std::string deck;
  std::vector<std::string> overrides;
  int gpus = 0, per_node = 8, top = 20, threads = 0;
  std::string precision, json;
  double gpu_mem = 80.0 * (1ull << 30), peak_tflops = 0, efficiency = 0.5, layer_overhead_us = 30;
  double intra_gbs = 450, inter_gbs = 50, intra_us = 3, inter_us = 10, reserve = -1;
};

double parse_number(const std::string& text, const std::string& option, double lo, double hi) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != 0 || !std::isfinite(v) || v < lo || v > hi)
    throw UserError(strfmt("%s = '%s': expected a number in [%g, %g]", option.c_str(), text.c_str(), lo, hi));
  return v;
}

int parse_int(const std::string& text, const std::string& option, int lo, int hi) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != 0 || v < lo || v > hi)
    throw UserError(strfmt("%s = '%s': expected a whole number from %d to %d", option.c_str(), text.c_str(), lo, hi));
  return int(v);
}

Options parse_options(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      if (!o.deck.empty()) throw UserError("unexpected argument '" + a + "' (one DECK only)");
      o.deck = a;
      continue;
    }
    std::string name = a, value;
    const bool has_eq = a.find('=') != std::string::npos;
    if (has_eq) name = a.substr(0, a.find('=')), value = a.substr(a.find('=') + 1);
    if (name.find('.') != std::string::npos) {  // a deck key
      o.overrides.push_back(a);
      continue;
    }
    auto take = [&]() -> std::string {
      if (has_eq) return value;
      if (i + 1 >= args.size()) throw UserError(name + ": needs a value (" + name + " VALUE)");
      return args[++i];
    };
    if (name == "--gpus") o.gpus = parse_int(take(), name, 1, 1 << 24);
    else if (name == "--gpus-per-node") o.per_node = parse_int(take(), name, 1, 1 << 16);
    else if (name == "--gpu-mem") o.gpu_mem = parse_size(take(), name, 1 << 20);  // (0.5: bytes)
    else if (name == "--precision") o.precision = take();
    else if (name == "--peak-tflops") o.peak_tflops = parse_number(take(), name, 1e-6, 1e9);
    else if (name == "--efficiency") o.efficiency = parse_number(take(), name, 1e-3, 1);
    else if (name == "--layer-overhead-us")
      o.layer_overhead_us = parse_number(take(), name, 0, 1e9);
    else if (name == "--intra-node-gbs") o.intra_gbs = parse_number(take(), name, 1e-3, 1e9);
    else if (name == "--inter-node-gbs") o.inter_gbs = parse_number(take(), name, 1e-3, 1e9);
    else if (name == "--intra-latency-us") o.intra_us = parse_number(take(), name, 0, 1e9);
    else if (name == "--inter-latency-us") o.inter_us = parse_number(take(), name, 0, 1e9);
    else if (name == "--reserve") o.reserve = parse_size(take(), name);
    else if (name == "--threads") o.threads = parse_int(take(), name, 1, 1 << 16);
    else if (name == "--top") o.top = parse_int(take(), name, 0, 1 << 30);
    else if (name == "--json") {
      o.json = take();
      if (o.json.empty()) throw UserError("--json: an empty path; give the file to write");
    }
    else throw UserError("unknown option '" + name + "' (trellis plan --help lists them)");
  }
  if (o.deck.empty()) throw UserError("which deck? usage: trellis plan DECK [options]");
  if (!o.precision.empty()) parse_precision(o.precision);  // names --precision when wrong
  if (!o.json.empty()) check_not_the_deck(o.json, o.deck, "--json", "the JSON");
  return o;
}

std::string count(double n) {
  if (n >= 1e12) return strfmt("%.2fT", n / 1e12);
  if (n >= 1e9) return strfmt("%.2fB", n / 1e9);
  if (n >= 1e6) return strfmt("%.2fM", n / 1e6);
  if (n >= 1e3) return strfmt("%.1fK", n / 1e3);
  return strfmt("%.0f", n);
}

std::string seconds(double s) {
  if (s >= 1) return strfmt("%.2f s", s);
  if (s >= 1e-3) return strfmt("%.1f ms", s * 1e3);
  return strfmt("%.0f us", s * 1e6);
}

/// "ZeRO-N", and where dp is 1 that it runs as stage 0 (parallel/zero.hpp).
static std::string zero_name(const ParallelConfig& p) {
  return strfmt("ZeRO-%d%s", p.zero, p.zero > 0 && p.dp == 1 ? " (as 0 over dp 1)" : "");
}

std::string layout_name(const Config& c) {
  const ParallelConfig& p = c.parallel;
  std::string s = strfmt("dp %d x tp %d x pp %d, %s, micro_batch %d, %s", p.dp, p.tp, p.pp,
                         zero_name(p).c_str(), c.train.micro_batch, p.schedule.c_str());
  if (p.schedule == "interleaved") s += strfmt(" v=%d", p.virtual_stages);
  if (p.sequence_parallel && p.tp > 1) s += ", SP";
  if (c.train.recompute != "none") s += ", recompute " + c.train.recompute;
  return s;
}

std::string memory_table(const Config& cfg, const std::vector<RankMemory>& stages, double usable) {
  const RankMemory& r = largest(stages);
  std::vector<std::vector<std::string>> rows;
  auto row = [&](const char* kind, const MemoryItem& item) {
    rows.push_back({kind, format_bytes(item.bytes), item.how});
  };
  row("parameters", r.params);
  row("gradients", r.grads);
  row("optimizer", r.optim);
  row("activations", r.activations);
  row("comm buffers", r.comm);
  row("workspace", r.workspace);
  rows.push_back({"total", format_bytes(r.total()),
                  r.total() <= usable ? strfmt("fits: %s usable per device", format_bytes(usable).c_str())
                                      : strfmt("DOES NOT FIT: %s usable per device", format_bytes(usable).c_str())});
  std::string title = strfmt("memory per rank, the deck's layout (%s); pipeline stage %d of %d, the largest",
                             layout_name(cfg).c_str(), r.stage, cfg.parallel.pp);
  std::string out = format_table(title, {"kind", "bytes", "how"}, rows);
  if (stages.size() > 1) {
    std::string line = "per stage:";
    for (size_t s = 0; s < stages.size(); ++s) {
      if (stages.size() > 12 && s >= 4 && s + 4 < stages.size()) {
        if (s == 4) line += " ...";
        continue;
      }
      line += strfmt(" %zu: %s", s, format_bytes(stages[s].total()).c_str());
    }
    out += line + "\n";
  }
  return out;
}

std::string formulas_line(const Config& cfg, Precision precision) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& p = cfg.parallel;
  const double psi = double(model_parameter_count(m)) / (p.tp * p.pp);
  const ModelStates z = zero_model_states(psi, p.dp, p.zero, precision);
  const double layer = megatron_layer_activation_bytes(m.seq_len, cfg.train.micro_batch, m, p.tp,
                                                       p.sequence_parallel && p.tp > 1, cfg.train.recompute);
  return strfmt(
      "textbook check: %s model states (%s) for Ψ/(tp·pp) = %s: %s per rank; Megatron "
      "activations per layer and micro-batch (16-bit, with dropout masks): %s\n",
      zero_name(p).c_str(),
      precision == Precision::BF16_FULL ? "2Ψ + 2Ψ + 12Ψ"
      : precision == Precision::BF16    ? "2Ψ + 4Ψ + 12Ψ"
                                        : "4Ψ + 4Ψ + 8Ψ",
      count(psi).c_str(), format_bytes(z.total()).c_str(), format_bytes(layer).c_str());
}

/// What a rank holds on the host besides the table (the process measured 2026-12-06 on the CPU
/// VM): a checkpoint's write or read holds the rank's part of the model and of AdamW's m and v
/// (checkpoint_parts.hpp: its ZeRO shard, give or take a row), fp32, and one of the three of its
/// shard on the way; on the CPU, the process itself. `stages`: the layout's (the largest stage's
/// Ψ_rank: the first holds the embeddings, and replicated tensors do not divide by tp).
std::string host_line(const Config& cfg, const std::vector<RankMemory>& stages, bool device) {
  int64_t largest = 0;
  for (const RankMemory& s : stages) largest = std::max(largest, s.stage_params);
  const double psi = std::ceil(double(largest) / cfg.parallel.dp);
  const bool moved = cfg.parallel.dp > 1;  // (at dp 1 the part is the shard: nothing on its way)
  return strfmt(
      "host memory besides: a checkpoint's write or read holds the rank's part, Ψ_rank/dp = %s "
      "parameters (the largest stage's), of the weights and AdamW's m and v%s, fp32 (%d B "
      "each): %s a rank while it writes or reads%s\n",
      count(psi).c_str(), moved ? " and one of them on its way" : "", moved ? 16 : 12,
      format_bytes((moved ? 16 : 12) * psi).c_str(),
      device ? ""
             : "; the process itself (libraries, MPI, BLAS buffers): 20-45 MB a rank more than "
               "the table (measured: default.deck 26 MB at dp 4, 59 MB on 1 rank of 2 threads)");
}

std::string layouts_table(const LayoutSearch& s, int top) {
  std::vector<std::vector<std::string>> rows;
  for (size_t i = 0; i < s.layouts.size() && int(i) < top; ++i) {
    const LayoutPlan& L = s.layouts[i];
    const ParallelConfig& p = L.cfg.parallel;
    rows.push_back({std::to_string(i + 1), std::to_string(p.dp), std::to_string(p.tp), std::to_string(p.pp),
                    std::to_string(p.zero), std::to_string(L.cfg.train.micro_batch),
                    p.schedule == "interleaved" ? strfmt("interl. v%d", p.virtual_stages) : p.schedule,
                    p.sequence_parallel && p.tp > 1 ? "yes" : "-", L.cfg.train.recompute,
                    format_bytes(L.memory.total()), L.fits ? "yes" : "NO", seconds(L.time.total()),
                    count(L.tokens_per_s), strfmt("%.1f%%", 100 * L.mfu),
                    strfmt("%.0f%%", 100 * L.time.comm_share()),
                    strfmt("%.0f%%", 100 * L.time.bubble / L.time.total()), L.advice});
  }
  return format_table("layouts, ranked: fitting first, then by estimated step time",
                      {"#", "dp", "tp", "pp", "ZeRO", "mb", "schedule", "SP", "recompute", "mem/rank",
                       "fits", "step", "tok/s", "MFU", "comm", "bubble", "advice"},
                      rows);
}

void write_json(const std::string& path, const Config& cfg, const std::vector<RankMemory>& stages) {
  // Opened without blocking: a FIFO no process reads fails at once (ENXIO) instead of waiting
  // for ever; a pipe with a reader (--json /dev/stdout | jq) is written as any file.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0)
    throw UserError("--json " + path + ": cannot write the file: " +
                    (errno == ENXIO ? std::string("a FIFO that no process reads")
                                    : std::string(std::strerror(errno))));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::ostringstream f;
  const RankMemory& r = largest(stages);
  auto kinds = [](const RankMemory& m) {
    return strfmt("{\"parameters\": %.0f, \"gradients\": %.0f, \"optimizer\": %.0f, \"activations\": %.0f, "
                  "\"comm buffers\": %.0f, \"scratch\": %.0f}",
                  m.params.bytes, m.grads.bytes, m.optim.bytes, m.activations.bytes, m.comm.bytes,
                  m.workspace.bytes);
  };
  f << "{\n  \"layout\": " << strfmt("{\"dp\": %d, \"tp\": %d, \"pp\": %d, \"zero\": %d}", cfg.parallel.dp,
                                     cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero)
    << ",\n  \"peak_bytes_per_rank\": " << strfmt("%.0f", r.total())
    << ",\n  \"largest_stage\": " << r.stage << ",\n  \"peak_bytes_by_kind\": " << kinds(r)
    << ",\n  \"stages\": [";
  for (size_t s = 0; s < stages.size(); ++s)
    f << (s ? ", " : "") << strfmt("{\"stage\": %zu, \"peak_bytes\": %.0f, \"by_kind\": ", s, stages[s].total())
      << kinds(stages[s]) << "}";
  f << "]\n}\n";
  const std::string text = f.str();
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += size_t(n);
  }
  const int write_errno = errno;
  if (::close(fd) != 0 || done < text.size())
    throw UserError("--json " + path + ": write failed: " + std::strerror(write_errno));
}

/// The best fitting layout on N/4, N/2 and N devices: what doubling the devices buys (the second
/// seed document: a small model or a light load becomes communication-bound).
std::string scaling_table(const PlanRequest& req, const LayoutSearch& at_n) {
  std::vector<std::vector<std::string>> rows;
  double first_per_device = 0;
  for (int div : {4, 2, 1}) {
    if (req.devices % div != 0) continue;
    PlanRequest r = req;
    r.devices = req.devices / div;
    const LayoutSearch s = div == 1 ? at_n : search_layouts(r);
    if (s.layouts.empty() || !s.layouts.front().fits) {
      rows.push_back({std::to_string(r.devices), "nothing fits", "", "", "", ""});
      continue;
    }
    const LayoutPlan& best = s.layouts.front();
    const double per_device = best.tokens_per_s / r.devices;
    if (first_per_device == 0) first_per_device = per_device;
    rows.push_back({std::to_string(r.devices), layout_name(best.cfg), seconds(best.time.total()),
                    count(best.tokens_per_s), count(per_device),
                    strfmt("%.0f%%", 100 * per_device / first_per_device)});
  }
  if (rows.size() < 2) return "";
  return format_table("scaling: the best fitting layout on fewer devices (estimates)",
                      {"devices", "best layout", "step", "tok/s", "tok/s per device", "per-device efficiency"}, rows);
}

}  // namespace

double parse_size(const std::string& text, const std::string& option, double at_least) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  std::string unit(end);
  const struct { const char* name; double scale; } units[] = {
      {"", 1}, {"B", 1}, {"K", 1024.0}, {"KiB", 1024.0}, {"KB", 1e3}, {"M", 1048576.0}, {"MiB", 1048576.0},
      {"MB", 1e6}, {"G", 1073741824.0}, {"GiB", 1073741824.0}, {"GB", 1e9}, {"T", 1099511627776.0},
      {"TiB", 1099511627776.0}, {"TB", 1e12}};
  if (end != text.c_str() && std::isfinite(v) && v > 0)
    for (const auto& u : units)
      if (unit == u.name && v * u.scale >= at_least) return v * u.scale;
  const std::string least =
      at_least > 1 ? ", at least " + format_bytes(at_least) + " (a number alone is bytes)" : "";
  throw UserError(option + " = '" + text + "': expected a size such as 80GiB, 96GB or 512MiB" +
                  least);
}

// `word` as the shell reads one word: as it is where it holds only characters the shell leaves
// alone, else in single quotes.
static std::string shell_word(const std::string& word) {
  const char* const safe =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./=,:+-@%";
  const bool plain = !word.empty() && word.find_first_not_of(safe) == std::string::npos;
  if (plain) return word;
  std::string quoted = "'";
  for (const char c : word) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The command that trains what was planned, pasted as it is: the layout's ranks under mpirun;
// the deck, the command line's overrides (a shell word each), the plan's options that change the
// run (--precision, --threads), then the layout's keys, which win.
static std::string run_command(const Options& o, const Config& deck, const PlanRequest& req,
                               const LayoutPlan& best) {
  const ParallelConfig& p = best.cfg.parallel;
  std::string run = strfmt("mpirun -np %d trellis train %s", p.dp * p.tp * p.pp,
                           shell_word(o.deck).c_str());
  for (const std::string& w : o.overrides) run.append(" ").append(shell_word(w));
  // bf16-full has no run of its own: this code's bf16 is the nearest (a note says so).
  const char* precision = req.precision == Precision::FP32 ? "fp32" : "bf16";
  if (precision != deck.system.precision) run.append(" --system.precision=").append(precision);
  if (o.threads > 0 && o.threads != deck.system.threads)
    run += strfmt(" --system.threads=%d", o.threads);  // the CPU attention scratch planned
  run.append(" ").append(best.overrides());
  return run;
}

int plan_main(const std::vector<std::string>& args) {
  try {
    const Options o = parse_options(args);
    // The deck's own layout; dp = 0 takes the rest of --gpus.
    Config cfg = load_config(o.deck, o.overrides, 0, false);
    const bool dp_derived = std::find(cfg.derived.begin(), cfg.derived.end(), "parallel.dp") != cfg.derived.end();
    // Why the deck's layout, its dp taking the devices its tp and pp leave, has no place on
    // --gpus N (empty: it has). Other layouts may: they are ranked all the same.
    std::string deck_layout_refused;
    if (dp_derived && o.gpus > 0) {
      try {
        cfg = load_config(o.deck, o.overrides, o.gpus, false);
      } catch (const UserError& e) {  // (the deck's keys are right alone: --gpus is the change)
        deck_layout_refused = e.what();
        if (!o.json.empty())
          throw UserError(strfmt("--json %s: no plan of the deck's layout to write: on --gpus %d, "
                                 "the deck's dp taking the GPUs its tp and pp leave: %s",
                                 o.json.c_str(), o.gpus, e.what()));
      }
    }
    const int deck_world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp;

    PlanRequest req;
    req.deck = o.deck;
    req.overrides = o.overrides;
    req.devices = o.gpus > 0 ? o.gpus : deck_world;
    req.precision = parse_precision(!o.precision.empty() ? o.precision : cfg.system.precision);
    // (The ranks of one node share its cores, as the run's do: dp 2 on a 2-core node plans the
    // attention scratch of one thread a rank, which it runs.)
    req.memory = run_memory_options(cfg, std::min(o.gpus > 0 ? o.gpus : deck_world, o.per_node));
    req.memory.precision = req.precision;
    req.memory.device = req.memory.device || req.precision == Precision::BF16_FULL;
    const bool bf16 = req.precision != Precision::FP32 && req.memory.device;  // a bf16 GPU run
    if (o.threads > 0) req.memory.threads = o.threads;
    DeviceModel& d = req.device;
    d.memory_bytes = o.gpu_mem;
    d.per_node = o.per_node;
    d.peak_flops = o.peak_tflops > 0 ? o.peak_tflops * 1e12
                   : bf16                       ? 989e12
                   : cfg.system.peak_gflops > 0 ? cfg.system.peak_gflops * 1e9
                                                : 494e12;
    d.efficiency = o.efficiency;
    d.layer_overhead = o.layer_overhead_us * 1e-6;
    d.intra_bw = o.intra_gbs * 1e9;
    d.inter_bw = o.inter_gbs * 1e9;
    d.intra_latency = o.intra_us * 1e-6;
    d.inter_latency = o.inter_us * 1e-6;
    d.reserve_bytes = o.reserve >= 0 ? o.reserve : req.memory.device ? 2.0 * (1ull << 30) : 0.0;
    if (d.reserve_bytes >= d.memory_bytes)
      throw UserError(strfmt("--reserve (%s) leaves nothing of --gpu-mem (%s)", format_bytes(d.reserve_bytes).c_str(),
                             format_bytes(d.memory_bytes).c_str()));

    // Every layout on N devices (printed below), first: where there is none, and the deck's own
    // does not apply either, there is nothing to plan.
    const LayoutSearch s = search_layouts(req);
    if (s.layouts.empty() && !deck_layout_refused.empty())  // nothing at all to plan on N devices
      throw UserError(strfmt("--gpus %d: no layout of the deck's model is valid on %d devices "
                             "(the deck's rules refuse every split: heads, kv_heads, d_ff by tp; "
                             "stages <= layers; batch by dp), its own included: %s",
                             o.gpus, o.gpus, deck_layout_refused.c_str()));

    // ---- summary ----
    const ModelConfig& m = cfg.model;
    const int64_t psi = model_parameter_count(m);
    std::printf("trellis plan %s: %s parameters (Ψ = %lld), %d layers, d_model %d, %d heads (%d kv), "
                "d_ff %d, seq_len %d, vocab %d; global batch %d sequences = %s tokens per step\n",
                o.deck.c_str(), count(double(psi)).c_str(), (long long)psi, m.layers, m.d_model, m.heads,
                m.kv_heads, m.d_ff, m.seq_len, m.vocab, cfg.train.global_batch,
                count(double(cfg.train.global_batch) * m.seq_len).c_str());
    std::printf("devices: %d, %d per node, %s each (%s usable after a %s reserve); precision %s; peak %.4g "
                "TFLOP/s x efficiency %.2f, %g us a layer and micro-batch; links %g GB/s %g us "
                "inside a node, %g GB/s %g us between nodes\n",
                req.devices, d.per_node, format_bytes(d.memory_bytes).c_str(), format_bytes(d.usable()).c_str(),
                format_bytes(d.reserve_bytes).c_str(), precision_name(req.precision), d.peak_flops / 1e12,
                d.efficiency, o.layer_overhead_us, o.intra_gbs, o.intra_us, o.inter_gbs,
                o.inter_us);
    std::printf("model FLOPs: %.3g per token (6 per matmul weight + attention), %.3g per step\n\n",
                train_flops_per_token(m), train_flops_per_token(m) * cfg.train.global_batch * m.seq_len);

    // ---- the deck's layout ----
    if (!deck_layout_refused.empty()) {
      std::printf("the deck's layout (tp %d x pp %d, dp taking the rest) does not apply to %d "
                  "devices: %s\nits memory table is left out; every layout for %d devices "
                  "follows\n\n",
                  cfg.parallel.tp, cfg.parallel.pp, req.devices, deck_layout_refused.c_str(),
                  req.devices);
    } else {
      const std::vector<RankMemory> stages = layout_memory(cfg, req.memory);
      // (A layout set in full by the deck or the command line is planned as set: the job that
      // runs it starts its dp·tp·pp ranks, whatever --gpus says of the layouts ranked below.)
      if (deck_world != req.devices)
        std::printf("note: the deck's layout takes %d rank(s), not the %d of --gpus: the table "
                    "and the step estimate below are for its own %d%s\n",
                    deck_world, req.devices, deck_world,
                    o.json.empty() ? "" : strfmt(", and so is %s", o.json.c_str()).c_str());
      std::fputs(memory_table(cfg, stages, d.usable()).c_str(), stdout);
      std::fputs(formulas_line(cfg, req.precision).c_str(), stdout);
      std::fputs(host_line(cfg, stages, req.memory.device).c_str(), stdout);
      const StepTime t = estimate_step_time(cfg, req.precision, d);
      const std::string elsewhere =
          deck_world != req.devices
              ? strfmt(" — on the deck's %d rank(s), not the %d planned below", deck_world,
                       req.devices)
              : "";
      std::printf("estimated step: %s (compute %s, overhead %s, tp %s, pp %s, bubble %s, dp "
                  "exposed %s)%s\n\n",
                  seconds(t.total()).c_str(), seconds(t.compute).c_str(),
                  seconds(t.overhead).c_str(), seconds(t.tp).c_str(), seconds(t.pp).c_str(),
                  seconds(t.bubble).c_str(), seconds(t.dp).c_str(), elsewhere.c_str());
      if (!o.json.empty()) write_json(o.json, cfg, stages);
    }

    // ---- every layout on N devices ----
    const int fitting = int(std::count_if(s.layouts.begin(), s.layouts.end(), [](const LayoutPlan& L) { return L.fits; }));
    if (o.top > 0 && !s.layouts.empty()) std::fputs(layouts_table(s, o.top).c_str(), stdout);
    std::printf("%zu layouts of %d devices evaluated, %d fit; %zu shown; %d (dp, tp, pp, micro-batch) "
                "combinations refused by the deck's rules (heads, kv_heads, d_ff by tp; stages <= layers; "
                "batch by dp)\n",
                s.layouts.size(), req.devices, fitting, std::min<size_t>(s.layouts.size(), size_t(std::max(0, o.top))),
                s.rejected);
    std::printf("the model %s one device with plain data parallelism (seed table: %s)\n",
                s.fits_one_device ? "fits" : "does not fit",
                s.fits_one_device ? "data parallel; ZeRO, tp, pp only if the batch or speed asks for them"
                                  : "ZeRO, then tensor parallelism inside a node, pipeline across nodes");
    if (fitting > 0) {
      const LayoutPlan& best = s.layouts.front();
      std::printf("best estimate: %s; %s per step, %s tok/s\n  run it: %s\n",
                  layout_name(best.cfg).c_str(), seconds(best.time.total()).c_str(),
                  count(best.tokens_per_s).c_str(), run_command(o, cfg, req, best).c_str());
      if (req.precision == Precision::BF16_FULL)
        std::printf("  (bf16-full is the papers' full bf16 run, not this code's: its bf16 keeps "
                    "fp32 gradients, 2 bytes more a parameter; --precision bf16 plans what it "
                    "runs)\n");
      std::fputs(scaling_table(req, s).c_str(), stdout);
      std::printf("these are estimates: more devices are not always faster — measure the top few on the real "
                  "workload (tokens/s and memory per device) before a long run\n");
    } else if (s.layouts.empty()) {
      std::printf("no valid layout on %d devices: the deck's rules refuse every split (try a device count "
                  "that the heads, layers and global batch divide)\n", req.devices);
    } else {
      std::printf("no layout fits %d devices of %s: more devices, more memory, or a smaller micro-batch\n",
                  req.devices, format_bytes(d.memory_bytes).c_str());
    }
    return kExitOk;
  } catch (const UserError& e) {
    std::fprintf(stderr, "trellis plan: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace trellis
