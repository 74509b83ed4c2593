// The TOML config: every key checked before any work, errors that name file:line:column and
// the key, --set overrides, stage inheritance and the resolved-config round trip.
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "support.h"

namespace frugal {
namespace {

/// The ConfigError message parse_config throws for `text` (as file "cfg.toml").
std::string config_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, "cfg.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << text;
  return "";
}

::testing::AssertionResult starts_with(const std::string& s, const std::string& prefix) {
  if (s.rfind(prefix, 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << s << "\"\ndoes not start with\n\"" << prefix
                                       << "\"";
}

const nlohmann::json* find_key(const nlohmann::json& fields, const std::string& key) {
  for (const auto& f : fields)
    if (f["key"] == key) return &f;
  return nullptr;
}

// ---- unknown keys ----

TEST(ConfigErrors, UnknownKeyNamesLineColumnAndSuggestion) {
  const std::string msg = config_error(
      "[run]\n"
      "seed = 1\n"
      "\n"
      "[data]\n"
      "dataset = \"synthetic\"\n"
      "batch_size = 8\n"
      "batchsize = 16\n");
  EXPECT_TRUE(starts_with(msg,
                          "cfg.toml:7:1: unknown key 'data.batchsize'; did you mean "
                          "'data.batch_size'? Allowed keys in [data]: dataset, path, batch_size, "
                          "valid_batch_size,"));
  EXPECT_NE(msg.find("samples"), std::string::npos) << msg;  // the whole list
}

TEST(ConfigErrors, UnknownKeyWithNothingNearHasNoSuggestion) {
  const std::string msg = config_error("[run]\nxylophone = 1\n");
  EXPECT_TRUE(starts_with(msg, "cfg.toml:2:1: unknown key 'run.xylophone'. Allowed keys"));
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Allowed keys in [run]: seed, device, out_dir"), std::string::npos) << msg;
}

TEST(ConfigErrors, UnknownTopLevelTableIsNamedWithAllowedTables) {
  const std::string msg = config_error("[run]\nseed = 1\n[datta]\nbatch_size = 4\n");
  EXPECT_EQ(msg,
            "cfg.toml:3:2: unknown key 'datta'; did you mean 'data'? Allowed top-level tables: "
            "run, data, model, optimizer, schedule, loss, stages, plugins, ablation, distributed");
}

TEST(ConfigErrors, UnknownKeyInStageOptimizerNamesFullPath) {
  const std::string msg = config_error(
      "[[stages]]\nname = \"a\"\n[stages.optimizer]\nlearning_rate = 0.1\n");
  EXPECT_TRUE(starts_with(msg, "cfg.toml:4:1: unknown key 'stages.0.optimizer.learning_rate'"))
      << msg;
  EXPECT_NE(msg.find("Allowed keys in [stages.0.optimizer]: name, lr,"), std::string::npos);
}

// ---- types and ranges ----

TEST(ConfigErrors, WrongTypeNamesKeyExpectationAndValue) {
  EXPECT_EQ(config_error("[data]\nbatch_size = \"abc\"\n"),
            "cfg.toml:2:14: 'data.batch_size' must be an integer >= 1, got string \"abc\"");
  EXPECT_EQ(config_error("[data]\nshuffle = \"yes\"\n"),
            "cfg.toml:2:11: 'data.shuffle' must be true or false, got string \"yes\"");
  EXPECT_EQ(config_error("[run]\nout_dir = 3\n"),
            "cfg.toml:2:11: 'run.out_dir' must be a string, got integer 3");
  EXPECT_EQ(config_error("[data]\nsamples = [1, 2]\n"),
            "cfg.toml:2:11: 'data.samples' must be an integer >= 1, got an array");
}

TEST(ConfigErrors, FloatWhereIntegerIsExpectedIsRejected) {
  EXPECT_EQ(config_error("[data]\nbatch_size = 2.0\n"),
            "cfg.toml:2:14: 'data.batch_size' must be an integer >= 1, got float 2.0");
}

TEST(ConfigLoad, IntegerWhereFloatIsExpectedIsAccepted) {
  const Config c =
      parse_config("[optimizer]\nname = \"sgd\"\nlr = 1\nmomentum = 0\n", "cfg.toml");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1.0);
  EXPECT_DOUBLE_EQ(c.optimizer.get<double>("momentum"), 0.0);
}

TEST(ConfigErrors, OutOfRangeNamesLimitAndValue) {
  EXPECT_EQ(config_error("[data]\nbatch_size = 0\n"),
            "cfg.toml:2:14: 'data.batch_size' must be an integer >= 1, got 0");
  EXPECT_EQ(config_error("[[stages]]\nname = \"a\"\n[[stages]]\nname = \"b\"\nimage_size = -1\n"),
            "cfg.toml:5:14: 'stages.1.image_size' must be an integer >= 0, got -1");
  EXPECT_EQ(config_error("[[stages]]\nepochs = -1\n"),
            "cfg.toml:2:10: 'stages.0.epochs' must be an integer >= 0, got -1");
  EXPECT_EQ(config_error("[optimizer]\nlr = 0\n"),
            "cfg.toml:2:6: 'optimizer.lr' must be a number > 0, got 0");
  EXPECT_EQ(config_error("[model]\ndropout = 1.0\n"),
            "cfg.toml:2:11: 'model.dropout' must be a number in [0, 1), got 1.0");
  EXPECT_EQ(config_error("[optimizer]\nbeta2 = 1\n"),
            "cfg.toml:2:9: 'optimizer.beta2' must be a number in [0, 1), got 1");
  EXPECT_EQ(config_error("[data]\nclasses = 1\n"),
            "cfg.toml:2:11: 'data.classes' must be an integer >= 2, got 1");
}

TEST(ConfigErrors, ChoiceErrorListsChoicesAndSuggests) {
  EXPECT_EQ(config_error("[run]\ndevice = \"gpu\"\n"),
            "cfg.toml:2:10: 'run.device' must be one of cpu, cuda, auto; got \"gpu\"; did you "
            "mean \"cpu\"?");
  EXPECT_EQ(config_error("[optimizer]\nname = \"lamb\"\n"),
            "cfg.toml:2:8: 'optimizer.name' must be one of adafactor, adagrad, adam, adam8bit, adamw, adamw8bit, rmsprop, sgd; "
            "got \"lamb\"");
  EXPECT_EQ(config_error("[run]\nprogress = 1\n"),
            "cfg.toml:2:12: 'run.progress' must be one of auto, bar, log, none; got integer 1");
}

TEST(ConfigErrors, StringArrayElementOfWrongTypeIsNamed) {
  EXPECT_EQ(config_error("[[stages]]\nfreeze = [\"conv\", 3]\n"),
            "cfg.toml:2:19: 'stages.0.freeze' must be an array of strings; element 1 is "
            "integer 3");
}

TEST(ConfigErrors, SectionThatIsNotATableIsRejected) {
  EXPECT_EQ(config_error("data = 3\n"),
            "cfg.toml:1:8: 'data' must be a table ([data]), got integer 3");
  EXPECT_EQ(config_error("plugins = \"amp\"\n"),
            "cfg.toml:1:11: 'plugins' must be a table ([plugins]), got string \"amp\"");
}

TEST(ConfigErrors, CheckErrorIsPrefixedWithTableLocation) {
  const std::string msg = config_error("[run]\nseed = 3\n[model]\narch = \"vit\"\nwidth = 30\n");
  EXPECT_TRUE(starts_with(msg, "cfg.toml:3:1: 'model.width' (30) must be divisible by "
                               "'model.heads' (4)"))
      << msg;
  EXPECT_NE(msg.find("width = 32"), std::string::npos) << msg;  // how to fix it
  EXPECT_NO_THROW(parse_config("[model]\narch = \"vit\"\nwidth = 32\n", "cfg.toml"));
  EXPECT_NO_THROW(parse_config("[model]\narch = \"cnn\"\nwidth = 30\n", "cfg.toml"));
}

// ---- syntax and files ----

TEST(ConfigErrors, MalformedTomlHasLineAndColumn) {
  const std::string msg = config_error("[data]\nbatch_size = 4\nshuffle = = true\n");
  EXPECT_TRUE(starts_with(msg, "cfg.toml:3:11: TOML syntax error: ")) << msg;
  EXPECT_GT(msg.size(), std::string("cfg.toml:3:11: TOML syntax error: ").size());
}

TEST(ConfigErrors, MissingFileIsNamed) {
  try {
    load_config("/nonexistent/frugal/x.toml");
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "cannot read config file '/nonexistent/frugal/x.toml': No such file or "
                 "directory");
  }
}

TEST(ConfigLoad, LoadConfigReadsFileAndRecordsSource) {
  test::TempDir dir;
  const std::string path = dir.file("run.toml");
  std::ofstream(path) << "[data]\nbatch_size = 32\n[run]\ndevice = \"gpu\"\n";
  try {
    load_config(path);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(starts_with(e.what(), path + ":4:10: 'run.device'"));
  }
  const Config c = load_config(path, {"run.device=cpu"});
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.data.batch_size, 32);
  EXPECT_EQ(c.run.device, "cpu");
}

