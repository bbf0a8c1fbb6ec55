// Whether a checkpoint can restart this run (train/checkpointing.hpp's check_compatible and
// resume): which deck keys a checkpoint cannot survive, which change the run's course, and the
// error that stops an automatic resume at a checkpoint of another model.
#pragma once
#include <filesystem>
#include <string>

#include "config/config.hpp"
#include "core/error.hpp"

namespace trellis {

/// A checkpoint of another model (or another format): no older checkpoint of the same directory
/// would do better, so an auto resume stops at it instead of trying them.
struct IncompatibleCheckpoint : UserError {
  using UserError::UserError;
};

/// A path as one file is named whatever way it was reached (links, `..`): for comparing two.
std::filesystem::path resolved_path(const std::string& p);
/// The deck file's path, as checkpoints store it ("" for a deck that is no file: tests).
std::string deck_identity(const std::string& deck_path);
/// Keys whose change a checkpoint cannot survive: the model's shape.
bool is_model_shape_key(const std::string& key);
/// Keys that change the run's course from the checkpoint on: said, not refused.
bool changes_the_course(const std::string& key);
/// Whether a run under `b` takes the course a run under `a` took.
bool same_course(const Config& a, const Config& b);

}  // namespace trellis
