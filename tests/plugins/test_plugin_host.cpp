// The plugin loader, driven with fixture plugins (tests/plugins/fixtures) through real fits.
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include "cli_support.h"
#include "frugal/app/plugin_host.h"
#include "frugal/app/run.h"
#include "learner_fixture.h"
#include "log_capture.h"

namespace frugal::test {
namespace {

const std::string kFixtures = FRUGAL_TEST_FIXTURE_DIR;


/// Sets an environment variable while it lives.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_.empty())
      unsetenv(name_);
    else
      setenv(name_, old_.c_str(), 1);
  }

 private:
  const char* name_;
  std::string old_;
};

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

std::vector<Stage> two_stages() { return {make_stage("one", 1), make_stage("two", 1)}; }

TEST(PluginHost, GoodPluginRunsInARealFitWithItsOptions) {
  LogCapture cap;
  auto learner = make_tiny_learner();  // 64 samples, batches of 16: 4 batches per epoch
  {
    PluginHost host({kFixtures});
    auto cbs = host.load(plugins_of("[plugins.fixture_counter]\nevery = 3\n"), "cfg.toml");
    ASSERT_EQ(cbs.size(), 1u);
    EXPECT_EQ(cbs[0]->name(), "fixture_counter");
    EXPECT_EQ(host.loaded(), std::vector<std::string>{"fixture_counter"});
    for (auto& cb : cbs) learner->add_callback(cb);
    learner->fit(two_stages());
    learner->clear_callbacks();
  }
  // 8 batches, a mark every 3rd: the option reached the plugin; its logger is named after it.
  EXPECT_TRUE(Has(cap.text(), "fixture_counter: counted 8 batches, 2 marks, 8 steps"));
}

TEST(PluginHost, CallbackKeepsItsLibraryLoadedAfterTheHostIsGone) {
  LogCapture cap;
  auto learner = make_tiny_learner();
  std::vector<std::shared_ptr<Callback>> cbs;
  {
    PluginHost host({kFixtures});
    cbs = host.load(plugins_of("[plugins.fixture_counter]\n"), "cfg.toml");
  }
  for (auto& cb : cbs) learner->add_callback(cb);
  cbs.clear();
  learner->fit(1);
  EXPECT_TRUE(Has(cap.text(), "counted 4 batches, 4 marks"));
  learner->clear_callbacks();  // the last reference: the library unloads here
}

TEST(PluginHost, UnknownOptionNamesLineColumnAndNearestKey) {
  PluginHost host({kFixtures});
  const std::string text = "[plugins.fixture_counter]\nevry = 2\n";
  EXPECT_EQ(error_of<ConfigError>([&] { host.load(plugins_of(text), "cfg.toml"); }),
            "cfg.toml:2:1: unknown key 'plugins.fixture_counter.evry'; did you mean "
            "'plugins.fixture_counter.every'? Allowed keys in [plugins.fixture_counter]: enabled, "
            "every, order");
  EXPECT_TRUE(host.loaded().empty());
}

TEST(PluginHost, WrongTypeAndOutOfRangeOptionsAreConfigErrors) {
  PluginHost host({kFixtures});
  EXPECT_EQ(error_of<ConfigError>([&] {
              host.load(plugins_of("[plugins.fixture_counter]\nevery = \"two\"\n"), "cfg.toml");
            }),
            "cfg.toml:2:9: 'plugins.fixture_counter.every' must be an integer >= 1, got string "
            "\"two\"");
  EXPECT_TRUE(Has(error_of<ConfigError>([&] {
                host.load(plugins_of("[plugins.fixture_counter]\nevery = 0\n"), "cfg.toml");
              }),
              "cfg.toml:2:9: 'plugins.fixture_counter.every' must be an integer >= 1"));
  EXPECT_TRUE(Has(error_of<ConfigError>([&] {
                host.load(plugins_of("[plugins]\nfixture_counter = true\n"), "cfg.toml");
              }),
              "cfg.toml:2:19: 'plugins.fixture_counter' must be a table"));
  EXPECT_TRUE(Has(error_of<ConfigError>([&] {
                host.load(plugins_of("[plugins.fixture_counter]\nenabled = \"no\"\n"), "cfg.toml");
              }),
              "cfg.toml:2:11: 'plugins.fixture_counter.enabled' must be true or false"));
}

