#include "io/archive.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "frugal/base/error.h"
#include "frugal/io/file_writer.h"
#include "io/file_seal.h"
#include "io/zip_records.h"

namespace frugal::archive {

namespace {

CheckpointError error(const std::string& path, const std::string& what) {
  return CheckpointError("checkpoint '" + path + "' " + what);
}

// LibTorch's Module::load replaces a tensor of another shape without a word: every shape is
// checked first, so a checkpoint of another model is refused before anything changes.
void check_shapes(torch::nn::Module& m, InputArchive& a, const std::string& prefix,
                  const std::string& path) {
  auto check = [&](const std::string& key, const torch::Tensor& now, bool buffer) {
    torch::Tensor saved;
    if (!a.try_read(key, saved, buffer))
      throw error(path, "does not fit this model: it has no '" + prefix + key + "'");
    if (saved.sizes() != now.sizes())
      throw error(path, "does not fit this model: '" + prefix + key + "' is " +
                            c10::str(saved.sizes()) + " there, " + c10::str(now.sizes()) + " here");
  };
  for (const auto& p : m.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : m.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& c : m.named_children()) {
    InputArchive sub;
    if (!a.try_read(c.key(), sub))
      throw error(path, "does not fit this model: it has no module '" + prefix + c.key() + "'");
    check_shapes(*c.value(), sub, prefix + c.key() + ".", path);
  }
}

// The name of the tensor in `a` (recursively, dotted) whose storage holds exactly `bytes`.
std::string tensor_holding(InputArchive& a, const std::string& prefix,
                           const std::vector<unsigned char>& bytes) {
  for (const auto& key : a.keys()) {
    torch::Tensor t;
    if (a.try_read(key, t) || a.try_read(key, t, /*is_buffer=*/true)) {
      const torch::Tensor c = t.cpu();
      const auto& s = c.storage();
      if (s.nbytes() == bytes.size() && std::memcmp(s.data(), bytes.data(), bytes.size()) == 0)
        return prefix + key;
      continue;
    }
    InputArchive sub;
    if (a.try_read(key, sub))
      if (auto found = tensor_holding(sub, prefix + key + ".", bytes); !found.empty()) return found;
  }
  return "";
}

// " (tensor 'model.stem.0.weight')": which tensors the changed records belong to, found by
// loading the damaged archive (LibTorch does not check the CRCs) and matching their bytes.
std::string changed_tensors(const std::string& path, const std::vector<seal::ChangedRecord>& records) {
  if (records.empty()) return "";
  // Only when nothing but tensor bytes changed: LibTorch's reader trusts the pickle and the
  // code records, and a damaged one can crash it (seen under ASan).
  for (const auto& r : records)
    if (r.name.rfind("data/", 0) != 0 || r.bytes.empty()) return "";
  std::string names;
  try {
    zip::check_file(path);
    InputArchive a;
    a.load_from(path, torch::kCPU);
    for (const auto& r : records) {
      if (r.bytes.empty()) continue;
      const std::string name = tensor_holding(a, "", r.bytes);
      if (!name.empty()) names += (names.empty() ? "" : ", ") + ("'" + name + "'");
    }
  } catch (const std::exception&) {  // too damaged to load: the records are named already
  }
  return names.empty() ? "" : " (the tensor(s) " + names + ")";
}

// JSON has no NaN (a diverged loss): it is stored as null.
double number(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : std::nan("");
}

nlohmann::json position_json(const FitPosition& p) {
  return {{"stage", p.stage},         {"epoch", p.epoch},           {"batch", p.batch},
          {"data_epoch", p.data_epoch}, {"iteration", p.iteration}, {"steps", p.steps},
          {"stop_epoch", p.stop_epoch}, {"stop_fit", p.stop_fit},   {"done", p.done}};
}

FitPosition position_from_json(const nlohmann::json& p) {
  return FitPosition{p.at("stage").get<int64_t>(),      p.at("epoch").get<int64_t>(),
                     p.at("batch").get<int64_t>(),      p.at("data_epoch").get<int64_t>(),
                     p.at("iteration").get<int64_t>(),  p.at("steps").get<int64_t>(),
                     p.at("stop_epoch").get<bool>(),    p.at("stop_fit").get<bool>(),
                     p.at("done").get<bool>()};
}

// Every field a resume reads, checked so that a damaged record fails before any work.
void check_resume_json(const nlohmann::json& j) {
  const auto& p = j.at("position");
  for (const char* k : {"stage", "epoch", "batch", "data_epoch", "iteration", "steps"})
    if (p.at(k).get<int64_t>() < 0) throw std::out_of_range(std::string("negative ") + k);
  for (const char* k : {"stop_epoch", "stop_fit", "done"}) (void)p.at(k).get<bool>();
  (void)j.at("stages").get<std::vector<std::string>>();
  (void)j.at("callbacks").get<std::vector<std::string>>();
  (void)j.at("optimizer").get<std::string>();
  (void)j.at("loss_count").get<int64_t>();
  if (!j.at("stats").is_array()) throw std::out_of_range("stats is not an array");
}

}  // namespace

// ---------------------------------------------------------------- writing

void write_header(OutputArchive& a) { a.write("frugal.format", c10::IValue(kFormat)); }

void write_model(OutputArchive& a, const torch::nn::Module& model) {
  OutputArchive sub;
  model.save(sub);
  a.write("model", sub);
}

void write_optimizer(OutputArchive& a, const torch::optim::Optimizer& opt, const std::string& name) {
  OutputArchive sub;
  opt.save(sub);
  a.write("optimizer", sub);
  a.write("optimizer.name", c10::IValue(name));
}

std::vector<char> optimizer_bytes(const torch::optim::Optimizer& opt, const std::string& name) {
  OutputArchive sub;
  write_optimizer(sub, opt, name);
  std::vector<char> out;
  sub.save_to([&](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
    return n;
  });
  return out;
}

namespace {
std::string rank_optimizer_key(int rank) { return "optimizer.rank" + std::to_string(rank); }
}  // namespace

void write_rank_optimizer(OutputArchive& a, int rank, const std::vector<char>& bytes) {
  const auto n = static_cast<int64_t>(bytes.size());
  torch::Tensor t = torch::empty({n}, torch::kByte);
  if (n) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  a.write(rank_optimizer_key(rank), t);
}

bool has_rank_optimizer(InputArchive& a, int rank) {
  torch::Tensor t;
  return a.try_read(rank_optimizer_key(rank), t);
}

void read_rank_optimizer(InputArchive& a, int rank, InputArchive& out, const torch::Device& device,
                         const std::string& path) {
  torch::Tensor t;
  if (!a.try_read(rank_optimizer_key(rank), t))
    throw error(path, "has no optimizer state for rank " + std::to_string(rank) + " ('" +
                          rank_optimizer_key(rank) + "')");
  if (t.scalar_type() != torch::kByte || t.dim() != 1)
    throw error(path, "has a damaged '" + rank_optimizer_key(rank) + "' record");
  t = t.contiguous();
  try {
    zip::check_bytes(static_cast<const unsigned char*>(t.data_ptr()), static_cast<uint64_t>(t.numel()));
    out.load_from(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()), device);
  } catch (const c10::Error& e) {
    throw error(path, "has a damaged '" + rank_optimizer_key(rank) + "' record: " +
                          first_line(e.what_without_backtrace()));
  } catch (const std::runtime_error& e) {  // zip::check_bytes
    throw error(path, "has a damaged '" + rank_optimizer_key(rank) + "' record: " + e.what());
  }
}

