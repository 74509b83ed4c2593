#pragma once
// Runs the `frugal` CLI as a user would and captures what it prints.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace frugal::test {

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

/// The CLI: $FRUGAL_CLI, else the `frugal` built beside this test binary (both in build/bin).
inline std::string cli_path() {
  if (const char* p = std::getenv("FRUGAL_CLI")) return p;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "frugal" : (self.parent_path() / "frugal").string();
}

/// Tests that start the CLI are labelled `cli` (FRUGAL_CLI_SUITES in tests/CMakeLists.txt), the
/// others `unit`, so `ctest -L unit` is the quick inner loop. A test run under the unit label
/// (ctest sets FRUGAL_TEST_LABEL) that starts the CLI fails, naming its suite: the list stays true.
inline void note_cli_use() {
  const char* label = std::getenv("FRUGAL_TEST_LABEL");
  const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
  if (!t) return;
  if (const char* record = std::getenv("FRUGAL_TEST_RECORD_CLI"))  // list the suites that do
    std::ofstream(record, std::ios::app) << t->test_suite_name() << "\n";
  if (label && std::string(label) == "unit")
    ADD_FAILURE() << "suite " << t->test_suite_name() << " starts the frugal CLI but is labelled "
                  << "unit: add it to FRUGAL_CLI_SUITES in tests/CMakeLists.txt";
}

/// Runs a shell command; stdout and stderr together.
inline CliResult run_cli_command(const std::string& command) {
  note_cli_use();
  CliResult r;
  const std::string cmd = command + " 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(f);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  return run_cli_command(env + " " + cli_path() + " " + args);
}

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// A `frugal train` child whose output goes to `log`. Everything is prepared before fork: the
/// child of a threaded process only calls async-signal-safe functions (no malloc) before exec.
/// `file_size_limit` (bytes): the child's RLIMIT_FSIZE, as `ulimit -f` would set it.
inline pid_t start_train(const std::vector<std::string>& args, const std::string& log,
                         rlim_t file_size_limit = RLIM_INFINITY) {
  note_cli_use();
  std::filesystem::remove(log);  // an earlier run's marker must not count
  const std::string cli = cli_path();
  std::vector<char*> argv = {const_cast<char*>(cli.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (file_size_limit != RLIM_INFINITY) {
    const struct rlimit limit = {file_size_limit, file_size_limit};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(126);
  }
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  ::execv(cli.c_str(), argv.data());
  ::_exit(127);
}

/// Waits (at most 120 s) until `log` contains `marker` or the child exits; false if it exited.
inline bool wait_for_marker(pid_t pid, const std::string& log, const std::string& marker, int& status) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    if (read_text(log).find(marker) != std::string::npos) return true;
    if (::waitpid(pid, &status, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

/// Exit status of the child, killed after 120 s if it has not ended by then.
inline int wait_child(pid_t pid) {
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status;
}

}  // namespace frugal::test
