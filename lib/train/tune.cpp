#include "train/tune.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <filesystem>
#include <memory>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
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
  int steps = 4;  // timed steps per layout, after one warm-up step
  std::string out;
};

TuneOptions parse_tune_options(const std::vector<std::string>& args) {
  TuneOptions o;
  po::options_description desc("trellis tune");
  desc.add_options()
      ("candidates", po::value<int>(&o.candidates), "layouts to run (the planner's best first)")
      ("steps", po::value<int>(&o.steps), "timed steps per layout, after one warm-up step")
      ("out", po::value<std::string>(&o.out), "where to write the winning deck");
  std::vector<std::string> rest;
  try {
    po::parsed_options parsed =
        po::command_line_parser(args).options(desc).allow_unregistered().run();
    po::variables_map vm;
    po::store(parsed, vm);
    po::notify(vm);
    rest = po::collect_unrecognized(parsed.options, po::include_positional);
  } catch (const po::error& e) {
    throw UserError(strfmt("trellis tune: %s", e.what()));
  }
  for (const auto& a : rest) {
    if (a.rfind("--", 0) == 0) o.overrides.push_back(a);
    else if (o.deck.empty()) o.deck = a;
    else throw UserError("trellis tune: more than one deck given ('" + o.deck + "', '" + a + "')");
  }
  if (o.deck.empty()) throw UserError("trellis tune: which deck? usage: trellis tune DECK [options]");
  if (o.candidates < 1) throw UserError("trellis tune: --candidates must be at least 1");
  if (o.steps < 1) throw UserError("trellis tune: --steps must be at least 1");
  return o;
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
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
                        "--parallel.stage_layers=", "--parallel.schedule=1f1b"})
    overrides.push_back(o);
  return load_config(deck, overrides, 1);
}

bool validates(const std::string& deck, const std::vector<std::string>& overrides, int world) {
  try {
    load_config(deck, overrides, world);
    return true;
  } catch (const UserError&) {
    return false;
  }
}

}  // namespace

std::vector<LayoutChoice> tune_candidates(const std::string& deck,
                                          const std::vector<std::string>& overrides, int world) {
  const Config base = base_config(deck, overrides);
  std::vector<LayoutChoice> out;
  for (int tp : divisors(world)) {
    for (int pp : divisors(world / tp)) {
      const int dp = world / (tp * pp);
      std::vector<int> stages = dp > 1 ? std::vector<int>{1, 2, 3} : std::vector<int>{0};
      for (int zero : stages) {
        // The micro-batch: the deck's, or the largest that divides this dp rank's share.
        const int share = base.train.global_batch % dp == 0 ? base.train.global_batch / dp : 0;
        if (share == 0) continue;
        int mb = std::min(base.train.micro_batch, share);
        while (share % mb) --mb;
        LayoutChoice c;
        c.overrides = overrides;
        for (const std::string& o :
             {strfmt("--parallel.dp=%d", dp), strfmt("--parallel.tp=%d", tp),
              strfmt("--parallel.pp=%d", pp), strfmt("--parallel.zero=%d", zero),
              strfmt("--train.micro_batch=%d", mb), std::string("--parallel.stage_layers=")})
          c.overrides.push_back(o);
        // With pp > 1 the deck's own schedule when it fits this layout, else 1F1B.
        if (pp == 1) c.overrides.push_back("--parallel.schedule=1f1b");
        if (!validates(deck, c.overrides, world)) {
          c.overrides.push_back("--parallel.schedule=1f1b");
          if (pp == 1 || !validates(deck, c.overrides, world)) continue;  // e.g. heads % tp != 0
        }
        c.name = strfmt("dp%d tp%d pp%d zero%d mb%d", dp, tp, pp, zero, mb);
        out.push_back(c);
      }
    }
  }
  // Without an estimate, the seed documents' order: data parallel first (least communication
  // per FLOP), then tensor parallel inside a node, pipeline last; lower ZeRO stages first.
  std::stable_sort(out.begin(), out.end(), [](const LayoutChoice& a, const LayoutChoice& b) {
    return a.estimated_seconds < b.estimated_seconds;
  });
  return out;
}

int tune_main(const std::vector<std::string>& args, World& world) {
  TuneOptions opt;
  std::vector<LayoutChoice> candidates;
  std::string error;
  try {
    opt = parse_tune_options(args);
    candidates = tune_candidates(opt.deck, opt.overrides, world.size());
    if (candidates.empty())
      throw UserError(strfmt("trellis tune: no valid layout of %s for %d ranks", opt.deck.c_str(),
                             world.size()));
    if (opt.out.empty()) opt.out = base_config(opt.deck, opt.overrides).run.dir + "/tuned.deck";
    check_writable_dir(fs::path(opt.out).parent_path().string(), "--out");
  } catch (const UserError& e) {
    error = e.what();
  }
  error = agree_on_error(world.comm(), error);
  if (!error.empty()) {
    if (world.rank() == 0) log_error("trellis: error: " + error);
    return kExitBadInput;
  }
  if (int(candidates.size()) > opt.candidates) candidates.resize(opt.candidates);
  log(strfmt("tune: %zu layout(s) of %s on %d rank(s), %d timed step(s) each after a warm-up",
             candidates.size(), opt.deck.c_str(), world.size(), opt.steps));

  std::vector<Measured> results;
  for (const LayoutChoice& c : candidates) {
    Measured m;
    m.layout = c;
    m.cfg = load_config(opt.deck, c.overrides, world.size());
    reset_memory_peaks();
    std::vector<double> seconds;
    {
      Trainer trainer(m.cfg, world.comm());
      trainer.set_quiet(true);
      for (int s = 0; s <= opt.steps; ++s) {
        StepResult r = trainer.train_step(s);
        double slowest = r.seconds;
        MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, world.comm());
        if (s > 0) seconds.push_back(slowest);
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
                    m.layout.estimated_seconds > 0 ? strfmt("%.1f", m.layout.estimated_seconds * 1e3) : "-"});
  }
  log(format_table(strfmt("tune: measured on %d rank(s), fastest first", world.size()),
                   {"rank", "layout", "ms/step", "tokens/s", "vs best", "peak/rank", "planned ms"},
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
  write_error = agree_on_error(world.comm(), write_error);
  if (!write_error.empty()) {
    if (world.rank() == 0) log_error("trellis: error: " + write_error);
    return kExitBadInput;
  }
  log("tune: the winner, " + best.layout.name + ", is written to " + opt.out);
  return kExitOk;
}

}  // namespace trellis
