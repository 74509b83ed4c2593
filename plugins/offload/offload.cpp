// offload: the optimizer's state in memory-mapped files on disk, stepped in place.
#include "offload.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <typeinfo>

#include <c10/core/CPUAllocator.h>
#include <frugal/base/compat.h>
#include <frugal/base/error.h>
#include <frugal/memory/memory.h>
#include <frugal/optim/adafactor.h>
#include <frugal/optim/adam8bit.h>

namespace frugal::offload {

namespace {

namespace fs = std::filesystem;

// One shared file mapping; unmapped when the last tensor using it dies.
struct Segment {
  char* base = nullptr;
  size_t bytes = 0;
  bool scratch = false;  // one allocation of a redirected step: packed into a segment later
  ~Segment();
};

// The live segments by base address: on_disk looks a pointer up, drop_pages walks them.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<uintptr_t, Segment*>& registry() {
  static std::map<uintptr_t, Segment*> r;
  return r;
}

Segment::~Segment() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(reinterpret_cast<uintptr_t>(base));
  }
  munmap(base, bytes);
}

// A tensor's DataPtr context: a reference to its segment.
void release(void* ctx) { delete static_cast<std::shared_ptr<Segment>*>(ctx); }

// A DataPtr onto bytes of `seg`, holding it. Its deleter tells the meter the bytes are on disk
// (frugal::resident, on_disk below): registered before the first such pointer exists.
c10::DataPtr segment_ptr(char* p, const std::shared_ptr<Segment>& seg) {
  static const bool registered = (frugal::register_offloaded_deleter(&release), true);
  (void)registered;
  return {p, new std::shared_ptr<Segment>(seg), &release, c10::Device(c10::kCPU)};
}

constexpr size_t kAlign = 64;
size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

[[noreturn]] void fail(const std::string& what, const std::string& path, int err) {
  throw frugal::Error("plugins.offload: " + what + " '" + path + "': " + std::strerror(err));
}

// A file of `bytes` in `dir`, reserved, mapped shared and already unlinked.
std::shared_ptr<Segment> make_segment(const std::string& dir, size_t bytes, bool scratch) {
  static std::atomic<int64_t> counter{0};
  const std::string path = (fs::path(dir) / ("frugal-offload-" + std::to_string(::getpid()) + "-" +
                                             std::to_string(counter++) + ".bin"))
                               .string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail("cannot create", path, errno);
  const auto close_and_fail = [&](const std::string& what, int err) {
    ::unlink(path.c_str());
    ::close(fd);
    fail(what, path, err);
  };
  if (const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)))
    close_and_fail("no room for " + frugal::format_bytes(static_cast<int64_t>(bytes)) + " in", err);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) close_and_fail("cannot map", errno);
  ::unlink(path.c_str());  // the mapping keeps the blocks; nothing outlives the process
  ::close(fd);
  auto s = std::make_shared<Segment>();
  s->base = static_cast<char*>(p);
  s->bytes = bytes;
  s->scratch = scratch;
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[reinterpret_cast<uintptr_t>(s->base)] = s.get();
  return s;
}

// While set on a thread, that thread's CPU allocations come from segments of their own: the
// optimizer's first step creates its state there, never in the allocator's memory.
thread_local const std::string* tl_redirect_dir = nullptr;

// Installed as LibTorch's CPU allocator only around a redirected step; never deleted, since a
// storage made meanwhile keeps a pointer to the allocator that made it (a resize calls it).
class RedirectingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) FRUGAL_ALLOCATE_CONST override {
    if (!tl_redirect_dir || n == 0) return next_.load()->allocate(n);
    const std::shared_ptr<Segment> seg = make_segment(*tl_redirect_dir, aligned(n), /*scratch=*/true);
    return segment_ptr(seg->base, seg);
  }
  // raw_allocate needs data == context, which a segment's pointer is not: no raw deleter.
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  FRUGAL_ALLOCATOR_COPY_DATA

  std::atomic<c10::Allocator*> next_{nullptr};  // the allocator it stands above
};

RedirectingAllocator& redirecting_allocator() {
  static auto* a = new RedirectingAllocator();
  return *a;
}

// Above frugal's caching allocator (priority 100), so SetCPUAllocator takes it, and the one
// before it can be put back.
constexpr uint8_t kRedirectPriority = 101;

}  // namespace