TEST(PluginHost, EnabledFalseKeepsAPluginOffEvenWhenItIsNotInstalled) {
  PluginHost host({kFixtures});
  auto cbs = host.load(plugins_of("[plugins.fixture_counter]\nenabled = false\nevery = 2\n"
                                  "[plugins.not_installed_anywhere]\nenabled = false\n"),
                       "cfg.toml");
  EXPECT_TRUE(cbs.empty());
  EXPECT_TRUE(host.loaded().empty());
  // `enabled = true` is accepted and not passed on as a plugin option.
  EXPECT_EQ(host.load(plugins_of("[plugins.fixture_counter]\nenabled = true\n"), "cfg.toml").size(), 1u);
}

TEST(PluginHost, ADisabledPluginsOptionsAreStillChecked) {
  PluginHost host({kFixtures});
  EXPECT_EQ(error_of<ConfigError>([&] {
              host.load(plugins_of("[plugins.fixture_counter]\nenabled = false\nevry = 2\n"), "cfg.toml");
            }),
            "cfg.toml:3:1: unknown key 'plugins.fixture_counter.evry'; did you mean "
            "'plugins.fixture_counter.every'? Allowed keys in [plugins.fixture_counter]: enabled, "
            "every, order");
  EXPECT_TRUE(host.loaded().empty());
}

TEST(PluginHost, AFileThatIsNotASharedLibrarySaysSo) {
  TempDir dir;
  std::ofstream(dir.file("libfrugal_junk.so")) << "junk";
  PluginHost host({dir.path().string()});
  const std::string msg =
      error_of<PluginError>([&] { host.load(plugins_of("[plugins.junk]\n"), "cfg.toml"); });
  EXPECT_TRUE(Has(msg, "cannot load plugin 'junk' from '" + dir.file("libfrugal_junk.so") + "'")) << msg;
  EXPECT_TRUE(Has(msg, "it is not a shared library: no ELF header")) << msg;
  EXPECT_FALSE(Has(msg, "another frugal")) << msg;
}

TEST(PluginHost, NotFoundSuggestsTheNearestAndListsWhatWasSearched) {
  ScopedEnv env("FRUGAL_PLUGIN_PATH", "/nonexistent/frugal-plugins");
  PluginHost host({kFixtures});
  const std::string msg = error_of<PluginError>(
      [&] { host.load(plugins_of("[plugins.fixture_countr]\n"), "cfg.toml"); });
  EXPECT_TRUE(Has(msg, "cfg.toml:1:1: plugin 'fixture_countr' not found; did you mean "
                             "'fixture_counter'? Available: "));
  EXPECT_TRUE(Has(msg, "fixture_bad_abi, fixture_counter, fixture_faulty, fixture_models"));
  EXPECT_TRUE(Has(msg, "Searched: "));
  EXPECT_TRUE(Has(msg, kFixtures));
  EXPECT_TRUE(Has(msg, FRUGAL_TEST_PLUGIN_DIR));
  EXPECT_TRUE(Has(msg, "(FRUGAL_PLUGIN_PATH: /nonexistent/frugal-plugins)"));
}

TEST(PluginHost, LibraryWithoutTheExportIsNotAPlugin) {
  PluginHost host({kFixtures});
  EXPECT_EQ(error_of<PluginError>(
                [&] { host.load(plugins_of("[plugins.fixture_not_plugin]\n"), "cfg.toml"); }),
            "'" + kFixtures + "/libfrugal_fixture_not_plugin.so' is not a frugal plugin (no "
            "'frugal_plugin' symbol): a plugin exports one with FRUGAL_PLUGIN(...) from "
            "frugal/plugin.h");
}

TEST(PluginHost, AbiMismatchShowsBothVersions) {
  PluginHost host({kFixtures});
  EXPECT_EQ(error_of<PluginError>(
                [&] { host.load(plugins_of("[plugins.fixture_bad_abi]\n"), "cfg.toml"); }),
            "plugin 'fixture_bad_abi' (" + kFixtures + "/libfrugal_fixture_bad_abi.so) was built "
            "for plugin ABI 999, this frugal has ABI " + std::to_string(kAbiVersion) +
            ": rebuild it against this frugal");
}

TEST(PluginHost, LibTorchMismatchShowsBothVersions) {
  PluginHost host({kFixtures});
  const std::string msg = error_of<PluginError>(
      [&] { host.load(plugins_of("[plugins.fixture_old_torch]\n"), "cfg.toml"); });
  EXPECT_TRUE(Has(msg, "plugin 'fixture_old_torch'"));
  EXPECT_TRUE(Has(msg, "was built with LibTorch 0.4.1, this frugal uses LibTorch " +
                             std::string(compat::torch_version())));
}

