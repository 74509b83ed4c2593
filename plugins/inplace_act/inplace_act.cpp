// inplace_act: activation modules in their in-place forms where a check on a real batch shows
// outputs and gradients unchanged.
#include "inplace_act.h"

#include <algorithm>
#include <cmath>

#include <frugal/base/error.h>
#include <frugal/memory/memory.h>
#include <frugal/base/rng.h>

namespace frugal::inplace_act {

namespace nn = torch::nn;

namespace {

// ---- the modules with an in-place form ----------------------------------------------------

namespace detail {
/// The module's type name and a pointer to its inplace flag, if T is the module's type.
template <class T>
bool match(nn::Module& m, const char* type, std::pair<const char*, bool*>& out) {
  auto* p = dynamic_cast<T*>(&m);
  if (!p) return false;
  out = {type, &p->options.inplace()};
  return true;
}
}  // namespace detail

/// The type name ("ReLU") and the inplace flag of a module that has an in-place form;
/// {nullptr, nullptr} for any other module. Threshold is left out: autograd keeps a copy of the
/// input of threshold_ (LibTorch 1.13), so in place saves nothing there.
std::pair<const char*, bool*> inplace_flag(nn::Module& m) {
  std::pair<const char*, bool*> f{nullptr, nullptr};
  detail::match<nn::ReLUImpl>(m, "ReLU", f) || detail::match<nn::ReLU6Impl>(m, "ReLU6", f) ||
      detail::match<nn::LeakyReLUImpl>(m, "LeakyReLU", f) ||
      detail::match<nn::HardtanhImpl>(m, "Hardtanh", f) ||
      detail::match<nn::ELUImpl>(m, "ELU", f) || detail::match<nn::SELUImpl>(m, "SELU", f) ||
      detail::match<nn::CELUImpl>(m, "CELU", f) || detail::match<nn::RReLUImpl>(m, "RReLU", f) ||
      detail::match<nn::DropoutImpl>(m, "Dropout", f) ||
      detail::match<nn::Dropout2dImpl>(m, "Dropout2d", f) ||
      detail::match<nn::Dropout3dImpl>(m, "Dropout3d", f) ||
      detail::match<nn::AlphaDropoutImpl>(m, "AlphaDropout", f) ||
      detail::match<nn::FeatureAlphaDropoutImpl>(m, "FeatureAlphaDropout", f);
  return f;
}

bool is_dropout(const std::string& type) { return type.find("Dropout") != std::string::npos; }

namespace detail {
/// Sequential-like containers (nn::Sequential and the zoo's Block, which derives from it) pass
/// one module's output to the next and to no one else.
void walk(const std::shared_ptr<nn::Module>& m, const std::string& prefix, bool chain_fed,
          bool top, std::vector<Site>& out) {
  const bool sequential = dynamic_cast<nn::SequentialImpl*>(m.get()) != nullptr;
  size_t k = 0;
  for (const auto& child : m->named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    const bool fed = sequential && (k > 0 || chain_fed);
    auto [type, flag] = inplace_flag(*child.value());
    if (type) {
      Site s;
      s.name = name;
      s.type = type;
      s.place = fed ? Place::Chain
                    : (sequential && top && k == 0 ? Place::ModelInput : Place::Opaque);
      s.module = child.value();
      s.flag = flag;
      s.was_inplace = *flag;
      out.push_back(std::move(s));
    } else {
      walk(child.value(), name, fed, top && sequential && k == 0, out);
    }
    ++k;
  }
}
}  // namespace detail

}  // namespace

std::vector<Site> find_sites(const std::shared_ptr<nn::Module>& model) {
  std::vector<Site> out;
  detail::walk(model, "", /*chain_fed=*/false, /*top=*/true, out);
  return out;
}

// ---- one forward and backward, leaving the model as it was --------------------------------

namespace {

/// What a check pass may change in the model and the process, restored after every pass:
/// gradients, buffers (BatchNorm's running statistics and batch counter), RNG, train modes.
class Snapshot {
 public:
  Snapshot(nn::Module& model, const torch::Device& device)
      : rng_(RngState::capture(device)) {
    for (auto& p : model.parameters()) {
      params_.push_back(p);
      grads_.push_back(p.grad());
    }
    torch::NoGradGuard no_grad;
    for (auto& b : model.buffers()) {
      buffers_.push_back(b);
      saved_buffers_.push_back(b.clone());
    }
    for (auto& m : model.modules()) modes_.emplace_back(m, m->is_training());
  }
  /// Gradients to none, so a pass starts from nothing (and never adds into a kept gradient).
  void clear_grads() {
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  }
  void restore() {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = grads_[i];
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_buffers_[i]);
    for (auto& [m, training] : modes_) m->train(training);
    rng_.restore();
  }
  const RngState& rng() const { return rng_; }