std::optional<std::vector<torch::Tensor>> state_tensors(torch::optim::OptimizerParamState& s) {
  namespace o = torch::optim;
  std::vector<torch::Tensor> out;
  // TORCH_ARG getters return a const reference; read them through a copy of the handle.
  const auto get = [](const torch::Tensor& t) { return t; };
  if (auto* a = dynamic_cast<o::AdamParamState*>(&s))
    out = {get(a->exp_avg()), get(a->exp_avg_sq()), get(a->max_exp_avg_sq())};
  else if (auto* w = dynamic_cast<o::AdamWParamState*>(&s))
    out = {get(w->exp_avg()), get(w->exp_avg_sq()), get(w->max_exp_avg_sq())};
  else if (auto* g = dynamic_cast<o::SGDParamState*>(&s))
    out = {get(g->momentum_buffer())};
  else if (auto* r = dynamic_cast<o::RMSpropParamState*>(&s))
    out = {get(r->square_avg()), get(r->momentum_buffer()), get(r->grad_avg())};
  else if (auto* d = dynamic_cast<o::AdagradParamState*>(&s))
    out = {get(d->sum())};
  else if (auto* f = dynamic_cast<frugal::AdafactorParamState*>(&s))
    out = {get(f->exp_avg_sq_row()), get(f->exp_avg_sq_col()), get(f->exp_avg_sq()), get(f->exp_avg())};
  else if (auto* q = dynamic_cast<frugal::Adam8bitParamState*>(&s))
    out = {get(q->exp_avg()),          get(q->exp_avg_sq()),       get(q->exp_avg_codes()),
           get(q->exp_avg_absmax()),   get(q->exp_avg_sq_codes()), get(q->exp_avg_sq_absmax())};
  else
    return std::nullopt;
  return out;
}

Moved move_to_disk(const std::vector<torch::Tensor>& ts, const std::string& dir) {
  std::vector<torch::Tensor> todo;
  size_t total = 0;
  for (const auto& t : ts) {
    if (!t.defined() || t.numel() == 0 || !t.device().is_cpu() || packed_on_disk(t)) continue;
    todo.push_back(t);
    total += aligned(t.numel() * t.element_size());
  }
  if (todo.empty()) return {};
  const std::shared_ptr<Segment> seg = make_segment(dir, total, /*scratch=*/false);
  torch::NoGradGuard no_grad;
  Moved m;
  size_t at = 0;
  for (auto& t : todo) {
    const size_t n = t.numel() * t.element_size();
    char* p = seg->base + at;
    torch::from_blob(p, t.sizes(), t.options()).copy_(t);
    c10::Storage storage(c10::Storage::use_byte_size_t(), n, segment_ptr(p, seg),
                         /*allocator=*/nullptr, /*resizable=*/false);
    t.set_(storage, 0, t.sizes());  // the same tensor (the optimizer's handle) on the file's bytes
    at += aligned(n);
    ++m.tensors;
    m.bytes += static_cast<int64_t>(n);
  }
  return m;
}

namespace {
// Whether t's bytes are in a packed segment (not a scratch one the first step made).
bool in_packed_segment(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.storage().data()) return false;
  const auto p = reinterpret_cast<uintptr_t>(t.storage().data());
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().upper_bound(p);
  if (it == registry().begin()) return false;
  --it;
  return p < it->first + it->second->bytes && !it->second->scratch;
}
}  // namespace

// Every segment's DataPtr has our deleter (registered with the meter in the constructor).
bool on_disk(const torch::Tensor& t) { return t.defined() && !frugal::resident(t); }
bool packed_on_disk(const torch::Tensor& t) { return in_packed_segment(t); }

int64_t disk_bytes() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  int64_t n = 0;
  for (const auto& [base, s] : registry()) n += static_cast<int64_t>(s->bytes);
  return n;
}

int64_t drop_pages() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  int64_t n = 0;
  for (const auto& [base, s] : registry())
    if (::madvise(s->base, s->bytes, MADV_DONTNEED) == 0) n += static_cast<int64_t>(s->bytes);
  return n;
}

// ---- the plugin ---------------------------------------------------------------------------

