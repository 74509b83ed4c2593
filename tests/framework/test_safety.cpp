// The run's safety nets: a non-finite loss or gradient stops the run naming where (or is skipped
// and counted, the model's buffers left as they were), amp's own skipped steps are not errors,
// early stopping waits `patience` epochs for an improvement by more than min_delta, and
// run.save_best keeps the model of the best epoch.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include "cli_support.h"
#include "frugal/app/model_export.h"
#include "frugal/app/plugin_host.h"
#include "frugal/app/run.h"
#include "frugal/callbacks/early_stopping.h"
#include "frugal/callbacks/nonfinite.h"
#include "frugal/frugal.h"
#include "frugal/io/safetensors.h"
#include "frugal/optim/fused.h"
#include "learner_fixture.h"
#include "log_capture.h"
#include "support.h"

// Its own namespace: a unity build compiles this file with others whose helpers share names.
namespace frugal::test::safety {
namespace {

namespace fs = std::filesystem;

/// Sets one parameter's gradient to NaN after the backward of chosen iterations: a diverged
/// step at a known place.
class PoisonGradient : public Callback {
 public:
  PoisonGradient(std::string parameter, std::vector<int64_t> iterations,
                 float value = std::numeric_limits<float>::quiet_NaN())
      : parameter_(std::move(parameter)), iterations_(std::move(iterations)), value_(value) {}
  std::string name() const override { return "poison_gradient"; }
  void after_backward(Learner& l) override {
    if (std::find(iterations_.begin(), iterations_.end(), l.iteration()) == iterations_.end()) return;
    for (auto& p : l.model()->named_parameters())
      if (p.key() == parameter_) {
        torch::NoGradGuard g;
        p.value().mutable_grad().view({-1})[0] = value_;
      }
  }

