// The Learner's save/load and checkpoint/resume: what to write and where a resumed fit picks
// up. The file format itself is archive.h's.
#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "core/guard.h"
#include "core/pending_resume.h"
#include "frugal/base/error.h"
#include "frugal/core/learner.h"
#include "frugal/optim/reshard.h"
#include "io/archive.h"

namespace frugal {

namespace {

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string list(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& n : v) out += (out.empty() ? "" : ", ") + n;
  return "[" + out + "]";
}

// Every rank's `own` bytes on rank 0 ({} elsewhere). A collective: the bytes travel padded to
// the longest, behind their length; only rank 0 holds them all.
std::vector<std::vector<char>> gather_bytes(Collective& world, const std::vector<char>& own) {
  const auto n = static_cast<int64_t>(own.size());
  const int64_t longest = world.max(n);
  torch::Tensor t = torch::zeros({longest + 8}, torch::kByte);
  std::memcpy(t.data_ptr(), &n, 8);
  if (n) std::memcpy(static_cast<char*>(t.data_ptr()) + 8, own.data(), own.size());
  const auto all = world.gather(t.to(world.device()));
  std::vector<std::vector<char>> out;
  for (const auto& g : all) {
    const torch::Tensor c = g.cpu().contiguous();
    const char* p = static_cast<const char*>(c.data_ptr());
    int64_t len = 0;
    std::memcpy(&len, p, 8);
    out.emplace_back(p + 8, p + 8 + len);
  }
  return out;
}

// The world size a checkpoint's run had (1 for one process and for files older than the key).
int64_t saved_world_size(const nlohmann::json& info) {
  return info.is_object() ? info.value("world_size", int64_t{1}) : int64_t{1};
}

// The saved generator a rank restores: its own, or rank 0's for a rank the writing run lacked.
int rng_rank(int rank, int64_t saved_world) { return rank < saved_world ? rank : 0; }

bool saved_per_rank(const nlohmann::json& info) {
  return info.is_object() && info.value("optimizer_per_rank", false);
}

}  // namespace

// ---------------------------------------------------------------- save and load

void Learner::save(const std::string& path, bool with_opt) {
  live();
  archive::OutputArchive a;
  archive::write_header(a);
  archive::write_model(a, *model_);
  if (with_opt) archive::write_optimizer(a, *optimizer_, optimizer_options_.name);
  archive::write_file(a, path);
}

void Learner::load(const std::string& path, bool with_opt) {
  live();
  archive::InputArchive a;
  archive::open(path, device_, a);
  archive::load_model(*model_, a, path);
  if (with_opt)
    archive::load_optimizer(*optimizer_, optimizer_options_.name, a, path,
                            "; load it with with_opt = false");
}

// ---------------------------------------------------------------- checkpoint

FitPosition Learner::position() const {
  FitPosition p = next_;
  if (training_) {
    // A batch that failed after its optimizer step counts as done: replaying it would step
    // twice.
    if (steps_ > p.steps) {
      p.batch = batch_index_ + 1;
      p.iteration = iteration_ + 1;
      p.steps = steps_;
    }
    p.stop_epoch = stop_epoch_;
    p.stop_fit = stop_fit_;
  } else if (stop_fit_) {
    p.done = true;  // between epochs or stages: nothing of a stopped fit is left
  }
  return p;
}

void Learner::save_checkpoint(const std::string& path, const nlohmann::json& info) {
  live();
  const FullParameters full(*this);  // every rank: a collective when sharded
  archive::ResumeRecord r;
  r.position = position();
  for (const auto& s : stages_) {
    r.stages.push_back(s.name);
    r.stage_epochs.push_back(s.epochs);
  }
  for (const auto& c : callbacks_) r.callbacks.push_back(c->name());
  r.optimizer = optimizer_options_.name;
  // The running loss belongs to the position's epoch only while it trains; between epochs it
  // is the finished epoch's.
  r.loss_count = training_ ? loss_count_ : 0;
  r.valid_accuracy = valid_accuracy();
  r.valid_sums = valid_sums_;
  r.stats = stats_.stages();
  // Mid-epoch: the epoch's batches so far are in the stage's samples; their time goes with
  // them (the resumed epoch adds only its own), so samples/s stays right across a resume.
  const auto stage = static_cast<size_t>(stage_index_);
  if (training_ && stage < r.stats.size())
    r.stats[stage].train_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - train_started_).count();
  r.info = info;
  Collective& world = collective();
  const RngState rng = RngState::capture(device_);
  std::vector<torch::Tensor> rank_rngs;  // data parallel: every rank's CPU generator
  if (world.distributed()) {
    if (!r.info.is_object()) r.info = nlohmann::json::object();
    r.info["world_size"] = world.size();
    rank_rngs = world.all_gather(rng.cpu.to(world.device()));
  }
  const std::vector<std::vector<char>> rank_optimizers = record_optimizers(world, r);
  if (!world.is_main()) {  // rank 0 writes; the others learn whether it did
    if (world.any(false)) throw CheckpointError("rank 0 could not write checkpoint '" + path + "'");
    return;
  }
  try {
    write_checkpoint_file(path, r, rng, rank_rngs, rank_optimizers);
  } catch (...) {
    world.any(true);
    throw;
  }
  world.any(false);  // after the rename: every rank knows the file is there
}

