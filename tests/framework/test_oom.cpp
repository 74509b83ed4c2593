// Out of memory on CPU: the tracking allocator's budget raises c10::OutOfMemoryError as CUDA
// does; the loop retries with half the micro-batch (same gradients), stops with OomError after
// run.oom_retries, and run.micro_batch = "auto" finds the largest micro-batch that fits.
#include <gtest/gtest.h>

#include "frugal/app/plugin_host.h"
#include "frugal/app/run.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

// An MLP whose activations dominate what a step adds: a 256-sample batch of 16x16 images
// through 64 hidden units. Plain SGD, data in order: micro-batching is exact.
/// width 256: activations, not the batch or the step, set the peak at every micro-batch size
/// (the loop frees the prediction before backward). Under amp the bf16 copies of wide weights
/// would set it: amp's test takes width 64.
TinySetup wide_batch(int64_t width = 256) {
  TinySetup s = exact_setup(512, 256, 0.1);
  s.image_size = 16;
  s.width = width;
  return s;
}

struct FitRun {
  std::vector<torch::Tensor> params;
  double final_loss = 0;
  int64_t ooms = 0, micro_batch = 0, iterations = 0;
  nlohmann::json report;
};

FitRun finish(Learner& l) {
  FitRun r;
  r.params = clone_params(*l.model());
  r.report = l.report();
  r.final_loss = r.report["final_loss"].get<double>();
  r.ooms = l.oom_count();
  r.micro_batch = l.effective_micro_batch(l.train_data().batch_size());
  r.iterations = l.iteration();
  return r;
}

/// Live bytes of a fresh learner for `s`, and the highest live bytes of its unbudgeted fit.
struct Footprint {
  int64_t base = 0, peak = 0;
};
Footprint measure(const TinySetup& s, int64_t micro = 0) {
  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(micro);
  Footprint f;
  f.base = MemoryMeter::get().current();
  l->fit(1);
  f.peak = l->report()["peak_bytes"].get<int64_t>();
  return f;
}

/// A budget between the peak at micro-batches of 8 (what micro-batching cannot shrink: the
/// batch, the model, its gradients) and the whole batch's peak: `share` of what the whole batch
/// adds over it. At share 0.5 the whole batch needs about twice the room the budget leaves.
/// `micro`: the largest micro-batch measured (0 = the whole batch).
int64_t budget_for(const TinySetup& s, double share, int64_t micro = 0) {
  const Footprint whole = measure(s, micro), floor = measure(s, 8);
  // Measured on fresh learners, whose live bytes are the next one's (same data and model).
  return floor.peak + static_cast<int64_t>(share * static_cast<double>(whole.peak - floor.peak));
}

using test::message_of;

TEST(OomBudget, AllocationPastTheBudgetThrowsOutOfMemoryAndLeavesLiveBytes) {
  MemoryMeter& mm = MemoryMeter::get();
  ASSERT_EQ(mm.budget(), 0);
  {
    ScopedMemoryBudget budget(mm.current() + (1 << 20));
    torch::Tensor fits = torch::ones({128 * 1024});  // 512 KiB
    const int64_t live = mm.current();
    const int64_t refused = mm.refused();
    std::string message;
    try {
      torch::Tensor too_big = torch::ones({256 * 1024});  // 1 MiB more
      FAIL() << "the budget did not refuse 1 MiB";
    } catch (const c10::OutOfMemoryError& e) {
      message = e.what_without_backtrace();
    }
    EXPECT_NE(message.find("frugal: out of memory: tried to allocate 1.00 MiB"), std::string::npos)
        << message;
    EXPECT_NE(message.find("of budget 1."), std::string::npos) << message;
    EXPECT_EQ(mm.current(), live);  // nothing was counted for the refused allocation
    EXPECT_EQ(mm.refused(), refused + 1);
    // Under the budget allocations still work after a refusal.
    torch::Tensor small = torch::ones({1024});
    EXPECT_EQ(mm.current(), live + 4096);
  }
  EXPECT_EQ(mm.budget(), 0);  // restored by the guard
  torch::Tensor big = torch::ones({1 << 20});  // no budget: anything goes
  EXPECT_EQ(big.numel(), 1 << 20);
}

