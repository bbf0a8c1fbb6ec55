#include "train/tune.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
#include "plan/layouts.hpp"
#include "train/run_dir.hpp"
#include "train/trainer.hpp"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace trellis {
namespace {

struct TuneOptions {
  std::string deck;
  std::vector<std::string> overrides;  // --section.key=value for the deck
  int candidates = 6;
  int steps = 4;  // timed steps per layout, after one warm-up step (more while a GPU's kernels
                  // time their ways)
  std::string out;
};

TuneOptions parse_tune_options(const std::vector<std::string>& args) {
  TuneOptions o;
  po::options_description desc("trellis tune");
  desc.add_options()
      ("candidates", po::value<int>(&o.candidates), "layouts to run (the planner's best first)")
      ("steps", po::value<int>(&o.steps), "timed steps per layout, after the warm-up")
      ("out", po::value<std::string>(&o.out), "where to write the winning deck");
  std::vector<std::string> rest;
  try {
    po::parsed_options parsed =
        po::command_line_parser(args).options(desc).allow_unregistered().run();
    po::variables_map vm;
    po::store(parsed, vm);
    po::notify(vm);
    if (vm.count("out") && o.out.empty())
      throw UserError("trellis tune: --out: an empty path; give the file to write (or leave "
                      "--out out: RUN_DIR/tuned.deck)");
    rest = po::collect_unrecognized(parsed.options, po::include_positional);
  } catch (const po::error& e) {
    throw UserError(strfmt("trellis tune: %s", e.what()));
  }
  for (const auto& a : rest) {
    // A deck key has a section (--section.key=value); any other option is one tune lacks, and
    // its value must not be taken for a second deck.
    const std::string name = a.substr(0, a.find('='));
    if (a.size() > 1 && a[0] == '-' && name.find('.') == std::string::npos)
      throw UserError("trellis tune: unknown option '" + name +
                      "' (trellis tune --help lists them)");
    if (a.rfind("--", 0) == 0) o.overrides.push_back(a);
    else if (o.deck.empty()) o.deck = a;
    else throw UserError("trellis tune: more than one deck given ('" + o.deck + "', '" + a + "')");
  }
  if (o.deck.empty()) throw UserError("trellis tune: which deck? usage: trellis tune DECK [options]");
  if (o.candidates < 1) throw UserError("trellis tune: --candidates must be at least 1");
  if (o.steps < 1) throw UserError("trellis tune: --steps must be at least 1");
  return o;
}

struct Measured {
  LayoutChoice layout;
  Config cfg;
  double step_seconds = 0;  // median over the timed steps of the slowest rank's step
  double tokens_per_s = 0;
  double peak_bytes = 0;  // max over ranks
  double final_loss = 0;
};

// The deck as one rank would run it: the base that the candidates vary (the deck's own layout may
// be for another number of ranks).
Config base_config(const std::string& deck, std::vector<std::string> overrides) {
  for (const char* o : {"--parallel.dp=1", "--parallel.tp=1", "--parallel.pp=1", "--parallel.zero=0",
                        "--parallel.stage_layers=", "--parallel.schedule=1f1b",
                        "--parallel.virtual_stages=1"})
    overrides.push_back(o);
  return load_config(deck, overrides, 1);
}

// This node's CPUs as the planner's device: the memory a rank may use is its share of what the
// node has available now; the peak is the deck's system.peak_gflops (a rough 50 GFLOP/s per rank
// without it — the ranking needs the ratio of compute to communication, not the absolute figure);
// ranks talk through shared memory inside a node. Each BLAS call hands its work to the rank's
// threads: measured on a 2-core machine (default deck, 2 and 4 layers, 2 threads), 0.1 to 0.17 ms
// a layer and micro-batch more than the FLOPs say (with one thread, about none).
DeviceModel cpu_device_model(const Config& cfg, int local_ranks) {
  DeviceModel d;
  const double available = host_meminfo_bytes("MemAvailable");
  d.memory_bytes = available > 0 ? available / std::max(1, local_ranks) : 4.0 * (1ull << 30);
  d.reserve_bytes = 0;
  d.per_node = std::max(1, local_ranks);
  d.peak_flops = (cfg.system.peak_gflops > 0 ? cfg.system.peak_gflops : 50.0) * 1e9;
  d.efficiency = 0.6;
  d.layer_overhead = 100e-6;
  d.intra_bw = 5e9, d.intra_latency = 5e-6;
  d.inter_bw = 1e9, d.inter_latency = 2e-5;
  return d;
}

// Collective, for a GPU backend: the device memory a run may take on the rank with the least —
// what the driver says is free now on each rank's GPU (chosen as the trainer chooses it), plus
// what the backend opened for asking holds itself (its workspace: freed again at once). A rank
// that cannot open its GPU is every rank's UserError.
double gpu_memory_free(const Config& base, MPI_Comm comm) {
  const NodeRanks node = node_ranks(comm);
  double free = 0;
  setup_together(comm, [&] {
    const int64_t before = memory_stats().total_current;
    std::unique_ptr<Backend> backend = make_backend(base.system.backend, node.rank, node.size);
    free = double(backend->memory_info().free) + double(memory_stats().total_current - before);
  });
  MPI_Allreduce(MPI_IN_PLACE, &free, 1, MPI_DOUBLE, MPI_MIN, comm);
  return free;
}

}  // namespace