// ---- --set overrides ----

TEST(ConfigOverrides, SetChangesValuesBeforeValidation) {
  const Config c = parse_config(
      "[data]\nbatch_size = 0\n[[stages]]\nname = \"a\"\n[[stages]]\nname = \"b\"\n", "cfg.toml",
      {"data.batch_size=64", "run.out_dir=runs/x y", "stages.1.epochs=3", "model.dropout=0.25",
       "stages.0.freeze=[\"conv1\", \"conv2\"]", "stages.1.optimizer.lr = 0.5"});
  EXPECT_EQ(c.data.batch_size, 64);  // the file's invalid 0 is never validated
  EXPECT_EQ(c.run.out_dir, "runs/x y");  // not TOML: a plain string
  EXPECT_EQ(c.stages.at(1).epochs, 3);
  EXPECT_EQ(c.stages.at(0).epochs, 1);
  EXPECT_DOUBLE_EQ(c.model.dropout, 0.25);
  EXPECT_EQ(c.stages.at(0).freeze, (std::vector<std::string>{"conv1", "conv2"}));
  EXPECT_TRUE(c.stages.at(1).has_optimizer);
  EXPECT_DOUBLE_EQ(c.stages.at(1).optimizer.lr, 0.5);
  EXPECT_FALSE(c.stages.at(0).has_optimizer);
}