// Which model parameter each saved optimizer's state belongs to (per rank when sharded), in
// r.optimizer_layout: a resume cut another way (another world size, zero on or off) moves each
// state where its parameter lives then (frugal/optim/reshard.h). None when an optimizer holds a
// tensor that is not the model's (such a file resumes only as it was written). A collective with
// a sharded optimizer: returns every rank's optimizer bytes on rank 0.
std::vector<std::vector<char>> Learner::record_optimizers(Collective& world, archive::ResumeRecord& r) {
  nlohmann::json layout;
  try {
    layout = optimizer_layout(*optimizer_, model_->parameters());
  } catch (const Error&) {
  }
  r.optimizer_layout = layout.is_null() ? layout : nlohmann::json::array({layout});
  if (!world.distributed() || !per_rank_optimizer_) return {};
  r.info["optimizer_per_rank"] = true;
  auto rank_optimizers = gather_bytes(world, archive::optimizer_bytes(*optimizer_, optimizer_options_.name));
  const std::string own = layout.dump();
  r.optimizer_layout = nlohmann::json::array();
  for (const auto& bytes : gather_bytes(world, std::vector<char>(own.begin(), own.end())))
    r.optimizer_layout.push_back(nlohmann::json::parse(bytes.begin(), bytes.end()));
  const nlohmann::json& all = r.optimizer_layout;
  if (std::any_of(all.begin(), all.end(), [](const nlohmann::json& l) { return l.is_null(); }))
    r.optimizer_layout = nullptr;
  return rank_optimizers;
}

void Learner::write_checkpoint_file(const std::string& path, const archive::ResumeRecord& r,
                                    const RngState& rng,
                                    const std::vector<torch::Tensor>& rank_rngs,
                                    const std::vector<std::vector<char>>& rank_optimizers) {
  archive::OutputArchive a;
  archive::write_header(a);
  archive::write_resume(a, r);
  archive::write_model(a, *model_);
  archive::write_optimizer(a, *optimizer_, optimizer_options_.name);
  for (const auto& c : callbacks_) {
    archive::OutputArchive state;
    call_guarded(*c, "save_state", [&] { c->save_state(state); });
    archive::write_callback_state(a, c->name(), state);
  }
  if (training_) archive::write_loss_sum(a, torch::tensor(loss_sum_));
  archive::write_rng(a, rng);
  for (size_t k = 1; k < rank_rngs.size(); ++k)
    archive::write_rank_rng(a, static_cast<int>(k), rank_rngs[k]);
  for (size_t k = 1; k < rank_optimizers.size(); ++k)
    archive::write_rank_optimizer(a, static_cast<int>(k), rank_optimizers[k]);
  archive::write_file(a, path);
}

nlohmann::json Learner::read_checkpoint(const std::string& path) {
  archive::InputArchive a;
  archive::open(path, torch::kCPU, a);
  return archive::read_resume_json(a, path);
}

nlohmann::json Learner::load_checkpoint(const std::string& path) {
  live();
  auto r = std::make_unique<PendingResume>();
  r->path = path;
  archive::open(path, device_, r->archive);
  r->record = archive::read_resume(r->archive, path);
  const Collective& world = collective();
  const int64_t saved_world = saved_world_size(r->record.info);
  if (saved_world != world.size())
    spdlog::info("checkpoint '{}' was written by {} process(es); this run has {}: the optimizer "
                 "state re-sharded, the data continues at the same global batch, not bitwise",
                 path, saved_world, world.size());
  // The records a resumed fit reads last, checked now: a damaged one fails before the model
  // changes.
  torch::Tensor loss_sum;
  archive::read_loss_sum(r->archive, loss_sum, path);
  archive::read_rng(r->archive, device_, rng_rank(world.rank(), saved_world), path);
  archive::load_model(*model_, r->archive, path);
  nlohmann::json info = r->record.info;
  resume_ = std::move(r);
  return info;
}

std::optional<FitPosition> Learner::pending_resume() const {
  if (!resume_) return std::nullopt;
  return resume_->record.position;
}

