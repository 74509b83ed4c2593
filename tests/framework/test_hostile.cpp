// Hostile input: mutated configs (a seeded mutation fuzzer) only ever give ConfigError;
// corrupt IDX and checkpoint files give DataError / CheckpointError naming the file; a
// callback that throws in any event stops the fit naming itself and the event, and the last
// checkpoint stays intact and loadable.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <typeinfo>

#include <zlib.h>

#include "cli_support.h"
#include "learner_fixture.h"

namespace frugal::test {
namespace {

namespace fs = std::filesystem;

// The repository, from this file's path (CMake compiles it by its absolute path).
// From the build (not __FILE__: ccache's base_dir makes that relative to the build folder).
fs::path source_root() { return FRUGAL_TEST_SOURCE_DIR; }

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

int64_t iterations(int64_t fallback) {
  const char* n = std::getenv("FRUGAL_FUZZ_ITERATIONS");
  return n ? std::max<int64_t>(1, std::atoll(n)) : fallback;
}

/// The configs users start from: examples and every plugin's bench.toml.
std::vector<std::string> seed_configs() {
  std::vector<std::string> out;
  const fs::path root = source_root();
  for (const fs::path& dir : {root / "examples" / "configs", root / "plugins"})
    for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it)
      if (it->path().extension() == ".toml") out.push_back(read_bytes(it->path().string()));
  return out;
}

/// One random edit of a text: bytes deleted, duplicated, flipped or inserted, the end cut,
/// a value replaced by one of another type, lines swapped or a table header inserted.
std::string mutate(std::string s, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  static const std::vector<std::string> values = {
      "\"x\"", "1", "-1", "0", "9223372036854775807", "-9223372036854775808", "1.5e308", "-0.0",
      "nan", "inf", "true", "[1, \"a\"]", "[]", "{a = 1}", "{}", "1979-05-27T07:32:00Z", "07:32:00",
      "\"\\u0000\"", "'''multi\nline'''", "\"\xff\xfe\"", "[[1]]", "0x7fffffffffffffff"};
  static const std::vector<std::string> inserts = {
      "[run]\n", "[[stages]]\n", "[plugins]\n", "[plugins.amp]\n", "[stages.optimizer]\n", "=",
      "\"", "[", "]", "{", "}", "\n", "#", ".", ",", "\\", "\x00", "\xc3", "a.b.c = 1\n",
      "data = 3\n", "stages = 1\n", "plugins = []\n", "path = [1]\n"};
  switch (rng() % 9) {
    case 0: {  // delete a range
      const size_t at = pick(s.size()), n = 1 + pick(16);
      return s.erase(at, n);
    }
    case 1: {  // duplicate a range
      const size_t at = pick(s.size()), n = 1 + pick(64);
      return s.insert(at, s.substr(at, n));
    }
    case 2:  // flip a byte
      if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1 << pick(8));
      return s;
    case 3:  // insert a random byte
      return s.insert(pick(s.size() + 1), 1, static_cast<char>(rng() & 0xff));
    case 4:  // truncate
      return s.substr(0, pick(s.size() + 1));
    case 5: {  // a value of another type
      const size_t eq = s.find('=', pick(s.size()));
      if (eq == std::string::npos) return s;
      const size_t end = s.find('\n', eq);
      return s.replace(eq + 1, end == std::string::npos ? std::string::npos : end - eq - 1,
                       " " + values[pick(values.size())]);
    }
    case 6:  // a TOML fragment
      return s.insert(pick(s.size() + 1), inserts[pick(inserts.size())]);
    case 7: {  // swap two lines
      std::vector<std::string> lines;
      std::string line;
      for (char c : s) {
        line += c;
        if (c == '\n') lines.push_back(std::move(line)), line.clear();
      }
      if (!line.empty()) lines.push_back(line);
      if (lines.size() > 1) std::swap(lines[pick(lines.size())], lines[pick(lines.size())]);
      std::string out;
      for (auto& l : lines) out += l;
      return out;
    }
    default: {  // a number made extreme
      const size_t d = s.find_first_of("0123456789", pick(s.size()));
      if (d == std::string::npos) return s;
      return s.insert(d, pick(2) ? "99999999999999999999" : "-");
    }
  }
}

