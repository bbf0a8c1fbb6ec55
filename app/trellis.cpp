// trellis — trains GPT-style transformers as an HPC job. This file only reads the subcommand and
// hands over to lib/: `train` → lib/train/train_main.cpp (the job's set-up), whose Trainer
// (lib/train/trainer.cpp) trains: Trainer::train_step is one step;
// `plan` → lib/plan/plan_main.cpp, `tune` → lib/train/tune.cpp, `eval` →
// lib/train/evaluation.cpp, `generate` → lib/infer/generate.cpp, `export` → lib/ckpt/export_hf.cpp.
#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/blas_kernels.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/export_hf.hpp"
#include "ckpt/stored_config.hpp"
#include "comm/world.hpp"
#include "config/config.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/timer.hpp"
#include "infer/generate.hpp"
#include "plan/plan_main.hpp"
#include "train/bench.hpp"
#include "train/stop_signals.hpp"
#include "train/trainer.hpp"
#include "train/tune.hpp"

namespace {

const char* kUsage = R"(trellis — trains GPT-style transformers on clusters

usage:
  mpirun -np N trellis train DECK [--section.key=value ...]   train from an input deck
  trellis plan DECK [--gpus N --gpu-mem 80GiB ...]            memory per rank and ranked layouts
                                                              before submitting (no MPI needed)
  trellis bench [DECK] [--section.key=value ...]              step speed vs. this machine's sgemm
  mpirun -np N trellis tune DECK [--candidates K --steps S --out FILE] [--section.key=value ...]
                                                              run the best layouts for N ranks a few
                                                              steps each; write the fastest as a deck
  trellis inspect CKPT                                        a checkpoint's step, layout, deck,
                                                              tensors; verifies every checksum
  mpirun -np N trellis eval CKPT [--section.key=value ...]    the held-out loss of a checkpoint
                                                              ([eval]), on any layout of N ranks
  mpirun -np TP trellis generate CKPT --prompt TEXT [...]     sample text from a trained model
                                                              (KV cache, tensor-parallel over TP)
  trellis export CKPT --format hf-gpt2 OUTDIR                 a Hugging Face GPT-2 model directory
                                                              (config.json, model.safetensors)
  trellis train --help                                        every deck key: type, default, meaning
  trellis --help                                              this text

exit status: 0 done, 1 internal failure, 2 bad input (deck, command line, files),
             3 stopped early with a checkpoint (signal, system.max_hours, TRELLIS_DEADLINE):
             resubmit to continue, 4 a rank made no progress for system.hang_timeout_s
             (trellis inspect: 0 sound, 1 damaged, 2 no such file)
)";

bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

std::string g_command;  // the subcommand, for end_job_on_uncaught's message

/// std::terminate's handler once MPI runs: an exception nothing caught (it reaches here without
/// unwinding: no destructor waits for a peer first) ends the whole job, saying which rank and
/// what, with status 1 (2 where memory ran out, as elsewhere).
[[noreturn]] void end_job_on_uncaught() {
  std::string what = "std::terminate without an exception";
  if (const std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::bad_alloc& b) {
      trellis::abort_out_of_memory(MPI_COMM_WORLD, "trellis " + g_command, b);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "an exception of unknown type";
    }
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  trellis::log_error("trellis " + g_command + ": rank " + std::to_string(rank) + ": error: " + what);
  MPI_Abort(MPI_COMM_WORLD, trellis::kExitFailure);
  std::abort();
}

}  // namespace

