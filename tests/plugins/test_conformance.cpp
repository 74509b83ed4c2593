// Every plugin in the build's plugin folder (build/lib/frugal/plugins) joins this test without
// editing it: it loads with default options, runs a tiny two-stage CPU fit (stages "one" and
// "two"), and unloads leaving no registry entry behind (Composer's algorithm_settings.py, for
// frugal). A plugin with a required option (optim_swap's trigger) ships
// plugins/<name>/conformance.toml with the [plugins.<name>] table to use instead; its defaults
// alone must then be rejected with a ConfigError, so the file is only used where it must be.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "frugal/app/plugin_host.h"
#include "gpt_fixture.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

/// The plugins built into this build's plugin folder (not the installed or FRUGAL_PLUGIN_PATH
/// ones), and the problems discover() found there.
std::vector<PluginDescription> built_plugins(std::vector<std::string>& problems) {
  const std::filesystem::path dir = FRUGAL_TEST_PLUGIN_DIR;
  PluginHost host;
  std::vector<std::string> all_problems;
  std::vector<PluginDescription> out;
  for (auto& d : host.discover(&all_problems))
    if (std::filesystem::path(d.path).parent_path() == dir) out.push_back(std::move(d));
  for (auto& p : all_problems)
    if (p.find(dir.string()) != std::string::npos) problems.push_back(p);
  return out;
}

template <class R>
std::vector<std::string> sorted_names(const R& registry) {
  auto n = registry.names();
  std::sort(n.begin(), n.end());
  return n;
}

TEST(PluginConformance, EveryBuiltPluginLoadsFitsAndUnloads) {
  std::vector<std::string> problems;
  const auto plugins = built_plugins(problems);
  for (const auto& p : problems) ADD_FAILURE() << "not a loadable plugin: " << p;
  if (plugins.empty()) {
    std::cout << "[conformance] no plugins in " << FRUGAL_TEST_PLUGIN_DIR
              << " yet: nothing to check\n";
    return;
  }
  for (const auto& d : plugins) {
    SCOPED_TRACE("plugin '" + d.name + "' (" + d.path + ")");
    EXPECT_FALSE(d.description.empty()) << "a plugin describes itself in one line";
    EXPECT_FALSE(d.version.empty());
    EXPECT_EQ(d.abi_version, kAbiVersion);
    for (const auto& o : d.options) EXPECT_FALSE(o["help"].get<std::string>().empty()) << o.dump();

    const auto models_before = sorted_names(models());
    const auto datasets_before = sorted_names(datasets());
    const auto losses_before = sorted_names(losses());
    // Every plugin on an image classifier and on a language model (gpt on text).
    for (const bool gpt : {false, true}) {
      SCOPED_TRACE(gpt ? "on a tiny gpt" : "on a tiny mlp");
      PluginHost host;
      toml::table table;
      const auto required = std::filesystem::path(FRUGAL_TEST_PLUGIN_SOURCE_DIR) / d.name /
                            "conformance.toml";
      if (std::filesystem::exists(required)) {
        toml::table defaults;
        defaults.insert(d.name, toml::table{});
        EXPECT_THROW(PluginHost().load(defaults, "conformance.toml"), ConfigError)
            << required << " exists, but the plugin's defaults alone are valid: remove the file";
        toml::table root = toml::parse_file(required.string());
        ASSERT_TRUE(root["plugins"][d.name].is_table()) << required << " has no [plugins." << d.name << "]";
        table = std::move(*root["plugins"].as_table());
      } else {
        table.insert(d.name, toml::table{});  // [plugins.<name>] with every default
      }
      std::vector<std::shared_ptr<Callback>> cbs;
      ASSERT_NO_THROW(cbs = host.load(table, "conformance.toml"));
      ASSERT_FALSE(cbs.empty());
      EXPECT_EQ(host.loaded(), std::vector<std::string>{d.name});

      auto learner = gpt ? make_tiny_gpt_learner() : make_tiny_learner();
      for (auto& cb : cbs) learner->add_callback(cb);
      cbs.clear();
      ASSERT_NO_THROW(learner->fit({make_stage("one", 1), make_stage("two", 1)}));
      EXPECT_GT(learner->iteration(), 0);
      ASSERT_EQ(learner->stage_stats().size(), 2u);
      for (const auto& s : learner->stage_stats())
        EXPECT_TRUE(std::isfinite(s.last_epoch_loss)) << "stage " << s.name;
      learner.reset();  // callbacks and models die before the host unloads the library
    }
    EXPECT_EQ(sorted_names(models()), models_before) << "models left behind after unload";
    EXPECT_EQ(sorted_names(datasets()), datasets_before);
    EXPECT_EQ(sorted_names(losses()), losses_before);
    if (!::testing::Test::HasFailure()) std::cout << "[conformance] " << d.name << ": OK\n";
  }
}

