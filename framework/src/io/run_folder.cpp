#include "frugal/io/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "frugal/base/error.h"

namespace fs = std::filesystem;

namespace frugal {

RunLock::RunLock(const std::string& dir) : path_((fs::path(dir) / "run.lock").string()) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("cannot open the run folder's lock '" + path_ + "': " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::ifstream f(path_);
    std::string pid;
    std::getline(f, pid);
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw Error("cannot lock the run folder '" + dir + "' (" + path_ + "): " + std::strerror(err));
    throw Error("run folder '" + dir + "' is in use by another run (process " +
                (pid.empty() ? std::string("unknown") : pid) + ", holding " + path_ +
                "); wait for it to end, or give this run another run.out_dir");
  }
  // Ours now: the PID replaces the previous holder's.
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0) {
    // The lock holds without the PID; a second run's message then lacks it.
  }
}

RunLock::~RunLock() {
  // The file stays: removing it would let a third run lock a new file while a second waits on
  // the old one. Closing releases the lock.
  if (fd_ >= 0) ::close(fd_);
}

namespace {
/// The files a run leaves in its folder: its results.
constexpr const char* kRunFiles[] = {"report.json", "report.md", "config.toml", "model.pt",
                                     "model.safetensors", "config.json", "adapter"};
}  // namespace

std::vector<std::string> earlier_run_files(const std::string& dir, const std::string& checkpoint_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const char* name : kRunFiles)
    if (fs::exists(fs::path(dir) / name, ec)) out.push_back(name);
  if (fs::is_directory(checkpoint_dir, ec) && !fs::is_empty(checkpoint_dir, ec))
    out.push_back(fs::path(checkpoint_dir).lexically_relative(dir).string() + "/");
  return out;
}

void remove_earlier_run(const std::string& dir, const std::string& checkpoint_dir) {
  std::error_code ec;
  for (const char* name : kRunFiles) fs::remove_all(fs::path(dir) / name, ec);  // adapter/ is a folder
  if (fs::is_directory(checkpoint_dir, ec)) {
    fs::remove_all(checkpoint_dir, ec);
    if (ec)
      throw Error("--overwrite: cannot remove the earlier run's checkpoints '" + checkpoint_dir +
                  "': " + ec.message());
  }
}

namespace {

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// A name write_file_atomic, CheckpointHistory::link_last or ensure_writable_dir gives a file
/// while it is being written.
bool is_unfinished(const std::string& name) {
  const size_t tmp = name.rfind(".tmp.");
  if (tmp != std::string::npos && tmp > 0 && all_digits(name.substr(tmp + 5))) return true;
  if (name.size() > 9 && name.compare(name.size() - 9, 9, ".link-tmp") == 0) return true;
  return name.rfind(".frugal-probe.", 0) == 0 && all_digits(name.substr(14));
}

}  // namespace

std::vector<std::string> remove_unfinished_files(const std::string& dir,
                                                 const std::string& checkpoint_dir) {
  std::vector<std::string> removed;
  for (const std::string& d : {dir, checkpoint_dir}) {
    std::error_code ec;
    for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {
      const fs::path p = it->path();
      if (!is_unfinished(p.filename().string())) continue;
      std::error_code rm;
      if (fs::remove(p, rm)) removed.push_back(p.string());
    }
  }
  return removed;
}

}  // namespace frugal