void OffloadOptions::visit(frugal::FieldVisitor& v) {
  // Where the state lives does not change a number the run computes.
  v.field("to", to,
          frugal::outside_training("where the optimizer state goes: \"disk\" (a CPU run: "
                                   "memory-mapped files) or \"cpu\" (a CUDA run: host memory, "
                                   "pinned; the step runs on the host over copies of the "
                                   "parameters, ZeRO-Offload)"),
          {"disk", "cpu"});
  v.field("dir", dir,
          frugal::outside_training("to = \"disk\": the folder of the state files (unlinked as "
                                   "soon as mapped); default: <run.out_dir>/offload, or the "
                                   "system's temp folder"));
  v.field("drop_pages", drop_pages,
          frugal::outside_training("to = \"disk\": after each step, drop the state's pages from "
                                   "the process (they stay in the file and the page cache)"));
  v.field("parameters", parameters,
          frugal::outside_training("to = \"disk\": keep the parameters the optimizer steps in "
                                   "the files too (with zero, this rank's share; stage 3 gathers "
                                   "the others into memory for each unit): the forward reads "
                                   "them from the page cache, the step writes them in place"));
}

void OffloadOptions::check() const {
  if (to != "cpu") return;
  const auto refuse = [](const std::string& key) {
    frugal::throw_config_error("plugins.offload." + key +
                               " applies to to = \"disk\" only (this to = \"cpu\": the state "
                               "lives in host memory, the parameters on the device): remove it");
  };
  if (!dir.empty()) refuse("dir");
  if (!drop_pages) refuse("drop_pages");
  if (parameters) refuse("parameters");
}

frugal::CallbackRelations Offload::relations() const {
  if (!host()) return {};
  return {{}, {"step_in_backward"}, false};
}

Offload::Offload(const OffloadOptions& o, const frugal::PluginContext& ctx) : o_(o), log_(ctx.logger) {}

void Offload::attach(frugal::Learner& l) {
  const torch::Device d = l.device();
  if (!host() && !d.is_cpu())
    frugal::throw_config_error(
        "plugins.offload.to = \"disk\" keeps the optimizer state of a CPU run on disk; this run "
        "is on " + d.str() + ": set plugins.offload.to = \"cpu\" (the state in pinned host "
        "memory, stepped on the host) or remove [plugins.offload]");
  if (host() && !d.is_cuda() && !host_on_cpu_)
    frugal::throw_config_error(
        "plugins.offload.to = \"cpu\" moves a CUDA run's optimizer step and state to host "
        "memory; this run is on " + d.str() + ", already host memory: set plugins.offload.to = "
        "\"disk\" (memory-mapped files) or remove [plugins.offload]");
}

void Offload::before_fit(frugal::Learner& l) {
  if (host()) {
    host_.emplace(l.device());
    host_for_ = -1;
    l.set_optimizer_state_offloaded(true);  // the device never holds it
    return;
  }
  l.set_optimizer_state_offloaded(true);
  moved_ = {};
  unknown_ = 0;
  redirected_for_ = -1;
  scanned_at_ = {-1, -1};
  dir_ = !o_.dir.empty()                     ? o_.dir
         : !l.run_info().out_dir.empty() ? (fs::path(l.run_info().out_dir) / "offload").string()
                                             : fs::temp_directory_path().string();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    frugal::throw_config_error("plugins.offload.dir = \"" + dir_ + "\": not a folder it can create (" +
                               ec.message() + ")");
  struct statfs fs_info {};
  if (::statfs(dir_.c_str(), &fs_info) == 0 && fs_info.f_type == TMPFS_MAGIC)
    log_->warn("{} is on a tmpfs, which lives in memory: the state would stay there; set "
               "plugins.offload.dir to a folder on a disk", dir_);
  parameters_moved_ = {};
  move_parameters(l);
}

// The optimizer's parameters (each rank's share under zero: it runs after zero's before_fit),
// moved once; a stage's or a swap's new optimizer steps the same tensors, already there.
void Offload::move_parameters(frugal::Learner& l) {
  parameters_at_ = l.optimizer_changes();
  if (!o_.parameters) return;
  std::vector<torch::Tensor> ps;
  for (const auto& g : l.optimizer().param_groups())
    for (const auto& p : g.params())
      if (!packed_on_disk(p)) ps.push_back(p);
  const Moved m = move_to_disk(ps, dir_);
  parameters_moved_.tensors += m.tensors;
  parameters_moved_.bytes += m.bytes;
}

Offload::~Offload() { end_redirect(); }

void Offload::begin_redirect() {
  RedirectingAllocator& r = redirecting_allocator();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != &r) {
    r.next_ = current;
    c10::SetCPUAllocator(&r, kRedirectPriority);
  }
  tl_redirect_dir = &dir_;
}

void Offload::end_redirect() {
  tl_redirect_dir = nullptr;
  RedirectingAllocator& r = redirecting_allocator();
  if (c10::GetCPUAllocator() == &r) c10::SetCPUAllocator(r.next_.load(), kRedirectPriority);
}

