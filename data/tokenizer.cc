// data/tokenizer.cc — byte-level BPE in the Hugging Face format: loading and checking
// tokenizer.json, the encoding pipeline (added tokens, normalizer, regex pre-tokenizer,
// byte-level BPE, post-processor), decoding, and BpeTrainer.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

namespace troupe::layers {

using nlohmann::json;

// Llama 3's pre-tokenizer: contractions (any case), a letter run with at most one
// non-letter before it, numbers in groups of up to three digits, punctuation runs with
// their newlines, newline runs, and whitespace (a run before a word leaves its last space
// to the word).
const char* const Tokenizer::kTroupePattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// GPT-2's ByteLevel pre-tokenizer pattern (use_regex = true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// bytes_to_unicode(): the printable bytes stand for themselves, the others for 256 + n.
const std::vector<std::string>& byte_chars() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      append_utf8(t[static_cast<size_t>(b)],
                  printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++));
    }
    return t;
  }();
  return table;
}

// The byte a byte-level character stands for, keyed by the character's UTF-8.
const std::unordered_map<std::string, uint8_t>& char_bytes() {
  static const std::unordered_map<std::string, uint8_t> table = [] {
    std::unordered_map<std::string, uint8_t> t;
    for (int b = 0; b < 256; ++b) t[byte_chars()[static_cast<size_t>(b)]] = static_cast<uint8_t>(b);
    return t;
  }();
  return table;
}

// Length of the UTF-8 sequence starting at s[i] if it is valid there, else 0.
size_t utf8_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = 0;
  uint32_t cp = 0;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (d & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
      (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
    return 0;
  }
  return n;
}

// The bytes of a token string made of byte-level characters; nullopt when a character is
// not one of them.
std::optional<std::string> raw_bytes(const std::string& token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const size_t n = utf8_len(token, i);
    if (n == 0) return std::nullopt;
    auto it = char_bytes().find(token.substr(i, n));
    if (it == char_bytes().end()) return std::nullopt;
    out += static_cast<char>(it->second);
    i += n;
  }
  return out;
}

std::string byte_level(std::string_view bytes) {
  std::string s;
  for (char c : bytes) s += byte_chars()[static_cast<uint8_t>(c)];
  return s;
}

}  // namespace

std::string byte_level_char(uint8_t b) {
  return byte_chars()[b];
}

std::string valid_utf8(std::string_view text, int64_t* replaced) {
  std::string out;
  out.reserve(text.size());
  int64_t bad = 0;
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_len(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++bad;
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  if (replaced) *replaced = bad;
  return out;
}

// ---- TokenRegex -------------------------------------------------------------------------

struct TokenRegex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Result<TokenRegex> TokenRegex::compile(const std::string& pattern) {
  int err = 0;
  PCRE2_SIZE at = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return invalid_argument("pre-tokenizer regex /{}/: {} at offset {}", pattern,
                            reinterpret_cast<const char*>(msg), at);
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: the interpreter runs otherwise
  auto c = std::make_shared<Code>();
  c->code = code;
  TokenRegex r;
  r.code_ = std::move(c);
  r.pattern_ = pattern;
  return r;
}

std::vector<std::pair<size_t, size_t>> TokenRegex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  size_t at = 0;
  while (at <= text.size()) {
    const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                               PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;  // PCRE2_ERROR_NOMATCH (or a resource limit: the rest is one gap)
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e > b) {
      out.emplace_back(b, e);
      at = e;
    } else {  // an empty match: go on after the character it stands before
      if (b >= text.size()) break;
      at = b + std::max<size_t>(1, utf8_len(text, b));
    }
  }
  pcre2_match_data_free(md);
  return out;
}

// ---- loading ------------------------------------------------------------------------------

namespace {

Status refuse(const std::string& source, const std::string& what) {
  return failed_precondition(
      "{}: {} is not supported (Troupe reads byte-level BPE tokenizers: GPT-2, Llama 3, "
      "Qwen and its own)",
      source, what);
}

std::string json_type(const json& j) {
  return j.is_object() ? j.value("type", std::string("?")) : j.dump();
}

}  // namespace

