#pragma once
// Small Hugging Face GPT-2 folders made by tests/framework/hf_gpt2_reference.py (Debian's
// python3-torch; an implementation of GPT-2 independent of frugal), and frugal's gpt2 built
// from them: for test_hf_gpt2.cpp and the lora plugin's tests.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "frugal/io/weights.h"
#include "frugal/models/registry.h"

namespace frugal::test::hf {

/// The command's stdout and stderr when it exits 0.
inline std::optional<std::string> run(const std::string& command) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return std::nullopt;
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  if (pclose(p) != 0) {
    ADD_FAILURE() << command << ":\n" << out;
    return std::nullopt;
  }
  return out;
}

/// "/usr/bin/python3 <source>/tests/framework/hf_gpt2_reference.py ", or "" when either is missing.
inline std::string reference() {
  const char* root = std::getenv("FRUGAL_SOURCE_DIR");
  std::string dir = root ? root : "";
#ifdef FRUGAL_TEST_SOURCE_DIR
  dir = FRUGAL_TEST_SOURCE_DIR;
#endif
  const std::string script = dir + "/tests/framework/hf_gpt2_reference.py";
  if (!std::filesystem::exists(script) || std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    return "";
  return "/usr/bin/python3 " + script + " ";
}

#define FRUGAL_SKIP_WITHOUT_HF_REFERENCE(py)                                                     \
  const std::string py = ::frugal::test::hf::reference();                                       \
  if (py.empty()) GTEST_SKIP() << "needs /usr/bin/python3 with torch (Debian: python3-torch) and " \
                                  "tests/framework/hf_gpt2_reference.py"

/// Tokens x [B, T] and next tokens y, below `vocab`, written as the reference reads them.
inline std::pair<torch::Tensor, torch::Tensor> write_batch(const std::string& path, int64_t b, int64_t t,
                                                           int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  const auto seq = torch::randint(vocab, {b, t + 1}, torch::kLong);
  const auto x = seq.narrow(1, 0, t).contiguous(), y = seq.narrow(1, 1, t).contiguous();
  nlohmann::json j;
  for (const auto& [key, tensor] : {std::make_pair("x", x), std::make_pair("y", y)}) {
    j[key] = nlohmann::json::array();
    for (int64_t i = 0; i < b; ++i) {
      auto row = tensor[i];
      j[key].push_back(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + t));
    }
  }
  std::ofstream(path) << j.dump();
  return {x, y};
}

/// The logits [B, T, V] the reference wrote.
inline torch::Tensor read_logits(const std::string& path) {
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  const auto& l = j.at("logits");
  const int64_t b = static_cast<int64_t>(l.size()), t = static_cast<int64_t>(l[0].size()),
                v = static_cast<int64_t>(l[0][0].size());
  auto out = torch::empty({b, t, v}, torch::kDouble);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t k = 0; k < t; ++k)
      for (int64_t c = 0; c < v; ++c) out[i][k][c] = l[i][k][c].get<double>();
  return out;
}

/// frugal's gpt2 shaped by `folder`'s config.json, its weights loaded by Hugging Face's names.
inline torch::nn::Sequential load(const std::string& folder, int64_t vocab, int64_t block) {
  ModelOptions o;
  o.arch = "gpt2";
  o.init_from = folder;
  ModelInput in;
  in.num_classes = vocab;
  in.block_size = block;
  auto m = make_model(o, in);
  init_weights(*m, folder, /*strict=*/true, {}, weight_names("gpt2"));
  return m;
}

}  // namespace frugal::test::hf