TEST(ConfigOverrides, BadSetValueErrorNamesTheSet) {
  EXPECT_EQ(config_error("[data]\nbatch_size = 8\n", {"data.batch_size=0"}),
            "--set data.batch_size=0: 'data.batch_size' must be an integer >= 1, got 0");
  EXPECT_EQ(config_error("", {"run.device=gpu"}),
            "--set run.device=gpu: 'run.device' must be one of cpu, cuda, auto; got \"gpu\"; "
            "did you mean \"cpu\"?");
  EXPECT_TRUE(starts_with(config_error("", {"data.batchsize=3"}),
                          "--set data.batchsize=3: unknown key 'data.batchsize'; did you mean "
                          "'data.batch_size'?"));
  EXPECT_TRUE(starts_with(config_error("", {"datta.batch_size=3"}),
                          "--set datta.batch_size=3: unknown key 'datta'; did you mean 'data'?"));
}

TEST(ConfigOverrides, MalformedSetIsRejected) {
  EXPECT_EQ(config_error("", {"foo"}), "--set 'foo': expected KEY=VALUE");
  EXPECT_EQ(config_error("", {"=3"}), "--set '=3': expected KEY=VALUE");
  EXPECT_EQ(config_error("", {"data..batch_size=3"}),
            "--set 'data..batch_size=3': expected KEY=VALUE");
  // toml++ writes a key with a tab back unquoted: the run's config.toml would not read again.
  EXPECT_EQ(config_error("", {"plugins.gra\td_accum.steps=2"}),
            "--set plugins.gra\td_accum.steps=2: a key holds no control character (a tab, a newline)");
  EXPECT_EQ(config_error("[plugins.\"gra\\td\"]\nx = 1\n", {}),
            "cfg.toml:1:1: a key under [plugins] holds a control character (a tab, a newline): "
            "keys are names");
}

