// The BLAS kernels in use, and OpenBLAS's core selected for a CPU it does not know (blas.h).
#include "frugal/base/blas.h"

#include <dlfcn.h>

#include <cstdlib>

namespace frugal {
namespace {

using CoreName = char* (*)();
using Hook = void (*)();

// OpenBLAS's entry points, found in the process (LibTorch links libblas.so.3, which Debian's
// alternatives point at OpenBLAS when libopenblas0 is installed): nullptr when absent.
template <class F>
F symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

std::optional<std::string> openblas_core() {
  const auto name = symbol<CoreName>("openblas_get_corename");
  if (!name) return std::nullopt;
  const char* s = name();
  return std::string(s ? s : "");
}

// What was detected when frugal changed the core (the process's one switch).
std::string& detected_core() {
  static std::string d;
  return d;
}
std::string& switch_reason() {
  static std::string r;
  return r;
}

// The kernels this CPU runs best among those Debian's OpenBLAS ships, "" when nothing better
// than Prescott applies.
const char* best_core_for_cpu() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
#endif
  return "";
}

}  // namespace

std::optional<BlasInfo> blas_info() {
  const auto core = openblas_core();
  if (!core) return std::nullopt;
  BlasInfo b;
  b.library = "OpenBLAS";
  b.core = *core;
  b.detected = detected_core().empty() ? *core : detected_core();
  b.reason = switch_reason();
  // A child of a process that switched (a rank, an ablation arm) started on the chosen kernels.
  const char* inherited = std::getenv("FRUGAL_BLAS_DETECTED");
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (b.reason.empty() && inherited && coretype && *core != inherited) {
    b.detected = inherited;
    b.reason = std::string("inherited from the parent process: OPENBLAS_CORETYPE=") + coretype;
  }
  return b;
}

std::optional<BlasInfo> select_blas_core() {
  const auto core = openblas_core();
  if (!core) return std::nullopt;
  const char* as_found = std::getenv("FRUGAL_BLAS_AS_FOUND");
  const bool keep = std::getenv("OPENBLAS_CORETYPE") != nullptr ||
                    (as_found != nullptr && std::string(as_found) == "1");
  const std::string target = best_core_for_cpu();
  const auto quit = symbol<Hook>("gotoblas_dynamic_quit");
  const auto init = symbol<Hook>("gotoblas_dynamic_init");
  if (keep || *core != "Prescott" || target.empty() || !quit || !init || !detected_core().empty())
    return blas_info();
  // gotoblas_dynamic_init reads OPENBLAS_CORETYPE, as it does when the library loads; the
  // variable stays set so child processes (ranks, ablation arms) start on the same kernels.
  setenv("OPENBLAS_CORETYPE", target.c_str(), 1);
  quit();
  init();
  const auto now = openblas_core();
  if (!now || *now == "Prescott" || now->empty()) {  // refused: back to what it chose
    unsetenv("OPENBLAS_CORETYPE");
    quit();
    init();
    return blas_info();
  }
  detected_core() = *core;
  setenv("FRUGAL_BLAS_DETECTED", core->c_str(), 1);
  switch_reason() = "OpenBLAS did not recognise this CPU and chose its generic kernels "
                    "(Prescott); the CPU has " + std::string(target == "SkylakeX" ? "AVX-512" :
                    target == "Haswell" ? "AVX2 and FMA" : "AVX") + ": OPENBLAS_CORETYPE=" + target;
  return blas_info();
}

}  // namespace frugal
