#include "core/guard.h"

namespace frugal {

ModelForwardError::~ModelForwardError() = default;

void rethrow_attributed(const Callback& cb, std::string_view where) {
  const std::string w(where);
  try {
    throw;
  } catch (const CallbackError&) {
    throw;  // already names its callback (an event fired from inside a hook)
  } catch (const ModelForwardError&) {
    throw;  // the model's, not a wrapper's
  } catch (const c10::OutOfMemoryError&) {
    throw;  // keeps its type: the loop retries it (on_oom = "retry")
  } catch (const c10::Error& e) {
    throw CallbackError(cb.name(), w, e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw CallbackError(cb.name(), w, e.what());
  } catch (...) {
    throw CallbackError(cb.name(), w, "unknown exception");
  }
}

}  // namespace frugal