void write_callback_state(OutputArchive& a, const std::string& name, OutputArchive& state) {
  a.write("callbacks." + name, state);
}

void write_loss_sum(OutputArchive& a, const torch::Tensor& sum) { a.write("loss_sum", sum); }

void write_rng(OutputArchive& a, const RngState& rng) {
  a.write("rng.cpu", rng.cpu);
#ifdef FRUGAL_WITH_CUDA
  if (rng.cuda.defined()) a.write("rng.cuda", rng.cuda);
#endif
}

void write_file(OutputArchive& a, const std::string& path) {
  const std::filesystem::path target(path);
  try {
    if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
    write_file_atomic(path, [&](const std::string& tmp) {
      // Through a descriptor, not save_to(tmp): LibTorch's file writer does not say why a
      // write failed. LibTorch is never told of a failure: after one, its writer's destructor
      // writes the archive's end, fails again and terminates the process (pytorch#87997,
      // #156955). The first failure is kept (later writes do nothing); finish() throws it.
      FileWriter out(tmp);
      a.save_to([&](const void* data, size_t n) {
        out.write(data, n);
        return n;
      });
      out.finish();
      seal::seal_zip(tmp);  // the CRC32 open() checks, before the rename
    });
  } catch (const c10::Error& e) {
    throw CheckpointError("cannot write checkpoint '" + path + "': " + first_line(e.what_without_backtrace()));
  } catch (const std::filesystem::filesystem_error& e) {
    throw CheckpointError("cannot write checkpoint '" + path + "': " + e.code().message());
  } catch (const CheckpointError&) {
    throw;
  } catch (const Error& e) {
    throw CheckpointError("cannot write checkpoint '" + path + "': " + e.what());
  }
}