 private:
  std::string parameter_;
  std::vector<int64_t> iterations_;
  float value_;
};

std::string last_parameter(Learner& l) { return l.model()->named_parameters().keys().back(); }

bool all_finite(torch::nn::Module& m) {
  for (const auto& p : m.parameters())
    if (!torch::isfinite(p).all().item<bool>()) return false;
  return true;
}

using test::message_of;

TEST(NonFinite, FirstNonFiniteGradientNamesTheParameterAndIgnoresFiniteOverflow) {
  auto l = make_tiny_learner();
  for (auto& p : l->model()->parameters()) p.mutable_grad() = torch::ones_like(p);
  EXPECT_FALSE(first_nonfinite_gradient(*l->model()).has_value());
  // Finite but huge: a float sum would overflow; the check sums in double.
  for (auto& p : l->model()->parameters()) p.mutable_grad() = torch::full_like(p, 3e38);
  EXPECT_FALSE(first_nonfinite_gradient(*l->model()).has_value());
  const auto names = l->model()->named_parameters().keys();
  l->model()->named_parameters()[names[1]].mutable_grad().view({-1})[3] =
      std::numeric_limits<float>::infinity();
  l->model()->named_parameters()[names[2]].mutable_grad().view({-1})[0] =
      std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(first_nonfinite_gradient(*l->model()).value_or(""), names[1]);
}

TEST(NonFinite, FailStopsBeforeTheStepNamingStageEpochBatchAndParameter) {
  TempDir dir;
  TinySetup s;  // 64 samples, batches of 16: 4 per epoch
  auto l = make_tiny_learner(s);
  const std::string bad = last_parameter(*l);
  l->add_callback(std::make_shared<NonFiniteCheck>());
  l->add_callback(std::make_shared<PoisonGradient>(bad, std::vector<int64_t>{6}));  // epoch 2, batch 3
  l->add_callback(std::make_shared<CheckpointWriter>(dir.file("last.ckpt"), 1, 0));
  const std::string msg = message_of([&] { l->fit({make_stage("warm", 1), make_stage("main", 2)}); });
  EXPECT_NE(msg.find("non-finite gradient in stage 'main' (2), epoch 1, batch 3 (iteration 7, "
                     "after 6 optimizer steps); first non-finite gradient: " + bad),
            std::string::npos)
      << msg;
  EXPECT_EQ(l->steps(), 6);  // the poisoned step was not taken
  EXPECT_TRUE(all_finite(*l->model()));
  // The last good checkpoint is the one after the sixth step, and holds these parameters.
  const nlohmann::json rec = Learner::read_checkpoint(dir.file("last.ckpt"));
  EXPECT_EQ(rec["position"]["steps"].get<int64_t>(), 6) << rec.dump();
  auto resumed = make_tiny_learner(s);
  resumed->load_checkpoint(dir.file("last.ckpt"));
  EXPECT_TRUE(params_equal(*resumed->model(), clone_params(*l->model())));
}

// Scan::InStep (frugal train's): no scan before the step; the fused step finds the poisoned
// gradient while it updates, and the fit fails at the same place with the same words, the
// parameter named. That step ran in memory (the event says so); the last checkpoint is still
// the sixth step's, nothing was written after it.
TEST(NonFinite, InStepFailNamesTheSameBatchAndParameterAndWritesNothingAfter) {
  TempDir dir;
  TinySetup s;
  for (const std::string optimizer : {"adam", "sgd"}) {
    s.optimizer = optimizer;
    auto l = make_tiny_learner(s);
    ASSERT_NE(dynamic_cast<GradientVerdict*>(&l->optimizer()), nullptr);
    const std::string bad = l->model()->named_parameters().keys()[1];  // not the last one
    auto check = std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Fail, NonFiniteCheck::Scan::InStep);
    l->add_callback(check);
    l->add_callback(std::make_shared<PoisonGradient>(bad, std::vector<int64_t>{6}));
    l->add_callback(std::make_shared<CheckpointWriter>(dir.file(optimizer + ".ckpt"), 1, 0));
    const std::string msg = message_of([&] { l->fit({make_stage("warm", 1), make_stage("main", 2)}); });
    EXPECT_NE(msg.find("non-finite gradient in stage 'main' (2), epoch 1, batch 3 (iteration 7, "
                       "after 6 optimizer steps); first non-finite gradient: " + bad + " (found by "
                       "the optimizer's step"),
              std::string::npos)
        << msg;
    ASSERT_TRUE(check->last().has_value());
    EXPECT_TRUE(check->last()->step_ran);
    EXPECT_EQ(check->record()["event"]["step_ran"], true);
    EXPECT_EQ(l->steps(), 7) << "the step that found it ran";
    EXPECT_EQ(Learner::read_checkpoint(dir.file(optimizer + ".ckpt"))["position"]["steps"].get<int64_t>(), 6);
  }
  // Clipping by value would clamp an inf into range before the step reads it: the gradients
  // are scanned before the step then, which is not taken.
  auto l = make_tiny_learner(s);
  OptimizerOptions o = l->optimizer_options();
  o.clip_grad_value = 1.0;
  l->set_optimizer(o);
  const std::string bad = last_parameter(*l);
  l->add_callback(std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Fail, NonFiniteCheck::Scan::InStep));
  l->add_callback(std::make_shared<GradClip>());
  l->add_callback(std::make_shared<PoisonGradient>(bad, std::vector<int64_t>{2},
                                                   std::numeric_limits<float>::infinity()));
  const std::string msg = message_of([&] { l->fit(1); });
  EXPECT_NE(msg.find("non-finite gradient in stage"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("found by the optimizer's step"), std::string::npos) << msg;
  EXPECT_EQ(l->steps(), 2);
}

/// Replaces the optimizer in before_step (after the non-finite check's) at one iteration.
struct ReplaceOptimizerBeforeStep : Callback {
  explicit ReplaceOptimizerBeforeStep(int64_t i) : at(i) {}
  std::string name() const override { return "replace_optimizer_before_step"; }
  int order() const override { return order::kGradientClip + 10; }
  void before_step(Learner& l) override {
    if (l.iteration() == at) l.set_optimizer(l.optimizer_options());
  }
  int64_t at;
};

// The verdict was asked of an optimizer that a later before_step hook replaced: the gradients
// are scanned when the new one is announced (a poisoned step fails, not taken), and a clean one
// trains on.
TEST(NonFinite, InStepScansWhenTheOptimizerIsReplacedAfterTheRequest) {
  for (const bool poisoned : {true, false}) {
    auto l = make_tiny_learner();
    l->add_callback(std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Fail, NonFiniteCheck::Scan::InStep));
    l->add_callback(std::make_shared<ReplaceOptimizerBeforeStep>(2));
    if (poisoned) l->add_callback(std::make_shared<PoisonGradient>(last_parameter(*l), std::vector<int64_t>{2}));
    const std::string msg = message_of([&] { l->fit(1); });
    if (!poisoned) {
      EXPECT_EQ(msg, "");
      EXPECT_EQ(l->steps(), 4);
      continue;
    }
    EXPECT_NE(msg.find("non-finite gradient in stage"), std::string::npos) << msg;
    EXPECT_NE(msg.find("first non-finite gradient: " + last_parameter(*l)), std::string::npos) << msg;
    EXPECT_EQ(msg.find("found by the optimizer's step"), std::string::npos) << msg;
    EXPECT_EQ(l->steps(), 2);
  }
}

