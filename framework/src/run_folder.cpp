#include "frugal/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "frugal/error.h"

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
                                     "model.safetensors"};
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
  for (const char* name : kRunFiles) fs::remove(fs::path(dir) / name, ec);
  if (fs::is_directory(checkpoint_dir, ec)) {
    fs::remove_all(checkpoint_dir, ec);
    if (ec)
      throw Error("--overwrite: cannot remove the earlier run's checkpoints '" + checkpoint_dir +
                  "': " + ec.message());
  }
}

}  // namespace frugal
