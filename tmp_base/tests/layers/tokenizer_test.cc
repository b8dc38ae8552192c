// tests/layers/tokenizer_test.cc — byte-level BPE: pre-tokenisation, training, encode/
// decode round trips, the file format and its errors.
#include "layers/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

namespace troupe::layers {
namespace {

std::string corpus() {
  std::string s;
  for (int i = 0; i < 200; ++i) {
    s += "def function_" + std::to_string(i % 17) + "(self, value):\n    return self.value + value\n\n";
    s += "# the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  }
  return s;
}

TEST(PreTokenize, ChunksCoverTheTextAndKeepOneLeadingSpace) {
  const std::string text = "def f(x):\n    return x  + 1 ==  2\t\n";
  std::string joined;
  std::vector<std::string> chunks;
  for (auto c : pre_tokenize(text)) {
    joined += c;
    chunks.emplace_back(c);
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(chunks[0], "def");
  EXPECT_EQ(chunks[1], " f");
  // "\n    return": the whitespace run leaves its last space to the word.
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), "\n   "), chunks.end());
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), " return"), chunks.end());
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), " =="), chunks.end());
}

TEST(Bpe, TrainsRequestedVocabularyAndRoundTrips) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(340);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->vocab_size(), 340);
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

TEST(Bpe, ArbitraryBytesRoundTrip) {
  BpeTrainer tr;
  tr.add_text(corpus());
  auto tok = tr.train(300);
  ASSERT_TRUE(tok.ok());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string s(static_cast<size_t>(rng() % 200), '\0');
    for (auto& ch : s) ch = static_cast<char>(rng() & 0xff);
    EXPECT_EQ(tok->decode(tok->encode(s)), s);
  }
  EXPECT_TRUE(tok->encode("").empty());
  EXPECT_EQ(tok->decode({Tokenizer::kEot}), "");
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
  EXPECT_EQ(tt->vocab_size(), Tokenizer::kFirstMerge);  // no pair occurs twice
  EXPECT_FALSE(tiny.train(10).ok());                    // below bytes + eot
}

TEST(Bpe, MatchesAFullRecountOnTheFirstMerges) {
  // The incremental pair counts must pick the same merges as a naive full recount.
  const std::string text = corpus();
  BpeTrainer tr;
  tr.add_text(text);
  auto tok = tr.train(Tokenizer::kFirstMerge + 12);
  ASSERT_TRUE(tok.ok());
  std::vector<std::vector<int32_t>> words;
  for (auto c : pre_tokenize(text)) {
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
    const int32_t id = Tokenizer::kFirstMerge + static_cast<int32_t>(m);
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

  auto missing = Tokenizer::load(dir + "/nope.json");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  std::ofstream(dir + "/bad.json")
      << "{\"type\": \"troupe-byte-bpe\", \"version\": 1, \"merges\": [[1, 999]]}";
  auto bad = Tokenizer::load(dir + "/bad.json");
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("unknown token"), std::string::npos);
  std::ofstream(dir + "/garbage.json") << "not json";
  EXPECT_EQ(Tokenizer::load(dir + "/garbage.json").status().code(), StatusCode::kDataLoss);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace troupe::layers