/// The level-2 headings every method card has, in this order (issue 32: a card a newcomer
/// copies). Sub-sections are `###` under one of them.
const std::vector<std::string> kMethodCardHeadings = {
    "What", "Use", "Events and order", "Composes with", "Measured", "Costs", "Source"};

/// The `## ` headings of a Markdown file, in order, outside fenced code blocks.
std::vector<std::string> method_card_headings(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::vector<std::string> out;
  std::string line;
  bool fenced = false;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const auto first = line.find_first_not_of(" \t");
    if (first != std::string::npos && line.compare(first, 3, "```") == 0) {
      fenced = !fenced;
      continue;
    }
    if (fenced || line.rfind("## ", 0) != 0) continue;
    std::string heading = line.substr(3);
    while (!heading.empty() && (heading.back() == ' ' || heading.back() == '\t')) heading.pop_back();
    out.push_back(heading);
  }
  return out;
}

std::string joined_headings(const std::vector<std::string>& headings) {
  std::string out;
  for (const auto& h : headings) out += (out.empty() ? "" : ", ") + ("'" + h + "'");
  return out.empty() ? "none" : out;
}

/// What is wrong with a card's headings, one line each; "" when they are exactly the seven.
std::string method_card_problems(const std::vector<std::string>& found) {
  std::string out;
  for (const auto& h : kMethodCardHeadings)
    if (std::find(found.begin(), found.end(), h) == found.end()) out += "  missing: ## " + h + "\n";
  for (const auto& h : found)
    if (std::find(kMethodCardHeadings.begin(), kMethodCardHeadings.end(), h) ==
        kMethodCardHeadings.end())
      out += "  not a card heading (make it ### under one of the seven): ## " + h + "\n";
  for (const auto& h : kMethodCardHeadings)
    if (std::count(found.begin(), found.end(), h) > 1) out += "  repeated: ## " + h + "\n";
  if (out.empty() && found != kMethodCardHeadings) out += "  out of order\n";
  if (!out.empty())
    out += "  found:    " + joined_headings(found) + "\n  expected: " +
           joined_headings(kMethodCardHeadings) + "\n";
  return out;
}

TEST(PluginConformance, EveryMethodCardHasTheSameHeadings) {
  namespace fs = std::filesystem;
  const fs::path plugin_sources = FRUGAL_TEST_PLUGIN_SOURCE_DIR;
  std::vector<fs::path> cards;
  for (const auto& entry : fs::directory_iterator(plugin_sources))
    if (entry.is_directory() && fs::exists(entry.path() / "CMakeLists.txt"))
      cards.push_back(entry.path() / "README.md");
  std::sort(cards.begin(), cards.end());
  ASSERT_FALSE(cards.empty()) << "no plugin folder (with a CMakeLists.txt) in " << plugin_sources;
  // The template a new plugin starts from follows the same shape.
  cards.push_back(fs::path(FRUGAL_TEST_PLUGIN_SOURCE_DIR "/../examples/custom_plugin/README.md"));
  for (const auto& card : cards) {
    const std::string name = card.lexically_normal().string();
    if (!fs::exists(card)) {
      ADD_FAILURE() << name << " is missing: every plugin folder has a README.md method card";
      continue;
    }
    const std::string problems = method_card_problems(method_card_headings(card));
    EXPECT_TRUE(problems.empty()) << name << ": the method card's ## headings are not the seven "
                                  << "of every card:\n" << problems;
  }
}

}  // namespace
}  // namespace frugal::test