// ---------------------------------------------------------------- reading

void open(const std::string& path, const torch::Device& device, InputArchive& a) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw error(path, "does not exist");
  if (!std::filesystem::is_regular_file(path, ec)) throw error(path, "is not a file");
  try {
    seal::verify_zip(path);  // a flipped bit is refused before LibTorch reads a number
  } catch (const seal::SealError& e) {
    throw CheckpointError(e.what() + changed_tensors(path, e.records()) + seal::kDamageAdvice);
  }
  try {
    zip::check_file(path);  // LibTorch's readers trust the structure (zip_records.h)
  } catch (const std::runtime_error& e) {
    throw error(path, "is not an archive LibTorch wrote: " + std::string(e.what()));
  }
  try {
    a.load_from(path, device);
  } catch (const c10::Error& e) {
    throw error(path, "is unreadable (truncated, or not a checkpoint): " +
                          first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw error(path, "is unreadable (truncated, or not a checkpoint): " + first_line(e.what()));
  }
  c10::IValue format;
  if (!a.try_read("frugal.format", format))
    throw CheckpointError("'" + path + "' is not a frugal checkpoint (it has no frugal.format record)");
  if (!format.isInt() || format.toInt() != kFormat)
    throw error(path, "has format " + format.tagKind() + " " +
                          (format.isInt() ? std::to_string(format.toInt()) : "") +
                          "; this frugal reads format " + std::to_string(kFormat));
}

void load_model(torch::nn::Module& model, InputArchive& a, const std::string& path) {
  InputArchive sub;
  if (!a.try_read("model", sub)) throw error(path, "has no model");
  check_shapes(model, sub, "", path);
  try {
    model.load(sub);
  } catch (const c10::Error& e) {
    throw error(path, "does not fit this model: " + first_line(e.what_without_backtrace()));
  }
}

void load_optimizer(torch::optim::Optimizer& opt, const std::string& name, InputArchive& a,
                    const std::string& path, const std::string& fix) {
  InputArchive sub;
  if (!a.try_read("optimizer", sub)) throw error(path, "was saved without optimizer state" + fix);
  c10::IValue saved;
  if (a.try_read("optimizer.name", saved) && saved.isString() && saved.toStringRef() != name)
    throw error(path, "holds the state of optimizer '" + saved.toStringRef() + "', this learner uses '" +
                          name + "'" + fix);
  try {
    opt.load(sub);
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint '" + path + "': optimizer state does not fit: " +
                          first_line(e.what_without_backtrace()));
  }
}

