// tests/checkpoint/roundtrip_test.cc — one-process save and load: bitwise round trips of
// every dtype, slices read back from any box, the snapshot taken at save() time, run
// state (data position, RNG, config, tokenizer), retention, and every kind of damage
// (flipped bytes, truncated shard, missing manifest, missing shard, unfinished save)
// reported by name with a fall-back to the previous good checkpoint.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "checkpoint/reader.h"
#include "checkpoint/writer.h"
#include "tests/checkpoint/test_util.h"

namespace troupe::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

Tensor iota(const Shape& s, DType dt, float base) {
  std::vector<float> v(static_cast<size_t>(shape_numel(s)));
  std::iota(v.begin(), v.end(), base);
  return Tensor::from_floats(s, v, dt);
}

std::map<std::string, Tensor> sample_tensors(float base) {
  std::map<std::string, Tensor> t;
  t["embed.weight"] = iota({16, 8}, DType::kF32, base);
  t["layers.0.attn.wq"] = iota({8, 8}, DType::kBF16, base + 1);
  t["layers.0.moe.experts.w1"] = iota({4, 8, 6}, DType::kF16, base + 2);
  t["data.order"] = iota({10}, DType::kI64, base + 3);
  t["rng.bytes"] = iota({32}, DType::kU8, 0);
  t["step"] = iota({}, DType::kI32, base);
  t["empty"] = Tensor::empty({0, 4}, DType::kF32);
  return t;
}

std::vector<SaveEntry> entries_of(const std::map<std::string, Tensor>& ts) {
  std::vector<SaveEntry> e;
  for (const auto& [name, t] : ts) e.push_back(SaveEntry{name, t.shape(), {}, t});
  return e;
}

