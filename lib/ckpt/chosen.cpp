// The checkpoint a reader (eval, generate, export, a training run's start point) was given, and
// the file chosen for it — chosen again where a run publishing there removes it meanwhile.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/log.hpp"

namespace trellis {

using namespace ckpt_impl;

ChosenCheckpoint::ChosenCheckpoint(std::string given, MPI_Comm comm, std::string who, Say say)
    : given_(std::move(given)), who_(std::move(who)), comm_(comm), say_(say) {
  path_ = comm_ == MPI_COMM_NULL ? resolve_checkpoint(given_) : resolve_checkpoint(comm_, given_);
}

bool ChosenCheckpoint::choose_again(const std::string& error) {
  int gone = choices_ < kMaxChoices && chosen_checkpoint_gone(error, given_, path_);
  if (comm_ != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &gone, 1, MPI_INT, MPI_MAX, comm_);
  if (!gone) return false;
  const std::string before = path_;
  path_ = comm_ == MPI_COMM_NULL ? resolve_checkpoint(given_) : resolve_checkpoint(comm_, given_);
  ++choices_;
  const std::string said = who_ + ": " + before + ", the newest checkpoint of " + given_ +
                          " when it was chosen, was removed meanwhile (a run publishing there): " +
                          path_ + " instead";
  if (say_ == Say::on_stdout)
    log(said);  // (rank 0's)
  else if (comm_ == MPI_COMM_NULL || comm_rank(comm_) == 0)
    log_error(said);
  return true;
}

std::string ChosenCheckpoint::explained(const std::string& error) const {
  if (choices_ >= kMaxChoices && chosen_checkpoint_gone(error, given_, path_)) {
    // (open_failure's own advice, to try again, is cut: trying again is what failed.)
    const std::string said = "removed since it was chosen";
    const size_t at = error.find(said);
    const std::string what = at == std::string::npos ? error : error.substr(0, at + said.size());
    return what + " (" + std::to_string(choices_) + " newest checkpoints of " + given_ +
           " in a row were removed before they could be read: a run publishing there replaces "
           "them faster than this reader reads one; name a step file it keeps, or give that run "
           "a larger checkpoint.keep)";
  }
  return with_chosen_checkpoint_gone(error, given_, path_);
}

void ChosenCheckpoint::fault_point(const char* point) const {
  static bool done = false;
  const char* v = std::getenv("TRELLIS_FAULT_REMOVE_CHOSEN");
  if (done || !v || std::string(v) != point) return;
  done = true;
  if (comm_ == MPI_COMM_NULL || comm_rank(comm_) == 0) std::remove(path_.c_str());
  if (comm_ != MPI_COMM_NULL) MPI_Barrier(comm_);
}

}  // namespace trellis
