// The text dataset: the corpus, its split, its windows, their order and the errors.
#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "frugal/frugal.h"
#include "gpt_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

std::string write_file(const TempDir& d, const std::string& name, const std::string& text) {
  const std::string p = d.file(name);
  std::filesystem::create_directories(std::filesystem::path(p).parent_path());
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

std::string text_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TextData, LastTenthIsValidationAndEveryByteIsKept) {
  TempDir d;
  const std::string corpus = tiny_corpus(1000);
  const std::string p = write_file(d, "a.txt", corpus);
  const Dataset train = load_text({p}, 16, 0, true), valid = load_text({p}, 16, 0, false);
  ASSERT_EQ(train.tokens.numel(), 900);
  ASSERT_EQ(valid.tokens.numel(), 100);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(train.tokens.data_ptr<uint8_t>()), 900),
            corpus.substr(0, 900));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(valid.tokens.data_ptr<uint8_t>()), 100),
            corpus.substr(900));
  EXPECT_EQ(train.windows, 900 / 16);  // windows_per_epoch = 0: train bytes / block_size
  EXPECT_EQ(valid.windows, 99 / 16);   // whole windows whose targets fit
  EXPECT_EQ(train.num_classes, 256);
  EXPECT_EQ(load_text({p}, 16, 123, true).windows, 123);
}

TEST(TextData, AHeldOutValidPathValidatesAndTrainingKeepsEveryByte) {
  TempDir d;
  const std::string corpus = tiny_corpus(1000), held = tiny_corpus(300).substr(100);
  const std::string p = write_file(d, "a.txt", corpus), v = write_file(d, "held.txt", held);
  DataOptions o;
  o.dataset = "text";
  o.paths = {p};
  o.valid_path = v;
  o.block_size = 16;
  const Dataset train = make_dataset(o, true), valid = make_dataset(o, false);
  ASSERT_EQ(train.tokens.numel(), 1000) << "no tenth kept back when validation is held out";
  ASSERT_EQ(valid.tokens.numel(), 200);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(valid.tokens.data_ptr<uint8_t>()), 200), held);
  EXPECT_EQ(valid.windows, 199 / 16);
  o.valid_path = write_file(d, "tiny.txt", "short");
  EXPECT_NE(text_error_of([&] { make_dataset(o, false); }).find("validation (data.valid_path) needs 17"),
            std::string::npos);
}

TEST(TextData, FoldersAreReadRecursivelyInPathOrderWithoutLinks) {
  TempDir d;
  write_file(d, "corpus/b/2.txt", std::string(300, 'b'));
  write_file(d, "corpus/a.txt", std::string(300, 'a'));
  write_file(d, "corpus/c.txt", std::string(400, 'c'));
  std::filesystem::create_symlink(d.file("corpus/c.txt"), d.file("corpus/link.txt"));
  write_file(d, "corpus/c.dat", std::string("\0\0\0\2index", 9));
  const auto files = text_files({d.file("corpus")});
  ASSERT_EQ(files.size(), 3u) << "the link and the binary file are skipped";
  EXPECT_EQ(files[0], d.file("corpus/a.txt"));
  EXPECT_EQ(files[1], d.file("corpus/b/2.txt"));
  EXPECT_EQ(files[2], d.file("corpus/c.txt"));
  const Dataset v = load_text({d.file("corpus")}, 8, 0, false);
  EXPECT_EQ(v.tokens.numel(), 100);
  EXPECT_EQ(v.tokens.eq('c').sum().item<int64_t>(), 100) << "the last file ends the corpus";
}

