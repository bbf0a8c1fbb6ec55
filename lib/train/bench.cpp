#include "train/bench.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
#include "model/params.hpp"
#include "plan/flops.hpp"
#include "plan/memory.hpp"
#include "train/trainer.hpp"

namespace trellis {

namespace fs = std::filesystem;

/// Operands for the reference GEMM: out (M,N) = A (M,K)·B (N,K)ᵀ through the backend (in its
/// memory, of the run's type: an fp32 run's sgemm, a bf16 run's bf16 GEMM — like with like),
/// timed as `calls` back-to-back calls.
class ReferenceGemm {
 public:
  ReferenceGemm(Backend& be, int M, int N, int K)
      : be_(be),
        t_(be.dtype()),
        M_(M),
        N_(N),
        K_(K),
        a_(MemKind::Scratch, dtype_bytes(t_) * M * K, be.allocator()),
        b_(MemKind::Scratch, dtype_bytes(t_) * N * K, be.allocator()),
        c_(MemKind::Scratch, dtype_bytes(t_) * M * N, be.allocator()) {
    std::vector<float> host(std::max(int64_t(M), int64_t(N)) * K);
    for (int64_t i = 0; i < int64_t(M) * K; ++i) host[i] = float((i * 7919) % 1000) * 1e-3f;
    be.copy_from_host_as(a_.as(t_), host.data(), int64_t(M) * K);
    for (int64_t i = 0; i < int64_t(N) * K; ++i) host[i] = float((i * 104729) % 1000) * 1e-3f;
    be.copy_from_host_as(b_.as(t_), host.data(), int64_t(N) * K);
    seconds(1);  // warm-up: first-touch of the output, BLAS buffers
  }
  /// Seconds for `calls` products in a row.
  double seconds(int calls) {
    const double t0 = now_seconds();
    for (int c = 0; c < calls; ++c)
      be_.matmul_forward(c_.as(t_), a_.as(t_), b_.as(t_), nullptr, M_, K_, N_);
    be_.synchronize();  // a device backend returns before the GEMM is done
    return now_seconds() - t0;
  }
  double flops() const { return 2.0 * M_ * N_ * K_; }
  size_t bytes() const { return a_.bytes() + b_.bytes() + c_.bytes(); }
  /// GFLOP/s: the fastest of `samples` timings of `calls` products each.
  double gflops(int samples, int calls) {
    double best = 1e30;
    for (int s = 0; s < samples; ++s) best = std::min(best, seconds(calls));
    return flops() * calls / best / 1e9;
  }