bool read_callback_state(InputArchive& a, const std::string& name, InputArchive& state) {
  return a.try_read("callbacks." + name, state);
}

bool read_loss_sum(InputArchive& a, torch::Tensor& sum, const std::string& path) {
  if (!a.try_read("loss_sum", sum)) return false;
  if (sum.numel() != 1 || !sum.is_floating_point())
    throw error(path, "has a damaged running loss: 'loss_sum' is " + std::string(sum.dtype().name()) +
                          " " + c10::str(sum.sizes()) + ", not one number");
  return true;
}

void write_rank_rng(OutputArchive& a, int rank, const torch::Tensor& cpu_state) {
  a.write("rng.rank" + std::to_string(rank) + ".cpu", cpu_state.to(torch::kCPU));
}

std::optional<RngState> read_rng(InputArchive& a, const torch::Device& device, int rank,
                                 const std::string& path) {
  RngState s;
  const std::string key = rank > 0 ? "rng.rank" + std::to_string(rank) + ".cpu" : "rng.cpu";
  if (!a.try_read(key, s.cpu)) return std::nullopt;
  s.cpu = s.cpu.to(torch::kCPU);
  // Tried on a generator of its own first: LibTorch refuses a state of another size, type or
  // an invalid Mersenne Twister position with a c10::Error, which a resume would meet after
  // the model and the optimizer had changed.
  try {
    at::make_generator<at::CPUGeneratorImpl>().set_state(s.cpu);
  } catch (const c10::Error& e) {
    throw error(path, "has a damaged random generator state ('" + key + "'): " +
                          first_line(e.what_without_backtrace()));
  }
#ifdef FRUGAL_WITH_CUDA
  torch::Tensor cuda;
  if (device.is_cuda() && a.try_read("rng.cuda", cuda)) {
    s.cuda = cuda.to(torch::kCPU);
    s.device = device.has_index() ? device.index() : c10::DeviceIndex(0);
  }
#else
  (void)device;
#endif
  return s;
}

// ---------------------------------------------------------------- the resume record

nlohmann::json to_json(const ResumeRecord& r) {
  nlohmann::json stats = nlohmann::json::array();
  for (const auto& s : r.stats) stats.push_back(stats_to_json(s));
  return {{"position", position_json(r.position)},
          {"stages", r.stages},
          {"stage_epochs", r.stage_epochs},
          {"stats", stats},
          {"callbacks", r.callbacks},
          {"optimizer", r.optimizer},
          {"loss_count", r.loss_count},
          {"valid_accuracy", r.valid_accuracy},
          {"valid_sums", {r.valid_sums.loss_sum, r.valid_sums.count, r.valid_sums.correct, r.valid_sums.bytes}},
          {"info", r.info},
          {"optimizer_layout", r.optimizer_layout}};
}

void write_resume(OutputArchive& a, const ResumeRecord& r) {
  a.write("frugal.resume", c10::IValue(to_json(r).dump()));
}

nlohmann::json read_resume_json(InputArchive& a, const std::string& path) {
  c10::IValue text;
  if (!a.try_read("frugal.resume", text) || !text.isString())
    throw error(path, "holds no resume state (Learner::save wrote it): load it with load()");
  try {
    auto j = nlohmann::json::parse(text.toStringRef());
    check_resume_json(j);
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw error(path, "has a damaged resume record: " + std::string(e.what()));
  } catch (const std::out_of_range& e) {
    throw error(path, "has a damaged resume record: " + std::string(e.what()));
  }
}

