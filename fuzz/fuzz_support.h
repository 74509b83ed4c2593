#pragma once
// What the fuzz targets share: the learner whose checkpoints the checkpoint targets read (and
// frugal_fuzz_make_seeds writes), a private temp folder, and the one way a target reports a
// finding (a message and abort(), which libFuzzer records as a crash with its input).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "frugal/frugal.h"

namespace frugal::fuzz {

/// An MLP on 4 x 4 synthetic images, 4 classes, Adam: its checkpoints are a few KB.
inline std::unique_ptr<Learner> make_learner() {
  torch::manual_seed(0);
  ModelOptions mo;
  mo.arch = "mlp";
  mo.width = 4;
  mo.depth = 1;
  ModelInput in;
  in.channels = 1;
  in.image_size = 4;
  in.num_classes = 4;
  in.image_sizes = {4};
  OptimizerOptions oo;
  oo.name = "adam";
  oo.lr = 1e-2;
  return std::make_unique<Learner>(make_model(mo, in),
                                   DataLoader(make_synthetic(16, 1, 4, 4, 4, 1), 8, true, 0),
                                   std::nullopt, oo, make_loss(LossOptions{}));
}

/// A folder of this process's own under $TMPDIR (or /tmp), removed at exit.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/frugal-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) std::perror("mkdtemp"), std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!f.flush()) std::fprintf(stderr, "cannot write %s\n", path.c_str()), std::abort();
}

/// A finding: not one of the documented outcomes.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "\nFINDING: %s\n", what.c_str());
  std::abort();
}

/// The error's message must name the file it is about.
inline void expect_names(const std::exception& e, const std::string& path) {
  if (std::string(e.what()).find(path) == std::string::npos)
    finding(std::string("the error does not name '") + path + "': " + e.what());
}

}  // namespace frugal::fuzz
