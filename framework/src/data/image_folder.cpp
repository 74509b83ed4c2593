// The image_folder dataset: PNG and JPEG files in one sub-folder per class, decoded with stb_image
// and resized with stb_image_resize (both from Debian's libstb-dev, header-only: compiled here,
// static, so no symbol of theirs leaves libfrugal), cached in memory as uint8.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <memory>

#include "frugal/base/error.h"
#include "frugal/data/data.h"
#include "frugal/memory/memory.h"

// stb (Debian's libstb-dev, not patched here) left-shifts negative values in its JPEG code:
// undefined in C++17 (defined in C++20), and what every compiler does; the sanitizer build's
// -fno-sanitize-recover would stop on it, so its functions are not checked for that one thing.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((no_sanitize("shift"))), apply_to = function)
#endif
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_FAILURE_USERMSG
#include <stb/stb_image.h>
#define STB_IMAGE_RESIZE_STATIC
#define STB_IMAGE_RESIZE_IMPLEMENTATION
#include <stb/stb_image_resize.h>
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace frugal {
namespace {

namespace fs = std::filesystem;

bool is_image_file(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

/// The sorted entries of `dir` that are folders (classes) and image files (strays).
void scan_root(const std::string& dir, std::vector<std::string>& folders, std::vector<std::string>& strays) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw_data_error("image_folder '" + dir + "': no such folder (data.path names a folder with "
                     "one sub-folder of PNG/JPEG files per class)");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_directory(ec)) folders.push_back(e.path().filename().string());
    else if (e.is_regular_file(ec) && is_image_file(e.path())) strays.push_back(e.path().string());
  }
  if (ec) throw_data_error("image_folder '" + dir + "': cannot list it: " + ec.message());
  std::sort(folders.begin(), folders.end());
  std::sort(strays.begin(), strays.end());
}

/// The image files of one class folder, sorted.
std::vector<std::string> class_files(const fs::path& folder) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec))
    if (e.is_regular_file(ec) && is_image_file(e.path())) out.push_back(e.path().string());
  if (ec) throw_data_error("image_folder: cannot list '" + folder.string() + "': " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

int64_t machine_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

/// Refuses a cache the machine cannot hold, before any decoding (frugal does not stream).
void check_cache_fits(const std::string& dir, int64_t n, int64_t channels, int64_t size) {
  const double need = static_cast<double>(n) * static_cast<double>(channels * size * size + 8);
  const int64_t have = machine_memory();
  if (have <= 0 || need <= static_cast<double>(have)) return;
  throw_data_error("image_folder '" + dir + "': " + std::to_string(n) + " images of " +
                   std::to_string(channels) + "x" + std::to_string(size) + "x" + std::to_string(size) +
                   " need " + format_bytes(static_cast<int64_t>(need)) +
                   " cached in memory (frugal caches them as uint8 and does not stream), more than "
                   "this machine's " + format_bytes(have) +
                   "; lower data.image_size or use fewer images");
}

/// Decodes `file`, converts it to `channels` and resizes it into out (channels x size x size,
/// channel-first).
void decode_into(const std::string& file, int64_t channels, int64_t size, uint8_t* out) {
  int w = 0, h = 0, found = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> pixels(
      stbi_load(file.c_str(), &w, &h, &found, static_cast<int>(channels)), stbi_image_free);
  if (!pixels)
    throw_data_error("image_folder: cannot decode '" + file + "': " + stbi_failure_reason() +
                     " (PNG and JPEG are read)");
  const auto c = static_cast<int>(channels), s = static_cast<int>(size);
  std::vector<uint8_t> hwc(static_cast<size_t>(s) * s * c);
  if (w == s && h == s) {
    std::copy(pixels.get(), pixels.get() + hwc.size(), hwc.begin());
  } else if (!stbir_resize_uint8(pixels.get(), w, h, 0, hwc.data(), s, s, 0, c)) {
    throw_data_error("image_folder: cannot resize '" + file + "' (" + std::to_string(w) + "x" +
                     std::to_string(h) + ") to " + std::to_string(s) + "x" + std::to_string(s));
  }
  // stb gives rows of interleaved channels (HWC); frugal's images are CHW.
  const int64_t plane = size * size;
  for (int64_t p = 0; p < plane; ++p)
    for (int64_t k = 0; k < channels; ++k) out[k * plane + p] = hwc[static_cast<size_t>(p * channels + k)];
}

}  // namespace