ResumeRecord read_resume(InputArchive& a, const std::string& path) {
  const nlohmann::json j = read_resume_json(a, path);
  ResumeRecord r;
  r.position = position_from_json(j.at("position"));
  r.stages = j.at("stages").get<std::vector<std::string>>();
  if (auto it = j.find("stage_epochs"); it != j.end() && it->is_array() && it->size() == r.stages.size())
    for (const auto& e : *it)
      if (e.is_number_integer() && e.get<int64_t>() >= 0) r.stage_epochs.push_back(e.get<int64_t>());
  if (r.stage_epochs.size() != r.stages.size()) r.stage_epochs.clear();  // damaged: not extendable
  r.callbacks = j.at("callbacks").get<std::vector<std::string>>();
  r.optimizer = j.at("optimizer").get<std::string>();
  r.loss_count = j.at("loss_count").get<int64_t>();
  r.valid_accuracy = number(j, "valid_accuracy");
  if (std::isnan(r.valid_accuracy)) r.valid_accuracy = -1;
  // [loss, count, correct] (+ bytes since language models report bits per byte)
  if (auto it = j.find("valid_sums"); it != j.end() && it->is_array() && (it->size() == 3 || it->size() == 4) &&
                                      (*it)[0].is_number() && (*it)[1].is_number_integer() &&
                                      (*it)[2].is_number_integer()) {
    r.valid_sums = MetricSums{(*it)[0].get<double>(), (*it)[1].get<int64_t>(), (*it)[2].get<int64_t>()};
    if (it->size() == 4 && (*it)[3].is_number()) r.valid_sums.bytes = (*it)[3].get<double>();
  }
  r.info = j.value("info", nlohmann::json());
  r.optimizer_layout = j.value("optimizer_layout", nlohmann::json());
  try {
    for (const auto& s : j.at("stats")) r.stats.push_back(stats_from_json(s));
  } catch (const nlohmann::json::exception& e) {
    throw error(path, "has damaged stage statistics: " + std::string(e.what()));
  }
  return r;
}

nlohmann::json stats_to_json(const StageStats& s) {
  nlohmann::json steady = s.steady;
  return {{"name", s.name},
          {"peak_bytes", s.peak_bytes},
          {"phase_peaks", s.phase_peaks},
          {"steady", steady},
          {"steady_measured", s.steady_measured},
          {"step_seconds", s.step_seconds},
          {"samples", s.samples},
          {"train_seconds", s.train_seconds},
          {"last_epoch_loss", s.last_epoch_loss},
          {"valid_accuracy", s.valid_accuracy},
          {"valid_loss", s.valid_loss}};
}

StageStats stats_from_json(const nlohmann::json& j) {
  StageStats s;
  s.name = j.at("name").get<std::string>();
  s.peak_bytes = j.at("peak_bytes").get<int64_t>();
  s.phase_peaks = j.at("phase_peaks").get<std::array<int64_t, 4>>();
  const auto& b = j.at("steady");
  s.steady.parameters = b.value("parameters", int64_t{0});
  s.steady.gradients = b.value("gradients", int64_t{0});
  s.steady.optimizer_state = b.value("optimizer_state", int64_t{0});
  s.steady.activations = b.value("activations", int64_t{0});
  s.steady.data = b.value("data", int64_t{0});
  s.steady.callbacks = b.value("callbacks", int64_t{0});
  s.steady.other = b.value("other", int64_t{0});
  s.steady_measured = j.at("steady_measured").get<bool>();
  for (const auto& t : j.at("step_seconds"))
    s.step_seconds.push_back(t.is_number() ? t.get<double>() : 0.0);
  s.samples = j.at("samples").get<int64_t>();
  s.train_seconds = number(j, "train_seconds");
  s.last_epoch_loss = number(j, "last_epoch_loss");
  s.valid_accuracy = number(j, "valid_accuracy");
  s.valid_loss = j.contains("valid_loss") ? number(j, "valid_loss") : -1;
  return s;
}

}  // namespace frugal::archive
