#include "frugal/io/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include "frugal/base/error.h"
#include "frugal/io/file_writer.h"
#include "io/file_seal.h"

namespace frugal::safetensors {

namespace {

using ordered_json = nlohmann::ordered_json;

struct DType {
  c10::ScalarType type;
  const char* name;
};
constexpr DType kDTypes[] = {
    {torch::kFloat, "F32"}, {torch::kDouble, "F64"}, {torch::kHalf, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kLong, "I64"}, {torch::kInt, "I32"},
    {torch::kShort, "I16"}, {torch::kChar, "I8"}, {torch::kByte, "U8"}, {torch::kBool, "BOOL"}};

const char* dtype_name(c10::ScalarType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return nullptr;
}

/// Each tensor's CRC32 rides in the metadata ("frugal.crc32.<name>": 8 hex digits): the format
/// has no checksum, and a flipped bit in a weight would otherwise load as a wrong number.
/// Readers of the format ignore metadata they do not know.
constexpr const char* kCrcPrefix = "frugal.crc32.";

std::string crc_hex(const void* data, uint64_t size) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  for (uint64_t done = 0; done < size;) {  // zlib takes at most 4 GiB a call
    const uInt n = static_cast<uInt>(std::min<uint64_t>(size - done, 1u << 30));
    crc = ::crc32(crc, p + done, n);
    done += n;
  }
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08lx", static_cast<unsigned long>(crc));
  return hex;
}

bool little_endian() {
  const uint16_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

CheckpointError bad(const std::string& path, const std::string& what) {
  return CheckpointError("'" + path + "' is not a readable safetensors file: " + what);
}

/// The header's JSON, padded with spaces so the data starts at a multiple of 8.
std::string header(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                   const std::map<std::string, std::string>& metadata, const std::string& path) {
  ordered_json h = ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const char* dtype = dtype_name(t.scalar_type());
    if (!dtype)
      throw Error("cannot write '" + path + "': tensor '" + name + "' has dtype " +
                  std::string(c10::toString(t.scalar_type())) + ", which safetensors lacks");
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    h[name] = {{"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

void write(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  if (!little_endian()) throw Error("cannot write '" + path + "': safetensors is little-endian");
  // One tensor on the host at a time: its CRC first (the header precedes the data), then its
  // bytes. A tensor already contiguous on the CPU is not copied.
  const auto host = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU).contiguous(); };
  std::map<std::string, std::string> meta = metadata;
  for (const auto& [name, t] : tensors) {
    const torch::Tensor c = host(t);
    meta[kCrcPrefix + name] = crc_hex(c.data_ptr(), c.numel() * c.element_size());
  }
  const std::string text = header(tensors, meta, path);
  try {
    write_file_atomic(path, [&](const std::string& tmp) {
      FileWriter f(tmp);
      const uint64_t n = text.size();
      f.write(&n, sizeof n);
      f.write(text.data(), text.size());
      for (const auto& [name, t] : tensors) {
        const torch::Tensor c = host(t);
        if (!f.write(c.data_ptr(), static_cast<size_t>(c.numel() * c.element_size()))) break;
      }
      f.finish();
    });
  } catch (const Error& e) {
    throw Error("cannot write '" + path + "': " + e.what());
  }
}

std::vector<std::pair<std::string, torch::Tensor>> state_dict(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

namespace {

/// One entry of the header, checked against the data buffer of `size` bytes.
torch::Tensor read_tensor(const std::string& path, const std::string& name, const nlohmann::json& e,
                          const char* data, uint64_t size) {
  const auto what = [&](const std::string& w) { return bad(path, "tensor '" + name + "': " + w); };
  if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !e.contains("shape") ||
      !e["shape"].is_array() || !e.contains("data_offsets") || !e["data_offsets"].is_array() ||
      e["data_offsets"].size() != 2)
    throw what("needs dtype, shape and data_offsets [begin, end]");
  const DType* dtype = nullptr;
  for (const auto& d : kDTypes)
    if (e["dtype"] == d.name) dtype = &d;
  if (!dtype) throw what("unknown dtype " + e["dtype"].dump());
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned()) throw what("a dimension is not a non-negative integer");
    const uint64_t v = d.get<uint64_t>();
    if (v > size + 1 || (v != 0 && numel > size / v + 1)) throw what("shape larger than the file");
    numel *= v;
    shape.push_back(static_cast<int64_t>(v));
  }
  const auto& o = e["data_offsets"];
  if (!o[0].is_number_unsigned() || !o[1].is_number_unsigned()) throw what("offsets are not integers");
  const uint64_t begin = o[0].get<uint64_t>(), end = o[1].get<uint64_t>();
  if (begin > end || end > size) throw what("data_offsets outside the file");
  if (end - begin != numel * c10::elementSize(dtype->type)) throw what("shape and data_offsets disagree");
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(dtype->type));
  if (numel) std::memcpy(t.data_ptr(), data + begin, end - begin);
  return t;
}

}  // namespace

