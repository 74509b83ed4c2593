#pragma once
// What exists anywhere rather than what is in memory (internal to libfrugal).
namespace frugal::detail {

/// While alive, resident() (memory.h) is true on this thread for offloaded tensors too, so that
/// optimizer_state_bytes counts the state wherever it lives: optimizer_step_needs subtracts
/// state that exists, on disk or not, from what the next step still has to make.
class CountingOffloaded {
 public:
  CountingOffloaded();
  ~CountingOffloaded();
  CountingOffloaded(const CountingOffloaded&) = delete;
  CountingOffloaded& operator=(const CountingOffloaded&) = delete;

 private:
  bool previous_;
};

}  // namespace frugal::detail
