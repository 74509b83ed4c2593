#pragma once
/// The run report: report.json, a short report.md and the resolved config.toml in one folder.
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace frugal {

class Learner;
struct Config;

/// The whole report of a finished (or stopped) fit: resolved config, environment
/// (LibTorch version, device, threads), the learner's measurements and `extra` fields.
nlohmann::json make_report(const Learner& l, const Config& c, const nlohmann::json& extra = {});

/// Writes report.json, report.md and config.toml into `dir`, each atomically.
void write_report(const std::string& dir, const nlohmann::json& report, const Config& c);

/// The Markdown summary of a report (also printed by `frugal train`).
std::string report_markdown(const nlohmann::json& report);

}  // namespace frugal