std::map<std::string, torch::Tensor> read(const std::string& path,
                                          std::map<std::string, std::string>* metadata) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CheckpointError("'" + path + "' cannot be opened");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  if (bytes.size() < sizeof n) throw bad(path, "shorter than its 8-byte header length");
  std::memcpy(&n, bytes.data(), sizeof n);
  if (n > bytes.size() - sizeof n) throw bad(path, "header length beyond the end of the file");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(bytes.begin() + sizeof n, bytes.begin() + sizeof n + n);
  } catch (const nlohmann::json::exception& e) {
    throw bad(path, std::string("header is not JSON: ") + e.what());
  }
  if (!h.is_object()) throw bad(path, "header is not a JSON object");
  const char* data = bytes.data() + sizeof n + n;
  const uint64_t size = bytes.size() - sizeof n - n;
  std::map<std::string, torch::Tensor> out;
  std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> named;  // name, [begin, end)
  std::map<std::string, std::string> meta;
  if (h.contains("__metadata__") && h["__metadata__"].is_object())
    for (const auto& [k, v] : h["__metadata__"].items()) meta[k] = v.is_string() ? v.get<std::string>() : v.dump();
  const bool sealed = std::any_of(meta.begin(), meta.end(),
                                  [](const auto& kv) { return kv.first.rfind(kCrcPrefix, 0) == 0; });
  for (const auto& [name, e] : h.items()) {
    if (name == "__metadata__") continue;
    out[name] = read_tensor(path, name, e, data, size);
    const uint64_t begin = e["data_offsets"][0].get<uint64_t>(), end = e["data_offsets"][1].get<uint64_t>();
    named.emplace_back(name, std::make_pair(begin, end));
  }
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& entry : named) spans.push_back(entry.second);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) throw bad(path, "two tensors' bytes overlap");
  for (const auto& [name, span] : named) {
    if (!sealed) break;  // written by another tool: the format's own checks only
    auto crc = meta.find(kCrcPrefix + name);
    if (crc == meta.end())
      throw CheckpointError("'" + path + "' is damaged: tensor '" + name + "' has no checksum while "
                            "the file's other tensors have" + seal::kDamageAdvice);
    if (crc->second != crc_hex(data + span.first, span.second - span.first))
      throw CheckpointError("'" + path + "' is damaged: the bytes of tensor '" + name +
                            "' do not match their checksum" + seal::kDamageAdvice +
                            " (a file another tool rewrote keeps frugal's checksums only if its "
                            "tensors are unchanged: drop the frugal.crc32.* metadata)");
  }
  if (metadata)  // the checksums are the file's own business
    for (auto& [k, v] : meta)
      if (k.rfind(kCrcPrefix, 0) != 0) (*metadata)[k] = std::move(v);
  return out;
}

}  // namespace frugal::safetensors
