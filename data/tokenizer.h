// data/tokenizer.h — defines Tokenizer, a byte-level BPE tokenizer in the Hugging Face
// `tokenizers` JSON format (tokenizer.json: GPT-2, Llama 3, Qwen2/3 and Troupe's own), and
// BpeTrainer, which learns Troupe's own from text.
//
// Encoding follows the `tokenizers` library step by step, so that ids equal its
// Tokenizer.encode(text, add_special_tokens):
//   1. added tokens (special or not) are cut out of the text first (leftmost, longest);
//   2. the normalizer (none, or NFC / NFD / NFKC / NFKD) runs on the rest;
//   3. the pre-tokenizer splits it: Split by a regex ("Isolated": matches and the gaps
//      between them are pieces; PCRE2 with Unicode properties runs the GPT-2, Llama-3 and
//      Qwen patterns, \p{L}, \p{N}, (?i:...), lookahead), then ByteLevel (optionally its
//      own GPT-2 regex, optionally a prefix space per piece), which maps bytes to the
//      256 printable characters of GPT-2's table;
//   4. BPE merges each piece by rank (with `ignore_merges`, a piece that is a whole
//      vocabulary entry is that token);
//   5. with add_special_tokens, the post-processor's template (e.g. Llama 3's BOS).
// Text that is not valid UTF-8 has each bad byte replaced by U+FFFD first (what Python's
// decode(errors="replace") gives the library). Anything else in a file (a SentencePiece
// Metaspace pre-tokenizer, WordPiece, byte fallback, dropout, Lowercase, ...) is refused by
// name at load.
//
// Troupe's own tokenizers (BpeTrainer): ids 0..255 are the bytes, 256 is the special
// "<|endoftext|>" separating documents, 257.. the merges in rank order; the pre-tokenizer
// is Llama 3's pattern. They are written in the same format, so `tokenizers` and
// transformers load them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace troupe::layers {

// A compiled PCRE2 pattern (UTF, Unicode properties, JIT where available); shared by copies.
class TokenRegex {
 public:
  static Result<TokenRegex> compile(const std::string& pattern);
  // Byte ranges [begin, end) of the non-overlapping matches of `text` (valid UTF-8), left
  // to right; empty matches are skipped.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
};

class Tokenizer {
 public:
  // Troupe's own: the end-of-text token's content, and the pre-tokenizer pattern.
  static constexpr const char* kEndOfText = "<|endoftext|>";
  static const char* const kTroupePattern;

  // An HF tokenizer.json. The end-of-text token (eot()) is the `eot_token` given, else the
  // eos_token of a tokenizer_config.json beside the file, else the first added token named
  // <|endoftext|>, <|end_of_text|>, </s>, <|im_end|> or <eos>.
  static Result<Tokenizer> load(const std::string& path, const std::string& eot_token = "");
  static Result<Tokenizer> from_json(const nlohmann::json& j, const std::string& source);
  // Writes tokenizer.json (the file it was loaded from, as it was; Troupe's own in full).
  Status save(const std::string& path) const;

  // Ids of every token: vocabulary and added tokens (max id + 1).
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  // `tokenizers`' Tokenizer.encode(text, add_special_tokens).ids. Caches piece encodings.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false);
  // The text of the ids (special tokens left out with skip_special).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;
  // A token's bytes (an added token's content); empty for an unknown id.
  std::string token_bytes(int32_t id) const;
  std::optional<int32_t> token_id(std::string_view content) const;
  bool is_special(int32_t id) const;
  // The token that separates documents in the token shards; nullopt when the file names
  // none (then prepare asks for --eot-token).
  std::optional<int32_t> eot() const { return eot_; }
  Status set_eot(const std::string& content);
  // The merges as pairs of token ids, in rank order.
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merge_pairs_; }
  // The pre-tokenizer's pieces of `text` (after added tokens and the normalizer), as bytes.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  friend class BpeTrainer;
  struct Added {
    int32_t id = 0;
    std::string content;
    bool special = false, normalized = false;
  };
  struct Step {  // one pre-tokenizer step
    enum Kind { kSplit, kByteLevel } kind = kSplit;
    std::optional<TokenRegex> regex;  // kSplit; kByteLevel with use_regex
    bool add_prefix_space = false;    // kByteLevel
  };
  enum class Normalizer { kNone, kNFC, kNFD, kNFKC, kNFKD };

  Status build(const std::string& source);  // the tables below from tokens_, merges
  void split_added(std::string_view text, bool normalized_pass,
                   std::vector<std::pair<std::string, int32_t>>& out) const;
  std::vector<std::pair<std::string, int32_t>> segments(const std::string& text) const;
  void pieces(std::string segment, std::vector<std::string>& out) const;
  void encode_piece(const std::string& piece, std::vector<int32_t>& out);
  std::string normalize(std::string_view text) const;

  std::vector<std::string> tokens_;  // id -> token string (byte-level characters; added: content)
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<Added> added_;
  std::vector<std::pair<std::string, std::string>> merge_strings_;
  std::vector<std::pair<int32_t, int32_t>> merge_pairs_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> rank_;  // pair -> (rank, merged id)
  std::vector<int32_t> byte_id_;                                    // byte -> id (-1: absent)
  std::vector<std::string> token_raw_;                              // id -> bytes
  std::vector<Step> steps_;
  Normalizer normalizer_ = Normalizer::kNone;
  bool ignore_merges_ = false;
  std::vector<int32_t> prefix_ids_, suffix_ids_;  // the post-processor's single template
  std::optional<int32_t> eot_;
  std::shared_ptr<const std::string> file_text_;  // as loaded (save writes it back)
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// GPT-2's bytes_to_unicode: the printable character that stands for each byte.
std::string byte_level_char(uint8_t b);
// `text` with every byte that is not part of valid UTF-8 replaced by U+FFFD; `replaced`
// counts them.
std::string valid_utf8(std::string_view text, int64_t* replaced = nullptr);

class BpeTrainer {
 public:
  // Counts the pre-tokenizer pieces of `text` (call once per document).
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
  std::optional<TokenRegex> regex_;
};

}  // namespace troupe::layers