TEST(ConfigOverrides, SetIndexOutOfRangeIsRejected) {
  EXPECT_EQ(config_error("[[stages]]\nname = \"a\"\n", {"stages.5.epochs=3"}),
            "--set stages.5.epochs=3: index 5 is out of range: 'stages' has 1 element");
  EXPECT_EQ(config_error("", {"stages.0.epochs=3"}),
            "--set stages.0.epochs=3: index 0 is out of range: 'stages' is not set");
  EXPECT_EQ(config_error("[data]\nbatch_size = 8\n", {"data.batch_size.x=3"}),
            "--set data.batch_size.x=3: 'data.batch_size' is integer 8, not a table");
  EXPECT_EQ(config_error("", {"data.batch_size.x=3"}),  // absent: a table is made, then refused
            "--set data.batch_size.x=3: 'data.batch_size' must be an integer >= 1, got a table");
}

// ---- stages ----

TEST(ConfigStages, StageOptimizerInheritsGlobalOptimizer) {
  const Config c = parse_config(
      "[optimizer]\nname = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n"
      "[[stages]]\nname = \"warmup\"\nepochs = 2\nfreeze = [\"features\"]\nimage_size = 14\n"
      "[[stages]]\nname = \"finetune\"\n[stages.optimizer]\nlr = 0.01\n",
      "cfg.toml");
  ASSERT_EQ(c.stages.size(), 2u);
  const StageOptions& warmup = c.stages[0];
  EXPECT_EQ(warmup.name, "warmup");
  EXPECT_EQ(warmup.epochs, 2);
  EXPECT_EQ(warmup.freeze, std::vector<std::string>{"features"});
  EXPECT_EQ(warmup.image_size, 14);
  EXPECT_FALSE(warmup.has_optimizer);
  const StageOptions& finetune = c.stages[1];
  EXPECT_TRUE(finetune.has_optimizer);
  EXPECT_EQ(finetune.optimizer.name, "sgd");  // inherited
  EXPECT_DOUBLE_EQ(finetune.optimizer.get<double>("momentum"), 0.9);  // inherited
  EXPECT_DOUBLE_EQ(finetune.optimizer.lr, 0.01);  // its own
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.1);  // the global one is untouched
}

TEST(ConfigStages, DuplicateStageNamesAreRejected) {
  const std::string msg = config_error(
      "[[stages]]\nname = \"warmup\"\n[[stages]]\nname = \"main\"\n[[stages]]\nname = "
      "\"warmup\"\n");
  EXPECT_TRUE(starts_with(msg, "cfg.toml:6:8: 'stages.2.name' repeats the stage name \"warmup\" "
                               "of stages.0 at cfg.toml:2:8"))
      << msg;
  // Two unnamed stages are both "train".
  EXPECT_TRUE(starts_with(config_error("[[stages]]\nepochs = 1\n[[stages]]\nepochs = 2\n"),
                          "cfg.toml:3:1: 'stages.1.name' repeats the stage name \"train\""));
}

TEST(ConfigStages, StagesThatAreNotAnArrayOfTablesAreRejected) {
  EXPECT_EQ(config_error("stages = 3\n"),
            "cfg.toml:1:10: 'stages' must be an array of tables (one [[stages]] section per "
            "stage), got integer 3");
  EXPECT_TRUE(starts_with(config_error("[stages]\nname = \"a\"\n"),
                          "cfg.toml:1:1: 'stages' must be an array of tables"));
  EXPECT_TRUE(starts_with(config_error("stages = []\n"),
                          "cfg.toml:1:10: 'stages' must be an array of tables (one [[stages]] "
                          "section per stage), got an empty array"));
}