 private:
  Backend& be_;
  DType t_;
  int M_, N_, K_;
  Buffer a_, b_, c_;  // (M,K), (N,K), (M,N)
};

/// Attention alone: `iterations` forward and backward passes of one layer's shape on this rank
/// (its micro-batch, its heads under tp), back to back, as PyTorch's SDPA is timed beside it
/// (scripts/torch_bench.py) — what the backend's attention reaches with the device to itself,
/// to hold against the profile's in-step rate. TFLOP/s by the profile's count (causal: 3.5 times
/// 2·B·H·T²·hd a pass); 0 where its buffers do not fit next to the training's.
static double attention_alone_tflops(Backend& backend, const Config& cfg, int iterations) {
  const ParamTable table(cfg.model, cfg.parallel.tp);
  const int B = cfg.train.micro_batch, T = cfg.model.seq_len, H = table.heads_local,
            KV = table.kv_heads_local, hd = cfg.model.d_model / cfg.model.heads;
  const DType t = backend.dtype();
  const size_t e = dtype_bytes(t), rows = size_t(B) * T;
  try {
    Allocator* device = backend.allocator();
    Buffer qkv(MemKind::Scratch, e * rows * (H + 2 * KV) * hd, device);   // (B,T,(H+2KV)·hd)
    Buffer dqkv(MemKind::Scratch, e * rows * (H + 2 * KV) * hd, device);  // (B,T,(H+2KV)·hd)
    Buffer out(MemKind::Scratch, e * rows * H * hd, device);              // (B,T,H·hd)
    Buffer dout(MemKind::Scratch, e * rows * H * hd, device);             // (B,T,H·hd)
    Buffer att(MemKind::Scratch, sizeof(float) * backend.attention_state_elems(B, T, H), device);
    // Values in [-1, 1), as PyTorch's are random: a GPU's clock under all-zero operands, which
    // draw less power, would flatter the rate. (A chunk repeated: a 350M layer's qkv is 200M.)
    const auto fill = [&](const Buffer& b, int64_t n, int64_t seed) {
      std::vector<float> chunk(size_t(std::min<int64_t>(n, 1 << 20)));
      for (size_t i = 0; i < chunk.size(); ++i)
        chunk[i] = float((int64_t(i) * seed) % 2000) * 1e-3f - 1.0f;
      for (int64_t at = 0; at < n; at += int64_t(chunk.size()))
        backend.copy_from_host_as(b.as(t).at(at), chunk.data(),
                                  std::min<int64_t>(n - at, int64_t(chunk.size())));
    };
    fill(qkv, int64_t(rows) * (H + 2 * KV) * hd, 7919);
    fill(dout, int64_t(rows) * H * hd, 104729);
    const auto pass = [&] {
      backend.attention_forward(out.as(t), att.f32(), qkv.as(t), B, T, H, KV, hd);
      backend.attention_backward(dqkv.as(t), dout.as(t), qkv.as(t), out.as(t), att.f32(), B, T, H,
                                 KV, hd);
    };
    pass();  // (warm-up: plans, workspace)
    backend.synchronize();
    const double t0 = now_seconds();
    for (int i = 0; i < iterations; ++i) pass();
    backend.synchronize();
    const double seconds = (now_seconds() - t0) / iterations;
    return 3.5 * 2.0 * B * H * double(T) * T * hd / seconds / 1e12;
  } catch (const OutOfMemory&) {  // (no figure; the rest of the benchmark stands)
    return 0;
  }
}

constexpr int kStepsPerRound = 3;
/// Rounds where the command line gives no --train.steps: a deck's train.steps is a training's
/// length (5000 in gpt2-124m.deck: an hour of rounds on a GPU), not a benchmark's.
constexpr int kDefaultRounds = 9;

// Measures the step against the sgemm (below) and prints the table and the `bench:` line.
static int measure(Trainer& trainer, const Config& cfg, const std::string& deck, int rounds,
                   World& world) {
  Backend& backend = trainer.backend();  // the sgemm runs where the model runs
  // A shared machine's speed drifts by tens of percent within seconds: measure side by side, and
  // the two sides alike. Each round alternates 3 samples of the 2048³ sgemm with 3 training steps
  // and takes each side's fastest, every sample of about a step's length (a sample of the sgemm is as many
  // calls as fit in a step, at most 8: a GPU's 2048³ takes well under a millisecond, and its
  // kernel profile should stay the model's), and gives one ratio; the report is the median round.
  // Timing one ~80 ms call against a ~300 ms step would favour the sgemm: on a shared CPU the
  // shorter sample more often lands in a fast moment.
  const int N = cfg.train.micro_batch * cfg.model.seq_len;
  // A bf16 run's widening arena as the trainer reserved it (the planner's figure): the reference
  // GEMMs may grow it for themselves (every CPU kernel widens), which is not the training's.
  const size_t trainer_arena = backend.widening_bytes();
  const double sgemm_model = [&] {  // (the ranks' mean, as the square one's below)
    ReferenceGemm mlp(backend, N, cfg.model.d_ff, cfg.model.d_model);
    return min_avg_max(world.comm(), mlp.gflops(10, 1)).avg;
  }();
  ReferenceGemm square(backend, 2048, 2048, 2048);
  // The peak memory reported is the training's: from here on (the MLP-shaped GEMM's operands are
  // gone), less the square GEMM's, which stay through the steps.
  reset_memory_peaks();
  const double tokens = double(cfg.train.global_batch) * cfg.model.seq_len;
  const double step_flops = train_flops_per_token(cfg.model) * tokens;
  trainer.set_quiet(true);
  // Two warm-up steps, and more while a backend still times its kernels' ways (cuda: the
  // cross-entropy's take a call a micro-batch, three ways twice each), up to 12 — so that the
  // timed steps run as every later step of a training would.
  const Trainer::WarmUp warm = trainer.warm_up(2, 12);
  const double warm_step = warm.fastest_seconds;
  int64_t step = warm.steps;
  const int calls = std::clamp(int(std::lround(warm_step / square.seconds(1))), 1, 8);
  // The timed steps run without the kernel profile (TRELLIS_CUDA_PROFILE): its events around
  // every call are instrumentation, not training. The profile comes from as many steps after
  // them, whose time is reported beside (what the instrumentation costs).
  backend.pause_profile(true);
  // Rounds of kStepsPerRound steps (bench_rounds): a longer benchmark narrows the spread of the
  // median round rather than lengthening each round.
  const int per_round = kStepsPerRound;
  // A step is the job's: its slowest rank's (the next step waits for it), as the log's steps are.
  // ZeRO 1-2's parameter gathers run behind the next step's forward (parallel/zero.hpp): a step
  // timed alone would leave its own gathers out and find its predecessor's long done (during the
  // sgemm sample, which they would slow). Where the layout overlaps them (the same on every rank),
  // each timed step is the second of two back to back, waiting for the first's as every step of
  // a training does, and the gathers are waited for, untimed, before anything else runs.
  const bool overlapped_gathers = trainer.params().overlaps_param_gathers();
  const auto fastest_step_ms = [&](int steps) {
    double ms = 1e30;
    for (int i = 0; i < steps; ++i) {
      // Every rank starts together, as after a training step's last collective: a rank whose
      // sgemm sample ended early would otherwise count its wait for the others as its step's.
      MPI_Barrier(world.comm());
      if (overlapped_gathers) trainer.train_step(step++);
      ms = std::min(ms, min_avg_max(world.comm(), trainer.train_step(step++).seconds * 1e3).max);
      trainer.params().finish_param_gathers();
    }
    return ms;
  };
  struct Round {
    double sgemm, step_ms, ratio;
  };
  std::vector<Round> results;
  for (int r = 0; r < rounds; ++r) {
    Round round{0, 1e30, 0};
    for (int i = 0; i < per_round; ++i) {  // interleaved: an sgemm sample, then a step
      round.sgemm = std::max(round.sgemm, square.gflops(1, calls));
      round.step_ms = std::min(round.step_ms, fastest_step_ms(1));
    }
    // A rank's share of the step's work against a rank's sgemm (the ranks' mean): with several
    // ranks on a node each one's sgemm is its share of the cores, as its step is.
    round.sgemm = min_avg_max(world.comm(), round.sgemm).avg;
    round.ratio = step_flops / world.size() / (round.step_ms * 1e-3) / 1e9 / round.sgemm;
    results.push_back(round);
  }
  std::sort(results.begin(), results.end(), [](const Round& a, const Round& b) { return a.ratio < b.ratio; });
  const Round& mid = results[results.size() / 2];
  // The profiled steps: the same rounds' statistic (the median of each round's fastest), without
  // the reference GEMMs, which the profile should not count.
  // (every rank runs them where any profiles: the steps' collectives need every rank)
  double profiled_step_ms = 0;
  if (min_avg_max(world.comm(), backend.profiles() ? 1.0 : 0.0).max > 0) {
    backend.reset_profile();
    backend.pause_profile(false);
    std::vector<double> fastest;
    for (int r = 0; r < rounds; ++r) fastest.push_back(fastest_step_ms(per_round));
    std::sort(fastest.begin(), fastest.end());
    profiled_step_ms = fastest[fastest.size() / 2];
    backend.pause_profile(true);
  }
  const double step_ms = mid.step_ms, sgemm_square = mid.sgemm;
  const double gflops = step_flops / (step_ms * 1e-3) / 1e9;
  const ModelConfig& m = cfg.model;
  std::vector<std::vector<std::string>> rows = {
      {"model", strfmt("L%d H%d C%d T%d B%d vocab %d", m.layers, m.heads, m.d_model, m.seq_len,
                       cfg.train.global_batch, m.vocab)},
      // The threads the backend runs (system.threads, or as many as it chose: 0 = its own choice).
      {"threads", backend.on_device() ? "-"
                  : std::to_string(backend.threads()) +
                        (cfg.system.threads ? " (system.threads)"
                                            : " (system.threads = 0: the environment's or the "
                                              "cores')")},
      // bf16: the "sgemm" rows below are the backend's GEMM on bf16 tensors (fp32 accumulation)
      {"backend, precision", backend.name() + ", " + backend.precision()},
      {"backend details", backend.details().empty() ? "-" : backend.details()},
      {"kernel ways kept (timed; rank 0)",
       backend.kernel_ways().empty() ? "-" : backend.kernel_ways()},
      {strfmt("step%s (median round of %d; fastest of %d steps)",
              world.size() > 1 ? ", the slowest rank's" : "", rounds, per_round),
       strfmt("%.1f ms", step_ms)},
      {"tokens/s", strfmt("%.0f", tokens / (step_ms * 1e-3))},
      {"training GFLOP/s (model FLOPs)", strfmt("%.1f", gflops)},
      {strfmt("sgemm GFLOP/s, 2048³ (fastest of %d × %d calls%s)", per_round, calls,
              world.size() > 1 ? "; a rank's, the ranks' mean" : ""),
       strfmt("%.1f", sgemm_square)},
      {strfmt("sgemm GFLOP/s, %d×%d×%d (MLP shape%s)", N, m.d_ff, m.d_model,
              world.size() > 1 ? "; the ranks' mean" : ""),
       strfmt("%.1f", sgemm_model)},
      {world.size() > 1 ? "a rank's share of the step / its sgemm 2048³ (median round)"
                        : "step / sgemm 2048³ (median round)",
       strfmt("%.1f %%", 100 * mid.ratio)},
      {"ratio range over rounds",
       strfmt("%.1f – %.1f %%", 100 * results.front().ratio, 100 * results.back().ratio)},
  };
  const double peak_gflops = cfg.system.peak_gflops * world.size();
  const double reference_arena = double(backend.widening_bytes() - trainer_arena);
  const double peak_bytes =
      min_avg_max(world.comm(),
                  double(memory_stats().total_peak) - double(square.bytes()) - reference_arena)
          .max;  // the largest rank's (pipeline stages differ), as the plan's largest stage
  // What trellis plan says a rank needs, beside what it measured (gpu-check prints both).
  double planned_bytes = 0;
  for (const RankMemory& stage : layout_memory(cfg, run_memory_options(cfg, backend)))
    planned_bytes = std::max(planned_bytes, stage.total());
  // (after the peak above: its buffers are not the training's)
  const double attention_tflops =
      profiled_step_ms > 0 ? attention_alone_tflops(backend, cfg, 10) : 0;
  rows.push_back({"peak memory (measured: the training's allocations)", format_bytes(peak_bytes)});
  rows.push_back({"peak memory (trellis plan)", format_bytes(planned_bytes)});
  if (peak_gflops > 0) rows.push_back({"MFU (system.peak_gflops)", strfmt("%.1f %%", 100 * gflops / peak_gflops)});
  if (profiled_step_ms > 0)
    rows.push_back({strfmt("step while profiled (median of %d rounds' fastest)", rounds),
                    strfmt("%.1f ms (%+.1f %%)", profiled_step_ms,
                           100 * (profiled_step_ms / step_ms - 1))});
  if (attention_tflops > 0)
    rows.push_back({"attention alone, forward and backward (TFLOP/s, 10 passes)",
                    strfmt("%.4g", attention_tflops)});
  log(format_table("trellis bench: " + deck, {"what", "measured"}, rows));
  if (const std::string kernels = backend.profile_report(); !kernels.empty()) log(kernels);
  log(
      strfmt("bench: step_ms=%.3f tokens_per_s=%.1f gflops=%.2f sgemm_gflops=%.2f ratio=%.4f "
             "ratio_min=%.4f ratio_max=%.4f peak_bytes=%.0f planned_bytes=%.0f mfu=%.4f "
             "profiled_step_ms=%.3f attention_tflops=%.4g",
             step_ms, tokens / (step_ms * 1e-3), gflops, sgemm_square, mid.ratio,
             results.front().ratio, results.back().ratio, peak_bytes, planned_bytes,
             peak_gflops > 0 ? gflops / peak_gflops : 0.0, profiled_step_ms, attention_tflops));
  return kExitOk;
}

const char* const kBenchUsage =
    "usage: [mpirun -np N] trellis bench [DECK] [--section.key=value ...]\n"
    "  Times training steps of DECK (default: inputs/bench.deck, from the current directory or\n"
    "  else beside the executable's directory, as build/../inputs) next to a large sgemm through\n"
    "  the same backend, round by round, and prints the table and one `bench:` line\n"
    "  (step_ms, tokens_per_s, gflops, the ratio to sgemm, peak and planned bytes, mfu). Rounds\n"
    "  of 3 steps: train.steps / 3 of them where --train.steps is given, else at most 9 (a\n"
    "  deck's train.steps is a training's length); at ZeRO 1-2 over several ranks each timed\n"
    "  step follows an untimed one, whose parameter gathers it waits for as in training. Training\n"
    "  steps only: no checkpoints, no held-out evaluation, nothing written. Deck keys: trellis\n"
    "  train --help. With a kernel profile (TRELLIS_CUDA_PROFILE=1) the timed steps run without\n"
    "  it and as many steps after them with it: the profile is theirs, and profiled_step_ms their\n"
    "  time (0 without a profile); attention_tflops is then the rate of one layer's attention\n"
    "  alone, forward and backward, 10 passes back to back.\n";

namespace {

/// train.steps / 3 rounds (at least one) where --train.steps is given, else as many up to
/// kDefaultRounds.
int bench_rounds(const Config& cfg, const std::vector<std::string>& overrides) {
  const int rounds = std::max<int>(1, int(cfg.train.steps / kStepsPerRound));
  for (const std::string& o : overrides)
    if (o.rfind("--train.steps=", 0) == 0) return rounds;
  return std::min(rounds, kDefaultRounds);
}

/// inputs/bench.deck from here, else from the directory above the executable's (build/trellis
/// of a checkout run from elsewhere).
std::string default_bench_deck() {
  const fs::path here = "inputs/bench.deck";
  std::error_code ec;
  if (fs::exists(here, ec)) return here.string();
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path beside = exe.parent_path().parent_path() / "inputs" / "bench.deck";
    if (fs::exists(beside, ec)) return beside.string();
  }
  return here.string();  // (its load says it is not there)
}

}  // namespace

