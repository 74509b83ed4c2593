#pragma once
// A checkpoint's (or saved model's) bytes sealed with a CRC32, checked before LibTorch reads it.
//
// LibTorch's archives are zip files whose reader does not check the records' CRCs, so a flipped
// bit in a tensor loads as a wrong number (a NaN, once in an exponent). seal_zip() puts the
// CRC32 of every byte before it into the archive's comment ("frugal-crc32 xxxxxxxx", the last
// bytes of the end-of-central-directory record; zip readers, LibTorch's and Python's, skip it);
// verify_zip() recomputes it. Any changed bit, in a tensor, a header, padding or the seal
// itself, fails the check. Internal to libfrugal.
#include <cstdint>
#include <string>
#include <vector>

#include "frugal/base/error.h"

namespace frugal::seal {

/// What every damage message ends with.
inline constexpr const char* kDamageAdvice =
    ". Its bytes changed after it was written (disk, copy or transfer); resume from an earlier "
    "checkpoint or retrain";

/// A record (a tensor's storage, the pickle, ...) whose bytes no longer match the CRC the zip
/// writer stored for it: its name in the archive ("data/3") and its bytes as they are now.
struct ChangedRecord {
  std::string name;
  std::vector<unsigned char> bytes;
};

/// A damaged archive: the message names the file (without kDamageAdvice: the caller adds what
/// it knows, then the advice); `records` the changed records it could find (none when the
/// change is outside their data: a header, padding or the seal).
class SealError : public CheckpointError {
 public:
  SealError(const std::string& msg, std::vector<ChangedRecord> records)
      : CheckpointError(msg), records_(std::move(records)) {}
  const std::vector<ChangedRecord>& records() const { return records_; }

 private:
  std::vector<ChangedRecord> records_;
};

/// Appends the seal to the zip archive at `path` (written by LibTorch, no comment yet).
/// Throws CheckpointError naming the file when it is not such an archive.
void seal_zip(const std::string& path);

enum class Seal { Verified, Absent };

/// Checks the seal of the zip archive at `path`. Absent: an archive written before seals
/// (no comment) whose records match the zip's own CRC32s, left to LibTorch's own checks. Throws SealError (or CheckpointError) naming
/// the file, and the records whose bytes changed when it can tell, for a damaged file.
Seal verify_zip(const std::string& path);

}  // namespace frugal::seal
