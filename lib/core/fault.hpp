// Fault injection for the robustness tests (tests/cli/test_killed_rank.sh; README, "When things go
// wrong"). One environment variable names one fault:
//
//   TRELLIS_FAULT_KILL=POINT:STEP[:RANK]
//
// makes world rank RANK (default: the last rank) kill itself with SIGKILL — no cleanup, no
// message, as the kernel's OOM killer or a failing node would — the first time it reaches the fault
// point POINT while step STEP (1-based, as the log counts) runs. Points:
//   forward      the start of a micro-batch's forward pass
//   dp, tp, pp   entering any operation on the communicator of that name (lib/comm/comm.hpp):
//                dp = the data-parallel gradient all-reduce / reduce-scatter (with ZeRO 3
//                first the parameter gathers of forward), tp = the tensor-parallel
//                all-reduces of forward and backward, pp = pipeline messages; the other
//                ranks of the group are then waiting inside the collective
//   checkpoint   halfway through writing the checkpoint of step STEP (its datasets)
// TRELLIS_FAULT_STOP=POINT:STEP[:RANK] (the same syntax and points) stops that rank with SIGSTOP
// instead: a rank that hangs rather than dies, which only the hang watchdog ends
// (core/watchdog.hpp, system.hang_timeout_s; tests/cli/test_killed_rank.sh).
// TRELLIS_FAULT_SIGNAL=POINT:STEP[:RANK] sends that rank SIGUSR1, the default stop signal, as a
// batch system would at that moment (tests/cli/test_stop_resume.sh: during a checkpoint write).
// Unset — every real run — each fault point costs one predictable branch. Two more variables,
// read by the trainer: TRELLIS_FAULT_NAN_AT_STEP=STEP (that step's gradient norm becomes NaN:
// tests/cli/test_nan.sh) and TRELLIS_FAULT_STEP_MS=N (each training step, and each token
// `generate` makes, first sleeps N ms, outside its timing: a run lasts long enough for
// tests/cli/test_slurm.sh's stop signal on any machine, a generation for test_generate.sh's).
// TRELLIS_FAULT_ROOM_FOR_DATA=1: the free-space check before a checkpoint counts its data alone,
// not the whole file, and takes no room for the file (CheckpointRoom), so that
// tests/cli/test_full_disk.sh can fill the disk in mid-write and at the close.
// TRELLIS_FAULT_NO_FALLOCATE=1: the room is taken as on a filesystem that cannot allocate past a
// file's end (only the metadata's, in a file PATH.room beside it).
// TRELLIS_FAULT_FILL_DISK=room|data|close|closed: rank 0 fills the checkpoint's filesystem (a file
// .trellis-fault-filler beside it) as another job taking the disk meanwhile would: to the last
// byte just before it takes the file's room in the file (room), or but for 8 KiB once it has
// taken it, before the data (data), or just before the close (close), or to the last byte once
// the file is closed and its unused room freed (closed) (lib/ckpt/disk_space.cpp).
// TRELLIS_FAULT_REMOVE_CHOSEN=setup|load: a reader of a directory's newest checkpoint removes the
// file it has just chosen, once, as a run publishing there may meanwhile: `trellis eval` and
// `generate` in their set-up or before their load, `export` at setup, a training run's start
// point (checkpoint.resume = DIR) at load (ChosenCheckpoint, lib/ckpt/chosen.cpp;
// tests/cli/test_eval.sh, test_generate.sh, test_export.sh, test_help_and_paths.sh);
// TRELLIS_FAULT_REMOVE_CHOSEN=open removes it in every collective read once the ranks hold it
// open, before HDF5 opens it (read_checkpoint: the ranks read the file they hold).
// TRELLIS_FAULT_INTERNAL=RANK: see fault_internal_error below.
#pragma once
#include <cstdint>
#include <string_view>

namespace trellis {

/// Which rank this process is (set once at start-up; without it no fault fires).
void set_fault_rank(int world_rank, int world_size);
/// The step now running, 1-based.
void set_fault_step(int64_t step);
/// Kills this process with SIGKILL if TRELLIS_FAULT_KILL names this point, the current step and
/// this rank (stops it with SIGSTOP if TRELLIS_FAULT_STOP does). A bad value throws UserError.
void fault_point(std::string_view point);
/// Sleeps TRELLIS_FAULT_STEP_MS milliseconds (unset: returns at once).
void fault_step_delay();
/// TRELLIS_FAULT_INTERNAL=RANK: that world rank fails an internal check here (std::logic_error,
/// as TRELLIS_CHECK throws) — the trainer's set-up calls it, while the other ranks wait in a
/// collective (tests/cli/test_killed_rank.sh: the job ends with status 1 and the rank's message).
void fault_internal_error();

}  // namespace trellis
