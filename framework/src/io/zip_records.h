#pragma once
// The records of a LibTorch archive (a zip file), read from its central directory, and the
// check that they are what LibTorch's own writer makes, run before LibTorch's reader sees them.
//
// Why: LibTorch trusts an archive's structure. Its TorchScript importer crashes (SEGV in
// ScriptTypeParser::parseClassConstant) on some changed `code/` records, and its zip reader
// leaks when the archive has no folder or no version record. A seal (file_seal.h) catches
// changed bytes, but not a file made by hand, nor one whose seal was computed anew (the fuzzer
// learns to do that). check_records refuses, naming the record, anything LibTorch's writer
// does not make: another compression method, a size that is not the stored one, a record
// outside the archive's folder, no readable version in the supported range, or a code record
// whose class-level lines are not attribute declarations (the constants whose parsing crashed
// LibTorch); a saved model's methods (forward) pass, to LibTorch's compiler.
// Internal to libfrugal.
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace frugal::zip {

/// Reads `size` bytes at `offset` into `out`; false when they are not all there.
using ReadAt = std::function<bool(uint64_t offset, uint64_t size, std::vector<unsigned char>& out)>;

struct Record {
  std::string name;      ///< as in the archive ("archive/data/3")
  uint16_t method = 0;   ///< 0 = stored
  uint32_t crc = 0, stored_size = 0, size = 0;
  uint64_t data = 0;     ///< offset of its bytes (from its local header)
  bool local_ok = false; ///< its local header is where the directory says
};

/// Reads from `f` (of `size` bytes), which must outlive the function.
ReadAt file_reader(std::ifstream& f, uint64_t size);

/// The end-of-central-directory record: its offset and its comment's length, the comment
/// reaching exactly the end of the file. False when there is none.
bool find_end(const ReadAt& read, uint64_t file_size, uint64_t& offset, uint16_t& comment);

/// The records the central directory lists, in order; empty when the file has no end record
/// or a zip64 directory (LibTorch then reports what it finds itself).
/// `whole`, when given: whether the directory was where the end record says and held every
/// record it counts (false for a file with no end record at all).
std::vector<Record> records(const ReadAt& read, uint64_t file_size, bool* whole = nullptr);

/// The record's bytes as LibTorch reads them: stored, or inflated (LibTorch deflates some code
/// records). False when they are cut, larger than `limit`, of another method or do not inflate
/// to their size exactly. The CRC is not checked (intact does).
bool contents(const ReadAt& read, const Record& r, std::vector<unsigned char>& out, uint64_t limit);

/// Whether the record's contents match the CRC32 the zip writer stored for it.
bool intact(const ReadAt& read, const Record& r, uint64_t limit);

/// a == b for checksums, without handing either operand to a fuzzer's comparison tracing:
/// libFuzzer learns the operands of == and memcmp and writes them into its next input, which
/// made the CI's 60 s fuzz_checkpoint forge seals and zip CRCs within seconds and test LibTorch's
/// readers behind them (fuzz/README.md, findings 5 and 7). A forged file is what
/// frugal_fuzz_checkpoint_resealed explores; the CI target tests damage, as the seal promises.
bool same_checksum(uint32_t a, uint32_t b);
/// The same for two byte strings (a seal's text): equal length and every byte equal.
bool same_bytes(const std::string& a, const std::string& b);

/// Throws std::runtime_error saying what is wrong (the caller names the file) when the records
/// are not what LibTorch's writer makes (see the file comment), two names differ only in case
/// (miniz finds records ignoring it), or deflated records would inflate past 256 MiB in all.
/// Returns without a word for a file that is no zip archive at all (LibTorch says so, and
/// frees what it allocated) and for a zip64 one (past 4 GiB: left to LibTorch).
void check_records(const ReadAt& read, uint64_t file_size);

/// The same for a file on disk and for bytes in memory (an archive inside an archive).
void check_file(const std::string& path);
void check_bytes(const unsigned char* data, uint64_t size);

}  // namespace frugal::zip