TEST(OomRetry, BudgetOfHalfTheActivationsTrainsThroughRetriesAsMicroBatchedFromTheStart) {
  const TinySetup s = wide_batch();
  const int64_t budget = budget_for(s, 0.5);
  FitRun retried;
  {
    auto l = make_tiny_learner(s);
    l->set_oom_policy({budget, /*retry=*/true, /*max_retries=*/4, false});
    l->fit(2);
    retried = finish(*l);
  }
  EXPECT_GT(retried.ooms, 0);
  EXPECT_EQ(retried.iterations, 4);  // every batch of both epochs trained
  EXPECT_LT(retried.micro_batch, 256);
  EXPECT_GE(retried.micro_batch, 1);
  const auto& oom = retried.report["oom"];
  EXPECT_EQ(oom["count"].get<int64_t>(), retried.ooms);
  EXPECT_EQ(oom["micro_batch"].get<int64_t>(), retried.micro_batch);
  ASSERT_FALSE(oom["retries"].empty());
  EXPECT_EQ(oom["retries"][0]["from"].get<int64_t>(), 256);
  EXPECT_EQ(oom["retries"][0]["to"].get<int64_t>(), 128);
  EXPECT_EQ(MemoryMeter::get().budget(), 0);  // the fit's budget is gone after it

  // The same run micro-batched at the final size from the start, without a budget.
  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(retried.micro_batch);
  l->fit(2);
  const FitRun plain = finish(*l);
  EXPECT_EQ(plain.ooms, 0);
  EXPECT_TRUE(params_equal(*l->model(), retried.params));
  EXPECT_DOUBLE_EQ(plain.final_loss, retried.final_loss);
  // And it stays close to the whole-batch run (micro-batching changes only the rounding).
  auto whole = make_tiny_learner(s);
  whole->fit(2);
  EXPECT_NEAR(finish(*whole).final_loss, retried.final_loss, 1e-5);
}

/// Raises c10::OutOfMemoryError from inside the forward chain the first `n` times, as a
/// forward wrapper (activation checkpointing, autocast) running out would.
struct OomInForward : Callback {
  int remaining;
  explicit OomInForward(int n) : remaining(n) {}
  std::string name() const override { return "oom_in_forward"; }
  bool wraps_forward() const override { return true; }
  torch::Tensor wrap_forward(Learner& l, const torch::Tensor& x, const ForwardNext& next) override {
    if (l.training() && remaining > 0 && l.micro_index() == 1) {
      --remaining;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory");
    }
    return next(x);
  }
};

/// Records the events of the first batch.
struct EventLog : Callback {
  std::vector<std::string> events;
  std::string name() const override { return "event_log"; }
  void before_forward(Learner& l) override { note("before_forward", l); }
  void after_backward(Learner& l) override { note("after_backward", l); }
  void before_step(Learner& l) override { note("before_step", l); }
  void note(const char* e, Learner& l) {
    if (l.iteration() == 0)
      events.push_back(std::string(e) + " " + std::to_string(l.micro_index()) + "/" +
                       std::to_string(l.micro_count()));
  }
};