std::vector<LayoutChoice> tune_candidates(const std::string& deck,
                                          const std::vector<std::string>& overrides, int world,
                                          int local_ranks, int count, double gpu_memory) {
  PlanRequest req;
  req.deck = deck;
  req.overrides = overrides;
  req.devices = world;
  const Config base = base_config(deck, overrides);
  req.memory = run_memory_options(base, local_ranks);  // what the runs will use
  req.precision = req.memory.precision;
  if (base.system.backend == "cpu") req.device = cpu_device_model(base, local_ranks);
  if (req.memory.device) {
    // The planner's GPU (an H100/H200 node) with the memory these ranks' GPUs have free.
    req.device.per_node = local_ranks;
    if (gpu_memory > 0) req.device.memory_bytes = gpu_memory;
    if (base.system.peak_gflops > 0) req.device.peak_flops = base.system.peak_gflops * 1e9;
  }
  const LayoutSearch search = search_layouts(req);
  if (search.layouts.empty())  // not a question of memory: no split of these ranks is valid
    throw UserError(strfmt(
        "trellis tune: no layout of %s splits %d ranks: the deck's rules refuse every dp x tp x pp "
        "= %d (heads, kv_heads and d_ff by tp; pp up to model.layers; train.global_batch by dp x "
        "micro_batch); start a number of ranks they divide (trellis plan %s --gpus N lists them)",
        deck.c_str(), world, world, deck.c_str()));
  // The planner's ranking, best first, but one layout per grid shape (dp, tp, pp) before any
  // second one: the question tune answers is which degree of each parallelism pays here.
  std::vector<const LayoutPlan*> picked, seconds;
  std::set<std::tuple<int, int, int>> shapes;
  for (const LayoutPlan& L : search.layouts) {
    if (!L.fits) continue;
    const auto shape = std::make_tuple(L.cfg.parallel.dp, L.cfg.parallel.tp, L.cfg.parallel.pp);
    (shapes.insert(shape).second ? picked : seconds).push_back(&L);
  }
  picked.insert(picked.end(), seconds.begin(), seconds.end());
  if (int(picked.size()) > count) picked.resize(count);
  std::vector<LayoutChoice> out;
  for (const LayoutPlan* L : picked) {
    LayoutChoice c;
    c.overrides = overrides;
    std::istringstream words(L->overrides());
    // (the deck's stage_layers kept where the layout's pp is the deck's, as planned)
    for (std::string w; words >> w;) c.overrides.push_back(w);
    const ParallelConfig& p = L->cfg.parallel;
    c.name = strfmt("dp%d tp%d pp%d zero%d mb%d%s%s", p.dp, p.tp, p.pp, p.zero,
                    L->cfg.train.micro_batch, p.sequence_parallel ? " sp" : "",
                    L->cfg.train.recompute == "none" ? "" : (" rc-" + L->cfg.train.recompute).c_str());
    c.estimated_seconds = L->time.total();
    c.planned_bytes = L->memory.total();
    out.push_back(c);
  }
  return out;
}