 private:
  RngState rng_;
  std::vector<torch::Tensor> params_, grads_, buffers_, saved_buffers_;
  std::vector<std::pair<std::shared_ptr<nn::Module>, bool>> modes_;
};

/// What one pass produced: the output, the loss and every parameter's gradient; or why it failed.
struct Pass {
  bool ok = false;
  std::string error;  ///< autograd's or the forward's message when !ok
  torch::Tensor pred, loss;
  std::vector<torch::Tensor> grads;
  int64_t peak = 0;   ///< live bytes the pass added at its peak (forward and backward)
};

/// The first line of an error, without autograd's hint about Python's anomaly mode.
std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  const auto hint = line.find(" Hint: enable anomaly detection");
  return hint == std::string::npos ? line : line.substr(0, hint);
}

/// One training forward, loss and backward on (x, y), from the snapshot's RNG and buffers.
/// The snapshot is restored afterwards (also when the pass throws). The pass reads a copy of x:
/// a module that overwrites its input is caught by the copy's version counter and cannot
/// corrupt the batch (or the dataset it may view) for the next pass.
Pass run_pass(torch::nn::Sequential& model, const LossFn& loss_fn, const torch::Tensor& x,
              const torch::Tensor& y, Snapshot& snap) {
  Pass r;
  snap.rng().restore();
  snap.clear_grads();
  const torch::Tensor input = x.clone();
  const auto version = input._version();
  MemoryMeter& mm = MemoryMeter::get();
  const int64_t start = mm.current();
  MemoryWindow window = mm.open_window();
  try {
    model->train();
    torch::Tensor pred = model->forward(input);
    torch::Tensor loss = loss_fn(pred, y);
    loss.backward();
    r.peak = window.peak() - start;
    if (input._version() != version)
      r.error = "the model's input was overwritten in place";
    else
      r.ok = true;
    r.pred = pred.detach();
    r.loss = loss.detach();
    for (auto& p : model->parameters())
      r.grads.push_back(p.grad().defined() ? p.grad().detach() : torch::Tensor());
  } catch (const c10::Error& e) {
    r.error = first_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    r.error = first_line(e.what());
  }
  snap.restore();
  return r;
}

/// Largest |a - b| relative to `scale` (0 when equal; +inf when only one is defined, the shapes
/// differ or a difference is not finite).
double relative_difference(const torch::Tensor& a, const torch::Tensor& b, double scale) {
  if (a.defined() != b.defined()) return INFINITY;
  if (!a.defined()) return 0;
  if (a.sizes() != b.sizes()) return INFINITY;
  torch::NoGradGuard no_grad;
  const double diff = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  if (diff == 0) return 0;
  if (!std::isfinite(diff)) return INFINITY;
  return scale > 0 ? diff / scale : INFINITY;
}

double max_abs(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.abs().max().item<double>() : 0.0;
}

