#pragma once
/// The safetensors format (Hugging Face's), so a model frugal trained loads outside frugal:
/// `safetensors.torch.load_file("model.safetensors")` in Python, or any reader of the format.
///
/// Layout: an 8-byte little-endian header length N, N bytes of JSON
///   {"__metadata__": {...}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ..}
/// padded with spaces to a multiple of 8, then the tensors' bytes, little-endian, row-major,
/// each at [b, e) of that buffer. Names are the module's state-dict names (parameters and
/// buffers: "block0.attn.qkv.weight"), as PyTorch's `model.state_dict()` gives them.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace frugal::safetensors {

/// Writes `tensors` (in this order; names unique) to `path` atomically; `metadata` goes to
/// "__metadata__" (string values, as the format requires). Throws frugal::Error naming the
/// file and the tensor whose dtype the format lacks.
void write(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata = {});

/// A module's parameters and buffers, by state-dict name.
std::vector<std::pair<std::string, torch::Tensor>> state_dict(const torch::nn::Module& m);

/// Reads every tensor of `path` (on the CPU). Throws frugal::CheckpointError naming the file and
/// what is wrong: too short, a header that is not the format's JSON, offsets outside the file or
/// overlapping, a shape that does not match its bytes, an unknown dtype.
std::map<std::string, torch::Tensor> read(const std::string& path,
                                          std::map<std::string, std::string>* metadata = nullptr);

}  // namespace frugal::safetensors
