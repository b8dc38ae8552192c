// data/token_data.cc — shard files, memory-mapped reading, deterministic batches.
#include "data/token_data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "layers/parameter.h"

namespace troupe::layers {

namespace {
constexpr char kMagic[8] = {'T', 'R', 'P', 'T', 'O', 'K', 'S', '1'};
constexpr size_t kHeaderBytes = 24;
}  // namespace

ShardWriter::ShardWriter(std::string dir, std::string split, int token_bytes, int64_t shard_tokens)
    : dir_(std::move(dir)), split_(std::move(split)), token_bytes_(token_bytes), shard_tokens_(shard_tokens) {
  TROUPE_CHECK(token_bytes == 2 || token_bytes == 4, "token_bytes {}", token_bytes);
  TROUPE_CHECK_GT(shard_tokens, 0);
}

ShardWriter::~ShardWriter() = default;

Status ShardWriter::append(const std::vector<int32_t>& tokens) {
  for (int32_t t : tokens) {
    buf_.push_back(t);
    if (static_cast<int64_t>(buf_.size()) == shard_tokens_) TROUPE_RETURN_IF_ERROR(flush());
  }
  return ok_status();
}

Status ShardWriter::flush() {
  if (buf_.empty()) return ok_status();
  const std::string path = fmt::format("{}/{}-{:05d}.bin", dir_, split_, files_.size());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return io_error("cannot create shard {}", path);
  const uint32_t version = 1, tb = static_cast<uint32_t>(token_bytes_);
  const uint64_t n = buf_.size();
  f.write(kMagic, 8);
  f.write(reinterpret_cast<const char*>(&version), 4);
  f.write(reinterpret_cast<const char*>(&tb), 4);
  f.write(reinterpret_cast<const char*>(&n), 8);
  if (token_bytes_ == 2) {
    std::vector<uint16_t> v(buf_.begin(), buf_.end());
    f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 2));
  } else {
    f.write(reinterpret_cast<const char*>(buf_.data()), static_cast<std::streamsize>(buf_.size() * 4));
  }
  if (!f) return io_error("cannot write shard {}", path);
  total_ += static_cast<int64_t>(n);
  files_.push_back(path);
  buf_.clear();
  return ok_status();
}

Status ShardWriter::finish() { return flush(); }

struct TokenShards::Shard {
  std::string path;
  void* map = nullptr;
  size_t map_bytes = 0;
  const unsigned char* tokens = nullptr;
  int token_bytes = 2;
  int64_t count = 0;
  ~Shard() {
    if (map) munmap(map, map_bytes);
  }
};

TokenShards::TokenShards(TokenShards&&) noexcept = default;
TokenShards& TokenShards::operator=(TokenShards&&) noexcept = default;
TokenShards::~TokenShards() = default;

Result<TokenShards> TokenShards::open(const std::string& dir, const std::string& split) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return not_found("data directory {} does not exist (run `troupe-prepare --out {}` first)", dir, dir);
  }
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(split + "-", 0) == 0 && name.size() > 4 && name.substr(name.size() - 4) == ".bin") {
      paths.push_back(e.path().string());
    }
  }
  if (paths.empty()) return not_found("no {} shards ({}-*.bin) in {}", split, split, dir);
  std::sort(paths.begin(), paths.end());
  TokenShards ts;
  for (const auto& p : paths) {
    auto sh = std::make_unique<Shard>();
    const int fd = ::open(p.c_str(), O_RDONLY);
    if (fd < 0) return io_error("cannot open shard {}: {}", p, std::strerror(errno));
    struct stat stt {};
    fstat(fd, &stt);
    const size_t bytes = static_cast<size_t>(stt.st_size);
    if (bytes < kHeaderBytes) {
      ::close(fd);
      return data_loss("shard {} is truncated ({} bytes)", p, bytes);
    }
    void* m = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) return io_error("cannot map shard {}", p);
    sh->map = m;
    sh->map_bytes = bytes;
    const auto* base = static_cast<const unsigned char*>(m);
    uint32_t version = 0, tb = 0;
    uint64_t n = 0;
    std::memcpy(&version, base + 8, 4);
    std::memcpy(&tb, base + 12, 4);
    std::memcpy(&n, base + 16, 8);
    if (std::memcmp(base, kMagic, 8) != 0 || version != 1 || (tb != 2 && tb != 4)) {
      return data_loss("{} is not a Troupe token shard (bad header)", p);
    }
    if (kHeaderBytes + n * tb != bytes) {
      return data_loss("shard {} holds {} bytes, header says {} tokens of {} bytes", p, bytes, n, tb);
    }
    sh->path = p;
    sh->tokens = base + kHeaderBytes;
    sh->token_bytes = static_cast<int>(tb);
    sh->count = static_cast<int64_t>(n);
    ts.begin_.push_back(ts.total_);
    ts.total_ += sh->count;
    ts.shards_.push_back(std::move(sh));
  }
  return ts;
}