/// The largest relative difference between two passes, and where. The output is measured
/// against its own largest entry; every gradient against the largest gradient entry of the
/// model: a gradient that is rounding noise (a conv bias before BatchNorm, zero in exact
/// arithmetic) differs by 100% of itself under any change of rounding and is no evidence.
struct Difference {
  double value = 0;
  std::string where;
};
Difference difference(const Pass& ref, const Pass& got,
                      const std::vector<std::string>& param_names) {
  Difference d{relative_difference(ref.pred, got.pred, max_abs(ref.pred)), "the model's output"};
  double scale = 0;
  for (const auto& g : ref.grads) scale = std::max(scale, max_abs(g));
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    const double v = i < got.grads.size() ? relative_difference(ref.grads[i], got.grads[i], scale)
                                          : INFINITY;
    if (v > d.value)
      d = {v, "the gradient of " + (i < param_names.size() ? param_names[i] : std::to_string(i))};
  }
  return d;
}

}  // namespace

// ---- the decision -------------------------------------------------------------------------

namespace {

/// Why `site` is not tried under `s` on `device` ("" when it is a candidate).
std::string why_not_tried(const Site& site, const Settings& s, const torch::Device& device) {
  const bool excluded = std::any_of(s.exclude.begin(), s.exclude.end(), [&](const std::string& e) {
    return site.name == e || site.name.rfind(e + ".", 0) == 0;
  });
  if (site.was_inplace) return "already in place";
  if (excluded) return "excluded by the exclude option";
  if (site.place == Place::ModelInput) return "its input is the model's input (the batch)";
  if (site.place == Place::Opaque && !s.custom_modules)
    return "inside a custom module (custom_modules = false)";
  if (site.place == Place::Opaque && !s.verify)
    return "inside a custom module, whose forward only the check can judge (verify = false)";
  if (is_dropout(site.type) && !s.dropout) return "dropout (dropout = false)";
  if (is_dropout(site.type) && !device.is_cpu())
    return "dropout on " + device.str() +
           ": the out-of-place kernel keeps a 1-byte mask, the in-place one a full-width one";
  return "";
}

void set_inplace(const std::vector<Site>& sites, bool on) {
  for (const auto& c : sites) *c.flag = on;
}

/// apply's check: the candidates together, else one at a time in forward order.
void verify(torch::nn::Sequential& model, const LossFn& loss_fn, const torch::Tensor& x,
            const torch::Tensor& y, const torch::Device& device, const Settings& s,
            const std::vector<Site>& candidates, Outcome& out) {
  std::vector<std::string> names;
  for (const auto& np : model->named_parameters()) names.push_back(np.key());
  Snapshot snap(*model, device);
  const Pass ref = run_pass(model, loss_fn, x, y, snap);
  ++out.passes;
  if (!ref.ok) {
    // Not the plugin's to fail the fit for: the first training batch will say what is wrong.
    out.check_error = ref.error;
    for (auto& c : candidates) out.skipped.emplace_back(c, "the check could not run");
    return;
  }
  // A set is accepted when it is exact and its pass peaks no higher than the best accepted one:
  // in place on a view (after Flatten) makes autograd copy the base in backward (CopySlices).
  int64_t best_peak = ref.peak;
  auto verdict = [&](const Pass& p) -> std::string {
    if (!p.ok) return p.error;
    const Difference d = difference(ref, p, names);
    if (d.value > s.tolerance)
      return d.where + " differs from the out-of-place run (relative difference " +
             std::to_string(d.value) + " > tolerance " + std::to_string(s.tolerance) + ")";
    if (p.peak > best_peak)
      return "in place raises the peak of a forward and backward from " + format_bytes(best_peak) +
             " to " + format_bytes(p.peak);
    out.max_difference = d.value;
    best_peak = p.peak;
    out.peak_before = ref.peak;
    out.peak_after = p.peak;
    return "";
  };

  set_inplace(candidates, true);
  ++out.passes;
  if (verdict(run_pass(model, loss_fn, x, y, snap)).empty()) {
    out.changed = candidates;
    return;
  }
  // Some site breaks it: add them one at a time, in forward order, keeping those that pass.
  set_inplace(candidates, false);
  for (const auto& c : candidates) {
    *c.flag = true;
    ++out.passes;
    const std::string why = verdict(run_pass(model, loss_fn, x, y, snap));
    if (why.empty()) {
      out.changed.push_back(c);
    } else {
      *c.flag = false;
      out.reverted.emplace_back(c, why);
    }
  }
}

}  // namespace

