// The CRC32 seal of a zip archive (see file_seal.h).
#include "io/file_seal.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "frugal/base/error.h"
#include "frugal/io/file_writer.h"
#include "io/zip_records.h"

namespace frugal::seal {

namespace {

constexpr unsigned char kEndSignature[4] = {'P', 'K', 5, 6};  // end of central directory
constexpr size_t kEndSize = 22;                  // without the comment
constexpr const char* kPrefix = "frugal-crc32 ";
constexpr size_t kSealSize = 13 + 8;             // prefix + 8 hex digits

CheckpointError damaged(const std::string& path, const std::string& what) {
  return CheckpointError("checkpoint '" + path + "' is damaged: " + what + kDamageAdvice);
}

// `size` bytes at `offset`; empty when they are not all inside the file (sizes read from a
// damaged directory must not allocate what the file does not hold).
std::vector<unsigned char> read_range(std::ifstream& f, uint64_t offset, uint64_t size) {
  f.clear();
  f.seekg(0, std::ios::end);
  std::vector<unsigned char> buf;
  if (!zip::file_reader(f, static_cast<uint64_t>(f.tellg()))(offset, size, buf)) buf.clear();
  return buf;
}

uint32_t crc_of(std::ifstream& f, uint64_t offset, uint64_t size) {
  f.clear();
  f.seekg(static_cast<std::streamoff>(offset));
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<char> buf(1 << 20);
  while (size > 0) {
    const auto n = static_cast<std::streamsize>(std::min<uint64_t>(size, buf.size()));
    f.read(buf.data(), n);
    if (f.gcount() != n) return ~crc;  // short read: cannot match
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
    size -= static_cast<uint64_t>(n);
  }
  return static_cast<uint32_t>(crc);
}

// "frugal-crc32 xxxxxxxx": what seal_zip writes and verify_zip compares byte for byte.
std::string seal_text(uint32_t crc) {
  char text[kSealSize + 1];
  std::snprintf(text, sizeof(text), "%s%08x", kPrefix, crc);
  return text;
}

struct End {
  uint64_t offset = 0;    // of the end-of-central-directory record
  uint16_t comment = 0;   // its comment's length
};

bool find_end(std::ifstream& f, uint64_t size, End& e) {
  return zip::find_end(zip::file_reader(f, size), size, e.offset, e.comment);
}

// A sealed archive whose end record no longer fits the file (a changed comment length): some
// end-record signature in the tail is followed by the seal's prefix.
bool sealed_end_damaged(std::ifstream& f, uint64_t size) {
  const uint64_t span = std::min<uint64_t>(size, kEndSize + kSealSize + 64);
  const auto tail = read_range(f, size - span, span);
  const std::string prefix(kPrefix);
  for (uint64_t i = 0; i + kEndSize + prefix.size() <= tail.size(); ++i)
    if (std::equal(kEndSignature, kEndSignature + 4, tail.begin() + static_cast<std::ptrdiff_t>(i)) &&
        std::equal(prefix.begin(), prefix.end(), tail.begin() + static_cast<std::ptrdiff_t>(i + kEndSize)))
      return true;
  return false;
}

// Which records' bytes no longer match the CRC the zip writer stored for them.
std::vector<ChangedRecord> changed_records(std::ifstream& f, uint64_t size) {
  std::vector<ChangedRecord> out;
  for (const zip::Record& r : zip::records(zip::file_reader(f, size), size)) {
    // "<archive>/data/3": the bytes of the archive's fourth tensor storage.
    const size_t slash = r.name.find('/');
    const std::string name = slash == std::string::npos ? r.name : r.name.substr(slash + 1);
    if (r.method == 0 && r.size == r.stored_size) {  // tensors: CRC'd without a copy
      if (!r.local_ok || zip::same_checksum(crc_of(f, r.data, r.stored_size), r.crc)) continue;
      out.push_back({name, out.size() < 8 ? read_range(f, r.data, r.stored_size) : std::vector<unsigned char>{}});
    } else if (!zip::intact(zip::file_reader(f, size), r, uint64_t{1} << 26)) {
      // A deflated code record that changed, or another method or size: LibTorch takes a
      // record's length from its size without checking the CRC.
      out.push_back({name, {}});
    }
  }
  return out;
}

}  // namespace

void seal_zip(const std::string& path) {
  uint64_t size = 0;
  End e;
  {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) throw CheckpointError("cannot seal '" + path + "': it cannot be read");
    size = static_cast<uint64_t>(f.tellg());
    if (!find_end(f, size, e) || e.comment != 0)
      throw CheckpointError("cannot seal '" + path + "': not a zip archive without a comment");
    // Everything up to the comment's length field.
    const std::string seal = seal_text(crc_of(f, 0, e.offset + kEndSize - 2));
    // The comment's length and the comment: 21 bytes past the old end, so the write may find
    // the disk full or the file size limit reached; its cause is kept.
    std::string tail = {static_cast<char>(kSealSize & 0xFF), static_cast<char>(kSealSize >> 8)};
    tail += seal;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    const auto at = static_cast<off_t>(e.offset + kEndSize - 2);
    const ssize_t k = fd >= 0 ? ::pwrite(fd, tail.data(), tail.size(), at) : -1;
    const bool ok = k == static_cast<ssize_t>(tail.size());
    const int err = k < 0 ? errno : ENOSPC;  // a short write: no room for the rest
    if (fd >= 0 && ::close(fd) != 0 && ok)
      throw CheckpointError("cannot seal '" + path + "': " + write_failure(errno));
    if (!ok) throw CheckpointError("cannot seal '" + path + "': " + write_failure(err));
  }
}

