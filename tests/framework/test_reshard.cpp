// reshard_optimizer_state: optimizer state saved by optimizers cut over different sets of a
// model's parameters (zero's shards on N ranks) moves into an optimizer cut another way (M
// ranks, or one optimizer), and the next step is bitwise the step the uncut optimizer takes.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "frugal/base/error.h"
#include "frugal/optim/optimizers.h"
#include "frugal/optim/reshard.h"
#include "learner_fixture.h"

namespace frugal {
namespace {

/// Two linear layers: four parameters (two matrices, two biases) from one seed. The first
/// matrix has 5,120 elements: adam8bit keeps its moments quantized (4,096 and more), the others'
/// in float32.
torch::nn::Sequential two_layers() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(80, 64), torch::nn::Tanh(), torch::nn::Linear(64, 2));
}

OptimizerOptions reshard_options(const std::string& name) {
  OptimizerOptions o;
  o.name = name;
  o.lr = 0.05;
  if (name == "adamw") o.weight_decay = 0.1;  // two groups: matrices with decay, the rest without
  if (name == "sgd") o.set("momentum", 0.9);
  return o;
}

std::vector<torch::Tensor> pick_params(const std::vector<torch::Tensor>& params, const std::vector<size_t>& which) {
  std::vector<torch::Tensor> out;
  for (size_t i : which) out.push_back(params[i]);
  return out;
}

/// One step of every optimizer on the loss of a fixed batch; `step` counts the batch.
void step_all(torch::nn::Sequential& m, const std::vector<torch::optim::Optimizer*>& opts, int step) {
  for (auto* o : opts) o->zero_grad();
  torch::manual_seed(100 + step);
  m->forward(torch::randn({5, 80})).pow(2).sum().backward();
  for (auto* o : opts) o->step();
}

std::string saved_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream s;
  out.save_to(s);
  return s.str();
}

LoadSavedOptimizer record_loader(const std::vector<std::string>& saved) {
  return [saved](size_t k, torch::optim::Optimizer& into) {
    torch::serialize::InputArchive in;
    std::istringstream s(saved.at(k));
    in.load_from(s);
    into.load(in);
  };
}

void expect_same_weights(torch::nn::Sequential& a, torch::nn::Sequential& b, const std::string& what) {
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << what << " parameter " << i;
}

void copy_params(torch::nn::Sequential& from, torch::nn::Sequential& to) {
  torch::NoGradGuard g;
  const auto pf = from->parameters(), pt = to->parameters();
  for (size_t i = 0; i < pf.size(); ++i) pt[i].copy_(pf[i]);
}

const std::vector<std::string> kReshardOptimizers = {"adamw", "sgd", "adam8bit", "adafactor"};

// Two shards (as zero's partition on 2 ranks: whole parameters) step two batches; their saved
// states go into one optimizer over every parameter: its third step is the uncut optimizer's.
TEST(Reshard, ShardsSavedOnTwoRanksContinueAsOneOptimizer) {
  for (const std::string& name : kReshardOptimizers) {
    const OptimizerOptions o = reshard_options(name);
    auto whole = two_layers(), cut = two_layers();
    auto full = make_optimizer(o, whole->parameters());
    const std::vector<std::vector<size_t>> owned = {{0, 3}, {1, 2}};
    auto s0 = make_optimizer(o, pick_params(cut->parameters(), owned[0]));
    auto s1 = make_optimizer(o, pick_params(cut->parameters(), owned[1]));
    for (int i = 0; i < 2; ++i) {
      step_all(whole, {full.get()}, i);
      step_all(cut, {s0.get(), s1.get()}, i);
    }
    expect_same_weights(whole, cut, name + " shards");

    const std::vector<OptimizerLayout> layouts = {optimizer_layout(*s0, cut->parameters()),
                                                  optimizer_layout(*s1, cut->parameters())};
    EXPECT_EQ(layouts[0].front().front(), 0) << name;
    auto resumed = two_layers();
    copy_params(cut, resumed);
    auto one = make_optimizer(o, resumed->parameters());
    const int64_t moved = reshard_optimizer_state(*one, o, resumed->parameters(), layouts,
                                                  record_loader({saved_bytes(*s0), saved_bytes(*s1)}), "test");
    EXPECT_EQ(moved, 4) << name;
    step_all(whole, {full.get()}, 2);
    step_all(resumed, {one.get()}, 2);
    expect_same_weights(whole, resumed, name + " resumed as one optimizer");
  }
}