Outcome apply(torch::nn::Sequential& model, const LossFn& loss_fn, const torch::Tensor& x,
              const torch::Tensor& y, const torch::Device& device, const Settings& s) {
  Outcome out;
  std::vector<Site> candidates;
  for (auto& site : find_sites(model.ptr())) {
    const std::string why = why_not_tried(site, s, device);
    if (why.empty())
      candidates.push_back(site);
    else
      out.skipped.emplace_back(site, why);
  }
  if (candidates.empty()) return out;
  if (!s.verify) {
    set_inplace(candidates, true);
    out.changed = candidates;
    return out;
  }
  verify(model, loss_fn, x, y, device, s, candidates, out);
  return out;
}

std::string describe(const std::vector<Site>& sites) {
  std::string s;
  for (const auto& x : sites) s += (s.empty() ? "" : ", ") + x.label();
  return s.empty() ? "none" : s;
}

// ---- the plugin ---------------------------------------------------------------------------

void InplaceActOptions::visit(frugal::FieldVisitor& v) {
  v.field("verify", verify,
          "check on the first training batch that outputs and gradients are unchanged and "
          "autograd finds no overwritten saved tensor; failing modules are reverted");
  v.field("custom_modules", custom_modules,
          "also try activation modules registered inside modules with their own forward "
          "(residual blocks); only with verify, the check is what makes them safe");
  v.field("dropout", dropout,
          "also try the Dropout family (cpu only); off by default: its mask is saved either "
          "way, and in place on a view (after Flatten) costs two extra tensors in backward");
  v.field("tolerance", tolerance,
          "largest difference the check accepts, relative to the output's largest entry "
          "and to the largest gradient entry",
          frugal::at_least(0));
  v.field("exclude", exclude, "module names (or name prefixes) left out-of-place");
}

InplaceAct::InplaceAct(const InplaceActOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger) {}

void InplaceAct::before_fit(frugal::Learner& l) {
  torch::Tensor x, y;
  if (o_.verify) {
    if (l.train_data().num_batches() == 0) {
      log_->warn("no training batch to check on: nothing changed");
      return;
    }
    // The loader resizes to the stage's image size only once the stage begins: the check
    // uses the first stage's size already (a model may take that size only).
    DataLoader& data = l.train_data();
    const int64_t size = data.image_size();
    if (l.stage_index() == 0) data.set_image_size(l.stage().image_size);
    const Batch b = data.batch(0);
    data.set_image_size(size);
    x = b.x;
    y = b.y;
  }
  outcome_ = apply(l.model(), l.loss_fn(), x, y, l.device(), o_.settings());
  if (!outcome_.check_error.empty()) {
    log_->warn("nothing changed: the model's own forward and backward failed on the first "
               "batch: {}", outcome_.check_error);
    return;
  }
  for (const auto& [site, why] : outcome_.reverted)
    log_->warn("{} stays out of place: {}", site.label(), why);
  for (const auto& [site, why] : outcome_.skipped)
    log_->debug("{} not tried: {}", site.label(), why);
  log_->info("in place: {} ({} of {} activation modules; {} reverted, {} not tried; "
             "{} check passes, largest relative difference {}, check peak {} -> {})",
             describe(outcome_.changed), outcome_.changed.size(),
             outcome_.changed.size() + outcome_.reverted.size() + outcome_.skipped.size(),
             outcome_.reverted.size(), outcome_.skipped.size(), outcome_.passes,
             outcome_.max_difference, format_bytes(outcome_.peak_before),
             format_bytes(outcome_.peak_after));
}

void InplaceAct::after_fit(frugal::Learner&) {
  for (const auto& s : outcome_.changed) *s.flag = s.was_inplace;
}

}  // namespace frugal::inplace_act

FRUGAL_PLUGIN(frugal::inplace_act::InplaceAct, frugal::inplace_act::InplaceActOptions,
              "inplace_act",
              "activations (ReLU, ELU, Dropout, ...) in place where a check on a batch allows it",
              "1.0.0")
