#include "frugal/config/own_keys.h"

#include <ostream>

namespace frugal {

OwnKeys::OwnKeys() : t_(std::make_unique<Table>()) {}
OwnKeys::OwnKeys(const OwnKeys& o) : t_(std::make_unique<Table>(*o.t_)) {}
OwnKeys& OwnKeys::operator=(const OwnKeys& o) {
  if (this != &o) *t_ = *o.t_;
  return *this;
}
// A moved-from OwnKeys is empty, not null: every OptimizerOptions stays usable.
OwnKeys::OwnKeys(OwnKeys&& o) noexcept : t_(std::make_unique<Table>()) { std::swap(t_, o.t_); }
OwnKeys& OwnKeys::operator=(OwnKeys&& o) noexcept {
  std::swap(t_, o.t_);
  return *this;
}
OwnKeys::~OwnKeys() = default;

size_t OwnKeys::size() const { return t_->t.size(); }
bool OwnKeys::contains(const std::string& key) const { return t_->t.contains(key); }
bool OwnKeys::operator==(const OwnKeys& o) const { return t_->t == o.t_->t; }

std::ostream& operator<<(std::ostream& os, const OwnKeys& k) { return os << toml_of(k); }

}  // namespace frugal