// Saves `ts` as the only rank and commits it.
void save_step(const std::string& run, int64_t step, const std::map<std::string, Tensor>& ts, int keep = 5,
               CheckpointInfo info = {}) {
  auto w = CheckpointWriter::create(WriterOptions{run, ParallelLayout{}, 0});
  ASSERT_TRUE(w.ok()) << w.status();
  auto h = (*w)->save(step, entries_of(ts), {{"rng", "seed-state"}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->wait().ok()) << h->wait();
  FinalizeOptions fo;
  fo.world_size = 1;
  fo.keep_last = keep;
  fo.info = std::move(info);
  auto f = finalize_checkpoint(run, step, fo);
  ASSERT_TRUE(f.ok()) << f.status();
}

TEST(Checkpoint, RoundTripIsBitwiseForEveryDtype) {
  TempDir dir;
  const auto ts = sample_tensors(0.5f);
  // A tokenizer to copy in.
  const std::string tok = dir.sub("tokenizer.json");
  std::ofstream(tok) << R"({"vocab": ["a", "b"]})";
  CheckpointInfo info;
  info.config_text = "[model]\nlayers = 2\n";
  info.data_position = {{"epoch", 1}, {"sample", 4096}};
  info.tokenizer_path = tok;
  info.metadata = {{"git", "abc123"}};
  save_step(dir.sub("run"), 7, ts, 3, info);

  auto r = CheckpointReader::open_latest_valid(dir.sub("run"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->step(), 7);
  EXPECT_TRUE((*r)->skipped().empty());
  for (const auto& [name, t] : ts) {
    auto got = (*r)->read_full(name);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(testing::bitwise_equal(*got, t)) << name;
  }
  const Manifest& m = (*r)->manifest();
  EXPECT_EQ(m.config_text, info.config_text);
  EXPECT_EQ(m.data_position["sample"], 4096);
  EXPECT_EQ(m.metadata["git"], "abc123");
  EXPECT_EQ(m.ranks.at(0).state["rng"], "seed-state");
  ASSERT_TRUE(m.tokenizer.has_value());
  ASSERT_TRUE((*r)->extract_tokenizer(dir.sub("tok_out.json")).ok());
  std::ifstream in(dir.sub("tok_out.json"));
  std::string tok_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(tok_back, R"({"vocab": ["a", "b"]})");
  std::ifstream latest(dir.sub("run/latest"));
  std::string l;
  latest >> l;
  EXPECT_EQ(l, "step_7");
  EXPECT_FALSE(fs::exists(dir.sub("run/step_7.tmp")));
}

TEST(Checkpoint, ReadsAnyBoxAcrossStoredSlices) {
  // Two ranks (n=2) each save half of a [6, 5] tensor along dim 0; the reader assembles
  // boxes that straddle both halves.
  TempDir dir;
  const std::string run = dir.sub("run");
  const Tensor full = iota({6, 5}, DType::kF32, 1.0f);
  const ParallelLayout l{1, 1, 2};
  std::vector<std::unique_ptr<CheckpointWriter>> ws;
  for (int rank = 0; rank < 2; ++rank) {
    auto w = CheckpointWriter::create(WriterOptions{run, l, rank});
    ASSERT_TRUE(w.ok());
    auto h = (*w)->save(3, {SaveEntry{"x", {6, 5}, {3 * rank, 0}, full.narrow(0, 3 * rank, 3)}});
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(h->wait().ok());
    ws.push_back(std::move(*w));
  }
  FinalizeOptions fo;
  fo.world_size = 2;
  ASSERT_TRUE(finalize_checkpoint(run, 3, fo).ok());
  auto r = CheckpointReader::open(run + "/step_3");
  ASSERT_TRUE(r.ok()) << r.status();
  for (Slice box : {Slice{{2, 3}, {1, 3}}, Slice{{0, 6}, {4, 1}}, Slice{{3, 1}, {0, 5}}, Slice{{0, 6}, {0, 5}}}) {
    auto got = (*r)->read("x", box);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(testing::bitwise_equal(*got, full.narrow(0, box[0].start, box[0].length)
                                                 .narrow(1, box[1].start, box[1].length)))
        << slice_to_string(box);
  }
  auto bad = (*r)->read("x", Slice{{4, 3}, {0, 5}});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  auto missing = (*r)->read("y", Slice{{0, 1}});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'y'"), std::string::npos);
}

TEST(Checkpoint, SnapshotIsTakenAtSaveTime) {
  TempDir dir;
  const std::string run = dir.sub("run");
  Tensor t = iota({1024, 256}, DType::kF32, 0.0f);
  const Tensor original = t.clone();
  // A non-contiguous source too: the transpose of a second tensor.
  Tensor u = iota({32, 16}, DType::kF32, 5.0f);
  WriterOptions wo{run, ParallelLayout{}, 0};
  wo.max_bytes_per_second = 4u << 20;  // keep the write going while the caller mutates
  wo.write_chunk_bytes = 256u << 10;
  auto w = CheckpointWriter::create(wo);
  ASSERT_TRUE(w.ok());
  auto h = (*w)->save(1, {SaveEntry{"t", t.shape(), {}, t}, SaveEntry{"ut", {16, 32}, {}, u.transpose(0, 1)}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->done());  // the write is in the background
  t.fill(-1.0f);            // training goes on and changes the weights
  u.fill(-1.0f);
  ASSERT_TRUE(h->wait().ok());
  const SaveStats s = h->stats();
  EXPECT_GE(s.bytes, t.nbytes());
  EXPECT_LE(s.blocked_seconds, s.total_seconds);
  EXPECT_GT(s.write_seconds, 0.1);  // 1 MiB+ at 4 MiB/s
  FinalizeOptions fo;
  ASSERT_TRUE(finalize_checkpoint(run, 1, fo).ok());
  auto r = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(testing::bitwise_equal(*(*r)->read_full("t"), original));
  EXPECT_TRUE(testing::bitwise_equal(*(*r)->read_full("ut"), iota({32, 16}, DType::kF32, 5.0f).transpose(0, 1)));
}

TEST(Checkpoint, BadEntriesAreRefusedBeforeWriting) {
  TempDir dir;
  auto w = CheckpointWriter::create(WriterOptions{dir.sub("run"), ParallelLayout{}, 0});
  ASSERT_TRUE(w.ok());
  Tensor t = iota({4}, DType::kF32, 0);
  auto dup = (*w)->save(1, {SaveEntry{"a", {4}, {}, t}, SaveEntry{"a", {4}, {}, t}});
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  auto outside = (*w)->save(1, {SaveEntry{"a", {6}, {3}, t}});
  EXPECT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("'a'"), std::string::npos);
  auto rank = (*w)->save(1, {SaveEntry{"a", {4, 1}, {}, t}});
  EXPECT_EQ(rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir.sub("run/step_1.tmp")));
  EXPECT_EQ(CheckpointWriter::create(WriterOptions{dir.sub("run"), ParallelLayout{1, 1, 2}, 2}).status().code(),
            StatusCode::kOutOfRange);
}

// Every checkpoint of a run holds the tokenizer; while its bytes stay the same it is one
// file (hard links), which outlives the retention of the checkpoint that first wrote it.
// Changed bytes are copied, and each checkpoint still extracts its own.
TEST(Checkpoint, UnchangedTokenizerIsLinkedNotCopied) {
  TempDir dir;
  const std::string run = dir.sub("run"), tok = dir.sub("tokenizer.json");
  std::ofstream(tok) << R"({"vocab": ["a", "b"]})";
  CheckpointInfo info;
  info.tokenizer_path = tok;
  for (int step : {1, 2, 3}) save_step(run, step, sample_tensors(1.0f), 2, info);
  EXPECT_FALSE(fs::exists(run + "/step_1"));  // retention
  EXPECT_EQ(fs::hard_link_count(run + "/step_3/tokenizer.json"), 2u);
  EXPECT_TRUE(fs::equivalent(run + "/step_2/tokenizer.json", run + "/step_3/tokenizer.json"));
  std::ofstream(tok, std::ios::trunc) << R"({"vocab": ["a", "b", "c"]})";
  save_step(run, 4, sample_tensors(1.0f), 2, info);
  EXPECT_EQ(fs::hard_link_count(run + "/step_4/tokenizer.json"), 1u);
  for (const auto& [step, want] : {std::pair<int, std::string>{3, R"({"vocab": ["a", "b"]})"},
                                   std::pair<int, std::string>{4, R"({"vocab": ["a", "b", "c"]})"}}) {
    auto r = CheckpointReader::open(run + "/step_" + std::to_string(step), VerifyMode::kChecksums);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string out = dir.sub("tok_" + std::to_string(step) + ".json");
    ASSERT_TRUE((*r)->extract_tokenizer(out).ok());
    std::ifstream in(out);
    EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()), want)
        << step;
  }
}