/// Only ConfigError may escape; anything else (or a crash) fails the test with the input.
void expect_config_error_or_success(const std::string& text, const std::vector<std::string>& sets,
                                    int64_t i, int64_t& accepted) {
  try {
    Config c = parse_config(text, "fuzz.toml", sets);
    // A config that parses writes a resolved config that parses back.
    const std::string resolved = c.to_toml();
    EXPECT_NO_THROW(parse_config(resolved, "resolved.toml")) << "iteration " << i << "\n" << resolved;
    ++accepted;
  } catch (const ConfigError&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "iteration " << i << ": " << typeid(e).name() << ": " << e.what()
                  << "\n--- input ---\n" << text;
  }
}

TEST(Hostile, MutatedConfigsGiveConfigErrorsNeverCrashes) {
  const auto seeds = seed_configs();
  ASSERT_GE(seeds.size(), 3u) << "examples/configs and plugins/*/bench.toml";
  for (const auto& s : seeds) EXPECT_NO_THROW(parse_config(s, "seed.toml")) << s;
  std::mt19937_64 rng(20240607);
  const int64_t n = iterations(3000);
  int64_t accepted = 0;
  for (int64_t i = 0; i < n; ++i) {
    std::string text = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) text = mutate(std::move(text), rng);
    expect_config_error_or_success(text, {}, i, accepted);
    if (HasFailure()) break;  // one input is enough to debug
  }
  // Both outcomes were exercised: the mutations are neither all harmless nor all fatal.
  EXPECT_GT(accepted, n / 50);
  EXPECT_LT(accepted, n - n / 50);
}

TEST(Hostile, MutatedOverridesGiveConfigErrorsNeverCrashes) {
  const auto seeds = seed_configs();
  std::mt19937_64 rng(7);
  static const std::vector<std::string> keys = {
      "run.seed", "data.batch_size", "stages.0.epochs", "stages.9.epochs", "stages.0.optimizer.lr",
      "stages", "model", "plugins.amp.dtype", "plugins.path", "a..b", ".x", "run.", "stages.0.freeze.0",
      "data.path.x", "optimizer.name", "", "=", "stages.-1.name"};
  const int64_t n = iterations(3000) / 3;
  int64_t accepted = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::string& src = seeds[rng() % seeds.size()];
    std::string value = mutate(src.substr(rng() % src.size(), 1 + rng() % 30), rng);
    std::vector<std::string> sets = {keys[rng() % keys.size()] + "=" + value};
    expect_config_error_or_success(seeds[rng() % seeds.size()], sets, i, accepted);
    if (HasFailure()) break;
  }
  // Both outcomes were exercised: some overrides were accepted (and their resolved config
  // round-tripped), most were refused.
  EXPECT_GT(accepted, n / 50);
  EXPECT_LT(accepted, n - n / 50);
}

// Found by fuzz/config.cpp: a --set key of bytes that are not UTF-8 was stored as is and the
// resolved config named another key; a value was changed to U+FFFD without a word.
TEST(Hostile, AnOverrideThatIsNotUtf8IsAConfigError) {
  for (const std::string set : {"plugins.grad_acc\xcd\xcdum.steps=4", "data.path=/data/\xff\xfe"}) {
    try {
      parse_config("[data]\ndataset = \"synthetic\"\n", "cfg.toml", {set});
      ADD_FAILURE() << "accepted: " << set;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--set " + set + ": not UTF-8 text"), std::string::npos)
          << e.what();
    }
  }
  const std::string unicode = "/donn\xc3\xa9" "es";  // UTF-8 is fine
  EXPECT_EQ(parse_config("", "cfg.toml", {"data.path=" + unicode}).data.path, unicode);
}

// ---- IDX -------------------------------------------------------------------------------------

std::string data_error_of(const std::string& path) {
  try {
    read_idx(path);
  } catch (const DataError& e) {
    return e.what();
  }
  return "no DataError";
}