TEST(OomRetry, OomInAForwardWrapperKeepsItsTypeAndResumesAtTheFailedMicroBatch) {
  TinySetup s = exact_setup(64, 32, 0.1);
  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(16);
  l->set_oom_policy({0, true, 4, false});
  auto log = std::make_shared<EventLog>();
  l->add_callback(std::make_shared<OomInForward>(1));
  l->add_callback(log);
  l->fit(1);
  EXPECT_EQ(l->oom_count(), 1);
  EXPECT_EQ(l->micro_batch_cap(), 8);
  // Micro-batch 1 of 16 failed in forward: micro-batch 0 stands, the other 16 run as 8 + 8.
  EXPECT_EQ(log->events, (std::vector<std::string>{
                             "before_forward 0/2", "after_backward 0/2", "before_forward 1/2",
                             "before_forward 1/3", "after_backward 1/3", "before_forward 2/3",
                             "after_backward 2/3", "before_step 2/3"}));
  auto r = l->report()["oom"]["retries"][0];
  EXPECT_EQ(r["phase"], "forward");
  EXPECT_FALSE(r["restarted"].get<bool>());
  const auto params = clone_params(*l->model());

  // Exact up to rounding: 16 + 8 + 8 against 16 + 16, then 8s.
  auto ref = make_tiny_learner(s);
  ref->set_micro_batch_size(8);
  ref->fit(1);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(ref->model()->parameters()[i], params[i], 1e-5, 1e-6)) << i;

  // Without retry the same error stops the fit as OomError naming on_oom.
  auto fail = make_tiny_learner(s);
  fail->set_micro_batch_size(16);
  fail->add_callback(std::make_shared<OomInForward>(1));
  const std::string msg = message_of([&] { fail->fit(1); });
  EXPECT_NE(msg.find("out of memory in forward of batch 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("run.on_oom = \"retry\""), std::string::npos) << msg;
}

/// Vetoes every retry while `armed`, as step_in_backward does once it stepped a parameter.
struct VetoRetry : Callback {
  bool armed = true;
  mutable int asked = 0;
  std::string name() const override { return "veto_retry"; }
  std::string retry_veto(const Learner&) const override {
    ++asked;
    return armed ? "parameters already stepped" : "";
  }
};

TEST(OomRetry, ACallbacksVetoStopsTheRetryNamingItAndItsReason) {
  TinySetup s = exact_setup(64, 32, 0.1);
  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(16);
  l->set_oom_policy({0, true, 4, false});
  auto veto = std::make_shared<VetoRetry>();
  l->add_callback(std::make_shared<OomInForward>(1));
  l->add_callback(veto);
  OomError::Phase phase = OomError::Phase::Step;
  const std::string msg = message_of([&] {
    try {
      l->fit(1);
    } catch (const OomError& e) {
      phase = e.phase();
      throw;
    }
  });
  EXPECT_EQ(phase, OomError::Phase::Forward);
  EXPECT_EQ(veto->asked, 1);
  EXPECT_NE(msg.find("not retried (veto_retry: parameters already stepped)"), std::string::npos) << msg;
  EXPECT_EQ(l->micro_batch_cap(), 0) << "no retry was planned";

  // Without the veto the same error is retried (and the callback was asked).
  auto k = make_tiny_learner(s);
  k->set_micro_batch_size(16);
  k->set_oom_policy({0, true, 4, false});
  auto quiet = std::make_shared<VetoRetry>();
  quiet->armed = false;
  k->add_callback(std::make_shared<OomInForward>(1));
  k->add_callback(quiet);
  k->fit(1);
  EXPECT_EQ(quiet->asked, 1);
  EXPECT_EQ(k->oom_count(), 1);
  EXPECT_EQ(k->micro_batch_cap(), 8);
}