// One optimizer's saved state cut into two shards, each rank reading only what it steps.
TEST(Reshard, OneOptimizerSavedContinuesAsTwoShards) {
  for (const std::string& name : kReshardOptimizers) {
    const OptimizerOptions o = reshard_options(name);
    auto whole = two_layers();
    auto full = make_optimizer(o, whole->parameters());
    for (int i = 0; i < 2; ++i) step_all(whole, {full.get()}, i);
    const std::vector<OptimizerLayout> layouts = {optimizer_layout(*full, whole->parameters())};
    const std::string saved = saved_bytes(*full);

    auto resumed = two_layers();
    copy_params(whole, resumed);
    auto s0 = make_optimizer(o, pick_params(resumed->parameters(), {2}));
    auto s1 = make_optimizer(o, pick_params(resumed->parameters(), {0, 1, 3}));
    EXPECT_EQ(reshard_optimizer_state(*s0, o, resumed->parameters(), layouts, record_loader({saved}), "t"), 1);
    EXPECT_EQ(reshard_optimizer_state(*s1, o, resumed->parameters(), layouts, record_loader({saved}), "t"), 3);
    step_all(whole, {full.get()}, 2);
    step_all(resumed, {s0.get(), s1.get()}, 2);
    expect_same_weights(whole, resumed, name + " resumed as two shards");
  }
}

// A saved optimizer that holds none of the target's parameters is never read; a layout naming
// a parameter the model lacks, or grouped otherwise than make_optimizer groups, is refused.
TEST(Reshard, UnneededRecordsAreNotReadAndBadLayoutsAreRefused) {
  const OptimizerOptions o = reshard_options("adamw");
  auto m = two_layers();
  auto mine = make_optimizer(o, pick_params(m->parameters(), {0}));
  std::vector<size_t> read;
  const LoadSavedOptimizer record = [&](size_t k, torch::optim::Optimizer&) { read.push_back(k); };
  const std::vector<OptimizerLayout> two = {{{0}, {}}, {{2}, {1, 3}}};
  EXPECT_EQ(reshard_optimizer_state(*mine, o, m->parameters(), two, record, "x"), 0);
  EXPECT_EQ(read, std::vector<size_t>{0});

  const auto error = [&](const std::vector<OptimizerLayout>& l) {
    try {
      reshard_optimizer_state(*mine, o, m->parameters(), l, record, "checkpoint 'c.ckpt'");
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error({{{0, 9}, {}}}).find("checkpoint 'c.ckpt': its optimizer layout names parameter 9; "
                                       "this model has 4"),
            std::string::npos);
  // Parameter 0, which this optimizer steps, in no saved optimizer: fresh moments would follow.
  EXPECT_NE(error({{{2}, {1, 3}}}).find("steps parameter 0 [64, 80], which none of its saved optimizers held"),
            std::string::npos)
      << error({{{2}, {1, 3}}});
  // A bias in the decayed group: this configuration puts it in the second.
  EXPECT_NE(error({{{0, 1}, {}}}).find("cannot be rebuilt over the same parameters"), std::string::npos)
      << error({{{0, 1}, {}}});
}

// An optimizer holding a tensor that is not the model's (a learnable loss weight, say): its
// checkpoint has no layout (it cannot be re-cut) but saves and resumes as written.
TEST(Reshard, AnOptimizerHoldingAForeignTensorSavesAndResumesAsWritten) {
  test::TempDir dir;
  const auto with_extra = [](Learner& l) {
    std::vector<torch::Tensor> ps = l.model()->parameters();
    ps.push_back(torch::zeros({3}, torch::requires_grad()));
    l.set_optimizer(make_optimizer(l.optimizer_options(), ps), l.optimizer_options());
  };
  auto a = test::make_tiny_learner();
  with_extra(*a);
  a->fit(1);
  a->save_checkpoint(dir.file("c.ckpt"));
  EXPECT_TRUE(Learner::read_checkpoint(dir.file("c.ckpt"))["optimizer_layout"].is_null());
  auto b = test::make_tiny_learner();
  with_extra(*b);
  b->load_checkpoint(dir.file("c.ckpt"));
  b->fit(2);
  EXPECT_EQ(b->steps(), 2 * a->steps());
}

}  // namespace
}  // namespace frugal
