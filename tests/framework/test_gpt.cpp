// The gpt model and the language-model task: layout, causality, initialisation, learning,
// the report's metric, sequence-length stages and bitwise resume on text.
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "frugal/frugal.h"
#include "gpt_fixture.h"
#include "learner_fixture.h"
#include "support.h"

namespace frugal::test {
namespace {

TEST(Gpt, IsASequentialOfNamedBlocksMappingTokensToLogits) {
  TinyGpt s;
  auto m = make_model(gpt_options(s), gpt_input(s));
  std::vector<std::string> names;
  for (const auto& c : m->named_children()) names.push_back(c.key());
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "block0", "block1", "ln_f", "head"}));
  auto out = m->forward(torch::randint(0, 256, {3, 10}, torch::kLong));
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({3, 10, 256}));
  // head has no bias; every block has attention and MLP weights by nanoGPT's names
  const auto params = m->named_parameters();
  EXPECT_EQ(params.find("head.bias"), nullptr);
  EXPECT_NE(params.find("block1.attn.c_attn.weight"), nullptr);
  EXPECT_NE(params.find("block1.mlp.c_proj.weight"), nullptr);
  EXPECT_THROW(m->forward(torch::zeros({1, 17}, torch::kLong)), c10::Error) << "longer than block_size";
}

TEST(Gpt, ATokenChangesNoPredictionBeforeIt) {
  TinyGpt s;
  auto m = make_model(gpt_options(s), gpt_input(s));
  m->eval();
  torch::NoGradGuard g;
  auto x = torch::randint(0, 256, {1, 12}, torch::kLong);
  auto y = x.clone();
  y[0][7] = (x[0][7].item<int64_t>() + 1) % 256;
  auto a = m->forward(x), b = m->forward(y);
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 7), b.narrow(1, 0, 7))) << "positions 0..6 see no future";
  EXPECT_FALSE(torch::allclose(a.narrow(1, 7, 1), b.narrow(1, 7, 1)));
}

