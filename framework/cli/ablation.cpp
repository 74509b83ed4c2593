// What `frugal ablate` and `frugal plan` share: the techniques of a config, `frugal train`
// runs in their own processes, their reports.
#include "ablation.h"

#include <fcntl.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "frugal/app/plugin_host.h"
#include "frugal/app/run.h"
#include "frugal/base/compat.h"
#include "frugal/base/error.h"

namespace fs = std::filesystem;

namespace frugal::cli {

namespace {

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string joined_keys(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out.empty() ? "none" : out;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string last_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

}  // namespace

std::string join_on(const std::vector<std::string>& on, const char* sep) {
  std::string out;
  for (const auto& s : on) out += (out.empty() ? "" : sep) + s;
  return out.empty() ? "none" : out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

TechniqueSet resolve_techniques(const Config& cfg) {
  const AblationOptions& a = cfg.ablation;
  TechniqueSet t;
  t.baseline = a.baseline;
  // Where each name was written, for errors.
  std::vector<std::pair<std::string, std::string>> named;  // (name, "location: 'key'")
  for (const auto& b : a.baseline) named.emplace_back(b, a.baseline_at + ": 'ablation.baseline'");
  if (!a.techniques.empty()) {
    t.techniques = a.techniques;
    for (const auto& n : a.techniques)
      named.emplace_back(n, a.techniques_at + ": 'ablation.techniques'");
  } else {
    for (auto&& [k, v] : cfg.plugins) {
      const std::string name(k.str());
      if (!v.is_table() || contains(t.baseline, name)) continue;
      t.techniques.push_back(name);
      named.emplace_back(name, location(v, cfg.source) + ": '[plugins." + name + "]'");
    }
  }
  if (t.techniques.empty())
    throw_config_error((cfg.has_ablation ? a.techniques_at : cfg.source) +
                       ": nothing to vary: list plugins in 'ablation.techniques', or give each "
                       "technique a [plugins.<name>] table (an empty 'techniques' varies every "
                       "plugin with a table that is not in 'ablation.baseline')");

  PluginHost host(PluginHost::config_paths(cfg.plugins, cfg.source));
  std::vector<std::string> installed;
  for (const auto& d : host.discover()) installed.push_back(d.name);
  for (const auto& [name, where] : named) {
    if (contains(installed, name)) continue;
    const std::string near = nearest(name, installed);
    throw_config_error(where + " names plugin '" + name + "', which is not installed" +
                       (near.empty() ? "" : "; did you mean '" + near + "'?") +
                       " Installed plugins: " + joined_keys(installed) +
                       " (searched: " + joined_keys(host.search_path()) + ")");
  }
  return t;
}

Config load_base_config(const std::string& config, const std::vector<std::string>& sets) {
  const toml::table plugins = read_plugins_table(config, sets);
  PluginHost host(PluginHost::config_paths(plugins, config));
  host.register_plugins(plugins, config);
  return load_config(config, sets);  // holds nothing of a plugin: the host may go
}

std::vector<std::string> run_overrides(const TechniqueSet& t, const ChildRun& r) {
  std::vector<std::string> out;
  for (const auto& b : t.baseline) out.push_back("plugins." + b + ".enabled=true");
  for (const auto& n : t.techniques)
    out.push_back("plugins." + n + ".enabled=" + (contains(r.on, n) ? "true" : "false"));
  out.insert(out.end(), r.extra.begin(), r.extra.end());
  return out;
}

void check_runs(const std::string& config, const std::vector<std::string>& sets,
                const TechniqueSet& t, const std::vector<ChildRun>& runs) {
  for (const auto& r : runs) {
    std::vector<std::string> all = sets;
    for (auto& s : run_overrides(t, r)) all.push_back(s);
    try {
      load_config_with_plugins(config, all);
    } catch (const ConfigError& e) {
      throw ConfigError("run '" + r.name + "' (techniques: " + join_on(r.on, ", ") +
                        ") would fail: " + e.what());
    } catch (const PluginError& e) {
      throw PluginError("run '" + r.name + "' (techniques: " + join_on(r.on, ", ") +
                        ") would fail: " + e.what());
    }
  }
}

std::string self_exe(const char* argv0) {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(p, ec)) return p.string();
  return fs::absolute(argv0, ec).string();
}

int spawn_wait(const std::string& exe, const std::vector<std::string>& args,
               const std::string& log_path, const std::string& cwd) {
  // Everything the child touches is prepared before fork: between fork and exec only
  // async-signal-safe calls run (the parent has LibTorch's threads).
  std::vector<std::string> all = {exe};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : all) argv.push_back(s.data());
  argv.push_back(nullptr);
  const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fd);
    if (null_fd >= 0) ::close(null_fd);
    return -1;
  }
  if (pid == 0) {
    if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fd);
  if (null_fd >= 0) ::close(null_fd);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

ChildResult run_train_child(const std::string& exe, const std::string& config,
                            const std::vector<std::string>& sets, const TechniqueSet& t,
                            const ChildRun& r, const std::string& dir,
                            const std::vector<std::string>& run_keys, int nproc) {
  ChildResult out;
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string report = (fs::path(dir) / "report.json").string();
  fs::remove(report, ec);  // never read a stale report
  // The run's folder is the ablation's own: a rerun of the ablation replaces it.
  std::vector<std::string> args = {"train", config, "--overwrite"};
  if (nproc > 1) args.insert(args.end(), {"--nproc", std::to_string(nproc)});
  auto add = [&](const std::string& s) {
    args.push_back("--set");
    args.push_back(s);
  };
  for (const auto& s : sets) add(s);
  for (const auto& s : run_overrides(t, r)) add(s);
  for (const auto& s : run_keys) add(s);
  add("run.out_dir=" + dir);
  const std::string log_path = (fs::path(dir) / "log.txt").string();
  const auto t0 = std::chrono::steady_clock::now();
  out.exit_code = spawn_wait(exe, args, log_path);
  out.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (fs::exists(report, ec)) {
    try {
      out.report = nlohmann::json::parse(read_text(report));
    } catch (const std::exception& e) {
      out.report = nullptr;
      if (out.exit_code == 0) out.error = "unreadable report.json: " + std::string(e.what());
    }
  }
  if (out.exit_code != 0) {
    if (out.report.is_object() && out.report.contains("error"))
      out.error = out.report["error"].get<std::string>();
    else if (out.exit_code == 127 || out.exit_code < 0)
      out.error = "could not run " + exe;
    else
      out.error = last_line(read_text(log_path));
    if (out.error.empty()) out.error = "exit code " + std::to_string(out.exit_code);
  } else if (!out.report.is_object() && out.error.empty()) {
    out.error = "the run wrote no report.json";
  }
  return out;
}

nlohmann::json machine_info() {
  nlohmann::json m;
  std::ifstream cpu("/proc/cpuinfo");
  for (std::string line; std::getline(cpu, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      m["cpu"] = colon == std::string::npos ? line : line.substr(colon + 2);
      break;
    }
  }
  m["logical_cores"] = std::thread::hardware_concurrency();
  std::ifstream load("/proc/loadavg");
  double l1 = 0, l5 = 0, l15 = 0;
  if (load >> l1 >> l5 >> l15) m["load_average"] = {l1, l5, l15};
  utsname u{};
  if (::uname(&u) == 0) m["os"] = std::string(u.sysname) + " " + u.release + " " + u.machine;
  m["libtorch"] = compat::torch_version();
  return m;
}

std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (!path) return "";
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const fs::path p = fs::path(dir) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

}  // namespace frugal::cli
