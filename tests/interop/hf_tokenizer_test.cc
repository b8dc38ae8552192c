// tests/interop/hf_tokenizer_test.cc — Hugging Face tokenizer.json files built by the
// `tokenizers` library (fixtures/tokenizers: GPT-2's ByteLevel regex, Llama 3's Split
// regex with ignore_merges and a BOS template, Qwen2's NFC normalizer and single digits)
// give the library's ids on a mixed-script text (Latin, Cyrillic, Greek, CJK, Arabic,
// Hebrew, Devanagari, Thai, emoji with joiners and flags, code, combining marks, NBSP,
// NEL, special tokens inside the text) and on edge cases; Troupe's own tokenizer is
// written in the same format and reads back the same.
#include <gtest/gtest.h>

#include <filesystem>

#include "data/tokenizer.h"
#include "interop_test_util.h"

namespace troupe::layers {
namespace {

const std::string kDir = test::fixtures() + "/tokenizers";

nlohmann::json reference() {
  return test::read_json_file(kDir + "/reference.json");
}

class HfTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(HfTokenizer, IdsEqualTheLibrarysOnMixedScriptText) {
  const nlohmann::json ref = reference();
  const nlohmann::json& r = ref.at("tokenizers").at(GetParam());
  auto tok = Tokenizer::load(kDir + "/" + r.at("file").get<std::string>());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->vocab_size(), r.at("vocab_size").get<int64_t>());
  const std::string text = ref.at("text").get<std::string>();
  const std::vector<int32_t> want = r.at("ids").get<std::vector<int32_t>>();
  const std::vector<int32_t> got = tok->encode(text);
  size_t first_diff = 0;
  while (first_diff < std::min(want.size(), got.size()) && want[first_diff] == got[first_diff]) ++first_diff;
  EXPECT_EQ(got, want) << GetParam() << ": first difference at id " << first_diff << " (token '"
                       << (first_diff < want.size() ? r["tokens"][first_diff].get<std::string>() : "<end>")
                       << "')";
  EXPECT_EQ(tok->encode(text, /*add_special_tokens=*/true),
            r.at("ids_with_special").get<std::vector<int32_t>>());
  const auto edges = ref.at("edges").get<std::vector<std::string>>();
  for (size_t i = 0; i < edges.size(); ++i) {
    EXPECT_EQ(tok->encode(edges[i]), r.at("edges")[i].get<std::vector<int32_t>>())
        << GetParam() << ": edge case " << i << " '" << edges[i] << "'";
  }
  // Decoding gives the text back (NFC-normalised where the tokenizer normalises).
  EXPECT_EQ(tok->decode(got, /*skip_special=*/false), r.at("decoded").get<std::string>());
  fmt::print("[{}] {} ids on {} bytes of mixed-script text equal the tokenizers library's\n", GetParam(),
             got.size(), text.size());
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, HfTokenizer, ::testing::Values("gpt2", "llama3", "qwen2"));

TEST(HfTokenizerFile, EndOfTextTokenAndSavedCopy) {
  auto qwen = Tokenizer::load(kDir + "/qwen2.json");
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(qwen->eot(), qwen->token_id("<|endoftext|>"));
  auto llama = Tokenizer::load(kDir + "/llama3.json");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->eot(), llama->token_id("<|end_of_text|>"));
  auto asked = Tokenizer::load(kDir + "/llama3.json", "<|eot_id|>");
  ASSERT_TRUE(asked.ok());
  EXPECT_EQ(asked->eot(), asked->token_id("<|eot_id|>"));
  EXPECT_FALSE(Tokenizer::load(kDir + "/llama3.json", "<|nope|>").ok());
  // save() writes the loaded file back as it was.
  test::ScratchDir dir("hf-tok");
  ASSERT_TRUE(qwen->save(dir / "tokenizer.json").ok());
  std::ifstream a(kDir + "/qwen2.json"), b(dir / "tokenizer.json");
  std::stringstream sa, sb;
  sa << a.rdbuf();
  sb << b.rdbuf();
  EXPECT_EQ(sa.str(), sb.str());
}

TEST(HfTokenizerFile, RefusesWhatItCannotEncodeExactly) {
  const nlohmann::json base = test::read_json_file(kDir + "/gpt2.json");
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}};
       },
       "pre-tokenizer 'Metaspace'"},
      {[](nlohmann::json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {[](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, "model type 'WordPiece'"},
      {[](nlohmann::json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       "normalizer 'Lowercase'"},
      {[](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }, "dropout"},
      {[](nlohmann::json& j) { j["added_tokens"][0]["lstrip"] = true; }, "lstrip"},
      {[](nlohmann::json& j) {
         j["post_processor"] = {{"type", "BertProcessing"}};
       },
       "post-processor 'BertProcessing'"},
      {[](nlohmann::json& j) {
         j["model"]["merges"].push_back({"Ġ", "zzzz"});
       },
       "not in the vocabulary"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = base;
    c.edit(j);
    auto t = Tokenizer::from_json(j, "edited.json");
    ASSERT_FALSE(t.ok()) << c.says;
    EXPECT_NE(t.status().message().find(c.says), std::string::npos) << t.status().to_string();
  }
}

}  // namespace
}  // namespace troupe::layers
