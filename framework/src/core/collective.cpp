#include "frugal/core/collective.h"

#include <cmath>

#include "frugal/data/task.h"

namespace frugal {

Collective::~Collective() = default;

SingleProcess& SingleProcess::get() {
  static SingleProcess one;
  return one;
}

void sum_across_ranks(Collective& c, MetricSums& s) {
  if (!c.distributed()) return;
  // Doubles: counts stay exact up to 2^53 target elements.
  torch::Tensor t = torch::tensor({s.loss_sum, static_cast<double>(s.count),
                                   static_cast<double>(s.correct), s.bytes},
                                  torch::TensorOptions().dtype(torch::kDouble))
                        .to(c.device());
  c.all_reduce(t);
  t = t.cpu();
  const auto* v = t.data_ptr<double>();
  s.loss_sum = v[0];
  s.count = static_cast<int64_t>(std::llround(v[1]));
  s.correct = static_cast<int64_t>(std::llround(v[2]));
  s.bytes = v[3];
}

}  // namespace frugal