TEST(ConfigLoad, DefaultsWhenSectionsAreAbsent) {
  const Config c = parse_config("", "empty.toml");
  EXPECT_EQ(c.source, "empty.toml");
  RunOptions run;
  DataOptions data;
  ModelOptions model;
  OptimizerOptions optimizer;
  LossOptions loss;
  Config copy = c;
  EXPECT_EQ(options_to_json(copy.run), options_to_json(run));
  EXPECT_EQ(options_to_json(copy.data), options_to_json(data));
  EXPECT_EQ(options_to_json(copy.model), options_to_json(model));
  EXPECT_EQ(options_to_json(copy.optimizer), options_to_json(optimizer));
  EXPECT_EQ(options_to_json(copy.loss), options_to_json(loss));
  EXPECT_EQ(c.data.batch_size, 128);
  EXPECT_EQ(c.run.device, "auto");
  ASSERT_EQ(c.stages.size(), 1u);
  EXPECT_EQ(c.stages[0].name, "train");
  EXPECT_EQ(c.stages[0].epochs, 1);
  EXPECT_FALSE(c.stages[0].has_optimizer);
  EXPECT_TRUE(c.plugins.empty());

  // A key set in one section leaves the others' defaults alone.
  const Config d = parse_config("[optimizer]\nlr = 0.5\n", "cfg.toml");
  EXPECT_DOUBLE_EQ(d.optimizer.lr, 0.5);
  EXPECT_DOUBLE_EQ(d.optimizer.get<double>("beta2"), 0.999);
  EXPECT_DOUBLE_EQ(d.stages[0].optimizer.lr, 0.5);  // the default stage inherits too
}

TEST(ConfigLoad, PluginsTableIsKeptVerbatimWithPositions) {
  const Config c = parse_config(
      "[plugins]\npath = [\"/opt/p\"]\n[plugins.amp]\nenabled = true\nscale = 1024\n",
      "cfg.toml");
  ASSERT_TRUE(c.plugins["amp"]["scale"].is_integer());
  EXPECT_EQ(c.plugins["amp"]["scale"].value<int64_t>(), 1024);
  EXPECT_EQ(location(*c.plugins["amp"]["scale"].node(), c.source), "cfg.toml:5:9");
}

// ---- the resolved config ----

TEST(ConfigToToml, RoundTripGivesTheSameValues) {
  Config c = parse_config(
      "[run]\nseed = 7\ndevice = \"cpu\"\nout_dir = \"runs/\\\"q\\\"\"\nprogress = \"log\"\n"
      "[data]\ndataset = \"synthetic\"\nbatch_size = 16\nvalid_samples = -1\nshuffle = false\n"
      "[model]\narch = \"vit\"\nwidth = 48\nheads = 6\ndropout = 0.1\n"
      "[optimizer]\nname = \"adamw\"\nlr = 3e-4\nweight_decay = 0.05\n"
      "[loss]\nlabel_smoothing = 0.1\n"
      "[[stages]]\nname = \"frozen\"\nepochs = 2\nfreeze = [\"embed\", \"blocks.0\"]\n"
      "[[stages]]\nname = \"all\"\nimage_size = 14\n[stages.optimizer]\nlr = 1e-5\n"
      "[plugins]\npath = [\"/opt/plugins\"]\n[plugins.ema]\ndecay = 0.999\n",
      "cfg.toml");
  const std::string text = c.to_toml();
  EXPECT_NE(text.find("valid_batch_size = 1000"), std::string::npos) << text;  // defaults too
  EXPECT_NE(text.find("[[stages]]"), std::string::npos) << text;
  Config d = parse_config(text, "resolved.toml");
  EXPECT_EQ(options_to_json(d.run), options_to_json(c.run));
  EXPECT_EQ(options_to_json(d.data), options_to_json(c.data));
  EXPECT_EQ(options_to_json(d.model), options_to_json(c.model));
  EXPECT_EQ(options_to_json(d.optimizer), options_to_json(c.optimizer));
  EXPECT_EQ(options_to_json(d.loss), options_to_json(c.loss));
  ASSERT_EQ(d.stages.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(options_to_json(d.stages[i]), options_to_json(c.stages[i])) << i;
    EXPECT_EQ(d.stages[i].has_optimizer, c.stages[i].has_optimizer) << i;
    EXPECT_EQ(options_to_json(d.stages[i].optimizer), options_to_json(c.stages[i].optimizer));
  }
  EXPECT_EQ(d.run.out_dir, "runs/\"q\"");
  EXPECT_DOUBLE_EQ(d.stages[1].optimizer.lr, 1e-5);
  EXPECT_EQ(d.plugins, c.plugins);
  EXPECT_EQ(d.to_toml(), text);  // a fixed point
  EXPECT_NE(text.find("beta1 = 0.9\n"), std::string::npos) << text;  // shortest exact floats

  // A float that needs all 17 digits still reads back exactly.
  c.optimizer.lr = 0.1 + 0.2;
  EXPECT_EQ(parse_config(c.to_toml(), "resolved.toml").optimizer.lr, 0.1 + 0.2);
}