// ---------------------------------------------------------------- resume

namespace {
// A finished fit continues when this fit's stages are its stages with epochs added to the last
// or stages appended: the position moves to the first epoch not yet run. False when the stages
// are the same (nothing left to run). Throws when they differ otherwise.
bool extend_finished(FitPosition& p, const std::vector<Stage>& now, const std::vector<std::string>& names,
                     const std::vector<int64_t>& epochs, const std::string& path) {
  const size_t n = names.size();
  const auto refuse = [&](const std::string& why) {
    throw CheckpointError("checkpoint '" + path + "' ends a finished fit with stages " + list(names) +
                          "; " + why + ": a finished run continues with the same stages, epochs added to the "
                          "last or stages appended");
  };
  for (size_t i = 0; i < n && i < now.size(); ++i)
    if (now[i].name != names[i]) refuse("this fit's stage " + std::to_string(i + 1) + " is '" + now[i].name + "'");
  if (now.size() < n) refuse("this fit has fewer");
  if (!epochs.empty())
    for (size_t i = 0; i + 1 < n; ++i)
      if (now[i].epochs != epochs[i])
        refuse("stage '" + names[i] + "' ran " + std::to_string(epochs[i]) + " epochs, this fit gives it " +
               std::to_string(now[i].epochs));
  const int64_t last_done = epochs.empty() ? now[n - 1].epochs : epochs[n - 1];
  if (now[n - 1].epochs < last_done)
    refuse("its last stage '" + names[n - 1] + "' ran " + std::to_string(last_done) + " epochs, more than " +
           std::to_string(now[n - 1].epochs));
  if (now[n - 1].epochs > last_done) {  // the last stage goes on
    p.stage = static_cast<int64_t>(n - 1);
    p.epoch = last_done;
  } else if (now.size() > n) {  // the next stage starts
    p.stage = static_cast<int64_t>(n);
    p.epoch = 0;
  } else {
    return false;
  }
  p.batch = 0;
  p.done = p.stop_fit = p.stop_epoch = false;
  return true;
}
}  // namespace

// Before before_fit: the stages must be the checkpoint's (a finished fit's may be extended);
// counters and statistics continue.
size_t Learner::prepare_resume() {
  PendingResume& r = *resume_;
  std::vector<std::string> now;
  for (const auto& s : stages_) now.push_back(s.name);
  r.extended = r.record.position.done && !r.record.position.stop_fit &&
               extend_finished(r.record.position, stages_, r.record.stages, r.record.stage_epochs, r.path);
  if (r.record.stages != now && !r.extended)
    throw CheckpointError("checkpoint '" + r.path + "' was saved by a fit with stages " +
                          list(r.record.stages) + "; this fit has " + list(now) +
                          ": resume with the same stages");
  const FitPosition& p = r.record.position;
  const size_t first = p.done ? stages_.size() : static_cast<size_t>(p.stage);
  const size_t saved_stages = r.record.stats.size();
  if (first > stages_.size() || saved_stages > stages_.size() || (!p.done && saved_stages < first))
    throw CheckpointError("checkpoint '" + r.path + "' has an impossible position (stage " +
                          std::to_string(p.stage) + " of " + std::to_string(stages_.size()) + ")");
  // The optimizer of the last stage before the position that set its own (the resumed stage
  // sets its own again in run_stage).
  for (size_t i = std::min(first + 1, stages_.size()); i-- > 0;) {
    if (stages_[i].has_optimizer) {
      adopt_stage_optimizer(stages_[i].optimizer);
      break;
    }
  }
  stats_.start(r.record.stats);
  iteration_ = p.iteration;
  steps_ = p.steps;
  global_epoch_ = p.data_epoch;
  valid_sums_ = r.record.valid_sums;
  return first;
}

int64_t Learner::resume_epoch() const {
  return resume_->record.position.stage == stage_index_ ? resume_->record.position.epoch : 0;
}

// At the resumed position, after its before_* events: callbacks, optimizer, running loss,
// flags and, last, the random generators. Returns the batch to continue with.
int64_t Learner::apply_resume() {
  std::unique_ptr<PendingResume> r = std::move(resume_);
  const FitPosition& p = r->record.position;
  load_callback_states(*r);
  // A stage with its own optimizer starts it fresh: nothing saved before its start applies.
  const bool fresh_optimizer = !p.done && p.epoch == 0 && p.batch == 0 &&
                               p.stage < static_cast<int64_t>(stages_.size()) &&
                               stages_[static_cast<size_t>(p.stage)].has_optimizer;
  if (!fresh_optimizer) load_optimizer_state(*r);
  if (training_ && p.batch > num_batches_)
    throw CheckpointError("checkpoint '" + r->path + "' stopped at batch " +
                          std::to_string(p.batch) + " of an epoch that now has " +
                          std::to_string(num_batches_) + ": the data changed");
  restore_loop_state(*r);
  next_ = p;
  next_.stop_epoch = next_.stop_fit = false;
  return p.batch;
}