TEST(NonFinite, SkipModeSkipsAndCountsTheStepsAndParametersStayFinite) {
  auto l = make_tiny_learner();
  auto check = std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Skip);
  l->add_callback(check);
  l->add_callback(std::make_shared<PoisonGradient>(last_parameter(*l), std::vector<int64_t>{1, 5, 6}));
  l->fit(2);
  EXPECT_EQ(check->skipped(), 3);
  EXPECT_EQ(l->iteration(), 8);
  EXPECT_EQ(l->steps(), 5);
  EXPECT_TRUE(all_finite(*l->model()));
  EXPECT_EQ(check->record()["skipped_steps"].get<int64_t>(), 3);
  EXPECT_EQ(check->last()->batch, 2);  // the last skipped: iteration 6 = epoch 2, batch 3
  EXPECT_EQ(check->last()->epoch, 1);
}

// An epoch whose every step was skipped for a non-finite loss has no loss: the progress line
// says "-", not a perfect 0.0000; an epoch with good batches shows their mean alone.
TEST(NonFinite, AnEpochOfSkippedStepsShowsNoLossNotZero) {
  auto l = make_tiny_learner();
  l->add_callback(std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Skip));
  struct PoisonFirstEpoch : Callback {
    std::string name() const override { return "poison_first_epoch"; }
    void before_batch(Learner& l) override {
      if (l.epoch() == 0) l.x() = l.x() * std::numeric_limits<float>::quiet_NaN();
    }
  };
  l->add_callback(std::make_shared<PoisonFirstEpoch>());
  LogCapture log;
  l->add_callback(std::make_shared<ProgressCallback>(ProgressCallback::Mode::Log, 1000, spdlog::default_logger()));
  l->fit(2);
  EXPECT_TRUE(Has(log.text(), "epoch 1/2 loss - "));
  EXPECT_EQ(log.text().find("loss 0.0000"), std::string::npos) << log.text();
  EXPECT_EQ(log.text().find("nan"), std::string::npos) << log.text();
  EXPECT_GT(l->epoch_losses(), 0);
  EXPECT_TRUE(std::isfinite(l->epoch_loss()));
}

