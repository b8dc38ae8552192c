// tests/data/tokenizer_test.cc — Troupe's own byte-level BPE: pre-tokenisation,
// training, encode/decode round trips, the end-of-text token, the file format (Hugging
// Face's tokenizer.json) and its errors. tests/interop/hf_tokenizer_test.cc checks the
// encoding against the `tokenizers` library itself.
#include "data/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

namespace troupe::layers {
namespace {

constexpr int32_t kFirstMerge = 257;  // 256 bytes, then <|endoftext|>

std::string corpus() {
  std::string s;
  for (int i = 0; i < 200; ++i) {
    s += "def function_" + std::to_string(i % 17) + "(self, value):\n    return self.value + value\n\n";
    s += "# the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  }
  return s;
}

TEST(PreTokenize, PiecesCoverTheTextAndKeepOneLeadingSpace) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(300);
  ASSERT_TRUE(tok.ok());
  const std::string text = "def f(x):\n    return x  + 1234 ==  2\t\n";
  std::string joined;
  std::vector<std::string> chunks;
  for (auto& c : tok->pre_tokenize(text)) {
    joined += c;
    chunks.push_back(c);
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(chunks[0], "def");
  EXPECT_EQ(chunks[1], " f");
  // "\n    return": the whitespace run leaves its last space to the word.
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), " return"), chunks.end());
  // Numbers in groups of up to three digits (Llama 3's pattern).
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), "123"), chunks.end());
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), "4"), chunks.end());
}

TEST(Bpe, TrainsRequestedVocabularyAndRoundTrips) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(325);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->vocab_size(), 325);
  const std::string text = corpus();
  std::vector<int32_t> ids = tok->encode(text);
  EXPECT_EQ(tok->decode(ids), text);
  // Compression: frequent words become single tokens.
  EXPECT_LT(ids.size() * 3, text.size());
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, tok->vocab_size());
  }
  // The learned merges include a whole frequent word.
  const auto word = tok->encode(" quick");
  EXPECT_EQ(word.size(), 1u);
}

TEST(Bpe, InvalidUtf8IsReplacedAsTheLibraryIsGivenIt) {
  int64_t n = 0;
  EXPECT_EQ(valid_utf8("a\xff\xc3\xa9\xe2\x82", &n), "a\xEF\xBF\xBD\xc3\xa9\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(n, 3);
  EXPECT_EQ(valid_utf8("\xed\xa0\x80", &n), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
}

TEST(Bpe, ValidUtf8RoundTrips) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(300);
  ASSERT_TRUE(tok.ok());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string s(static_cast<size_t>(rng() % 200), '\0');
    for (auto& ch : s) ch = static_cast<char>(rng() & 0xff);
    s = valid_utf8(s);  // bytes that are not UTF-8 become U+FFFD first
    EXPECT_EQ(tok->decode(tok->encode(s)), s);
  }
  const std::string mixed = "Grüße, мир, 你好, 👍🏽 e\u0301 \t\r\n";
  EXPECT_EQ(tok->decode(tok->encode(mixed)), mixed);
  EXPECT_TRUE(tok->encode("").empty());
  ASSERT_TRUE(tok->eot().has_value());
  EXPECT_EQ(*tok->eot(), 256);
  EXPECT_EQ(tok->decode({*tok->eot()}), "");
  EXPECT_EQ(tok->decode({*tok->eot()}, /*skip_special=*/false), "<|endoftext|>");
  // The end-of-text token inside a text is that token, as the library encodes it.
  const std::vector<int32_t> ids = tok->encode("ab<|endoftext|>cd");
  EXPECT_NE(std::find(ids.begin(), ids.end(), 256), ids.end());
}