int main(int argc, char** argv) {
  trellis::count_from_process_start();  // (a run's wall time counts its set-up)
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? trellis::kExitBadInput : trellis::kExitOk;
  }
  const std::string command = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  // Before anything else: the commands that compute may need to start again with better BLAS
  // kernels than OpenBLAS picked (lib/backend/cpu/blas_kernels.hpp).
  const bool parallel = command == "train" || command == "bench" || command == "tune" ||
                        command == "generate" || command == "eval";
  if (command == "train") trellis::block_stop_signals();  // pending across the re-execution
  if (parallel) trellis::use_best_blas_kernels(argv);
  if (command == "train") trellis::hold_stop_signals();
  else if (parallel || command == "export" || command == "inspect")  // (long reads, in a job too)
    trellis::note_and_ignore_stop_signal(command);
  if (command == "bench" && wants_help(rest)) {
    std::fputs(trellis::kBenchUsage, stdout);
    return trellis::kExitOk;
  }
  if (command == "train" && wants_help(rest)) {
    std::printf("%s\ndeck keys (also as --section.key=value on the command line):\n\n%s", kUsage,
                trellis::keys_help().c_str());
    return trellis::kExitOk;
  }
  if (command == "plan") {  // no MPI needed: arithmetic on the deck
    if (wants_help(rest)) {
      std::fputs(trellis::kPlanUsage, stdout);
      return trellis::kExitOk;
    }
    return trellis::plan_main(rest);
  }
  if (command == "inspect") {  // no MPI needed: a serial read of one file
    if (wants_help(rest)) {
      std::fputs(trellis::kInspectUsage, stdout);
      return trellis::kExitOk;
    }
    if (rest.size() != 1) {
      std::fprintf(stderr,
                   "trellis inspect: error: which checkpoint? usage: trellis inspect CKPT\n");
      return trellis::kExitBadInput;
    }
    try {
      return trellis::inspect_checkpoint(trellis::resolve_checkpoint(rest[0]), stdout,
                                         trellis::stored_model_datasets);
    } catch (const trellis::UserError& e) {  // no such file; a directory without checkpoints
      std::fprintf(stderr, "trellis inspect: error: %s\n", e.what());
      return trellis::kExitBadInput;
    }
  }
  if (command == "eval" && wants_help(rest)) {  // before Kokkos, which reads --help too
    std::fputs(trellis::kEvalUsage, stdout);
    return trellis::kExitOk;
  }
  if (command == "tune" && wants_help(rest)) {  // before Kokkos, which reads --help too
    std::fputs(trellis::kTuneUsage, stdout);
    return trellis::kExitOk;
  }
  if (command == "generate" && wants_help(rest)) {  // before Kokkos, which reads --help too
    std::fputs(trellis::generate_usage(), stdout);
    return trellis::kExitOk;
  }
  if (command == "export") return trellis::export_main(rest);  // serial, like inspect
  if (!parallel) {
    std::fprintf(stderr, "trellis: error: unknown command '%s'\n\n%s", command.c_str(), kUsage);
    return trellis::kExitBadInput;
  }

  trellis::World world(&argc, &argv);
  trellis::set_log_rank(world.rank());
  int status;
  {
    // Every rank the same subcommand (mpirun's MPMD form can start others, which would wait on
    // collectives the others never join).
    // eval and generate choose their checkpoint together while they read their arguments: every
    // rank the same command line, too.
    std::vector<std::pair<std::string, std::string>> same = {{"command", command}};
    if (command == "eval" || command == "generate")
      for (size_t i = 0; i < rest.size(); ++i)
        same.emplace_back("argument " + std::to_string(i + 1), rest[i]);
    std::string error = trellis::settings_differ_from_rank0(world.comm(), same);
    // Not given the command line: Kokkos would parse options of its own there (--threads,
    // --numa, --device-id, --kokkos-*), and abort on a value that is not a number, before our
    // parser could name the unknown key. Its environment variables still apply (the host threads
    // are system.threads): one it cannot read throws, which is the user's to fix, on every rank.
    std::optional<Kokkos::ScopeGuard> kokkos;
    try {
      kokkos.emplace();
    } catch (const std::exception& e) {
      if (error.empty())
        error = std::string("Kokkos did not start (check the KOKKOS_* environment variables): ") +
                e.what();
    }
    if (trellis::failed_together(world.comm(), error, "trellis " + command))
      return trellis::kExitBadInput;
    // What the commands do not turn into an exit status themselves — a failed internal check
    // (std::logic_error) on one rank, while the others may wait for it in a collective — ends
    // the whole job with the rank's message (end_job_on_uncaught), not std::terminate's.
    g_command = command;
    std::set_terminate(end_job_on_uncaught);
    if (command == "train") {
      if (rest.empty() || rest[0].rfind("--", 0) == 0) {
        if (world.rank() == 0)
          trellis::log_error("trellis train: error: which deck? usage: trellis train DECK");
        status = trellis::kExitBadInput;
      } else {
        std::vector<std::string> overrides(rest.begin() + 1, rest.end());
        status = trellis::train_main(rest[0], overrides, world);
      }
    } else if (command == "tune") {
      status = trellis::tune_main(rest, world);
    } else if (command == "generate") {
      status = trellis::generate_main(rest, world);
    } else if (command == "eval") {
      status = trellis::eval_main(rest, world);
    } else {
      status = trellis::bench_main(rest, world);
    }
  }
  // HDF5 after a failed file close would crash in MPI_Finalize (core/error.hpp): every rank
  // ends here instead, with the same status (mpirun and srun report it as usual). Each first
  // waits, up to 10 s, for the others to have flushed their output too: once one rank leaves
  // without MPI_Finalize, mpirun ends the rest, which could cut what they had left to write.
  if (!trellis::library_cleanup_skipped().empty()) {
    std::fflush(nullptr);
    MPI_Request everyone_here;
    MPI_Ibarrier(world.comm(), &everyone_here);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int done = 0; !done && std::chrono::steady_clock::now() < until;) {
      MPI_Test(&everyone_here, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::_Exit(status);
  }
  return status;
}
