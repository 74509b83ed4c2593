// IDX files, Fashion-MNIST, synthetic data and the seeded loader.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "support.h"

namespace frugal {
namespace {

using test::TempDir;

template <class Fn>
std::string data_error(Fn&& f) {
  return test::message_of<DataError>(std::forward<Fn>(f));
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

bool fashion_mnist_installed() {
  return std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

// ---- IDX -----------------------------------------------------------------------------------

TEST(Idx, RoundTripGzip4D) {
  TempDir dir;
  auto t = torch::randint(0, 256, {3, 2, 5, 4}, torch::kLong).to(torch::kUInt8);
  write_idx(dir.file("x.idx.gz"), t);
  // A gzip file starts with 0x1f 0x8b.
  std::ifstream in(dir.file("x.idx.gz"), std::ios::binary);
  unsigned char head[2] = {};
  in.read(reinterpret_cast<char*>(head), 2);
  EXPECT_EQ(head[0], 0x1f);
  EXPECT_EQ(head[1], 0x8b);
  auto back = read_idx(dir.file("x.idx.gz"));
  EXPECT_EQ(back.sizes(), t.sizes());
  EXPECT_EQ(back.scalar_type(), torch::kUInt8);
  EXPECT_TRUE(torch::equal(back, t));
}

TEST(Idx, RoundTripPlain1D) {
  TempDir dir;
  auto t = torch::arange(0, 200, torch::kLong).to(torch::kUInt8);
  write_idx(dir.file("y.idx"), t);
  EXPECT_EQ(std::filesystem::file_size(dir.file("y.idx")), 4u + 4u + 200u);
  auto back = read_idx(dir.file("y.idx"));
  ASSERT_EQ(back.dim(), 1);
  EXPECT_TRUE(torch::equal(back, t));
}

TEST(Idx, ReadsHandWrittenBigEndianHeader) {
  TempDir dir;
  // 2 x 3 matrix: sizes are big-endian int32.
  write_bytes(dir.file("m.idx"), {0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6});
  auto t = read_idx(dir.file("m.idx"));
  ASSERT_EQ(t.sizes(), torch::IntArrayRef({2, 3}));
  EXPECT_EQ(t[1][2].item<int>(), 6);
}

TEST(Idx, WrongMagicNamesTheFile) {
  TempDir dir;
  const auto path = dir.file("bad.idx");
  write_bytes(path, {0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0});  // float data, not uint8
  auto msg = data_error([&] { read_idx(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("not an IDX file of uint8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0x00000D01"), std::string::npos) << msg;
}

TEST(Idx, TruncatedBodyIsReported) {
  TempDir dir;
  // A 10 x 10 header followed by 3 bytes.
  write_bytes(dir.file("short.idx"), {0, 0, 8, 2, 0, 0, 0, 10, 0, 0, 0, 10, 1, 2, 3});
  auto msg = data_error([&] { read_idx(dir.file("short.idx")); });
  EXPECT_NE(msg.find("short.idx' is truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected 100 bytes of data, got 3"), std::string::npos) << msg;
}

TEST(Idx, TruncatedGzipIsReported) {
  TempDir dir;
  const auto path = dir.file("cut.idx.gz");
  write_idx(path, torch::randint(0, 256, {4, 64, 64}, torch::kLong).to(torch::kUInt8));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  auto msg = data_error([&] { read_idx(path); });
  EXPECT_NE(msg.find("cut.idx.gz' is truncated: expected 16384 bytes of data"), std::string::npos)
      << msg;
}

TEST(Idx, MissingFileIsDataError) {
  TempDir dir;
  const auto path = dir.file("nope.idx.gz");
  auto msg = data_error([&] { read_idx(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// ---- Fashion-MNIST -------------------------------------------------------------------------

TEST(Data, FashionMnistRealData) {
  if (!fashion_mnist_installed()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  auto train = load_fashion_mnist(kFashionMnistDir, true);
  auto test = load_fashion_mnist(kFashionMnistDir, false);
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(train.images.sizes(), torch::IntArrayRef({60000, 1, 28, 28}));
  EXPECT_EQ(train.images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(train.labels.scalar_type(), torch::kLong);
  EXPECT_EQ(train.num_classes, 10);
  EXPECT_EQ(train.name, "fashion-mnist");
  EXPECT_GE(train.labels.min().item<int64_t>(), 0);
  EXPECT_LT(train.labels.max().item<int64_t>(), 10);
  // Every class appears 6000 times in the training split.
  EXPECT_TRUE(torch::equal(torch::bincount(train.labels), torch::full({10}, 6000, torch::kLong)));
  // The stored normalization matches the data.
  auto x = train.images.to(torch::kFloat).div(255);
  EXPECT_NEAR(x.mean().item<double>(), train.mean, 1e-3);
  EXPECT_NEAR(x.std().item<double>(), train.std, 1e-3);
}

TEST(Data, FashionMnistMissingNamesThePackage) {
  TempDir dir;
  const auto missing = dir.file("no-such-dir");
  auto msg = data_error([&] { load_fashion_mnist(missing, true); });
  EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
  EXPECT_NE(msg.find(missing + "/train-images-idx3-ubyte.gz"), std::string::npos) << msg;
  EXPECT_NE(msg.find("data.path"), std::string::npos) << msg;
}

TEST(Data, FashionMnistCountMismatchIsDataError) {
  TempDir dir;
  write_idx(dir.file("t10k-images-idx3-ubyte.gz"), torch::zeros({5, 28, 28}, torch::kUInt8));
  write_idx(dir.file("t10k-labels-idx1-ubyte.gz"), torch::zeros({4}, torch::kUInt8));
  auto msg = data_error([&] { load_fashion_mnist(dir.path().string(), false); });
  EXPECT_NE(msg.find("5 images"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 labels"), std::string::npos) << msg;
}

TEST(Data, HeadKeepsTheFirstSamples) {
  auto d = make_synthetic(50, 1, 8, 8, 3, 7);
  auto h = d.head(10);
  EXPECT_EQ(h.size(), 10);
  EXPECT_TRUE(torch::equal(h.images, d.images.narrow(0, 0, 10)));
  EXPECT_TRUE(torch::equal(h.labels, d.labels.narrow(0, 0, 10)));
  EXPECT_EQ(d.head(0).size(), 50);
  EXPECT_EQ(d.head(500).size(), 50);
}

// ---- synthetic -----------------------------------------------------------------------------

TEST(Data, SyntheticIsDeterministicPerSeed) {
  torch::manual_seed(123);
  auto before = torch::rand({4});
  torch::manual_seed(123);
  auto a = make_synthetic(64, 3, 16, 12, 5, 42);
  auto b = make_synthetic(64, 3, 16, 12, 5, 42);
  auto c = make_synthetic(64, 3, 16, 12, 5, 43);
  // The global generator is untouched.
  EXPECT_TRUE(torch::equal(torch::rand({4}), before));
  EXPECT_EQ(a.images.sizes(), torch::IntArrayRef({64, 3, 16, 12}));
  EXPECT_EQ(a.images.scalar_type(), torch::kUInt8);
  EXPECT_TRUE(torch::equal(a.images, b.images));
  EXPECT_TRUE(torch::equal(a.labels, b.labels));
  EXPECT_FALSE(torch::equal(a.images, c.images));
  EXPECT_EQ(a.num_classes, 5);
  auto x = a.images.to(torch::kFloat).div(255);
  EXPECT_NEAR(x.mean().item<double>(), a.mean, 1e-4);
  EXPECT_NEAR(x.std().item<double>(), a.std, 1e-4);
}

TEST(Data, SyntheticLabelsAreLearnable) {
  auto d = make_synthetic(2000, 1, 28, 28, 10, 1);
  auto counts = torch::bincount(d.labels, {}, 10);
  // Not constant: several classes, none taking almost everything.
  EXPECT_GE((counts > 0).sum().item<int64_t>(), 5);
  EXPECT_LT(counts.max().item<int64_t>(), 1000);
  // The rule is linear in the downsampled image: least squares on the 4x4 means, fitted on
  // one split, labels another split mostly right (seed 2 shares the rule).
  auto feats = [](const Dataset& s) {
    auto f =
        torch::adaptive_avg_pool2d(s.images.to(torch::kDouble), {4, 4}).reshape({s.size(), -1});
    return torch::cat({f, torch::ones({s.size(), 1}, torch::kDouble)}, 1);
  };
  auto onehot = torch::one_hot(d.labels, 10).to(torch::kDouble);
  auto X = feats(d);
  auto gram = X.t().matmul(X) + 1e-6 * torch::eye(X.size(1), torch::kDouble);
  auto W = torch::inverse(gram).matmul(X.t().matmul(onehot));
  auto other = make_synthetic(500, 1, 28, 28, 10, 2);
  double acc =
      (feats(other).matmul(W).argmax(1) == other.labels).to(torch::kDouble).mean().item<double>();
  EXPECT_GT(acc, 0.5);
}

// ---- loader --------------------------------------------------------------------------------

std::vector<int64_t> epoch_ids(DataLoader& l, int64_t epoch) {
  // Labels hold the sample index, so a batch's labels reveal the order.
  l.set_epoch(epoch);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < l.num_batches(); ++i) {
    auto y = l.batch(i).y;
    for (int64_t j = 0; j < y.size(0); ++j) ids.push_back(y[j].item<int64_t>());
  }
  return ids;
}

Dataset indexed(int64_t n) {
  Dataset d = make_synthetic(n, 1, 6, 6, 2, 3);
  d.labels = torch::arange(n, torch::kLong);
  return d;
}

TEST(Loader, SameSeedSameOrder) {
  DataLoader a(indexed(100), 16, true, 5), b(indexed(100), 16, true, 5),
      c(indexed(100), 16, true, 6);
  auto ea = epoch_ids(a, 3);
  EXPECT_EQ(ea, epoch_ids(b, 3));
  EXPECT_NE(ea, epoch_ids(c, 3));
  std::vector<int64_t> identity(100);
  for (int64_t i = 0; i < 100; ++i) identity[i] = i;
  EXPECT_NE(ea, identity);
}

TEST(Loader, EpochsDifferAndCoverEverySampleOnce) {
  DataLoader l(indexed(103), 10, true, 0);
  auto e0 = epoch_ids(l, 0), e1 = epoch_ids(l, 1);
  EXPECT_NE(e0, e1);
  for (const auto& e : {e0, e1}) {
    ASSERT_EQ(e.size(), 103u);
    std::set<int64_t> seen(e.begin(), e.end());
    EXPECT_EQ(seen.size(), 103u);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), 102);
  }
}

TEST(Loader, NoShuffleKeepsOrder) {
  DataLoader l(indexed(25), 10, false, 9);
  auto e = epoch_ids(l, 4);
  for (int64_t i = 0; i < 25; ++i) EXPECT_EQ(e[i], i);
}

TEST(Loader, LastPartialBatchAndDropLast) {
  DataLoader keep(indexed(103), 10, true, 0);
  EXPECT_EQ(keep.num_batches(), 11);
  EXPECT_EQ(keep.batch(10).size(), 3);
  EXPECT_EQ(keep.batch(10).x.size(0), 3);
  DataLoader drop(indexed(103), 10, true, 0, torch::kCPU, true);
  EXPECT_EQ(drop.num_batches(), 10);
  EXPECT_EQ(drop.batch(9).size(), 10);
  EXPECT_THROW(drop.batch(10), Error);
}

TEST(Loader, ResizesImages) {
  DataLoader l(make_synthetic(40, 1, 28, 28, 10, 1), 8, true, 0);
  EXPECT_EQ(l.batch(0).x.sizes(), torch::IntArrayRef({8, 1, 28, 28}));
  l.set_image_size(14);
  auto b = l.batch(0);
  EXPECT_EQ(b.x.sizes(), torch::IntArrayRef({8, 1, 14, 14}));
  EXPECT_EQ(b.x.scalar_type(), torch::kFloat);
  EXPECT_EQ(b.y.scalar_type(), torch::kLong);
}

TEST(Loader, CpuBatchesAreThePreparedImagesBitwise) {
  Dataset d = indexed(103);  // labels = sample ids
  d.mean = 0.2860;
  d.std = 0.3530;
  for (bool shuffle : {true, false}) {
    DataLoader l(d, 10, shuffle, 3);
    l.set_epoch(1);
    for (int64_t i : {0, 4, 10}) {  // 10: the last, partial batch
      const Batch b = l.batch(i);
      const torch::Tensor want = prepare_images(d.images.index_select(0, b.y), d.mean, d.std, 0);
      EXPECT_TRUE(torch::equal(b.x, want)) << "batch " << i << (shuffle ? " shuffled" : "");
      EXPECT_NE(b.y.data_ptr(), d.labels.data_ptr()) << "a batch never aliases the dataset";
    }
  }
}

TEST(Loader, PrepareImagesNormalizes) {
  auto u8 = torch::tensor({0, 51, 255}, torch::kUInt8).reshape({1, 1, 1, 3});
  auto x = prepare_images(u8, 0.2, 0.5, 0);
  EXPECT_NEAR(x[0][0][0][0].item<float>(), -0.4, 1e-6);
  EXPECT_NEAR(x[0][0][0][1].item<float>(), 0.0, 1e-6);
  EXPECT_NEAR(x[0][0][0][2].item<float>(), 1.6, 1e-6);
  // Bilinear (align_corners = false) halving of a 2x2 block averages it.
  auto block = torch::tensor({0, 100, 200, 100}, torch::kUInt8).reshape({1, 1, 2, 2});
  EXPECT_NEAR(prepare_images(block, 0, 1, 1).item<float>(), 100.0 / 255.0, 1e-6);
}

TEST(Loader, NormalizedRealDataHasUnitStatistics) {
  Dataset d = fashion_mnist_installed() ? load_fashion_mnist(kFashionMnistDir, false)
                                        : make_synthetic(2000, 1, 28, 28, 10, 1);
  DataLoader l(d.head(2000), 2000, true, 0);
  auto x = l.batch(0).x;
  EXPECT_NEAR(x.mean().item<double>(), 0.0, 0.05);
  EXPECT_NEAR(x.std().item<double>(), 1.0, 0.05);
}

TEST(Loader, ClearReleasesData) {
  DataLoader l(indexed(30), 8, true, 0);
  ASSERT_EQ(l.num_batches(), 4);
  l.clear();
  EXPECT_EQ(l.dataset().size(), 0);
  EXPECT_FALSE(l.dataset().images.defined());
  EXPECT_EQ(l.num_batches(), 0);
}

}  // namespace
}  // namespace frugal
