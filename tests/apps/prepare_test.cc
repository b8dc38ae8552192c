// tests/apps/prepare_test.cc — `train_moe prepare` on JSON-lines corpora, as a user runs
// it (the binary, real files): plain, gzip and Zstandard files streamed one record at a
// time, malformed records skipped, counted and named by file and line (or an error with
// --strict), another text key, a Hugging Face tokenizer.json (the shards hold exactly its
// ids, each document ended by its end-of-text token; the mixed-script text's ids are the
// `tokenizers` library's), a tokenizer trained on the records, and a truncated file.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/token_data.h"
#include "data/tokenizer.h"
#include "tests/common/train_moe_harness.h"

namespace troupe::test {
namespace {

const std::string kTokDir = std::string(TROUPE_SOURCE_DIR) + "/tests/interop/fixtures/tokenizers";

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::string gzip(const std::string& s) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // +16: a gzip header
  std::string out(deflateBound(&z, s.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  z.avail_in = static_cast<uInt>(s.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string zstd(const std::string& s) {
  std::string out(ZSTD_compressBound(s.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), s.data(), s.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

std::string record(const std::string& key, const std::string& text) {
  return nlohmann::json{{key, text}}.dump() + "\n";
}

std::vector<int32_t> shard_tokens(const fs::path& dir, const std::string& split) {
  auto s = layers::TokenShards::open(dir.string(), split);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  std::vector<int32_t> t(static_cast<size_t>(s->size()));
  s->read(0, s->size(), t.data());
  return t;
}

class PrepareJsonl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { root_ = new fs::path(make_run_root("prepare-jsonl")); }
  static void TearDownTestSuite() {
    remove_run_root(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* PrepareJsonl::root_ = nullptr;

TEST_F(PrepareJsonl, StreamsCompressedFilesSkipsAndNamesMalformedRecordsWithAnHfTokenizer) {
  const nlohmann::json ref = nlohmann::json::parse(std::ifstream(kTokDir + "/reference.json"));
  const std::string mixed = ref["text"].get<std::string>();
  std::vector<std::string> docs;  // the valid records, in file order
  std::string a;                  // a.jsonl: valid records and four malformed ones
  for (int i = 0; i < 12; ++i) {
    if (i == 4) a += "this is not json\n";              // line 5
    if (i == 7) a += "{\"txt\": \"the wrong key\"}\n";  // line 9
    if (i == 9) a += "{\"text\": 5}\n";                 // line 12
    if (i == 10) a += "[\"an\", \"array\"]\r\n";        // line 14
    const std::string t =
        i == 3 ? mixed : "record " + std::to_string(i) + ": the quick brown fox, ünïcödé 123";
    a += record("text", t);
    docs.push_back(t);
  }
  a += "\n";  // an empty line is not a record
  std::string b, c;
  for (int i = 0; i < 6; ++i) {
    b += record("text", "gzip document " + std::to_string(i) + " \t tabs and  spaces");
    docs.push_back("gzip document " + std::to_string(i) + " \t tabs and  spaces");
  }
  for (int i = 0; i < 6; ++i) {
    const std::string t = "zstd document " + std::to_string(i) + " <|endoftext|> with a special token";
    c += record("text", t);
    docs.push_back(t);
  }
  c.pop_back();  // the last line without its newline is still a record
  const fs::path dir = *root_ / "hf";
  fs::create_directories(dir);
  write_file(dir / "a.jsonl", a);
  write_file(dir / "b.jsonl.gz", gzip(b));
  write_file(dir / "c.jsonl.zst", zstd(c));
  const fs::path out = dir / "data";
  const RunResult r =
      run({train_moe_bin(), "prepare", "--input", (dir / "a.jsonl").string(), (dir / "b.jsonl.gz").string(),
           (dir / "c.jsonl.zst").string(), "--out", out.string(), "--tokenizer", kTokDir + "/qwen2.json",
           "--val-fraction", "0", "--max-bytes", "0"},
          dir / "prepare.log", std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped 4 malformed"), std::string::npos) << r.output;
  for (const char* where : {"a.jsonl:5: not valid JSON", "a.jsonl:9: no field \"text\"",
                            "a.jsonl:12: field \"text\" is not a string", "a.jsonl:14: not a JSON object"}) {
    EXPECT_NE(r.output.find(where), std::string::npos) << where << "\n" << r.output;
  }
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(out / "meta.json"));
  EXPECT_EQ(meta["malformed_records"], 4);
  EXPECT_EQ(meta["documents"], static_cast<int64_t>(docs.size()));

  // The train split: every valid record's ids, each ended by <|endoftext|>.
  auto tok = layers::Tokenizer::load(kTokDir + "/qwen2.json");
  ASSERT_TRUE(tok.ok());
  std::vector<int32_t> want;
  for (const std::string& d : docs) {
    std::vector<int32_t> ids = tok->encode(d, true);
    ids.push_back(*tok->eot());
    want.insert(want.end(), ids.begin(), ids.end());
  }
  const std::vector<int32_t> got = shard_tokens(out, "train");
  EXPECT_EQ(got, want);
  // The mixed-script record holds the library's own ids.
  const std::vector<int32_t> lib = ref["tokenizers"]["qwen2"]["ids"].get<std::vector<int32_t>>();
  EXPECT_NE(std::search(got.begin(), got.end(), lib.begin(), lib.end()), got.end());
  // The tokenizer file is the one given.
  auto copied = layers::Tokenizer::load((out / "tokenizer.json").string());
  ASSERT_TRUE(copied.ok());
  EXPECT_EQ(copied->vocab_size(), tok->vocab_size());

  // --strict: the first malformed record is the error, named.
  const RunResult s = run({train_moe_bin(), "prepare", "--input", (dir / "a.jsonl").string(), "--out",
                           (dir / "strict").string(), "--tokenizer", kTokDir + "/qwen2.json", "--strict"},
                          dir / "strict.log", std::chrono::seconds(60));
  EXPECT_NE(s.exit_code, 0);
  EXPECT_NE(s.output.find("a.jsonl:5: not valid JSON (--strict)"), std::string::npos) << s.output;
}

TEST_F(PrepareJsonl, TrainsItsOwnTokenizerOnAnotherKeyAndNamesATruncatedFile) {
  const fs::path dir = *root_ / "own";
  fs::create_directories(dir);
  std::string body;
  for (int i = 0; i < 300; ++i) {
    body += record("content", "def function_" + std::to_string(i % 13) +
                                  "(self, value):\n    return value * " + std::to_string(i) + "  # Grüße\n");
  }
  write_file(dir / "code.jsonl.zst", zstd(body));
  const fs::path out = dir / "data";
  const RunResult r =
      run({train_moe_bin(), "prepare", "--input", dir.string(), "--ext", ".jsonl.zst", "--out", out.string(),
           "--text-key", "content", "--vocab", "300", "--val-fraction", "0.1"},
          dir / "prepare.log", std::chrono::seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(out / "meta.json"));
  EXPECT_EQ(meta["documents"], 300);
  EXPECT_EQ(meta["malformed_records"], 0);
  EXPECT_GT(meta["val_tokens"].get<int64_t>(), 0);
  auto tok = layers::Tokenizer::load((out / "tokenizer.json").string());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->vocab_size(), 300);
  const std::vector<int32_t> train = shard_tokens(out, "train");
  EXPECT_EQ(std::count(train.begin(), train.end(), *tok->eot()), 270);  // 9 of every 10 documents

  // A file cut short in the middle of its Zstandard frame.
  const std::string z = zstd(body);
  write_file(dir / "cut.jsonl.zst", z.substr(0, z.size() / 2));
  const RunResult bad = run({train_moe_bin(), "prepare", "--input", (dir / "cut.jsonl.zst").string(), "--out",
                             (dir / "bad").string(), "--text-key", "content"},
                            dir / "bad.log", std::chrono::seconds(60));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("cut.jsonl.zst"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace troupe::test
