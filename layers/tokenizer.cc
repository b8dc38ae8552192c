// layers/tokenizer.cc — byte-level BPE: pre-tokenisation, encoding, training, file format.
#include "layers/tokenizer.h"

#include <fstream>
#include <queue>
#include <sstream>

#include <nlohmann/json.hpp>

namespace troupe::layers {

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

enum class ByteClass { kWord, kSpace, kOtherSpace, kPunct };

ByteClass classify(unsigned char c) {
  if (c >= 0x80 || c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
    return ByteClass::kWord;
  }
  if (c == ' ') return ByteClass::kSpace;
  if (c == '\n' || c == '\t' || c == '\r' || c == '\v' || c == '\f') return ByteClass::kOtherSpace;
  return ByteClass::kPunct;
}

bool is_space(ByteClass k) { return k == ByteClass::kSpace || k == ByteClass::kOtherSpace; }

}  // namespace

std::vector<std::string_view> pre_tokenize(std::string_view text) {
  std::vector<std::string_view> out;
  const size_t n = text.size();
  auto cls = [&](size_t i) { return classify(static_cast<unsigned char>(text[i])); };
  size_t i = 0;
  while (i < n) {
    const size_t start = i;
    ByteClass k = cls(i);
    if (k == ByteClass::kSpace && i + 1 < n && !is_space(cls(i + 1))) {
      ++i;  // one leading space joins the following word or punctuation run
      k = cls(i);
    }
    if (k == ByteClass::kWord) {
      while (i < n && cls(i) == ByteClass::kWord) ++i;
    } else if (k == ByteClass::kPunct) {
      const char c0 = text[i];
      while (i < n && text[i] == c0) ++i;  // runs of one punctuation byte ("==", "...")
    } else {
      while (i < n && is_space(cls(i))) ++i;
      // Leave the last space of a whitespace run to the word after it.
      if (i < n && i - start > 1 && text[i - 1] == ' ') --i;
    }
    out.push_back(text.substr(start, i - start));
  }
  return out;
}

Tokenizer::Tokenizer(std::vector<std::pair<int32_t, int32_t>> merges) : merges_(std::move(merges)) {
  bytes_.resize(static_cast<size_t>(vocab_size()));
  for (int32_t b = 0; b < 256; ++b) bytes_[static_cast<size_t>(b)] = std::string(1, static_cast<char>(b));
  for (size_t i = 0; i < merges_.size(); ++i) {
    const auto [a, b] = merges_[i];
    const int32_t id = kFirstMerge + static_cast<int32_t>(i);
    rank_[pair_key(a, b)] = static_cast<int32_t>(i);
    bytes_[static_cast<size_t>(id)] = bytes_[static_cast<size_t>(a)] + bytes_[static_cast<size_t>(b)];
  }
}

void Tokenizer::encode_chunk(std::string_view chunk, std::vector<int32_t>& out) {
  auto it = cache_.find(std::string(chunk));
  if (it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> w;
  w.reserve(chunk.size());
  for (char ch : chunk) w.push_back(static_cast<unsigned char>(ch));
  // Repeatedly merge the adjacent pair of lowest rank (as the merges were learned).
  while (w.size() > 1) {
    int32_t best = INT32_MAX;
    for (size_t j = 0; j + 1 < w.size(); ++j) {
      auto r = rank_.find(pair_key(w[j], w[j + 1]));
      if (r != rank_.end() && r->second < best) best = r->second;
    }
    if (best == INT32_MAX) break;
    const auto [a, b] = merges_[static_cast<size_t>(best)];
    const int32_t id = kFirstMerge + best;
    size_t o = 0;
    for (size_t j = 0; j < w.size(); ++j) {
      if (j + 1 < w.size() && w[j] == a && w[j + 1] == b) {
        w[o++] = id;
        ++j;
      } else {
        w[o++] = w[j];
      }
    }
    w.resize(o);
  }
  out.insert(out.end(), w.begin(), w.end());
  if (cache_.size() < (1u << 20)) cache_.emplace(std::string(chunk), std::move(w));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view chunk : pre_tokenize(text)) encode_chunk(chunk, out);
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id == kEot || id < 0 || id >= vocab_size()) return {};
  return bytes_[static_cast<size_t>(id)];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) s += token_bytes(id);
  return s;
}