// Runs each candidate for a few steps, prints the ranking and writes the fastest as a deck
// (collective; returns the exit status).
static int measure_and_write(const TuneOptions& opt, const std::vector<LayoutChoice>& candidates,
                             World& world) {
  std::vector<Measured> results;
  for (const LayoutChoice& c : candidates) {
    Measured m;
    m.layout = c;
    m.cfg = load_config(opt.deck, c.overrides, world.size());
    reset_memory_peaks();
    std::vector<double> seconds;
    {
      Config timed = m.cfg;
      timed.eval.every = 0;  // training steps only: no held-out data to read
      Trainer trainer(timed, world.comm());
      trainer.set_quiet(true);
      // One warm-up step, more while a backend still times its kernels' ways (at most 12).
      const int64_t first = trainer.warm_up(1, 12).steps;
      for (int s = 0; s < opt.steps; ++s) {
        StepResult r = trainer.train_step(first + s);
        double slowest = r.seconds;
        MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, world.comm());
        seconds.push_back(slowest);
        m.final_loss = r.loss;
      }
    }
    std::sort(seconds.begin(), seconds.end());
    m.step_seconds = seconds[seconds.size() / 2];
    m.tokens_per_s = double(m.cfg.train.global_batch) * m.cfg.model.seq_len / m.step_seconds;
    m.peak_bytes = min_avg_max(world.comm(), double(memory_stats().total_peak)).max;
    log(strfmt("tune: %-28s %9.1f ms/step %10.0f tok/s  peak %s per rank", c.name.c_str(),
               m.step_seconds * 1e3, m.tokens_per_s, format_bytes(m.peak_bytes).c_str()));
    results.push_back(m);
  }

  std::vector<size_t> order(results.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return results[a].tokens_per_s > results[b].tokens_per_s;
  });
  std::vector<std::vector<std::string>> rows;
  for (size_t k = 0; k < order.size(); ++k) {
    const Measured& m = results[order[k]];
    rows.push_back({std::to_string(k + 1), m.layout.name, strfmt("%.1f", m.step_seconds * 1e3),
                    strfmt("%.0f", m.tokens_per_s),
                    strfmt("%.2f", m.tokens_per_s / results[order[0]].tokens_per_s),
                    format_bytes(m.peak_bytes),
                    format_bytes(m.layout.planned_bytes),
                    m.layout.estimated_seconds > 0 ? strfmt("%.1f", m.layout.estimated_seconds * 1e3) : "-"});
  }
  log(format_table(strfmt("tune: measured on %d rank(s), fastest first", world.size()),
                   {"rank", "layout", "ms/step", "tokens/s", "vs best", "peak/rank", "planned peak",
                    "planned ms"},
                   rows));
  const Measured& best = results[order[0]];
  std::string write_error;
  if (world.rank() == 0) {
    try {
      const fs::path out(opt.out);
      RunDir(out.has_parent_path() ? out.parent_path().string() : ".")
          .write_file(out.filename().string(),
                      strfmt("# written by trellis tune: the fastest of %zu layouts measured on %d "
                             "rank(s) (%s, %.0f tokens/s)\n",
                             results.size(), world.size(), best.layout.name.c_str(), best.tokens_per_s) +
                          effective_deck_ini(best.cfg));
    } catch (const std::exception& e) {
      write_error = strfmt("trellis tune: --out = '%s': %s", opt.out.c_str(), e.what());
    }
  }
  if (failed_together(world.comm(), write_error, "trellis")) return kExitBadInput;
  log("tune: the winner, " + best.layout.name + ", is written to " + opt.out);
  return kExitOk;
}

