#pragma once
// The Learner's two exception helpers: a callback call whose exception names the callback and
// the event (or hook), and a region whose out-of-memory error is noted, not handled.
#include <optional>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

#include "frugal/base/error.h"
#include "frugal/core/callback.h"

namespace frugal {

/// An error of the model's own forward: the callbacks that wrap the forward pass it on, so
/// none of them claims it.
class ModelForwardError : public Error {
 public:
  using Error::Error;
  ~ModelForwardError() override;
};

/// Rethrows the exception being handled as CallbackError naming `cb` and `where` (an event or a
/// hook). Errors already attributed (CallbackError, ModelForwardError) and c10::OutOfMemoryError
/// (the loop retries it) pass unchanged. The message is copied: the exception object may belong
/// to a plugin's library. Call only inside a catch block.
[[noreturn]] void rethrow_attributed(const Callback& cb, std::string_view where);

/// Runs f() on behalf of `cb`; an exception leaves as rethrow_attributed says.
template <class F>
decltype(auto) call_guarded(const Callback& cb, std::string_view where, F&& f) {
  try {
    return f();
  } catch (...) {
    rethrow_attributed(cb, where);
  }
}

/// Runs f(); a c10::OutOfMemoryError it throws is caught and the first line of its message
/// returned (nullopt: f returned). The catch block only records: when this returns the
/// exception object (and whatever it holds) is gone, so the caller's recovery can allocate.
template <class F>
std::optional<std::string> catch_oom(F&& f) {
  try {
    f();
  } catch (const c10::OutOfMemoryError& e) {
    return first_line(e.what_without_backtrace());
  }
  return std::nullopt;
}

}  // namespace frugal