TEST(Hostile, IdxHeaderClaimingMoreThanTheFileHoldsIsRefusedBeforeAllocating) {
  TempDir dir;
  const auto path = dir.file("huge.idx");
  // 4 dimensions of 2^31 - 1: 2^124 bytes, which overflows int64 unless checked.
  write_bytes(path, std::string("\x00\x00\x08\x04", 4) + std::string(4 * 4, '\x7f') + "abc");
  auto msg = data_error_of(path);
  EXPECT_NE(msg.find(path + "' is corrupt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2139062143 x 2139062143"), std::string::npos) << msg;
  // Found by fuzz/idx.cpp: with one size 0 the others went unchecked, and LibTorch refused
  // the shape with a c10::Error.
  const auto empty = dir.file("empty_huge.idx");
  write_bytes(empty, std::string("\x00\x00\x08\x04", 4) + std::string(3 * 4, '\x7f') +
                         std::string(4, '\0') + "abc");
  msg = data_error_of(empty);
  EXPECT_NE(msg.find(empty + "' is corrupt: its header claims 2139062143 x 2139062143 x "
                             "2139062143 x 0, sizes more than a file of 23 bytes can hold"),
            std::string::npos)
      << msg;
  write_idx(empty, torch::zeros({5, 0, 3}, torch::kUInt8));  // an empty file of sane sizes
  EXPECT_EQ(read_idx(empty).sizes(), (std::vector<int64_t>{5, 0, 3}));

  const auto gz = dir.file("huge.idx.gz");
  write_idx(gz, torch::zeros({2, 2}, torch::kUInt8));
  std::string bytes = read_bytes(gz);
  ASSERT_GT(bytes.size(), 18u);
  write_bytes(dir.file("garbage.idx.gz"), bytes.substr(0, 10) + std::string(64, '\x55'));
  msg = data_error_of(dir.file("garbage.idx.gz"));
  EXPECT_NE(msg.find("garbage.idx.gz"), std::string::npos) << msg;
}

TEST(Hostile, MutatedIdxFilesGiveDataErrorsNeverCrashes) {
  TempDir dir;
  std::mt19937_64 rng(11);
  const torch::Tensor t = torch::randint(0, 256, {3, 5, 7}, torch::kLong).to(torch::kUInt8);
  for (const std::string name : {"a.idx", "a.idx.gz"}) {
    write_idx(dir.file(name), t);
    const std::string good = read_bytes(dir.file(name));
    const int64_t n = iterations(3000) / 6;
    for (int64_t i = 0; i < n; ++i) {
      std::string bad = good;
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < edits; ++k) {
        const size_t at = rng() % bad.size();
        switch (rng() % 3) {
          case 0: bad[at] = static_cast<char>(rng() & 0xff); break;
          case 1: bad.resize(at); break;
          default: bad.insert(at, 1, static_cast<char>(rng() & 0xff));
        }
        if (bad.empty()) break;
      }
      const std::string path = dir.file("m_" + name);
      write_bytes(path, bad);
      try {
        auto back = read_idx(path);
        EXPECT_LE(back.numel(), static_cast<int64_t>(bad.size()) * 1032 + 1024);
      } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << name << " iteration " << i << ": " << e.what();
        break;
      }
    }
  }
}

// ---- checkpoints ----------------------------------------------------------------------------

std::string checkpoint_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a CheckpointError: ") + e.what();
  }
  return "no error";
}