// ---- options: describers and helpers ----

TEST(OptionsHelpers, EditDistanceIsLevenshtein) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("same", "same"), 0u);
  EXPECT_EQ(edit_distance("batchsize", "batch_size"), 1u);
  EXPECT_EQ(edit_distance("ab", "ba"), 2u);
}

TEST(OptionsHelpers, NearestPicksClosestWithinThreshold) {
  const std::vector<std::string> keys = {"dataset", "path", "batch_size", "valid_batch_size"};
  EXPECT_EQ(nearest("batchsize", keys), "batch_size");
  EXPECT_EQ(nearest("pth", keys), "path");
  EXPECT_EQ(nearest("zzzzzzzz", keys), "");
  EXPECT_EQ(nearest("x", {}), "");
  // Threshold max(2, |word|/3): "abcdefghijkl" (12) allows 4 edits, not 5.
  EXPECT_EQ(nearest("abcdefghijkl", {"abcdefghWXYZ"}), "abcdefghWXYZ");
  EXPECT_EQ(nearest("abcdefghijkl", {"abcdefgVWXYZ"}), "");
}

TEST(OptionsHelpers, LimitsDescribeThemselves) {
  EXPECT_EQ(at_least(1).describe(true), "an integer >= 1");
  EXPECT_EQ(positive().describe(false), "a number > 0");
  EXPECT_EQ(between(0, 1).describe(false), "a number in [0, 1]");
  EXPECT_EQ(half_open(0, 1).describe(false), "a number in [0, 1)");
  EXPECT_EQ(any_value().describe(true), "an integer");
  EXPECT_EQ(at_least(0.5).describe(false), "a number >= 0.5");
  EXPECT_TRUE(half_open(0, 1).contains(0.0));
  EXPECT_FALSE(half_open(0, 1).contains(1.0));
  EXPECT_FALSE(positive().contains(0.0));
}

