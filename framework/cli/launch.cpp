// `frugal train --nproc N`: N local workers with torchrun's environment, signals forwarded, and
// the group failing as a whole.
#include "launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "frugal/error.h"
#include "frugal/stop.h"

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

int launch_local(int nproc, const std::vector<std::string>& argv, spdlog::logger& log) {
  if (nproc < 1) throw ConfigError("--nproc must be >= 1, got " + std::to_string(nproc));
  const char* port_env = std::getenv("MASTER_PORT");
  const int port = port_env && *port_env ? std::atoi(port_env) : free_port();
  const std::vector<std::string> args = worker_args(argv);
  log.info("--nproc {}: starting {} ranks on 127.0.0.1:{}", nproc, nproc, port);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  const int forwarded[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
  struct sigaction old[4];
  for (int i = 0; i < 4; ++i) sigaction(forwarded[i], &sa, &old[i]);

  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      throw Error(std::string("--nproc: fork failed: ") + std::strerror(errno));
    }
    if (pid == 0) {
      // The child: torchrun's variables, then this very program without --nproc.
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      for (int i = 0; i < 4; ++i) sigaction(forwarded[i], &old[i], nullptr);
      std::vector<char*> cargv;
      for (const auto& a : args) cargv.push_back(const_cast<char*>(a.c_str()));
      cargv.push_back(nullptr);
      ::execv("/proc/self/exe", cargv.data());
      std::fprintf(stderr, "--nproc: cannot start rank %d: %s\n", r, std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }

  // Wait for all; pass signals on; when one rank fails, stop the others (their next
  // collective would wait for it until the timeout).
  int rc = 0, failed_rank = -1;
  size_t running = pids.size();
  std::vector<bool> done(pids.size(), false);
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    if (g_forward) {
      const int sig = g_forward;
      g_forward = 0;
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) ::kill(pids[i], sig);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (pids[i] != pid || done[i]) continue;
        done[i] = true;
        --running;
        const int code = exit_code(status);
        // 75: a clean stop; the others got the same signal and stop at the same batch.
        if (code == kExitInterrupted && rc == 0) rc = code;
        if (code != 0 && code != kExitInterrupted && (rc == 0 || rc == kExitInterrupted)) {
          rc = code;
          failed_rank = static_cast<int>(i);
          if (running > 0) {
            log.error("rank {} ended with exit code {}: stopping the other ranks", i, code);
            for (size_t j = 0; j < pids.size(); ++j)
              if (!done[j]) ::kill(pids[j], SIGTERM);
            deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          }
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR && errno != ECHILD) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t j = 0; j < pids.size(); ++j)
        if (!done[j]) ::kill(pids[j], SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int i = 0; i < 4; ++i) sigaction(forwarded[i], &old[i], nullptr);
  if (failed_rank >= 0) log.error("--nproc {}: rank {} failed first (exit code {})", nproc, failed_rank, rc);
  return rc;
}

}  // namespace frugal::cli
