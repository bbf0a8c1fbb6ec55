#include "train/bench.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
#include "plan/flops.hpp"
#include "train/trainer.hpp"

namespace trellis {

/// GFLOP/s of out (M,N) = A (M,K)·B (N,K)ᵀ through the backend (in its memory): the best of
/// `reps` timed calls.
static double gemm_gflops(Backend& be, int M, int N, int K, int reps) {
  Buffer a(MemKind::Scratch, sizeof(float) * M * K, be.allocator()),
      b(MemKind::Scratch, sizeof(float) * N * K, be.allocator()),
      c(MemKind::Scratch, sizeof(float) * M * N, be.allocator());
  std::vector<float> host(std::max(int64_t(M), int64_t(N)) * K);
  for (int64_t i = 0; i < int64_t(M) * K; ++i) host[i] = float((i * 7919) % 1000) * 1e-3f;
  be.copy_from_host(a.data(), host.data(), a.bytes());
  for (int64_t i = 0; i < int64_t(N) * K; ++i) host[i] = float((i * 104729) % 1000) * 1e-3f;
  be.copy_from_host(b.data(), host.data(), b.bytes());
  be.matmul_forward(c.f32(), a.f32(), b.f32(), nullptr, M, K, N);  // warm-up
  be.synchronize();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_seconds();
    be.matmul_forward(c.f32(), a.f32(), b.f32(), nullptr, M, K, N);
    be.synchronize();  // a device backend returns before the GEMM is done
    best = std::min(best, now_seconds() - t0);
  }
  return 2.0 * M * N * K / best / 1e9;
}

int bench_main(const std::vector<std::string>& args, World& world) {
  std::string deck = "inputs/bench.deck";
  std::vector<std::string> overrides;
  for (const auto& a : args) {
    if (a.rfind("--", 0) == 0 || a.find('=') != std::string::npos) overrides.push_back(a);
    else deck = a;
  }
  Config cfg;
  std::unique_ptr<Trainer> trainer;
  std::string error;
  try {
    cfg = load_config(deck, overrides, world.size());
    trainer = std::make_unique<Trainer>(cfg, world.comm());
  } catch (const UserError& e) {
    error = e.what();
  }
  if (failed_together(world.comm(), error, "trellis bench")) return kExitBadInput;

  Backend& backend = trainer->backend();  // the sgemm runs where the model runs
  // A shared machine's speed drifts: measure side by side. Each round times the sgemm (best of a
  // few calls) and then a few training steps, and gives one ratio; the report is the median
  // round. train.steps is the total number of timed steps.
  const int N = cfg.train.micro_batch * cfg.model.seq_len;
  const double sgemm_model = gemm_gflops(backend, N, cfg.model.d_ff, cfg.model.d_model, 10);
  const double tokens = double(cfg.train.global_batch) * cfg.model.seq_len;
  const double step_flops = train_flops_per_token(cfg.model) * tokens;
  trainer->set_quiet(true);
  for (int s = 0; s < 2; ++s) trainer->train_step(s);  // warm-up
  // Rounds of 3 steps: as many rounds as train.steps allows (at least one), so that a longer
  // benchmark narrows the spread of the median round rather than lengthening each round.
  const int per_round = 3, rounds = std::max<int>(1, int(cfg.train.steps) / per_round);
  struct Round {
    double sgemm, step_ms, ratio;
  };
  std::vector<Round> results;
  int64_t step = 2;
  for (int r = 0; r < rounds; ++r) {
    Round round;
    round.sgemm = gemm_gflops(backend, 2048, 2048, 2048, 3);
    std::vector<double> ms;
    for (int i = 0; i < per_round; ++i) ms.push_back(trainer->train_step(step++).seconds * 1e3);
    std::sort(ms.begin(), ms.end());
    round.step_ms = ms[ms.size() / 2];
    round.ratio = step_flops / (round.step_ms * 1e-3) / 1e9 / round.sgemm;
    results.push_back(round);
  }
  std::sort(results.begin(), results.end(), [](const Round& a, const Round& b) { return a.ratio < b.ratio; });
  const Round& mid = results[results.size() / 2];
  const double step_ms = mid.step_ms, sgemm_square = mid.sgemm;
  const double gflops = step_flops / (step_ms * 1e-3) / 1e9;
  const ModelConfig& m = cfg.model;
  std::vector<std::vector<std::string>> rows = {
      {"model", strfmt("L%d H%d C%d T%d B%d vocab %d", m.layers, m.heads, m.d_model, m.seq_len,
                       cfg.train.global_batch, m.vocab)},
      {"threads", cfg.system.threads ? std::to_string(cfg.system.threads) : "all"},
      // bf16: the model's GEMMs and the "sgemm" rows below take bf16 operands (fp32 accumulation)
      {"backend, precision", backend.name() + ", " + backend.precision()},
      {"backend details", backend.details().empty() ? "-" : backend.details()},
      {strfmt("step (median round of %d, %d steps each)", rounds, per_round), strfmt("%.1f ms", step_ms)},
      {"tokens/s", strfmt("%.0f", tokens / (step_ms * 1e-3))},
      {"training GFLOP/s (model FLOPs)", strfmt("%.1f", gflops)},
      {"sgemm GFLOP/s, 2048³", strfmt("%.1f", sgemm_square)},
      {strfmt("sgemm GFLOP/s, %d×%d×%d (MLP shape)", N, m.d_ff, m.d_model), strfmt("%.1f", sgemm_model)},
      {"step / sgemm 2048³ (median round)", strfmt("%.1f %%", 100 * mid.ratio)},
      {"ratio range over rounds", strfmt("%.1f – %.1f %%", 100 * results.front().ratio, 100 * results.back().ratio)},
  };
  const double peak_gflops = cfg.system.peak_gflops * world.size();
  const double peak_bytes = double(memory_stats().total_peak);
  rows.push_back({"peak memory (measured allocations)", format_bytes(peak_bytes)});
  if (peak_gflops > 0) rows.push_back({"MFU (system.peak_gflops)", strfmt("%.1f %%", 100 * gflops / peak_gflops)});
  log(format_table("trellis bench: " + deck, {"what", "measured"}, rows));
  if (const std::string kernels = backend.profile_report(); !kernels.empty()) log(kernels);
  log(strfmt("bench: step_ms=%.3f tokens_per_s=%.1f gflops=%.2f sgemm_gflops=%.2f ratio=%.4f "
             "ratio_min=%.4f ratio_max=%.4f peak_bytes=%.0f mfu=%.4f", step_ms,
             tokens / (step_ms * 1e-3), gflops, sgemm_square, mid.ratio, results.front().ratio,
             results.back().ratio, peak_bytes, peak_gflops > 0 ? gflops / peak_gflops : 0.0));
  return kExitOk;
}

}  // namespace trellis