TEST(Hostile, CorruptCheckpointsGiveCheckpointErrorsNamingTheFile) {
  TempDir dir;
  const std::string good = dir.file("good.ckpt");
  {
    auto a = make_tiny_learner();
    a->fit(1);
    a->save_checkpoint(good);
  }
  const std::string bytes = read_bytes(good);
  struct Case {
    std::string name, bytes, expect;
  };
  std::vector<Case> cases = {
      {"empty.ckpt", "", "unreadable"},
      {"magic.ckpt", "XXXX" + bytes.substr(4), "is damaged: CRC32"},
      {"text.ckpt", "this is not a checkpoint\n", "unreadable"},
  };
  std::mt19937_64 rng(5);
  std::string noise(bytes.size(), '\0');
  for (auto& c : noise) c = static_cast<char>(rng() & 0xff);
  cases.push_back({"noise.ckpt", noise, "unreadable"});
  for (int k = 1; k < 16; ++k)
    cases.push_back({"cut" + std::to_string(k) + ".ckpt", bytes.substr(0, bytes.size() * k / 16),
                     "unreadable"});
  {  // a torch archive, but not frugal's
    torch::serialize::OutputArchive foreign;
    foreign.write("weights", torch::ones({3}));
    foreign.save_to(dir.file("foreign.ckpt"));
    cases.push_back({"foreign.ckpt", read_bytes(dir.file("foreign.ckpt")), "not a frugal checkpoint"});
  }
  {  // frugal's format record, a damaged resume record
    torch::serialize::OutputArchive damaged;
    damaged.write("frugal.format", c10::IValue(int64_t{1}));
    damaged.write("frugal.resume", c10::IValue(std::string("{\"position\": {\"stage\": -3")));
    damaged.save_to(dir.file("damaged.ckpt"));
    cases.push_back({"damaged.ckpt", read_bytes(dir.file("damaged.ckpt")), "damaged resume record"});
  }
  {  // a future format
    torch::serialize::OutputArchive future;
    future.write("frugal.format", c10::IValue(int64_t{9}));
    future.save_to(dir.file("future.ckpt"));
    cases.push_back({"future.ckpt", read_bytes(dir.file("future.ckpt")), "this frugal reads format 1"});
  }
  auto l = make_tiny_learner();
  const auto before = clone_params(*l->model());
  for (const auto& c : cases) {
    const std::string path = dir.file("bad_" + c.name);
    write_bytes(path, c.bytes);
    for (const auto& msg : {checkpoint_error_of([&] { l->load_checkpoint(path); }),
                            checkpoint_error_of([&] { Learner::read_checkpoint(path); })}) {
      EXPECT_NE(msg.find(path), std::string::npos) << c.name << ": " << msg;
      EXPECT_NE(msg.find(c.expect), std::string::npos) << c.name << ": " << msg;
    }
    EXPECT_FALSE(l->pending_resume()) << c.name;
  }
  EXPECT_TRUE(params_equal(*l->model(), before)) << "no corrupt file touched the model";
  const auto msg = checkpoint_error_of([&] { l->load_checkpoint(dir.path().string()); });
  EXPECT_NE(msg.find("is not a file"), std::string::npos) << msg;
  l->load_checkpoint(good);  // and the good one still loads
}

// Found by fuzz/checkpoint_target.h: LibTorch's generator refused a damaged state with a
// c10::Error, met by a resumed fit after the model and the optimizer had changed; a running
// loss of several numbers failed at the epoch's end.
TEST(Hostile, ADamagedGeneratorStateOrRunningLossIsRefusedBeforeTheModelChanges) {
  TempDir dir;
  const std::string good = dir.file("good.ckpt");
  auto a = make_tiny_learner();
  a->fit(1);
  a->save_checkpoint(good);
  const std::string resume = Learner::read_checkpoint(good).dump();
  struct Case {
    std::string name, key;
    torch::Tensor value;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"rng_size", "rng.cpu", torch::zeros({3}, torch::kUInt8),
       "has a damaged random generator state ('rng.cpu')"},
      {"rng_type", "rng.cpu", torch::zeros({5056}), "has a damaged random generator state"},
      {"rng_position", "rng.cpu", torch::zeros({5056}, torch::kUInt8),  // never seeded
       "has a damaged random generator state"},
      {"loss_sum", "loss_sum", torch::ones({3}), "has a damaged running loss: 'loss_sum' is float [3]"}};
  TinySetup other;
  other.seed = 1;  // other initial weights
  auto l = make_tiny_learner(other);
  const auto before = clone_params(*l->model());
  for (const auto& c : cases) {
    // A frugal archive whose other records are good (unsealed: as written before seals).
    torch::serialize::OutputArchive out, model;
    a->model()->save(model);
    out.write("frugal.format", c10::IValue(int64_t{1}));
    out.write("frugal.resume", c10::IValue(resume));
    out.write("model", model);
    out.write(c.key, c.value);
    const std::string path = dir.file(c.name + ".ckpt");
    out.save_to(path);
    const std::string msg = checkpoint_error_of([&] { l->load_checkpoint(path); });
    EXPECT_NE(msg.find("checkpoint '" + path + "' " + c.expect), std::string::npos) << c.name << ": " << msg;
    EXPECT_FALSE(l->pending_resume()) << c.name;
  }
  EXPECT_TRUE(params_equal(*l->model(), before)) << "no damaged file reached the model";
  l->load_checkpoint(good);
  l->fit(1);  // the good one resumes (a finished fit: nothing left to run)
  EXPECT_EQ(l->iteration(), a->iteration());
  EXPECT_FALSE(params_equal(*l->model(), before));
}