TEST(Checkpoint, RetentionKeepsTheLastK) {
  TempDir dir;
  const std::string run = dir.sub("run");
  for (int step = 1; step <= 5; ++step) save_step(run, step * 10, sample_tensors(static_cast<float>(step)), 2);
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(run)) names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_40", "step_50"}));
  auto r = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->step(), 50);
  EXPECT_TRUE(testing::bitwise_equal(*(*r)->read_full("embed.weight"), sample_tensors(5.0f)["embed.weight"]));
}

// Each kind of damage to the newest checkpoint: open() names the problem, and
// open_latest_valid() falls back to the previous checkpoint and says why.
struct DamageCase {
  std::string label;
  std::function<void(const std::string& ckpt_dir)> damage;
  StatusCode code;
  std::vector<std::string> must_mention;
};

class Damage : public ::testing::TestWithParam<int> {};

std::vector<DamageCase> damage_cases() {
  return {
      {"flipped byte in a shard",
       [](const std::string& d) {
         auto m = CheckpointReader::open(d);
         const StoredSlice& s = (*m)->manifest().tensors.at("layers.0.attn.wq").slices.at(0);
         testing::flip_byte(d + "/" + s.file, static_cast<std::streamoff>(s.offset + 5));
       },
       StatusCode::kDataLoss,
       {"checksum mismatch", "rank_00000.bin", "'layers.0.attn.wq'"}},
      {"truncated shard",
       [](const std::string& d) { testing::truncate_to(d + "/rank_00000.bin", 100); },
       StatusCode::kDataLoss,
       {"truncated", "rank_00000.bin"}},
      {"manifest deleted",
       [](const std::string& d) { fs::remove(d + "/manifest.json"); },
       StatusCode::kNotFound,
       {"manifest", "missing"}},
      {"manifest names a missing file",
       [](const std::string& d) { fs::remove(d + "/rank_00000.bin"); },
       StatusCode::kNotFound,
       {"rank_00000.bin", "missing"}},
      {"manifest is garbage",
       [](const std::string& d) { std::ofstream(d + "/manifest.json") << "{\"format\": \"troupe-checkpoint\", \"tens"; },
       StatusCode::kDataLoss,
       {"manifest.json", "not valid JSON"}},
  };
}

