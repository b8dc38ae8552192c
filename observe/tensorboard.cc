// observe/tensorboard.cc — TFRecord framing, the Event/Summary protobuf subset, and the
// event-file writer (tensorboard.h).
#include "observe/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

namespace troupe::observe {

namespace {

// Castagnoli polynomial, reflected.
constexpr uint32_t kCrc32cPoly = 0x82f63b78u;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// ---- protobuf encoding (the wire format's four rules that these messages need) --------
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, uint32_t field, WireType wt) {
  put_varint(out, (uint64_t{field} << 3) | wt);
}
void put_double(std::string& out, uint32_t field, double v) {
  put_tag(out, field, kFixed64);
  char b[8];
  std::memcpy(b, &v, 8);  // little-endian hosts only (x86-64, aarch64)
  out.append(b, 8);
}
void put_float(std::string& out, uint32_t field, float v) {
  put_tag(out, field, kFixed32);
  char b[4];
  std::memcpy(b, &v, 4);
  out.append(b, 4);
}
void put_bytes(std::string& out, uint32_t field, std::string_view v) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, v.size());
  out.append(v);
}
void put_packed_doubles(std::string& out, uint32_t field, const std::vector<double>& v) {
  std::string body;
  for (double d : v) {
    char b[8];
    std::memcpy(b, &d, 8);
    body.append(b, 8);
  }
  put_bytes(out, field, body);
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);                                                        // Event.wall_time
  if (step != 0) put_tag(e, 2, kVarint), put_varint(e, static_cast<uint64_t>(step));  // Event.step
  return e;
}

std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary;
  put_bytes(summary, 1, value);  // Summary.value
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);  // Event.summary
  return e;
}

// ---- protobuf decoding ---------------------------------------------------------------
struct Field {
  uint32_t number = 0;
  WireType type = kVarint;
  uint64_t varint = 0;     // kVarint
  uint64_t fixed = 0;      // kFixed64 / kFixed32 bits
  std::string_view bytes;  // kLengthDelimited
};

class Parser {
 public:
  explicit Parser(std::string_view b) : b_(b) {}
  bool done() const { return pos_ >= b_.size(); }
  Result<Field> next() {
    Field f;
    TROUPE_ASSIGN_OR_RETURN(uint64_t key, varint());
    f.number = static_cast<uint32_t>(key >> 3);
    f.type = static_cast<WireType>(key & 7);
    switch (f.type) {
      case kVarint: {
        TROUPE_ASSIGN_OR_RETURN(f.varint, varint());
        break;
      }
      case kFixed64:
      case kFixed32: {
        const size_t n = f.type == kFixed64 ? 8 : 4;
        if (b_.size() - pos_ < n)
          return data_loss("protobuf: fixed field {} truncated at byte {}", f.number, pos_);
        std::memcpy(&f.fixed, b_.data() + pos_, n);
        pos_ += n;
        break;
      }
      case kLengthDelimited: {
        TROUPE_ASSIGN_OR_RETURN(uint64_t n, varint());
        if (n > b_.size() - pos_)
          return data_loss("protobuf: field {} of {} bytes overruns the message", f.number, n);
        f.bytes = b_.substr(pos_, n);
        pos_ += n;
        break;
      }
      default:
        return data_loss("protobuf: unsupported wire type {} (field {}) at byte {}", static_cast<int>(f.type),
                         f.number, pos_);
    }
    return f;
  }

 private:
  Result<uint64_t> varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= b_.size()) return data_loss("protobuf: varint truncated at byte {}", pos_);
      const auto c = static_cast<uint8_t>(b_[pos_++]);
      v |= uint64_t{c & 0x7fu} << shift;
      if ((c & 0x80) == 0) return v;
    }
    return data_loss("protobuf: varint longer than 10 bytes at byte {}", pos_);
  }
  std::string_view b_;
  size_t pos_ = 0;
};

double as_double(const Field& f) {
  double d;
  std::memcpy(&d, &f.fixed, 8);
  return d;
}

