// The Learner driven through real events on a tiny synthetic problem.
#include <filesystem>
#include <fstream>

#include "learner_fixture.h"

namespace frugal::test {
namespace {

/// Records every event it sees; optional actions steer the loop.
class Recorder : public Callback {
 public:
  explicit Recorder(std::string name = "recorder", int order = 0) : name_(std::move(name)), order_(order) {}
  std::string name() const override { return name_; }
  int order() const override { return order_; }
  std::vector<std::string> events;
  std::function<void(Event, Learner&)> action;

#define FRUGAL_RECORD(hook, ev)          \
  void hook(Learner& l) override {        \
    events.emplace_back(#hook);           \
    if (action) action(Event::ev, l);     \
  }
  FRUGAL_RECORD(before_fit, BeforeFit)
  FRUGAL_RECORD(before_stage, BeforeStage)
  FRUGAL_RECORD(before_epoch, BeforeEpoch)
  FRUGAL_RECORD(before_train, BeforeTrain)
  FRUGAL_RECORD(before_batch, BeforeBatch)
  FRUGAL_RECORD(before_forward, BeforeForward)
  FRUGAL_RECORD(after_forward, AfterForward)
  FRUGAL_RECORD(after_loss, AfterLoss)
  FRUGAL_RECORD(before_backward, BeforeBackward)
  FRUGAL_RECORD(after_backward, AfterBackward)
  FRUGAL_RECORD(before_step, BeforeStep)
  FRUGAL_RECORD(after_step, AfterStep)
  FRUGAL_RECORD(after_batch, AfterBatch)
  FRUGAL_RECORD(after_train, AfterTrain)
  FRUGAL_RECORD(before_validate, BeforeValidate)
  FRUGAL_RECORD(after_validate, AfterValidate)
  FRUGAL_RECORD(after_epoch, AfterEpoch)
  FRUGAL_RECORD(after_stage, AfterStage)
  FRUGAL_RECORD(after_fit, AfterFit)
#undef FRUGAL_RECORD

  size_t count(const std::string& e) const { return std::count(events.begin(), events.end(), e); }

 private:
  std::string name_;
  int order_;
};

std::vector<std::string> full_batch() {
  return {"before_batch",    "before_forward", "after_forward", "after_loss", "before_backward",
          "after_backward",  "before_step",    "after_step",    "after_batch"};
}

std::vector<std::string> expected_epoch(int batches, bool validate) {
  std::vector<std::string> e = {"before_epoch", "before_train"};
  for (int b = 0; b < batches; ++b) {
    auto fb = full_batch();
    e.insert(e.end(), fb.begin(), fb.end());
  }
  e.push_back("after_train");
  if (validate) {
    e.push_back("before_validate");
    e.push_back("after_validate");
  }
  e.push_back("after_epoch");
  return e;
}

TEST(LearnerEvents, TwoStageFitFiresEveryEventInOrder) {
  TinySetup s;
  s.samples = 32;  // 2 batches of 16
  auto l = make_tiny_learner(s);
  auto rec = std::make_shared<Recorder>();
  l->add_callback(rec);
  l->fit({make_stage("head", 1, {"stem"}), make_stage("all", 2)});

  std::vector<std::string> expected = {"before_fit", "before_stage"};
  auto ep = expected_epoch(2, true);
  expected.insert(expected.end(), ep.begin(), ep.end());
  expected.push_back("after_stage");
  expected.push_back("before_stage");
  for (int i = 0; i < 2; ++i) expected.insert(expected.end(), ep.begin(), ep.end());
  expected.push_back("after_stage");
  expected.push_back("after_fit");
  EXPECT_EQ(rec->events, expected);
  EXPECT_EQ(l->iteration(), 6);
  EXPECT_EQ(l->steps(), 6);
}

TEST(LearnerEvents, ALastStageOfNoEpochsKeepsTheFinalLossOfTheStageThatTrained) {
  auto l = make_tiny_learner();
  l->fit({make_stage("train", 1), make_stage("tail", 0)});
  const nlohmann::json fit = l->report();
  ASSERT_EQ(fit["stages"].size(), 2u);
  EXPECT_GT(fit["final_loss"].get<double>(), 0.0) << "not the empty stage's 0";
  EXPECT_EQ(fit["final_loss"].get<double>(), fit["stages"][0]["loss"].get<double>());
}

TEST(LearnerEvents, AFitOfNoEpochsAtAllIsRefusedBeforeAnyEvent) {
  auto l = make_tiny_learner();
  auto log = std::make_shared<Recorder>();
  l->add_callback(log);
  try {
    l->fit({make_stage("a", 0), make_stage("b", 0)});
    ADD_FAILURE() << "a fit that trains nothing ran";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("every stage has epochs = 0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(log->events.empty());
}

TEST(LearnerEvents, SkipStepKeepsParametersAndSkipsAfterStep) {
  auto l = make_tiny_learner();
  auto before = clone_params(*l->model());
  auto rec = std::make_shared<Recorder>();
  rec->action = [](Event e, Learner& learner) {
    if (e == Event::BeforeStep) learner.skip_step();
  };
  l->add_callback(rec);
  l->fit(1);
  EXPECT_TRUE(params_equal(*l->model(), before));
  EXPECT_EQ(rec->count("after_step"), 0u);
  EXPECT_EQ(rec->count("before_step"), 4u);
  EXPECT_EQ(l->steps(), 0);
  // Skipped steps keep the gradients: they accumulated over the 4 batches.
  EXPECT_GT(gradient_bytes(*l->model()), 0);
}

TEST(LearnerEvents, SkipBatchSkipsTheRestButFiresAfterBatch) {
  auto l = make_tiny_learner();
  auto before = clone_params(*l->model());
  auto rec = std::make_shared<Recorder>();
  rec->action = [](Event e, Learner& learner) {
    if (e == Event::BeforeBatch && learner.batch_index() % 2 == 0) learner.skip_batch();
  };
  l->add_callback(rec);
  l->fit(1);
  EXPECT_EQ(rec->count("before_batch"), 4u);
  EXPECT_EQ(rec->count("after_batch"), 4u);
  EXPECT_EQ(rec->count("before_forward"), 2u);
  EXPECT_EQ(rec->count("before_backward"), 2u);
  EXPECT_EQ(l->steps(), 2);
  EXPECT_FALSE(params_equal(*l->model(), before));
}

TEST(LearnerEvents, StopEpochEndsTheEpochButValidates) {
  auto l = make_tiny_learner();
  auto rec = std::make_shared<Recorder>();
  rec->action = [](Event e, Learner& learner) {
    if (e == Event::AfterBatch) learner.stop_epoch();
  };
  l->add_callback(rec);
  l->fit(3);
  EXPECT_EQ(rec->count("before_batch"), 3u);  // one batch per epoch
  EXPECT_EQ(rec->count("after_epoch"), 3u);
  EXPECT_EQ(rec->count("after_validate"), 3u);
}

TEST(LearnerEvents, StopFitClosesEveryOpenEventAndStartsNothingNew) {
  auto l = make_tiny_learner();
  auto rec = std::make_shared<Recorder>();
  rec->action = [](Event e, Learner& learner) {
    if (e == Event::AfterStep) learner.stop_fit();
  };
  l->add_callback(rec);
  l->fit({make_stage("one", 2), make_stage("two", 2)});
  std::vector<std::string> tail(rec->events.end() - 6, rec->events.end());
  EXPECT_EQ(tail, (std::vector<std::string>{"after_step", "after_batch", "after_train", "after_epoch",
                                             "after_stage", "after_fit"}));
  EXPECT_EQ(rec->count("before_stage"), 1u);
  EXPECT_EQ(rec->count("before_validate"), 0u);
  EXPECT_TRUE(l->fit_stopped());
}

TEST(LearnerEvents, AfterEventsRunInReverseOrder) {
  auto l = make_tiny_learner();
  std::vector<std::string> log;
  auto a = std::make_shared<Recorder>("a", 1);
  auto b = std::make_shared<Recorder>("b", 2);
  a->action = [&](Event e, Learner&) { if (e == Event::BeforeFit || e == Event::AfterFit) log.push_back("a"); };
  b->action = [&](Event e, Learner&) { if (e == Event::BeforeFit || e == Event::AfterFit) log.push_back("b"); };
  l->add_callback(b);  // added out of order: order() decides
  l->add_callback(a);
  l->fit(1);
  EXPECT_EQ(log, (std::vector<std::string>{"a", "b", "b", "a"}));
}

/// Replaces the optimizer in before_batch of the second batch (as optim_swap at a trigger).
struct SwapAtBatch : Callback {
  std::string name() const override { return "swap_at_batch"; }
  int order() const override { return -10; }
  void before_batch(Learner& l) override {
    if (l.iteration() != 1) return;
    OptimizerOptions o;
    o.name = "sgd";
    o.lr = 0.1;
    l.set_optimizer(o);
  }
};

/// Notes each optimizer_replaced and the before_batch hooks around it.
struct ReplacedLog : Callback {
  std::vector<std::string> log;
  std::string name() const override { return "replaced_log"; }
  int order() const override { return 10; }
  void optimizer_replaced(Learner& l) override {
    log.push_back("replaced " + l.optimizer_options().name + " at " + std::to_string(l.iteration()));
  }
  void before_batch(Learner& l) override {
    if (l.iteration() <= 2) log.push_back("before_batch " + std::to_string(l.iteration()));
  }
};

TEST(LearnerEvents, AReplacedOptimizerIsAnnouncedOnceBeforeTheNextHook) {
  auto l = make_tiny_learner();  // 4 batches
  auto log = std::make_shared<ReplacedLog>();
  l->add_callback(log);
  l->add_callback(std::make_shared<SwapAtBatch>());
  l->fit(1);
  EXPECT_EQ(log->log, (std::vector<std::string>{"before_batch 0", "replaced sgd at 1",
                                                "before_batch 1", "before_batch 2"}));
  EXPECT_EQ(l->optimizer_options().name, "sgd");
}

TEST(LearnerEvents, CallbackExceptionNamesCallbackAndEvent) {
  auto l = make_tiny_learner();
  auto rec = std::make_shared<Recorder>("thrower");
  rec->action = [](Event e, Learner&) {
    if (e == Event::AfterLoss) throw std::runtime_error("boom");
  };
  l->add_callback(rec);
  try {
    l->fit(1);
    FAIL() << "fit should have thrown";
  } catch (const CallbackError& e) {
    EXPECT_EQ(e.callback(), "thrower");
    EXPECT_EQ(e.event(), "after_loss");
    EXPECT_EQ(e.reason(), "boom");
    EXPECT_NE(std::string(e.what()).find("callback 'thrower' failed in event 'after_loss': boom"),
              std::string::npos);
  }
}

class Doubler : public Callback {
 public:
  std::string name() const override { return "doubler"; }
  void after_loss(Learner& l) override { l.scale_loss(2.0); }
  void after_backward(Learner& l) override {
    if (grads.empty())
      for (auto& p : l.model()->parameters()) grads.push_back(p.grad().clone());
  }
  std::vector<torch::Tensor> grads;
};

class GradTaker : public Callback {
 public:
  std::string name() const override { return "taker"; }
  void after_backward(Learner& l) override {
    if (grads.empty())
      for (auto& p : l.model()->parameters()) grads.push_back(p.grad().clone());
  }
  std::vector<torch::Tensor> grads;
};

TEST(LearnerSteering, ScaleLossScalesTheGradients) {
  TinySetup s;
  s.shuffle = false;
  auto plain = make_tiny_learner(s);
  auto taker = std::make_shared<GradTaker>();
  plain->add_callback(taker);
  plain->fit(1);
  auto scaled = make_tiny_learner(s);
  auto doubler = std::make_shared<Doubler>();
  scaled->add_callback(doubler);
  scaled->fit(1);
  ASSERT_EQ(taker->grads.size(), doubler->grads.size());
  for (size_t i = 0; i < taker->grads.size(); ++i)
    EXPECT_TRUE(torch::allclose(doubler->grads[i], 2 * taker->grads[i], 1e-5, 1e-7));
}

class ZeroForward : public Callback {
 public:
  std::string name() const override { return "zero_forward"; }
  bool wraps_forward() const override { return true; }
  torch::Tensor wrap_forward(Learner&, const torch::Tensor& x, const ForwardNext& next) override {
    ++calls;
    return next(x) * 0.0;
  }
  int calls = 0;
};

TEST(LearnerSteering, WrapForwardWrapsTheModel) {
  auto l = make_tiny_learner();
  auto x = torch::randn({3, 1, 8, 8});
  EXPECT_GT(l->predict(x).abs().sum().item<double>(), 0.0);
  auto w = std::make_shared<ZeroForward>();
  l->add_callback(w);
  EXPECT_EQ(l->predict(x).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(w->calls, 1);
}

TEST(LearnerFit, TwoEpochsOnSyntheticDataLowerTheLoss) {
  TinySetup s;
  s.samples = 256;
  s.batch_size = 32;
  auto l = make_tiny_learner(s);
  std::vector<double> losses;
  auto rec = std::make_shared<Recorder>();
  rec->action = [&](Event e, Learner& learner) {
    if (e == Event::AfterTrain) losses.push_back(learner.epoch_loss());
  };
  l->add_callback(rec);
  l->fit(2);
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_LT(losses[1], losses[0]);
  EXPECT_LT(losses[1], std::log(4.0));  // better than chance
  EXPECT_GT(l->valid_accuracy(), 0.25);
}

// A stage whose [stages.optimizer] only lowers the learning rate keeps Adam's moments: the fit
// equals one optimizer whose rate was changed between the stages. Another name (or key) builds a
// new optimizer, whose state starts empty.
TEST(LearnerStages, AStageThatOnlyChangesTheRateKeepsTheOptimizerAndItsState) {
  TinySetup s = exact_setup(64, 16, 1e-2);
  s.optimizer = "adam";
  Stage slower = make_stage("slower", 1);
  slower.has_optimizer = true;
  auto staged = make_tiny_learner(s);
  slower.optimizer = staged->optimizer_options();
  slower.optimizer.lr = 5e-3;
  const int64_t changes = staged->optimizer_changes();
  staged->fit({make_stage("first", 1), slower});
  EXPECT_EQ(staged->optimizer_changes(), changes);
  EXPECT_EQ(staged->optimizer().param_groups()[0].options().get_lr(), 5e-3);

  auto by_hand = make_tiny_learner(s);
  by_hand->fit(1);
  for (auto& g : by_hand->optimizer().param_groups()) g.options().set_lr(5e-3);
  by_hand->fit(1);
  EXPECT_TRUE(params_equal(*staged->model(), clone_params(*by_hand->model())));

  Stage other = make_stage("sgd", 1);
  other.has_optimizer = true;
  other.optimizer = staged->optimizer_options();
  other.optimizer.name = "sgd";
  auto rebuilt = make_tiny_learner(s);
  rebuilt->fit({make_stage("first", 1), other});
  EXPECT_GT(rebuilt->optimizer_changes(), changes);
  EXPECT_NE(dynamic_cast<torch::optim::SGD*>(&rebuilt->optimizer()), nullptr);
}

TEST(LearnerFreeze, FrozenPrefixDoesNotTrain) {
  auto l = make_tiny_learner();
  auto named = l->model()->named_parameters();
  torch::Tensor stem = named["stem.1.weight"].detach().clone();
  torch::Tensor head = named["head.0.weight"].detach().clone();
  l->fit({make_stage("head-only", 1, {"stem"})});
  EXPECT_TRUE(torch::equal(l->model()->named_parameters()["stem.1.weight"], stem));
  EXPECT_FALSE(torch::equal(l->model()->named_parameters()["head.0.weight"], head));
}

TEST(LearnerFreeze, UnknownPrefixIsRefusedBeforeAnyEvent) {
  auto l = make_tiny_learner();
  auto rec = std::make_shared<Recorder>();
  l->add_callback(rec);
  try {
    l->fit({make_stage("bad", 1, {"stme"})});
    FAIL() << "fit should have thrown";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'stme'"), std::string::npos) << m;
    EXPECT_NE(m.find("did you mean 'stem'"), std::string::npos) << m;
  }
  EXPECT_TRUE(rec->events.empty());
}

TEST(LearnerMemory, PurgeReleasesOptimizerStateAndGradients) {
  auto l = make_tiny_learner();
  l->fit(1);
  // Gradients exist between backward and step; make some, as a stopped run would leave.
  auto b = l->train_data().batch(0);
  l->loss() = make_loss(LossOptions{})(l->model()->forward(b.x), b.y);
  l->backward();
  const int64_t grads = gradient_bytes(*l->model());
  const int64_t state = optimizer_state_bytes(l->optimizer());
  ASSERT_GT(grads, 0);
  ASSERT_EQ(state, 2 * grads);  // Adam: exp_avg and exp_avg_sq per parameter
  const int64_t released = l->purge();
  EXPECT_GE(released, grads + state);
  EXPECT_EQ(gradient_bytes(*l->model()), 0);
  EXPECT_EQ(optimizer_state_bytes(l->optimizer()), 0);
}

TEST(LearnerMemory, PurgeKeepsOptimizerStateWhenTold) {
  auto l = make_tiny_learner();
  l->fit(1);
  const int64_t state = optimizer_state_bytes(l->optimizer());
  ASSERT_GT(state, 0);
  l->purge(/*clear_opt=*/false);
  EXPECT_EQ(optimizer_state_bytes(l->optimizer()), state);
}

TEST(LearnerMemory, SteadyStateSplitsParametersGradientsOptimizerAndActivations) {
  auto l = make_tiny_learner();
  l->fit(1);
  ASSERT_EQ(l->stage_stats().size(), 1u);
  const auto& st = l->stage_stats()[0];
  ASSERT_TRUE(st.steady_measured);
  const int64_t params = parameter_bytes(*l->model());
  EXPECT_EQ(st.steady.parameters, params);
  EXPECT_EQ(st.steady.gradients, params);            // every parameter trains, no buffers
  EXPECT_EQ(st.steady.optimizer_state, 2 * params);  // Adam
  // A batch of 16 through Linear(64,16)+ReLU+Linear(16,16)+ReLU+Linear(16,4): backward keeps
  // the two ReLU outputs (each Linear's output dies once its ReLU ran) and the logits.
  const int64_t saved = (2 * 16 * 16 + 16 * 4) * 4;
  EXPECT_GE(st.steady.activations, saved);
  EXPECT_LE(st.steady.activations, 2 * saved);
  EXPECT_GT(st.peak_bytes, params * 4);
}

TEST(LearnerMemory, DestroyReleasesEverythingAndForbidsUse) {
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t base = mm.current();
  auto l = make_tiny_learner();
  l->fit(1);
  ASSERT_GT(mm.current(), base);
  l->destroy();
  EXPECT_LE(mm.current(), base + 1024);  // a few scalars may stay in LibTorch's caches
  EXPECT_THROW(l->fit(1), UsageError);
  EXPECT_THROW(l->model(), UsageError);
}

TEST(LearnerCheckpoint, SaveLoadRoundTripGivesIdenticalPredictions) {
  TempDir dir;
  auto a = make_tiny_learner();
  a->fit(1);
  a->save(dir.file("ckpt.pt"));
  TinySetup other;
  other.seed = 7;  // different initial weights
  auto b = make_tiny_learner(other);
  auto x = torch::randn({5, 1, 8, 8});
  ASSERT_FALSE(torch::equal(a->predict(x), b->predict(x)));
  b->load(dir.file("ckpt.pt"));
  EXPECT_TRUE(torch::equal(a->predict(x), b->predict(x)));
  EXPECT_EQ(optimizer_state_bytes(b->optimizer()), optimizer_state_bytes(a->optimizer()));
  EXPECT_FALSE(std::filesystem::exists(dir.file("ckpt.pt.tmp." + std::to_string(::getpid()))));
}

TEST(LearnerCheckpoint, TruncatedCheckpointIsRefusedClearly) {
  TempDir dir;
  auto a = make_tiny_learner();
  a->save(dir.file("ckpt.pt"));
  const auto size = std::filesystem::file_size(dir.file("ckpt.pt"));
  std::filesystem::resize_file(dir.file("ckpt.pt"), size / 2);
  auto x = torch::randn({2, 1, 8, 8});
  auto before = a->predict(x);
  try {
    a->load(dir.file("ckpt.pt"));
    FAIL() << "load should have thrown";
  } catch (const CheckpointError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("ckpt.pt"), std::string::npos) << m;
    EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  }
  EXPECT_TRUE(torch::equal(a->predict(x), before));  // the model was not touched
  EXPECT_THROW(a->load(dir.file("missing.pt")), CheckpointError);
  std::ofstream(dir.file("junk.pt")) << "not a checkpoint";
  EXPECT_THROW(a->load(dir.file("junk.pt")), CheckpointError);
}

TEST(LearnerCheckpoint, ModelOnlyCheckpointNeedsWithOptFalse) {
  TempDir dir;
  auto a = make_tiny_learner();
  a->fit(1);
  a->save(dir.file("model.pt"), /*with_opt=*/false);
  auto b = make_tiny_learner();
  EXPECT_THROW(b->load(dir.file("model.pt")), CheckpointError);
  b->load(dir.file("model.pt"), /*with_opt=*/false);
  auto x = torch::randn({2, 1, 8, 8});
  EXPECT_TRUE(torch::equal(a->predict(x), b->predict(x)));
}

TEST(LearnerReport, ReportHoldsStagesPeaksAndTimes) {
  auto l = make_tiny_learner();
  l->fit({make_stage("a", 1), make_stage("b", 1)});
  auto r = l->report();
  ASSERT_EQ(r["stages"].size(), 2u);
  EXPECT_EQ(r["stages"][0]["name"], "a");
  EXPECT_GT(r["peak_bytes"].get<int64_t>(), 0);
  EXPECT_GT(r["phase_peaks"]["forward"].get<int64_t>(), 0);
  EXPECT_GT(r["phase_peaks"]["backward"].get<int64_t>(), 0);
  EXPECT_GT(r["step_seconds"]["median"].get<double>(), 0.0);
  EXPECT_EQ(r["optimizer_steps"].get<int64_t>(), 8);
  EXPECT_TRUE(r.contains("valid_accuracy"));
}

}  // namespace
}  // namespace frugal::test

namespace frugal::test {
namespace {

class FirstStepGrads : public Callback {
 public:
  std::string name() const override { return "first_step_grads"; }
  void before_step(Learner& l) override {
    if (!grads.empty()) return;
    for (auto& p : l.model()->parameters()) grads.push_back(p.grad().clone());
    loss = l.loss().item<double>();
    micro = l.micro_count();
  }
  std::vector<torch::Tensor> grads;
  double loss = 0;
  int64_t micro = 0;
};

std::shared_ptr<FirstStepGrads> first_step(int64_t micro_batch_size) {
  TinySetup s;
  s.batch_size = 64;
  s.shuffle = false;
  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(micro_batch_size);
  auto g = std::make_shared<FirstStepGrads>();
  l->add_callback(g);
  l->set_max_batches(1);
  l->fit(1);
  return g;
}

TEST(LearnerMicroBatches, SplitBatchGivesTheWholeBatchGradients) {
  auto whole = first_step(0);
  auto split = first_step(16);
  auto uneven = first_step(24);  // 24 + 24 + 16
  EXPECT_EQ(whole->micro, 1);
  EXPECT_EQ(split->micro, 4);
  EXPECT_EQ(uneven->micro, 3);
  ASSERT_EQ(whole->grads.size(), split->grads.size());
  for (size_t i = 0; i < whole->grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(split->grads[i], whole->grads[i], 1e-5, 1e-6)) << "param " << i;
    EXPECT_TRUE(torch::allclose(uneven->grads[i], whole->grads[i], 1e-5, 1e-6)) << "param " << i;
  }
  EXPECT_NEAR(split->loss, whole->loss, 1e-5);  // the logged loss is the batch's
  EXPECT_NEAR(uneven->loss, whole->loss, 1e-5);
}

TEST(LearnerMicroBatches, SplittingLowersTheActivationPeak) {
  auto activations = [](int64_t mbs) {
    TinySetup s;
    s.samples = 256;
    s.batch_size = 256;
    s.width = 256;
    s.depth = 4;
    auto l = make_tiny_learner(s);
    l->set_micro_batch_size(mbs);
    l->fit(1);
    return l->stage_stats()[0].steady.activations;
  };
  const int64_t whole = activations(0), quarter = activations(64);
  EXPECT_LT(quarter, whole / 3) << whole << " vs " << quarter;
}

}  // namespace
}  // namespace frugal::test
