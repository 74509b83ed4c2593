// `frugal lr_find`: fastai's learning-rate finder (Learner.lr_find): the learning rate grows
// exponentially batch by batch while the smoothed training loss is recorded; the sweep stops
// when the loss diverges. The suggestion is fastai's default, `valley`.
#include "lr_find.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "frugal/app/plugin_host.h"
#include "frugal/app/run.h"
#include "frugal/base/error.h"
#include "frugal/callbacks/metrics_log.h"
#include "frugal/callbacks/schedule.h"
#include "frugal/core/learner.h"
#include "frugal/io/file_writer.h"

namespace frugal::cli {

namespace fs = std::filesystem;

namespace {

/// Sets lr_i = start * (end / start)^(i / (n - 1)) before each batch and records the smoothed
/// loss after it (fastai's exponentially weighted average, beta 0.98, debiased).
class LrFinder : public Callback {
 public:
  LrFinder(double start, double end, int64_t n) : start_(start), end_(end), n_(n) {}
  std::string name() const override { return "lr_find"; }
  int order() const override { return order::kSchedule; }
  void before_batch(Learner& l) override {
    const double p = n_ > 1 ? static_cast<double>(i_) / static_cast<double>(n_ - 1) : 0.0;
    lr_ = start_ * std::pow(end_ / start_, p);
    set_learning_rate(l.optimizer(), lr_);
  }
  // A non-finite loss ends the sweep here, before the non-finite check (a higher order) skips
  // the step and drops the loss.
  void before_step(Learner& l) override {
    if (l.loss().defined() && !std::isfinite(l.loss().item<double>())) {
      diverged = true;
      l.stop_fit();
    }
  }
  void after_batch(Learner& l) override {
    if (!l.loss().defined()) return;
    const double loss = l.loss().item<double>();
    avg_ = 0.98 * avg_ + 0.02 * loss;
    const double smooth = avg_ / (1.0 - std::pow(0.98, static_cast<double>(i_ + 1)));
    lrs.push_back(lr_);
    losses.push_back(smooth);
    best_ = i_ == 0 ? smooth : std::min(best_, smooth);
    ++i_;
    if (i_ >= n_) {
      l.stop_fit();
    } else if (!std::isfinite(smooth) || smooth > 4.0 * best_) {
      diverged = true;
      l.stop_fit();
    }
  }
  std::vector<double> lrs, losses;
  bool diverged = false;