// Found by fuzz/checkpoint_resealed.cpp: an archive without a seal whose TorchScript record
// had changed crashed LibTorch's importer (SEGV); its pickle changed, LibTorch read on. The
// zip's own CRC32 of each record refuses both before LibTorch reads.
TEST(Hostile, AnUnsealedArchiveWithAChangedRecordIsRefusedBeforeLibTorchReadsIt) {
  TempDir dir;
  torch::serialize::OutputArchive out;
  out.write("frugal.format", c10::IValue(int64_t{1}));
  out.write("weights", torch::ones({3}));
  out.save_to(dir.file("plain.ckpt"));
  const std::string bytes = read_bytes(dir.file("plain.ckpt"));
  auto l = make_tiny_learner();
  for (const std::string record : {"/data.pkl", "/code/__torch__.py"}) {
    const size_t name = bytes.find(record);
    ASSERT_NE(name, std::string::npos) << record;
    // The record's data follows its local header, name and extra field (LibTorch's padding).
    const size_t head = bytes.rfind(std::string("PK\x03\x04", 4), name);
    ASSERT_NE(head, std::string::npos) << record;
    auto le16 = [&](size_t at) { return size_t(uint8_t(bytes[at])) | size_t(uint8_t(bytes[at + 1])) << 8; };
    const size_t data = head + 30 + le16(head + 26) + le16(head + 28) + 2;
    std::string b = bytes;
    b[data] = static_cast<char>(b[data] ^ 0x10);
    const std::string path = dir.file("changed.ckpt");
    write_bytes(path, b);
    const std::string msg = checkpoint_error_of([&] { l->load(path, false); });
    EXPECT_NE(msg.find("checkpoint '" + path + "' is damaged: changed record(s): " + record.substr(1)),
              std::string::npos)
        << record << ": " << msg;
  }
  // The unchanged archive passes the check (and is not a frugal model: no "model" record).
  EXPECT_NE(checkpoint_error_of([&] { l->load(dir.file("plain.ckpt"), false); }).find("has no model"),
            std::string::npos);
}

