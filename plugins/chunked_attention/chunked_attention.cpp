// chunked_attention: the memory-efficient attention kernel for the fit's attention modules.
#include "chunked_attention.h"

namespace frugal::chunked_attention {

void ChunkedAttentionOptions::visit(frugal::FieldVisitor& v) {
  v.field("query_chunk", query_chunk,
          "queries per tile: the probabilities alive at once are B x heads x query_chunk x key_chunk",
          frugal::at_least(1));
  v.field("key_chunk", key_chunk, "keys per tile (0: query_chunk)", frugal::at_least(0));
}

ChunkedAttention::ChunkedAttention(const ChunkedAttentionOptions& o, const frugal::PluginContext& ctx)
    : o_(o), log_(ctx.logger) {}

void ChunkedAttention::before_fit(frugal::Learner& l) {
  frugal::AttentionKernel k;
  k.query_chunk = o_.query_chunk;
  k.key_chunk = o_.key_chunk > 0 ? o_.key_chunk : o_.query_chunk;
  before_.clear();
  for (const auto& m : l.model()->modules(/*include_self=*/true))
    if (auto* a = dynamic_cast<frugal::AttentionModule*>(m.get())) {
      before_.emplace_back(m, a->attention_kernel());
      a->attention_kernel() = k;
    }
  modules_ = static_cast<int64_t>(before_.size());
  if (modules_ == 0) {
    log_->warn("nothing to do: the model has no attention module it can switch (a module deriving from "
               "frugal::AttentionModule, as the gpt's attention does); it trains as without the plugin");
    return;
  }
  log_->info("{} attention modules compute in tiles of {} queries x {} keys", modules_, k.query_chunk,
             k.key_chunk);
}

void ChunkedAttention::after_fit(frugal::Learner&) {
  for (auto& [module, kernel] : before_) dynamic_cast<frugal::AttentionModule&>(*module).attention_kernel() = kernel;
  before_.clear();
}

}  // namespace frugal::chunked_attention

FRUGAL_PLUGIN(frugal::chunked_attention::ChunkedAttention, frugal::chunked_attention::ChunkedAttentionOptions,
              "chunked_attention",
              "attention in query x key tiles with an online softmax (FlashAttention's algorithm): "
              "no B x H x T x T probabilities",
              "1.0.0")
