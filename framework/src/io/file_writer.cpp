#include "frugal/io/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "frugal/base/error.h"

namespace frugal {

namespace fs = std::filesystem;

namespace {

/// "File too large writing 'x' (the file size limit, RLIMIT_FSIZE or ulimit -f, was reached)":
/// errno `err` met while `doing`, and for a full disk or the size limit which one it was.
std::string failure(int err, const std::string& doing) {
  std::string why = std::strerror(err);
  if (!doing.empty()) why += " " + doing;
  if (err == EFBIG)
    why += " (the file size limit, RLIMIT_FSIZE or ulimit -f, was reached)";
  else if (err == ENOSPC || err == EDQUOT)
    why += " (the disk is full: make room, or write the run elsewhere)";
  return why;
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);  // the rename is done; a failure here loses nothing already written
  ::close(fd);
}

/// The written file's bytes on the disk: an error here (ENOSPC, EIO) means they may not be.
void sync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(failure(errno, "opening '" + path + "' to sync it"));
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0) throw Error(failure(err, "syncing '" + path + "'"));
}

}  // namespace

std::string write_failure(int err) { return failure(err, ""); }

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(failure(errno, "creating '" + path_ + "'"));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::fail(int err) {
  if (error_ == 0) error_ = err;
}

bool FileWriter::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (error_ == 0 && n > 0) {
    const ssize_t k = ::write(fd_, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      fail(k < 0 ? errno : ENOSPC);  // 0 bytes for a non-empty write: no room
      break;
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return error_ == 0;
}

void FileWriter::finish() {
  if (fd_ >= 0 && ::close(fd_) != 0) fail(errno);
  fd_ = -1;
  if (error_ != 0) throw Error(failure(error_, "writing '" + path_ + "'"));
}

void write_file_atomic(const std::string& path, const std::function<void(const std::string&)>& write) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    write(tmp);
    sync_file(tmp);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = failure(errno, "renaming '" + tmp + "' to '" + path + "'");
    std::remove(tmp.c_str());
    throw Error(why);
  }
  const fs::path parent = fs::path(path).parent_path();
  fsync_dir(parent.empty() ? "." : parent.string());
}

void write_file_atomic(const std::string& path, const std::string& text) {
  try {
    write_file_atomic(path, [&](const std::string& tmp) {
      FileWriter f(tmp);
      f.write(text.data(), text.size());
      f.finish();
    });
  } catch (const Error& e) {
    throw Error("cannot write '" + path + "': " + e.what());
  }
}

void ensure_writable_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error("output folder '" + dir + "' cannot be created: " + ec.message() +
                "; set run.out_dir to a writable folder");
  const std::string probe = (fs::path(dir) / (".frugal-probe." + std::to_string(::getpid()))).string();
  std::ofstream f(probe);
  if (!f)
    throw Error("output folder '" + dir + "' is not writable: " + std::strerror(errno) +
                "; set run.out_dir to a writable folder");
  f.close();
  fs::remove(probe, ec);
}

}  // namespace frugal