TEST(TextData, ErrorsNameThePathAndWhatIsMissing) {
  TempDir d;
  EXPECT_NE(text_error_of([&] { load_text({d.file("nope.txt")}, 8, 0, true); }).find(d.file("nope.txt")),
            std::string::npos);
  const std::string empty = write_file(d, "empty.txt", "");
  EXPECT_NE(text_error_of([&] { load_text({empty}, 8, 0, true); }).find("hold no bytes"),
            std::string::npos);
  const std::string shorter = write_file(d, "short.txt", std::string(50, 'x'));
  const std::string m = text_error_of([&] { load_text({shorter}, 8, 0, true); });
  EXPECT_NE(m.find("50 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("block_size 8"), std::string::npos) << m;
  EXPECT_THROW(load_text({}, 8, 0, true), DataError);
}

TEST(TextLoader, TargetsAreTheNextTokens) {
  DataLoader l(text_dataset(tiny_corpus(), 16, 20, true), 8, true, 3);
  l.set_epoch(0);
  ASSERT_EQ(l.num_batches(), 3);  // 20 windows in batches of 8: 8, 8, 4
  const Batch b = l.batch(0), last = l.batch(2);
  EXPECT_EQ(b.x.sizes(), torch::IntArrayRef({8, 16}));
  EXPECT_EQ(b.x.scalar_type(), torch::kLong);
  EXPECT_EQ(last.x.size(0), 4);
  EXPECT_TRUE(torch::equal(b.y.narrow(1, 0, 15), b.x.narrow(1, 1, 15)));
}

TEST(TextLoader, WindowStartsAreTorchRandintFromSeedPlusEpoch) {
  const Dataset d = text_dataset(tiny_corpus(), 16, 10, true);
  DataLoader l(d, 10, true, 5);
  l.set_epoch(2);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);  // seed 5 + epoch 2
  auto starts = torch::randint(0, d.tokens.numel() - 16, {10}, gen, torch::kLong);
  const Batch b = l.batch(0);
  for (int64_t i = 0; i < 10; ++i) {
    const int64_t s = starts[i].item<int64_t>();
    EXPECT_TRUE(torch::equal(b.x[i], d.tokens.narrow(0, s, 16).to(torch::kLong))) << i;
    EXPECT_TRUE(torch::equal(b.y[i], d.tokens.narrow(0, s + 1, 16).to(torch::kLong))) << i;
  }
  l.set_epoch(3);
  EXPECT_FALSE(torch::equal(l.batch(0).x, b.x)) << "another epoch, other windows";
  l.set_epoch(2);
  EXPECT_TRUE(torch::equal(l.batch(0).x, b.x)) << "the same epoch, the same windows";
}

TEST(TextLoader, SeqLenCutsEachWindowAndValidationReadsWholeConsecutiveWindows) {
  DataLoader l(text_dataset(tiny_corpus(), 16, 8, true), 8, true, 0);
  const Batch whole = l.batch(0);
  l.set_seq_len(4);
  const Batch cut = l.batch(0);
  EXPECT_EQ(cut.x.size(1), 4);
  EXPECT_TRUE(torch::equal(cut.x, whole.x.narrow(1, 0, 4)));
  EXPECT_TRUE(torch::equal(cut.y, whole.y.narrow(1, 0, 4)));

  const Dataset v = text_dataset(tiny_corpus(), 16, 0, false);
  DataLoader vl(v, 100, false, 0);
  const Batch vb = vl.batch(0);
  ASSERT_EQ(vb.x.size(0), v.windows);
  for (int64_t i = 0; i < v.windows; ++i)
    EXPECT_TRUE(torch::equal(vb.x[i], v.tokens.narrow(0, 16 * i, 16).to(torch::kLong))) << i;
  EXPECT_EQ(v.head(2).size(), 2);
  EXPECT_EQ(v.head(2).tokens.numel(), 33) << "the first two windows and the last target";
}

TEST(TextConfig, MissingCorpusIsAConfigErrorNamingTheKeyBeforeAnyWork) {
  const Config c = parse_config(
      "[data]\ndataset = \"text\"\npaths = [\"/nonexistent/corpus.txt\"]\n[model]\narch = \"gpt\"\n",
      "cfg.toml");
  const std::string m = text_error_of([&] { check_config(c); });
  EXPECT_NE(m.find("cfg.toml: data.paths"), std::string::npos) << m;
  EXPECT_NE(m.find("/nonexistent/corpus.txt"), std::string::npos) << m;
}

TEST(TextConfig, ImageModelsRefuseTextAndGptRefusesImages) {
  TempDir d;
  const std::string p = write_file(d, "c.txt", tiny_corpus());
  const Config c = parse_config("[data]\ndataset = \"text\"\nblock_size = 16\npaths = [\"" + p +
                                    "\"]\n[model]\narch = \"mlp\"\n",
                                "cfg.toml");
  const std::string m = text_error_of([&] { check_config(c); });
  EXPECT_NE(m.find("model.arch = \"gpt\""), std::string::npos) << m;
  const Config g = parse_config("[data]\ndataset = \"synthetic\"\n[model]\narch = \"gpt\"\n", "cfg.toml");
  EXPECT_NE(text_error_of([&] { check_config(g); }).find("takes text"), std::string::npos);
  EXPECT_NE(text_error_of([&] { parse_config("[model]\narch = \"gpt\"\nn_embd = 30\nn_head = 4\n", "cfg.toml"); })
                .find("n_embd = 32"),
            std::string::npos);
}

}  // namespace
}  // namespace frugal::test