const char* const kTuneUsage =
    "usage: mpirun -np N trellis tune DECK [--candidates K] [--steps S] [--out FILE]\n"
    "                                 [--section.key=value ...]\n"
    "  Finds the fastest layout of the deck's model for these N ranks by measuring: the planner\n"
    "  (trellis plan) ranks every layout that fits in memory, the best K run on the real ranks\n"
    "  for S timed steps each after a warm-up (one step; on a GPU more, up to 12, while its\n"
    "  kernels time their ways), and the fastest is written as a deck.\n"
    "\n"
    "  --candidates K   layouts to run, the planner's best first (default 6)\n"
    "  --steps S        timed steps per layout, after the warm-up (default 4)\n"
    "  --out FILE       where to write the winning deck (default RUN_DIR/tuned.deck)\n";

int tune_main(const std::vector<std::string>& args, World& world) {
  TuneOptions opt;
  std::vector<LayoutChoice> candidates;
  std::string error;
  double hang_timeout_s = 0;
  Config base;
  try {
    opt = parse_tune_options(args);
    base = base_config(opt.deck, opt.overrides);
  } catch (const UserError& e) {
    error = e.what();
  }
  if (failed_together(world.comm(), error, "trellis")) return kExitBadInput;
  std::vector<std::pair<std::string, std::string>> settings = base.effective;
  settings.insert(settings.end(), {{"--candidates", std::to_string(opt.candidates)},
                                   {"--steps", std::to_string(opt.steps)},
                                   {"--out", opt.out}});
  if (failed_together(world.comm(), settings_differ_from_rank0(world.comm(), settings), "trellis"))
    return kExitBadInput;
  double gpu_memory = 0;
  try {
    if (base.system.backend != "cpu") gpu_memory = gpu_memory_free(base, world.comm());
    candidates = tune_candidates(opt.deck, opt.overrides, world.size(),
                                 node_ranks(world.comm()).size, opt.candidates, gpu_memory);
    if (candidates.empty())
      throw UserError(
          strfmt("trellis tune: no layout of %s for %d ranks fits in memory", opt.deck.c_str(),
                 world.size()) +
          (gpu_memory <= 0
               ? strfmt(" (see trellis plan %s --gpus %d)", opt.deck.c_str(), world.size())
           : gpu_memory <= DeviceModel().reserve_bytes
               ? strfmt(": %s free on the fullest GPU, less than the %s the planner keeps back "
                        "for NCCL and the allocator (what else holds the GPU's memory?)",
                        format_bytes(gpu_memory).c_str(),
                        format_bytes(DeviceModel().reserve_bytes).c_str())
               : strfmt(": %s free on the fullest GPU, of which the planner keeps %s back for "
                        "NCCL and the allocator (see trellis plan %s --gpus %d --gpu-mem %.0fMiB)",
                        format_bytes(gpu_memory).c_str(),
                        format_bytes(DeviceModel().reserve_bytes).c_str(), opt.deck.c_str(),
                        world.size(), gpu_memory / (1 << 20))));
    if (opt.out.empty()) opt.out = base.run.dir + "/tuned.deck";
    hang_timeout_s = base.system.hang_timeout_s;
    check_writable_dir(fs::path(opt.out).parent_path().string(), "--out");  // ("": here)
    if (std::error_code ec; fs::is_directory(opt.out, ec))
      throw UserError("--out " + opt.out + ": a directory; name the deck file to write");
    check_not_the_deck(opt.out, opt.deck, "--out", "the winner");
    regular_file_target(opt.out);  // (a device or a FIFO there: refused before any layout runs)
  } catch (const UserError& e) {
    error = e.what();
  }
  if (failed_together(world.comm(), error, "trellis")) return kExitBadInput;
  log(strfmt("tune: %zu layout(s) of %s on %d rank(s), %d timed step(s) each after a warm-up",
             candidates.size(), opt.deck.c_str(), world.size(), opt.steps) +
      (gpu_memory > 0 ? strfmt("; planned for %s of GPU memory a rank (the fullest GPU's free)",
                               format_bytes(gpu_memory).c_str())
                      : std::string()));
  // The runs are collective work as training is: a data file no rank can open is every rank's
  // UserError (status 2), a rank that stops is the watchdog's (status 4).
  return run_collective_phase(world, hang_timeout_s, "trellis tune",
                              [&] { return measure_and_write(opt, candidates, world); });
}

}  // namespace trellis
