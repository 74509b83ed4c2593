// detach_loss: the loss and prediction detached once backward has run, and a watch for live
// memory that grows batch after batch. The callback and the watch's arithmetic live in
// detach_loss.h, where the tests reach them.
#include "detach_loss.h"

FRUGAL_PLUGIN(frugal::detach_loss::DetachLoss, frugal::detach_loss::DetachLossOptions,
              "detach_loss",
              "detaches loss and prediction after backward; warns when live memory grows per batch",
              "1.0.0")
