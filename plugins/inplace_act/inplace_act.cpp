// inplace_act: activation modules in their in-place forms where a check on a real batch shows
// outputs and gradients unchanged. The callback and the decision live in inplace_act.h, where
// the tests reach them.
#include "inplace_act.h"

FRUGAL_PLUGIN(frugal::inplace_act::InplaceAct, frugal::inplace_act::InplaceActOptions,
              "inplace_act",
              "activations (ReLU, ELU, Dropout, ...) in place where a check on a batch allows it",
              "1.0.0")
