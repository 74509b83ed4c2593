#include "frugal/core/parameter_shards.h"

#include <algorithm>

#include "frugal/core/learner.h"

namespace frugal {

std::vector<std::pair<int64_t, int64_t>> plan_units(const std::vector<int64_t>& block_bytes,
                                                    int64_t unit_bytes) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t held = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(block_bytes.size()); ++b) {
    if (out.empty() || held >= std::max<int64_t>(unit_bytes, 1)) {
      out.emplace_back(b, b);
      held = 0;
    }
    out.back().second = b + 1;
    held += block_bytes[static_cast<size_t>(b)];
  }
  return out;
}

FullParameters::FullParameters(Learner& l) : shards_(l.parameter_shards()) {
  if (!shards_) return;
  if (l.full_parameter_scopes_ == 0) shards_->gather_all();  // may throw: nothing to undo yet
  ++l.full_parameter_scopes_;
  learner_ = &l;
}

FullParameters::~FullParameters() {
  if (learner_ && --learner_->full_parameter_scopes_ == 0) shards_->release_all();
}

}  // namespace frugal