Result<Tokenizer> Tokenizer::load(const std::string& path, const std::string& eot_token) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("tokenizer file {} not found (run `troupe-prepare` first)", path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto text = std::make_shared<const std::string>(ss.str());
  json j;
  try {
    j = json::parse(*text);
  } catch (const std::exception& e) {
    return data_loss("tokenizer {}: not valid JSON: {}", path, e.what());
  }
  if (j.is_object() && j.value("type", "") == "troupe-byte-bpe") {
    return data_loss(
        "tokenizer {} is in the format of earlier Troupe versions; run `troupe-prepare` again (it "
        "now writes the Hugging Face tokenizer.json format)",
        path);
  }
  TROUPE_ASSIGN_OR_RETURN(Tokenizer tok, from_json(j, path));
  tok.file_text_ = text;
  // The end-of-text token: asked for, else tokenizer_config.json's eos_token, else a
  // conventional name.
  std::string want = eot_token;
  if (want.empty()) {
    const std::string cfg = (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
    std::ifstream cf(cfg);
    if (cf) {
      const json c = json::parse(cf, nullptr, false);
      if (c.is_object() && c.contains("eos_token")) {
        const json& e = c["eos_token"];
        if (e.is_string()) want = e.get<std::string>();
        if (e.is_object() && e.contains("content") && e["content"].is_string())
          want = e["content"].get<std::string>();
      }
    }
  }
  if (!want.empty()) {
    TROUPE_RETURN_IF_ERROR(tok.set_eot(want).with_context(path));
  } else {
    for (const char* name : {kEndOfText, "<|end_of_text|>", "</s>", "<|im_end|>", "<eos>"}) {
      if (auto id = tok.token_id(name)) {
        tok.eot_ = *id;
        break;
      }
    }
  }
  return tok;
}

Status Tokenizer::set_eot(const std::string& content) {
  std::optional<int32_t> id = token_id(content);
  if (!id) return not_found("the tokenizer has no token '{}' to end documents with", content);
  eot_ = *id;
  return ok_status();
}

Result<Tokenizer> Tokenizer::from_json(const json& j, const std::string& src) {
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) {
    return data_loss("tokenizer {}: not a Hugging Face tokenizer.json (no \"model\" object)", src);
  }
  Tokenizer t;
  const json& m = j["model"];
  if (m.value("type", std::string("BPE")) != "BPE")
    return refuse(src, fmt::format("model type '{}'", json_type(m)));
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(key) && !m[key].is_null())
      return refuse(src, fmt::format("model.{} = {}", key, m[key].dump()));
  }
  if (m.value("byte_fallback", false))
    return refuse(src, "model.byte_fallback (SentencePiece-style byte tokens)");
  t.ignore_merges_ = m.value("ignore_merges", false);
  if (!m.contains("vocab") || !m["vocab"].is_object())
    return data_loss("tokenizer {}: model.vocab is missing", src);
  int64_t max_id = -1;
  for (const auto& [tok, id] : m["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (int64_t{1} << 31)) {
      return data_loss("tokenizer {}: vocab['{}'] is not a token id", src, tok);
    }
    max_id = std::max(max_id, id.get<int64_t>());
  }
  std::vector<Added> added;
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& a : j["added_tokens"]) {
      Added x;
      try {
        x.id = a.at("id").get<int32_t>();
        x.content = a.at("content").get<std::string>();
      } catch (const std::exception& e) {
        return data_loss("tokenizer {}: bad added token {}: {}", src, a.dump(), e.what());
      }
      x.special = a.value("special", false);
      x.normalized = a.value("normalized", !x.special);
      for (const char* key : {"single_word", "lstrip", "rstrip"}) {
        if (a.value(key, false))
          return refuse(src, fmt::format("added token '{}' with {} = true", x.content, key));
      }
      if (x.id < 0 || x.content.empty()) return data_loss("tokenizer {}: bad added token {}", src, a.dump());
      max_id = std::max<int64_t>(max_id, x.id);
      added.push_back(std::move(x));
    }
  }
  t.tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : m["vocab"].items()) t.tokens_[id.get<size_t>()] = tok;
  for (const Added& a : added) t.tokens_[static_cast<size_t>(a.id)] = a.content;
  t.added_ = std::move(added);
  if (m.contains("merges") && m["merges"].is_array()) {
    for (const auto& mg : m["merges"]) {
      if (mg.is_string()) {  // "a b" (the format before tokenizers 0.20)
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) return data_loss("tokenizer {}: merge '{}' is not two tokens", src, s);
        t.merge_strings_.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        t.merge_strings_.emplace_back(mg[0].get<std::string>(), mg[1].get<std::string>());
      } else {
        return data_loss("tokenizer {}: merge {} is not a pair of tokens", src, mg.dump());
      }
    }
  }
  // Normalizer.
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const json* n = &j["normalizer"];
    if (json_type(*n) == "Sequence") {
      const json& ns = (*n)["normalizers"];
      if (!ns.is_array() || ns.size() > 1) return refuse(src, fmt::format("normalizer {}", n->dump()));
      n = ns.empty() ? nullptr : &ns[0];
    }
    if (n != nullptr) {
      const std::string type = json_type(*n);
      if (type == "NFC") {
        t.normalizer_ = Normalizer::kNFC;
      } else if (type == "NFD") {
        t.normalizer_ = Normalizer::kNFD;
      } else if (type == "NFKC") {
        t.normalizer_ = Normalizer::kNFKC;
      } else if (type == "NFKD") {
        t.normalizer_ = Normalizer::kNFKD;
      } else {
        return refuse(src, fmt::format("normalizer '{}'", type));
      }
    }
  }
  // Pre-tokenizer: Split steps and a final ByteLevel.
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) {
    return refuse(src, "a tokenizer without a ByteLevel pre-tokenizer (not byte-level)");
  }
  std::vector<const json*> steps;
  if (json_type(j["pre_tokenizer"]) == "Sequence") {
    for (const auto& s : j["pre_tokenizer"]["pretokenizers"]) steps.push_back(&s);
  } else {
    steps.push_back(&j["pre_tokenizer"]);
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& s = *steps[i];
    const std::string type = json_type(s);
    Step step;
    if (type == "Split") {
      if (!s.contains("pattern") || !s["pattern"].is_object())
        return data_loss("tokenizer {}: Split without a pattern", src);
      std::string pat;
      if (s["pattern"].contains("Regex")) {
        pat = s["pattern"]["Regex"].get<std::string>();
      } else if (s["pattern"].contains("String")) {
        return refuse(src, "a Split pre-tokenizer on a literal string");
      }
      if (s.value("behavior", std::string("Isolated")) != "Isolated") {
        return refuse(src, fmt::format("Split behavior '{}'", s.value("behavior", std::string())));
      }
      if (s.value("invert", false)) return refuse(src, "Split invert = true");
      step.kind = Step::kSplit;
      TROUPE_ASSIGN_OR_RETURN(TokenRegex re, TokenRegex::compile(pat));
      step.regex = std::move(re);
    } else if (type == "ByteLevel") {
      if (i + 1 != steps.size()) return refuse(src, "a pre-tokenizer step after ByteLevel");
      step.kind = Step::kByteLevel;
      step.add_prefix_space = s.value("add_prefix_space", false);
      if (s.value("use_regex", true)) {
        TROUPE_ASSIGN_OR_RETURN(TokenRegex re, TokenRegex::compile(kGpt2Pattern));
        step.regex = std::move(re);
      }
    } else {
      return refuse(src, fmt::format("pre-tokenizer '{}'", type));
    }
    t.steps_.push_back(std::move(step));
  }
  if (t.steps_.empty() || t.steps_.back().kind != Step::kByteLevel) {
    return refuse(src, "a tokenizer without a ByteLevel pre-tokenizer (not byte-level)");
  }
  // Post-processor: ByteLevel (ids unchanged) and the single-sequence template.
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    std::vector<const json*> procs;
    if (json_type(j["post_processor"]) == "Sequence") {
      for (const auto& p : j["post_processor"]["processors"]) procs.push_back(&p);
    } else {
      procs.push_back(&j["post_processor"]);
    }
    for (const json* p : procs) {
      const std::string type = json_type(*p);
      if (type == "ByteLevel") continue;
      if (type != "TemplateProcessing") return refuse(src, fmt::format("post-processor '{}'", type));
      const json& sp = (*p)["special_tokens"];
      bool before = true;
      for (const auto& item : (*p)["single"]) {
        if (item.contains("Sequence")) {
          before = false;
          continue;
        }
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        if (!sp.contains(name))
          return data_loss("tokenizer {}: template token '{}' is not defined", src, name);
        for (const auto& id : sp[name]["ids"])
          (before ? t.prefix_ids_ : t.suffix_ids_).push_back(id.get<int32_t>());
      }
    }
  }
  TROUPE_RETURN_IF_ERROR(t.build(src));
  return t;
}

