#pragma once
// `frugal train --nproc N`: starts N local ranks of this program with the environment torchrun
// gives its workers. CLI-internal.
#include <string>
#include <vector>

#include <spdlog/logger.h>

namespace frugal::cli {

/// `argv` without --nproc and its value: what each rank runs.
std::vector<std::string> worker_args(const std::vector<std::string>& argv);

/// Forks N ranks running `argv` (minus --nproc) with RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, MASTER_ADDR = 127.0.0.1 and MASTER_PORT (a free port, or $MASTER_PORT);
/// forwards SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 to them; when a rank fails (not by a clean
/// stop, exit code 75) the others get SIGTERM, then SIGKILL 30 s later. Returns the first
/// failing rank's exit code (0 when all succeed).
int launch_local(int nproc, const std::vector<std::string>& argv, spdlog::logger& log);

}  // namespace frugal::cli
