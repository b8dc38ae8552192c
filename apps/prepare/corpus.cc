// apps/train_moe/corpus.cc — streaming reads of text and JSON-lines corpora (plain, gzip
// through zlib's gzread, Zstandard through ZSTD_decompressStream), and the progress line.
#include "apps/prepare/corpus.h"

#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

namespace troupe::prepare {

namespace fs = std::filesystem;

namespace {

constexpr size_t kChunk = 1 << 20;
constexpr size_t kMaxLine = size_t{256} << 20;  // a longer JSON-lines record is malformed
constexpr size_t kExamples = 5;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The decompressed bytes of one file, in chunks; consumed() is how far into the stored
// file it has read.
class Stream {
 public:
  virtual ~Stream() = default;
  // Bytes read into buf (0 at the end), or an error naming the file.
  virtual Result<size_t> read(char* buf, size_t n) = 0;
  virtual uint64_t consumed() = 0;
};

// Plain and gzip files (gzread passes a file that is not gzip through unchanged).
class GzStream final : public Stream {
 public:
  static Result<std::unique_ptr<Stream>> open(const std::string& path) {
    gzFile f = gzopen(path.c_str(), "rb");
    if (f == nullptr) return io_error("cannot open {}", path);
    gzbuffer(f, kChunk);
    return std::unique_ptr<Stream>(new GzStream(f, path));
  }
  ~GzStream() override { gzclose(f_); }
  Result<size_t> read(char* buf, size_t n) override {
    const int got = gzread(f_, buf, static_cast<unsigned>(n));
    if (got < 0) {
      int err = 0;
      const char* msg = gzerror(f_, &err);
      return data_loss("{}: cannot decompress (gzip): {}", path_, msg ? msg : "unknown error");
    }
    return static_cast<size_t>(got);
  }
  uint64_t consumed() override {
    const z_off_t o = gzoffset(f_);
    return o < 0 ? 0 : static_cast<uint64_t>(o);
  }

 private:
  GzStream(gzFile f, std::string path) : f_(f), path_(std::move(path)) {}
  gzFile f_;
  std::string path_;
};

class ZstdStream final : public Stream {
 public:
  static Result<std::unique_ptr<Stream>> open(const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return io_error("cannot open {}", path);
    return std::unique_ptr<Stream>(new ZstdStream(f, path));
  }
  ~ZstdStream() override {
    ZSTD_freeDStream(d_);
    std::fclose(f_);
  }
  Result<size_t> read(char* buf, size_t n) override {
    ZSTD_outBuffer out{buf, n, 0};
    while (out.pos == 0) {
      if (in_.pos == in_.size) {
        if (eof_) {
          if (!frame_done_)
            return data_loss("{}: the Zstandard stream ends in the middle of a frame (truncated)", path_);
          return size_t{0};
        }
        const size_t got = std::fread(inbuf_.data(), 1, inbuf_.size(), f_);
        if (got == 0) {
          if (std::ferror(f_)) return io_error("{}: read error", path_);
          eof_ = true;
          continue;
        }
        consumed_ += got;
        in_ = ZSTD_inBuffer{inbuf_.data(), got, 0};
      }
      const size_t r = ZSTD_decompressStream(d_, &out, &in_);
      if (ZSTD_isError(r)) return data_loss("{}: cannot decompress (zstd): {}", path_, ZSTD_getErrorName(r));
      frame_done_ = r == 0;
    }
    return out.pos;
  }
  uint64_t consumed() override { return consumed_; }

 private:
  ZstdStream(FILE* f, std::string path)
      : f_(f), path_(std::move(path)), d_(ZSTD_createDStream()), inbuf_(ZSTD_DStreamInSize()) {
    ZSTD_initDStream(d_);
  }
  FILE* f_;
  std::string path_;
  ZSTD_DStream* d_;
  std::vector<char> inbuf_;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  bool eof_ = false, frame_done_ = true;
  uint64_t consumed_ = 0;
};

Result<std::unique_ptr<Stream>> open_stream(const std::string& path) {
  if (path.ends_with(".zst") || path.ends_with(".zstd")) return ZstdStream::open(path);
  return GzStream::open(path);
}

bool ends_with_any(const std::string& name, const std::vector<std::string>& exts) {
  return std::any_of(exts.begin(), exts.end(), [&](const std::string& e) { return name.ends_with(e); });
}

}  // namespace

bool Corpus::is_jsonl(const std::string& path) {
  std::string p = path;
  for (const char* c : {".gz", ".zst", ".zstd"})
    if (p.ends_with(c)) p.resize(p.size() - std::string_view(c).size());
  return p.ends_with(".jsonl") || p.ends_with(".ndjson");
}

Result<Corpus> Corpus::open(const CorpusOptions& o) {
  Corpus c;
  c.o_ = o;
  for (const auto& in : o.inputs) {
    std::error_code ec;
    if (fs::is_regular_file(in, ec)) {
      c.files_.push_back(in);
    } else if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(in, fs::directory_options::skip_permission_denied, ec);
           it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (ec) break;
        if (!it->is_regular_file(ec)) continue;
        if (ends_with_any(it->path().filename().string(), o.extensions)) found.push_back(it->path().string());
      }
      std::sort(found.begin(), found.end());
      c.files_.insert(c.files_.end(), found.begin(), found.end());
    } else {
      return not_found("prepare: input {} does not exist", in);
    }
  }
  if (c.files_.empty()) {
    return not_found("prepare: no input files under {} (extensions taken from directories: {})",
                     fmt::join(o.inputs, ", "), fmt::join(o.extensions, " "));
  }
  for (const auto& f : c.files_) {
    std::error_code ec;
    const auto n = fs::file_size(f, ec);
    if (!ec) c.stored_bytes_ += n;
  }
  return c;
}