Status Tokenizer::build(const std::string& src) {
  ids_.clear();
  for (size_t i = 0; i < tokens_.size(); ++i)
    if (!tokens_[i].empty()) ids_.emplace(tokens_[i], static_cast<int32_t>(i));
  byte_id_.assign(256, -1);
  for (int b = 0; b < 256; ++b) {
    auto it = ids_.find(byte_chars()[static_cast<size_t>(b)]);
    if (it != ids_.end()) byte_id_[static_cast<size_t>(b)] = it->second;
  }
  token_raw_.assign(tokens_.size(), std::string());
  std::vector<bool> is_added(tokens_.size(), false);
  for (const Added& a : added_) is_added[static_cast<size_t>(a.id)] = true;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (is_added[i]) {
      token_raw_[i] = tokens_[i];
    } else if (auto r = raw_bytes(tokens_[i])) {
      token_raw_[i] = *r;
    } else if (!tokens_[i].empty()) {
      return failed_precondition(
          "{}: vocabulary entry '{}' (id {}) is not made of byte-level characters (not a "
          "byte-level BPE: SentencePiece-style tokenizers are not supported)",
          src, tokens_[i], i);
    }
  }
  rank_.clear();
  merge_pairs_.clear();
  for (size_t r = 0; r < merge_strings_.size(); ++r) {
    const auto& [a, b] = merge_strings_[r];
    auto ia = ids_.find(a), ib = ids_.find(b), im = ids_.find(a + b);
    if (ia == ids_.end() || ib == ids_.end() || im == ids_.end()) {
      return data_loss("{}: merge {} ('{}' '{}') refers to a token not in the vocabulary", src, r, a, b);
    }
    merge_pairs_.emplace_back(ia->second, ib->second);
    rank_.emplace(pair_key(ia->second, ib->second), std::make_pair(static_cast<int32_t>(r), im->second));
  }
  cache_.clear();
  return ok_status();
}

