// `trellis train`'s entry point (train_main), and what every command's set-up shares: the check
// that a layout fits its node's memory, and the collective phases that agree on bad input
// (run_collective_phase). The training itself is trainer.cpp's.
#include "train/trainer.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/watchdog.hpp"
#include "parallel/schedule.hpp"
#include "plan/flops.hpp"
#include "plan/memory.hpp"
#include "train/device_links.hpp"
#include "train/stop_signals.hpp"

namespace trellis {

// What a rank holds on the host besides what trellis plan counts: the synthetic source's tokens
// (int32; the held-out source walks the training corpus again before its own, then drops it) and
// a step's pipeline schedule (two passes a micro-batch and model chunk). Token files are mapped,
// not read in: the page cache holds them.
static double host_data_bytes(const Config& cfg) {
  const bool synthetic = cfg.data.source == "synthetic";
  const double corpus = synthetic ? double(cfg.data.synthetic_tokens) : 0;
  const double held_out =
      synthetic && cfg.eval.every > 0
          ? corpus + double(cfg.eval.batches) * double(cfg.train.global_batch) * cfg.model.seq_len
          : 0;
  const double micro_batches = double(cfg.train.global_batch) /
                               (double(cfg.parallel.dp) * double(cfg.train.micro_batch));
  return sizeof(int32_t) * (corpus + held_out) +
         2 * sizeof(PipelineOp) * micro_batches * cfg.parallel.virtual_stages;
}

// A layout that cannot fit its node, said before any allocation: Linux overcommits, so each
// allocation of such a run may succeed and the kernel's out-of-memory killer end the job later
// without a word. The bar is certain failure: on the CPU trellis plan's smallest rank (its figures
// are within 10 % of the measured peaks), on any backend the data's host memory, times the ranks
// on this node, against memory and swap.
void check_node_memory(const Config& cfg, int local_ranks) {
  const double node = host_meminfo_bytes("MemTotal") + host_meminfo_bytes("SwapTotal");
  if (node <= 0) return;
  double smallest = cfg.system.backend == "cpu" ? INFINITY : 0;  // (GPU memory: its allocator's)
  if (cfg.system.backend == "cpu")
    for (const RankMemory& r : layout_memory(cfg, run_memory_options(cfg, local_ranks)))
      smallest = std::min(smallest, r.total());
  const double data = host_data_bytes(cfg), rank = smallest + data;
  if (rank * local_ranks <= node) return;
  std::string parts = smallest > 0 ? "trellis plan's smallest rank: " + format_bytes(smallest) : "";
  if (data >= 0.1 * rank)
    parts += (parts.empty() ? "" : "; ") + std::string("data: ") + format_bytes(data) +
             " (data.synthetic_tokens, eval.batches, and train.global_batch / "
             "train.micro_batch micro-batches a step)";
  const std::string advice =
      data >= 0.5 * rank
          ? "fewer ranks a node, a smaller data.synthetic_tokens or eval.batches, fewer "
            "micro-batches a step, or token files (data.source = tokens: mapped, not held)"
          : strfmt("more nodes, fewer ranks a node, a smaller train.micro_batch, parallel.zero or "
                   "a smaller model (trellis plan %s --gpus N ranks the layouts that fit)",
                   cfg.deck_path.c_str());
  throw UserError(strfmt(
      "this run needs at least %s a rank (%s), %s for the %d rank(s) on this node, more than its "
      "%s of memory and swap: %s",
      format_bytes(rank).c_str(), parts.c_str(), format_bytes(rank * local_ranks).c_str(),
      local_ranks, format_bytes(node).c_str(), advice.c_str()));
}

int train_main(const std::string& deck, const std::vector<std::string>& overrides, World& world) {
  // Phase 1: everything that bad input can break, on every rank; then all ranks agree.
  Config cfg;
  std::unique_ptr<Trainer> trainer;
  std::string error = setup_error([&] {
    set_fault_rank(world.rank(), world.size());  // tests only: TRELLIS_FAULT_KILL
    cfg = load_config(deck, overrides, world.size());
    check_writable_dir(cfg.run.dir, "run.dir");
    check_writable_dir(cfg.checkpoint.dir, "checkpoint.dir");
  });
  if (failed_together(world.comm(), error, "trellis")) return kExitBadInput;
  if (failed_together(world.comm(), settings_differ_from_rank0(world.comm(), cfg.effective),
                      "trellis"))
    return kExitBadInput;
  const int local_ranks = node_ranks(world.comm()).size;
  if (failed_together(world.comm(), setup_error([&] { check_node_memory(cfg, local_ranks); }),
                      "trellis"))
    return kExitBadInput;
  catch_stop_signal(cfg.system.stop_signal);
  // Ranks on GPUs that may talk through NCCL: CUDA modules loaded at start, not at a kernel's
  // first launch. A lazy load waits for the device's queued work to drain (CUDA's lazy loading
  // guide), and an NCCL kernel in that queue spins until its peer rank arrives — which may be
  // waiting on this rank in turn: the first step (new kernels while gradient buckets and pipeline
  // messages fly) could hang. Costs start-up time and device memory for every kernel of every
  // library; CUDA_MODULE_LOADING=LAZY set by hand stays. (Set after MPI_Init, which a CUDA-aware
  // MPI may use to start CUDA, which reads it then: slurm/train.sbatch sets it before.)
  if (cfg.system.backend == "cuda" && cfg.system.device_comm != "staged" && world.size() > 1)
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  {
    // The trainer's set-up has collectives (the grid, NCCL's communicators): watched as the run
    // is, so that a rank that never arrives ends the job rather than keeping it waiting.
    Watchdog watchdog(cfg.system.hang_timeout_s, world.rank());
    watchdog_beat("setting up the trainer");
    error = setup_error([&] {
      try {
        trainer = std::make_unique<Trainer>(cfg, world.comm());
      } catch (const std::bad_alloc& e) {
        abort_out_of_memory(world.comm(), "trellis", e);
      }
      // The same file under two names (eval.path ./val.bin, data.path *.bin): the deck's check
      // compares the keys' text only.
      if (const TokenSource* held_out = trainer->held_out_source())
        if (const std::string shared = held_out_overlap(trainer->source(), *held_out);
            !shared.empty())
          throw UserError(shared);
    });
  }
  if (failed_together(world.comm(), error, "trellis")) return kExitBadInput;
  // This job's hold on the directories rank 0 writes, until it ends: a second job started on
  // the same run.dir or checkpoint.dir (a job submitted twice) stops here, before either reads a
  // checkpoint, instead of both writing there.
  struct Locks {  // let go in reverse: ckpt/ before the run.dir it may be inside
    std::vector<std::unique_ptr<DirLock>> held;
    ~Locks() {
      while (!held.empty()) held.pop_back();
    }
  } locks;
  error = setup_error([&] {
    if (world.rank() != 0) return;
    locks.held.push_back(std::make_unique<DirLock>(cfg.run.dir, "run.dir"));
    std::error_code ec;
    if (!std::filesystem::equivalent(cfg.run.dir, cfg.checkpoint.dir, ec))  // (one lock a dir)
      locks.held.push_back(std::make_unique<DirLock>(cfg.checkpoint.dir, "checkpoint.dir"));
  });
  if (failed_together(world.comm(), error, "trellis")) return kExitBadInput;
  // Phase 2: the run.
  return run_collective_phase(world, cfg.system.hang_timeout_s, "trellis", [&] {
    trainer->run();
    const bool stopped_early = trainer->stopped_early();
    // Torn down while still watched: an NCCL communicator is destroyed together with its other
    // ranks, so a rank that never gets there would keep this one waiting past the run's end.
    watchdog_beat("tearing down (communicators, device memory)");
    trainer.reset();
    if (!stopped_early) return int(kExitOk);
    // For the batch script: this job stopped on purpose, whatever status the launcher reports
    // (srun --kill-on-bad-exit signals the ranks still exiting once the first has exited 3).
    if (const char* file = std::getenv("TRELLIS_STOP_FILE"); file && *file && world.rank() == 0) {
      std::ofstream marker(file);
      marker << "stopped after checkpointing: requeue\n";
      marker.close();
      // Without it a status the launcher mangles (srun: 143, 137) is not requeued: say so.
      if (!marker)
        log(std::string("warning: TRELLIS_STOP_FILE = '") + file + "': cannot write it (" +
            std::strerror(errno) + "): a batch script that requeues on it will not see that "
            "this job stopped on purpose; resubmit if it does not go on");
    }
    return int(kExitRequeue);
  });
}

int run_collective_phase(World& world, double hang_timeout_s, const std::string& who,
                         const std::function<int()>& work) {
  Watchdog watchdog(hang_timeout_s, world.rank());
  try {
    return work();
  } catch (const UserError& e) {
    // Bad input found on the way (an explicit resume path that does not load, a full disk):
    // every rank got the same error from a collective.
    if (world.rank() == 0) log_error(who + ": error: " + std::string(e.what()));
    return kExitBadInput;
  } catch (const CollectiveError& e) {
    if (world.rank() == 0) log_error(who + ": error: " + std::string(e.what()));
    return kExitFailure;
  } catch (const RankInputError& e) {  // this rank's alone: the others wait in a collective
    log_error(strfmt("%s: rank %d: error: %s", who.c_str(), world.rank(), e.what()));
    MPI_Abort(world.comm(), kExitBadInput);
  } catch (const std::bad_alloc& e) {  // (a scratch grown mid-run): the layout asks too much
    abort_out_of_memory(world.comm(), who, e);
  } catch (const std::exception& e) {
    log_error(strfmt("%s: rank %d: error: %s", who.c_str(), world.rank(), e.what()));
    MPI_Abort(world.comm(), kExitFailure);
  }
  return kExitFailure;
}

}  // namespace trellis