TEST(Gpt, InitialisationFollowsTheSeedAndGpt2sScheme) {
  TinyGpt s;
  s.n_embd = 64;
  s.n_layer = 8;
  torch::manual_seed(1);
  auto a = make_model(gpt_options(s), gpt_input(s));
  torch::manual_seed(2);  // the global generator does not matter: the model's own does
  auto b = make_model(gpt_options(s), gpt_input(s));
  for (const auto& np : a->named_parameters())
    EXPECT_TRUE(torch::equal(np.value(), b->named_parameters()[np.key()])) << np.key();
  s.seed = 1;
  auto c = make_model(gpt_options(s), gpt_input(s));
  EXPECT_FALSE(torch::equal(a->named_parameters()["embed.wte.weight"], c->named_parameters()["embed.wte.weight"]));
  auto p = a->named_parameters();
  EXPECT_TRUE(torch::equal(p["block0.ln_1.weight"], torch::ones({64})));
  EXPECT_TRUE(torch::equal(p["block0.attn.c_attn.bias"], torch::zeros({192})));
  EXPECT_NEAR(p["embed.wte.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(p["block3.mlp.c_proj.weight"].std().item<double>(), 0.02 / std::sqrt(16.0), 0.0005);
}

TEST(GptTask, LearnsTheTinyCorpusAndReportsLossPerTokenAndPerplexity) {
  TinyGpt s;
  s.windows = 64;
  auto l = make_tiny_gpt_learner(s);
  EXPECT_EQ(l->task().kind, TaskKind::LanguageModel);
  l->validate();
  const double before = l->valid_sums().mean_loss();
  EXPECT_NEAR(before, std::log(256.0), 0.3) << "an untrained byte model is near uniform";
  l->fit(6);
  const MetricSums& v = l->valid_sums();
  EXPECT_EQ(v.count, 4 * 16) << "4 validation windows of 16 tokens";
  EXPECT_LT(v.mean_loss(), 2.5) << "from " << before;
  const nlohmann::json r = l->report();
  EXPECT_EQ(r["task"], "language_model");
  EXPECT_DOUBLE_EQ(r["valid_loss"].get<double>(), v.mean_loss());
  EXPECT_NEAR(r["perplexity"].get<double>(), std::exp(v.mean_loss()), 1e-9);
  EXPECT_EQ(r["valid_metric"]["name"], "valid_loss");
  EXPECT_FALSE(r["valid_metric"]["higher_is_better"].get<bool>());
  EXPECT_NE(report_markdown({{"fit", r}}).find("valid loss (nats/token)"), std::string::npos);
}

TEST(GptTask, AShorterSequenceLengthStageHoldsLessMemory) {
  TinyGpt s;
  s.block_size = 64;
  s.n_embd = 32;
  s.valid_windows = 0;
  auto l = make_tiny_gpt_learner(s);
  Stage short_stage = make_stage("short", 1), full = make_stage("full", 1);
  short_stage.seq_len = 16;
  l->fit({short_stage, full});
  const auto& st = l->stage_stats();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_LT(st[0].peak_bytes * 2, st[1].peak_bytes)
      << "a quarter of the tokens (and 1/16 of the attention) per window";
  const nlohmann::json r = l->report();
  EXPECT_EQ(r["stages"][0]["seq_len"], 16);
  EXPECT_EQ(r["stages"][1]["seq_len"], 64);
  Stage too_long = make_stage("long", 1);
  too_long.seq_len = 65;
  EXPECT_THROW(l->fit({too_long}), ConfigError);
}

TEST(GptTask, ClassificationKeepsAccuracyAsItsMetric) {
  auto l = make_tiny_learner();
  l->fit(1);
  EXPECT_EQ(l->task().kind, TaskKind::Classification);
  const nlohmann::json r = l->report();
  EXPECT_EQ(r["task"], "classification");
  EXPECT_EQ(r["valid_metric"]["name"], "accuracy");
  EXPECT_DOUBLE_EQ(r["valid_metric"]["value"].get<double>(), l->valid_accuracy());
  EXPECT_EQ(r["valid_samples"], 32);
}

TEST(GptResume, MidEpochCheckpointContinuesTheSameRunBitwise) {
  TempDir d;
  TinyGpt s;
  s.dropout = 0.1;  // the RNG must come back too
  auto straight = make_tiny_gpt_learner(s);
  straight->fit(2);
  auto first = make_tiny_gpt_learner(s);
  struct Stop : Callback {
    explicit Stop(std::string p) : path(std::move(p)) {}
    std::string name() const override { return "stop"; }
    int order() const override { return -2000; }
    void after_batch(Learner& l) override {
      if (l.iteration() + 1 != 5) return;
      l.save_checkpoint(path);
      l.stop_fit();
    }
    std::string path;
  };
  first->add_callback(std::make_shared<Stop>(d.file("c.ckpt")));
  first->fit(2);
  auto resumed = make_tiny_gpt_learner(s);
  resumed->load_checkpoint(d.file("c.ckpt"));
  resumed->fit(2);
  for (const auto& np : straight->model()->named_parameters())
    EXPECT_TRUE(torch::equal(np.value(), resumed->model()->named_parameters()[np.key()])) << np.key();
  EXPECT_EQ(straight->valid_sums().loss_sum, resumed->valid_sums().loss_sum);
}

}  // namespace
}  // namespace frugal::test

namespace frugal::test {
namespace {

TEST(MaxSteps, ACapOnAnEpochsLastBatchValidatesThatEpochAndOneMidEpochDoesNot) {
  auto at_end = make_tiny_learner();  // 64 samples in batches of 16: 4 per epoch
  at_end->set_max_batches(4);
  at_end->fit(3);
  EXPECT_EQ(at_end->iteration(), 4);
  EXPECT_GE(at_end->valid_accuracy(), 0.0) << "the whole epoch trained: it is validated";
  auto mid = make_tiny_learner();
  mid->set_max_batches(3);
  mid->fit(3);
  EXPECT_EQ(mid->iteration(), 3);
  EXPECT_LT(mid->valid_accuracy(), 0.0) << "a cut epoch is not validated";
}

}  // namespace
}  // namespace frugal::test

