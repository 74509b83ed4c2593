// `frugal train --nproc N`: N local workers with torchrun's environment, signals forwarded, and
// the group failing as a whole.
#include "launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "frugal/base/error.h"
#include "frugal/callbacks/stop.h"

namespace frugal::cli {

namespace {

volatile sig_atomic_t g_forward = 0;  // the signal to pass on, 0 = none

void on_signal(int sig) { g_forward = sig; }

// A port the kernel has free on loopback now (torchrun's --standalone does the same).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(std::string("--nproc: no socket for a free port: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(std::string("--nproc: no free port on 127.0.0.1: ") + std::strerror(e));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

std::vector<std::string> worker_args(const std::vector<std::string>& argv) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--nproc") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    out.push_back(a);
  }
  return out;
}

namespace {

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

/// This process's environment with torchrun's variables for `rank`, built before fork: the
/// child of a threaded process calls only async-signal-safe functions before exec.
std::vector<std::string> rank_environment(int rank, int nproc, int port) {
  static const std::set<std::string> ours = {"RANK", "LOCAL_RANK", "WORLD_SIZE",
                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    if (!ours.count(kv.substr(0, kv.find('=')))) env.push_back(kv);
  }
  for (const auto& [k, v] : {std::pair<const char*, std::string>{"RANK", std::to_string(rank)},
                             {"LOCAL_RANK", std::to_string(rank)},
                             {"WORLD_SIZE", std::to_string(nproc)},
                             {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
                             {"MASTER_ADDR", "127.0.0.1"},
                             {"MASTER_PORT", std::to_string(port)}})
    env.push_back(std::string(k) + "=" + v);
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

/// Forks the ranks; the forwarded signals' old handlers are restored in each child.
std::vector<pid_t> start_ranks(int nproc, int port, std::vector<std::string> args,
                               const struct sigaction (&old)[4]) {
  std::vector<char*> argv = pointers(args);
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env = rank_environment(r, nproc, port);
    std::vector<char*> envp = pointers(env);
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int e = errno;
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      throw Error(std::string("--nproc: fork failed: ") + std::strerror(e));
    }
    if (pid == 0) {  // this very program, without --nproc
      for (int i = 0; i < 4; ++i) sigaction(kForwarded[i], &old[i], nullptr);
      // Its own process group: a terminal's Ctrl-C reaches the launcher alone, which passes it
      // on once (a rank that got it twice would stop at once, without its checkpoint). And a
      // launcher that dies takes its ranks along (they stop cleanly on SIGTERM).
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      ::execve("/proc/self/exe", argv.data(), envp.data());
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

/// Waits for every rank; passes signals on; when one fails, stops the others (their next
/// collective would wait for it until the timeout). Returns the first failure's exit code.
int wait_ranks(const std::vector<pid_t>& pids, spdlog::logger& log) {
  int rc = 0, failed_rank = -1;
  size_t running = pids.size();
  std::vector<bool> done(pids.size(), false);
  auto deadline = std::chrono::steady_clock::time_point::max();
  auto signal_running = [&](int sig) {
    for (size_t j = 0; j < pids.size(); ++j)
      if (!done[j]) ::kill(pids[j], sig);
  };
  while (running > 0) {
    if (const int sig = g_forward) {
      g_forward = 0;
      signal_running(sig);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    const auto it = std::find(pids.begin(), pids.end(), pid);
    if (pid > 0 && it != pids.end() && !done[static_cast<size_t>(it - pids.begin())]) {
      const auto i = static_cast<size_t>(it - pids.begin());
      done[i] = true;
      --running;
      const int code = exit_code(status);
      // 75: a clean stop; the others got the same signal and stop at the same batch.
      if (code == kExitInterrupted && rc == 0) rc = code;
      if (code != 0 && code != kExitInterrupted && failed_rank < 0) {
        rc = code;
        failed_rank = static_cast<int>(i);
        if (running > 0) {
          log.error("rank {} ended with exit code {}: stopping the other ranks", i, code);
          signal_running(SIGTERM);
          deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // ECHILD: none left to wait for
    if (std::chrono::steady_clock::now() > deadline) {
      signal_running(SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (failed_rank >= 0)
    log.error("--nproc {}: rank {} failed first (exit code {})", pids.size(), failed_rank, rc);
  return rc;
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& argv, spdlog::logger& log) {
  if (nproc < 1) throw ConfigError("--nproc must be >= 1, got " + std::to_string(nproc));
  const char* port_env = std::getenv("MASTER_PORT");
  const int port = port_env && *port_env ? std::atoi(port_env) : free_port();
  log.info("--nproc {}: starting {} ranks on 127.0.0.1:{}", nproc, nproc, port);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old[4];
  for (int i = 0; i < 4; ++i) sigaction(kForwarded[i], &sa, &old[i]);
  ::signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would reap the ranks before waitpid
  int rc = 1;
  try {
    rc = wait_ranks(start_ranks(nproc, port, worker_args(argv), old), log);
  } catch (...) {
    for (int i = 0; i < 4; ++i) sigaction(kForwarded[i], &old[i], nullptr);
    throw;
  }
  for (int i = 0; i < 4; ++i) sigaction(kForwarded[i], &old[i], nullptr);
  return rc;
}

}  // namespace frugal::cli
