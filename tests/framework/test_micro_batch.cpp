// Micro-batching and the out-of-memory policy without a Learner (frugal/micro_batch.h): the
// decision after an error, the records, the probe's search and what a step needs.
#include <set>

#include <gtest/gtest.h>

#include "frugal/frugal.h"

namespace frugal::test {
namespace {

using P = OomError::Phase;

OomEvent event(P phase, int64_t micro, int64_t failures, bool grads_at_start = false,
               int64_t budget = 1 << 20) {
  OomEvent e;
  e.phase = phase;
  e.batch = 3;
  e.iteration = 7;
  e.micro_batch = micro;
  e.batch_samples = 64;
  e.failures = failures;
  e.grads_at_start = grads_at_start;
  e.budget = budget;
  e.message = "frugal: out of memory: tried to allocate 1 KiB";
  return e;
}

OomPolicy retrying(int64_t max_retries = 4) {
  OomPolicy p;
  p.retry = true;
  p.max_retries = max_retries;
  return p;
}

/// The OomError decide_oom_retry throws, or nullopt when it retries.
std::optional<OomError> stop_of(const OomPolicy& p, const OomEvent& e) {
  try {
    decide_oom_retry(p, e);
  } catch (const OomError& err) {
    return err;
  }
  return std::nullopt;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(OomDecision, RetryHalvesTheMicroBatchRoundingUp) {
  const OomRetry r = decide_oom_retry(retrying(), event(P::Forward, 64, 1));
  EXPECT_EQ(r.iteration, 7);
  EXPECT_EQ(r.from, 64);
  EXPECT_EQ(r.to, 32);
  EXPECT_FALSE(r.restarted);
  EXPECT_EQ(decide_oom_retry(retrying(), event(P::Forward, 5, 1)).to, 3);
  EXPECT_EQ(decide_oom_retry(retrying(), event(P::Forward, 2, 1)).to, 1);
  const OomRetry back = decide_oom_retry(retrying(), event(P::Backward, 16, 4));
  EXPECT_TRUE(back.restarted);
  EXPECT_EQ(back.phase, P::Backward);
  // A forward touches no gradient: held gradients do not stop its retry.
  EXPECT_EQ(decide_oom_retry(retrying(), event(P::Forward, 16, 1, true)).to, 8);
}

TEST(OomDecision, EachStopNamesItsCauseWithPhaseAndIteration) {
  OomPolicy fail;
  auto e = stop_of(fail, event(P::Forward, 64, 1));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->phase(), P::Forward);
  EXPECT_EQ(e->iteration(), 7);
  EXPECT_TRUE(has(e->what(), "out of memory in forward of batch 3 (iteration 7, micro-batch 64 "
                             "of 64 samples): frugal: out of memory"))
      << e->what();
  EXPECT_TRUE(has(e->what(), "run.on_oom = \"retry\"")) << e->what();

  e = stop_of(retrying(), event(P::Backward, 64, 1, true));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->phase(), P::Backward);
  EXPECT_TRUE(has(e->what(), "Gradients of earlier batches were being accumulated into this step "
                             "(a callback skipped the earlier steps)"))
      << e->what();
  EXPECT_FALSE(has(e->what(), "grad_accum")) << "the core names no plugin: " << e->what();

  e = stop_of(retrying(), event(P::Forward, 1, 1));
  ASSERT_TRUE(e);
  EXPECT_TRUE(has(e->what(), "even at micro-batch size 1, with run.memory_budget = 1.00 MiB"))
      << e->what();

