#include "frugal/callbacks/checkpoint_history.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "frugal/base/error.h"
#include "frugal/core/learner.h"

namespace fs = std::filesystem;

namespace frugal {

namespace {

bool is_numbered(const fs::path& p) {
  const std::string n = p.filename().string();
  return n.size() > 10 && n.rfind("step-", 0) == 0 && p.extension() == ".ckpt" &&
         std::all_of(n.begin() + 5, n.end() - 5, [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::string numbered_checkpoint_name(int64_t steps) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld.ckpt", static_cast<long long>(steps));
  return buf;
}

CheckpointHistory::CheckpointHistory(std::string last_path, int64_t keep)
    : last_path_(std::move(last_path)), keep_(keep < 1 ? 1 : keep) {}

std::string CheckpointHistory::write(Learner& l, const nlohmann::json& info) {
  if (sealed_) return "";
  const fs::path last(last_path_);
  const std::string file =
      keep_ == 1 ? last_path_ : (last.parent_path() / numbered_checkpoint_name(l.steps())).string();
  // Data parallel: every rank takes part in the save (rank 0 gathers their generators and
  // writes); only rank 0 touches the folder.
  const bool main = l.collective().is_main();
  if (main && last.has_parent_path()) fs::create_directories(last.parent_path());
  try {
    l.save_checkpoint(file, info);
  } catch (const CheckpointError& e) {
    throw CheckpointError(std::string(e.what()) + where_it_stopped(l));
  }
  if (!main) {
    written_at_ = l.iteration();
    return file;
  }
  if (keep_ > 1) link_last(file);
  prune(file);
  written_at_ = l.iteration();
  return file;
}

// ", at step 12 (stage 1, epoch 2, batch 4); the previous checkpoint, '...' (step 9), is
// intact: ...": where a failed write (a full disk) stopped the run, and how to go on. The
// previous checkpoint is read back (its seal checked) before it is called intact.
std::string CheckpointHistory::where_it_stopped(const Learner& l) const {
  const FitPosition p = l.position();
  std::string out = ", at step " + std::to_string(p.steps) + " (stage " +
                    std::to_string(p.stage + 1) + ", epoch " + std::to_string(p.epoch + 1) +
                    ", batch " + std::to_string(p.batch) + "); ";
  std::error_code ec;
  if (!fs::exists(last_path_, ec)) return out + "there is no earlier checkpoint to resume from";
  try {
    const auto steps = Learner::read_checkpoint(last_path_)["position"].value("steps", int64_t{0});
    return out + "the previous checkpoint, '" + last_path_ + "' (step " + std::to_string(steps) +
           "), is intact: make room, then continue from it with --resume";
  } catch (const std::exception& e) {
    return out + "the previous checkpoint does not load either: " + e.what();
  }
}

// A new link under a temporary name, renamed over last_path: rename is atomic, so last_path
// names the old checkpoint or the new one, never nothing.
void CheckpointHistory::link_last(const std::string& file) const {
  const fs::path last(last_path_);
  const fs::path tmp = last.string() + ".link-tmp";
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_symlink(fs::path(file).filename(), tmp, ec);
  if (!ec) fs::rename(tmp, last, ec);
  if (ec)
    throw CheckpointError("checkpoint '" + file + "' was written, but '" + last_path_ +
                          "' could not be pointed at it: " + ec.message());
}

std::vector<std::string> CheckpointHistory::numbered() const {
  std::vector<std::pair<fs::file_time_type, std::string>> found;
  std::error_code ec;
  const fs::path dir = fs::path(last_path_).parent_path();
  for (fs::directory_iterator it(dir.empty() ? "." : dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!is_numbered(it->path()) || !it->is_regular_file(ec) || it->is_symlink(ec)) continue;
    found.emplace_back(it->last_write_time(ec), it->path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

// The newest `keep` numbered files stay (keep = 1: none, last_path holds the newest); the
// just-written one always does, whatever the clock says.
void CheckpointHistory::prune(const std::string& newest) const {
  std::vector<std::string> files = numbered();
  files.erase(std::remove(files.begin(), files.end(), newest), files.end());
  const size_t others = keep_ == 1 ? 0 : static_cast<size_t>(keep_ - 1);
  std::error_code ec;
  for (size_t i = 0; i + others < files.size(); ++i) fs::remove(files[i], ec);
}

}  // namespace frugal