// The optimizer's state at the position. Cut as this run cuts it (one optimizer for every rank,
// or the same sharding at the same world size): rank 0's record, or with a sharded optimizer each
// rank's own. Cut another way: re-sharded by each record's layout.
void Learner::load_optimizer_state(PendingResume& r) {
  const Collective& world = collective();
  const bool per_rank = saved_per_rank(r.record.info);
  const int64_t saved_world = saved_world_size(r.record.info);
  const std::string at_position = " at that point";
  if (!per_rank && !per_rank_optimizer_) {
    archive::load_optimizer(*optimizer_, optimizer_options_.name, r.archive, r.path, at_position);
    return;
  }
  const auto load_record = [&](size_t k, torch::optim::Optimizer& into) {
    if (k == 0) {
      archive::load_optimizer(into, optimizer_options_.name, r.archive, r.path, at_position);
      return;
    }
    archive::InputArchive own;
    archive::read_rank_optimizer(r.archive, static_cast<int>(k), own, device_, r.path);
    archive::load_optimizer(into, optimizer_options_.name, own, r.path,
                            " (rank " + std::to_string(k) + "'s) at that point");
  };
  if (per_rank && per_rank_optimizer_ && saved_world == world.size()) {
    load_record(static_cast<size_t>(world.rank()), *optimizer_);
    return;
  }
  const size_t records = per_rank ? static_cast<size_t>(saved_world) : 1;
  std::vector<OptimizerLayout> layouts;
  try {
    layouts = r.record.optimizer_layout.get<std::vector<OptimizerLayout>>();
  } catch (const nlohmann::json::exception&) {
    throw CheckpointError("checkpoint '" + r.path + "' was written by " + std::to_string(saved_world) +
                          " process(es) with " + (per_rank ? "one optimizer shard per rank" : "one optimizer") +
                          " and without the optimizer's layout (a file of an older frugal, or an "
                          "optimizer holding tensors that are not the model's): resume it as it was "
                          "written (the same number of processes and the same plugins)");
  }
  if (layouts.size() != records)
    throw CheckpointError("checkpoint '" + r.path + "' is damaged: " + std::to_string(layouts.size()) +
                          " optimizer layouts for " + std::to_string(records) + " optimizer records");
  reshard_optimizer_state(*optimizer_, optimizer_options_, model_->parameters(), layouts, load_record,
                          "checkpoint '" + r.path + "'");
}

// Every saved callback state must have its callback here; each callback present reads its own.
void Learner::load_callback_states(PendingResume& r) {
  for (const auto& name : r.record.callbacks) {
    const bool present = std::any_of(callbacks_.begin(), callbacks_.end(),
                                     [&](const auto& c) { return c->name() == name; });
    archive::InputArchive state;
    if (!present && archive::read_callback_state(r.archive, name, state) && !state.keys().empty() &&
        !contains(state.keys(), kOptionalState))
      throw CheckpointError("checkpoint '" + r.path + "' holds the state of callback '" + name +
                            "', which this run does not have (is its plugin configured?)");
  }
  for (auto& c : callbacks_) {
    archive::InputArchive state;
    if (!archive::read_callback_state(r.archive, c->name(), state)) continue;
    announce_optimizer();  // an earlier load_state may have replaced it (optim_swap)
    call_guarded(*c, "load_state", [&] { c->load_state(*this, state); });
  }
  announce_optimizer();  // before the optimizer's state loads into it
}

// The epoch's running loss, the stop flags and, last, the random generators.
void Learner::restore_loop_state(PendingResume& r) {
  const FitPosition& p = r.record.position;
  torch::Tensor sum;
  loss_sum_ = archive::read_loss_sum(r.archive, sum, r.path) && training_ ? sum.item<float>() : 0;
  loss_count_ = training_ ? r.record.loss_count : 0;
  stop_epoch_ = p.stop_epoch;
  capped_ = !p.stop_fit && !p.done && max_steps_ > 0 && iteration_ >= max_steps_;
  stop_fit_ = p.stop_fit || p.done || capped_;
  const int rank = rng_rank(collective().rank(), saved_world_size(r.record.info));
  if (auto rng = archive::read_rng(r.archive, device_, rank, r.path)) rng->restore();
}

}  // namespace frugal
