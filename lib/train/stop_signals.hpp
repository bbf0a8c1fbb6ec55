#pragma once
// How a training run stops early on a signal, and what the other commands do with one. A signal
// handler only sets a flag (GROMACS's protocol); the ranks agree on it at the next step boundary,
// inside a collective (Trainer::should_stop), so every rank stops after the same step.

#include <string>

namespace trellis {

/// `trellis train`'s first steps, before MPI starts: block_stop_signals() first (a blocked
/// signal stays pending, across the re-execution that picks BLAS kernels too), then
/// hold_stop_signals(): SIGUSR1 and SIGTERM are recorded instead of ending the process, until
/// train_main knows which one system.stop_signal names. A stop signal in the job's first moments
/// (a requeue sent while the ranks start) then stops the run at its first step boundary, as one
/// a minute later would; the other signal then takes its default action (it would have ended
/// the rank).
void block_stop_signals();
void hold_stop_signals();
/// The other commands that run under a batch system (eval, tune, generate, bench, export,
/// inspect): SIGUSR1, the
/// stop signal a training job is sent before its time limit (`--signal=USR1@…`), is said on stderr
/// and otherwise ignored — such a command has no checkpoint to write, and its signal's default
/// action would end it with no word (exit 138). SIGTERM still ends it.
void note_and_ignore_stop_signal(const std::string& command);

/// From as early as the deck is known: a signal that comes during the set-up or a long resume
/// then stops the run at its first step boundary instead of killing the rank (and the requeue).
/// One held since the start (hold_stop_signals) counts as a request. The other signal: SIGTERM
/// (stop signal USR1) ends the rank, now if it was held; SIGUSR1 (stop signal TERM) is said on
/// stderr and ignored, as in the other commands — its default action would end the rank with no
/// checkpoint (a USR1 run's stop sent to a TERM run).
void catch_stop_signal(const std::string& stop_signal);  // "USR1" or "TERM" (system.stop_signal)

/// How many times the stop signal came since catch_stop_signal: 1 asks for a checkpoint, then a
/// stop; 2 or more for a stop without a new checkpoint. A signal within a second of the first is
/// the same request (one stop that reached a rank along two paths: directly and from mpirun).
int stop_requests();

}  // namespace trellis