namespace frugal::test {
namespace {

// The key-value cache computes one new position per byte from the kept keys and values: the
// same logits to float rounding, so the same text, greedy or sampled, inside the block and once
// the context slides past it (where the whole window is computed again).
TEST(GptGenerate, TheKvCacheGivesTheSameTextAsTheWholeContext) {
  TinyGpt s;
  auto l = make_tiny_gpt_learner(s);
  l->fit(1);  // logits far from flat
  torch::nn::Sequential model = l->model();
  for (double temperature : {0.0, 0.8}) {
    SampleOptions o;
    o.tokens = 3 * s.block_size;  // past the block: the window slides
    o.temperature = temperature;
    o.top_k = 0;
    o.seed = 7;
    o.block_size = s.block_size;
    o.kv_cache = false;
    const std::string plain = generate_text(model, "the ", o);
    o.kv_cache = true;
    const std::string cached = generate_text(model, "the ", o);
    EXPECT_EQ(cached, plain) << "temperature " << temperature;
    EXPECT_EQ(static_cast<int64_t>(cached.size()), o.tokens);
  }
}

// top_p keeps the likeliest bytes holding that share of the probability (the first always):
// a tiny share is the greedy sample. A stop string ends the sample before its first occurrence.
TEST(GptGenerate, TopPAndStopStrings) {
  TinyGpt s;
  auto l = make_tiny_gpt_learner(s);
  l->fit(1);
  torch::nn::Sequential model = l->model();
  SampleOptions o;
  o.tokens = 2 * s.block_size;
  o.block_size = s.block_size;
  o.top_k = 0;
  o.temperature = 0;
  const std::string greedy = generate_text(model, "the ", o);
  o.temperature = 1.0;
  o.top_p = 1e-6;
  EXPECT_EQ(generate_text(model, "the ", o), greedy);
  o.top_p = 1.0;
  o.seed = 5;
  const std::string sampled = generate_text(model, "the ", o);
  EXPECT_NE(sampled, greedy) << "the sampler never left the likeliest byte";
  const std::string stop = sampled.substr(sampled.size() / 2, 2);
  o.stop = {stop};
  EXPECT_EQ(generate_text(model, "the ", o), sampled.substr(0, sampled.find(stop)));
  o.top_p = 0;
  EXPECT_THROW(generate_text(model, "the ", o), std::invalid_argument);
}

// A batch of samples: one forward per token for all rows. Greedy rows are the single greedy
// text; sampled rows differ from one another, repeat with the seed, agree with and without the
// cache, and each stops at its own stop string.
TEST(GptGenerate, ABatchOfSamplesIsRowsOfIndependentContinuations) {
  TinyGpt s;
  auto l = make_tiny_gpt_learner(s);
  l->fit(1);
  torch::nn::Sequential model = l->model();
  const auto byte = [](int64_t id) { return std::string(1, static_cast<char>(id)); };
  const std::vector<int64_t> prompt = {'t', 'h', 'e', ' '};
  SampleOptions o;
  o.tokens = 2 * s.block_size;
  o.block_size = s.block_size;
  o.top_k = 0;
  o.temperature = 0;
  o.samples = 3;
  const std::string greedy = generate_text(model, "the ", o);
  for (const Sample& row : generate_tokens(model, prompt, o, byte)) {
    EXPECT_EQ(row.text, greedy);
    EXPECT_EQ(static_cast<int64_t>(row.ids.size()), o.tokens);
  }
  o.temperature = 1.0;
  o.seed = 11;
  const auto sampled = generate_tokens(model, prompt, o, byte);
  ASSERT_EQ(sampled.size(), 3u);
  EXPECT_NE(sampled[0].text, sampled[1].text);
  EXPECT_NE(sampled[1].text, sampled[2].text);
  o.kv_cache = false;
  const auto again = generate_tokens(model, prompt, o, byte);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(again[r].text, sampled[r].text) << "row " << r;
  o.stop = {" "};  // every row ends before its first space
  for (const Sample& row : generate_tokens(model, prompt, o, byte))
    EXPECT_EQ(row.text, row.text.substr(0, row.text.find(' ')));
  const auto cut = generate_tokens(model, prompt, o, byte);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(cut[r].text, sampled[r].text.substr(0, sampled[r].text.find(' '))) << r;
}

}  // namespace
}  // namespace frugal::test
