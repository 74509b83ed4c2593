#pragma once
// The checkpoint file format, for the Learner's save/load and save_checkpoint/load_checkpoint.
//
// A LibTorch archive (torch::serialize) with these records:
//   frugal.format    int 1 (a file without it is not frugal's)
//   model            the model's parameters and buffers
//   optimizer        the optimizer's state; optimizer.name its name (save(with_opt) and
//                    save_checkpoint)
//   frugal.resume    save_checkpoint only: the resume record as JSON text (ResumeRecord)
//   callbacks.<name> save_checkpoint only: each callback's save_state
//   loss_sum         save_checkpoint mid-epoch: the epoch's running loss
//   rng.cpu, rng.cuda  save_checkpoint only: the default generators' state
//   rng.rank<r>.cpu  data parallel: rank r's CPU generator (rank 0's is rng.cpu)
//   optimizer.rank<r>  a sharded optimizer (each rank steps its share of the parameters, as
//                    ZeRO): rank r's optimizer and optimizer.name records, serialized as bytes
//                    (rank 0's are optimizer and optimizer.name)
// The zip's comment holds a CRC32 of every byte before it (file_seal.h), checked by open().
// Every way a file can be unreadable, foreign, damaged or of another model is a CheckpointError
// naming it.
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/base/rng.h"
#include "frugal/data/task.h"
#include "frugal/memory/fit_stats.h"

namespace frugal::archive {

inline constexpr int64_t kFormat = 1;

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// ---- writing ----
/// The format record: the first thing every frugal archive holds.
void write_header(OutputArchive& a);
void write_model(OutputArchive& a, const torch::nn::Module& model);
void write_optimizer(OutputArchive& a, const torch::optim::Optimizer& opt, const std::string& name);
void write_rng(OutputArchive& a, const RngState& rng);
/// Data parallel: rank r's (r >= 1) CPU generator state, gathered by rank 0.
void write_rank_rng(OutputArchive& a, int rank, const torch::Tensor& cpu_state);
/// The bytes of an archive holding only the optimizer and optimizer.name records of `opt`:
/// what a rank sends rank 0 when the ranks' optimizers differ.
std::vector<char> optimizer_bytes(const torch::optim::Optimizer& opt, const std::string& name);
/// Rank r's (r >= 1) optimizer_bytes, gathered by rank 0, as "optimizer.rank<r>".
void write_rank_optimizer(OutputArchive& a, int rank, const std::vector<char>& bytes);
/// A callback's save_state, under "callbacks.<name>".
void write_callback_state(OutputArchive& a, const std::string& name, OutputArchive& state);
/// The epoch's running loss (saved mid-epoch only).
void write_loss_sum(OutputArchive& a, const torch::Tensor& sum);
/// Writes the archive straight to a temp file beside `path` (a checkpoint is never buffered
/// whole in memory), fsyncs and renames it over `path`; creates the folder.
/// Compiles TorchScript `source` (one or more `def name(self, ...):`) as methods of the archive's
/// own module, so the saved file is a module PyTorch calls (`torch.jit.load(path).forward(x)`);
/// `self.model` is the model write_model wrote. Throws std::runtime_error with TorchScript's
/// message when the source does not compile.
void define_methods(OutputArchive& a, const std::string& source);
void write_file(OutputArchive& a, const std::string& path);

// ---- reading ----
/// Opens a frugal archive onto `device`: missing, not a file, unreadable, foreign or of
/// another format are CheckpointErrors.
void open(const std::string& path, const torch::Device& device, InputArchive& a);
/// Loads the "model" record into `model`; every shape is checked before anything changes.
void load_model(torch::nn::Module& model, InputArchive& a, const std::string& path);
/// Loads the "optimizer" record into `opt`, whose name is `name`. Throws CheckpointError naming
/// `path` when the record is absent, holds another optimizer's state, or does not fit; `fix`
/// ends the first two messages (what the caller can do).
void load_optimizer(torch::optim::Optimizer& opt, const std::string& name, InputArchive& a,
                    const std::string& path, const std::string& fix);
/// Whether the archive holds rank r's own optimizer (optimizer.rank<r>).
bool has_rank_optimizer(InputArchive& a, int rank);
/// Rank r's optimizer_bytes as an archive `load_optimizer` reads. Throws CheckpointError naming
/// `path` when the record is absent or damaged.
void read_rank_optimizer(InputArchive& a, int rank, InputArchive& out, const torch::Device& device,
                         const std::string& path);
/// A callback's saved state into `state`; false when the archive has none for `name`.
bool read_callback_state(InputArchive& a, const std::string& name, InputArchive& state);
/// The running loss into `sum`; false when none was saved. Throws CheckpointError naming `path`
/// when it is not one floating-point number.
bool read_loss_sum(InputArchive& a, torch::Tensor& sum, const std::string& path);
/// The generators' state save_checkpoint stored (nullopt: none); CUDA's when `device` is CUDA.
/// Rank r >= 1 of a data-parallel run reads its own CPU generator (rng.rank<r>.cpu). Throws
/// CheckpointError naming `path` when LibTorch's CPU generator would refuse the state.
std::optional<RngState> read_rng(InputArchive& a, const torch::Device& device, int rank,
                                 const std::string& path);

// ---- the resume record ----
/// Where a saved fit stands and what it had measured.
struct ResumeRecord {
  FitPosition position;
  std::vector<std::string> stages;     ///< the fit's stage names
  /// Each stage's epochs (empty in checkpoints written before they were kept): what a finished
  /// fit may be extended past.
  std::vector<int64_t> stage_epochs;
  std::vector<std::string> callbacks;  ///< the callbacks it ran with
  std::string optimizer;               ///< the optimizer at the position
  int64_t loss_count = 0;              ///< batches in the position epoch's running loss
  double valid_accuracy = -1;
  MetricSums valid_sums;  ///< the last validation's (count 0: none)
  std::vector<StageStats> stats;
  nlohmann::json info;  ///< stored as is (the CLI keeps the resolved config there)
  /// Per saved optimizer record (rank 0's, then with a sharded optimizer rank r's), its layout
  /// (frugal/optim/reshard.h): what a resume cut another way needs. Null in older files.
  nlohmann::json optimizer_layout;
};
nlohmann::json to_json(const ResumeRecord& r);
void write_resume(OutputArchive& a, const ResumeRecord& r);
/// The "frugal.resume" JSON, with every field a resume reads checked (a damaged record fails
/// before any work).
nlohmann::json read_resume_json(InputArchive& a, const std::string& path);
/// The same, typed.
ResumeRecord read_resume(InputArchive& a, const std::string& path);

/// A stage's statistics as stored, and back (NaN, which JSON lacks, is stored as null).
nlohmann::json stats_to_json(const StageStats& s);
StageStats stats_from_json(const nlohmann::json& j);

}  // namespace frugal::archive
