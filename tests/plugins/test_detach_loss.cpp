// The detach_loss plugin: the leak it prevents (a callback keeping every batch's loss), the leak
// watch's arithmetic, and the watch firing in a real fit.
#include <sstream>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "../../plugins/detach_loss/detach_loss.h"
#include "frugal/plugin_host.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace dl = frugal::detach_loss;

/// The naive history: keeps every batch's l.loss() as it finds it in `when`, and records the
/// live bytes at the end of every batch.
struct LossKeeper : Callback {
  explicit LossKeeper(Event when) : when_(when) {}
  std::string name() const override { return "loss_keeper"; }
  void after_loss(Learner& l) override { keep(l, Event::AfterLoss); }
  void after_backward(Learner& l) override { keep(l, Event::AfterBackward); }
  void after_batch(Learner& l) override {
    keep(l, Event::AfterBatch);
    live.push_back(l.memory().current());
  }
  int64_t held_bytes() const override {
    int64_t n = 0;
    for (const auto& t : kept) n += static_cast<int64_t>(t.nbytes());
    return n;
  }
  /// Mean growth of the live bytes per batch from batch `from` on.
  double growth(size_t from = 2) const {
    if (live.size() < from + 2) return 0;
    return static_cast<double>(live.back() - live[from]) / static_cast<double>(live.size() - 1 - from);
  }
  std::vector<torch::Tensor> kept;
  std::vector<int64_t> live;

 private:
  void keep(Learner& l, Event e) {
    if (e == when_ && l.loss().defined()) kept.push_back(l.loss());
  }
  Event when_;
};

/// A guard that drops every other batch after its loss (a loss-spike or NaN guard): backward
/// never runs on those, so their graph still holds every saved activation.
struct SkipEveryOther : Callback {
  std::string name() const override { return "skip_every_other"; }
  void after_loss(Learner& l) override {
    if (l.batch_index() % 2 == 1) l.skip_batch();
  }
};

std::shared_ptr<spdlog::logger> capture_logger(std::ostringstream& out) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  sink->set_pattern("%n: %v");
  auto log = std::make_shared<spdlog::logger>("detach_loss", sink);
  log->set_level(spdlog::level::debug);
  return log;
}

std::shared_ptr<dl::DetachLoss> make_plugin(std::ostringstream& out, bool detach = true,
                                             int64_t window = 4) {
  dl::DetachLossOptions o;
  o.detach = detach;
  o.window = window;
  return std::make_shared<dl::DetachLoss>(o, PluginContext{"detach_loss", capture_logger(out)});
}

TinySetup leak_setup() {
  TinySetup s;
  s.samples = 32 * 12;  // 12 batches in one epoch
  s.batch_size = 32;
  s.width = 256;
  s.depth = 3;
  s.valid_samples = 0;
  s.optimizer = "sgd";
  return s;
}

TEST(DetachLossExplore, WhereKeptLossesGrow) {
  if (!MemoryMeter::installed()) GTEST_SKIP();
  for (Event e : {Event::AfterLoss, Event::AfterBackward, Event::AfterBatch}) {
    for (bool skip : {false, true}) {
      for (bool plugin : {false, true}) {
        auto l = make_tiny_learner(leak_setup());
        auto keeper = std::make_shared<LossKeeper>(e);
        l->add_callback(keeper);
        if (skip) l->add_callback(std::make_shared<SkipEveryOther>());
        std::ostringstream log;
        if (plugin) l->add_callback(make_plugin(log));
        l->fit(1);
        std::cout << "[explore] keep at " << to_string(e) << " skip " << skip << " plugin "
                  << plugin << ": growth " << keeper->growth() << " B/batch\n";
      }
    }
  }
}

}  // namespace
}  // namespace frugal::test