namespace {
// The index of the first token of `n` at `p` (little-endian, T-sized) that is not below
// `vocab`, or n.
template <typename T>
int64_t first_out_of_range(const unsigned char* p, int64_t n, int64_t vocab) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    // A branch-free maximum per block (vectorised); the exact position only on a hit.
    T worst = 0;
    for (int64_t i = b; i < e; ++i) {
      T v;
      std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
      worst = std::max(worst, v);
    }
    if (static_cast<int64_t>(worst) >= vocab) {
      for (int64_t i = b; i < e; ++i) {
        T v;
        std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
        if (static_cast<int64_t>(v) >= vocab) return i;
      }
    }
  }
  return n;
}
}  // namespace

Status TokenShards::check_token_ids(int64_t vocab) const {
  for (const auto& sh : shards_) {
    const int64_t at = sh->token_bytes == 2 ? first_out_of_range<uint16_t>(sh->tokens, sh->count, vocab)
                                            : first_out_of_range<uint32_t>(sh->tokens, sh->count, vocab);
    if (at == sh->count) continue;
    uint32_t id = 0;
    if (sh->token_bytes == 2) {
      uint16_t v;
      std::memcpy(&v, sh->tokens + at * 2, 2);
      id = v;
    } else {
      std::memcpy(&id, sh->tokens + at * 4, 4);
    }
    return data_loss("shard {}: token {} (of {}) is id {}, outside the vocabulary [0, {}) (model.vocab_size)",
                     sh->path, at, sh->count, id, vocab);
  }
  return ok_status();
}

void TokenShards::read(int64_t start, int64_t n, int32_t* out) const {
  TROUPE_CHECK(start >= 0 && n >= 0 && start + n <= total_, "read [{}, {}) of {} tokens", start, start + n, total_);
  size_t s = static_cast<size_t>(std::upper_bound(begin_.begin(), begin_.end(), start) - begin_.begin()) - 1;
  while (n > 0) {
    const Shard& sh = *shards_[s];
    const int64_t off = start - begin_[s];
    const int64_t take = std::min(n, sh.count - off);
    for (int64_t i = 0; i < take; ++i) {
      if (sh.token_bytes == 2) {
        uint16_t v;
        std::memcpy(&v, sh.tokens + (off + i) * 2, 2);
        out[i] = v;
      } else {
        std::memcpy(&out[i], sh.tokens + (off + i) * 4, 4);
      }
    }
    out += take;
    start += take;
    n -= take;
    ++s;
  }
}

DataLoader::DataLoader(const TokenShards& data, uint64_t seed, int64_t seq_len)
    : data_(data), seed_(seed), seq_len_(seq_len) {
  TROUPE_CHECK_GT(data.size(), seq_len, "the data holds fewer tokens than one sequence");
}

int64_t DataLoader::sequence_start(int64_t step, int64_t sample) const {
  const uint64_t h = mix64(seed_ ^ mix64(static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL ^
                                         mix64(static_cast<uint64_t>(sample) + 0x632be59bd9b4e019ULL)));
  const uint64_t range = static_cast<uint64_t>(data_.size() - seq_len_);  // start + seq_len + 1 <= size
  return static_cast<int64_t>(h % range);
}

void DataLoader::window(int64_t start, int64_t row, Tensor& ids, Tensor& targets) const {
  std::vector<int32_t> buf(static_cast<size_t>(seq_len_ + 1));
  data_.read(start, seq_len_ + 1, buf.data());
  int32_t* ip = ids.data<int32_t>() + row * seq_len_;
  int32_t* tp = targets.data<int32_t>() + row * seq_len_;
  std::copy(buf.begin(), buf.end() - 1, ip);
  std::copy(buf.begin() + 1, buf.end(), tp);
}

void DataLoader::train_batch(int64_t step, int64_t dp_rank, int64_t micro, int64_t grad_accum, int64_t micro_batch,
                             Tensor& ids, Tensor& targets) const {
  ids = Tensor::empty({micro_batch, seq_len_}, DType::kI32);
  targets = Tensor::empty({micro_batch, seq_len_}, DType::kI32);
  for (int64_t i = 0; i < micro_batch; ++i) {
    const int64_t sample = (dp_rank * grad_accum + micro) * micro_batch + i;
    window(sequence_start(step, sample), i, ids, targets);
  }
}

void DataLoader::eval_batch(int64_t k, int64_t total, int64_t micro_batch, Tensor& ids, Tensor& targets) const {
  ids = Tensor::empty({micro_batch, seq_len_}, DType::kI32);
  targets = Tensor::empty({micro_batch, seq_len_}, DType::kI32);
  const int64_t n = total * micro_batch;
  const int64_t range = data_.size() - seq_len_ - 1;
  for (int64_t i = 0; i < micro_batch; ++i) {
    const int64_t idx = k * micro_batch + i;
    window(n > 1 ? range * idx / (n - 1) : 0, i, ids, targets);
  }
}

}  // namespace troupe::layers