TEST(Bpe, TrainingIsDeterministicAndStopsWhenNothingRepeats) {
  BpeTrainer a, b;
  a.add_text(corpus());
  b.add_text(corpus());
  auto ta = a.train(350), tb = b.train(350);
  ASSERT_TRUE(ta.ok() && tb.ok());
  EXPECT_EQ(ta->merges(), tb->merges());
  BpeTrainer tiny;
  tiny.add_text("abc");
  auto tt = tiny.train(1000);
  ASSERT_TRUE(tt.ok());
  EXPECT_EQ(tt->vocab_size(), kFirstMerge);               // no pair occurs twice
  EXPECT_FALSE(tiny.train(10).ok());                      // below bytes + eot
}

TEST(Bpe, MatchesAFullRecountOnTheFirstMerges) {
  // The incremental pair counts must pick the same merges as a naive full recount.
  const std::string text = corpus();
  BpeTrainer tr;
  tr.add_text(text);
  auto tok = tr.train(kFirstMerge + 12);
  ASSERT_TRUE(tok.ok());
  std::vector<std::vector<int32_t>> words;
  for (auto& c : tok->pre_tokenize(text)) {
    std::vector<int32_t> w;
    for (char ch : c) w.push_back(static_cast<unsigned char>(ch));
    words.push_back(w);
  }
  for (size_t m = 0; m < 12; ++m) {
    std::map<std::pair<int32_t, int32_t>, int64_t> counts;
    for (auto& w : words)
      for (size_t j = 0; j + 1 < w.size(); ++j) counts[{w[j], w[j + 1]}]++;
    std::pair<int32_t, int32_t> best{};
    int64_t bc = -1;
    for (auto& [p, c] : counts)
      if (c > bc) bc = c, best = p;  // map order: ties go to the smaller pair
    ASSERT_EQ(tok->merges()[m], best) << "merge " << m;
    const int32_t id = kFirstMerge + static_cast<int32_t>(m);
    for (auto& w : words) {
      std::vector<int32_t> o;
      for (size_t j = 0; j < w.size(); ++j) {
        if (j + 1 < w.size() && w[j] == best.first && w[j + 1] == best.second) {
          o.push_back(id);
          ++j;
        } else {
          o.push_back(w[j]);
        }
      }
      w = o;
    }
  }
}

TEST(Bpe, SaveLoadAndCorruptFiles) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(320);
  ASSERT_TRUE(tok.ok());
  const std::string dir = ::testing::TempDir() + "/troupe_tok_test_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(tok->save(dir + "/tokenizer.json").ok());
  auto back = Tokenizer::load(dir + "/tokenizer.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->merges(), tok->merges());
  EXPECT_EQ(back->encode(corpus()), tok->encode(corpus()));

  // The file is Hugging Face's format: a BPE model, the Split + ByteLevel pre-tokenizer.
  std::ifstream saved(dir + "/tokenizer.json");
  const nlohmann::json j = nlohmann::json::parse(saved);
  EXPECT_EQ(j["model"]["type"], "BPE");
  EXPECT_EQ(j["model"]["vocab"].size(), 320u);
  EXPECT_EQ(j["model"]["merges"].size(), 320u - kFirstMerge);
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], Tokenizer::kTroupePattern);
  EXPECT_EQ(j["added_tokens"][0]["content"], "<|endoftext|>");

  auto missing = Tokenizer::load(dir + "/nope.json");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  nlohmann::json broken = j;
  broken["model"]["merges"].push_back({"q", "notatoken"});
  std::ofstream(dir + "/bad.json") << broken.dump();
  auto bad = Tokenizer::load(dir + "/bad.json");
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("not in the vocabulary"), std::string::npos)
      << bad.status().to_string();
  std::ofstream(dir + "/old.json") << "{\"type\": \"troupe-byte-bpe\", \"version\": 1, \"merges\": []}";
  auto old = Tokenizer::load(dir + "/old.json");
  EXPECT_NE(old.status().message().find("prepare"), std::string::npos) << old.status().to_string();
  std::ofstream(dir + "/garbage.json") << "not json";
  EXPECT_EQ(Tokenizer::load(dir + "/garbage.json").status().code(), StatusCode::kDataLoss);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace troupe::layers
