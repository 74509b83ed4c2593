#pragma once
/// Every file frugal writes goes through here: a checked writer that names the cause of a
/// failure (a full disk, the file size limit) and an atomic replace (temp file, fsync, rename).
#include <cstddef>
#include <functional>
#include <string>

namespace frugal {

/// Checks before any work that `dir` can be created and written; throws Error naming it.
void ensure_writable_dir(const std::string& dir);

/// A new file written through its descriptor, every write and the close checked: a full disk
/// (ENOSPC, EDQUOT) or the file size limit (EFBIG; `frugal` ignores SIGXFSZ so a write past
/// RLIMIT_FSIZE fails instead of killing it) is caught where it happens, with its cause. The
/// first failure is kept; later writes do nothing.
class FileWriter {
 public:
  /// Creates (truncates) `path`; throws Error naming it and the cause.
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  /// Writes all `n` bytes; false once the file could not take them.
  bool write(const void* data, size_t n);
  /// Closes the file; throws Error("<cause> writing '<path>' (<which limit>)") if a write or
  /// the close failed.
  void finish();

 private:
  void fail(int err);
  std::string path_;
  int fd_ = -1;
  int error_ = 0;
};

/// What errno `err` means to a writer: its strerror, and for a full disk or the file size
/// limit which one it is ("File too large (the file size limit, RLIMIT_FSIZE or ulimit -f, was
/// reached)").
std::string write_failure(int err);

/// Writes `path` atomically: `write` fills a temp file beside it (given its path), which is
/// fsync'd (checked: a full disk may first show there) and renamed over `path`, and the folder
/// is fsync'd. A failure removes the temp file and leaves any existing `path` untouched; its
/// Error says the cause and the step ("No space left on device syncing '<tmp>' (the disk is
/// full: ...)").
void write_file_atomic(const std::string& path, const std::function<void(const std::string& tmp)>& write);
/// The same for a text; the Error begins "cannot write '<path>': ".
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace frugal
