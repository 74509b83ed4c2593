#pragma once
// Runs the `frugal` CLI as a user would and captures what it prints.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

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

/// Runs a shell command; stdout and stderr together.
inline CliResult run_cli_command(const std::string& command) {
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

}  // namespace frugal::test