Status Tokenizer::save(const std::string& path) const {
  nlohmann::json j;
  j["type"] = "troupe-byte-bpe";
  j["version"] = 1;
  j["eot"] = kEot;
  j["vocab_size"] = vocab_size();
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [a, b] : merges_) m.push_back({a, b});
  j["merges"] = std::move(m);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return io_error("cannot write tokenizer {}", tmp);
    f << j.dump() << "\n";
    if (!f) return io_error("cannot write tokenizer {}", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return io_error("cannot rename {} to {}", tmp, path);
  return ok_status();
}

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("tokenizer file {} not found (run `troupe-prepare` first)", path);
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    return data_loss("tokenizer {}: not valid JSON: {}", path, e.what());
  }
  if (j.value("type", "") != "troupe-byte-bpe" || j.value("version", 0) != 1 || !j.contains("merges")) {
    return data_loss("tokenizer {}: not a troupe-byte-bpe version 1 file", path);
  }
  std::vector<std::pair<int32_t, int32_t>> merges;
  int32_t next = kFirstMerge;
  for (const auto& m : j["merges"]) {
    if (!m.is_array() || m.size() != 2 || !m[0].is_number_integer() || !m[1].is_number_integer()) {
      return data_loss("tokenizer {}: merge {} is not a pair of ids", path, next - kFirstMerge);
    }
    const int32_t a = m[0].get<int32_t>(), b = m[1].get<int32_t>();
    if (a < 0 || b < 0 || a >= next || b >= next || a == kEot || b == kEot) {
      return data_loss("tokenizer {}: merge {} refers to an unknown token", path, next - kFirstMerge);
    }
    merges.emplace_back(a, b);
    ++next;
  }
  return Tokenizer(std::move(merges));
}

void BpeTrainer::add_text(std::string_view text) {
  for (std::string_view chunk : pre_tokenize(text)) counts_[std::string(chunk)]++;
}

Result<Tokenizer> BpeTrainer::train(int64_t vocab_size, const std::function<void(int64_t, int64_t)>& progress) {
  if (vocab_size < Tokenizer::kFirstMerge) {
    return invalid_argument("vocab size {} is too small: a byte-level BPE needs at least {}", vocab_size,
                            Tokenizer::kFirstMerge);
  }
  const int64_t want = vocab_size - Tokenizer::kFirstMerge;

  // Words in a fixed order (sorted), so training does not depend on hash-map order.
  std::vector<std::pair<std::string, int64_t>> sorted(counts_.begin(), counts_.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> freq(sorted.size());
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;  // pair -> words (may repeat)
  for (size_t w = 0; w < sorted.size(); ++w) {
    freq[w] = sorted[w].second;
    for (char ch : sorted[w].first) words[w].push_back(static_cast<unsigned char>(ch));
    for (size_t j = 0; j + 1 < words[w].size(); ++j) {
      const uint64_t k = pair_key(words[w][j], words[w][j + 1]);
      pair_count[k] += freq[w];
      where[k].push_back(static_cast<int32_t>(w));
    }
  }

  struct Entry {
    int64_t count;
    uint64_t key;
    bool operator<(const Entry& o) const {  // max-heap: larger count, then smaller key first
      return count != o.count ? count < o.count : key > o.key;
    }
  };
  std::priority_queue<Entry> heap;
  for (const auto& [k, c] : pair_count) heap.push({c, k});

  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<int64_t> last_seen(words.size(), -1);
  while (static_cast<int64_t>(merges.size()) < want && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    auto pc = pair_count.find(top.key);
    const int64_t current = pc == pair_count.end() ? 0 : pc->second;
    if (current != top.count) {  // stale entry
      if (current > 0 && current < top.count) heap.push({current, top.key});
      continue;
    }
    if (current < 2) break;  // nothing left worth merging
    const int32_t a = static_cast<int32_t>(top.key >> 32), b = static_cast<int32_t>(top.key & 0xffffffffu);
    const int32_t id = Tokenizer::kFirstMerge + static_cast<int32_t>(merges.size());
    merges.emplace_back(a, b);
    const int64_t merge_no = static_cast<int64_t>(merges.size());
    std::vector<int32_t> affected = std::move(where[top.key]);
    where.erase(top.key);
    std::unordered_map<uint64_t, int64_t> delta;
    for (int32_t wi : affected) {
      if (last_seen[static_cast<size_t>(wi)] == merge_no) continue;  // duplicate entry
      last_seen[static_cast<size_t>(wi)] = merge_no;
      std::vector<int32_t>& w = words[static_cast<size_t>(wi)];
      const int64_t f = freq[static_cast<size_t>(wi)];
      bool has = false;
      for (size_t j = 0; j + 1 < w.size(); ++j) has |= (w[j] == a && w[j + 1] == b);
      if (!has) continue;
      for (size_t j = 0; j + 1 < w.size(); ++j) delta[pair_key(w[j], w[j + 1])] -= f;
      size_t o = 0;
      for (size_t j = 0; j < w.size(); ++j) {
        if (j + 1 < w.size() && w[j] == a && w[j + 1] == b) {
          w[o++] = id;
          ++j;
        } else {
          w[o++] = w[j];
        }
      }
      w.resize(o);
      for (size_t j = 0; j + 1 < w.size(); ++j) {
        const uint64_t k = pair_key(w[j], w[j + 1]);
        delta[k] += f;
        if (w[j] == id || w[j + 1] == id) where[k].push_back(wi);
      }
    }
    for (const auto& [k, d] : delta) {
      if (d == 0) continue;
      int64_t& c = pair_count[k];
      c += d;
      if (d > 0) heap.push({c, k});
      if (c == 0) pair_count.erase(k);
    }
    pair_count.erase(top.key);
    if (progress && merge_no % 64 == 0) progress(merge_no, want);
  }
  if (progress) progress(static_cast<int64_t>(merges.size()), want);
  return Tokenizer(std::move(merges));
}

}  // namespace troupe::layers