  e = stop_of(retrying(2), event(P::Forward, 8, 3, false, 0));
  ASSERT_TRUE(e);
  EXPECT_TRUE(has(e->what(), "3 out-of-memory errors on this batch (run.oom_retries = 2), with no "
                             "run.memory_budget (the device's memory)"))
      << e->what();
  EXPECT_FALSE(stop_of(retrying(2), event(P::Forward, 8, 2)));  // the second error still retries
}

TEST(OomDecision, ErrorsOutsideForwardAndBackwardCarryTheirPhase) {
  const OomError step = oom_in_step(2, 9, "refused");
  EXPECT_EQ(step.phase(), P::Step);
  EXPECT_EQ(step.iteration(), 9);
  EXPECT_TRUE(has(step.what(), "in the optimizer step of batch 2 (iteration 9): refused")) << step.what();
  EXPECT_EQ(oom_loading(0, 64, 5, "refused").phase(), P::Load);
  const OomError hook = oom_in_event("before_step", 4, "refused");
  EXPECT_EQ(hook.phase(), P::Event);
  EXPECT_EQ(std::string(hook.what()).find("out of memory in event 'before_step' (iteration 4)"), 0u);
  EXPECT_EQ(oom_budget_below_live(1024, 4096, 0).phase(), P::Start);
  EXPECT_EQ(oom_in_probe(1024, 512, 256, 0).phase(), P::Probe);
  EXPECT_EQ(to_string(P::Backward), "backward");
  EXPECT_EQ(to_string(P::Step), "step");
}

TEST(MicroBatchSize, EffectiveIsTheSmallestOfBatchSizeAndCap) {
  EXPECT_EQ(effective_micro_batch(64, 0, 0), 64);
  EXPECT_EQ(effective_micro_batch(64, 16, 0), 16);
  EXPECT_EQ(effective_micro_batch(64, 16, 8), 8);
  EXPECT_EQ(effective_micro_batch(64, 0, 100), 64);
  EXPECT_EQ(effective_micro_batch(10, 16, 0), 10);
  EXPECT_EQ(effective_micro_batch(0, 0, 0), 1);
}

TEST(MicroBatchRecords, RetriesLowerTheCapAndTheReportShowsThem) {
  MicroBatching m;
  m.set_size(32);
  m.retried({3, P::Backward, 32, 16, true});
  EXPECT_EQ(m.cap(), 16);
  EXPECT_EQ(m.effective(64), 16);
  m.count_oom();
  m.ran_at(16);
  m.probed("one", 8);
  OomPolicy p = retrying();
  p.budget = 1 << 20;
  const nlohmann::json j = m.report(p);
  EXPECT_EQ(j["budget"], 1 << 20);
  EXPECT_EQ(j["on_oom"], "retry");
  EXPECT_EQ(j["count"], 1);
  EXPECT_EQ(j["micro_batch"], 16);
  ASSERT_EQ(j["retries"].size(), 1u);
  EXPECT_EQ(j["retries"][0]["phase"], "backward");
  EXPECT_EQ(j["retries"][0]["from"], 32);
  EXPECT_EQ(j["retries"][0]["to"], 16);
  EXPECT_EQ(j["retries"][0]["restarted"], true);
  EXPECT_EQ(j["auto"][0]["stage"], "one");
  EXPECT_EQ(j["auto"][0]["micro_batch"], 8);

  for (int i = 0; i < 150; ++i) m.retried({i, P::Forward, 2, 1, false});
  EXPECT_EQ(m.report(p)["retries"].size(), 100u);  // the first 100 are kept
  m.start_fit();
  EXPECT_EQ(m.cap(), 0);
  EXPECT_EQ(m.oom_count(), 0);
  EXPECT_EQ(m.size(), 32);  // the size is a setting, not a record
  EXPECT_TRUE(m.report(p)["retries"].empty());
  EXPECT_THROW(m.set_size(-1), UsageError);
  EXPECT_THROW(m.set_cap(-1), UsageError);
}

TEST(OomProbeSearch, FindsTheLargestSizeThatFitsAskingEachSizeOnce) {
  for (int64_t limit : {0, 1, 2, 3, 7, 100, 129, 255, 256}) {
    SCOPED_TRACE(limit);
    std::set<int64_t> asked;
    const ProbeSearch s = largest_fitting(256, [&](int64_t m) {
      EXPECT_TRUE(asked.insert(m).second) << "asked twice: " << m;
      return m <= limit;
    });
    EXPECT_EQ(s.size, limit);
    EXPECT_EQ(s.probes, static_cast<int64_t>(asked.size()));
  }
  // The whole batch fits: one probe. Nothing fits: 256, 128, ..., 1.
  EXPECT_EQ(largest_fitting(256, [](int64_t) { return true; }).probes, 1);
  EXPECT_EQ(largest_fitting(256, [](int64_t) { return false; }).probes, 9);
  EXPECT_EQ(largest_fitting(5, [](int64_t m) { return m <= 4; }).size, 4);
}

TEST(OomProbeSearch, AProbeFitsWithRoomForTheStep) {
  constexpr int64_t kSlack = 256;  // the loop's own scalars
  const ProbeResult r{false, 1000, 800};
  const StepNeeds needs{100, 150};
  const int64_t budget = 1000 + 100 + kSlack;  // the peak with the state to come
  EXPECT_TRUE(probe_fits(r, needs, budget));
  EXPECT_FALSE(probe_fits(r, needs, budget - 1));
  // After backward the step's temporaries come on top: 800 + 100 + 150 + slack.
  EXPECT_FALSE(probe_fits({false, 800, 800}, needs, 800 + 100 + 150 + kSlack - 1));
  EXPECT_TRUE(probe_fits({false, 800, 800}, needs, 800 + 100 + 150 + kSlack));
  EXPECT_FALSE(probe_fits({true, 0, 0}, needs, 1 << 30));
}

}  // namespace
}  // namespace frugal::test
