#pragma once
// What load_checkpoint keeps for the next fit: the open archive (callback states, optimizer
// state, RNG) and its resume record.
#include <string>

#include "frugal/core/learner.h"
#include "io/archive.h"

namespace frugal {

struct Learner::PendingResume {
  archive::InputArchive archive;
  archive::ResumeRecord record;
  std::string path;
  /// The record ended a finished fit that this fit extends (its position moved to the first
  /// epoch not run yet).
  bool extended = false;
};

}  // namespace frugal