TEST(OptionsDescribe, ListsKeysWithTypesDefaultsAndLimits) {
  DataOptions data;
  const nlohmann::json fields = describe_options(data);
  ASSERT_TRUE(fields.is_array());
  // 11 for images, 7 for text (paths, block_size, windows, tokenizer, vocab_size,
  // tokenizer_model, tokenizer_path), 5 for image folders, CSV files and augmentation
  // (valid_path, label_column, task, flip, crop_padding)
  EXPECT_EQ(fields.size(), 23u);
  const auto* paths = find_key(fields, "paths");
  ASSERT_NE(paths, nullptr);
  EXPECT_EQ((*paths)["default"], nlohmann::json::array());
  const auto* batch = find_key(fields, "batch_size");
  ASSERT_NE(batch, nullptr);
  EXPECT_EQ((*batch)["type"], "int");
  EXPECT_EQ((*batch)["default"], 128);
  EXPECT_EQ((*batch)["allowed"], "an integer >= 1");
  EXPECT_FALSE((*batch)["help"].get<std::string>().empty());
  const auto* shuffle = find_key(fields, "shuffle");
  ASSERT_NE(shuffle, nullptr);
  EXPECT_EQ((*shuffle)["type"], "bool");
  EXPECT_EQ((*shuffle)["default"], true);

  RunOptions run;
  run.device = "cpu";  // current values are the defaults shown
  const nlohmann::json run_fields = describe_options(run);
  const auto* device = find_key(run_fields, "device");
  ASSERT_NE(device, nullptr);
  EXPECT_EQ((*device)["type"], "string");
  EXPECT_EQ((*device)["default"], "cpu");
  EXPECT_EQ((*device)["allowed"], "one of cpu, cuda, auto");

  StageOptions stage;
  const nlohmann::json stage_fields = describe_options(stage);
  const auto* freeze = find_key(stage_fields, "freeze");
  ASSERT_NE(freeze, nullptr);
  EXPECT_EQ((*freeze)["type"], "string[]");
  EXPECT_EQ((*freeze)["default"], nlohmann::json::array());
  const auto* opt = find_key(stage_fields, "optimizer");
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ((*opt)["type"], "table");
  const auto* lr = find_key((*opt)["fields"], "lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ((*lr)["type"], "float");
  EXPECT_DOUBLE_EQ((*lr)["default"].get<double>(), 1e-3);
  EXPECT_EQ((*lr)["allowed"], "a number > 0");
}

TEST(OptionsToJson, WritesCurrentValuesWithNestedTables) {
  StageOptions stage;
  stage.name = "ft";
  stage.freeze = {"a"};
  stage.optimizer.lr = 0.25;
  EXPECT_FALSE(options_to_json(stage).contains("optimizer"));  // as to_toml: only its own
  stage.has_optimizer = true;
  const nlohmann::json j = options_to_json(stage);
  EXPECT_EQ(j["name"], "ft");
  EXPECT_EQ(j["epochs"], 1);
  EXPECT_EQ(j["freeze"], nlohmann::json::array({"a"}));
  EXPECT_DOUBLE_EQ(j["optimizer"]["lr"].get<double>(), 0.25);
  EXPECT_EQ(j["optimizer"]["name"], "adam");
}

/// A plugin-style options struct read by read_options directly.
struct EmaOptions : Options {
  double decay = 0.99;
  int64_t every = 1;
  void visit(FieldVisitor& v) override {
    v.field("decay", decay, "decay per step", half_open(0, 1));
    v.field("every", every, "steps between updates", at_least(1));
  }
  void check() const override {
    if (every > 100) throw_config_error("'plugins.ema.every' must be <= 100");
  }
};

TEST(OptionsRead, ReadOptionsFillsPresentKeysAndKeepsDefaults) {
  const Config c = parse_config("[plugins.ema]\nevery = 4\n", "cfg.toml");
  EmaOptions ema;
  read_options(*c.plugins["ema"].as_table(), ema, "plugins.ema", c.source);
  EXPECT_EQ(ema.every, 4);
  EXPECT_DOUBLE_EQ(ema.decay, 0.99);

  const Config bad = parse_config("[plugins.ema]\nevry = 4\n[plugins.x]\nevery = 200\n", "p.toml");
  try {
    read_options(*bad.plugins["ema"].as_table(), ema, "plugins.ema", bad.source);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "p.toml:2:1: unknown key 'plugins.ema.evry'; did you mean 'plugins.ema.every'? "
              "Allowed keys in [plugins.ema]: decay, every");
  }
  try {
    read_options(*bad.plugins["x"].as_table(), ema, "plugins.x", bad.source);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "p.toml:3:1: 'plugins.ema.every' must be <= 100");
  }
}

// ---- byte sizes: read once, errors at the value ----

TEST(ByteSizeField, ReadsUnitsIntegersAndNone) {
  EXPECT_EQ(parse_config("[run]\nmemory_budget = \"2.5MiB\"\n", "cfg.toml").run.memory_budget.bytes,
            2621440);
  EXPECT_EQ(parse_config("[run]\nmemory_budget = \"1.5GB\"\n", "cfg.toml").run.memory_budget.bytes,
            1500000000);
  EXPECT_EQ(parse_config("[run]\nmemory_budget = 1000\n", "cfg.toml").run.memory_budget.bytes, 1000);
  EXPECT_EQ(parse_config("[run]\nmemory_budget = \"\"\n", "cfg.toml").run.memory_budget.bytes, 0);
  EXPECT_EQ(parse_config("[run]\nmemory_budget = 0\n", "cfg.toml").run.memory_budget.bytes, 0);
  EXPECT_EQ(parse_config("", "cfg.toml", {"run.memory_budget=3GiB"}).run.memory_budget.bytes,
            3LL << 30);
}