// Found by fuzz/checkpoint.cpp: the fuzzer learns to write a seal that matches its changes
// (it sees the comparison), so a sealed file can hold what LibTorch's writer never makes. A
// changed TorchScript record crashed LibTorch's importer (SEGV in parseClassConstant); an
// archive whose records were outside its folder, or without a version, leaked LibTorch's zip
// reader. zip_records.h checks the structure before LibTorch reads: each is refused, named.
TEST(Hostile, BytesAfterTheEndRecordAreRefusedBeforeLibTorchReadsTheArchive) {
  // LibTorch's zip reader takes the last end record it finds whatever follows it; frugal's
  // checks looked only for one ending the file, so a changed record behind such an end reached
  // LibTorch's TorchScript importer (SEGV: the CI's fuzz_checkpoint, stop 47)
  TempDir dir;
  auto l = make_tiny_learner();
  l->save(dir.file("good.ckpt"), false);
  const std::string bytes = read_bytes(dir.file("good.ckpt"));
  for (const std::string& tail : {std::string(100, 'Z'), std::string("PK\x05\x06") + std::string(30, '\0')}) {
    const std::string path = dir.file("tail.ckpt");
    write_bytes(path, bytes + tail);
    const std::string msg = checkpoint_error_of([&] { l->load(path, false); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("end-of-archive record"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(l->load(dir.file("good.ckpt"), false));
}

TEST(Hostile, ASealedArchiveLibTorchWouldNotWriteIsRefusedNamingWhy) {
  TempDir dir;
  auto l = make_tiny_learner();
  l->save(dir.file("good.ckpt"), false);
  const std::string bytes = read_bytes(dir.file("good.ckpt"));
  struct Change {
    std::string from, to, why;
  };
  // Each replacement keeps the length, so only the named thing changes.
  const std::vector<Change> changes = {
      {"  weight : Tensor", "  w : int = 3.0 #", "is not an attribute declaration"},
      // LibTorch 1.13 reads `__buffers__` as a list and crashed on the missing one (fuzz_checkpoint)
      {"  weight : Tensor", "  __buffers__ : T", "is not an attribute declaration"},
      {"/version", "/versiom", "has no version record"},
  };
  for (const Change& c : changes) {
    std::string b = bytes;
    const size_t at = b.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    for (size_t k = at; (k = b.find(c.from, k)) != std::string::npos; k += c.to.size()) b.replace(k, c.to.size(), c.to);
    // Sealed anew as file_seal.cpp does: the CRC32 of every byte before the comment's length.
    b.resize(b.size() - 21);
    char seal[32];
    std::snprintf(seal, sizeof(seal), "frugal-crc32 %08lx",
                  crc32(0L, reinterpret_cast<const Bytef*>(b.data()), static_cast<uInt>(b.size() - 2)));
    b += seal;
    const std::string path = dir.file("forged.ckpt");
    write_bytes(path, b);
    const std::string msg = checkpoint_error_of([&] { l->load(path, false); });
    EXPECT_NE(msg.find("'" + path + "' is not an archive LibTorch wrote"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.why), std::string::npos) << c.from << ": " << msg;
  }
}

/// Flips `trials` single bits at random offsets of the file `good` (a sealed archive) and
/// expects `load` to refuse every one with a CheckpointError naming the file.
void expect_every_flip_refused(const std::string& good, const std::string& flipped, int64_t trials,
                               uint64_t seed, const std::function<void(const std::string&)>& load) {
  const std::string bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), 64u);
  std::mt19937_64 rng(seed);
  int64_t in_tensors = 0;
  for (int64_t t = 0; t < trials; ++t) {
    std::string b = bytes;
    const size_t at = static_cast<size_t>(rng() % b.size());
    const int bit = static_cast<int>(rng() % 8);
    b[at] = static_cast<char>(b[at] ^ (1 << bit));
    write_bytes(flipped, b);
    const std::string msg = checkpoint_error_of([&] { load(flipped); });
    EXPECT_EQ(msg.find("not a CheckpointError"), std::string::npos) << msg;
    EXPECT_NE(msg.find(flipped), std::string::npos)
        << "byte " << at << " of " << b.size() << ", bit " << bit << ": " << msg;
    if (msg.find("(the tensor(s) '") != std::string::npos) ++in_tensors;
  }
  // Most of the file is tensor bytes: the error names the changed record.
  EXPECT_GT(in_tensors, 0) << "no flip was traced to a tensor's record";
}

TEST(Hostile, EveryFlippedBitOfACheckpointOrSavedModelIsRefused) {
  TempDir dir;
  const std::string ckpt = dir.file("good.ckpt"), model = dir.file("model.pt");
  {
    auto a = make_tiny_learner();
    a->fit(1);
    a->save_checkpoint(ckpt);
    a->save(model, /*with_opt=*/false);
  }
  auto l = make_tiny_learner();
  const auto before = clone_params(*l->model());
  expect_every_flip_refused(ckpt, dir.file("flipped.ckpt"), iterations(100), 11,
                            [&](const std::string& p) { l->load_checkpoint(p); });
  expect_every_flip_refused(model, dir.file("flipped.pt"), iterations(100) / 4, 12,
                            [&](const std::string& p) { l->load(p, /*with_opt=*/false); });
  EXPECT_TRUE(params_equal(*l->model(), before)) << "no damaged file reached the model";
  EXPECT_FALSE(l->pending_resume());
  l->load_checkpoint(ckpt);  // the sealed originals load
  l->load(model, false);
}

// ---- a callback that throws ------------------------------------------------------------------

/// Throws in one event (or in wrap_forward), at its first firing after the second optimizer
/// step (so a checkpoint exists), or at its first firing for before_fit. Keeps the bytes of
/// the checkpoint as they were when it threw.
struct Thrower : Callback {
  Thrower(std::optional<Event> e, std::string file) : event(e), ckpt(std::move(file)) {}
  std::string name() const override { return "thrower"; }
  bool wraps_forward() const override { return !event; }
  torch::Tensor wrap_forward(Learner& l, const torch::Tensor& x, const ForwardNext& next) override {
    if (l.training() && l.steps() >= 2) boom();
    return next(x);
  }
  void before_fit(Learner& l) override { at(l, Event::BeforeFit); }
  void before_stage(Learner& l) override { at(l, Event::BeforeStage); }
  void before_epoch(Learner& l) override { at(l, Event::BeforeEpoch); }
  void before_train(Learner& l) override { at(l, Event::BeforeTrain); }
  void before_batch(Learner& l) override { at(l, Event::BeforeBatch); }
  void before_forward(Learner& l) override { at(l, Event::BeforeForward); }
  void after_forward(Learner& l) override { at(l, Event::AfterForward); }
  void after_loss(Learner& l) override { at(l, Event::AfterLoss); }
  void before_backward(Learner& l) override { at(l, Event::BeforeBackward); }
  void after_backward(Learner& l) override { at(l, Event::AfterBackward); }
  void before_step(Learner& l) override { at(l, Event::BeforeStep); }
  void after_step(Learner& l) override { at(l, Event::AfterStep); }
  void after_batch(Learner& l) override { at(l, Event::AfterBatch); }
  void after_train(Learner& l) override { at(l, Event::AfterTrain); }
  void before_validate(Learner& l) override { at(l, Event::BeforeValidate); }
  void after_validate(Learner& l) override { at(l, Event::AfterValidate); }
  void after_epoch(Learner& l) override { at(l, Event::AfterEpoch); }
  void after_stage(Learner& l) override { at(l, Event::AfterStage); }
  void after_fit(Learner& l) override { at(l, Event::AfterFit); }
  void at(Learner& l, Event e) {
    if (event == e && (e == Event::BeforeFit || l.steps() >= 2)) boom();
  }
  [[noreturn]] void boom() {
    snapshot = fs::exists(ckpt) ? read_bytes(ckpt) : "";
    threw = true;
    throw std::runtime_error("the plugin broke");
  }
  std::optional<Event> event;
  std::string ckpt, snapshot;
  bool threw = false;
};

TEST(Hostile, ACallbackThrowingInAnyEventStopsTheFitNamingItAndKeepsTheCheckpoint) {
  TempDir dir;
  std::vector<std::optional<Event>> where(kAllEvents.begin(), kAllEvents.end());
  where.push_back(std::nullopt);  // wrap_forward
  for (const auto& e : where) {
    const std::string what = e ? std::string(to_string(*e)) : "wrap_forward";
    const std::string ckpt = dir.file(what + ".ckpt");
    auto l = make_tiny_learner();  // 4 batches an epoch, validated
    l->add_callback(std::make_shared<CheckpointWriter>(ckpt, 1, 0));
    auto thrower = std::make_shared<Thrower>(e, ckpt);
    l->add_callback(thrower);
    try {
      l->fit(std::vector<Stage>{make_stage("a", 1), make_stage("b", 1)});
      ADD_FAILURE() << what << ": the fit went on";
      continue;
    } catch (const CallbackError& err) {
      EXPECT_EQ(err.callback(), "thrower") << what;
      EXPECT_EQ(err.event(), what);
      EXPECT_NE(std::string(err.what()).find("the plugin broke"), std::string::npos) << err.what();
    }
    ASSERT_TRUE(thrower->threw) << what;
    if (e == Event::BeforeFit) {
      EXPECT_FALSE(fs::exists(ckpt));
      continue;
    }
    ASSERT_FALSE(thrower->snapshot.empty()) << what << ": a checkpoint existed before the error";
    EXPECT_EQ(read_bytes(ckpt), thrower->snapshot) << what << ": the checkpoint changed";
    auto again = make_tiny_learner();
    again->add_callback(std::make_shared<CheckpointWriter>(dir.file("again.ckpt"), 1, 0));
    again->load_checkpoint(ckpt);
    EXPECT_GE(again->pending_resume()->steps, 1) << what;
    again->fit(std::vector<Stage>{make_stage("a", 1), make_stage("b", 1)});
    EXPECT_EQ(again->iteration(), 8) << what << ": the resumed fit finished";
  }
}

TEST(Hostile, UnwritableCheckpointFolderIsReportedBeforeTraining) {
  TempDir dir;
  const std::string out = dir.file("out");
  fs::create_directories(out);
  write_text(out + "/checkpoints", "a file where the checkpoint folder goes");
  write_text(dir.file("run.toml"),
             "[run]\nout_dir = \"" + out + "\"\ncheckpoint_every = 2\n"
             "[data]\ndataset = \"synthetic\"\nsamples = 32\nimage_size = 8\nclasses = 4\n"
             "[model]\narch = \"mlp\"\n");
  auto r = run_cli("train " + dir.file("run.toml"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("output folder '" + out + "/checkpoints' cannot be created"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("training mlp"), std::string::npos) << "no training: " << r.output;
  EXPECT_FALSE(fs::exists(out + "/report.json"));
}

}  // namespace
}  // namespace frugal::test