Result<CorpusStats> Corpus::for_each(const std::function<Status(std::string_view)>& doc,
                                     const std::function<void(uint64_t, int64_t)>& progress) const {
  CorpusStats st;
  uint64_t before = 0;  // stored bytes of the files done
  std::vector<char> buf(kChunk);
  const auto capped = [&] { return o_.max_bytes > 0 && st.bytes >= o_.max_bytes; };
  for (const std::string& path : files_) {
    if (capped()) break;
    auto opened = open_stream(path);
    if (!opened.ok()) {
      ++st.skipped_files;
      continue;
    }
    Stream& in = **opened;
    uint64_t next_report = 4 << 20;
    if (!is_jsonl(path)) {
      // A text file is one document; binaries (NUL bytes) are skipped.
      std::string text;
      while (true) {
        TROUPE_ASSIGN_OR_RETURN(size_t n, in.read(buf.data(), buf.size()));
        if (n == 0) break;
        text.append(buf.data(), n);
      }
      if (text.empty() || text.find('\0') != std::string::npos) {
        ++st.skipped_files;
      } else {
        st.bytes += static_cast<int64_t>(text.size());
        ++st.documents;
        TROUPE_RETURN_IF_ERROR(doc(text));
      }
    } else {
      std::string line;
      int64_t line_no = 0;
      bool too_long = false;
      const auto record = [&]() -> Status {
        ++line_no;
        if (line.empty() && !too_long) return ok_status();
        std::string why;
        nlohmann::json j;
        if (too_long) {
          why = fmt::format("longer than {} MiB", kMaxLine >> 20);
        } else {
          j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
          if (j.is_discarded()) {
            why = "not valid JSON";
          } else if (!j.is_object()) {
            why = "not a JSON object";
          } else if (!j.contains(o_.text_key)) {
            why = fmt::format("no field \"{}\"", o_.text_key);
          } else if (!j[o_.text_key].is_string()) {
            why = fmt::format("field \"{}\" is not a string", o_.text_key);
          }
        }
        too_long = false;
        if (!why.empty()) {
          const std::string where = fmt::format("{}:{}: {}", path, line_no, why);
          if (o_.strict) return invalid_argument("prepare: malformed record {} (--strict)", where);
          ++st.malformed;
          if (st.malformed_examples.size() < kExamples) st.malformed_examples.push_back(where);
          return ok_status();
        }
        const std::string& text = j[o_.text_key].get_ref<const std::string&>();
        if (text.empty()) return ok_status();
        st.bytes += static_cast<int64_t>(text.size());
        ++st.documents;
        return doc(text);
      };
      while (!capped()) {
        TROUPE_ASSIGN_OR_RETURN(size_t n, in.read(buf.data(), buf.size()));
        if (n == 0) break;
        size_t at = 0;
        while (at < n && !capped()) {
          const char* nl = static_cast<const char*>(std::memchr(buf.data() + at, '\n', n - at));
          const size_t end = nl ? static_cast<size_t>(nl - buf.data()) : n;
          if (!too_long) {
            if (line.size() + (end - at) > kMaxLine) {
              too_long = true;
              line.clear();
              line.shrink_to_fit();
            } else {
              line.append(buf.data() + at, end - at);
            }
          }
          at = end;
          if (nl == nullptr) break;
          ++at;
          if (!line.empty() && line.back() == '\r') line.pop_back();
          TROUPE_RETURN_IF_ERROR(record());
          line.clear();
        }
        if (progress && in.consumed() >= next_report) {
          progress(before + in.consumed(), st.documents);
          next_report = in.consumed() + (4 << 20);
        }
      }
      if (!capped() && (!line.empty() || too_long))
        TROUPE_RETURN_IF_ERROR(record());  // a last line without '\n'
    }
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    before += ec ? in.consumed() : size;
    if (progress) progress(before, st.documents);
  }
  return st;
}

ProgressLine::ProgressLine(std::string what, uint64_t total)
    : what_(std::move(what)), total_(total), tty_(isatty(STDOUT_FILENO) == 1), start_(now_s()) {}

void ProgressLine::update(uint64_t done, int64_t documents) {
  const double t = now_s();
  if (tty_ ? t - last_ < 0.2 : t - last_ < 10.0) return;
  last_ = t;
  printed_ = done;
  const double frac =
      total_ > 0 ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total_)) : 0.0;
  const double el = t - start_;
  const double rate = el > 0 ? static_cast<double>(done) / el : 0.0;
  const double left = rate > 0 && total_ > done ? static_cast<double>(total_ - done) / rate : 0.0;
  const int width = 24, fill = static_cast<int>(frac * width);
  const std::string bar =
      std::string(static_cast<size_t>(fill), '#') + std::string(static_cast<size_t>(width - fill), ' ');
  fmt::print("{}{}: [{}] {:5.1f}% {:.1f}/{:.1f} MB{}, {:.1f} MB/s, {:.0f}s left{}", tty_ ? "\r" : "", what_,
             bar, 100.0 * frac, static_cast<double>(done) / 1e6, static_cast<double>(total_) / 1e6,
             documents >= 0 ? fmt::format(", {} documents", documents) : "", rate / 1e6, left,
             tty_ ? "   " : "\n");
  std::fflush(stdout);
}

void ProgressLine::finish(uint64_t done, int64_t documents) {
  if (printed_ != done) {  // else the last line already says so
    last_ = -1e9;
    update(done, documents);
  }
  if (tty_) fmt::print("\n");
}

}  // namespace troupe::prepare