// The first step of each optimizer (a fit's, a stage's own, optim_swap's, zero's shard) creates
// its state: on disk, through the redirect. Last of the before_step hooks: nothing but the
// step (and callbacks told of an optimizer replaced) runs between here and after_step.
void Offload::before_step(frugal::Learner& l) {
  if (host_) {
    if (l.step_skipped() || l.batch_skipped()) return;
    if (l.optimizer_changes() != host_for_) {  // another optimizer: its own masters
      host_->reset();
      host_for_ = l.optimizer_changes();
    }
    host_->to_host(l.optimizer());
    return;
  }
  if (l.step_skipped() || l.batch_skipped() || l.optimizer_changes() == redirected_for_) return;
  redirected_for_ = l.optimizer_changes();
  begin_redirect();
}

void Offload::after_step(frugal::Learner&) {
  if (host_ && host_->on_host()) host_->to_device(/*stepped=*/true);
  end_redirect();
}

// A step that failed, or did not come (another callback skipped it after before_step): the
// parameters point at their device storage again.
void Offload::back_to_device() {
  if (host_ && host_->on_host()) host_->to_device(/*stepped=*/false);
}

void Offload::before_stage(frugal::Learner&) { redirected_for_ = -1; }

void Offload::after_batch(frugal::Learner& l) {
  back_to_device();
  if (host_) return;
  end_redirect();  // also when the step failed
  // New state comes with a step or another optimizer (a resume's loads before its first step):
  // an accumulation group's inner batches have nothing to move or drop.
  const std::pair<int64_t, int64_t> now{l.steps(), l.optimizer_changes()};
  if (now == scanned_at_) return;
  scanned_at_ = now;
  std::vector<torch::Tensor> fresh;
  for (auto& kv : l.optimizer().state()) {
    auto ts = state_tensors(*kv.second);
    if (!ts) {
      if (unknown_++ == 0)
        log_->warn("the optimizer's state type {} is not one it knows: its tensors stay in memory",
                   typeid(*kv.second).name());
      continue;
    }
    for (auto& t : *ts)
      if (t.defined() && !packed_on_disk(t)) fresh.push_back(t);
  }
  const Moved m = move_to_disk(fresh, dir_);
  moved_.tensors += m.tensors;
  moved_.bytes += m.bytes;
  if (l.optimizer_changes() != parameters_at_) move_parameters(l);  // a new optimizer's, once
  if (o_.drop_pages) drop_pages();
}

StateBytes state_bytes(torch::optim::Optimizer& opt) {
  StateBytes b;
  for (auto& kv : opt.state()) {
    const auto ts = state_tensors(*kv.second);
    if (!ts) continue;
    for (const auto& t : *ts)
      if (t.defined()) (on_disk(t) ? b.on_disk : b.in_memory) += static_cast<int64_t>(t.nbytes());
  }
  return b;
}

void Offload::release_caches(frugal::Learner&) {
  back_to_device();
  end_redirect();
}

void Offload::after_fit(frugal::Learner& l) {
  end_redirect();
  if (host_) {
    back_to_device();
    const HostStep::Bytes b = host_->bytes();
    log_->info("the step ran on the host: masters {}, gradients {}, optimizer state {} in {} host "
               "memory{}",
               frugal::format_bytes(b.masters), frugal::format_bytes(b.gradients),
               frugal::format_bytes(b.state), l.device().is_cuda() ? "pinned" : "plain",
               host_->unknown_states() ? "; states of an unknown type stayed where the step made them" : "");
    host_->release_buffers();  // the masters and gradient buffers go; the state is the optimizer's
    return;
  }
  const StateBytes b = state_bytes(l.optimizer());
  log_->info("optimizer state: {} in memory-mapped files in {}, {} in memory ({} moved in {} "
             "tensors over the fit{})",
             frugal::format_bytes(b.on_disk), dir_, frugal::format_bytes(b.in_memory),
             frugal::format_bytes(moved_.bytes), moved_.tensors,
             unknown_ ? "; states of an unknown type stayed in memory" : "");
  if (o_.parameters)
    log_->info("parameters: {} in {} tensors in memory-mapped files", frugal::format_bytes(parameters_moved_.bytes),
               parameters_moved_.tensors);
}

}  // namespace frugal::offload

FRUGAL_PLUGIN(frugal::offload::Offload, frugal::offload::OffloadOptions, "offload",
              "keeps the optimizer state in memory-mapped files on disk, stepped in place "
              "(ZeRO-Infinity's offload, for the CPU)",
              "1.0.0")