torch::Tensor decode_image(const std::string& file, int64_t channels, int64_t size) {
  torch::Tensor out = torch::empty({channels, size, size}, torch::kUInt8);
  decode_into(file, channels, size, out.data_ptr<uint8_t>());
  return out;
}

ImageFolderListing list_image_folder(const std::string& dir, const std::vector<std::string>& classes) {
  std::vector<std::string> folders, strays;
  scan_root(dir, folders, strays);
  if (!strays.empty())
    throw_data_error("image_folder '" + dir + "': image '" + strays.front() +
                     "' is outside a class sub-folder; put every image in the folder of its class");
  if (folders.empty())
    throw_data_error("image_folder '" + dir + "' has no sub-folders; it needs one sub-folder of "
                     "PNG/JPEG files per class (" + dir + "/cat/1.png, " + dir + "/dog/2.jpg, ...)");
  ImageFolderListing l;
  l.classes = classes.empty() ? folders : classes;
  std::vector<std::vector<std::string>> per_class;
  std::vector<int64_t> label_of;
  for (const auto& name : folders) {
    const auto it = std::find(l.classes.begin(), l.classes.end(), name);
    if (it == l.classes.end())
      throw_data_error("image_folder '" + dir + "': class folder '" + name +
                       "' is not a class of the training folder; its classes are the training "
                       "folder's sub-folders");
    const fs::path folder = fs::path(dir) / name;
    std::vector<std::string> files = class_files(folder);
    if (files.empty())
      throw_data_error("image_folder: class folder '" + folder.string() +
                       "' holds no PNG or JPEG file (.png, .jpg, .jpeg)");
    per_class.push_back(std::move(files));
    label_of.push_back(it - l.classes.begin());
  }
  // The classes take turns (each one's files in name order), so the first n files, what
  // data.train_samples / valid_samples keep, hold every class, not the first few.
  for (size_t turn = 0, left = 1; left > 0; ++turn) {
    left = 0;
    for (size_t c = 0; c < per_class.size(); ++c) {
      if (turn >= per_class[c].size()) continue;
      l.files.push_back(std::move(per_class[c][turn]));
      l.labels.push_back(label_of[c]);
      ++left;
    }
  }
  return l;
}

Dataset load_image_folder(const std::string& dir, int64_t channels, int64_t size,
                          const std::vector<std::string>& classes) {
  if (channels != 1 && channels != 3)
    throw_data_error("image_folder '" + dir + "': data.channels = " + std::to_string(channels) +
                     "; images are read as 1 (grey) or 3 (RGB) channels");
  if (size < 1) throw_data_error("image_folder '" + dir + "': data.image_size must be >= 1");
  const ImageFolderListing l = list_image_folder(dir, classes);
  const auto n = static_cast<int64_t>(l.files.size());
  check_cache_fits(dir, n, channels, size);
  Dataset d;
  d.images = torch::empty({n, channels, size, size}, torch::kUInt8);
  uint8_t* out = d.images.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i)
    decode_into(l.files[static_cast<size_t>(i)], channels, size, out + i * channels * size * size);
  d.labels = torch::tensor(l.labels, torch::kLong);
  d.num_classes = static_cast<int64_t>(l.classes.size());
  d.classes = l.classes;
  // Pixels to [-1, 1], the same for every split: a validation folder's own statistics would
  // shift its inputs away from the training ones (and `frugal evaluate` reads only that folder).
  d.mean = 0.5;
  d.std = 0.5;
  d.name = "image_folder";
  return d;
}

}  // namespace frugal
