// layers/tokenizer.h — defines Tokenizer, a byte-level BPE (ids 0..255 are bytes, 256 is
// the end-of-text token separating documents, 257.. are merges in rank order), and
// BpeTrainer, which learns the merges from text.
//
// Text is first split into chunks (pre_tokenize): a run of word bytes (ASCII letters,
// digits, '_', and every byte >= 0x80) or of one punctuation byte class, each optionally
// preceded by one space; and runs of other whitespace. Merges never cross a chunk, so a
// chunk's encoding is independent of its neighbours and is cached.
//
// Every byte string round-trips: decode(encode(s)) == s.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace troupe::layers {

class Tokenizer {
 public:
  static constexpr int32_t kEot = 256;
  static constexpr int32_t kFirstMerge = 257;

  Tokenizer() = default;
  explicit Tokenizer(std::vector<std::pair<int32_t, int32_t>> merges);

  int64_t vocab_size() const { return kFirstMerge + static_cast<int64_t>(merges_.size()); }
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }

  std::vector<int32_t> encode(std::string_view text);  // caches chunk encodings
  // Bytes of the tokens; the end-of-text token decodes to nothing.
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string token_bytes(int32_t id) const;

  // JSON file {"type": "troupe-byte-bpe", "version": 1, "merges": [[a, b], ...]}.
  Status save(const std::string& path) const;
  static Result<Tokenizer> load(const std::string& path);

 private:
  void encode_chunk(std::string_view chunk, std::vector<int32_t>& out);
  std::vector<std::pair<int32_t, int32_t>> merges_;
  std::unordered_map<uint64_t, int32_t> rank_;  // pair key -> merge index
  std::vector<std::string> bytes_;              // token id -> its bytes
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// Splits text into the chunks described above (views into `text`).
std::vector<std::string_view> pre_tokenize(std::string_view text);

class BpeTrainer {
 public:
  // Counts the chunks of `text` (call once per document).
  void add_text(std::string_view text);
  int64_t unique_chunks() const { return static_cast<int64_t>(counts_.size()); }

  // Learns merges until vocab_size tokens (or no pair occurs twice). Pair counts are
  // updated incrementally after each merge (only the words containing the merged pair
  // are touched), with a max-heap of lazily invalidated counts. Ties go to the smaller
  // pair (first id, then second), so training is deterministic. progress(done, total) is
  // called every 64 merges.
  Result<Tokenizer> train(int64_t vocab_size, const std::function<void(int64_t, int64_t)>& progress = {});

 private:
  std::unordered_map<std::string, int64_t> counts_;
};

}  // namespace troupe::layers