TEST(PluginHost, FactoryThatThrowsIsAPluginErrorNamingThePlugin) {
  std::string msg;
  {
    PluginHost host({kFixtures});
    msg = error_of<PluginError>([&] {
      host.load(plugins_of("[plugins.fixture_faulty]\nfail_in = \"factory\"\n"), "cfg.toml");
    });
  }
  // The host is gone and the library unloaded: the message is the host's own copy.
  EXPECT_EQ(msg, "plugin 'fixture_faulty' failed to start: refusing to start (fail_in = factory)");
}

/// Saves a checkpoint at the end of the first stage.
class SaveAfterFirstStage : public Callback {
 public:
  explicit SaveAfterFirstStage(std::string path) : path_(std::move(path)) {}
  std::string name() const override { return "save"; }
  void after_stage(Learner& l) override {
    if (l.stage_index() != 0) return;
    l.save(path_);
    saved = clone_params(*l.model());
  }
  std::vector<torch::Tensor> saved;

 private:
  std::string path_;
};

TEST(PluginHost, EventThatThrowsNamesPluginAndEventAndKeepsTheCheckpoint) {
  TempDir dir;
  const std::string ckpt = dir.file("model.pt");
  auto learner = make_tiny_learner();
  auto saver = std::make_shared<SaveAfterFirstStage>(ckpt);
  learner->add_callback(saver);
  PluginHost host({kFixtures});
  for (auto& cb : host.load(plugins_of("[plugins.fixture_faulty]\nfail_in = \"before_step\"\n"
                                       "after_steps = 6\n"),
                            "cfg.toml"))
    learner->add_callback(cb);
  try {
    learner->fit(two_stages());  // stage one: steps 0-3; stage two fails at step 6
    FAIL() << "no error";
  } catch (const CallbackError& e) {
    EXPECT_EQ(e.callback(), "fixture_faulty");
    EXPECT_EQ(e.event(), "before_step");
    EXPECT_EQ(e.reason(), "boom after 6 steps");
  }
  ASSERT_FALSE(saver->saved.empty());
  TinySetup other;
  other.seed = 7;
  auto fresh = make_tiny_learner(other);
  ASSERT_FALSE(params_equal(*fresh->model(), saver->saved));
  fresh->load(ckpt);
  EXPECT_TRUE(params_equal(*fresh->model(), saver->saved));
}

TEST(PluginHost, OnLoadRegistersAModelUntilTheHostIsDestroyed) {
  ASSERT_FALSE(models().contains("fixture_mlp"));
  {
    PluginHost host({kFixtures});
    auto cbs = host.load(plugins_of("[plugins.fixture_models]\n"), "cfg.toml");
    ASSERT_EQ(cbs.size(), 1u);
    ASSERT_TRUE(models().contains("fixture_mlp"));
    ModelOptions mo;
    mo.arch = "fixture_mlp";
    ModelInput in;
    in.image_size = 8;
    in.num_classes = 3;
    auto model = make_model(mo, in);
    EXPECT_EQ(model->forward(torch::zeros({2, 1, 8, 8})).sizes(), (std::vector<int64_t>{2, 3}));
  }
  EXPECT_FALSE(models().contains("fixture_mlp"));
}

