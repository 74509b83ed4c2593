#pragma once
/// Parameters kept in shards between uses (zero stage 3, FSDP): a callback that frees the
/// parameters its rank does not own registers a ParameterShards with the Learner
/// (Learner::set_parameter_shards), and whoever reads every parameter outside the forward
/// (a checkpoint, the best model's export) holds a FullParameters for the time it reads, as
/// FSDP's summon_full_params. Gathering is a collective: every rank must hold one at the same
/// point of the fit.
#include <cstdint>
#include <utility>
#include <vector>

namespace frugal {

class Learner;

class ParameterShards {
 public:
  virtual ~ParameterShards() = default;
  /// Brings every parameter into memory with its owner's values (a collective).
  virtual void gather_all() = 0;
  /// Frees again what gather_all brought in (this rank's own shard stays).
  virtual void release_all() = 0;
  /// A forward this rank does not run (a validation batch it has no row of) while the others
  /// do: takes part in its gathers.
  virtual void skip_forward() = 0;
};

/// The units a sharded model is gathered in: consecutive top-level blocks [begin, end), a unit
/// closing once its parameter bytes reach `unit_bytes` (0: every block is its own unit, FSDP's
/// wrapping of each block; a block without parameters joins the next). zero stage 3 gathers by
/// them; `frugal plan` predicts the bytes they hold at once.
std::vector<std::pair<int64_t, int64_t>> plan_units(const std::vector<int64_t>& block_bytes,
                                                    int64_t unit_bytes);

/// Every parameter in memory for the scope's life: a no-op without shards, nested scopes
/// gather once.
class FullParameters {
 public:
  explicit FullParameters(Learner& l);
  ~FullParameters();
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;

 private:
  ParameterShards* shards_ = nullptr;
  Learner* learner_ = nullptr;  // set once gathered: the scope to close
};

}  // namespace frugal
