// The metrics history: rows every log_every batches and per epoch, to metrics.csv,
// metrics.jsonl and TensorBoard event files, kept consistent across a resume; its plots.
#include "frugal/callbacks/metrics_log.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "frugal/base/error.h"
#include "frugal/callbacks/schedule.h"
#include "frugal/core/learner.h"
#include "frugal/io/file_writer.h"

extern char** environ;

namespace frugal {

namespace fs = std::filesystem;

namespace {

const char* const kCsv = "metrics.csv";
const char* const kJsonl = "metrics.jsonl";

std::string csv_quote(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string csv_number(double v) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  std::ostringstream os;
  os << std::setprecision(9) << v;
  return os.str();
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// The lines of `path` that end in a newline (a killed writer's partial line is dropped).
std::vector<std::string> complete_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<std::string> out;
  for (size_t b = 0, e; (e = text.find('\n', b)) != std::string::npos; b = e + 1)
    out.push_back(text.substr(b, e - b));
  return out;
}

/// Whether a row (kind, stage index, its 1-based epoch, iteration) was written before `p`: a
/// resumed fit writes the rest again. The rows count epochs from 1, the position from 0.
bool before_position(const std::string& kind, int64_t stage, int64_t epoch, int64_t iteration,
                     const FitPosition& p) {
  if (p.done) return true;
  if (kind == "step") return iteration <= p.iteration;
  return stage < p.stage || (stage == p.stage && epoch - 1 < p.epoch);
}

/// Rewrites metrics.csv and metrics.jsonl with the rows before `p`, atomically.
void keep_rows_before(const std::string& dir, const FitPosition& p) {
  const std::string csv = (fs::path(dir) / kCsv).string(), jsonl = (fs::path(dir) / kJsonl).string();
  std::string kept_csv = metrics_csv_header(), kept_json;
  const auto csv_lines = complete_lines(csv);
  for (size_t i = 1; i < csv_lines.size(); ++i) {  // kind,stage_index,epoch,batch,iteration,...
    std::stringstream ss(csv_lines[i]);
    std::string f[5];
    for (auto& x : f) std::getline(ss, x, ',');
    try {
      if (before_position(f[0], std::stoll(f[1]), std::stoll(f[2]), std::stoll(f[4]), p))
        kept_csv += csv_lines[i] + "\n";
    } catch (const std::exception&) {  // a damaged line: dropped
    }
  }
  for (const auto& line : complete_lines(jsonl)) {
    try {
      const auto j = nlohmann::json::parse(line);
      if (before_position(j.at("kind"), j.at("stage_index"), j.at("epoch"), j.at("iteration"), p))
        kept_json += line + "\n";
    } catch (const std::exception&) {
    }
  }
  write_file_atomic(csv, kept_csv);
  write_file_atomic(jsonl, kept_json);
}

}  // namespace

std::string metrics_csv_header() {
  return "kind,stage_index,epoch,batch,iteration,step,stage,loss,lr,samples_per_second,"
         "step_seconds,live_bytes,peak_bytes,valid_loss,valid_metric\n";
}

std::string metrics_csv_line(const MetricsRow& r) {
  std::ostringstream os;
  os << r.kind << ',' << r.stage_index << ',' << r.epoch << ',' << r.batch << ',' << r.iteration
     << ',' << r.step << ',' << csv_quote(r.stage) << ',' << (r.loss ? csv_number(*r.loss) : "")
     << ',' << csv_number(r.lr)
     << ',' << csv_number(r.samples_per_second) << ',' << csv_number(r.step_seconds) << ','
     << r.live_bytes << ',' << r.peak_bytes << ','
     << (r.valid_loss ? csv_number(*r.valid_loss) : "") << ','
     << (r.valid_metric ? csv_number(*r.valid_metric) : "") << '\n';
  return os.str();
}

std::string metrics_json_line(const MetricsRow& r) {
  nlohmann::json j = {{"kind", r.kind},         {"stage", r.stage},
                      {"stage_index", r.stage_index}, {"epoch", r.epoch},
                      {"batch", r.batch},       {"iteration", r.iteration},
                      {"step", r.step},
                      {"loss", r.loss ? nlohmann::json(*r.loss) : nlohmann::json(nullptr)},
                      {"lr", r.lr},             {"samples_per_second", r.samples_per_second},
                      {"step_seconds", r.step_seconds}, {"live_bytes", r.live_bytes},
                      {"peak_bytes", r.peak_bytes},     {"time", r.wall_time}};
  if (r.valid_loss) j["valid_loss"] = *r.valid_loss;
  if (r.valid_metric) {
    j["valid_metric"] = *r.valid_metric;
    j["valid_metric_name"] = r.valid_metric_name;
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::vector<Scalar> metrics_scalars(const MetricsRow& r) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const std::string prefix = r.kind == "epoch" ? "epoch/" : "train/";
  std::vector<Scalar> s = {{prefix + "lr", static_cast<float>(r.lr)},
                           {prefix + "samples_per_second", static_cast<float>(r.samples_per_second)},
                           {prefix + "step_seconds", static_cast<float>(r.step_seconds)},
                           {"memory/live_MiB", static_cast<float>(r.live_bytes / kMiB)},
                           {"memory/peak_MiB", static_cast<float>(r.peak_bytes / kMiB)}};
  if (r.loss) s.insert(s.begin(), Scalar{prefix + "loss", static_cast<float>(*r.loss)});
  if (r.valid_loss) s.emplace_back("valid/loss", static_cast<float>(*r.valid_loss));
  if (r.valid_metric && r.valid_metric_name != "valid_loss")
    s.emplace_back("valid/" + r.valid_metric_name, static_cast<float>(*r.valid_metric));
  return s;
}

MetricsHistory::MetricsHistory(MetricsHistoryOptions o) : o_(std::move(o)) {
  o_.log_every = std::max<int64_t>(1, o_.log_every);
}

MetricsHistory::~MetricsHistory() = default;

void MetricsHistory::open_files(Learner& l) {
  const std::optional<FitPosition> resumed = l.pending_resume();
  fs::create_directories(o_.dir);
  if (o_.tables) {
    const std::string csv = (fs::path(o_.dir) / kCsv).string();
    if (resumed && fs::exists(csv)) keep_rows_before(o_.dir, *resumed);
    const bool fresh = !resumed || !fs::exists(csv);
    csv_ = std::make_unique<AppendFile>(csv, fresh);
    if (fresh) csv_->write(metrics_csv_header());
    jsonl_ = std::make_unique<AppendFile>((fs::path(o_.dir) / kJsonl).string(), fresh);
  }
  if (o_.tensorboard) open_events(resumed);
}

void MetricsHistory::open_events(const std::optional<FitPosition>& resumed) {
  const fs::path tb = fs::path(o_.dir) / "tensorboard";
  if (!resumed && fs::exists(tb))  // a fresh fit's curves must not mix with an old run's
    for (const auto& e : fs::directory_iterator(tb))
      if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(e.path());
  events_ = std::make_unique<EventFileWriter>(tb.string());
  // SessionLog START at the fit's first step (rows are at 1-based iterations): TensorBoard drops
  // the events of earlier files at steps >= a START's. The rows kept above go up to the resumed
  // position itself, so the purge starts one past it.
  const int64_t first = (resumed ? resumed->iteration : 0) + 1;
  events_->write(session_start_event(
      now_seconds(), first,
      resumed ? "fit resumed after iteration " + std::to_string(resumed->iteration) : "fit started"));
}

void MetricsHistory::before_fit(Learner& l) {
  open_files(l);
  peak_ = l.memory().open_window();
  since_row_ = since_epoch_ = Window{};
}

void MetricsHistory::before_stage(Learner& l) {
  stage_samples_seen_ = l.stage_stats().empty() ? 0 : l.stage_stats().back().samples;
}

void MetricsHistory::before_epoch(Learner&) {
  since_epoch_ = Window{};
  validated_ = false;
}

void MetricsHistory::after_validate(Learner&) { validated_ = true; }

void MetricsHistory::after_batch(Learner& l) {
  const StageStats& st = l.stage_stats().back();
  const int64_t samples = st.samples - stage_samples_seen_;
  stage_samples_seen_ = st.samples;
  const double seconds = st.step_seconds.empty() ? 0.0 : st.step_seconds.back();
  for (Window* w : {&since_row_, &since_epoch_}) {
    w->samples += samples;
    w->seconds += seconds;
    ++w->batches;
    if (!l.batch_skipped() && l.loss().defined()) {
      add_loss(*w, l.loss());
      ++w->losses;
    }
  }
  if ((l.iteration() + 1) % o_.log_every != 0) return;
  emit(row(l, "step", since_row_));
  since_row_ = Window{};
}

void MetricsHistory::after_epoch(Learner& l) {
  emit(row(l, "epoch", since_epoch_));
  // The next step row covers the batches after this epoch's row. Emptied here, not only in
  // before_epoch: a checkpoint taken after this epoch saves no sums of it.
  since_row_ = since_epoch_ = Window{};
}

void MetricsHistory::after_fit(Learner&) {
  peak_.close();
  csv_.reset();
  jsonl_.reset();
  events_.reset();
  if (!o_.plots || !o_.tables) return;
  std::string why;
  if (!draw_metrics_plots(o_.dir, why)) spdlog::warn("no metrics plots: {}", why);
}

// On the CPU the loss is read at once: no tensor is made (the steady-state breakdown and the
// peaks see none of the history's bytes). On a GPU it is summed there: no sync per batch.
void MetricsHistory::add_loss(Window& w, const torch::Tensor& loss) {
  if (loss.device().is_cpu()) {
    w.cpu_loss_sum += loss.item<double>();
    return;
  }
  const torch::Tensor v = loss.detach().to(torch::kDouble);
  w.loss_sum = w.loss_sum.defined() ? w.loss_sum + v : v;
}

// The window's mean loss; none when no batch of it had one (each step skipped for a non-finite
// loss, which the check drops): an empty cell, not a 0 that reads as a perfect fit.
std::optional<double> MetricsHistory::mean_loss(const Window& w) {
  if (w.losses == 0) return std::nullopt;
  const double on_device = w.loss_sum.defined() ? w.loss_sum.item<double>() : 0.0;
  return (w.cpu_loss_sum + on_device) / static_cast<double>(w.losses);
}

MetricsRow MetricsHistory::row(Learner& l, const std::string& kind, const Window& w) {
  MetricsRow r;
  r.kind = kind;
  r.stage = l.stage().name;
  r.stage_index = l.stage_index();
  r.epoch = l.epoch() + 1;  // 1-based, as the log and the report
  const bool epoch_row = kind == "epoch";
  r.iteration = epoch_row ? l.iteration() : l.iteration() + 1;  // the loop counts after after_batch
  r.batch = epoch_row ? l.num_batches() : l.batch_index() + 1;
  r.step = l.steps();
  if (w.losses > 0) r.loss = epoch_row ? l.epoch_loss() : *mean_loss(w);
  r.lr = learning_rate(l.optimizer());
  r.samples_per_second = w.seconds > 0 ? static_cast<double>(w.samples) / w.seconds : 0.0;
  r.step_seconds = w.batches ? w.seconds / static_cast<double>(w.batches) : 0.0;
  r.live_bytes = l.memory().current();
  r.peak_bytes = peak_.is_open() ? peak_.peak() : 0;
  if (peak_.is_open()) peak_.reset();
  if (epoch_row && validated_ && l.valid_sums().count > 0) {
    const TaskMetric m = l.valid_metric();
    r.valid_loss = l.valid_sums().mean_loss();
    r.valid_metric = m.value;
    r.valid_metric_name = m.name;
  }
  r.wall_time = now_seconds();
  return r;
}

// Each sum as a double or an int64: a GPU's loss sum is read once, at the checkpoint.
void MetricsHistory::save_window(torch::serialize::OutputArchive& a, const std::string& prefix,
                                 const Window& w) {
  const double on_device = w.loss_sum.defined() ? w.loss_sum.item<double>() : 0.0;
  a.write(prefix + "loss_sum", c10::IValue(w.cpu_loss_sum + on_device));
  a.write(prefix + "losses", c10::IValue(w.losses));
  a.write(prefix + "samples", c10::IValue(w.samples));
  a.write(prefix + "batches", c10::IValue(w.batches));
  a.write(prefix + "seconds", c10::IValue(w.seconds));
}

MetricsHistory::Window MetricsHistory::load_window(torch::serialize::InputArchive& a,
                                                   const std::string& prefix) {
  Window w;
  c10::IValue v;
  if (a.try_read(prefix + "loss_sum", v) && v.isDouble()) w.cpu_loss_sum = v.toDouble();
  if (a.try_read(prefix + "losses", v) && v.isInt()) w.losses = v.toInt();
  if (a.try_read(prefix + "samples", v) && v.isInt()) w.samples = v.toInt();
  if (a.try_read(prefix + "batches", v) && v.isInt()) w.batches = v.toInt();
  if (a.try_read(prefix + "seconds", v) && v.isDouble()) w.seconds = v.toDouble();
  return w;
}

// A checkpoint between the rows of a window holds its sums: the row written after a resume
// averages the batches before the checkpoint too, as the uninterrupted run's does. Nothing when
// both windows are empty (a checkpoint after an epoch): the Learner refuses a checkpoint holding
// the state of a callback the resuming run lacks, and a resume may turn the history off.
void MetricsHistory::save_state(torch::serialize::OutputArchive& a) const {
  if (since_row_.batches == 0 && since_epoch_.batches == 0) return;
  // Rank 0 alone keeps the history, and a resumed run may turn it off: the others skip it.
  a.write(kOptionalState, c10::IValue(true));
  save_window(a, "row.", since_row_);
  save_window(a, "epoch.", since_epoch_);
}

// After the resumed position's before_* events, which emptied both windows.
void MetricsHistory::load_state(Learner&, torch::serialize::InputArchive& a) {
  since_row_ = load_window(a, "row.");
  since_epoch_ = load_window(a, "epoch.");
}

void MetricsHistory::emit(const MetricsRow& r) {
  if (csv_) csv_->write(metrics_csv_line(r));
  if (jsonl_) jsonl_->write(metrics_json_line(r));
  if (events_) events_->write(scalars_event(r.wall_time, r.iteration, metrics_scalars(r)));
}

// ---------------------------------------------------------------- plots

namespace {

/// Which series metrics.csv has: step rows, epoch rows, a validation metric.
struct CsvSeries {
  bool step = false, epoch = false, valid = false;
};

CsvSeries csv_series(const std::string& path) {
  CsvSeries s;
  const auto lines = complete_lines(path);
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].rfind("step,", 0) == 0) s.step = true;
    if (lines[i].rfind("epoch,", 0) == 0) s.epoch = true;
    if (!lines[i].empty() && lines[i].back() != ',') s.valid = true;  // valid_metric is last
  }
  return s;
}