 private:
  double start_, end_;
  int64_t n_, i_ = 0;
  double lr_ = 0, avg_ = 0, best_ = 0;
};

std::string sweep_csv(const std::vector<double>& lrs, const std::vector<double>& losses) {
  std::ostringstream os;
  os << "lr,loss\n" << std::setprecision(9);
  for (size_t i = 0; i < lrs.size(); ++i) os << lrs[i] << ',' << losses[i] << '\n';
  return os.str();
}

std::string sweep_script(double suggestion) {
  std::ostringstream gp;
  gp << "# gnuplot lr_find.gp (run in this folder) draws lr_find.svg and lr_find.png\n"
     << "set datafile separator ','\n"
     << "png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'\n"
     << "do for [k = 1:2] {\n"
     << "  if (k == 1) { set terminal svg size 900,520 dynamic font 'sans,11'; set output 'lr_find.svg' }\n"
     << "  if (k == 2) { eval(sprintf('set terminal %s size 900,520', png_term)); set output 'lr_find.png' }\n"
     << "  set title 'learning-rate finder: smoothed training loss'\n  set logscale x\n  set grid\n"
     << "  set xlabel 'learning rate'\n  set ylabel 'loss'\n  set format x '%.0e'\n"
     << "  set arrow 1 from " << suggestion << ", graph 0 to " << suggestion
     << ", graph 1 nohead lc rgb '#cc6677' dt 2\n"
     << "  plot 'lr_find.csv' skip 1 using 1:2 with lines lw 2 lc rgb '#4477aa' title 'loss', "
        "NaN with lines lc rgb '#cc6677' dt 2 title sprintf('valley %.2e', " << suggestion << ")\n"
     << "}\n";
  return gp.str();
}

// fastai's valley over fastai's points; over the whole sweep when it ended before there were
// any (fastai fails there), said so.
size_t suggestion_index(const std::vector<double>& losses, int64_t num_it, spdlog::logger& log) {
  if (auto i = suggested_index(losses, num_it)) return *i;
  log.warn("lr_find: {} points, too few for fastai's (from point {} to the 6th from the end): "
           "the valley is taken over all of them; a larger --num-it or a lower --end-lr gives more",
           losses.size(), num_it / 10 + 1);
  return valley_index(losses);
}

}  // namespace

CLI::App* add_lr_find_command(CLI::App& app, LrFindArgs& a) {
  auto* cmd = app.add_subcommand("lr_find", "fastai's learning-rate finder: loss against an "
                                            "exponentially growing lr, and a suggestion");
  cmd->add_option("config", a.config, "the run's TOML file")->required();
  cmd->add_option("--set", a.sets, "override a key, e.g. --set data.batch_size=64 (repeatable)");
  cmd->add_option("--start-lr", a.start_lr, "the sweep's first learning rate")->check(CLI::PositiveNumber);
  cmd->add_option("--end-lr", a.end_lr, "the sweep's last learning rate")->check(CLI::PositiveNumber);
  cmd->add_option("--num-it", a.num_it, "batches in the sweep")->check(CLI::Range(int64_t{2}, int64_t{100000}));
  cmd->add_option("--out", a.out, "folder for lr_find.csv and its plot; default <run.out_dir>/lr_find");
  return cmd;
}

int run_lr_find(const LrFindArgs& a, spdlog::logger& log) {
  if (a.end_lr <= a.start_lr)
    throw ConfigError("lr_find: --end-lr (" + std::to_string(a.end_lr) + ") must be above --start-lr (" +
                      std::to_string(a.start_lr) + ")");
  ConfigWithPlugins loaded = load_config_with_plugins(a.config, a.sets);
  Config& c = loaded.config;
  const std::string out = a.out.empty() ? (fs::path(c.run.out_dir) / "lr_find").string() : a.out;
  // The sweep is not a run: nothing of a run's own output is written.
  c.run.metrics = c.run.tensorboard = c.run.plots = false;
  c.run.checkpoint_every = c.run.checkpoint_epochs = 0;
  c.run.max_steps = 0;
  // A sweep diverges on purpose: its end is the finder's to see, not a failure; it keeps no
  // model and validates nothing.
  c.run.on_nonfinite = "skip";
  c.run.save_best = c.run.early_stopping = "off";
  c.run.out_dir = out;
  ensure_writable_dir(out);
  auto learner = make_learner(c);
  for (auto& cb : loaded.callbacks) learner->add_callback(cb);
  learner->remove_callback("schedule");      // the finder sets the lr itself
  learner->remove_callback("model_export");  // its weights are the sweep's: not a model to keep
  auto finder = std::make_shared<LrFinder>(a.start_lr, a.end_lr, a.num_it);
  learner->add_callback(finder);
  Stage sweep = c.stages.front();
  sweep.schedule = ScheduleOptions{};
  sweep.epochs = (a.num_it + learner->train_data().num_batches() - 1) / learner->train_data().num_batches();
  learner->fit(std::vector<Stage>{sweep});
  if (finder->lrs.empty()) throw Error("lr_find: no batch ran; the data has no training batch");
  const double suggestion = finder->lrs[suggestion_index(finder->losses, a.num_it, log)];
  write_file_atomic((fs::path(out) / "lr_find.csv").string(), sweep_csv(finder->lrs, finder->losses));
  write_file_atomic((fs::path(out) / "lr_find.gp").string(), sweep_script(suggestion));
  std::string why;
  if (!run_gnuplot(out, "lr_find.gp", why)) log.warn("no lr_find plot: {}", why);
  log.info("lr_find: {} batches from {:.1e} to {:.2e}{}; the loss against lr is in {}/lr_find.csv",
           finder->lrs.size(), finder->lrs.front(), finder->lrs.back(),
           finder->diverged ? " (stopped: the loss diverged)" : "", out);
  std::cout << "suggested lr (valley): " << std::setprecision(3) << suggestion << "\n";
  return 0;
}

}  // namespace frugal::cli