int bench_main(const std::vector<std::string>& args, World& world) {
  std::string deck;
  std::vector<std::string> overrides;
  Config cfg;
  std::unique_ptr<Trainer> trainer;
  std::string error;
  error = setup_error([&] {
    // As tune reads its arguments: --section.key=value overrides, at most one deck.
    for (const auto& a : args) {
      if (a.rfind("--", 0) == 0)
        overrides.push_back(a);
      else if (deck.empty())
        deck = a;
      else
        throw UserError("more than one deck given ('" + deck + "', '" + a +
                        "'); overrides are --section.key=value");
    }
    if (deck.empty()) deck = default_bench_deck();
    cfg = load_config(deck, overrides, world.size());
    cfg.eval.every = 0;  // training steps only: no held-out data to read
  });
  // Every rank the same settings before the trainer's collectives.
  error = agree_on_error(world.comm(), error);
  if (error.empty()) error = settings_differ_from_rank0(world.comm(), cfg.effective);
  if (error.empty())
    error = setup_error([&] { trainer = std::make_unique<Trainer>(cfg, world.comm()); });
  if (failed_together(world.comm(), error, "trellis bench")) return kExitBadInput;

  // Collective work as training is: bad input met on the way is status 2, a device error or a
  // host out of memory one message and status 1, a rank that stops the watchdog's (status 4).
  return run_collective_phase(world, cfg.system.hang_timeout_s, "trellis bench",
                              [&] {
                                return measure(*trainer, cfg, deck, bench_rounds(cfg, overrides),
                                               world);
                              });
}

}  // namespace trellis