Seal verify_zip(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return Seal::Absent;  // the loader names a missing or unreadable file
  const auto size = static_cast<uint64_t>(f.tellg());
  End e;
  if (!find_end(f, size, e)) {
    // Not a zip (LibTorch says so), unless a sealed end record lost its shape.
    if (sealed_end_damaged(f, size)) throw damaged(path, "its end-of-archive record was changed");
    return Seal::Absent;
  }
  if (e.comment == 0) {
    // Written before seals: the zip's own CRC32 of each record still tells changed bytes in a
    // record, which LibTorch's reader does not check (a changed TorchScript record crashed it).
    std::vector<ChangedRecord> records = changed_records(f, size);
    if (records.empty()) return Seal::Absent;
    std::string names;
    for (const auto& r : records) names += (names.empty() ? "" : ", ") + r.name;
    throw SealError("checkpoint '" + path + "' is damaged: changed record(s): " + names,
                    std::move(records));
  }
  const auto comment = read_range(f, e.offset + kEndSize, e.comment);
  const std::string text(comment.begin(), comment.end());
  if (e.comment != kSealSize || text.rfind(kPrefix, 0) != 0)
    throw damaged(path, "its seal (the archive comment) is not frugal's");
  const uint32_t now = crc_of(f, 0, e.offset + kEndSize - 2);
  // Byte for byte (a changed seal never passes), and opaque to a fuzzer (zip_records.h).
  if (zip::same_bytes(text, seal_text(now))) return Seal::Verified;
  const uint32_t stored = static_cast<uint32_t>(std::strtoul(text.c_str() + 13, nullptr, 16));
  std::vector<ChangedRecord> records = changed_records(f, size);
  std::string names;
  for (const auto& r : records) names += (names.empty() ? "" : ", ") + r.name;
  char crcs[64];
  std::snprintf(crcs, sizeof(crcs), "CRC32 %08x, sealed %08x", now, stored);
  throw SealError("checkpoint '" + path + "' is damaged: " + crcs +
                      (names.empty() ? " (outside any record's data: a header, padding or the seal)"
                                     : "; changed record(s): " + names),
                  std::move(records));
}

}  // namespace frugal::seal