TEST_P(Damage, IsReportedByNameAndThePreviousCheckpointIsUsed) {
  const DamageCase c = damage_cases()[static_cast<size_t>(GetParam())];
  TempDir dir;
  const std::string run = dir.sub("run");
  save_step(run, 100, sample_tensors(1.0f));
  save_step(run, 200, sample_tensors(2.0f));
  const std::string newest = run + "/step_200";
  c.damage(newest);

  auto direct = CheckpointReader::open(newest, VerifyMode::kChecksums);
  ASSERT_FALSE(direct.ok()) << c.label;
  EXPECT_EQ(direct.status().code(), c.code) << c.label << ": " << direct.status();
  for (const std::string& word : c.must_mention) {
    EXPECT_NE(direct.status().message().find(word), std::string::npos)
        << c.label << ": '" << word << "' not in: " << direct.status();
  }
  auto r = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(r.ok()) << c.label << ": " << r.status();
  EXPECT_EQ((*r)->step(), 100) << c.label;
  ASSERT_EQ((*r)->skipped().size(), 1u);
  EXPECT_NE((*r)->skipped()[0].find("step_200"), std::string::npos) << (*r)->skipped()[0];
  for (const auto& [name, t] : sample_tensors(1.0f)) {
    auto got = (*r)->read_full(name);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(testing::bitwise_equal(*got, t)) << c.label << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, Damage, ::testing::Range(0, 5));

TEST(Checkpoint, ChecksumsAreCheckedOnReadEvenWithoutFullVerification) {
  TempDir dir;
  const std::string run = dir.sub("run");
  save_step(run, 1, sample_tensors(1.0f));
  auto m = CheckpointReader::open(run + "/step_1");
  const StoredSlice s = (*m)->manifest().tensors.at("embed.weight").slices.at(0);
  testing::flip_byte(run + "/step_1/" + s.file, static_cast<std::streamoff>(s.offset));
  auto r = CheckpointReader::open(run + "/step_1", VerifyMode::kStructure);  // sizes are fine
  ASSERT_TRUE(r.ok()) << r.status();
  auto got = (*r)->read("embed.weight", Slice{{0, 1}, {0, 8}});
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(got.status().message().find("'embed.weight'"), std::string::npos) << got.status();
  EXPECT_TRUE((*r)->read_full("layers.0.attn.wq").ok());  // other tensors are intact
}

TEST(Checkpoint, NoValidCheckpointIsNotFoundWithEveryReason) {
  TempDir dir;
  const std::string run = dir.sub("run");
  save_step(run, 1, sample_tensors(1.0f));
  fs::remove(run + "/step_1/manifest.json");
  auto r = CheckpointReader::open_latest_valid(run);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("step_1"), std::string::npos) << r.status();
  EXPECT_EQ(CheckpointReader::open_latest_valid(dir.sub("nothing")).status().code(), StatusCode::kNotFound);
}

TEST(Checkpoint, UnfinishedSaveIsIgnoredAndCannotBeCommitted) {
  TempDir dir;
  const std::string run = dir.sub("run");
  save_step(run, 1, sample_tensors(1.0f));
  // Rank 0 of a 2-rank save finishes; rank 1 never does.
  auto w = CheckpointWriter::create(WriterOptions{run, ParallelLayout{1, 2, 1}, 0});
  auto h = (*w)->save(2, entries_of(sample_tensors(2.0f)));
  ASSERT_TRUE(h->wait().ok());
  FinalizeOptions fo;
  fo.world_size = 2;
  auto f = finalize_checkpoint(run, 2, fo);
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("rank 1"), std::string::npos) << f.status();
  EXPECT_EQ(wait_for_parts(run, 2, 2, std::chrono::milliseconds(50)).code(), StatusCode::kDeadlineExceeded);
  // Retrying step 2: the old part must vanish the moment the new save starts, so that it
  // cannot pass for this attempt's "done" marker.
  {
    WriterOptions slow{run, ParallelLayout{1, 2, 1}, 0};
    slow.max_bytes_per_second = 2048;
    slow.write_chunk_bytes = 256;
    auto w2 = CheckpointWriter::create(slow);
    const std::string part = run + "/step_2.tmp/" + part_file_name(0);
    ASSERT_TRUE(fs::exists(part));
    auto h2 = (*w2)->save(2, entries_of(sample_tensors(2.0f)));
    ASSERT_TRUE(h2.ok());
    EXPECT_FALSE(fs::exists(part));
    ASSERT_TRUE(h2->wait().ok());
    EXPECT_TRUE(fs::exists(part));
  }
  EXPECT_FALSE(fs::exists(run + "/step_2"));
  auto r = CheckpointReader::open_latest_valid(run);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->step(), 1);
  // The next committed save clears the abandoned temporary directory.
  save_step(run, 3, sample_tensors(3.0f));
  EXPECT_FALSE(fs::exists(run + "/step_2.tmp"));
  EXPECT_EQ(finalize_checkpoint(run, 3, FinalizeOptions{}).status().code(), StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace troupe::checkpoint