TEST(PluginHost, APluginsOptimizerIsNamedByTheConfigAndByOptimSwapsTarget) {
  TempDir dir;
  std::ofstream(dir.file("run.toml")) <<
             "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\n"
             "batch_size = 16\nvalid_samples = -1\n[model]\narch = \"mlp\"\nwidth = 16\n"
             "[run]\ndevice = \"cpu\"\nprogress = \"none\"\n"
             "[optimizer]\nname = \"fixture_sgd\"\nlr = 0.01\ndampening = 0.1\n"
             "[[stages]]\nname = \"a\"\nepochs = 2\n"
             "[plugins]\npath = \"" + kFixtures + "\"\n[plugins.fixture_models]\n"
             "[plugins.optim_swap]\nat_epoch = 1\n"
             "to = { name = \"fixture_sgd\", lr = 0.05, momentum = 0.5, dampening = 0.25 }\n";
  ASSERT_FALSE(optimizers().contains("fixture_sgd"));
  {
    // Plugins load before the rest of the config is read: [optimizer] may name fixture_sgd.
    ConfigWithPlugins loaded = load_config_with_plugins(dir.file("run.toml"));
    EXPECT_EQ(loaded.config.optimizer.name, "fixture_sgd");
    EXPECT_DOUBLE_EQ(loaded.config.optimizer.get<double>("dampening"), 0.1);
    EXPECT_DOUBLE_EQ(loaded.config.optimizer.get<double>("momentum"), 0.9);  // its default
    auto l = make_learner(loaded.config);
    for (auto& cb : loaded.callbacks) l->add_callback(cb);
    const auto& first = static_cast<torch::optim::SGDOptions&>(l->optimizer().param_groups()[0].options());
    EXPECT_DOUBLE_EQ(first.dampening(), 0.1);
    l->fit(loaded.config.stages);
    // optim_swap swapped to its `to`, the plugin's optimizer with its own keys.
    EXPECT_EQ(l->optimizer_changes(), 1);
    EXPECT_EQ(l->optimizer_options().name, "fixture_sgd");
    const auto& now = static_cast<torch::optim::SGDOptions&>(l->optimizer().param_groups()[0].options());
    EXPECT_DOUBLE_EQ(now.lr(), 0.05);
    EXPECT_DOUBLE_EQ(now.momentum(), 0.5);
    EXPECT_DOUBLE_EQ(now.dampening(), 0.25);
    l->clear_callbacks();
  }
  EXPECT_FALSE(optimizers().contains("fixture_sgd")) << "removed before the library unloads";
  // Without the plugin the name is unknown, and the error lists what is registered.
  try {
    load_config(dir.file("run.toml"));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'optimizer.name' must be one of adafactor, adagrad, adam, adam8bit, "
                                         "adamw, adamw8bit, rmsprop, sgd; got \"fixture_sgd\""),
              std::string::npos)
        << e.what();
  }
}

TEST(PluginHost, ConflictingPluginsAreRefusedBeforeAnyRuns) {
  PluginHost host({kFixtures});
  EXPECT_EQ(error_of<PluginError>([&] {
              host.load(plugins_of("[plugins.fixture_faulty]\n[plugins.fixture_models]\n"), "cfg.toml");
            }),
            "callbacks 'fixture_faulty' and 'fixture_models' conflict: 'fixture_faulty' declares "
            "that it cannot run together with 'fixture_models'; turn one off (a plugin: enabled = "
            "false)");
  EXPECT_FALSE(models().contains("fixture_mlp"));  // fixture_models' on_load never ran
}

TEST(PluginHost, RunsBeforeIsCheckedAgainstTheOrders) {
  PluginHost host({kFixtures});
  // fixture_models (order 10) must run before fixture_counter (order 0 by default).
  EXPECT_EQ(error_of<PluginError>([&] {
              host.load(plugins_of("[plugins.fixture_models]\n[plugins.fixture_counter]\n"), "cfg.toml");
            }),
            "callback 'fixture_models' must run before 'fixture_counter', but its order is 10 and "
            "'fixture_counter' has order 0: give 'fixture_models' a smaller order than "
            "'fixture_counter'");
  PluginHost ok({kFixtures});
  auto cbs = ok.load(plugins_of("[plugins.fixture_models]\n[plugins.fixture_counter]\norder = 20\n"),
                     "cfg.toml");
  EXPECT_EQ(ok.loaded(), (std::vector<std::string>{"fixture_models", "fixture_counter"}));
  ASSERT_EQ(cbs.size(), 2u);
  EXPECT_EQ(cbs[0]->name(), "fixture_models");
}

TEST(PluginHost, DiscoverListsPluginsWithTheirOptionsAndReportsProblems) {
  PluginHost host({kFixtures});
  std::vector<std::string> problems;
  const auto found = host.discover(&problems);
  const PluginDescription* counter = nullptr;
  for (const auto& d : found)
    if (d.name == "fixture_counter") counter = &d;
  ASSERT_NE(counter, nullptr);
  EXPECT_EQ(counter->path, kFixtures + "/libfrugal_fixture_counter.so");
  EXPECT_EQ(counter->version, "1.2.3");
  EXPECT_EQ(counter->abi_version, kAbiVersion);
  EXPECT_EQ(counter->torch_version, compat::torch_version());
  ASSERT_EQ(counter->options.size(), 2u);
  EXPECT_EQ(counter->options[0]["key"], "every");
  EXPECT_EQ(counter->options[0]["default"], 1);
  EXPECT_EQ(counter->options[0]["allowed"], "an integer >= 1");
  nlohmann::json j = *counter;
  EXPECT_EQ(j["description"], "counts batches (test fixture)");
  for (const auto& d : found) {
    if (d.name == "fixture_models") {
      EXPECT_EQ(d.relations.runs_before, std::vector<std::string>{"fixture_counter"});
    }
  }

  std::string all;
  for (const auto& p : problems) all += p + "\n";
  EXPECT_TRUE(Has(all, "libfrugal_fixture_not_plugin.so' is not a frugal plugin"));
  EXPECT_TRUE(Has(all, "was built for plugin ABI 999"));
  EXPECT_TRUE(Has(all, "was built with LibTorch 0.4.1"));
}

