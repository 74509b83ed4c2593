#pragma once
/// The BLAS kernels LibTorch's matrix products run on, and the fix for a CPU that OpenBLAS does
/// not know. Debian's OpenBLAS (0.3.21) picks its kernels from the CPU's model number; on a CPU
/// newer than it (Sapphire/Emerald Rapids, seen here) it falls back to "Prescott", its generic
/// SSE3 kernels, and every matrix product runs 2-3x slower than the CPU allows. The documented
/// cure is OPENBLAS_CORETYPE in the environment before the process starts; select_blas_core()
/// does the same from inside the process, through OpenBLAS's own exported entry points
/// (gotoblas_dynamic_quit/init), when OpenBLAS chose Prescott on a CPU with AVX2 or AVX-512.
#include <optional>
#include <string>

namespace frugal {

/// The BLAS library LibTorch uses, when frugal can tell.
struct BlasInfo {
  std::string library;   ///< "OpenBLAS"
  std::string core;      ///< the kernels in use ("SkylakeX", "Haswell", "Prescott", ...)
  std::string detected;  ///< what the library chose by itself (== core unless frugal changed it)
  /// Why frugal changed it (empty when it did not).
  std::string reason;
};

/// The BLAS in use; nullopt when it is not OpenBLAS (MKL, a reference BLAS) or not loaded.
std::optional<BlasInfo> blas_info();

/// Call first thing in main, before any matrix product and before other threads start: when
/// OpenBLAS fell back to its generic kernels on a CPU it does not know and the user did not set
/// OPENBLAS_CORETYPE (or FRUGAL_BLAS_AS_FOUND=1), switches it to the kernels the CPU supports
/// (SkylakeX for AVX-512, Haswell for AVX2 + FMA). Returns what is in use after it (blas_info()).
/// frugal's CLI and benchmarks call it; a program of its own that trains a Learner may.
std::optional<BlasInfo> select_blas_core();

}  // namespace frugal