Status Tokenizer::save(const std::string& path) const {
  std::string text;
  if (file_text_) {
    text = *file_text_;
  } else {
    json vocab = json::object();
    for (size_t i = 0; i < tokens_.size(); ++i) vocab[tokens_[i]] = i;
    json merges = json::array();
    for (const auto& [a, b] : merge_strings_) merges.push_back({a, b});
    json added = json::array();
    for (const Added& a : added_) {
      added.push_back({{"id", a.id},
                       {"content", a.content},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", a.normalized},
                       {"special", a.special}});
    }
    json j = {
        {"version", "1.0"},
        {"truncation", nullptr},
        {"padding", nullptr},
        {"added_tokens", added},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", kTroupePattern}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"},
             {"add_prefix_space", false},
             {"trim_offsets", true},
             {"use_regex", false}}}}}},
        {"post_processor",
         {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
        {"decoder",
         {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
        {"model",
         {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", false},
          {"byte_fallback", false},
          {"ignore_merges", false},
          {"vocab", vocab},
          {"merges", merges}}}};
    text = j.dump(2) + "\n";
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return io_error("cannot write tokenizer {}", tmp);
    f << text;
    if (!f) return io_error("cannot write tokenizer {}", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return io_error("cannot rename {} to {}", tmp, path);
  return ok_status();
}

// ---- encoding -----------------------------------------------------------------------------

std::optional<int32_t> Tokenizer::token_id(std::string_view content) const {
  for (const Added& a : added_)
    if (a.content == content) return a.id;
  auto it = ids_.find(std::string(content));
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_special(int32_t id) const {
  for (const Added& a : added_)
    if (a.id == id) return a.special;
  return false;
}

std::string Tokenizer::normalize(std::string_view text) const {
  if (normalizer_ == Normalizer::kNone || text.empty()) return std::string(text);
  int options = UTF8PROC_STABLE;
  switch (normalizer_) {
    case Normalizer::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case Normalizer::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case Normalizer::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case Normalizer::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
    case Normalizer::kNone:
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out, static_cast<utf8proc_option_t>(options));
  if (n < 0) return std::string(text);  // only for invalid UTF-8, which encode has replaced
  std::string s(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return s;
}

// Cuts the added tokens of the pass (normalized or not) out of `text`, leftmost first and
// the longest where several start at one place: (text, -1) and ("", id) segments.
void Tokenizer::split_added(std::string_view text, bool normalized_pass,
                            std::vector<std::pair<std::string, int32_t>>& out) const {
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const Added* best = nullptr;
    for (const Added& a : added_) {
      if (a.normalized != normalized_pass || a.content[0] != text[i]) continue;
      if (text.compare(i, a.content.size(), a.content) == 0 &&
          (!best || a.content.size() > best->content.size())) {
        best = &a;
      }
    }
    if (best == nullptr) {
      ++i;
      continue;
    }
    if (i > start) out.emplace_back(std::string(text.substr(start, i - start)), -1);
    out.emplace_back(std::string(), best->id);
    i += best->content.size();
    start = i;
  }
  if (start < text.size()) out.emplace_back(std::string(text.substr(start)), -1);
}

void Tokenizer::pieces(std::string segment, std::vector<std::string>& out) const {
  std::vector<std::string> cur{std::move(segment)};
  for (const Step& step : steps_) {
    std::vector<std::string> next;
    for (std::string& p : cur) {
      // ByteLevel's prefix space goes before each piece of the earlier steps (as the
      // library applies it per split).
      if (step.kind == Step::kByteLevel && step.add_prefix_space && !p.starts_with(' ')) p.insert(0, " ");
      if (!step.regex) {
        next.push_back(std::move(p));
        continue;
      }
      size_t at = 0;
      for (const auto& [b, e] : step.regex->find_all(p)) {
        if (b > at) next.push_back(p.substr(at, b - at));
        next.push_back(p.substr(b, e - b));
        at = e;
      }
      if (at < p.size()) next.push_back(p.substr(at));
    }
    cur = std::move(next);
  }
  for (std::string& p : cur)
    if (!p.empty()) out.push_back(std::move(p));
}

// The segments of `text` (valid UTF-8): added tokens on the raw text, then the normalizer,
// then the added tokens that match normalized text.
std::vector<std::pair<std::string, int32_t>> Tokenizer::segments(const std::string& text) const {
  std::vector<std::pair<std::string, int32_t>> raw, segs;
  split_added(text, false, raw);
  for (auto& [s, id] : raw) {
    if (id >= 0) {
      segs.emplace_back(std::string(), id);
    } else {
      split_added(normalize(s), true, segs);
    }
  }
  return segs;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::string> out;
  for (auto& [s, id] : segments(valid_utf8(text)))
    if (id < 0) pieces(std::move(s), out);
  return out;
}

void Tokenizer::encode_piece(const std::string& piece, std::vector<int32_t>& out) {
  auto it = cache_.find(piece);
  if (it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> w;
  if (ignore_merges_) {  // a piece that is a whole vocabulary entry is that token
    auto v = ids_.find(byte_level(piece));
    if (v != ids_.end()) w.push_back(v->second);
  }
  if (w.empty()) {
    w.reserve(piece.size());
    for (char ch : piece) {
      const int32_t id = byte_id_[static_cast<uint8_t>(ch)];
      if (id >= 0) w.push_back(id);  // a byte the vocabulary lacks is dropped, as the library does
    }
    // Repeatedly merge the adjacent pair of lowest rank, every occurrence left to right.
    while (w.size() > 1) {
      int32_t best = INT32_MAX, merged = -1, a = 0, b = 0;
      for (size_t j = 0; j + 1 < w.size(); ++j) {
        auto r = rank_.find(pair_key(w[j], w[j + 1]));
        if (r != rank_.end() && r->second.first < best) {
          best = r->second.first;
          merged = r->second.second;
          a = w[j];
          b = w[j + 1];
        }
      }
      if (merged < 0) break;
      size_t o = 0;
      for (size_t j = 0; j < w.size(); ++j) {
        if (j + 1 < w.size() && w[j] == a && w[j + 1] == b) {
          w[o++] = merged;
          ++j;
        } else {
          w[o++] = w[j];
        }
      }
      w.resize(o);
    }
  }
  out.insert(out.end(), w.begin(), w.end());
  if (cache_.size() < (1u << 20)) cache_.emplace(piece, std::move(w));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size());
  if (add_special_tokens) out.insert(out.end(), prefix_ids_.begin(), prefix_ids_.end());
  std::vector<std::string> ps;
  for (auto& [s, id] : segments(valid_utf8(text))) {
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    ps.clear();
    pieces(std::move(s), ps);
    for (const std::string& p : ps) encode_piece(p, out);
  }
  if (add_special_tokens) out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return token_raw_[static_cast<size_t>(id)];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string s;
  for (int32_t id : ids) {
    if (skip_special && is_special(id)) continue;
    s += token_bytes(id);
  }
  return s;
}

// ---- training ------------------------------------------------------------------------------

void BpeTrainer::add_text(std::string_view text_in) {
  if (!regex_) regex_ = *TokenRegex::compile(Tokenizer::kTroupePattern);
  const std::string text = valid_utf8(text_in);
  // The end-of-text token is cut out of documents (as encode does), then the pattern.
  size_t start = 0;
  const std::string_view eot = Tokenizer::kEndOfText;
  const auto count = [&](std::string_view seg) {
    size_t at = 0;
    for (const auto& [b, e] : regex_->find_all(seg)) {
      if (b > at) counts_[std::string(seg.substr(at, b - at))]++;
      counts_[std::string(seg.substr(b, e - b))]++;
      at = e;
    }
    if (at < seg.size()) counts_[std::string(seg.substr(at))]++;
  };
  for (size_t p = text.find(eot); p != std::string::npos; p = text.find(eot, start)) {
    count(std::string_view(text).substr(start, p - start));
    start = p + eot.size();
  }
  count(std::string_view(text).substr(start));
}

Result<Tokenizer> BpeTrainer::train(int64_t vocab_size, const std::function<void(int64_t, int64_t)>& progress) {
  constexpr int32_t kFirstMerge = 257;  // 256 bytes, then the end-of-text token
  if (vocab_size < kFirstMerge) {
    return invalid_argument("vocab size {} is too small: a byte-level BPE needs at least {}", vocab_size,
                            kFirstMerge);
  }
  const int64_t want = vocab_size - kFirstMerge;

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

  // Tokens by id: the bytes, the end-of-text token, then what merges make. A merge whose
  // bytes an earlier merge made already (in other words, by another path) gives that
  // token, as the `tokens` library's trainer does: every id is a distinct string.
  std::vector<std::string> bytes_of;
  std::unordered_map<std::string, int32_t> token_of;
  for (int b = 0; b < 256; ++b) {
    bytes_of.emplace_back(1, static_cast<char>(b));
    token_of.emplace(bytes_of.back(), b);
  }
  bytes_of.emplace_back();  // 256: <|endoftext|>
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<int64_t> last_seen(words.size(), -1);
  while (static_cast<int64_t>(bytes_of.size()) < vocab_size && !heap.empty()) {
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
    std::string raw = bytes_of[static_cast<size_t>(a)] + bytes_of[static_cast<size_t>(b)];
    int32_t id = static_cast<int32_t>(bytes_of.size());
    if (auto known = token_of.find(raw); known != token_of.end()) {
      id = known->second;
    } else {
      token_of.emplace(raw, id);
      bytes_of.push_back(std::move(raw));
    }
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
    if (progress && merge_no % 64 == 0) progress(static_cast<int64_t>(bytes_of.size()) - kFirstMerge, want);
  }
  if (progress) progress(static_cast<int64_t>(bytes_of.size()) - kFirstMerge, want);

  // The Hugging Face form: the same ids, as byte-level strings.
  Tokenizer t;
  for (size_t i = 0; i < bytes_of.size(); ++i)
    t.tokens_.push_back(i == 256 ? Tokenizer::kEndOfText : byte_level(bytes_of[i]));
  t.added_.push_back({256, Tokenizer::kEndOfText, true, false});
  for (const auto& [a, b] : merges) {
    t.merge_strings_.emplace_back(byte_level(bytes_of[static_cast<size_t>(a)]),
                                  byte_level(bytes_of[static_cast<size_t>(b)]));
  }
  TROUPE_ASSIGN_OR_RETURN(TokenRegex re, TokenRegex::compile(Tokenizer::kTroupePattern));
  Tokenizer::Step split;
  split.kind = Tokenizer::Step::kSplit;
  split.regex = std::move(re);
  t.steps_.push_back(std::move(split));
  t.steps_.push_back(Tokenizer::Step{Tokenizer::Step::kByteLevel, std::nullopt, false});
  t.eot_ = 256;
  TROUPE_RETURN_IF_ERROR(t.build("the trained tokenizer"));
  return t;
}

}  // namespace troupe::layers