TEST(OomRetry, GradAccumSplitDoesNotUndoTheCapAtTheNextStage) {
  const TinySetup s = wide_batch();
  // Half of what grad_accum's micro-batches of 128 add.
  const int64_t budget = budget_for(s, 0.5, 128);
  PluginHost host;
  FitRun retried;
  {
    auto l = make_tiny_learner(s);
    for (auto& cb : host.load(plugins_of("[plugins.grad_accum]\nsteps = 2\n"), "cfg.toml"))
      l->add_callback(cb);
    l->set_oom_policy({budget, true, 4, false});
    l->fit({make_stage("one", 1), make_stage("two", 1)});  // grad_accum re-splits at each stage
    retried = finish(*l);
    EXPECT_EQ(l->micro_batch_size(), 0);  // grad_accum restored its own setting
  }
  EXPECT_GT(retried.ooms, 0);
  EXPECT_LT(retried.micro_batch, 128);  // below grad_accum's split of 256 into 2
  EXPECT_EQ(retried.iterations, 4);
  // No OOM in stage two: the cap held when grad_accum set its 128 again.
  for (const auto& r : retried.report["oom"]["retries"])
    EXPECT_LT(r["iteration"].get<int64_t>(), 2) << r.dump();

  auto l = make_tiny_learner(s);
  l->set_micro_batch_size(retried.micro_batch);
  l->fit({make_stage("one", 1), make_stage("two", 1)});
  EXPECT_TRUE(params_equal(*l->model(), retried.params));
}

TEST(OomRetry, AmpAutocastRetriesAndEndsOff) {
  // Under amp (bfloat16 autocast) the retried run equals an amp run micro-batched at the final
  // size from the start, and autocast is off after the fit.
  const TinySetup s = wide_batch(64);
  PluginHost host;
  const char* amp = "[plugins.amp]\ndtype = \"bfloat16\"\n";
  auto fit_amp = [&](int64_t micro, int64_t budget, bool retry) {
    auto l = make_tiny_learner(s);
    for (auto& cb : host.load(plugins_of(amp), "cfg.toml")) l->add_callback(cb);
    l->set_micro_batch_size(micro);
    l->set_oom_policy({budget, retry, 4, false});
    l->fit(1);
    FitRun r = finish(*l);
    r.micro_batch = l->micro_batch_cap() > 0 ? l->micro_batch_cap() : micro;
    return r;
  };
  auto footprint = [&](int64_t micro) {
    auto l = make_tiny_learner(s);
    for (auto& cb : host.load(plugins_of(amp), "cfg.toml")) l->add_callback(cb);
    l->set_micro_batch_size(micro);
    l->fit(1);
    return l->report()["peak_bytes"].get<int64_t>();
  };
  const int64_t whole = footprint(0), floor = footprint(8);
  const FitRun retried = fit_amp(0, floor + (whole - floor) / 2, true);
  EXPECT_GT(retried.ooms, 0);
  EXPECT_EQ(retried.iterations, 2);
  EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
  const FitRun plain = fit_amp(retried.micro_batch, 0, false);
  ASSERT_EQ(plain.params.size(), retried.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i)
    EXPECT_TRUE(torch::equal(plain.params[i], retried.params[i])) << i;
}

