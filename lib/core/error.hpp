// Errors that end a run. A UserError (bad deck, bad file, bad layout) ends every rank with exit
// status 2 and one message; anything else is an internal failure (status 1).
#pragma once
#include <stdexcept>
#include <string>

namespace trellis {

/// Exit statuses a job script can rely on (README, "Exit statuses").
enum ExitStatus : int {
  kExitOk = 0,
  kExitFailure = 1,   // internal error, a failed collective, a crash we caught
  kExitBadInput = 2,  // the deck, the command line or an input file is wrong
  kExitRequeue = 3,   // stopped early (signal, system.max_hours) with a checkpoint: resubmit
  kExitHang = 4,      // no progress for system.hang_timeout_s (core/watchdog.hpp): the job ended
};

/// Something the user can fix: the message names the key, value or file.
class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what) : std::runtime_error(what) {}
};

/// A failure every rank detects together (from values already reduced over all ranks, like the
/// loss): the job can end cleanly with status 1 instead of aborting.
class CollectiveError : public std::runtime_error {
 public:
  explicit CollectiveError(const std::string& what) : std::runtime_error(what) {}
};

/// Bad input one rank finds alone in the middle of collective work — a data file rewritten under
/// a running job, so that a window now holds a token id past model.vocab. The other ranks wait in
/// a collective and cannot be told, so the job ends at once: this rank's message, then MPI_Abort
/// with status 2 (run_collective_phase).
class RankInputError : public std::runtime_error {
 public:
  explicit RankInputError(const std::string& what) : std::runtime_error(what) {}
};

/// A library left in a state its own clean-up at exit would crash on: HDF5 1.10 after a file
/// close that failed (a full disk) keeps a half-destroyed file among its open objects and
/// crashes on it in MPI_Finalize (HDFFV-11052, fixed in HDF5 1.14.1) — a segmentation fault
/// for what is bad input. Once this is called (on every rank alike), main() ends the process with
/// its status, output flushed, without MPI_Finalize or the libraries' atexit clean-up; `why`
/// is kept for the record.
void skip_library_cleanup(const std::string& why);
/// Empty unless skip_library_cleanup was called: then its reason.
const std::string& library_cleanup_skipped();

/// printf-style formatting into a std::string.
std::string strfmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace trellis

/// Fails loudly with the file and line when an internal invariant breaks.
#define TRELLIS_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw std::logic_error(::trellis::strfmt("%s:%d: check failed: %s: ", __FILE__,     \
                                               __LINE__, #cond) +                         \
                             ::trellis::strfmt(__VA_ARGS__));                             \
  } while (0)
