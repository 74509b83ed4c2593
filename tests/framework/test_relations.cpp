// What the Learner checks when callbacks are added (Callback::relations), the one path that
// releases cached memory (Callback::release_caches), and the Learner's named memory windows.
#include "learner_fixture.h"

namespace frugal::test {
namespace {

/// A callback with a name, an order, relations, and optionally a forward wrapper.
class Related : public Callback {
 public:
  Related(std::string name, int order, CallbackRelations r = {}, bool wraps = false)
      : name_(std::move(name)), order_(order), relations_(std::move(r)), wraps_(wraps) {}
  std::string name() const override { return name_; }
  int order() const override { return order_; }
  CallbackRelations relations() const override { return relations_; }
  bool wraps_forward() const override { return wraps_; }
  void release_caches(Learner&) override { ++released; }
  int released = 0;

 private:
  std::string name_;
  int order_;
  CallbackRelations relations_;
  bool wraps_;
};

std::string add_error(Learner& l, std::shared_ptr<Callback> cb) {
  try {
    l.add_callback(std::move(cb));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(LearnerRelations, AConflictIsRefusedWhenTheCallbackIsAdded) {
  auto l = make_tiny_learner();
  l->add_callback(std::make_shared<Related>("a", 0, CallbackRelations{{}, {"b"}, false}));
  EXPECT_EQ(add_error(*l, std::make_shared<Related>("b", 5)),
            "callbacks 'a' and 'b' conflict: 'a' declares that it cannot run together with 'b'; "
            "turn one off (a plugin: enabled = false)");
  ASSERT_EQ(l->callbacks().size(), 1u);  // the refused callback was not added
  EXPECT_EQ(add_error(*l, std::make_shared<Related>("c", 5)), "");
  EXPECT_EQ(l->callbacks().size(), 2u);
}

TEST(LearnerRelations, RunsBeforeIsCheckedAgainstTheOrdersInEitherAddOrder) {
  const CallbackRelations before_b{{"b"}, {}, false};
  {
    auto l = make_tiny_learner();
    l->add_callback(std::make_shared<Related>("b", 0));
    EXPECT_EQ(add_error(*l, std::make_shared<Related>("a", 10, before_b)),
              "callback 'a' must run before 'b', but its order is 10 and 'b' has order 0: give "
              "'a' a smaller order than 'b'");
  }
  {
    auto l = make_tiny_learner();
    l->add_callback(std::make_shared<Related>("a", 10, before_b));
    EXPECT_NE(add_error(*l, std::make_shared<Related>("b", 0)), "");
    EXPECT_EQ(add_error(*l, std::make_shared<Related>("b", 20)), "");
  }
}

TEST(LearnerRelations, AnInnermostForwardWrapperRefusesAWrapperInsideIt) {
  auto l = make_tiny_learner();
  l->add_callback(std::make_shared<Related>("inner", order::kInnermostForward,
                                            CallbackRelations{{}, {}, true}, true));
  EXPECT_EQ(add_error(*l, std::make_shared<Related>("deeper", order::kInnermostForward + 1,
                                                    CallbackRelations{}, true)),
            "callback 'inner' runs the model itself and must be the innermost forward wrapper "
            "(order 100), but 'deeper' also wraps the forward with order 101: give 'deeper' an "
            "order below 100");
  // A callback at a larger order that does not wrap the forward is fine, as is an outer wrapper.
  EXPECT_EQ(add_error(*l, std::make_shared<Related>("late", order::kOutputRelease)), "");
  EXPECT_EQ(add_error(*l, std::make_shared<Related>("outer", order::kPrecision, CallbackRelations{},
                                                    true)),
            "");
}

TEST(LearnerRelations, InTreeOrderBandsAreDistinct) {
  const std::vector<int> bands = {order::kTrace,          order::kCheckpointWriter,
                                  order::kModelRewrite,   order::kOptimizerSwap,
                                  order::kPurge,          order::kDefault,
                                  order::kBatchGrouping,  order::kPrecision,
                                  order::kInnermostForward, order::kOutputRelease,
                                  order::kProgress};
  for (size_t i = 1; i < bands.size(); ++i) EXPECT_LT(bands[i - 1], bands[i]) << i;
}

TEST(LearnerReleaseCaches, PurgeProbeAndDestroyReleaseThroughEveryCallback) {
  auto l = make_tiny_learner();
  auto a = std::make_shared<Related>("a", 0), b = std::make_shared<Related>("b", 1);
  l->add_callback(a);
  l->add_callback(b);
  l->purge();
  EXPECT_EQ(a->released, 1);
  EXPECT_EQ(b->released, 1);
  {
    ScopedMemoryBudget budget(MemoryMeter::get().current() + (64 << 20));
    l->find_micro_batch();  // everything fits: one probe
  }
  EXPECT_EQ(a->released, 2);
  l->destroy();  // before the callbacks go
  EXPECT_EQ(a->released, 3);
  EXPECT_EQ(b->released, 3);
}

TEST(LearnerWindows, StageAndPhasePeaksAreReadableDuringAFitOnly) {
  struct Reader : Callback {
    std::string name() const override { return "reader"; }
    void after_loss(Learner& l) override { forward = std::max(forward, l.phase_peak()); }
    void after_batch(Learner& l) override { stage = std::max(stage, l.stage_peak()); }
    int64_t forward = 0, stage = 0;
  };
  auto l = make_tiny_learner();
  auto r = std::make_shared<Reader>();
  l->add_callback(r);
  const int64_t live = MemoryMeter::get().current();
  l->fit(1);
  EXPECT_GT(r->forward, live);
  EXPECT_GE(r->stage, r->forward);
  EXPECT_LE(r->stage, l->stage_stats()[0].peak_bytes);  // validation came after the batches
  EXPECT_EQ(l->stage_peak(), 0);  // the fit gave its windows back
  EXPECT_EQ(l->phase_peak(), 0);
}

}  // namespace
}  // namespace frugal::test
