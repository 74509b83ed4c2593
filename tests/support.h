#pragma once
// Shared test helpers: a seeding fixture (as LibTorch's test/cpp/api/support.h) and a
// temporary directory that removes itself.
#include <exception>
#include <filesystem>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace frugal::test {

/// Runs `f` and returns the message of the E it throws ("" when nothing was thrown; another
/// exception type propagates and fails the test).
template <class E = std::exception, class Fn>
std::string message_of(Fn&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

class Seeded : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(0); }
};

/// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("frugal-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace frugal::test
