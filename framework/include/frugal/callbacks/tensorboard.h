#pragma once
/// TensorBoard event files without TensorFlow or protobuf: TFRecord framing (length, masked
/// CRC32C of the length, data, masked CRC32C of the data) around hand-encoded `Event` messages
/// (tensorflow/core/util/event.proto: wall_time = 1, step = 2, file_version = 3, summary = 5,
/// session_log = 7 (6 is the deprecated log_message); Summary.value = 1; Value.tag = 1,
/// Value.simple_value = 2; SessionLog.status = 1 (START = 1), checkpoint_path = 2, msg = 3).
/// `tensorboard --logdir runs/` reads them as scalars. The reader is the check: it verifies
/// both CRCs.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace frugal {

/// CRC-32C (Castagnoli, as TFRecord uses) of `n` bytes, continuing from `crc`.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
/// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const std::string& bytes);
/// One TFRecord around `data`.
std::string tf_record(const std::string& data);

/// One scalar of an event: its tag ("train/loss") and value.
using Scalar = std::pair<std::string, float>;
/// An encoded Event: the first of a file (file_version "brain.Event:2").
std::string file_version_event(double wall_time);
/// An encoded Event with scalars at `step`.
std::string scalars_event(double wall_time, int64_t step, const std::vector<Scalar>& scalars);
/// An encoded Event with a SessionLog (Event field 7) of status START at `step`, and `msg` when
/// not empty: TensorBoard drops the events of earlier files at or after that step (a resumed
/// run replaces what its killed predecessor wrote after its last checkpoint).
std::string session_start_event(double wall_time, int64_t step, const std::string& msg = "");

/// What read_event_file decodes of one Event.
struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  bool session_start = false;  ///< a SessionLog (field 7) with status START
  std::string session_msg;     ///< its msg
  std::vector<Scalar> scalars;
};
/// Reads an event file, checking each record's two CRCs. Throws Error naming the file and the
/// record on a bad CRC, a truncated record or a malformed message.
std::vector<DecodedEvent> read_event_file(const std::string& path);

/// A file the histories append to: each write goes to the kernel at once (a killed run leaves
/// every row it wrote). Throws Error naming the file and the cause (a full disk) when a write
/// fails.
class AppendFile {
 public:
  /// Opens `path` for appending, creating it (truncating it when `truncate`).
  AppendFile(std::string path, bool truncate);
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  void write(const std::string& bytes);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

/// Appends events to <dir>/events.out.tfevents.<seconds>.<host>.<pid>.
class EventFileWriter {
 public:
  /// Creates `dir` and the file; writes the file-version event. Throws Error when it cannot.
  explicit EventFileWriter(const std::string& dir);
  const std::string& path() const { return file_.path(); }
  void write(const std::string& event) { file_.write(tf_record(event)); }

 private:
  static std::string file_name(const std::string& dir);
  AppendFile file_;
};

}  // namespace frugal