TEST(PluginHost, SearchPathHonoursFrugalPluginPath) {
  ScopedEnv env("FRUGAL_PLUGIN_PATH", "/nonexistent/a:" + kFixtures);
  PluginHost host;  // no extra folders: the fixtures come from the environment
  const auto& sp = host.search_path();
  ASSERT_GE(sp.size(), 3u);
  EXPECT_EQ(sp.front(), FRUGAL_TEST_PLUGIN_DIR);  // the build's folder comes first
  EXPECT_EQ(sp[sp.size() - 2], "/nonexistent/a");
  EXPECT_EQ(sp.back(), kFixtures);
  EXPECT_EQ(host.load(plugins_of("[plugins.fixture_counter]\n"), "cfg.toml").size(), 1u);
}

TEST(PluginHost, ConfigPathsResolveAgainstTheTomlFolder) {
  EXPECT_EQ(PluginHost::config_paths(plugins_of("[plugins]\npath = \"p\"\n"), "/a/b/run.toml"),
            std::vector<std::string>{"/a/b/p"});
  EXPECT_EQ(PluginHost::config_paths(plugins_of("[plugins]\npath = [\"../x\", \"/abs\"]\n"),
                                     "/a/b/run.toml"),
            (std::vector<std::string>{"/a/x", "/abs"}));
  EXPECT_TRUE(PluginHost::config_paths(plugins_of("[plugins.amp]\n"), "/a/run.toml").empty());
  EXPECT_TRUE(Has(error_of<ConfigError>([] {
                PluginHost::config_paths(plugins_of("[plugins]\npath = 3\n", "run.toml"), "run.toml");
              }),
              "run.toml:2:8: 'plugins.path' must be a folder or a list of folders"));

  // load() searches them too: the fixtures' folder named relative to a TOML next to it.
  const std::filesystem::path fixtures(kFixtures);
  const std::string source = (fixtures.parent_path() / "run.toml").string();
  const auto table = plugins_of(
      "[plugins]\npath = \"" + fixtures.filename().string() + "\"\n[plugins.fixture_counter]\n", source);
  PluginHost host;
  EXPECT_EQ(host.load(table, source).size(), 1u);
  EXPECT_EQ(host.search_path().back(), kFixtures);
}

TEST(PluginHost, AMissingPluginFolderIsAConfigErrorAtItsLine) {
  TempDir dir;
  write_text(dir.file("run.toml"), "[plugins]\npath = \"nope\"\n");
  EXPECT_TRUE(Has(error_of<ConfigError>([&] { load_config_with_plugins(dir.file("run.toml")); }),
                  dir.file("run.toml") + ":2:8: 'plugins.path' names 'nope', which is not a folder"));
}

TEST(PluginHost, TheResolvedConfigFindsItsPluginsFromAnyFolder) {
  // A config beside the fixtures' folder names it relatively; the resolved config (a run's
  // config.toml) names it absolutely and loads the plugin from another folder.
  const std::filesystem::path fixtures(kFixtures);
  const std::string source = (fixtures.parent_path() / "relative.toml").string();
  write_text(source, "[plugins]\npath = \"" + fixtures.filename().string() +
                         "\"\n[plugins.fixture_counter]\n");
  const ConfigWithPlugins loaded = load_config_with_plugins(source);
  const std::string resolved = loaded.config.to_toml();
  EXPECT_NE(resolved.find(kFixtures), std::string::npos) << resolved;
  TempDir elsewhere;
  write_text(elsewhere.file("config.toml"), resolved);
  const ConfigWithPlugins again = load_config_with_plugins(elsewhere.file("config.toml"));
  EXPECT_EQ(again.host->loaded(), std::vector<std::string>{"fixture_counter"});
  std::filesystem::remove(source);
}

}  // namespace
}  // namespace frugal::test
