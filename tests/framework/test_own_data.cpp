// Users' own data: image folders (PNG and JPEG written here with stb_image_write), CSV files
// (classification and regression), the regression task (mse loss, RMSE metric) and the seeded
// image augmentations, down to a resumed run that matches an uninterrupted one bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_support.h"
#include "frugal/app/model_export.h"
#include "frugal/app/preflight.h"
#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/config/config.h"
#include "frugal/core/learner.h"
#include "frugal/data/data.h"
#include "frugal/data/task.h"
#include "frugal/models/registry.h"
#include "support.h"

// stb_image_write's JPEG encoder left-shifts negative values (see data_image_folder.cpp).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((no_sanitize("shift"))), apply_to = function)
#endif
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#if defined(__clang__)
#pragma clang attribute pop
#endif

// Its own namespace: in a unity build this file shares a translation unit with test_data.cpp.
namespace frugal::own_data {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

template <class Fn>
std::string data_error(Fn&& f) {
  return test::message_of<DataError>(std::forward<Fn>(f));
}

template <class Fn>
std::string config_error(Fn&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

/// A w x h RGB image of one colour, as PNG or JPEG (quality 100).
void write_solid(const std::string& path, int w, int h, std::array<uint8_t, 3> rgb, bool jpeg) {
  fs::create_directories(fs::path(path).parent_path());
  std::vector<uint8_t> px(static_cast<size_t>(w * h * 3));
  for (size_t i = 0; i < px.size(); ++i) px[i] = rgb[i % 3];
  const int ok = jpeg ? stbi_write_jpg(path.c_str(), w, h, 3, px.data(), 100)
                      : stbi_write_png(path.c_str(), w, h, 3, px.data(), w * 3);
  ASSERT_NE(ok, 0) << path;
}

// ---- image_folder --------------------------------------------------------------------------

/// Classes written out of order; one JPEG; one PNG at the target size with a pattern.
std::vector<uint8_t> write_folder(const std::string& root) {
  write_solid(root + "/zebra/a.png", 8, 6, {200, 10, 30}, false);
  write_solid(root + "/zebra/b.JPG", 16, 16, {20, 220, 120}, true);
  write_solid(root + "/ant/c.png", 8, 8, {0, 0, 255}, false);
  write_text(root + "/ant/notes.txt", "not an image: skipped");
  // 4 x 4 RGB with every byte different: no resize, so the CHW layout must be exact.
  std::vector<uint8_t> px(4 * 4 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(5 * i);
  fs::create_directories(root + "/moth");
  EXPECT_NE(stbi_write_png((root + "/moth/p.png").c_str(), 4, 4, 3, px.data(), 12), 0);
  return px;
}

TEST(ImageFolder, DecodesResizesAndLabelsBySortedSubfolders) {
  TempDir dir;
  const std::vector<uint8_t> pattern = write_folder(dir.file("train"));
  const Dataset d = load_image_folder(dir.file("train"), 3, 4);
  EXPECT_EQ(d.classes, (std::vector<std::string>{"ant", "moth", "zebra"}));
  EXPECT_EQ(d.num_classes, 3);
  ASSERT_EQ(d.images.sizes(), torch::IntArrayRef({4, 3, 4, 4}));
  EXPECT_EQ(d.images.scalar_type(), torch::kUInt8);
  // The classes take turns, each in name order: ant/c.png, moth/p.png, zebra/a.png, zebra/b.JPG.
  EXPECT_TRUE(torch::equal(d.labels, torch::tensor({0, 1, 2, 2}, torch::kLong)));
  // So the first n files (data.train_samples = n) hold every class, not the first ones.
  for (const char* f : {"turns/a/1.png", "turns/a/2.png", "turns/b/1.png", "turns/b/2.png"})
    write_solid(dir.file(f), 2, 2, {1, 2, 3}, false);
  EXPECT_EQ(list_image_folder(dir.file("turns")).labels, (std::vector<int64_t>{0, 1, 0, 1}));
  const auto channel = [&](int64_t i, int64_t c) { return d.images[i][c].to(torch::kInt); };
  // A solid PNG resized stays its colour (to a rounding step); JPEG to a few levels.
  for (int c = 0; c < 3; ++c) {
    const int want[3][3] = {{0, 0, 255}, {200, 10, 30}, {20, 220, 120}};
    EXPECT_LE((channel(0, c) - want[0][c]).abs().max().item<int>(), 1) << "ant/c.png channel " << c;
    EXPECT_LE((channel(2, c) - want[1][c]).abs().max().item<int>(), 1) << "zebra/a.png channel " << c;
    EXPECT_LE((channel(3, c) - want[2][c]).abs().max().item<int>(), 4) << "zebra/b.JPG channel " << c;
  }
  // HWC bytes land in CHW order.
  auto hwc = torch::from_blob(const_cast<uint8_t*>(pattern.data()), {4, 4, 3}, torch::kUInt8);
  EXPECT_TRUE(torch::equal(d.images[1], hwc.permute({2, 0, 1})));
}

TEST(ImageFolder, GreyAndValidationFolderUseTheTrainingClasses) {
  TempDir dir;
  write_folder(dir.file("train"));
  write_solid(dir.file("valid/zebra/v.png"), 5, 5, {100, 100, 100}, false);
  const Dataset train = load_image_folder(dir.file("train"), 1, 4);
  EXPECT_EQ(train.images.size(1), 1);
  // stb's grey of pure blue (0, 0, 255): (0*77 + 0*150 + 255*29) >> 8 = 28.
  EXPECT_LE((train.images[0].to(torch::kInt) - 28).abs().max().item<int>(), 1);
  const Dataset valid = load_image_folder(dir.file("valid"), 1, 4, train.classes);
  ASSERT_EQ(valid.size(), 1);
  EXPECT_EQ(valid.labels[0].item<int64_t>(), 2);  // zebra is the training folder's class 2
  EXPECT_EQ(valid.num_classes, 3);
}

TEST(ImageFolder, ErrorsNameTheFileAndWhatIsWrong) {
  TempDir dir;
  write_folder(dir.file("a"));
  write_text(dir.file("a/ant/broken.png"), "this is not a PNG");
  std::string msg = data_error([&] { load_image_folder(dir.file("a"), 3, 4); });
  EXPECT_NE(msg.find(dir.file("a/ant/broken.png")), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot decode"), std::string::npos) << msg;

  write_solid(dir.file("b/loose.png"), 2, 2, {1, 2, 3}, false);
  msg = data_error([&] { load_image_folder(dir.file("b"), 3, 4); });
  EXPECT_NE(msg.find(dir.file("b/loose.png")), std::string::npos) << msg;
  EXPECT_NE(msg.find("outside a class sub-folder"), std::string::npos) << msg;

  fs::create_directories(dir.file("c/empty"));
  msg = data_error([&] { load_image_folder(dir.file("c"), 3, 4); });
  EXPECT_NE(msg.find(dir.file("c/empty")), std::string::npos) << msg;
  EXPECT_NE(msg.find("no PNG or JPEG"), std::string::npos) << msg;

  write_solid(dir.file("v/wasp/x.png"), 2, 2, {1, 2, 3}, false);
  msg = data_error([&] { load_image_folder(dir.file("v"), 3, 4, {"ant", "zebra"}); });
  EXPECT_NE(msg.find("'wasp' is not a class of the training folder"), std::string::npos) << msg;

  msg = data_error([&] { load_image_folder(dir.file("nowhere"), 3, 4); });
  EXPECT_NE(msg.find(dir.file("nowhere") + "': no such folder"), std::string::npos) << msg;
}

TEST(ImageFolder, TrainsThroughTheConfigAndPreflightCountsItsBytes) {
  TempDir dir;
  write_folder(dir.file("train"));
  write_solid(dir.file("valid/zebra/v.png"), 5, 5, {100, 100, 100}, false);
  write_solid(dir.file("valid/ant/w.jpeg"), 9, 7, {10, 10, 200}, true);
  const Config c = parse_config(
      "[run]\nthreads = 1\nout_dir = \"" + dir.file("run") + "\"\n[data]\ndataset = \"image_folder\"\n"
          "path = \"" + dir.file("train") + "\"\nvalid_path = \"" + dir.file("valid") +
          "\"\nchannels = 3\nimage_size = 8\nbatch_size = 2\nflip = true\ncrop_padding = 1\n"
          "[model]\narch = \"mlp\"\nwidth = 8\n[[stages]]\nepochs = 1\n",
      "images.toml");
  auto l = make_learner(c);
  l->fit(c.stages);
  EXPECT_EQ(l->valid_sums().count, 2);
  // 6 images of 3 x 8 x 8 bytes and an int64 label each.
  EXPECT_EQ(l->data_bytes(), 6 * (3 * 8 * 8 + 8));
  EXPECT_EQ(estimated_data_bytes(c), l->data_bytes());
  // The model a run folder is reloaded into (`frugal evaluate`) has one output per class folder.
  torch::nn::Sequential m = make_config_model(c);
  EXPECT_EQ(m->parameters().back().size(0), 3);
}

// ---- csv -----------------------------------------------------------------------------------

TEST(Csv, ClassificationStandardizesWithTheTrainingStatistics) {
  TempDir dir;
  // Labels "10" and "9" sort as numbers (9 < 10), not as text; a quoted field holds a comma.
  write_text(dir.file("train.csv"),
             "a, b ,kind\n1,10,10\n\n2,20,9\r\n3,30,10\n4,\"40\",7\n");
  write_text(dir.file("valid.csv"), "a,b,kind\n2.5,25,9\n");
  const CsvSpec spec{"kind", false};
  const Dataset t = load_csv(dir.file("train.csv"), spec, dir.file("train.csv"));
  EXPECT_EQ(t.classes, (std::vector<std::string>{"7", "9", "10"}));
  EXPECT_TRUE(torch::equal(t.labels, torch::tensor({2, 1, 2, 0}, torch::kLong)));
  ASSERT_EQ(t.features.sizes(), torch::IntArrayRef({4, 2}));
  EXPECT_EQ(t.channels(), 2);
  EXPECT_EQ(t.height(), 1);
  // Column a = 1..4: mean 2.5, sample std sqrt(5/3).
  const double sd = std::sqrt(5.0 / 3.0);
  EXPECT_NEAR(t.features[0][0].item<double>(), (1 - 2.5) / sd, 1e-6);
  EXPECT_NEAR(t.features[3][1].item<double>(), (40 - 25) / (10 * sd), 1e-6);
  const Dataset v = load_csv(dir.file("valid.csv"), spec, dir.file("train.csv"));
  // The training mean standardizes to 0 in the validation file too.
  EXPECT_NEAR(v.features.abs().max().item<double>(), 0.0, 1e-6);
  EXPECT_EQ(v.labels[0].item<int64_t>(), 1);
  EXPECT_EQ(csv_shape(dir.file("train.csv"), spec).classes, 3);
  EXPECT_EQ(csv_shape(dir.file("train.csv"), spec).rows, 4);
  // Excel's "CSV UTF-8": a byte-order mark before the header, CRLF after quoted fields.
  write_text(dir.file("excel.csv"), "\xEF\xBB\xBF\"a\",\"kind\"\r\n1,\"cat\"\r\n2,\"dog\" \r\n");
  const Dataset e = load_csv(dir.file("excel.csv"), CsvSpec{"kind", false}, dir.file("excel.csv"));
  EXPECT_EQ(e.classes, (std::vector<std::string>{"cat", "dog"}));
}

TEST(Csv, ErrorsNameFileLineAndColumn) {
  TempDir dir;
  const std::string f = dir.file("bad.csv");
  write_text(f, "x,y,label\n1,2,a\n3,oops,b\n");
  std::string msg = data_error([&] { load_csv(f, {}, f); });
  EXPECT_NE(msg.find("'" + f + "':3: column 2 ('y'): 'oops' is not a finite number"), std::string::npos) << msg;

  write_text(f, "x,y,label\n1,2,a\n1,2\n");
  msg = data_error([&] { load_csv(f, {}, f); });
  EXPECT_NE(msg.find("'" + f + "':3: 2 fields, but the header has 3 columns"), std::string::npos) << msg;

  write_text(f, "x,y,label\n1,2,3.5\n1,2,nan\n");
  msg = data_error([&] { load_csv(f, {"", true}, f); });
  EXPECT_NE(msg.find("'" + f + "':3: column 3 ('label'): 'nan' is not a finite number (a regression target)"),
            std::string::npos) << msg;

  write_text(f, "x,y,label\n1,\"2\"x,a\n");
  msg = data_error([&] { load_csv(f, {}, f); });
  EXPECT_NE(msg.find("'" + f + "':2: 'x' after the closing quote of field 2"), std::string::npos) << msg;

  write_text(f, "x,y,label\n1,2,3.5\n1,2,nan\n");
  msg = data_error([&] { load_csv(f, {"target", true}, f); });
  EXPECT_NE(msg.find("no column 'target' (data.label_column)"), std::string::npos) << msg;

  write_text(dir.file("t.csv"), "x,label\n1,a\n2,b\n");
  write_text(dir.file("v.csv"), "x,label\n1,a\n\n2,c\n");
  msg = data_error([&] { load_csv(dir.file("v.csv"), {}, dir.file("t.csv")); });
  EXPECT_NE(msg.find("'" + dir.file("v.csv") + "':4: column 2 ('label'): label 'c' is not among the training file's 2 classes"),
            std::string::npos) << msg;
}

// ---- the regression task -------------------------------------------------------------------

/// y = 2 a - b + 0.5 (exactly linear): an mlp learns it in a few steps.
void write_linear_csv(const std::string& path, int rows, int offset) {
  std::ostringstream os;
  os << "a,b,y\n";
  for (int i = 0; i < rows; ++i) {
    const double a = std::sin(0.7 * (i + offset)), b = std::cos(1.3 * (i + offset));
    os << a << "," << b << "," << 2 * a - b + 0.5 << "\n";
  }
  write_text(path, os.str());
}

std::string regression_toml(const TempDir& dir) {
  return "[run]\nthreads = 1\nout_dir = \"" + dir.file("run") + "\"\n"
         "[data]\ndataset = \"csv\"\ntask = \"regression\"\npath = \"" + dir.file("train.csv") +
         "\"\nvalid_path = \"" + dir.file("valid.csv") + "\"\nbatch_size = 16\n"
         "[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n"
         "[optimizer]\nname = \"adam\"\nlr = 0.02\n"
         "[loss]\nname = \"mse\"\n"
         "[[stages]]\nepochs = 10\n";
}

TEST(Regression, TinyCsvTrainedAFewStepsLowersTheRmse) {
  TempDir dir;
  write_linear_csv(dir.file("train.csv"), 64, 0);
  write_linear_csv(dir.file("valid.csv"), 32, 1000);
  const Config c = parse_config(regression_toml(dir), "regression.toml");
  auto l = make_learner(c);
  ASSERT_EQ(l->task().kind, TaskKind::Regression);
  l->validate();
  const TaskMetric before = l->valid_metric();
  EXPECT_EQ(before.name, "rmse");
  EXPECT_FALSE(before.higher_is_better);
  EXPECT_EQ(l->valid_accuracy(), -1);  // no argmax for a regression
  l->fit(c.stages);
  const TaskMetric after = l->valid_metric();
  EXPECT_LT(after.value, 0.5 * before.value) << before.text << " -> " << after.text;
  EXPECT_NEAR(after.value * after.value, l->valid_sums().mean_loss(), 1e-12);

  // The report: the task, the MSE and RMSE, no accuracy; metric_from_json reads it back.
  const nlohmann::json r = l->report();
  EXPECT_EQ(r["task"], "regression");
  EXPECT_FALSE(r.contains("valid_accuracy"));
  EXPECT_NEAR(r["valid_rmse"].get<double>(), after.value, 1e-12);
  const TaskMetric back = metric_from_json(r["valid_metric"]);
  EXPECT_EQ(back.name, "rmse");
  EXPECT_EQ(back.value, after.value);
  EXPECT_FALSE(back.higher_is_better);
  EXPECT_FALSE(r["stages"][0].contains("valid_accuracy"));
  // score() on the bare model (what `frugal evaluate` runs) gives the same sums.
  const MetricSums s = score(*l->valid_data(), [&](const torch::Tensor& x) { return l->model()->forward(x); },
                             torch::kCPU);
  EXPECT_NEAR(s.mean_loss(), l->valid_sums().mean_loss(), 1e-9);
  // preflight's estimate is the bytes the learner holds.
  EXPECT_EQ(estimated_data_bytes(c), l->data_bytes());
}

/// The regression CSVs and config in `dir`, trained through the CLI into dir/run.
test::CliResult train_regression_run(const TempDir& dir) {
  write_linear_csv(dir.file("train.csv"), 64, 0);
  write_linear_csv(dir.file("valid.csv"), 32, 1000);
  std::string toml = regression_toml(dir);
  toml.replace(toml.find("[run]\n"), 6, "[run]\nprogress = \"none\"\n");
  write_text(dir.file("r.toml"), toml);
  return test::run_cli("train " + dir.file("r.toml"));
}

TEST(RegressionCli, TrainEvaluateAndTheReportSpeakRmse) {
  TempDir dir;
  const test::CliResult train = train_regression_run(dir);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const nlohmann::json report = nlohmann::json::parse(test::read_text(dir.file("run/report.json")));
  const double rmse = report["fit"]["valid_rmse"].get<double>();
  const std::string md = test::read_text(dir.file("run/report.md"));
  EXPECT_NE(md.find("| valid RMSE |"), std::string::npos) << md;
  EXPECT_NE(md.find("validation RMSE "), std::string::npos) << md;
  EXPECT_EQ(md.find("valid accuracy"), std::string::npos) << md;
  // `frugal evaluate` rebuilds the model from the config (the CSV's two features) and scores it.
  const test::CliResult ev = test::run_cli("evaluate " + dir.file("run") + " --json");
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  // stdout and stderr come together: the JSON object is what lies between the braces.
  const size_t open = ev.output.find('{'), close = ev.output.rfind('}');
  ASSERT_TRUE(open != std::string::npos && close != std::string::npos) << ev.output;
  const nlohmann::json j = nlohmann::json::parse(ev.output.substr(open, close - open + 1));
  EXPECT_EQ(j["task"], "regression");
  EXPECT_EQ(j["valid_metric"]["name"], "rmse");
  EXPECT_NEAR(j["valid_metric"]["value"].get<double>(), rmse, 1e-9);
}

/// The JSON lines a `predict --json` printed (stdout and stderr come together).
std::vector<nlohmann::json> json_lines(const std::string& output) {
  std::vector<nlohmann::json> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(PredictCli, ImagesArePredictedFromTheRunFolderAloneAsTheModelSeesThem) {
  TempDir dir;
  write_folder(dir.file("train"));
  write_solid(dir.file("valid/zebra/v.png"), 5, 5, {100, 100, 100}, false);
  write_solid(dir.file("new/x.png"), 12, 10, {30, 40, 220}, false);
  write_text(dir.file("i.toml"),
             "[run]\nthreads = 1\nprogress = \"none\"\nout_dir = \"" + dir.file("run") + "\"\n[data]\n"
             "dataset = \"image_folder\"\npath = \"" + dir.file("train") + "\"\nvalid_path = \"" +
             dir.file("valid") + "\"\nchannels = 3\nimage_size = 8\nbatch_size = 2\n"
             "[model]\narch = \"mlp\"\nwidth = 8\n[[stages]]\nepochs = 2\n");
  ASSERT_EQ(test::run_cli("train " + dir.file("i.toml")).exit_code, 0);
  fs::rename(dir.file("train"), dir.file("moved"));  // predict reads the run folder only
  const test::CliResult r = test::run_cli("predict " + dir.file("run") + " " + dir.file("new/x.png") + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto p = json_lines(r.output);
  ASSERT_EQ(p.size(), 1u) << r.output;
  // evaluate too: the classes come from data.json, not the moved training folder.
  const test::CliResult ev = test::run_cli("evaluate " + dir.file("run") + " --json");
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  const auto report = nlohmann::json::parse(test::read_text(dir.file("run/report.json")));
  EXPECT_NEAR(nlohmann::json::parse(ev.output.substr(ev.output.find('{')))["valid_metric"]["value"].get<double>(),
              report["fit"]["valid_accuracy"].get<double>(), 1e-9);
  // What the model gives for the image decoded, resized and normalized as training did.
  fs::rename(dir.file("moved"), dir.file("train"));
  RunModel run = load_run_model(dir.file("run"));
  const Dataset d = load_image_folder(dir.file("train"), 3, 8);
  torch::NoGradGuard g;
  const auto probs = torch::softmax(
      run.model->forward(prepare_images(decode_image(dir.file("new/x.png"), 3, 8).unsqueeze(0), d.mean, d.std, 0)), 1)[0];
  const int64_t best = probs.argmax().item<int64_t>();
  EXPECT_EQ(p[0]["class"], d.classes[static_cast<size_t>(best)]);
  EXPECT_NEAR(p[0]["top"][0]["probability"].get<double>(), probs[best].item<double>(), 1e-6);
  EXPECT_EQ(p[0]["top"].size(), 3u) << "three classes, --top 3";
}

TEST(PredictCli, CsvRowsAreStandardizedWithTheTrainingStatisticsKeptInTheRunFolder) {
  TempDir dir;
  ASSERT_EQ(train_regression_run(dir).exit_code, 0);
  const nlohmann::json data = nlohmann::json::parse(test::read_text(dir.file("run/data.json")));
  EXPECT_EQ(data["features"]["names"], nlohmann::json({"a", "b"}));
  fs::remove(dir.file("train.csv"));
  const test::CliResult ev = test::run_cli("evaluate " + dir.file("run") + " --json");
  ASSERT_EQ(ev.exit_code, 0) << "the statistics come from data.json: " << ev.output;
  EXPECT_NEAR(nlohmann::json::parse(ev.output.substr(ev.output.find('{')))["valid_metric"]["value"].get<double>(),
              nlohmann::json::parse(test::read_text(dir.file("run/report.json")))["fit"]["valid_rmse"].get<double>(),
              1e-9);
  write_text(dir.file("rows.csv"), "y,b,a\n0,0.5,0.25\n");  // any column order, the label ignored
  const test::CliResult r = test::run_cli("predict " + dir.file("run") + " 0.25,0.5 " + dir.file("rows.csv") + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto p = json_lines(r.output);
  ASSERT_EQ(p.size(), 2u) << r.output;
  EXPECT_EQ(p[0]["value"], p[1]["value"]) << "the same row, given two ways";
  const auto mean = data["features"]["mean"], sd = data["features"]["std"];
  RunModel run = load_run_model(dir.file("run"));
  torch::NoGradGuard g;
  const auto x = torch::tensor({static_cast<float>((0.25 - mean[0].get<double>()) / sd[0].get<double>()),
                                static_cast<float>((0.5 - mean[1].get<double>()) / sd[1].get<double>())}).reshape({1, 2});
  EXPECT_NEAR(p[0]["value"].get<double>(), run.model->forward(x).item<double>(), 1e-6);
  const test::CliResult bad = test::run_cli("predict " + dir.file("run") + " 1,2,3");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("3 values; the model takes 2 features in this order: [\"a\",\"b\"]"), std::string::npos)
      << bad.output;
}

TEST(Regression, TheLossMustMatchTheTask) {
  TempDir dir;
  std::string toml = regression_toml(dir);
  std::string msg = config_error([&] {
    parse_config(toml.substr(0, toml.find("[loss]")) + "[[stages]]\nepochs = 1\n", "r.toml");
  });
  EXPECT_NE(msg.find("'loss.name' = \"cross_entropy\" cannot train 'data.task' = \"regression\""),
            std::string::npos) << msg;
  msg = config_error([&] { parse_config("[data]\ndataset = \"synthetic\"\n[loss]\nname = \"mse\"\n", "c.toml"); });
  EXPECT_NE(msg.find("'loss.name' = \"mse\" needs float targets"), std::string::npos) << msg;
  msg = config_error([&] { parse_config("[data]\ndataset = \"csv\"\npath = \"x.csv\"\n", "v.toml"); });
  EXPECT_NE(msg.find("'data.valid_path' is empty"), std::string::npos) << msg;
}

TEST(Csv, CheckConfigReadsTheFilesBeforeAnyWork) {
  TempDir dir;
  const Config missing = parse_config(regression_toml(dir), "r.toml");
  std::string msg = config_error([&] { check_config(missing); });
  EXPECT_NE(msg.find("r.toml: data.path: cannot read '" + dir.file("train.csv") + "'"), std::string::npos) << msg;
  write_linear_csv(dir.file("train.csv"), 8, 0);
  msg = config_error([&] { check_config(missing); });
  EXPECT_NE(msg.find("r.toml: data.valid_path: '" + dir.file("valid.csv") + "' does not exist"), std::string::npos) << msg;
  write_text(dir.file("train.csv"), "a,b,y\n1,2,3\n1,x,3\n");
  msg = config_error([&] { check_config(missing); });
  EXPECT_NE(msg.find(dir.file("train.csv") + "':3: column 2 ('b')"), std::string::npos) << msg;
}

TEST(Csv, ClassificationTrainsThroughTheConfig) {
  TempDir dir;
  // Class = which of a, b is larger: separable.
  std::ostringstream os;
  os << "a,b,label\n";
  for (int i = 0; i < 64; ++i) {
    const double a = std::sin(0.9 * i), b = std::cos(1.7 * i);
    os << a << "," << b << "," << (a > b ? "high" : "low") << "\n";
  }
  write_text(dir.file("train.csv"), os.str());
  write_text(dir.file("valid.csv"), os.str());
  const Config c = parse_config(
      "[run]\nthreads = 1\nout_dir = \"" + dir.file("run") + "\"\n[data]\ndataset = \"csv\"\npath = \"" +
          dir.file("train.csv") + "\"\nvalid_path = \"" + dir.file("valid.csv") +
          "\"\nbatch_size = 16\n[model]\narch = \"mlp\"\nwidth = 16\ndepth = 1\n"
          "[optimizer]\nlr = 0.02\n[[stages]]\nepochs = 8\n",
      "cls.toml");
  auto l = make_learner(c);
  EXPECT_EQ(l->task().kind, TaskKind::Classification);
  EXPECT_EQ(l->train_data().dataset().classes, (std::vector<std::string>{"high", "low"}));
  l->fit(c.stages);
  EXPECT_GT(l->valid_accuracy(), 0.85);
  EXPECT_EQ(estimated_data_bytes(c), l->data_bytes());
}

// ---- augmentation --------------------------------------------------------------------------

Dataset augmented(const Augment& a) {
  Dataset d = make_synthetic(24, 1, 6, 6, 3, 7);
  d.augment = a;
  return d;
}

TEST(Augment, FlipsAndCropsAreSeededPerEpochAndSampleWise) {
  const Augment flip_only{true, 0};
  DataLoader plain(augmented({}), 8, true, 5);
  DataLoader flipped(augmented(flip_only), 8, true, 5);
  int mirrored = 0, same = 0;
  for (int64_t e = 0; e < 2; ++e) {
    plain.set_epoch(e);
    flipped.set_epoch(e);
    for (int64_t i = 0; i < plain.num_batches(); ++i) {
      const Batch p = plain.batch(i), f = flipped.batch(i);
      EXPECT_TRUE(torch::equal(p.y, f.y));  // the same order: augmentation draws apart
      for (int64_t k = 0; k < p.size(); ++k) {
        if (torch::equal(f.x[k], p.x[k])) ++same;
        else if (torch::equal(f.x[k], p.x[k].flip({2}))) ++mirrored;
        else ADD_FAILURE() << "sample " << k << " is neither itself nor its mirror";
      }
    }
  }
  EXPECT_GT(mirrored, 10);
  EXPECT_GT(same, 10);

  // A crop with padding 1 moves content by at most one pixel and pads with black.
  DataLoader cropped(augmented({false, 1}), 24, false, 5);
  DataLoader ref(augmented({}), 24, false, 5);
  const Batch cb = cropped.batch(0), rb = ref.batch(0);
  const double black = -ref.dataset().mean / ref.dataset().std;
  int shifted = 0;
  for (int64_t k = 0; k < 24; ++k) {
    bool found = false;
    for (int dy = 0; dy <= 2 && !found; ++dy)
      for (int dx = 0; dx <= 2 && !found; ++dx) {
        std::vector<bool> no_flip{false};
        auto one = rb.x[k].unsqueeze(0).clone();
        augment_images(one, no_flip, {dy}, {dx}, 1, black);
        found = torch::equal(one[0], cb.x[k]);
        if (found && (dy != 1 || dx != 1)) ++shifted;
      }
    EXPECT_TRUE(found) << "sample " << k << " is no crop of itself";
  }
  EXPECT_GT(shifted, 12);  // 8 of 9 offsets move the image
}

TEST(Augment, AnEpochsDrawDependsOnlyOnSeedEpochAndPosition) {
  const Augment a{true, 2};
  DataLoader one(augmented(a), 8, true, 11), two(augmented(a), 8, true, 11);
  one.set_epoch(0);
  (void)one.batch(0);
  one.set_epoch(1);
  two.set_epoch(1);  // a resumed loader jumps straight to epoch 1
  for (int64_t i = 0; i < one.num_batches(); ++i)
    EXPECT_TRUE(torch::equal(one.batch(i).x, two.batch(i).x)) << "batch " << i;
  two.set_epoch(2);
  EXPECT_FALSE(torch::equal(one.batch(1).x, two.batch(1).x));
  DataLoader other_seed(augmented(a), 8, true, 12);
  other_seed.set_epoch(1);
  EXPECT_FALSE(torch::equal(one.batch(1).x, other_seed.batch(1).x));
}

/// Checkpoints at the n-th batch and stops the fit: a run killed right after it.
struct CheckpointAndStop : Callback {
  CheckpointAndStop(std::string file, int batch) : path(std::move(file)), n(batch) {}
  std::string name() const override { return "checkpoint_and_stop"; }
  int order() const override { return -2000; }
  void after_batch(Learner& l) override {
    if (++seen != n) return;
    l.save_checkpoint(path, {});
    l.stop_fit();
  }
  std::string path;
  int n, seen = 0;
};

TEST(Augment, AResumedRunEqualsTheUninterruptedOneBitwise) {
  TempDir dir;
  const std::string toml = "[run]\nthreads = 1\nout_dir = \"" + dir.file("run") +
                           "\"\n[data]\ndataset = \"synthetic\"\nimage_size = 8\nsamples = 48\n"
                           "batch_size = 16\nflip = true\ncrop_padding = 2\nvalid_samples = -1\n"
                           "[model]\narch = \"mlp\"\nwidth = 8\ndepth = 1\n[[stages]]\nepochs = 3\n";
  const Config c = parse_config(toml, "aug.toml");
  auto params = [](Learner& l) {
    std::vector<torch::Tensor> out;
    for (const auto& p : l.model()->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  auto whole = make_learner(c);
  whole->fit(c.stages);
  const auto ref = params(*whole);
  {
    auto first = make_learner(c);
    first->add_callback(std::make_shared<CheckpointAndStop>(dir.file("ckpt"), 5));  // epoch 2, batch 2
    first->fit(c.stages);
  }
  auto second = make_learner(c);
  second->load_checkpoint(dir.file("ckpt"));
  second->fit(c.stages);
  const auto resumed = params(*second);
  ASSERT_EQ(ref.size(), resumed.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(torch::equal(ref[i], resumed[i])) << "parameter " << i;

  // And the augmentation is in effect: without it the same run ends elsewhere.
  const Config plain = parse_config(toml, "plain.toml", {"data.flip=false", "data.crop_padding=0"});
  auto unaugmented = make_learner(plain);
  unaugmented->fit(plain.stages);
  EXPECT_FALSE(torch::equal(ref[0], params(*unaugmented)[0]));
}

}  // namespace
}  // namespace frugal::own_data
