// TensorBoard event files: CRC32C, TFRecord framing, the few protobuf fields an Event with
// scalars or a SessionLog needs (written and read), and the append-only file the histories share.
#include "frugal/callbacks/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "frugal/base/error.h"

namespace frugal {

namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
    t[i] = c;
  }
  return t;
}

// ---- protobuf wire format: varints, tags, length-delimited fields ----
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, int field, int wire) { put_varint(out, static_cast<uint64_t>(field << 3 | wire)); }
template <class T>
void put_fixed(std::string& out, T v) {  // little-endian, as protobuf's fixed32/fixed64
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_tag(e, 1, 1);  // wall_time: double
  put_fixed(e, wall_time);
  if (step != 0) {
    put_tag(e, 2, 0);  // step: int64
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

// ---- reading back: a cursor over one message ----
struct Cursor {
  const std::string& s;
  size_t pos = 0;
  std::string where;
  bool done() const { return pos >= s.size(); }
  [[noreturn]] void bad(const std::string& why) const { throw Error(where + ": " + why); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) bad("truncated varint");
      const auto b = static_cast<uint8_t>(s[pos++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    bad("varint longer than 10 bytes");
  }
  template <class T>
  T fixed() {
    if (pos + sizeof(T) > s.size()) bad("truncated fixed field");
    T v;
    std::memcpy(&v, s.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (n > s.size() - pos) bad("length-delimited field runs past the message");
    std::string out = s.substr(pos, n);
    pos += n;
    return out;
  }
  void skip(int wire) {
    if (wire == 0) varint();
    else if (wire == 1) fixed<uint64_t>();
    else if (wire == 2) bytes();
    else if (wire == 5) fixed<uint32_t>();
    else bad("unknown wire type " + std::to_string(wire));
  }
};

Scalar decode_value(const std::string& m, const std::string& where) {
  Cursor c{m, 0, where};
  Scalar v;
  while (!c.done()) {
    const uint64_t tag = c.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 2) v.first = c.bytes();
    else if (field == 2 && wire == 5) v.second = c.fixed<float>();
    else c.skip(wire);
  }
  return v;
}

void decode_summary(const std::string& m, const std::string& where, DecodedEvent& e) {
  Cursor c{m, 0, where};
  while (!c.done()) {
    const uint64_t tag = c.varint();
    if ((tag >> 3) == 1 && (tag & 7) == 2) e.scalars.push_back(decode_value(c.bytes(), where));
    else c.skip(static_cast<int>(tag & 7));
  }
}

// SessionLog: status = 1 (an enum, START = 1), checkpoint_path = 2, msg = 3.
void decode_session_log(const std::string& m, const std::string& where, DecodedEvent& e) {
  Cursor c{m, 0, where};
  while (!c.done()) {
    const uint64_t tag = c.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 0) e.session_start = c.varint() == 1;
    else if (field == 3 && wire == 2) e.session_msg = c.bytes();
    else c.skip(wire);
  }
}

DecodedEvent decode_event(const std::string& m, const std::string& where) {
  Cursor c{m, 0, where};
  DecodedEvent e;
  while (!c.done()) {
    const uint64_t tag = c.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 1) e.wall_time = c.fixed<double>();
    else if (field == 2 && wire == 0) e.step = static_cast<int64_t>(c.varint());
    else if (field == 3 && wire == 2) e.file_version = c.bytes();
    else if (field == 5 && wire == 2) decode_summary(c.bytes(), where, e);
    else if (field == 7 && wire == 2) decode_session_log(c.bytes(), where, e);
    else c.skip(wire);
  }
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const std::string& bytes) {
  const uint32_t crc = crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tf_record(const std::string& data) {
  std::string len;
  put_fixed(len, static_cast<uint64_t>(data.size()));
  std::string out = len;
  put_fixed(out, masked_crc32c(len));
  out += data;
  put_fixed(out, masked_crc32c(data));
  return out;
}

std::string file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const std::vector<Scalar>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_tag(v, 2, 5);  // simple_value: float
    put_fixed(v, value);
    put_bytes(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string session_start_event(double wall_time, int64_t step, const std::string& msg) {
  std::string log;
  put_tag(log, 1, 0);
  put_varint(log, 1);  // SessionLog.status = START
  if (!msg.empty()) put_bytes(log, 3, msg);
  std::string e = event_head(wall_time, step);
  // Field 7, session_log: TensorBoard purges on it. Field 6 is the deprecated log_message,
  // which it reads as a log line and purges nothing on.
  put_bytes(e, 7, log);
  return e;
}

std::vector<DecodedEvent> read_event_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read event file '" + path + "': " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<DecodedEvent> out;
  for (size_t pos = 0, i = 0; pos < s.size(); ++i) {
    const std::string where = "'" + path + "' record " + std::to_string(i);
    if (s.size() - pos < 12) throw Error(where + ": truncated header");
    const std::string len_bytes = s.substr(pos, 8);
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, len_bytes.data(), 8);
    std::memcpy(&len_crc, s.data() + pos + 8, 4);
    if (len_crc != masked_crc32c(len_bytes)) throw Error(where + ": the length's CRC32C does not match");
    if (len > s.size() - pos - 12 || s.size() - pos - 12 - len < 4) throw Error(where + ": truncated data");
    const std::string data = s.substr(pos + 12, len);
    std::memcpy(&data_crc, s.data() + pos + 12 + len, 4);
    if (data_crc != masked_crc32c(data)) throw Error(where + ": the data's CRC32C does not match");
    out.push_back(decode_event(data, where));
    pos += 12 + len + 4;
  }
  return out;
}

AppendFile::AppendFile(std::string path, bool truncate) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd_ < 0) throw Error("cannot open '" + path_ + "' for writing: " + std::strerror(errno));
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::write(const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(std::string(std::strerror(errno)) + " writing '" + path_ + "'");
    done += static_cast<size_t>(n);
  }
}

std::string EventFileWriter::file_name(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
  // A second writer of this process in the same second (a fit resumed in-process) must not
  // replace the first's file.
  static std::atomic<int> written{0};
  const int n = written++;
  return (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(secs) + "." +
                                        host + "." + std::to_string(::getpid()) +
                                        (n ? "." + std::to_string(n) : "")))
      .string();
}

EventFileWriter::EventFileWriter(const std::string& dir) : file_(file_name(dir), true) {
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  write(file_version_event(now));
}

}  // namespace frugal