TEST(OomRetry, StopsWithOomErrorNamingTheBudgetWhenNothingFits) {
  // Wide layers: the gradients (1 MiB) are far more than the batch (64 KiB).
  TinySetup s = exact_setup(128, 64, 0.1);
  s.image_size = 16;
  s.width = 1024;
  s.depth = 1;
  auto l = make_tiny_learner(s);
  const int64_t batch_bytes = static_cast<int64_t>(l->train_data().batch(0).x.nbytes());
  const int64_t live = MemoryMeter::get().current();
  // Room to load a batch, not for the gradients of even one sample.
  const int64_t budget = live + 4 * batch_bytes;
  l->set_oom_policy({budget, true, 20, false});
  std::string msg;
  try {
    l->fit(1);
    ADD_FAILURE() << "fit did not stop";
  } catch (const OomError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("even at micro-batch size 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("run.memory_budget = " + format_bytes(budget)), std::string::npos) << msg;
  EXPECT_NE(msg.find("tried to allocate"), std::string::npos) << msg;
  EXPECT_EQ(l->oom_count(), 7);  // 64, 32, ..., 1
  // The failed batch let go of what it held; the budget is gone.
  EXPECT_LE(MemoryMeter::get().current(), live + 64);
  EXPECT_EQ(MemoryMeter::get().budget(), 0);
  l.reset();

  // K = 2: the third error on one batch stops the run.
  auto k = make_tiny_learner(s);
  k->set_oom_policy({budget, true, 2, false});
  const std::string km = message_of([&] { k->fit(1); });
  EXPECT_NE(km.find("3 out-of-memory errors on this batch (run.oom_retries = 2)"), std::string::npos)
      << km;
  EXPECT_EQ(k->oom_count(), 3);
  k.reset();

  // A batch that cannot even be loaded: micro-batches cannot help, the error says so.
  auto loading = make_tiny_learner(s);
  loading->set_oom_policy({live + batch_bytes / 2, true, 4, false});
  const std::string lm = message_of([&] { loading->fit(1); });
  EXPECT_NE(lm.find("out of memory loading training batch 0 of 64 samples"), std::string::npos)
      << lm;
  loading.reset();

  // Out of memory outside forward and backward (here a callback's hook) stops as OomError
  // naming the event, without LibTorch's backtrace.
  struct Hungry : Callback {
    std::string name() const override { return "hungry"; }
    void before_step(Learner&) override { big = torch::ones({1 << 22}); }
    torch::Tensor big;
  };
  auto hungry = make_tiny_learner(s);
  hungry->add_callback(std::make_shared<Hungry>());
  hungry->set_oom_policy({MemoryMeter::get().current() + (8 << 20), true, 4, false});
  const std::string hm = message_of([&] { hungry->fit(1); });
  EXPECT_EQ(hm.find("out of memory in event 'before_step' (iteration 0): frugal: out of memory: "
                    "tried to allocate 16.0 MiB"), 0u) << hm;
  EXPECT_EQ(hm.find("Exception raised from"), std::string::npos) << hm;
  hungry.reset();

  // A budget below what the learner already holds is refused before any batch.
  auto under = make_tiny_learner(s);
  under->set_oom_policy({1024, true, 4, false});
  const std::string um = message_of([&] { under->fit(1); });
  EXPECT_NE(um.find("less than what the model, the optimizer and the data already hold"),
            std::string::npos)
      << um;
}

TEST(OomAuto, FindsTheLargestMicroBatchThatFitsAndLeavesTheRunUnchanged) {
  // sgd: the probe's answer is exact (no optimizer state, no step temporaries); adam: it
  // leaves room for the state the first step creates, so the fit needs no retry either.
  for (const char* optimizer : {"sgd", "adam"}) {
    SCOPED_TRACE(optimizer);
    TinySetup s = wide_batch();
    s.dropout = 0.2;  // the probe's forwards draw dropout masks: the RNG must be restored
    s.optimizer = optimizer;
    const int64_t budget = budget_for(s, 0.5);
    auto l = make_tiny_learner(s);
    l->set_oom_policy({budget, /*retry=*/false, 4, /*auto=*/true});
    l->fit(1);  // on_oom = fail: any out-of-memory error would stop it
    const FitRun a = finish(*l);
    l.reset();
    const auto& autos = a.report["oom"]["auto"];
    ASSERT_EQ(autos.size(), 1u);
    const int64_t m = autos[0]["micro_batch"].get<int64_t>();
    EXPECT_EQ(a.ooms, 0);
    EXPECT_EQ(a.micro_batch, m);
    EXPECT_GE(m, 2);
    EXPECT_LT(m, 256);
    if (std::string(optimizer) == "sgd") {
      // Twice the size does not fit: the same fit at 2m runs out.
      auto more = make_tiny_learner(s);
      more->set_micro_batch_size(2 * m);
      more->set_oom_policy({budget, false, 4, false});
      EXPECT_THROW(more->fit(1), OomError);
    }
    // The probe left no trace: the run equals one micro-batched at m from the start.
    auto ref = make_tiny_learner(s);
    ref->set_micro_batch_size(m);
    ref->fit(1);
    EXPECT_TRUE(params_equal(*ref->model(), a.params));
  }
}

// The bytes a gradient sync adds at the end of backward (Learner::set_sync_reserve; data_parallel
// sets its largest bucket's copy) are kept free by the search: under budgets between the two it
// finds a smaller micro-batch with the reserve than without, never a larger one.
TEST(OomAuto, TheSearchKeepsTheSyncReserveFree) {
  TinySetup s = exact_setup(64, 32, 0.1);
  s.width = 256;
  auto l = make_tiny_learner(s);
  const int64_t live = MemoryMeter::get().current(), reserve = 256 << 10;
  const auto search = [&](int64_t kept) {
    l->set_sync_reserve(kept);
    return micro_batch_that_fits(*l);
  };
  int64_t smaller = 0, without = 0;
  for (int64_t extra = 0; extra <= (8 << 20) && without < s.batch_size; extra += 64 << 10) {
    ScopedMemoryBudget budget(live + extra);
    without = search(0);
    const int64_t with = search(reserve);
    EXPECT_LE(with, without) << extra;
    if (with < without) ++smaller;
  }
  EXPECT_EQ(without, s.batch_size);
  EXPECT_GT(smaller, 0) << "no budget where the reserve made the difference";
  l->set_sync_reserve(0);
}

TEST(OomAuto, ProbeRestoresBatchNormStatistics) {
  TinySetup s = exact_setup(64, 32, 0.1);
  s.arch = "cnn";
  s.width = 4;
  auto l = make_tiny_learner(s);
  auto buffers = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& b : l->model()->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto before = buffers();
  const int64_t live = MemoryMeter::get().current();
  {
    ScopedMemoryBudget budget(live + (64 << 20));
    EXPECT_EQ(l->find_micro_batch(), 32);  // everything fits in 64 MiB
  }
  const auto after = buffers();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
  for (const auto& p : l->model()->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_EQ(l->micro_batch_cap(), 0);
  EXPECT_THROW(l->find_micro_batch(), UsageError);  // no budget
}

TEST(OomConfig, BadValuesNameTheKey) {
  auto error_of = [](const std::string& text) {
    try {
      parse_config(text, "cfg.toml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string on = error_of("[run]\non_oom = \"sometimes\"\n");
  EXPECT_NE(on.find("on_oom"), std::string::npos) << on;
  EXPECT_NE(on.find("retry"), std::string::npos) << on;
  const std::string mb = error_of("[run]\nmicro_batch = \"auto\"\n");
  EXPECT_NE(mb.find("'run.micro_batch' = \"auto\" needs 'run.memory_budget'"), std::string::npos)
      << mb;
  EXPECT_NE(mb.find("cfg.toml"), std::string::npos) << mb;
  const std::string bytes = error_of("[run]\nmemory_budget = \"lots\"\n");
  EXPECT_NE(bytes.find("run.memory_budget"), std::string::npos) << bytes;
  const std::string k = error_of("[run]\noom_retries = 0\n");
  EXPECT_NE(k.find("oom_retries"), std::string::npos) << k;

  Config c = parse_config(
      "[run]\nmemory_budget = \"3MiB\"\non_oom = \"retry\"\noom_retries = 2\nmicro_batch = "
      "\"auto\"\n[data]\ndataset = \"synthetic\"\nsamples = 32\nimage_size = 8\nbatch_size = 16\n"
      "valid_samples = -1\n[model]\narch = \"mlp\"\n",
      "cfg.toml");
  auto l = make_learner(c);
  EXPECT_EQ(l->oom_policy().budget, 3 << 20);
  EXPECT_TRUE(l->oom_policy().retry);
  EXPECT_EQ(l->oom_policy().max_retries, 2);
  EXPECT_TRUE(l->oom_policy().auto_micro_batch);
}

}  // namespace
}  // namespace frugal::test
