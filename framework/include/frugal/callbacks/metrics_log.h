#pragma once
/// The run's metrics history (Lightning's CSVLogger, the Hugging Face Trainer's log_history):
/// a row every `log_every` training batches and one per epoch, in <out_dir>/metrics.csv and
/// metrics.jsonl, the same scalars in TensorBoard event files (<out_dir>/tensorboard/), and
/// gnuplot plots of them (<out_dir>/metrics.svg, .png) when the fit ends.
///
/// A row: kind (step | epoch), stage, stage_index, epoch (within the stage, 1-based: 1 is the
/// first, as the log and the report count), batch (within the epoch, 1-based), iteration
/// (training batches done in the fit), step (optimizer steps), loss (mean training loss of the
/// batches since the previous row; of the epoch for an epoch row; empty in metrics.csv, null in
/// metrics.jsonl and left out of TensorBoard when no batch of it had a loss: every step skipped
/// for a non-finite one), lr (the optimizer's first group's), samples/s
/// and mean step_seconds since the previous row, live_bytes now, peak_bytes (the highest live
/// bytes since the previous row), and on epoch rows with validation valid_loss and
/// valid_metric (the task's headline number, named in metrics.jsonl's "valid_metric_name").
/// Only the columns' values, never their set, change between rows.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "frugal/callbacks/tensorboard.h"
#include "frugal/core/callback.h"
#include "frugal/memory/fit_stats.h"
#include "frugal/memory/memory.h"

namespace frugal {

/// One row of the history.
struct MetricsRow {
  std::string kind;  ///< "step" | "epoch"
  std::string stage;
  int64_t stage_index = 0;
  int64_t epoch = 1;  ///< within the stage, 1-based (Learner::epoch() + 1)
  int64_t batch = 0, iteration = 0, step = 0;
  std::optional<double> loss;  ///< none when no batch of the row had a loss
  double lr = 0, samples_per_second = 0, step_seconds = 0;
  int64_t live_bytes = 0, peak_bytes = 0;
  std::optional<double> valid_loss, valid_metric;
  std::string valid_metric_name;
  double wall_time = 0;  ///< seconds since the epoch (1970), for TensorBoard
};

/// The CSV header of metrics.csv, and one row in that shape.
std::string metrics_csv_header();
std::string metrics_csv_line(const MetricsRow& r);
/// One line of metrics.jsonl.
std::string metrics_json_line(const MetricsRow& r);
/// The TensorBoard scalars of a row ("train/loss", "memory/live_MiB", "valid/accuracy", ...).
std::vector<Scalar> metrics_scalars(const MetricsRow& r);

/// What the history writes; each can be off.
struct MetricsHistoryOptions {
  std::string dir;          ///< the run folder
  int64_t log_every = 100;  ///< training batches between step rows
  bool tables = true;       ///< metrics.csv and metrics.jsonl
  bool tensorboard = true;  ///< tensorboard/events.out.tfevents.*
  bool plots = true;        ///< metrics.gp, drawn to metrics.svg and metrics.png by gnuplot
};

/// The in-tree callback that writes the history. A fresh fit starts the files over; a resumed
/// fit keeps the rows before its position and appends (rows a killed run wrote after its last
/// checkpoint go). Every fit starts a new event file with a SessionLog START at its first step,
/// which makes TensorBoard drop the old files' events from that step on. The sums of the rows
/// under way travel with checkpoints, so a row that spans a resume averages all its batches.
class MetricsHistory : public Callback {
 public:
  explicit MetricsHistory(MetricsHistoryOptions o);
  ~MetricsHistory() override;
  std::string name() const override { return "metrics_history"; }
  int order() const override { return order::kMetricsHistory; }
  void before_fit(Learner& l) override;
  void before_stage(Learner& l) override;
  void before_epoch(Learner& l) override;
  void after_batch(Learner& l) override;
  void after_validate(Learner& l) override;
  void after_epoch(Learner& l) override;
  void after_fit(Learner& l) override;

  /// The sums of the step row and the epoch row under way (absent in older checkpoints: they
  /// start from zero); nothing when both are empty (after an epoch). Marked kOptionalState:
  /// the other ranks of a data-parallel run have no history, nor has a run resumed with
  /// run.metrics and run.tensorboard off.
  void save_state(torch::serialize::OutputArchive& a) const override;
  void load_state(Learner&, torch::serialize::InputArchive& a) override;

 private:
  struct Window {  // sums since the previous row
    torch::Tensor loss_sum;  // on a GPU
    double cpu_loss_sum = 0;
    int64_t losses = 0, samples = 0, batches = 0;
    double seconds = 0;
  };
  static void add_loss(Window& w, const torch::Tensor& loss);
  static std::optional<double> mean_loss(const Window& w);
  static void save_window(torch::serialize::OutputArchive& a, const std::string& prefix, const Window& w);
  static Window load_window(torch::serialize::InputArchive& a, const std::string& prefix);
  MetricsRow row(Learner& l, const std::string& kind, const Window& w);
  void emit(const MetricsRow& r);
  void open_files(Learner& l);
  void open_events(const std::optional<FitPosition>& resumed);

  MetricsHistoryOptions o_;
  std::unique_ptr<AppendFile> csv_, jsonl_;
  std::unique_ptr<EventFileWriter> events_;
  MemoryWindow peak_;
  Window since_row_, since_epoch_;
  int64_t stage_samples_seen_ = 0;  // StageStats::samples at the last batch
  bool validated_ = false;          // this epoch ran validation
};

/// Runs gnuplot on `script`, a file in `dir`, with `dir` as its working folder; its output goes
/// to <dir>/<script>.log. False, with the reason in `why`, when gnuplot is absent or fails.
bool run_gnuplot(const std::string& dir, const std::string& script, std::string& why);

/// Writes <dir>/metrics.gp (loss, learning rate, validation metric and memory from
/// metrics.csv) and runs gnuplot on it, drawing metrics.svg and metrics.png. False, with the
/// reason in `why`, when gnuplot is absent or fails (its output: <dir>/metrics.gp.log).
bool draw_metrics_plots(const std::string& dir, std::string& why);

}  // namespace frugal