TEST(NonFinite, ALossPoisonedByTheInputIsNamedAsTheLoss) {
  auto l = make_tiny_learner();
  l->add_callback(std::make_shared<NonFiniteCheck>());
  struct PoisonInput : Callback {
    std::string name() const override { return "poison_input"; }
    void before_batch(Learner& l) override {
      if (l.iteration() == 2) l.x() = l.x() * std::numeric_limits<float>::quiet_NaN();
    }
  };
  l->add_callback(std::make_shared<PoisonInput>());
  const std::string msg = message_of([&] { l->fit(1); });
  EXPECT_NE(msg.find("non-finite loss (nan) in stage 'fit' (1), epoch 1, batch 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("first non-finite gradient: " + l->model()->named_parameters().keys().front()),
            std::string::npos) << msg;
}

TEST(NonFinite, AmpsOwnSkippedStepsUnderAHugeLossScaleAreNotErrors) {
  // The scaled loss overflows to inf: amp's scaler finds inf gradients, skips the step and
  // backs off; the check (after amp in before_step) sees a skipped step, not an error.
  PluginHost host;
  auto l = make_tiny_learner();
  for (auto& cb : host.load(plugins_of("[plugins.amp]\ndtype = \"bfloat16\"\nscaler = \"on\"\n"
                                       "init_scale = 1e39\nbackoff_factor = 0.001\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  auto check = std::make_shared<NonFiniteCheck>();
  l->add_callback(check);
  l->fit(2);
  EXPECT_LT(l->steps(), l->iteration()) << "the scale never overflowed: amp skipped nothing";
  EXPECT_GT(l->steps(), 0);
  EXPECT_EQ(check->skipped(), 0);
  EXPECT_FALSE(check->last().has_value());
  EXPECT_TRUE(all_finite(*l->model()));
}

// ---------------------------------------------------------------- a skipped step's buffers

std::vector<torch::Tensor> clone_buffers(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.empty() || a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

/// The model's buffers before batch `first` and after batch `last` (iterations): around a step.
class BuffersAroundAStep : public Callback {
 public:
  BuffersAroundAStep(int64_t first, int64_t last) : first_(first), last_(last) {}
  std::string name() const override { return "buffers_around_a_step"; }
  void before_batch(Learner& l) override {
    if (l.iteration() == first_) before = clone_buffers(*l.model());
  }
  void after_batch(Learner& l) override {
    if (l.iteration() == last_) after = clone_buffers(*l.model());
  }
  std::vector<torch::Tensor> before, after;

 private:
  int64_t first_, last_;
};

/// Makes the input of one iteration NaN: BatchNorm's running statistics take NaN in its forward.
struct NanInputAt : Callback {
  explicit NanInputAt(int64_t at) : iteration(at) {}
  std::string name() const override { return "nan_input_at"; }
  void before_batch(Learner& l) override {
    if (l.iteration() == iteration) l.x() = l.x() * std::numeric_limits<float>::quiet_NaN();
  }
  int64_t iteration;
};

TinySetup batch_norm_setup() {
  TinySetup s;  // 64 samples, batches of 16: 4 per epoch
  s.arch = "cnn";  // BatchNorm after each convolution
  s.width = 4;
  s.valid_samples = 0;
  return s;
}

bool buffers_finite(torch::nn::Module& m) {
  for (const auto& b : m.buffers())
    if (b.is_floating_point() && !torch::isfinite(b).all().item<bool>()) return false;
  return true;
}

TEST(NonFinite, ASkippedNanBatchLeavesBatchNormsRunningStatisticsAsTheyWere) {
  auto l = make_tiny_learner(batch_norm_setup());
  ASSERT_FALSE(l->model()->buffers().empty());
  auto check = std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Skip);
  auto around = std::make_shared<BuffersAroundAStep>(2, 2);
  l->add_callback(check);
  l->add_callback(std::make_shared<NanInputAt>(2));
  l->add_callback(around);
  l->fit(2);
  EXPECT_EQ(check->skipped(), 1);
  EXPECT_EQ(l->steps(), 7);
  // running_mean, running_var and num_batches_tracked of every BatchNorm, bit for bit.
  EXPECT_TRUE(all_equal(around->before, around->after));
  EXPECT_TRUE(buffers_finite(*l->model()));
  EXPECT_TRUE(all_finite(*l->model()));
  EXPECT_GT(check->held_bytes(), 0);  // the copy, named in the memory breakdown
}

TEST(NonFinite, ASkippedAccumulatedStepRestoresTheBuffersOfItsFirstBatch) {
  // grad_accum, 2 batches a step: batches 3 and 4 (iterations 2, 3) make one step. A NaN
  // gradient in the first shows at the step, in the second batch's before_step; the skipped
  // step undoes what both batches' forwards did to the buffers.
  PluginHost host;
  auto l = make_tiny_learner(batch_norm_setup());
  for (auto& cb : host.load(plugins_of("[plugins.grad_accum]\nsteps = 2\nmode = \"accumulate\"\n"),
                            "cfg.toml"))
    l->add_callback(cb);
  auto check = std::make_shared<NonFiniteCheck>(NonFiniteCheck::Mode::Skip);
  auto around = std::make_shared<BuffersAroundAStep>(2, 3);
  l->add_callback(check);
  l->add_callback(std::make_shared<PoisonGradient>(last_parameter(*l), std::vector<int64_t>{2}));
  l->add_callback(around);
  l->fit(1);
  EXPECT_EQ(check->skipped(), 1);
  EXPECT_EQ(l->steps(), 1);
  EXPECT_TRUE(all_equal(around->before, around->after));
  EXPECT_TRUE(buffers_finite(*l->model()));
}

// ---------------------------------------------------------------- early stopping

TEST(EarlyStopping, AnImprovementMustBeatTheBestByMoreThanMinDelta) {
  const Task classification{};
  const MetricMonitor loss("valid_loss", 0.1), acc("accuracy", 0.01);
  EXPECT_TRUE(loss.improves(classification, 5.0, false, 0.0));
  EXPECT_TRUE(loss.improves(classification, 0.89, true, 1.0));
  EXPECT_FALSE(loss.improves(classification, 0.9, true, 1.0));
  EXPECT_FALSE(loss.improves(classification, std::nan(""), true, 1.0));
  EXPECT_TRUE(acc.improves(classification, 0.52, true, 0.5));
  EXPECT_FALSE(acc.improves(classification, 0.51, true, 0.5));
  EXPECT_NE(message_of([&] { MetricMonitor("rmse").check(classification, "run.save_best"); })
                .find("run.save_best = \"rmse\": this classification run's validation gives "
                      "\"valid_loss\", \"accuracy\""),
            std::string::npos);
}

/// Epochs a fit of `epochs` ran with early stopping on valid_loss.
int64_t epochs_run(double lr, double min_delta, int64_t patience, int64_t epochs,
                   std::shared_ptr<EarlyStopping>* out = nullptr) {
  TinySetup s;
  s.optimizer = "sgd";
  s.lr = lr;
  auto l = make_tiny_learner(s);
  auto es = std::make_shared<EarlyStopping>(MetricMonitor("valid_loss", min_delta), patience);
  l->add_callback(es);
  l->fit(epochs);
  if (out) *out = es;
  return l->iteration() / l->train_data().num_batches();
}

TEST(EarlyStopping, StopsAfterPatienceEpochsWithoutImprovementAndNotBefore) {
  // lr = 1e-30: no weight moves (below a float's resolution), the metric never changes; the
  // first epoch sets the best, `patience` more end the fit.
  std::shared_ptr<EarlyStopping> es;
  EXPECT_EQ(epochs_run(1e-30, 0.0, 3, 10, &es), 4);
  EXPECT_TRUE(es->stopped());
  EXPECT_EQ(es->record()["best_epoch"].get<int64_t>(), 1);
  EXPECT_EQ(es->record()["stopped_epoch"].get<int64_t>(), 4);
  // Learning: the loss falls every epoch, by less than 10 nats: min_delta = 10 waits
  // `patience` epochs, min_delta = 0 runs them all.
  EXPECT_EQ(epochs_run(0.05, 10.0, 2, 6), 3);
  EXPECT_EQ(epochs_run(0.05, 0.0, 2, 6, &es), 6);
  EXPECT_FALSE(es->stopped());
  EXPECT_EQ(es->waited(), 0);
}

// ---------------------------------------------------------------- the best model

/// Keeps every epoch's parameters and validation loss.
class EpochSnapshots : public Callback {
 public:
  std::string name() const override { return "epoch_snapshots"; }
  void after_epoch(Learner& l) override {
    losses.push_back(l.valid_sums().mean_loss());
    std::map<std::string, torch::Tensor> p;
    for (const auto& kv : l.model()->named_parameters()) p[kv.key()] = kv.value().detach().clone();
    params.push_back(p);
  }
  std::vector<double> losses;
  std::vector<std::map<std::string, torch::Tensor>> params;
};

TEST(SaveBest, TheBestFilesHoldTheModelOfTheBestEpoch) {
  TempDir dir;
  TinySetup s;
  s.lr = 0.3;  // adam at a rate that overshoots: the validation loss goes up and down
  auto l = make_tiny_learner(s);
  auto best = std::make_shared<SaveBest>(MetricMonitor("valid_loss"), dir.file("best.pt"));
  auto snaps = std::make_shared<EpochSnapshots>();
  l->add_callback(best);
  l->add_callback(snaps);
  l->fit(6);
  const auto& v = snaps->losses;
  const size_t at = static_cast<size_t>(std::min_element(v.begin(), v.end()) - v.begin());
  ASSERT_LT(at + 1, v.size()) << "the last epoch was the best: this test shows nothing";
  EXPECT_EQ(best->record()["epoch"].get<int64_t>(), static_cast<int64_t>(at + 1));
  EXPECT_DOUBLE_EQ(best->record()["value"].get<double>(), v[at]);
  const auto st = safetensors::read(dir.file("best.safetensors"));
  for (const auto& [name, t] : snaps->params[at]) {
    ASSERT_TRUE(st.count(name)) << name;
    EXPECT_TRUE(torch::equal(st.at(name), t)) << name;
  }
  auto fresh = make_tiny_learner(s);
  fresh->load(dir.file("best.pt"), /*with_opt=*/false);
  for (const auto& kv : fresh->model()->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value(), snaps->params[at].at(kv.key()))) << kv.key();
}

// ---------------------------------------------------------------- from TOML and the CLI

std::string config(const std::string& out, const std::string& run_keys, double lr = 1e-2) {
  return "[run]\nout_dir = \"" + out + "\"\nprogress = \"none\"\nthreads = 1\n" + run_keys +
         "[data]\ndataset = \"synthetic\"\nsamples = 64\nimage_size = 8\nclasses = 4\n"
         "batch_size = 16\nvalid_samples = 32\n"
         "[model]\narch = \"mlp\"\nwidth = 8\ndepth = 1\n"
         "[optimizer]\nname = \"sgd\"\nlr = " + std::to_string(lr) + "\n"
         "[[stages]]\nname = \"only\"\nepochs = 3\n";
}

TEST(SafetyConfig, AMetricTheTaskDoesNotHaveIsRefusedBeforeAnyWork) {
  TempDir dir;
  const Config c = parse_config(config(dir.file("run"), "save_best = \"rmse\"\n"), "cfg.toml");
  const std::string msg = message_of([&] { make_learner(c); });
  EXPECT_NE(msg.find("cfg.toml: run.save_best: \"rmse\": this classification run's validation "
                     "gives \"valid_loss\", \"accuracy\""),
            std::string::npos) << msg;
  const Config e = parse_config(config(dir.file("run"), "early_stopping = \"accuracy\"\n"), "cfg.toml",
                                {"data.valid_samples=-1"});
  EXPECT_NE(message_of([&] { make_learner(e); }).find("run.early_stopping"), std::string::npos);
  EXPECT_NE(message_of([&] { parse_config(config("x", "on_nonfinite = \"ignore\"\n"), "cfg.toml"); })
                .find("on_nonfinite"),
            std::string::npos);
}

TEST(SafetyCli, ADivergedRunExitsNonZeroAndItsReportSaysWhereAndWhichCheckpointIsKept) {
  // sgd at lr 1e30: the first step throws the weights out of float's range; the second batch's
  // loss is not finite.
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("nan.toml"), config(out, "checkpoint_every = 1\n", 1e30));
  const CliResult r = run_cli("train " + dir.file("nan.toml"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("non-finite loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("in stage 'only' (1), epoch 1, batch 2"), std::string::npos) << r.output;
  const nlohmann::json report = nlohmann::json::parse(read_text(out + "/report.json"));
  const auto& n = report["nonfinite"];
  EXPECT_EQ(n["event"]["batch"].get<int64_t>(), 1) << n.dump();
  EXPECT_EQ(n["checkpoint"].get<std::string>(), out + "/checkpoints/last.ckpt");
  EXPECT_EQ(Learner::read_checkpoint(out + "/checkpoints/last.ckpt")["position"]["steps"].get<int64_t>(), 1);
  EXPECT_FALSE(fs::exists(out + "/model.pt"));  // no diverged model exported
  EXPECT_NE(read_text(out + "/report.md").find("Stopped at a non-finite loss** (the step was not "
                                               "taken); the last good checkpoint, `" + out),
            std::string::npos);
}

TEST(SafetyCli, SaveBestAndEarlyStoppingFromTomlReachTheRunFolderAndReport) {
  TempDir dir;
  const std::string out = dir.file("run");
  write_text(dir.file("best.toml"),
             config(out, "save_best = \"accuracy\"\nearly_stopping = \"valid_loss\"\npatience = 1\n"
                         "min_delta = 100.0\n"));
  const CliResult r = run_cli("train " + dir.file("best.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out + "/best.pt"));
  EXPECT_TRUE(fs::exists(out + "/best.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/model.pt"));
  const nlohmann::json report = nlohmann::json::parse(read_text(out + "/report.json"));
  EXPECT_TRUE(report["early_stopping"]["stopped"].get<bool>()) << report.dump();
  EXPECT_EQ(report["early_stopping"]["stopped_epoch"].get<int64_t>(), 2);
  EXPECT_EQ(report["best_model"]["metric"].get<std::string>(), "accuracy");
  EXPECT_EQ(report["nonfinite"]["skipped_steps"].get<int64_t>(), 0);
  EXPECT_NE(read_text(out + "/report.md").find("**Stopped early** after 2 epochs"), std::string::npos);
}

TEST(SafetyCli, TwoRanksFailAtTheSameNonFiniteStep) {
  // Each rank decides from its own loss and the all-reduced gradients, and the verdict is
  // all-reduced: a rank that decided alone would leave the other in a collective until the
  // timeout. (Early stopping decides on validation sums reduced across ranks, agreed likewise.)
  TempDir dir;
  const std::string nan = dir.file("nan");
  write_text(dir.file("nan.toml"), config(nan, "", 1e30));
  const CliResult failed = run_cli("train " + dir.file("nan.toml") + " --nproc 2");
  EXPECT_NE(failed.exit_code, 0) << failed.output;
  EXPECT_NE(failed.output.find("[rank 1]"), std::string::npos) << failed.output;
  EXPECT_NE(failed.output.find("epoch 1, batch 2"), std::string::npos) << failed.output;
  EXPECT_EQ(nlohmann::json::parse(read_text(nan + "/report.json"))["nonfinite"]["event"]["batch"], 1);
}

// A non-finite loss on ONE rank: row 13 of a regression table has a target of 3e38, whose
// squared error is infinite in float. With batches of 8 split 4 + 4, it is in rank 1's half of
// the second batch only. Rank 0's own loss is finite: the verdict must still reach it (the flags
// ride on the gradient sync), so that both ranks fail at that batch, or both skip that step and
// go on in step (a rank that stepped alone would wait in a later collective until the timeout).
TEST(SafetyCli, ANonFiniteLossOnOneRankStopsOrSkipsTheStepOnBoth) {
  TempDir dir;
  std::ostringstream csv;
  csv << "a,b,y\n";
  for (int i = 0; i < 32; ++i)
    csv << 0.1 * (i % 7) << "," << 0.2 * (i % 5) << "," << (i == 13 ? "3e38" : "0.5") << "\n";
  write_text(dir.file("train.csv"), csv.str());
  const auto toml = [&](const std::string& out, const std::string& mode) {
    return "[run]\nthreads = 1\nprogress = \"log\"\nlog_every = 1\nout_dir = \"" + out +
           "\"\non_nonfinite = \"" + mode + "\"\n[data]\ndataset = \"csv\"\ntask = \"regression\"\n"
           "path = \"" + dir.file("train.csv") + "\"\nvalid_samples = -1\nbatch_size = 8\nshuffle = false\n"
           "[model]\narch = \"mlp\"\nwidth = 8\ndepth = 1\n[optimizer]\nname = \"sgd\"\nlr = 0.01\n"
           "[loss]\nname = \"mse\"\n[[stages]]\nname = \"only\"\nepochs = 2\n";
  };
  const std::string failed = dir.file("fail"), skipped = dir.file("skip");
  write_text(failed + ".toml", toml(failed, "fail"));
  const CliResult f = run_cli("train " + failed + ".toml --nproc 2");
  EXPECT_NE(f.exit_code, 0) << f.output;
  EXPECT_NE(f.output.find("non-finite loss (inf) in stage 'only' (1), epoch 1, batch 2"), std::string::npos)
      << f.output;
  EXPECT_NE(f.output.find("on another rank"), std::string::npos) << "rank 0's own loss was finite\n"
                                                                 << f.output;
  EXPECT_EQ(nlohmann::json::parse(read_text(failed + "/report.json"))["nonfinite"]["event"]["batch"], 1);

  write_text(skipped + ".toml", toml(skipped, "skip"));
  const CliResult k = run_cli("train " + skipped + ".toml --nproc 2");
  ASSERT_EQ(k.exit_code, 0) << k.output;
  const nlohmann::json r = nlohmann::json::parse(read_text(skipped + "/report.json"));
  EXPECT_EQ(r["nonfinite"]["skipped_steps"].get<int64_t>(), 2) << "batch 2 of each epoch, on both ranks";
  EXPECT_EQ(r["fit"]["optimizer_steps"].get<int64_t>(), 6) << r["fit"].dump();
  for (const auto& [name, t] : safetensors::read(skipped + "/model.safetensors"))
    EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << name;
}

}  // namespace
}  // namespace frugal::test::safety