Result<Histogram> decode_histogram(std::string_view b) {
  Histogram h;
  Parser p(b);
  auto packed = [](const Field& f, std::vector<double>& out) -> Status {
    if (f.type == kFixed64) {
      out.push_back(as_double(f));
      return ok_status();
    }
    if (f.type != kLengthDelimited || f.bytes.size() % 8 != 0)
      return data_loss("HistogramProto: field {} is not a list of doubles", f.number);
    for (size_t i = 0; i < f.bytes.size(); i += 8) {
      double d;
      std::memcpy(&d, f.bytes.data() + i, 8);
      out.push_back(d);
    }
    return ok_status();
  };
  while (!p.done()) {
    TROUPE_ASSIGN_OR_RETURN(Field f, p.next());
    if (f.number >= 1 && f.number <= 5 && f.type != kFixed64)
      return data_loss("HistogramProto: field {} is not a double", f.number);
    switch (f.number) {
      case 1:
        h.min = as_double(f);
        break;
      case 2:
        h.max = as_double(f);
        break;
      case 3:
        h.num = as_double(f);
        break;
      case 4:
        h.sum = as_double(f);
        break;
      case 5:
        h.sum_squares = as_double(f);
        break;
      case 6:
        TROUPE_RETURN_IF_ERROR(packed(f, h.bucket_limit));
        break;
      case 7:
        TROUPE_RETURN_IF_ERROR(packed(f, h.bucket));
        break;
      default:
        break;
    }
  }
  if (h.bucket.size() != h.bucket_limit.size())
    return data_loss("HistogramProto: {} buckets but {} bucket limits", h.bucket.size(),
                     h.bucket_limit.size());
  return h;
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  const auto& t = crc_table();
  uint32_t c = 0xffffffffu;
  for (unsigned char ch : data) c = t[(c ^ ch) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + kMaskDelta;
}

std::string frame_record(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  char len[8];
  const uint64_t n = data.size();
  std::memcpy(len, &n, 8);
  out.append(len, 8);
  const uint32_t lc = masked_crc32c(std::string_view(len, 8));
  out.append(reinterpret_cast<const char*>(&lc), 4);
  out.append(data);
  const uint32_t dc = masked_crc32c(data);
  out.append(reinterpret_cast<const char*>(&dc), 4);
  return out;
}

Result<std::vector<std::string>> read_records(std::string_view bytes) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < 12) return data_loss("TFRecord: truncated header at byte {}", pos);
    uint64_t n;
    std::memcpy(&n, bytes.data() + pos, 8);
    uint32_t lc;
    std::memcpy(&lc, bytes.data() + pos + 8, 4);
    if (lc != masked_crc32c(bytes.substr(pos, 8)))
      return data_loss("TFRecord: the length's CRC at byte {} does not match", pos);
    if (n > bytes.size() - pos - 12 || bytes.size() - pos - 12 - n < 4)
      return data_loss("TFRecord: record at byte {} ({} bytes) is truncated", pos, n);
    const std::string_view data = bytes.substr(pos + 12, n);
    uint32_t dc;
    std::memcpy(&dc, bytes.data() + pos + 12 + n, 4);
    if (dc != masked_crc32c(data))
      return data_loss("TFRecord: the data's CRC at byte {} does not match", pos);
    out.emplace_back(data);
    pos += 12 + n + 4;
  }
  return out;
}

Histogram Histogram::of(const std::vector<double>& values, int buckets) {
  Histogram h;
  if (values.empty()) return h;
  h.min = *std::min_element(values.begin(), values.end());
  h.max = *std::max_element(values.begin(), values.end());
  h.num = static_cast<double>(values.size());
  for (double v : values) h.sum += v, h.sum_squares += v * v;
  const int nb = h.max > h.min ? std::max(1, buckets) : 1;
  const double width = (h.max - h.min) / nb;
  for (int i = 0; i < nb; ++i) h.bucket_limit.push_back(i + 1 == nb ? h.max : h.min + width * (i + 1));
  h.bucket.assign(static_cast<size_t>(nb), 0.0);
  for (double v : values) {
    int i = width > 0 ? static_cast<int>(std::ceil((v - h.min) / width)) - 1 : 0;
    h.bucket[static_cast<size_t>(std::clamp(i, 0, nb - 1))] += 1;
  }
  return h;
}

std::string encode_file_version_event(double wall_time) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");  // Event.file_version
  return e;
}

std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);    // Summary.Value.tag
  put_float(v, 2, value);  // Summary.Value.simple_value
  return summary_event(wall_time, step, v);
}

