// Writes the generated part of the seed corpus: `frugal_fuzz_make_seeds fuzz/corpus` (after a
// change of the checkpoint format). The configs in fuzz/corpus/config are copies of
// examples/configs and plugins/*/bench.toml, some with --set overrides.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "fuzz_support.h"

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  frugal::fuzz::write_file(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <fuzz/corpus>\n", argv[0]);
    return 2;
  }
  using namespace frugal;
  const std::string root = argv[1];
  const fuzz::TempDir tmp;
  auto learner = fuzz::make_learner();
  learner->fit(1);
  learner->save_checkpoint(tmp.file("a.ckpt"));
  learner->save(tmp.file("model.pt"), /*with_opt=*/false);
  const std::string ckpt = read_bytes(tmp.file("a.ckpt"));
  write_bytes(root + "/checkpoint/tiny.ckpt", ckpt);
  write_bytes(root + "/checkpoint/tiny_model.pt", read_bytes(tmp.file("model.pt")));
  // An archive written before seals: no comment, the end record's comment length 0.
  std::string unsealed = ckpt.substr(0, ckpt.size() - 21);
  unsealed[unsealed.size() - 2] = unsealed[unsealed.size() - 1] = 0;
  write_bytes(root + "/checkpoint/tiny_unsealed.ckpt", unsealed);

  const auto images = torch::arange(2 * 3 * 3, torch::kUInt8).reshape({2, 3, 3});
  const auto labels = torch::tensor({3, 9}, torch::kUInt8);
  write_idx(tmp.file("i.idx"), images);
  write_idx(tmp.file("l.idx"), labels);
  write_idx(tmp.file("i.idx.gz"), images);
  write_idx(tmp.file("l.idx.gz"), labels);
  write_bytes(root + "/idx/images.idx", read_bytes(tmp.file("i.idx")));
  write_bytes(root + "/idx/labels.idx.gz", read_bytes(tmp.file("l.idx.gz")));
  write_bytes(root + "/idx/pair", read_bytes(tmp.file("i.idx")) + "\n--labels--\n" + read_bytes(tmp.file("l.idx")));
  write_bytes(root + "/idx/pair_gz",
              read_bytes(tmp.file("i.idx.gz")) + "\n--labels--\n" + read_bytes(tmp.file("l.idx.gz")));
  return 0;
}