// Columns of metrics.csv (1-based, as gnuplot counts): iteration 5, loss 8, lr 9, live 12,
// peak 13, valid_loss 14, valid_metric 15.
std::string plots_script(const CsvSeries& s) {
  const std::string step = "(strcol(1) eq 'step' ? $8 : NaN)", epoch = "(strcol(1) eq 'epoch' ? $8 : NaN)";
  std::string loss;
  if (s.step) loss += "'metrics.csv' skip 1 using 5:" + step + " with lines lc rgb '#4477aa' title 'every log_every batches'";
  if (s.epoch) loss += std::string(loss.empty() ? "" : ", ") + "'metrics.csv' skip 1 using 5:" + epoch +
                       " with linespoints pt 7 lc rgb '#cc6677' title 'epoch mean'";
  std::ostringstream gp;
  gp << "# gnuplot metrics.gp (run in this folder) draws metrics.svg and metrics.png from metrics.csv\n"
     << "set datafile separator ','\n"
     << "png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'\n"
     << "do for [k = 1:2] {\n"
     << "  if (k == 1) { set terminal svg size 1000,700 dynamic font 'sans,11'; set output 'metrics.svg' }\n"
     << "  if (k == 2) { eval(sprintf('set terminal %s size 1000,700', png_term)); set output 'metrics.png' }\n"
     << "  set multiplot layout 2,2\n  set grid\n  set xlabel 'training batch'\n  set key top right noenhanced\n"
     << "  set title 'training loss'\n  plot " << (loss.empty() ? "0 notitle" : loss) << "\n"
     << "  set title 'learning rate'\n  set format y '%g'\n"
     << "  plot 'metrics.csv' skip 1 using 5:9 with lines lc rgb '#228833' notitle\n"
     << "  set title 'validation'\n"
     << "  plot " << (s.valid ? "'metrics.csv' skip 1 using 5:15 with linespoints pt 7 lc rgb '#aa3377' title 'metric', "
                               "'metrics.csv' skip 1 using 5:14 with linespoints pt 5 lc rgb '#666666' title 'loss'"
                             : "0 notitle") << "\n"
     << "  set title 'memory (MiB)'\n"
     << "  plot 'metrics.csv' skip 1 using 5:($13/1048576) with lines lc rgb '#cc6677' title 'peak since the previous row', "
        "'metrics.csv' skip 1 using 5:($12/1048576) with lines lc rgb '#4477aa' title 'live'\n"
     << "  unset multiplot\n}\n";
  return gp.str();
}

}  // namespace

bool run_gnuplot(const std::string& dir, const std::string& script, std::string& why) {
  const std::string abs = fs::absolute(dir).string();
  const std::string log = (fs::path(abs) / (script + ".log")).string();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addchdir_np(&fa, abs.c_str());
  std::string exe = "gnuplot", arg = script;
  char* argv[] = {exe.data(), arg.data(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "gnuplot", &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    why = "gnuplot not found (install gnuplot-nox); " + script + " is in " + dir;
    return false;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) break;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  why = "gnuplot " + script + " failed; see " + log;
  return false;
}

bool draw_metrics_plots(const std::string& dir, std::string& why) {
  const CsvSeries s = csv_series((fs::path(dir) / kCsv).string());
  write_file_atomic((fs::path(dir) / "metrics.gp").string(), plots_script(s));
  return run_gnuplot(dir, "metrics.gp", why);
}

}  // namespace frugal