std::string encode_histogram_event(double wall_time, int64_t step, const std::string& tag,
                                   const Histogram& h) {
  std::string histo;
  put_double(histo, 1, h.min);
  put_double(histo, 2, h.max);
  put_double(histo, 3, h.num);
  put_double(histo, 4, h.sum);
  put_double(histo, 5, h.sum_squares);
  put_packed_doubles(histo, 6, h.bucket_limit);
  put_packed_doubles(histo, 7, h.bucket);
  std::string v;
  put_bytes(v, 1, tag);
  put_bytes(v, 5, histo);  // Summary.Value.histo
  return summary_event(wall_time, step, v);
}

Result<DecodedEvent> decode_event(std::string_view bytes) {
  DecodedEvent ev;
  Parser p(bytes);
  while (!p.done()) {
    TROUPE_ASSIGN_OR_RETURN(Field f, p.next());
    if (f.number == 1 && f.type == kFixed64) {
      ev.wall_time = as_double(f);
    } else if (f.number == 2 && f.type == kVarint) {
      ev.step = static_cast<int64_t>(f.varint);
    } else if (f.number == 3 && f.type == kLengthDelimited) {
      ev.file_version = std::string(f.bytes);
    } else if (f.number == 5 && f.type == kLengthDelimited) {
      Parser s(f.bytes);
      while (!s.done()) {
        TROUPE_ASSIGN_OR_RETURN(Field vf, s.next());
        if (vf.number != 1 || vf.type != kLengthDelimited) continue;
        Parser v(vf.bytes);
        std::string tag;
        std::optional<float> simple;
        std::optional<Histogram> histo;
        while (!v.done()) {
          TROUPE_ASSIGN_OR_RETURN(Field x, v.next());
          if (x.number == 1 && x.type == kLengthDelimited) {
            tag = std::string(x.bytes);
          } else if (x.number == 2 && x.type == kFixed32) {
            float fl;
            const auto bits = static_cast<uint32_t>(x.fixed);
            std::memcpy(&fl, &bits, 4);
            simple = fl;
          } else if (x.number == 5 && x.type == kLengthDelimited) {
            TROUPE_ASSIGN_OR_RETURN(Histogram h, decode_histogram(x.bytes));
            histo = std::move(h);
          }
        }
        if (tag.empty()) return data_loss("Summary.Value without a tag");
        if (simple) ev.scalars[tag] = *simple;
        if (histo) ev.histograms[tag] = std::move(*histo);
      }
    }
  }
  return ev;
}

Result<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error("tensorboard: cannot create {}: {}", dir, ec.message());
  char host[256] = "host";
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const double wall = std::chrono::duration<double>(now).count();
  const std::string path =
      fmt::format("{}/events.out.tfevents.{}.{}.{}.troupe", dir, static_cast<int64_t>(wall), host, getpid());
  std::FILE* f = std::fopen(path.c_str(), "wbx");  // x: never another writer's file
  if (f == nullptr) return io_error("tensorboard: cannot create {}: {}", path, std::strerror(errno));
  std::unique_ptr<TensorBoardWriter> w(new TensorBoardWriter(f, path));
  TROUPE_RETURN_IF_ERROR(w->write(encode_file_version_event(wall)));
  TROUPE_RETURN_IF_ERROR(w->flush());
  return w;
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_ != nullptr) std::fclose(f_);
}

Status TensorBoardWriter::write(const std::string& event) {
  const std::string rec = frame_record(event);
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size())
    return io_error("tensorboard: cannot write {}: {}", path_, std::strerror(errno));
  return ok_status();
}

Status TensorBoardWriter::scalar(int64_t step, const std::string& tag, double value, double wall_time) {
  return write(encode_scalar_event(wall_time, step, tag, static_cast<float>(value)));
}

Status TensorBoardWriter::histogram(int64_t step, const std::string& tag, const Histogram& h,
                                    double wall_time) {
  return write(encode_histogram_event(wall_time, step, tag, h));
}

Status TensorBoardWriter::flush() {
  if (std::fflush(f_) != 0) return io_error("tensorboard: cannot write {}: {}", path_, std::strerror(errno));
  return ok_status();
}

}  // namespace troupe::observe