TEST(ByteSizeField, WritesTheShortestExactTextThatReadsBack) {
  EXPECT_EQ(ByteSize{0}.str(), "");
  EXPECT_EQ(ByteSize{1 << 20}.str(), "1MiB");
  EXPECT_EQ(ByteSize{2621440}.str(), "2560KiB");
  EXPECT_EQ(ByteSize{3LL << 30}.str(), "3GiB");
  EXPECT_EQ(ByteSize{1500000000}.str(), "1500000000B");
  Config c = parse_config("[run]\nmemory_budget = \"2.5MiB\"\n", "cfg.toml");
  const std::string text = c.to_toml();
  EXPECT_NE(text.find("memory_budget = '2560KiB'"), std::string::npos) << text;
  EXPECT_EQ(parse_config(text, "resolved.toml").run.memory_budget.bytes, 2621440);
  EXPECT_NE(parse_config("", "cfg.toml").to_toml().find("memory_budget = ''"), std::string::npos);
}

TEST(ByteSizeField, ABadValueIsReportedAtTheValueOrTheOverride) {
  EXPECT_EQ(config_error("[run]\nseed = 1\n\n\n\nmemory_budget = \"lots\"\n"),
            "cfg.toml:6:17: 'run.memory_budget' must be a size such as \"512MiB\" or \"2GiB\", "
            "got \"lots\"");
  EXPECT_EQ(config_error("[run]\nmemory_budget = \"lots\"\n", {"run.memory_budget=2 parsecs"}),
            "--set run.memory_budget=2 parsecs: 'run.memory_budget' has an unknown unit "
            "\"parsecs\"; use B, KiB, MiB, GiB, TiB (or kB, MB, GB, TB)");
  EXPECT_EQ(config_error("[run]\nmemory_budget = -5\n"),
            "cfg.toml:2:17: 'run.memory_budget' must be a size such as \"512MiB\" or \"2GiB\", or "
            "an integer of bytes >= 0, got -5");
  // Found by the mutation fuzz test: 2^63 bytes once wrapped to INT64_MIN ("-8388608TiB").
  EXPECT_EQ(config_error("[run]\nmemory_budget = \"9000000TiB\"\n"),
            "cfg.toml:2:17: 'run.memory_budget' is too large: \"9000000TiB\" is more than 8 EiB");
  EXPECT_EQ(config_error("[run]\nmemory_budget = true\n"),
            "cfg.toml:2:17: 'run.memory_budget' must be a size such as \"512MiB\" or \"2GiB\", or "
            "an integer of bytes, got boolean true");
}

TEST(ByteSizeField, DescribedAsBytes) {
  RunOptions run;
  run.memory_budget.bytes = 64 << 20;
  const nlohmann::json fields = describe_options(run);
  const auto* f = find_key(fields, "memory_budget");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ((*f)["type"], "bytes");
  EXPECT_EQ((*f)["default"], "64MiB");
  EXPECT_EQ((*f)["affects_training"], false);
  EXPECT_FALSE(find_key(fields, "seed")->contains("affects_training"));
}

/// Plugin-style options with a mark and a size.
struct MarkedOptions : Options {
  double decay = 0.9;
  ByteSize report_over{1024};
  void visit(FieldVisitor& v) override {
    v.field("decay", decay, "decay", half_open(0, 1));
    v.field("report_over", report_over, outside_training("log above this"));
  }
};

TEST(OptionsMarks, KeysOutsideTrainingListsTheMarkedFieldsUnderThePrefix) {
  MarkedOptions o;
  EXPECT_EQ(keys_outside_training(o, "plugins.x"), std::vector<std::string>{"plugins.x.report_over"});
  StageOptions stage;
  EXPECT_TRUE(keys_outside_training(stage, "stages.0").empty());
}

}  // namespace
}  // namespace frugal
