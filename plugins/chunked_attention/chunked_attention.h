#pragma once
// chunked_attention: the model's attention modules (frugal::AttentionModule, the gpt's) switched
// to the memory-efficient kernel for the fit: probabilities in query x key tiles, never the
// whole B x H x T x T.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <frugal/core/learner.h>
#include <frugal/models/attention.h>
#include <frugal/plugin.h>

namespace frugal::chunked_attention {

struct ChunkedAttentionOptions : frugal::Options {
  int64_t query_chunk = 64;
  int64_t key_chunk = 0;  ///< 0: query_chunk
  void visit(frugal::FieldVisitor& v) override;
};

class ChunkedAttention : public frugal::Callback {
 public:
  ChunkedAttention(const ChunkedAttentionOptions& o, const frugal::PluginContext& ctx);
  std::string name() const override { return "chunked_attention"; }

  /// Sets the chunked kernel on every attention module; a model with none gets a warning that
  /// the plugin changes nothing.
  void before_fit(frugal::Learner& l) override;
  /// The modules get back the kernel each had (the plain one, for the gpt: the exported model
  /// and evaluate compute as without).
  void after_fit(frugal::Learner& l) override;

  /// Attention modules switched in the last fit.
  int64_t modules() const { return modules_; }

 private:
  ChunkedAttentionOptions o_;
  std::shared_ptr<spdlog::logger> log_;
  int64_t modules_ = 0;
  /// The modules switched and the kernel each had before the fit.
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, frugal::AttentionKernel>> before_;
};

}  // namespace frugal::chunked_attention
