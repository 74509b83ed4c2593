// archive::define_methods (archive.h): TorchScript compiled onto an archive's module. In a file
// of its own: the TorchScript frontend's inline code casts to c10 types whose RTTI LibTorch does
// not export (c10::DynamicType), so clang's -fsanitize=vptr is off here (framework/CMakeLists.txt).
#include <stdexcept>
#include <string>

#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>

#include "io/archive.h"

namespace frugal::archive {

void define_methods(OutputArchive& a, const std::string& source) {
  // The archive's module is the class "__torch__.Module" of its own compilation unit (nested
  // archives get mangled names); the methods are defined on that class, as Module::define does.
  const auto cu = a.compilation_unit();
  const auto cls = cu->get_class(c10::QualifiedName("__torch__.Module"));
  if (!cls) throw std::runtime_error("the archive has no module class to define methods on");
  const torch::jit::SimpleSelf self(cls);
  try {
    cu->define(cls->name(), source, torch::jit::nativeResolver(), &self);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + "\n" + source);
  }
}

}  // namespace frugal::archive
